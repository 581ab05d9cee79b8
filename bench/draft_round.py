"""A greedy draft round (catch-up + k positions, one graph replay) against the GPU time of its forwards.

    python bench/draft_round.py --model DRAFT_DIR --batch 1 --k 4 [--dtype bfloat16] [--out round.json]

Times `GreedyRounds.run` end to end (host packing, one replay, the [B, k] read-back) over many rounds,
and the GPU time of the same round's kernels from torch.profiler (the forwards, LM heads and argmaxes:
everything the round must compute). The ratio is what the host and launch overhead add.
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
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    config = DraftConfig(model=args.model, device="cuda", dtype=args.dtype, max_batch_size=max(args.batch),
                         log_format="json", num_speculative_tokens=args.k)  # fmt: skip
    runner = DraftRunner(init_tp(1, 0, device=torch.device("cuda")), config)
    results = []
    for b in args.batch:

        def one(b: int = b) -> list[list[int]]:
            return runner.rounds.run([[7]] * b, [100] * b, list(range(b)), args.k)[0]

        for _ in range(10):
            one()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.rounds):
            one()
        wall = (time.perf_counter() - t0) / args.rounds
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                one()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        gpu = sum(e.device_time for e in kernels if "Memcpy" not in e.name) / 20 / 1e6  # us -> s
        row = {"batch": b, "k": args.k, "round_ms": wall * 1e3, "kernel_ms": gpu * 1e3, "ratio": wall / gpu}
        results.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"argv": sys.argv, "rows": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
