"""A greedy draft round (catch-up + k positions, one graph replay) against the GPU time of its forwards.

    python bench/draft_round.py --model DRAFT_DIR --batch 1 --k 4 [--dtype bfloat16] [--out round.json]
    python bench/draft_round.py --model DRAFT_DIR --batch 1 16 64 --catch-up 1 8 48 241   # after plain steps

Times `GreedyRounds.run` end to end (host packing, one replay, the [B, k] read-back) over many rounds,
and the GPU time of the same round's kernels from torch.profiler (the forwards, LM heads and argmaxes:
everything the round must compute). The ratio is what the host and launch overhead add. With
--catch-up N each row brings N pending tokens (the round after N - 1 plain steps of the target): the
first round of a speculative window, which the target waits for whole; --profile-table prints where its
host and GPU time go.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.distributed import init_tp
from draft_service.config import DraftConfig
from draft_service.runner import DraftRunner


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--catch-up", type=int, nargs="+", default=[1], help="pending tokens per row")
    ap.add_argument("--start", type=int, default=300, help="position of each row's first pending token")
    ap.add_argument("--profile-table", action="store_true", help="torch.profiler's top ops per shape")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    config = DraftConfig(model=args.model, device="cuda", dtype=args.dtype, max_batch_size=max(args.batch),
                         log_format="json", num_speculative_tokens=args.k)  # fmt: skip
    runner = DraftRunner(init_tp(1, 0, device=torch.device("cuda")), config)
    results = []
    for b, n in [(b, n) for n in args.catch_up for b in args.batch]:
        rows, starts = [[7] * n] * b, [args.start] * b

        def one(b: int = b, rows=rows, starts=starts) -> list[list[int]]:
            return runner.rounds.run(rows, starts, list(range(b)), args.k)[0]

        torch.cuda.synchronize()
        t0 = time.perf_counter()
        one()  # the shape's first round: a compile or capture here would be paid while serving
        first = time.perf_counter() - t0
        for _ in range(10):
            one()
        torch.cuda.synchronize()
        rounds = args.rounds if n <= 2 else max(10, args.rounds // 10)
        t0 = time.perf_counter()
        for _ in range(rounds):
            one()
        wall = (time.perf_counter() - t0) / rounds
        activities = [torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(20):
                one()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        gpu = sum(e.device_time for e in kernels if "Memcpy" not in e.name) / 20 / 1e6  # us -> s
        row = {"batch": b, "k": args.k, "catch_up": n, "first_ms": first * 1e3, "round_ms": wall * 1e3,
               "kernel_ms": gpu * 1e3, "ratio": wall / gpu}  # fmt: skip
        results.append(row)
        print(json.dumps(row), flush=True)
        if args.profile_table:
            for key in ("self_cpu_time_total", "self_device_time_total"):
                print(prof.key_averages().table(sort_by=key, row_limit=12), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"argv": sys.argv, "rows": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
