"""The colocated B=64 bench on a simulated GPU: step costs by batch size and width from the H200 runs.

    python bench/sim_bench.py --batch 64 --tokens 384 --scale 4

One Scheduler per mode kept over a warm-up and --repeats runs (as bench_e2e's services are), each run B
greedy requests; verify(B, w) = plain(B) + per_position(B) (w - 1) and the draft's round trip(B),
interpolated in log B from the tenth session's colocated H200 figures, times --scale (so the host's own
time on this machine weighs as little as on the GPU machine's). Prints tokens/s per run and mode and,
with --traces DIR, writes each mode's step trace there.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import math
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prometheus_client import CollectorRegistry

from bench.host_path import SimulatedDraft, SimulatedRunner, submit
from common.metrics import ServiceMetrics
from target_service.config import TargetConfig
from target_service.scheduler import Scheduler

# batch -> ms, colocated H200, bf16 1.5B preset (docs/bench/colocated-h200-s10*.json, adaptive debug)
PLAIN = {1: 1.9, 4: 1.9, 16: 2.2, 64: 2.8}
PER_POSITION = {1: 0.05, 4: 0.08, 16: 0.15, 64: 0.46}
ROUND_TRIP = {1: 2.0, 4: 2.3, 16: 3.0, 64: 5.0}
# The draft's catch-up: each token it must append before drafting (starts' prompts, verdicts: after plain
# steps those hold every token since) costs this much more of its round (a guess: a 2-layer draft's
# prefill at ~1 M tokens/s; --catch-up-us) ...
CATCH_UP_US = 1.0
# ... and every step's GPU time is off by a lognormal factor of this sigma (--noise): contention on a
# shared GPU (the draft's rounds), clocks.
NOISE = 0.1


def at(table: dict[int, float], batch: int) -> float:
    keys = sorted(table)
    i = bisect.bisect_left(keys, batch)
    if i == 0:
        return table[keys[0]]
    if i == len(keys):
        return table[keys[-1]]
    lo, hi = keys[i - 1], keys[i]
    f = (math.log(batch) - math.log(lo)) / (math.log(hi) - math.log(lo))
    return table[lo] + f * (table[hi] - table[lo])


class BatchRunner(SimulatedRunner):
    def __init__(self, alpha: float, scale: float, noise: float):
        super().__init__(alpha)
        self.scale, self.noise = scale, noise

    def step(self, rows, width, on_launched=None, on_verified=None):
        b = len(rows)
        self.step_seconds = at(PLAIN, b) * self.scale * 1e-3 * self.rng.lognormvariate(0.0, self.noise)
        self.per_position = at(PER_POSITION, b) * self.scale * 1e-3
        return super().step(rows, width, on_launched, on_verified)


class BatchDraft(SimulatedDraft):
    def __init__(self, scale: float, catch_up_us: float):
        super().__init__()
        self.scale, self.catch_up_us = scale, catch_up_us
        self.pending = 0  # tokens told to the draft (starts, verdicts) since its last round

    def send(self, msg, epoch):
        told = [*(s.token_ids for s in msg.starts), *(v.token_ids for v in msg.verdicts)]
        self.pending += sum(len(ids) for ids in told)
        if not msg.propose:  # bookkeeping sent without an ask: the draft appends it with the next round
            return super().send(msg, epoch)
        ms = at(ROUND_TRIP, len(msg.propose)) + self.catch_up_us * 1e-3 * self.pending
        self.round_trip, self.pending = ms * self.scale * 1e-3, 0
        return super().send(msg, epoch)


def serve(mode: str, batch: int, tokens: int, repeats: int, args, trace: str) -> list:
    alpha, scale = args.alpha, args.scale
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    policy = "fixed" if mode in ("plain", "fixed") else "adaptive"
    config = TargetConfig(model="none", max_batch_size=batch, speculation_policy=policy, step_trace=trace)
    metrics = ServiceMetrics("target", "sim", registry=CollectorRegistry())
    runner = BatchRunner(alpha, scale, args.noise)
    draft = None if mode == "plain" else BatchDraft(scale, args.catch_up_us)
    sched = Scheduler(runner, config, metrics, draft, frozenset())
    sched.start()
    k = 0 if mode == "plain" else 4
    rates = []
    for n in [8] + [tokens] * repeats:  # a warm-up, then the runs
        streams = submit(sched, loop, [n] * batch, k, prefix=f"{n}-{len(rates)}-")
        t0 = time.perf_counter()
        got = sum(len(f.result(timeout=900)[0]) for f in streams)
        if n == tokens:
            rates.append(got / (time.perf_counter() - t0) * scale)
        time.sleep(0.1)
    sched.stop()
    loop.call_soon_threadsafe(loop.stop)
    return rates


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=384)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--alpha", type=float, default=0.8)
    ap.add_argument("--scale", type=float, default=4.0)
    ap.add_argument("--noise", type=float, default=NOISE)
    ap.add_argument("--catch-up-us", type=float, default=CATCH_UP_US)
    ap.add_argument("--modes", nargs="+", default=["plain", "fixed", "adaptive"])
    ap.add_argument("--traces", type=Path, default=None)
    args = ap.parse_args()
    for mode in args.modes:
        trace = ""
        if args.traces:
            args.traces.mkdir(parents=True, exist_ok=True)
            trace = str(args.traces / f"target-{mode}-steps.jsonl")
            Path(trace).unlink(missing_ok=True)
        rates = serve(mode, args.batch, args.tokens, args.repeats, args, trace)
        print(mode, "tok/s (GPU-time scale):", [round(r) for r in rates], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
