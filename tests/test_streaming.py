"""--stream-interval: the target's streamer sends a request's tokens once that many are ready (its first
token at once, its last with the final flush), through the real scheduler, streamer, StreamOut and event
loop (bench/host_path.py's harness: a simulated step, greedy, no draft); the streamed output is the same."""

from __future__ import annotations

import math

import pytest

from bench.host_path import run
from target_service.config import TargetConfig


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
