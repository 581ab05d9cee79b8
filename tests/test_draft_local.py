"""The draft in the target's own process (`--draft-local`, target_service/draft_local.py).

- Through real gRPC to a real target subprocess: output equals a target with no draft, token for token,
  with the draft's rounds chained to the verify (the default) or not, and drafts were made and
  accepted; the draft's metrics are on their own /metrics port (role=draft) and no draft message went
  over gRPC.
- Bad flags exit with status 2 and a message naming the flag, before or after the target's load.
- In process: proposals equal the draft model's own greedy continuation; a failing round ends the stream
  (plain decoding, as a lost connection), and the next stream (a new epoch) drafts again.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from prometheus_client import CollectorRegistry
from service_util import assert_same_tokens, generate_many, prompts, request, running, start_target

from common.distributed import init_tp
from common.loader import load_model
from common.metrics import ServiceMetrics
from common.models.generate import greedy_generate
from common.settings import parse_config
from draft_service.stream import DraftStream
from specsplit.launch import REPO, ServiceProcess
from specsplit.v1 import draft_pb2
from target_service import draft_local
from target_service.config import TargetConfig
from target_service.draft_local import LocalDraft, local_draft_config

pytestmark = pytest.mark.slow


def test_local_draft_is_lossless_and_speculates(demo_models, tmp_path):
    # A free metrics port, named in the log. No draft-ahead, as on a GPU the draft shares with the target
    # (on the CPU the draft cannot tell): its next rounds are chained to the verify instead.
    flags = f"--model {demo_models.draft} --metrics-port 0 --no-draft-ahead"
    local = start_target(demo_models.target, tmp_path, None, "--speculation-policy", "fixed",
                         "--draft-local", flags, name="local")  # fmt: skip
    unchained = start_target(demo_models.target, tmp_path, None, "--speculation-policy", "fixed",
                             "--draft-local", flags, "--no-draft-chain", name="unchained")  # fmt: skip
    plain = start_target(demo_models.target, tmp_path, None, name="plain")
    with running(local, unchained, plain):
        for t in (local, unchained, plain):
            t.wait_ready()
        ps = prompts(12, seed=3)
        spec = generate_many(local.address, [request(p, max_new_tokens=32) for p in ps], 4)
        ref = generate_many(plain.address, [request(p, max_new_tokens=32) for p in ps], 4)
        assert_same_tokens(spec, ref)
        other = generate_many(unchained.address, [request(p, max_new_tokens=32) for p in ps], 4)
        assert_same_tokens(other, ref)
        drafted = sum(r.usage.drafted_tokens for r in spec)
        accepted = sum(r.usage.accepted_tokens for r in spec)
        assert all(r.usage.drafted_tokens > 0 for r in spec), "every request should have been speculated"
        # The demo draft shares the target's first layer: acceptance well above chance.
        assert accepted / drafted > 0.3, (accepted, drafted)
        # The draft's own series, on its own port: every asked round ran there.
        port = int(re.search(r"draft in this process: .* metrics port (\d+)", local.log_text()).group(1))
        draft = ServiceProcess("draft_service", local.popen, 0, port, local.log)
        assert draft.metric("specsplit_draft_step_seconds_count", role="draft") > 0
        # Most rounds after the first of each request ran chained to the verify (--draft-chain, default).
        chained = draft.metric("specsplit_draft_chained_rows_total", role="draft")
        assert chained > len(ps), chained
        # Most steps drafted from the chained round without waiting for the draft's answer.
        pipelined = local.metric("specsplit_spec_pipelined_steps_total", role="target")
        steps = local.metric("specsplit_verify_step_seconds_count", role="target")
        assert pipelined > 0.5 * steps, (pipelined, steps)
        port = int(re.search(r"metrics port (\d+)", unchained.log_text()).group(1))
        other = ServiceProcess("draft_service", unchained.popen, 0, port, unchained.log)
        assert other.metric("specsplit_draft_chained_rows_total", role="draft") == 0
        assert unchained.metric("specsplit_spec_pipelined_steps_total", role="target") == 0
        assert draft.metric("specsplit_ready", role="draft") == 1
        assert local.metric("specsplit_draft_round_trip_seconds_count", role="target") > 0
        assert local.metric("specsplit_draft_connected") == 1
        # Nothing went over gRPC between the two: the message counters exist and stayed at zero.
        assert local.metric("specsplit_grpc_messages_total", kind="speculate_request") == 0
        assert local.metric("specsplit_grpc_messages_total", kind="generate_request") == len(ps)
    assert "draft in this process: draft (greedy-local-argmax" in local.log_text()


def _exit_of_target(demo_models, draft_flags: str, *extra: str) -> subprocess.CompletedProcess:
    """A target started with --draft-local `draft_flags` (DRAFT: the demo draft's directory) and `extra`."""
    flags = draft_flags.replace("DRAFT", str(demo_models.draft))
    cmd = [sys.executable, "-m", "target_service", "--model", str(demo_models.target), "--port", "0",
           "--metrics-port", "-1", "--draft-local", flags, *extra]  # fmt: skip
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "draft_flags, extra, message",
    [
        ("--model DRAFT", ["--draft-address", "127.0.0.1:1"], "give either --draft-local or --draft-address"),
        ("--model DRAFT", ["--tp-size", "2"], "--draft-local: needs --tp-size 1"),
        ("--model DRAFT --max-speculative-tokens 99", [], "--max-speculative-tokens: must be in [1, 64]"),
        ("--model DRAFT --no-such-flag", [], "unrecognized arguments: --no-such-flag"),
        ("--model /nonexistent/draft", [], "--draft-local: cannot load the draft model"),
    ],
)
def test_bad_local_draft_flags_exit_naming_the_flag(demo_models, draft_flags, extra, message):
    done = _exit_of_target(demo_models, draft_flags, *extra)
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stdout + done.stderr, done.stdout + done.stderr


def test_a_busy_draft_metrics_port_exits_naming_it(demo_models):
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = _exit_of_target(demo_models, f"--model DRAFT --metrics-port {port}")
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"--draft-local: --metrics-port {port}:" in done.stdout + done.stderr, done.stdout + done.stderr


def _local(demo_models, registry: CollectorRegistry, *flags: str) -> LocalDraft:
    draft = " ".join([f"--model {demo_models.draft} --metrics-port -1", *flags])
    target = parse_config(TargetConfig, ["--model", str(demo_models.target), "--draft-local", draft], "t")
    metrics = ServiceMetrics("target", "t", registry)
    return LocalDraft(local_draft_config(target), metrics, 512, [])


def _ask(step: int, rid: int, ids: list[int], k: int) -> draft_pb2.SpeculateRequest:
    msg = draft_pb2.SpeculateRequest(step=step, propose=[rid], propose_k=[k])
    msg.starts.add(request_id=rid, token_ids=ids, num_speculative_tokens=k)
    return msg


def test_local_draft_proposes_its_greedy_continuation_and_survives_a_failed_round(demo_models, monkeypatch):
    registry = CollectorRegistry()
    link = _local(demo_models, registry)
    link.start()
    try:
        ids = prompts(1, seed=7)[0]
        assert link.wait_connected(5) and link.epoch == 1
        model = load_model(demo_models.draft, init_tp(1, 0, device=torch.device("cpu")), device="cpu")
        expected = greedy_generate(model, [ids], 4)[0]
        assert link.send(_ask(1, 11, ids, 4), link.epoch)
        answer = link.receive(1, 1, time.perf_counter() + 30)
        assert answer is not None and list(answer.proposals[0].token_ids) == expected

        # A round that raises ends the stream: the waiting step gets no answer (it decodes plainly).
        real = DraftStream.handle
        calls = []

        def failing(self, msg, arrived, answer=True):
            calls.append(msg.step)
            if len(calls) == 1:
                raise RuntimeError("injected: the draft's round failed")
            return real(self, msg, arrived, answer)

        monkeypatch.setattr(DraftStream, "handle", failing)
        assert link.send(_ask(2, 12, ids, 4), 1)
        assert link.receive(2, 1, time.perf_counter() + 30) is None
        assert link.wait_connected(5) and link.epoch == 2
        assert not link.send(_ask(3, 13, ids, 4), 1), "a message of the dead stream's epoch is refused"
        # The new stream knows nothing: the target re-sends its requests, and they are drafted for.
        assert link.send(_ask(3, 11, ids, 4), 2)
        answer = link.receive(3, 2, time.perf_counter() + 30)
        assert answer is not None and list(answer.proposals[0].token_ids) == expected
        assert calls == [2, 3]
        assert link.draft.streams == 1
        labels = {"role": "target", "model": "t"}
        assert registry.get_sample_value("specsplit_draft_reconnects_total", labels) == 1
        assert registry.get_sample_value("specsplit_draft_connected", labels) == 1
    finally:
        link.close()


@contextmanager
def _proposed(demo_models) -> Iterator[tuple[LocalDraft, list[int], list[int]]]:
    """A running in-process draft (no draft-ahead) that has answered its first ask, for request 21:
    (the link, the request's tokens, its drafts)."""
    link = _local(demo_models, CollectorRegistry(), "--no-draft-ahead")
    link.start()
    try:
        ids = prompts(1, seed=9)[0]
        assert link.wait_connected(5)
        assert link.send(_ask(1, 21, ids, 4), link.epoch)
        answer = link.receive(1, link.epoch, time.perf_counter() + 30)
        yield link, ids, list(answer.proposals[0].token_ids)
    finally:
        link.close()


def test_a_chained_round_that_fails_to_launch_turns_chaining_off(demo_models, caplog):
    """A chained round that raises (a bug) must cost only the chaining: the request keeps no half-made
    chained round, its verdict then drafts as before, and no later step tries again."""
    with _proposed(demo_models) as (link, ids, drafts):
        assert link._stream is not None and not link._stream.ahead  # no draft-ahead: it would not chain
        bad = torch.zeros(1, 2, dtype=torch.int64)  # not [rows, width + 2] for a width of 5
        link.chain([(0, 21, drafts)], bad, len(drafts) + 1, link.epoch)
        assert not link.chaining and "no more chained rounds" in caplog.text
        assert link._stream.reqs[21].chained is None
        # The verdict drafts with a round of its own, as without chaining.
        verdict = draft_pb2.SpeculateRequest(step=2, propose=[21], propose_k=[4])
        verdict.verdicts.add(request_id=21, start=len(ids), token_ids=[*drafts[:1], (drafts[1] + 1) % 512])
        assert link.send(verdict, link.epoch)
        answer = link.receive(2, link.epoch, time.perf_counter() + 30)
        assert answer is not None and len(answer.proposals[0].token_ids) == 4


def _packed(emitted: list[int], width: int) -> torch.Tensor:
    """A one-row verify output: the emitted tokens, -1 past them, the accepted count, the emitted count."""
    return torch.tensor([[*emitted, *[-1] * (width - len(emitted)), len(emitted) - 1, len(emitted)]])


def test_a_held_ask_is_applied_at_the_next_chain_and_a_failure_ends_the_stream(demo_models, monkeypatch):
    """An ask the chained round answers (DraftSession reads its tokens from the round) is held back: the
    draft applies it when the target next chains (or sends, or waits for an answer), drops its
    answer, and the next chained round starts from the state it leaves. A held ask whose handling fails
    ends the stream, and the chained launch waiting for it returns at once (the target decodes on)."""
    monkeypatch.setattr(draft_local, "HOLD_SECONDS", 30.0)  # held until released, whatever the load
    with _proposed(demo_models) as (link, ids, drafts):
        emitted = [*drafts[:2], (drafts[2] + 1) % 512]  # two drafts accepted, then the target's token
        link.chain([(0, 21, drafts)], _packed(emitted, 5), 5, link.epoch)
        launched = link.take_chained(link.epoch)
        assert launched is not None and list(launched.index) == [21]
        assert link.take_chained(link.epoch) is None, "a round answers one ask"
        proposal = launched.tokens(21, 4)
        assert len(proposal) == 4

        held = draft_pb2.SpeculateRequest(step=2, propose=[21], propose_k=[4])
        held.verdicts.add(request_id=21, start=len(ids), token_ids=emitted)
        assert link.send(held, link.epoch, hold=True)
        time.sleep(0.2)
        assert link._handled_step == 1, "a held ask waits for the target's next call"
        req = link._stream.reqs[21]
        following = [proposal[0], (proposal[1] + 1) % 512]
        link.chain([(0, 21, proposal)], _packed(following, 5), 5, link.epoch)
        assert link._handled_step == 2 and req.committed == [*ids, *emitted]
        # The draft took the round as its proposal (no round of its own) and chained the next one from it.
        assert not link.draft.state.round_ran and link.take_chained(link.epoch) is not None
        assert link._recv_q.empty(), "a held ask's answer is dropped"

        answers = []

        def failing(self, msg, arrived, answer=True):
            answers.append(answer)
            raise RuntimeError("injected: the draft failed on a held ask")

        monkeypatch.setattr(DraftStream, "handle", failing)
        epoch = link.epoch
        held = draft_pb2.SpeculateRequest(step=3, propose=[21], propose_k=[4])
        held.verdicts.add(request_id=21, start=len(ids) + len(emitted), token_ids=following)
        assert link.send(held, epoch, hold=True)
        t0 = time.perf_counter()
        link.chain([(0, 21, following)], _packed([following[0]], 5), 5, epoch)
        assert time.perf_counter() - t0 < draft_local.HANDLED_SECONDS / 2
        assert answers == [False], "a held ask is handled without building its answer"
        assert link.take_chained(epoch) is None
        assert link.wait_connected(5) and link.epoch == epoch + 1, "a new stream after the failure"
