"""No draft-ahead for a target on the draft's own GPU. The target names the GPUs of its TP group (UUIDs) on
a stream's first message; a draft that runs on one of them drafts no round ahead for that stream (there a
round overlaps nothing and only delays the target's verify), unless --draft-ahead-shared-gpu. Real gRPC
to the real DraftServicer over a tiny CPU draft whose GPU list the test gives (a CPU draft runs on none);
and the target's DraftLink names its GPUs on the first message of each stream only."""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent import futures
from contextlib import contextmanager

import grpc
import pytest
import torch
from prometheus_client import CollectorRegistry

from common.distributed import init_tp
from common.kv_cache import SlotTable
from common.metrics import ServiceMetrics
from common.tp_executor import tp_gpu_uuids
from draft_service.config import DraftConfig
from draft_service.runner import DraftRunner
from draft_service.server import DraftServicer
from draft_service.state import DraftState
from specsplit.v1 import draft_pb2, draft_pb2_grpc
from target_service.draft_link import DraftLink
from tests.tiny import make_tiny_model

VOCAB = 512
K = 3
ROUNDS = 8
PROMPT = [5, 17, 42, 8, 99, 23, 7, 61]
DRAFT_GPU = "GPU-0d1a3c6e-0000-4000-8000-000000000001"  # the draft's, as the test gives it
OTHER_GPU = "GPU-0d1a3c6e-0000-4000-8000-000000000002"


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> DraftRunner:
    path = make_tiny_model(tmp_path_factory.mktemp("ahead") / "draft", vocab_size=VOCAB, seed=3)
    config = DraftConfig(model=str(path), max_batch_size=4, num_speculative_tokens=K)
    return DraftRunner(init_tp(1, 0, device=torch.device("cpu")), config)


@contextmanager
def draft(runner: DraftRunner, gpus: list[str], **flags):
    """The draft service on a free port, over `runner`, running on `gpus`; yields its stub. Draft-ahead
    never pauses for a low hit rate here (min hit rate 0), so that every round with a proposal drafts
    ahead unless the shared GPU stops it."""
    config = DraftConfig(model=runner.config.model, max_batch_size=4, draft_ahead_min_hit_rate=0.0, **flags)
    state = DraftState(runner, SlotTable(config.max_batch_size))
    metrics = ServiceMetrics("draft", "tiny", registry=CollectorRegistry())
    servicer = DraftServicer(config, state, metrics, "tiny", VOCAB, 1, False, gpus=gpus)
    server = grpc.server(futures.ThreadPoolExecutor(4))
    draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield draft_pb2_grpc.DraftServiceStub(channel)
    finally:
        channel.close()
        server.stop(grace=0).wait()


def ahead_rounds(stub, target_gpus: list[str], want_branches: bool = False) -> int:
    """One stream as a target runs it: a request, then ROUNDS verdicts that accept all k drafted tokens
    plus a bonus token. Returns how many of those verdicts met a round drafted ahead (hits and misses)."""
    before = stub.GetDraftInfo(draft_pb2.GetDraftInfoRequest())
    send: queue.SimpleQueue = queue.SimpleQueue()
    responses = stub.Speculate(iter(send.get, None), timeout=60)
    committed = list(PROMPT)
    start = draft_pb2.DraftRequestStart(request_id=1, token_ids=committed, num_speculative_tokens=K)
    send.put(draft_pb2.SpeculateRequest(step=0, starts=[start], propose=[1], target_vocab_size=VOCAB,
                                        target_gpus=target_gpus, want_branches=want_branches))  # fmt: skip
    for step in range(1, ROUNDS + 1):
        answer = next(r for r in responses if not r.branches)  # branches messages: not an answer
        (proposal,) = answer.proposals
        assert len(proposal.token_ids) == K
        appended = [*proposal.token_ids, (7 * step) % VOCAB]
        verdict = draft_pb2.Verdict(request_id=1, start=len(committed), token_ids=appended, accepted=K)
        send.put(draft_pb2.SpeculateRequest(step=step, verdicts=[verdict], propose=[1],
                                            want_branches=want_branches))  # fmt: skip
        committed += appended
    next(r for r in responses if not r.branches)
    send.put(None)
    for _ in responses:  # the stream ends once the draft has read the end of the requests
        pass
    after = stub.GetDraftInfo(draft_pb2.GetDraftInfoRequest())
    return (after.draft_ahead_hits - before.draft_ahead_hits) + (
        after.draft_ahead_misses - before.draft_ahead_misses
    )


@pytest.mark.parametrize("want_branches", [False, True], ids=["single-guess", "branches"])
def test_no_draft_ahead_for_a_target_on_the_drafts_gpu(runner, caplog, want_branches):
    with draft(runner, [DRAFT_GPU]) as stub, caplog.at_level(logging.INFO, logger="specsplit.draft"):
        assert ahead_rounds(stub, [OTHER_GPU, DRAFT_GPU], want_branches) == 0
        shared = [r for r in caplog.records if "no draft-ahead for this stream" in r.getMessage()]
        assert len(shared) == 1 and DRAFT_GPU in shared[0].getMessage()
        # The same draft drafts ahead in every round for a target elsewhere, or one that names no GPU (CPU).
        assert ahead_rounds(stub, [OTHER_GPU], want_branches) == ROUNDS
        assert ahead_rounds(stub, [], want_branches) == ROUNDS
        assert len([r for r in caplog.records if "shares GPU" in r.getMessage()]) == 1


def test_draft_ahead_on_a_shared_gpu_when_asked(runner, caplog):
    with draft(runner, [DRAFT_GPU], draft_ahead_shared_gpu=True) as stub:
        with caplog.at_level(logging.INFO, logger="specsplit.draft"):
            assert ahead_rounds(stub, [DRAFT_GPU]) == ROUNDS
        assert any("draft-ahead anyway" in r.getMessage() for r in caplog.records)
    # --no-draft-ahead still wins over it.
    with draft(runner, [DRAFT_GPU], draft_ahead_shared_gpu=True, draft_ahead=False) as stub:
        assert ahead_rounds(stub, [OTHER_GPU]) == 0


def test_a_cpu_service_runs_on_no_gpu():
    assert tp_gpu_uuids("cpu", 2) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_uuids_name_the_tp_ranks_devices():
    count = torch.cuda.device_count()
    uuids = tp_gpu_uuids("cuda", count)
    assert len(uuids) == count == len(set(uuids))
    assert uuids[0] == str(torch.cuda.get_device_properties(0).uuid)
    assert tp_gpu_uuids("cuda", count + 1) == uuids  # never more than the visible devices


class RecordingDraft(draft_pb2_grpc.DraftServiceServicer):
    """Records every Speculate message and answers it; ends the first stream after two messages."""

    def __init__(self):
        self.streams: list[list[draft_pb2.SpeculateRequest]] = []
        self.lock = threading.Lock()

    def GetDraftInfo(self, request, context):
        return draft_pb2.GetDraftInfoResponse(model="rec", vocab_size=VOCAB, tp_size=1, method="greedy")

    def Speculate(self, request_iterator, context):
        with self.lock:
            got: list[draft_pb2.SpeculateRequest] = []
            self.streams.append(got)
            first_stream = len(self.streams) == 1
        for msg in request_iterator:
            got.append(msg)
            yield draft_pb2.SpeculateResponse(step=msg.step)
            if first_stream and len(got) == 2:
                return


def exchange(link: DraftLink, step: int) -> None:
    assert link.send(draft_pb2.SpeculateRequest(step=step, propose=[1]), link.epoch)
    assert link.receive(step, link.epoch, time.perf_counter() + 10) is not None


def test_the_target_names_its_gpus_on_the_first_message_of_each_stream():
    recorder = RecordingDraft()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    draft_pb2_grpc.add_DraftServiceServicer_to_server(recorder, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    gpus = [OTHER_GPU, DRAFT_GPU]
    link = DraftLink(f"127.0.0.1:{port}", ServiceMetrics("target", "t", registry=CollectorRegistry()), VOCAB,
                     backoff_max=0.1, target_gpus=gpus)  # fmt: skip
    link.start()
    try:
        assert link.wait_connected(10)
        exchange(link, 1)
        exchange(link, 2)  # the draft ends this stream after it: the link reconnects, a new epoch
        deadline = time.monotonic() + 10
        while not (link.epoch == 2 and link.connected) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert link.epoch == 2 and link.connected
        exchange(link, 3)
        exchange(link, 4)
    finally:
        link.close()
        server.stop(grace=0).wait()
    first, second = recorder.streams
    assert [list(m.target_gpus) for m in first] == [gpus, []]
    assert [list(m.target_gpus) for m in second] == [gpus, []]
    assert [m.target_vocab_size for m in first + second] == [VOCAB, 0, VOCAB, 0]
