"""Profile one target verify step (forward + rejection kernel) on the GPU with torch.profiler.

    python bench/profile_step.py --model DIR --batch 1 --width 5 [--dtype bfloat16]

Prints the time per phase (host timers around synchronised phases) and the top kernels by GPU time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.distributed import init_tp
from common.kernels.rejection import verify
from target_service.config import TargetConfig
from target_service.runner import TargetRunner


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
    rows = [[1] * w for _ in range(b)]
    starts, slots = [100] * b, list(range(b))
    dev = runner.device
    extra = dict(
        num_draft_tokens=torch.full((b,), w - 1, dtype=torch.int32, device=dev),
        temperature=torch.zeros(b, device=dev),
        seeds=torch.arange(b, device=dev),
        positions=torch.full((b,), 101, device=dev),
    )
    draft = torch.ones(b, max(w - 1, 1), dtype=torch.int64, device=dev)[:, : w - 1]

    def step():
        logits = runner.verify_forward(rows, starts, slots, w)
        res = verify(logits, draft, **extra)
        return res.output_tokens.tolist()

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    times = {"forward (sync)": 0.0, "verify kernel (sync)": 0.0, "whole step": 0.0}
    for _ in range(args.steps):
        t0 = time.perf_counter()
        logits = runner.verify_forward(rows, starts, slots, w)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        verify(logits, draft, **extra).output_tokens.tolist()
        t2 = time.perf_counter()
        times["forward (sync)"] += t1 - t0
        times["verify kernel (sync)"] += t2 - t1
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    times["whole step"] = time.perf_counter() - t0
    print({k: f"{v / args.steps * 1e3:.3f} ms" for k, v in times.items()})
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        for _ in range(10):
            step()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=50))
    return 0


if __name__ == "__main__":
    sys.exit(main())
