"""Profile one target verify step (forward + rejection kernel, one graph replay) with torch.profiler.

    python bench/profile_step.py --model DIR --batch 1 --width 5 [--dtype bfloat16]

Prints the wall and GPU time of the step and the top kernels by GPU time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.distributed import init_tp
from target_service.config import TargetConfig
from target_service.runner import StepRow, TargetRunner


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--width", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()
    config = TargetConfig(
        model=args.model,
        device="cuda",
        dtype=args.dtype,
        max_batch_size=16,
        log_format="json",  # no progress bar
        num_speculative_tokens=args.width - 1,
    )
    runner = TargetRunner(init_tp(1, 0, device=torch.device("cuda")), config)
    b, w = args.batch, args.width
    # Rows that accept nothing: the step's shape is what matters here, not the tokens.
    rows = [StepRow(1, [1] * (w - 1), 100, slot, 0.0, slot) for slot in range(b)]

    def step():
        return runner.step(rows, w)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    gpu = 0.0
    t0 = time.perf_counter()
    for _ in range(args.steps):
        gpu += step().gpu_seconds
    wall = time.perf_counter() - t0
    print(f"whole step (forward + rejection kernel, one replay): {wall / args.steps * 1e3:.3f} ms wall, "
          f"{gpu / args.steps * 1e3:.3f} ms GPU")  # fmt: skip
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        for _ in range(10):
            step()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=50))
    return 0


if __name__ == "__main__":
    sys.exit(main())
