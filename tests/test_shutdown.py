"""Stopping a TP=2 service (ranks spawned by the service, gloo on CPU) as Kubernetes does: SIGTERM under
load drains and exits 0 with every stream complete; a rank that dies takes the service down, non-zero,
with a log line naming the rank."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import grpc
import pytest
from service_util import (
    Load,
    generate_many,
    prompts,
    request,
    start_draft,
    start_target,
    stub_for,
    wait_for,
)

pytestmark = pytest.mark.slow

TP2 = ("--tp-size", "2")
NEW_TOKENS = 48
FAST = ("--verify-backend", "torch")  # the Triton interpreter's verify is slow on CPU; tested elsewhere


def spawned_ranks(pid: int) -> list[int]:
    """PIDs of the TP workers a service spawned (multiprocessing's spawn_main children)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def test_sigterm_at_tp2_drains_draft_and_target_and_exits_0(demo_models, tmp_path):
    """The draft is stopped mid-load (the target decodes plainly from then on), then the target: both
    exit 0, every stream ends OK with exactly the target's greedy tokens."""
    draft = start_draft(demo_models.draft, tmp_path, *TP2)
    target = start_target(demo_models.target, tmp_path, draft, *TP2, *FAST, "--drain-timeout", "60")
    draft.wait_ready()
    target.wait_ready()
    wait_for(lambda: target.metric("specsplit_draft_connected") == 1, 30, "the draft stream")
    channel, stub = stub_for(target)
    try:
        ps = prompts(4, seed=21)
        plain = generate_many(target.address, [request(p, max_new_tokens=NEW_TOKENS, k=0) for p in ps], 4)
        want = [r.ids for r in plain]

        load = Load(stub, ps, NEW_TOKENS)
        wait_for(load.started, 60, "every stream's first tokens")
        draft.signal(signal.SIGTERM)
        assert draft.popen.wait(60) == 0, draft.log_text()[-3000:]

        second = Load(stub, ps, NEW_TOKENS)
        wait_for(second.started, 60, "the second load's first tokens")
        target.signal(signal.SIGTERM)
        assert target.popen.wait(90) == 0, target.log_text()[-3000:]
        load.join()
        second.join()
        for run in (load, second):
            assert run.status == [grpc.StatusCode.OK] * len(ps)
            assert run.tokens == want
        for service in (draft, target):
            text = service.log_text()
            assert "INFO stopped" in text and "exited with code" not in text, text[-3000:]
    finally:
        channel.close()
        target.stop()
        draft.stop()


def test_a_killed_rank_stops_the_service_non_zero_naming_the_rank(demo_models, tmp_path):
    target = start_target(demo_models.target, tmp_path, None, *TP2, *FAST).wait_ready()
    channel, stub = stub_for(target)
    try:
        ranks = spawned_ranks(target.popen.pid)
        assert len(ranks) == 1, ranks
        load = Load(stub, prompts(2, seed=22), NEW_TOKENS)
        wait_for(load.started, 60, "first tokens")
        os.kill(ranks[0], signal.SIGKILL)
        assert target.popen.wait(30) == 3
        load.join()
        # The streams in flight end with a status (the connection drops), none hangs.
        assert all(s is not None and s != grpc.StatusCode.OK for s in load.status), load.status
        assert "TP worker tp-rank-1 exited with code -9; stopping the service" in target.log_text()
    finally:
        channel.close()
        target.stop()
