"""GPU time of `skinny.stream_linear` (a pipelined, optionally split-K Triton GEMM for few rows) against
cuBLAS and `skinny_linear`, per tile configuration, on the 1.5B target's GEMM shapes.

    python bench/stream_sweep.py [--rows 1 5 16 80] [--shapes gate_up down] --out sweep.jsonl

Each figure is one call's GPU time inside a CUDA graph that calls the GEMM 28 times on 28 weight copies
(as the layers do: no weight from L2), launched as the model launches them (PDL on Hopper), median of 3
x 50 replays (bench/gemm_sweep.py's `time_graph`). Each configuration also records its largest error
against an fp32 reference and whether row 0 of an 80-row call equals the same row computed alone, bit
for bit (a row's result must not depend on its batch).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gemm_sweep import LAYERS, SHAPES, time_graph
from common.kernels import skinny

SHAPES = {**SHAPES, "lm_head": (151936, 1536, False), "down7b": (3584, 18944, False)}


def configs(name: str, sweep: int) -> list[dict]:
    """Sweep 1 (first call): tiles at 16 rows a block. Sweep 2: the best of sweep 1 again, and 32-128
    rows a block for the 80-row verify of B=16. Sweep 3: the default tiles with other splits."""
    if sweep == 3:  # the default tiles (split_k None: the default rule) on a long K, and other splits
        grid = itertools.product((32, 64), (256,), (None, 6, 8, 16), (4,), (True,), (16,), (4,))
    elif sweep == 1:
        if name == "gate_up":
            grid = itertools.product((32, 64, 128), (128, 256), (1,), (3, 5), (False, True), (16,), (4,))
        elif name == "down":
            grid = itertools.product((32, 64), (128, 256), (2, 4, 7), (3, 5), (True,), (16,), (4,))
        elif name == "lm_head":
            grid = itertools.product((64, 128), (128, 256), (1,), (3,), (True,), (16,), (4,))
        else:  # qkv, o_proj
            grid = itertools.product((16, 32), (128, 256), (1, 2, 3), (3,), (True,), (16,), (4,))
    elif name == "down":
        grid = itertools.chain(
            itertools.product((32, 64), (256,), (4, 5, 7), (3, 4, 5), (True,), (16,), (4,)),
            itertools.product((64, 128), (128,), (1, 2, 4), (3,), (True,), (32, 64, 128), (4, 8)),
        )
    elif name == "gate_up":
        grid = itertools.product((64, 128), (64, 128), (1,), (3,), (False,), (32, 64, 128), (4, 8))
    else:  # qkv, o_proj
        grid = itertools.chain(
            itertools.product((32,), (256,), (3, 4), (3, 4), (True,), (16,), (4,)),
            itertools.product((32, 64), (128,), (1, 2, 3), (3,), (True,), (32, 64, 128), (4,)),
        )
    keys = ("block_n", "block_k", "split_k", "stages", "prefetch", "block_m", "warps")
    return [dict(zip(keys, c)) for c in grid]


def time_per_call(fn, ws, x, b, layers: int, **cfg) -> float:
    """us per call of fn(x, w, b, **cfg) over the layers' weight copies, one CUDA graph."""
    return 1e3 * time_graph(lambda: [fn(x, w, b, **cfg) for w in ws]) / layers


def sweep_shape(name: str, args, emit) -> None:
    n, k, has_bias = SHAPES[name]
    dev = torch.device("cuda")
    layers = 4 if name == "lm_head" else LAYERS
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
    b = torch.randn(n, device=dev, dtype=torch.bfloat16) if has_bias else None
    xs = {m: torch.randn(m, k, device=dev, dtype=torch.bfloat16) for m in args.rows}
    bf = b.float() if b is not None else None
    refs = {m: F.linear(xs[m].float(), ws[0].float(), bf) for m in args.rows}
    base = dict(gemm=name, n=n, k=k)
    for m in args.rows:
        us = time_per_call(F.linear, ws, xs[m], b, layers)
        emit(dict(base, kernel="cublas", rows=m, us=round(us, 3), tbps=round(n * k * 2 / us / 1e6, 2)))
        if skinny.fits(m, ws[0]):
            us = time_per_call(skinny.skinny_linear, ws, xs[m], b, layers)
            emit(dict(base, kernel="skinny", rows=m, us=round(us, 3), tbps=round(n * k * 2 / us / 1e6, 2)))
    for cfg in configs(name, args.sweep):
        t0 = time.time()
        try:
            invariant = same_as_16 = None
            if 80 in xs:
                among = skinny.stream_linear(xs[80], ws[0], b, **cfg)
                alone = skinny.stream_linear(xs[80][:1].contiguous(), ws[0], b, **cfg)
                invariant = bool(torch.equal(alone[0], among[0]))
                # the same rows from 16-row blocks (mma.sync) and from cfg's blocks (wgmma from 64)
                as16 = skinny.stream_linear(xs[80], ws[0], b, **{**cfg, "block_m": 16, "warps": 4})
                same_as_16 = bool(torch.equal(as16, among))
            for m in args.rows:
                if cfg["block_m"] > 16 and m < 80:
                    continue  # bigger row blocks are for the 80-row verify
                err = (skinny.stream_linear(xs[m], ws[0], b, **cfg).float() - refs[m]).abs().max().item()
                us = time_per_call(skinny.stream_linear, ws, xs[m], b, layers, **cfg)
                emit(dict(base, kernel="stream", rows=m, us=round(us, 3), tbps=round(n * k * 2 / us / 1e6, 2),
                          err=round(err, 5), invariant=invariant, same_as_16=same_as_16,
                          s=round(time.time() - t0, 1), **cfg))  # fmt: skip
        except Exception as e:  # a tile too large for shared memory: record and go on
            emit(dict(base, kernel="stream", error=f"{type(e).__name__}: {str(e)[:160]}", **cfg))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 5, 16, 80], help="rows per call")
    ap.add_argument(
        "--shapes", nargs="+", default=["gate_up", "down", "qkv", "o_proj"], help="GEMMs (SHAPES)"
    )
    ap.add_argument("--sweep", type=int, default=2, help="the tile grid: 1, 2 or 3 (see configs)")
    ap.add_argument("--out", required=True, help="raw results, one JSON line per configuration")
    args = ap.parse_args()
    torch.manual_seed(0)
    with open(args.out, "a") as f:

        def emit(row: dict) -> None:
            print(json.dumps(row), flush=True)
            f.write(json.dumps(row) + "\n")
            f.flush()

        for name in args.shapes:
            sweep_shape(name, args, emit)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
