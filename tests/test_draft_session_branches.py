"""The target's use of the draft's branches (DraftSession): a step goes on without the draft's answer
when every asked request's committed sequence matches a candidate, or when at least half do and going on
yields more tokens per second than waiting for the rest of the round trip; never leaves a seeded sampled
request out; and only a candidate keyed by exactly the tokens committed since its base is used. Also
what a plain step sends: the releases it holds back."""

from __future__ import annotations

import time
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from common.metrics import ServiceMetrics
from specsplit.v1 import draft_pb2
from target_service.draft_session import Ask, DraftSession

VOCAB = 100


def session() -> DraftSession:
    link = SimpleNamespace(target_vocab_size=VOCAB, connected=True, epoch=1)
    s = DraftSession(link, ServiceMetrics("target", "t", registry=CollectorRegistry()), timeout=1.0)
    s.verify_seconds, s.round_trip, s.accepted_per_row = 2e-3, 3e-3, 2.4
    return s


def req(rid: int, tokens: list[int], pinned: bool = False):
    return SimpleNamespace(draft=SimpleNamespace(draft_id=rid), tokens=tokens, pinned_k=pinned)


def branches(s: DraftSession, rid: int, base: int, table: dict[tuple[int, ...], list[int]]) -> None:
    cands = [draft_pb2.Candidate(appended=list(k), token_ids=v) for k, v in table.items()]
    msg = draft_pb2.SpeculateResponse(step=1, branches=True)
    msg.proposals.append(draft_pb2.Proposal(request_id=rid, context_length=base, candidates=cands))
    s._store_candidates(msg)


def ask(ks: dict[int, int], sent: float | None = None) -> Ask:
    return Ask(step=2, epoch=1, sent=time.perf_counter() if sent is None else sent, ks=ks)


def test_every_request_picked_a_branch():
    s = session()
    batch = [req(1, [5, 6, 7, 8]), req(2, [9, 9, 3])]
    branches(s, 1, 2, {(7, 8): [10, 11, 12, 13], (7, 4): [1, 2, 3, 4]})
    branches(s, 2, 2, {(3,): [20, 21, 22, 23]})
    got = s._from_candidates(ask({1: 4, 2: 2}), batch)
    assert got is not None and got[1].tokens == [10, 11, 12, 13] and got[2].tokens == [20, 21]
    assert s.metrics.pipelined_steps._value.get() == 1


def test_a_candidate_must_match_exactly_what_was_committed_since_its_base():
    s = session()
    branches(s, 1, 2, {(7,): [10, 11]})
    assert s._from_candidates(ask({1: 2}), [req(1, [5, 6, 7, 8])]) is None  # one token more
    assert s._from_candidates(ask({1: 2}), [req(1, [5, 6])]) is None  # nothing committed since
    branches(s, 1, 2, {(7,): [10, VOCAB]})  # outside the target's vocabulary: dropped
    assert s._from_candidates(ask({1: 2}), [req(1, [5, 6, 7])]) is None


def test_going_on_with_part_of_the_batch_when_waiting_costs_more():
    s = session()
    batch = [req(1, [1, 2]), req(2, [1, 3]), req(3, [1, 4])]
    for rid in (1, 2):
        branches(s, rid, 1, {(rid + 1,): [7, 7, 7, 7]})
    # 2 of 3 hit: now, 2 * 3.4 + 1 = 7.8 tokens in 2 ms; waiting 3 ms more, 10.2 tokens in 5 ms.
    got = s._from_candidates(ask({1: 4, 2: 4, 3: 4}), batch)
    assert got is not None and set(got) == {1, 2}
    # Most of the round trip already gone: waiting is cheap, so the step waits.
    assert s._from_candidates(ask({1: 4, 2: 4, 3: 4}, sent=time.perf_counter() - 2.9e-3), batch) is None
    # A seeded sampled request is never left out.
    batch[2].pinned_k = True
    assert s._from_candidates(ask({1: 4, 2: 4, 3: 4}), batch) is None


def test_less_than_half_the_batch_waits():
    s = session()
    batch = [req(i, [1, i]) for i in range(1, 4)]
    branches(s, 1, 1, {(1,): [7, 7]})
    assert s._from_candidates(ask({1: 2, 2: 2, 3: 2}), batch) is None


@settings(max_examples=200, deadline=None)
@given(
    committed=st.lists(st.integers(0, 9), min_size=1, max_size=6),
    base=st.integers(0, 6),
    table=st.dictionaries(
        st.lists(st.integers(0, 9), max_size=4).map(tuple),
        st.lists(st.integers(0, VOCAB + 5), max_size=5),
        max_size=6,
    ),
    k=st.integers(1, 4),
)
def test_a_used_candidate_is_always_the_one_keyed_by_the_committed_tokens(committed, base, table, k):
    """Whatever the draft sends (any keys, empty or out-of-vocabulary proposals), a proposal taken from
    the branches is the first k tokens of the candidate whose key is exactly the tokens committed since
    its base, within the vocabulary; otherwise the step waits."""
    s = session()
    branches(s, 1, base, table)
    got = s._from_candidates(ask({1: k}), [req(1, committed)])
    key = tuple(committed[base:])
    expected = table.get(key, [])[:k] if len(committed) > base else []
    if expected and max(expected) < VOCAB:
        assert got is not None and got[1].tokens == expected
    else:
        assert got is None


class RecordingLink(SimpleNamespace):
    """A connected draft link that keeps the messages it is handed."""

    def __init__(self):
        super().__init__(target_vocab_size=VOCAB, connected=True, epoch=0, sent=[])

    def send(self, msg, epoch, hold=False):
        self.sent.append(msg)
        return True


def test_steps_that_ask_for_nothing_hold_releases_until_many_wait_or_the_batch_empties():
    """A plain step (k = 0) sends no message for one finished request's release: the releases go out
    together once RELEASE_BATCH wait, with the next ask that wants proposals, or when the batch is empty,
    and the draft applies them before that message's starts (draft_service/stream.py)."""
    from target_service.draft_session import RELEASE_BATCH

    link = RecordingLink()
    s = DraftSession(link, ServiceMetrics("target", "t", registry=CollectorRegistry()), timeout=1.0)

    def running(rid: int):
        draft = SimpleNamespace(draft_id=rid, synced=3, last_accepted=0)
        return SimpleNamespace(draft=draft, tokens=[1, 2, 3], pinned_k=0, k=4)

    live = [running(1000)]
    for rid in range(RELEASE_BATCH - 1):
        s.release(running(rid))
        s.ask(live, 0, 1 << 20)
    assert link.sent == [] and len(s.releases) == RELEASE_BATCH - 1
    s.release(running(RELEASE_BATCH - 1))
    s.ask(live, 0, 1 << 20)
    assert [list(m.releases) for m in link.sent] == [list(range(RELEASE_BATCH))] and not s.releases

    s.release(running(500))
    s.ask(live, 0, 1 << 20)
    assert len(link.sent) == 1
    live[0].tokens = [1, 2, 3, 4]
    s.ask(live, 4, 1 << 20)  # speculation resumes: the held release rides with the ask
    assert list(link.sent[-1].releases) == [500] and list(link.sent[-1].propose) == [1000]

    s.release(running(501))
    s.ask([], 0, 1 << 20)  # nothing running: the draft's state is freed now
    assert list(link.sent[-1].releases) == [501] and not s.releases
