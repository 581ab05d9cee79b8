"""--stream-interval: the target's streamer sends a request's tokens once that many are ready (its first
token at once, its last with the final flush), through the real scheduler, streamer, StreamOut and event
loop (bench/host_path.py's harness: a simulated step, greedy, no draft); the streamed output is the same.
--stream-messages-per-step: at most that many messages a step, the longest-waiting requests first. A
step's tokens are handed to the streamer once the next step's forward is launched."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry

from bench.host_path import SimulatedDraft, SimulatedRunner, run
from common.metrics import ServiceMetrics
from common.tokenizer import Tokenizer
from target_service.config import TargetConfig
from target_service.detok import StreamDetokenizer
from target_service.request import Request
from target_service.streamer import Streamer


@pytest.mark.parametrize("interval", [1, 4, 7])
def test_stream_interval_sends_fewer_messages_and_the_same_tokens(interval):
    batch, steps = 3, 30
    plain = run(batch, steps, None, 0)
    chunked = run(batch, steps, None, 0, stream_interval=interval)
    assert chunked["outputs"] == plain["outputs"] and all(len(o) == steps for o in plain["outputs"])
    assert plain["messages"] == batch * steps  # one per token: a plain step emits one token per request
    # Per request: the first token alone, then one message per `interval` tokens, the rest at the end.
    assert chunked["messages"] == batch * (1 + math.ceil((steps - 1) / interval))


def test_stream_interval_flag_is_checked():
    with pytest.raises(ValueError, match="--stream-interval"):
        TargetConfig(model="m", stream_interval=0).validate()


def test_messages_per_step_bound_the_writes_and_keep_the_tokens():
    # 40 plain requests, 30 steps: unlimited, a message per request per step; at most 16 a step, the
    # first tokens all at once (time to first token), the rest at the end's flush, the same output.
    batch, steps, limit = 40, 30, 16
    free = run(batch, steps, None, 0, stream_messages_per_step=0)
    bounded = run(batch, steps, None, 0, stream_messages_per_step=limit)
    assert bounded["outputs"] == free["outputs"] and all(len(o) == steps for o in free["outputs"])
    assert free["messages"] == batch * steps
    assert (steps - 1) * limit < bounded["messages"] <= batch + (steps - 1) * limit + batch


def _requests(n: int, tokenizer=None, stops=()) -> list[Request]:
    return [
        Request(str(i), [1], 1000, 0.0, 0, 1.0, 0, 0, frozenset(), StreamDetokenizer(tokenizer, list(stops)))
        for i in range(n)
    ]


def _step(streamer: Streamer, reqs: list[Request], ids: list[list[int]], now: float) -> set[str]:
    """One step's tokens through the streamer; the ids of the requests it wrote to."""
    for r in reqs:
        r.out = r.request_id  # _outbox pairs (out, message): the request id stands in for its stream
    streamer._handle(("tokens", list(zip(reqs, ids)), now), [])
    sent = {out for out, _ in streamer._outbox}
    streamer._outbox.clear()
    return sent


def test_the_limit_serves_the_longest_waiting_first_and_never_holds_a_first_token_or_a_stop():
    streamer = Streamer(ServiceMetrics("target", "t", registry=CollectorRegistry()), lambda r: None, 1, 16)
    reqs = _requests(40)
    gaps, last = [], {}
    for step in range(12):
        sent = _step(streamer, reqs, [[100 + step]] * 40, now=1.0 + step)  # perf_counter times: never 0
        assert len(sent) == (40 if step == 0 else 16), step  # all first tokens, then the limit
        for rid in sent:
            if rid in last:
                gaps.append(step - last[rid])
            last[rid] = step
    assert max(gaps) == 3  # ceil(40 / 16): round robin by the age of the last message
    # A new request's first token goes out even when the step is over the limit, beside 16 others.
    newcomer = _requests(1)[0]
    newcomer.request_id = "new"
    assert "new" in _step(streamer, [*reqs, newcomer], [[7]] * 41, now=13.0)
    # A stop string that completes in a request not due by age is sent at once: nothing is flushed for a
    # request that ended on a stop string.
    stopper = _requests(1, Tokenizer(), ["END"])[0]
    stopper.request_id = "stopper"
    _step(streamer, [stopper], [[ord("a")]], now=13.5)  # its first token: sent, now the newest message
    sent = _step(streamer, [*reqs, stopper], [[100]] * 40 + [list(b"xEND")], now=14.0)
    assert "stopper" in sent and stopper.cancelled == "stop_string"
    assert len(sent) == 16


def test_stream_messages_per_step_flag_is_checked():
    with pytest.raises(ValueError, match="--stream-messages-per-step"):
        TargetConfig(model="m", stream_messages_per_step=-1).validate()


def test_a_steps_tokens_reach_the_streamer_once_the_next_step_is_launched(monkeypatch):
    # The streamer and event loop take the GIL while the GPU works, not while the scheduler prepares
    # the launch. First tokens and the last step's (the request finishes) are handed over at once.
    handed: list[int] = []  # tokens per hand-off to the streamer
    real_tokens = Streamer.tokens

    def tokens(self, items, now):
        handed.append(sum(len(new) for _, new in items))
        real_tokens(self, items, now)

    monkeypatch.setattr(Streamer, "tokens", tokens)

    seen: list[tuple[int, int]] = []  # hand-offs so far at each step's call, and once it launched

    class Recording(SimulatedRunner):
        def step(self, rows, width, on_launched=None, on_verified=None):
            before = len(handed)
            result = super().step(rows, width, on_launched, on_verified)
            seen.append((before, len(handed)))
            return result

    batch, steps = 2, 6
    out = run(batch, steps, None, 0, Recording())
    assert all(len(o) == steps for o in out["outputs"])
    # Step 1: nothing pending; its first tokens go at once. Steps 2..6: step n-1's tokens go at step n's
    # launch, except step 1's (already gone).
    assert seen == [(0, 0), (1, 1)] + [(n - 2, n - 1) for n in range(3, steps + 1)]
    assert handed == [batch] * steps  # the last step's at once (its requests finish)
    # Speculating against a draft that answers 2 ms after the ask: the scheduler waits for it before
    # each launch, and hands the last step's tokens over before that wait.
    seen.clear()
    handed.clear()
    out = run(batch, 3 * steps, None, 2, Recording(), SimulatedDraft(round_trip=0.002))
    assert all(len(o) == 3 * steps for o in out["outputs"])
    assert seen == [(n, n) for n in range(len(seen))] and len(handed) == len(seen) >= steps
