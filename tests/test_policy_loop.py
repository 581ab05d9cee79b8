"""The adaptive policy inside the real serving loop (Scheduler, DraftSession, streamer, event loop), with
the GPU step and the draft round trip simulated by sleeps: it must stop speculating where speculation
loses and keep speculating where it wins. The simulated costs are the ones measured on the H200 pair
(docs/benchmarks.md, TP=2 mode 1: a 2.63 ms plain step, +0.1 ms per verify position, a 3.1 ms draft
round trip)."""

from __future__ import annotations

import asyncio
import random
import threading
import time

from prometheus_client import CollectorRegistry

from common.aio_front import StreamOut
from common.metrics import ServiceMetrics
from specsplit.v1 import draft_pb2
from target_service.config import TargetConfig
from target_service.detok import StreamDetokenizer
from target_service.request import Request
from target_service.runner import StepResult
from target_service.scheduler import Scheduler

PLAIN_STEP, PER_POSITION, ROUND_TRIP = 2.63e-3, 0.1e-3, 3.1e-3


class SimulatedRunner:
    """Sleeps for the step's GPU time; each drafted token is accepted with probability `alpha`."""

    verify_backend = "simulated"
    max_context = 1 << 20

    def __init__(self, alpha: float, per_position: float):
        self.alpha, self.per_position = alpha, per_position
        self.rng = random.Random(0)
        self.batch_buckets = [1, 2, 4, 8]
        self.step_costs: dict = {}
        self.executor = self
        self.widths: list[int] = []

    def run(self, *_args, **_kwargs) -> None:  # prefill
        return None

    def step(self, rows, width: int) -> StepResult:
        self.widths.append(width)
        time.sleep(PLAIN_STEP + self.per_position * (width - 1))
        tokens, accepted = [], []
        for r in rows:
            a = 0
            while a < len(r.drafts) and self.rng.random() < self.alpha:
                a += 1
            tokens.append([*r.drafts[:a], 7])
            accepted.append(a)
        return StepResult(tokens, accepted, 0.0, None)


class SimulatedDraft:
    """A draft link whose answers arrive ROUND_TRIP seconds after the ask, through the wire format."""

    connected = True
    epoch = 1
    target_vocab_size = 1000
    info = None

    def __init__(self) -> None:
        self.asks: dict[int, tuple[float, bytes]] = {}

    def send(self, msg: draft_pb2.SpeculateRequest, epoch: int) -> bool:
        self.asks[msg.step] = (time.perf_counter(), msg.SerializeToString())
        return True

    def receive(self, step: int, epoch: int, deadline: float) -> draft_pb2.SpeculateResponse | None:
        sent, raw = self.asks.pop(step)
        time.sleep(max(0.0, ROUND_TRIP - (time.perf_counter() - sent)))
        msg = draft_pb2.SpeculateRequest.FromString(raw)
        response = draft_pb2.SpeculateResponse(step=step)
        for rid, k in zip(msg.propose, msg.propose_k):
            response.proposals.append(draft_pb2.Proposal(request_id=rid, token_ids=[5] * k))
        return draft_pb2.SpeculateResponse.FromString(response.SerializeToString())


def serve(alpha: float, per_position: float, tokens: int = 400) -> SimulatedRunner:
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    config = TargetConfig(model="simulated", max_batch_size=1, speculation_policy="adaptive")
    metrics = ServiceMetrics("target", "simulated", registry=CollectorRegistry())
    runner = SimulatedRunner(alpha, per_position)
    scheduler = Scheduler(runner, config, metrics, SimulatedDraft(), frozenset())
    out = StreamOut(loop, 1 << 20, lambda: None)

    async def drain() -> None:
        while await out.get() is not None:
            pass

    done = asyncio.run_coroutine_threadsafe(drain(), loop)
    req = Request("r", [1, 2, 3], tokens, 0.0, 0, 1.0, 0, 4, frozenset(), StreamDetokenizer(None))
    req.out = out
    scheduler.submit(req)
    scheduler.start()
    done.result(timeout=120)
    scheduler.stop()
    loop.call_soon_threadsafe(loop.stop)
    return runner


def test_adaptive_stops_speculating_where_it_loses():
    # alpha 0.36: a width-5 step yields 1.55 tokens for 3.03 ms + a 3.1 ms wait; a plain step 1 per 2.63 ms.
    runner = serve(alpha=0.36, per_position=PER_POSITION)
    speculative = sum(w > 1 for w in runner.widths)
    assert speculative <= 0.1 * len(runner.widths), (speculative, len(runner.widths))


def test_adaptive_keeps_speculating_where_it_wins():
    # alpha 0.9 and nearly free extra positions: k = 4 yields 4.1 tokens per 6.2 ms against 2.63 ms each.
    runner = serve(alpha=0.9, per_position=0.01e-3)
    speculative = sum(w > 1 for w in runner.widths)
    assert speculative >= 0.8 * len(runner.widths), (speculative, len(runner.widths))
