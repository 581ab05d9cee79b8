"""Two targets share a pool of two draft services over real gRPC; one draft is killed mid-generation.

Each target gets `--draft-address A,B`: one Speculate stream per draft, each request placed on the
draft with the most free KV slots and kept there. Greedy output must equal plain decoding exactly
throughout; both drafts must have drafted for both targets; after draft A is SIGKILLed in the middle
of a burst, every request still completes losslessly, and the requests after it are drafted (by B
alone): losing A cost only A's requests their drafts, and only until they started again on B.
"""

from __future__ import annotations

import threading

import grpc
import pytest

from specsplit.v1 import draft_pb2, draft_pb2_grpc
from tests.service_util import (
    Result,
    generate,
    prompts,
    request,
    start_draft,
    start_target,
    stub_for,
    wait_for,
)

pytestmark = pytest.mark.slow
N, NEW_TOKENS = 3, 32


def draft_tokens(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        info = draft_pb2_grpc.DraftServiceStub(channel).GetDraftInfo(
            draft_pb2.GetDraftInfoRequest(), timeout=10
        )
    return info.draft_tokens


def run_all(stubs, reqs) -> list[Result]:
    """Every request on every target at once (one thread each)."""
    results: dict[tuple[int, int], Result] = {}

    def one(t: int, i: int) -> None:
        results[t, i] = generate(stubs[t], reqs[i])

    threads = [threading.Thread(target=one, args=(t, i)) for t in range(len(stubs)) for i in range(len(reqs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert len(results) == len(threads), "a request did not finish"
    return [results[t, i] for t in range(len(stubs)) for i in range(len(reqs))]


def test_two_targets_share_two_drafts_and_survive_losing_one(demo_models, tmp_path):
    drafts = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        drafts.append(start_draft(demo_models.draft, tmp_path / name))
    targets, channels = [], []
    try:
        for d in drafts:
            d.wait_ready()
        pool = ",".join(d.address for d in drafts)
        for name in ("t1", "t2"):
            targets.append(
                # The torch verify path: this test is about the pool, not the kernels (tested elsewhere).
                start_target(
                    demo_models.target,
                    tmp_path,
                    pool,
                    "--draft-backoff-max",
                    "0.5",
                    "--verify-backend",
                    "torch",
                    name=name,
                )
            )
        for t in targets:
            t.wait_ready()
            wait_for(lambda t=t: t.metric("specsplit_draft_replicas_connected") == 2, 60, "both streams")
        channels, stubs = zip(*(stub_for(t) for t in targets), strict=True)
        ids = prompts(N, seed=21)
        want = [generate(stubs[0], request(p, max_new_tokens=NEW_TOKENS, k=0)).ids for p in ids]
        spec = [request(p, max_new_tokens=NEW_TOKENS, k=4) for p in ids]

        # Both targets at once over the pool: lossless, and both drafts drafted.
        before = [draft_tokens(d.address) for d in drafts]
        got = run_all(stubs, spec)
        assert [r.ids for r in got] == want * 2
        assert all(r.usage.drafted_tokens > 0 for r in got)
        assert sum(r.usage.accepted_tokens for r in got) > 0
        after = [draft_tokens(d.address) for d in drafts]
        assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)

        # Kill draft A in the middle of a burst: every request still completes with the same tokens.
        box: dict[str, list[Result]] = {}
        burst = threading.Thread(target=lambda: box.setdefault("r", run_all(stubs, spec)))
        start_a = draft_tokens(drafts[0].address)
        burst.start()
        wait_for(lambda: draft_tokens(drafts[0].address) > start_a + 20, 60, "draft A to be drafting")
        drafts[0].popen.kill()
        burst.join(300)
        assert [r.ids for r in box["r"]] == want * 2
        for t in targets:
            wait_for(
                lambda t=t: t.metric("specsplit_draft_replicas_connected") == 1, 30, "A's stream to drop"
            )
            assert t.metric("specsplit_draft_connected") == 1  # the pool still has B

        # After the loss, every request is drafted, by B alone.
        b_before = draft_tokens(drafts[1].address)
        got = run_all(stubs, spec[:1])
        assert [r.ids for r in got] == want[:1] * 2
        assert all(r.usage.drafted_tokens > 0 for r in got)
        assert draft_tokens(drafts[1].address) > b_before
    finally:
        for channel in channels:
            channel.close()
        for proc in [*targets, *drafts]:
            proc.stop()
