"""The few-row fused GEMMs (common/kernels/small_linear.py) against the unfused path they replace, and
their tile configs tuned, per (N, K, row bucket), on the GPU.

    python bench/small_linear.py --preset qwen1.5b --tp 1 --rows 5 80 --sweep --out small_linear.json

For each GEMM of a layer (qkv with add+RMSNorm in front, o_proj, gate_up with add+RMSNorm, down with
SiLU-and-mul) it captures one CUDA graph of `--layers` launches, each on its own copy of the weight (as
the model's layers: no weight stays in L2), and reports the GPU time per launch (200 replays, 3 repeats,
median): the unfused path (the norm / SiLU kernel + cuBLAS) and the fused kernel, with its default
config and, with --sweep, the best of a grid. The best configs are written under "configs" in the JSON,
which SPECSPLIT_SMALL_M_CONFIGS=<that file> makes the model use (then copied into small_linear.CONFIGS).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.profile_step import PRESETS
from common.kernels import fused
from common.kernels import small_linear as sl


def layer_gemms(preset: str, tp: int) -> list[tuple[str, int, int, int, bool]]:
    """(name, prologue, N, K, bias) of one layer's GEMMs on one rank."""
    p = PRESETS[preset]
    h, inter, nh, nkv = (
        p["hidden_size"],
        p["intermediate_size"],
        p["num_attention_heads"],
        p["num_key_value_heads"],
    )
    hd = h // nh
    qkv = (nh + 2 * nkv) * hd // tp
    return [
        ("qkv", sl.ADD_NORM, qkv, h, True),
        ("o_proj", sl.NONE, h, nh * hd // tp, False),
        ("gate_up", sl.ADD_NORM, 2 * inter // tp, h, False),
        ("down", sl.SILU, h, inter // tp, False),
    ]


def time_graph(fn, replays: int = 200, repeats: int = 3) -> float:
    """GPU ms of one replay of a graph capturing fn(), median of `repeats` runs of `replays` replays."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / replays)
    return statistics.median(times)


def bench_gemm(prologue: int, n: int, k: int, has_bias: bool, rows: int, layers: int, configs) -> dict:
    dev, dt = "cuda", torch.bfloat16
    xk = 2 * k if prologue == sl.SILU else k
    x = torch.randn(rows, xk, device=dev, dtype=dt)
    res = torch.randn(rows, k, device=dev, dtype=dt)
    nw = torch.ones(k, device=dev, dtype=dt)
    ws = [torch.randn(n, k, device=dev, dtype=dt) / k**0.5 for _ in range(layers)]
    b = torch.randn(n, device=dev, dtype=dt) if has_bias else None

    def unfused():
        for w in ws:
            if prologue == sl.ADD_NORM:
                h, _ = fused.add_rms_norm(x, res, nw, 1e-6)
            elif prologue == sl.SILU:
                h = fused.silu_and_mul(x)
            else:
                h = x
            F.linear(h, w, b)

    def fused_with(config):
        def run():
            sl.CONFIGS[(n, k, sl._block_m(rows))] = config
            for w in ws:
                sl._launch(x, res if prologue == sl.ADD_NORM else None, nw, 1e-6, w, b, prologue)

        return run

    base = time_graph(unfused) / layers * 1e3
    block_m = sl._block_m(rows)
    default = sl._default_config(block_m, n, k)
    out = {"rows": rows, "n": n, "k": k, "unfused_us": base}
    out["default_config"] = default
    out["default_us"] = time_graph(fused_with(default)) / layers * 1e3
    best = (out["default_us"], default)
    for config in configs(block_m, n, k):
        try:
            us = time_graph(fused_with(config)) / layers * 1e3
        except Exception as e:  # a tile that does not fit in shared memory: skip it
            print(f"  skip {config}: {type(e).__name__}", file=sys.stderr)
            continue
        best = min(best, (us, config))
    sl.CONFIGS.pop((n, k, block_m), None)
    out["best_us"], out["best_config"] = best
    out["weight_tb_s"] = n * k * 2 / (best[0] * 1e-6) / 1e12
    return out


def sweep(block_m: int, n: int, k: int):
    """The tile grid tried per shape (the widest at the two buckets the 1.5B bench runs: B=1 and B=16
    at width 5): (BLOCK_N, BLOCK_K, num_warps, num_stages)."""
    if block_m <= 16:
        grid = itertools.product((16, 32, 64), (128, 256, 512), (4,), (3, 4, 6))
    elif block_m < 128:
        grid = itertools.product((16, 32), (64, 128), (4,), (3, 4))
    else:
        grid = itertools.product((16, 32, 64), (64, 128), (4, 8), (3, 4))
    return list(grid)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen1.5b", choices=list(PRESETS))
    ap.add_argument("--tp", type=int, nargs="+", default=[1])
    ap.add_argument("--rows", type=int, nargs="+", default=[5, 20, 40, 80])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    results, configs = [], {}
    for tp in args.tp:
        for name, prologue, n, k, has_bias in layer_gemms(args.preset, tp):
            for rows in args.rows:
                r = bench_gemm(
                    prologue, n, k, has_bias, rows, args.layers, sweep if args.sweep else lambda *a: []
                )
                r.update(name=name, tp=tp)
                results.append(r)
                block_m = sl._block_m(rows)
                faster = r["best_us"] < r["unfused_us"]
                configs[f"{n},{k},{block_m}"] = list(r["best_config"]) if faster else None
                print(f"tp={tp} {name} rows={rows} N={n} K={k}: unfused {r['unfused_us']:6.2f} us, "
                      f"fused default {r['default_us']:6.2f}, best {r['best_us']:6.2f} {r['best_config']} "
                      f"({r['weight_tb_s']:.2f} TB/s)", flush=True)  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps({"argv": sys.argv, "device": torch.cuda.get_device_name(),
                                        "results": results, "configs": configs}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
