"""The adaptive policy and its speculation gate on given step costs, no GPU: how often they leave the best
k (plain windows, refreshes of rival k's) and what that costs in throughput.

    python bench/gate_sim.py --batch 64 --step-ms 3.0 5.5 6.0 6.4 6.5 --alpha 0.8 --early-loss 0.7 0.75

One batch of --batch requests at per-token acceptance --alpha decodes --steps steps; a step at k takes
--step-ms[k] times a lognormal factor of sigma --noise and emits the policy's expected tokens. Each step's
k, tokens and time go back to the policy and its gate as the target's scheduler reports them. Prints, per
--early-loss value (target_service.gate.GateConfig.early_loss) and over --seeds runs: the share of steps at
each k, the lengths of the plain windows of the first noiseless run, and tokens per second. The default costs
are the nineteenth session's B=64 step traces on one H200 (docs/benchmarks.md, issue 10). Only the
policy is simulated here, not the scheduler, its draft or its tail of finishing requests: for those,
bench/sim_bench.py runs the whole serving loop on a simulated GPU.
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.cuda_graphs import buckets
from target_service.detok import StreamDetokenizer
from target_service.gate import SPECULATION_GATE
from target_service.policy import SpeculationPolicy
from target_service.request import Request
from target_service.step_costs import StepCosts

BUCKETS = buckets(64)  # the target's batch buckets at --max-batch-size 64


def run(args, seed: int, noise: float, early_loss: float) -> tuple[list[int], float]:
    """The k of every step and the tokens per second of one run."""
    rnd = random.Random(seed)
    step_s = [ms * 1e-3 for ms in args.step_ms]
    max_k = len(step_s) - 1  # every request's k
    costs = StepCosts(BUCKETS)
    for k, seconds in enumerate(step_s):  # every k timed once before (the service's start-up and warm-up)
        costs.observe_step(args.batch, k, seconds, verify=seconds, draft_wait=0.0)
    policy = SpeculationPolicy(
        "adaptive", costs, gate_config=replace(SPECULATION_GATE, early_loss=early_loss)
    )
    batch = []
    for i in range(args.batch):
        r = Request(str(i), [1], 8, 0.0, 0, 1.0, 0, max_k, frozenset(), StreamDetokenizer(None))
        r.spec.successes, r.spec.trials = args.alpha * 200, 200.0  # a long history at --alpha
        batch.append(r)
    chosen, tokens, seconds = [], 0.0, 0.0
    for _ in range(args.steps):
        k = policy.choose(batch)
        chosen.append(k)
        step = step_s[k] * (rnd.lognormvariate(0.0, noise) if noise else 1.0)
        emitted = policy.batch_tokens(batch, max_k)[k]
        tokens, seconds = tokens + emitted, seconds + step
        costs.observe_step(args.batch, k, step, verify=step, draft_wait=0.0)
        policy.observe_step(args.batch, round(emitted), step)
    return chosen, tokens / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--step-ms", type=float, nargs="+", default=[3.0, 5.5, 6.0, 6.4, 6.5],
                    help="whole step ms at k = 0, 1, ... (the last is the requests' k)")  # fmt: skip
    ap.add_argument("--alpha", type=float, default=0.8)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--noise", type=float, default=0.08)
    ap.add_argument("--seeds", type=int, default=30)
    ap.add_argument("--early-loss", type=float, nargs="+", default=[SPECULATION_GATE.early_loss])
    args = ap.parse_args()
    if args.batch not in BUCKETS or len(args.step_ms) < 2:
        ap.error("--batch must be one of 1, 2, 4, ..., 64 and --step-ms needs k = 0 and at least k = 1")
    for early_loss in args.early_loss:
        quiet, _ = run(args, 0, 0.0, early_loss)
        plain_windows = [len(m) for m in re.findall("0+", "".join(str(min(k, 1)) for k in quiet))]
        runs = [run(args, seed, args.noise, early_loss) for seed in range(args.seeds)]
        share = {k: statistics.mean(c.count(k) / len(c) for c, _ in runs) for k in range(len(args.step_ms))}
        rates = [rate for _, rate in runs]
        at_k = " ".join(f"{k}:{s:.3f}" for k, s in share.items())
        print(f"early_loss {early_loss}: steps at k {at_k}; plain windows (noiseless run) {plain_windows}; "
              f"tok/s median {statistics.median(rates):.0f} [{min(rates):.0f}-{max(rates):.0f}]")  # fmt: skip


if __name__ == "__main__":
    main()
