"""GPU time of the 1.5B target's GEMMs at decode / verify row counts, per way of calling cuBLAS.

    python bench/gemm_sweep.py [--rows 1 5 16 80 320] [--out gemm.json]
    CUBLASLT_WORKSPACE_SIZE=65536 python bench/gemm_sweep.py --tag ws64m      # workspace is read at start

Each figure is one call's GPU time inside a CUDA graph that calls the GEMM 28 times on 28 weight copies
(as the 28 layers do, so no weight is read from L2), over 50 replays, median of 3. Variants:
  - linear: F.linear(x, W, b) as the model calls it (W [N, K], the nn.Linear layout);
  - linear_lt: the same with torch.backends.cuda.preferred_blas_library("cublaslt");
  - mm_t: x @ Wt with Wt = W.T stored contiguous ([K, N]), bias via addmm;
  - invariant: common/kernels/invariant.py's fixed-tile GEMM (--batch-invariant), with its time over the
    best cuBLAS variant's (`invariant_x_best`): what a row's independence of the batch costs.
The variant that wins per (shape, rows) shows which layout / library the model should use.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.cuda_graphs import capture
from common.kernels.invariant import invariant_linear

SHAPES = {  # name: (N, K, bias) of Qwen2.5-1.5B at TP=1
    "qkv": (2048, 1536, True),
    "o_proj": (1536, 1536, False),
    "gate_up": (17920, 1536, False),
    "down": (1536, 8960, False),
}
LAYERS = 28


def time_graph(fn, replays: int = 50) -> float:
    """GPU ms of one replay of a graph holding fn's kernels."""
    g, _, _ = capture(fn, torch.device("cuda"), None)
    for _ in range(5):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(3):
        start.record()
        for _ in range(replays):
            g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / replays)
    return statistics.median(times)


def layer_calls(x, weights, bias, transposed: bool = False):
    """One GEMM per layer's weight: F.linear on [N, K] weights, or addmm / mm on [K, N] ones."""

    def run():
        for w in weights:
            if not transposed:
                F.linear(x, w, bias)
            elif bias is not None:
                torch.addmm(bias, x, w)
            else:
                torch.mm(x, w)

    return run


def invariant_calls(x, weights, bias):
    """One batch-invariant GEMM per layer's weight."""

    def run():
        for w in weights:
            invariant_linear(x, w, bias)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 5, 16, 80, 320], help="rows per GEMM call")
    ap.add_argument("--tag", default="default", help="a label written into every row")
    ap.add_argument("--out", help="the raw JSON: one row per (GEMM, rows)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    results = []
    for name, (n, k, has_bias) in SHAPES.items():
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
        wts = [w.t().contiguous() for w in ws]
        b = torch.randn(n, device=dev, dtype=torch.bfloat16) if has_bias else None
        for m in args.rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)

            linear, mm_t = layer_calls(x, ws, b), layer_calls(x, wts, b, transposed=True)
            row = {"tag": args.tag, "gemm": name, "n": n, "k": k, "rows": m}
            for variant, fn, lib in (("linear", linear, "cublas"), ("linear_lt", linear, "cublaslt"),
                                     ("mm_t", mm_t, "cublas"), ("mm_t_lt", mm_t, "cublaslt")):  # fmt: skip
                torch.backends.cuda.preferred_blas_library(lib)
                ms = time_graph(fn)
                us = 1e3 * ms / LAYERS
                row[variant] = round(us, 3)
                row[variant + "_tbps"] = round(n * k * 2 / (us * 1e-6) / 1e12, 2)
            torch.backends.cuda.preferred_blas_library("cublas")
            best = min(("linear", "linear_lt", "mm_t", "mm_t_lt"), key=lambda v: row[v])
            row["best"] = best
            us = 1e3 * time_graph(invariant_calls(x, ws, b)) / LAYERS
            row["invariant"] = round(us, 3)
            row["invariant_x_best"] = round(us / row[best], 2)
            results.append(row)
            print(json.dumps(row), flush=True)
        del ws, wts
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
