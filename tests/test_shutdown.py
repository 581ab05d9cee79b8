"""Stopping a TP=2 service (gloo on CPU) as Kubernetes does, by both launch paths (ranks spawned by the
service, ranks started by torchrun): SIGTERM under load drains and every rank exits 0 with every stream
complete; a rank that dies takes the service down, non-zero, with a log line naming the rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
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

from specsplit.launch import ServiceProcess, free_port

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


def test_sigterm_to_torchrun_under_load_drains_every_rank(demo_models, tmp_path):
    """The LeaderWorkerSet example's path: torchrun starts the ranks (common/graceful_torchrun.py hands
    SIGTERM to them, not to torchrun's agent, which would re-raise it). Rank 0 drains, every stream ends OK
    with exact tokens, no rank fails, and the whole launch exits 0."""
    port, metrics_port = free_port(), free_port()
    log = tmp_path / "torchrun-target.log"
    cmd = [sys.executable, "-m", "common.graceful_torchrun", "--nproc-per-node", "2", "--master-port",
           str(free_port()), "-m", "target_service", "--model", str(demo_models.target), *TP2, *FAST,
           "--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(metrics_port)]  # fmt: skip
    with open(log, "wb") as out:
        popen = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=os.environ | {"PYTHONUNBUFFERED": "1"}
        )
    target = ServiceProcess("target_service", popen, port, metrics_port, log).wait_ready()
    channel, stub = stub_for(target)
    try:
        ps = prompts(3, seed=23)
        plain = generate_many(target.address, [request(p, max_new_tokens=NEW_TOKENS, k=0) for p in ps], 3)
        load = Load(stub, ps, NEW_TOKENS)
        wait_for(load.started, 60, "every stream's first tokens")
        target.signal(signal.SIGTERM)
        load.join()
        assert popen.wait(60) == 0
        assert load.status == [grpc.StatusCode.OK] * len(ps)
        assert load.tokens == [r.ids for r in plain]
        text = target.log_text()
        assert "target INFO received SIGTERM: draining" in text and "target INFO stopped" in text, text[
            -3000:
        ]
        # A rank that failed would be reported by the agent (ChildFailedError, with its exit code).
        assert "ChildFailedError" not in text and "exitcode" not in text, text[-3000:]
    finally:
        channel.close()
        target.stop()
