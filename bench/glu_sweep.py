"""GPU time of the MLP's gate_up GEMM with SiLU-and-mul in its epilogue (`skinny.stream_linear(glu=True)`)
against what the model runs without it (cuBLAS gate_up, then the `fused.silu_and_mul` kernel), per tile
configuration, on the 1.5B target's shape (gate_up 17920 x 1536).

    python bench/glu_sweep.py [--rows 1 5 16 80] --out glu-sweep.jsonl
    python bench/glu_sweep.py --wide --rows 20 32 80 --out glu-wide.jsonl   (row blocks of 32-128: warps,
        stages and wider N tiles too; each row count only with the row block the model gives it)

Each figure is one call's GPU time inside a CUDA graph of 28 calls on 28 weight copies (as the layers do;
PDL launches on Hopper), median of 3 x 50 replays (bench/gemm_sweep.py's `time_graph`). Each
configuration also records, at the largest row count, whether its output equals the unfused pair's at
that row count bit for bit (`same_as_cublas`), whether row 0 equals the row alone (`invariant`), and
whether 16-row blocks give the same bits (`same_as_16`). The model serves up to SPECSPLIT_GLU_MAX_ROWS
rows with it (common/kernels/skinny.py, default 16); the whole forward with another limit:
`SPECSPLIT_GLU_MAX_ROWS=N bench/device.sh profile`.
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
from common.kernels import fused, skinny


def unfused(x, w):
    return fused.silu_and_mul(F.linear(x, w))


def glu(x, w, **cfg):
    return skinny.stream_linear(x, w, glu=True, **cfg)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 5, 16, 80], help="rows per call")
    ap.add_argument("--out", required=True, help="raw results, one JSON line per configuration")
    ap.add_argument("--wide", action="store_true", help="the grid for 32-128-row blocks")
    args = ap.parse_args()
    torch.manual_seed(0)
    n, k, _ = SHAPES["gate_up"]
    dev = torch.device("cuda")
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
    xs = {m: torch.randn(m, k, device=dev, dtype=torch.bfloat16) for m in args.rows}
    base = dict(gemm="gate_up+silu", n=n, k=k)
    with open(args.out, "a") as f:

        def emit(row: dict) -> None:
            print(json.dumps(row), flush=True)
            f.write(json.dumps(row) + "\n")
            f.flush()

        def per_call(fn, x, **cfg) -> float:
            return 1e3 * time_graph(lambda: [fn(x, w, **cfg) for w in ws]) / LAYERS

        for m in args.rows:
            emit(dict(base, kernel="cublas+silu_and_mul", rows=m, us=round(per_call(unfused, xs[m]), 3)))
        grid = itertools.product((32, 64), (64, 128, 256), (4,), (16, 64, 128), (4,))  # ~18 compiles
        if args.wide:  # ~60 compiles: each row count's own block (more warps for its dot, fewer stages
            # for two programs an SM: at 80 rows 140-280 programs share 132 SMs)
            blocks = sorted({skinny._row_block(m) for m in args.rows})
            grid = [
                (bn, bk, stages, bm, warps)
                for bm in blocks
                for bn in (32, 64, 128)
                for bk in ((64, 128) if bm < 128 else (32, 64))
                for stages in (2, 3, 4)
                for warps in (4, 8)
                if not (bn == 128 and warps == 4)
            ]
        for bn, bk, stages, bm, warps in grid:
            cfg = dict(block_n=bn, block_k=bk, stages=stages, block_m=bm, warps=warps)
            t0 = time.time()
            try:
                big = max(args.rows)
                among = glu(xs[big], ws[0], **cfg)
                checks = dict(
                    same_as_cublas=bool(torch.equal(among, unfused(xs[big], ws[0]))),
                    invariant=bool(torch.equal(glu(xs[big][:1].contiguous(), ws[0], **cfg)[0], among[0])),
                    same_as_16=bool(torch.equal(glu(xs[big], ws[0], **{**cfg, "block_m": 16}), among)),
                )
                for m in args.rows:
                    if bm > skinny._row_block(m) or (args.wide and bm != skinny._row_block(m)):
                        continue  # the model would serve these rows with another block
                    us = round(per_call(glu, xs[m], **cfg), 3)
                    took = round(time.time() - t0, 1)
                    emit(dict(base, kernel="stream_glu", rows=m, us=us, s=took, **checks, **cfg))
            except Exception as e:  # a tile too large for shared memory: record and go on
                emit(dict(base, kernel="stream_glu", error=f"{type(e).__name__}: {str(e)[:160]}", **cfg))


if __name__ == "__main__":
    main()
