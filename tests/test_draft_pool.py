"""DraftPool routing with scripted links: placement by free slots, stickiness, a replica lost or removed.

The links here stand in for DraftLink's transport only (connected / epoch / send / receive); the pool's
splitting, placement and merging are the production code. tests/test_draft_pool_live.py runs the
same pool over real gRPC with two draft services and a killed one.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry

from common.metrics import ServiceMetrics
from specsplit.v1 import draft_pb2
from target_service.draft_pool import DraftPool, resolve, split_host_port


class ScriptedLink:
    """A draft replica: holds started requests, proposes [id % 100] * 2, reports its free slots."""

    def __init__(self, address: str, metrics, slots: int):
        self.address, self.metrics, self.slots = address, metrics, slots
        self.target_vocab_size = 512
        self.connected, self.epoch = False, 0
        self.info = draft_pb2.GetDraftInfoResponse(max_batch_size=slots, free_slots=slots)
        self.live: set[int] = set()
        self.sent: list[draft_pb2.SpeculateRequest] = []
        self.answers: dict[int, tuple[int, draft_pb2.SpeculateResponse]] = {}

    def start(self) -> None:
        self.connect()

    def connect(self) -> None:
        self.connected, self.epoch, self.live = True, self.epoch + 1, set()
        self.metrics.draft_connected.set(1)

    def drop(self) -> None:
        self.connected = False
        self.metrics.draft_connected.set(0)

    def close(self) -> None:
        self.connected = False

    def send(self, msg, epoch) -> bool:
        if not self.connected or epoch != self.epoch:
            return False
        self.sent.append(msg)
        self.answers[msg.step] = (epoch, self.answer(msg))
        return True

    def receive(self, step, epoch, deadline, on_branches=None):
        answer_epoch, response = self.answers.pop(step, (None, None))
        return response if self.connected and answer_epoch == epoch == self.epoch else None

    def answer(self, msg):
        response = draft_pb2.SpeculateResponse(step=msg.step)
        for start in msg.starts:
            if len(self.live) < self.slots:
                self.live.add(start.request_id)
            else:
                response.unknown_request_ids.append(start.request_id)
        self.live -= set(msg.releases)
        for rid in msg.propose:
            if rid in self.live:
                response.proposals.append(draft_pb2.Proposal(request_id=rid, token_ids=[rid % 100] * 2))
        response.free_slots = self.slots - len(self.live)
        return response


def make_pool(slots: dict[str, int]) -> tuple[DraftPool, dict[str, ScriptedLink], dict]:
    links: dict[str, ScriptedLink] = {}
    addresses = {"now": list(slots)}

    def make_link(address, metrics):
        links[address] = ScriptedLink(address, metrics, slots[address])
        return links[address]

    metrics = ServiceMetrics("target", "m", CollectorRegistry())
    pool = DraftPool(",".join(slots), make_link, metrics, refresh_s=3600, resolver=lambda _: addresses["now"])
    pool.start()
    return pool, links, addresses


def exchange(pool: DraftPool, msg: draft_pb2.SpeculateRequest) -> draft_pb2.SpeculateResponse | None:
    """One step as the draft session runs it: send, then collect the answer to that step."""
    if not pool.send(msg, pool.epoch):
        return None
    return pool.receive(msg.step, pool.epoch, time.perf_counter() + 1.0)


def step(n: int, starts=(), verdicts=(), propose=(), releases=()) -> draft_pb2.SpeculateRequest:
    return draft_pb2.SpeculateRequest(
        step=n,
        starts=[draft_pb2.DraftRequestStart(request_id=r, token_ids=[1, 2]) for r in starts],
        verdicts=[draft_pb2.Verdict(request_id=r, start=2, token_ids=[3]) for r in verdicts],
        propose=list(propose),
        propose_k=[rid % 3 + 1 for rid in propose],  # per-request k travels with its id
        releases=list(releases),
    )


def placed_on(links: dict[str, ScriptedLink]) -> dict[str, set[int]]:
    return {a: set(link.live) for a, link in links.items()}


def test_resolve_comma_lists_and_dns_names():
    assert split_host_port("dns:///specsplit-draft:50052") == ("specsplit-draft", 50052)
    assert split_host_port("[::1]:7") == ("::1", 7)
    assert resolve("127.0.0.1:5001, 127.0.0.1:5002,127.0.0.1:5001") == ["127.0.0.1:5001", "127.0.0.1:5002"]
    assert "127.0.0.1:9" in resolve("dns:///localhost:9")
    assert resolve("no-such-host.invalid:1") == []


def test_least_loaded_placement_by_the_drafts_free_slots_then_sticky():
    pool, links, _ = make_pool({"a:1": 6, "b:1": 2})
    try:
        response = exchange(pool, step(1, starts=range(8), propose=range(8)))
        # a has 6 free, b 2: the estimate drops with every start placed, ties go to the replica
        # holding fewer of this target's requests.
        assert placed_on(links) == {"a:1": {0, 1, 2, 3, 5, 7}, "b:1": {4, 6}}
        assert sorted(p.request_id for p in response.proposals) == list(range(8))
        assert not response.unknown_request_ids
        for link in links.values():
            (part,) = link.sent
            assert list(part.propose_k) == [rid % 3 + 1 for rid in part.propose]
        # Verdicts and proposals follow each request to its replica.
        exchange(pool, step(2, verdicts=[4, 5], propose=[4, 5]))
        assert {v.request_id for v in links["a:1"].sent[-1].verdicts} == {5}
        assert {v.request_id for v in links["b:1"].sent[-1].verdicts} == {4}
        # Releases free the slot the draft reports, and the next start goes where there is room.
        exchange(pool, step(3, releases=[0, 1, 2, 3]))
        exchange(pool, step(4, starts=[10], propose=[10]))
        assert 10 in links["a:1"].live
    finally:
        pool.close()


def test_losing_a_replica_costs_only_its_requests_which_start_again_elsewhere():
    pool, links, _ = make_pool({"a:1": 8, "b:1": 8})
    try:
        exchange(pool, step(1, starts=range(4), propose=range(4)))
        on_a, on_b = links["a:1"].live, links["b:1"].live
        assert on_a and on_b and on_a | on_b == set(range(4))
        links["a:1"].drop()
        assert pool.connected  # b still is
        response = exchange(pool, step(2, verdicts=range(4), propose=range(4)))
        assert {p.request_id for p in response.proposals} == on_b  # b's requests keep their drafts
        assert set(response.unknown_request_ids) == on_a  # a's are re-sent as starts ...
        exchange(pool, step(3, starts=sorted(on_a), propose=range(4)))
        assert links["b:1"].live == set(range(4))  # ... and land on b
        # A reconnect is a new stream: nothing of the old one is assumed.
        links["a:1"].connect()
        response = exchange(pool, step(4, propose=range(4)))
        assert {p.request_id for p in response.proposals} == set(range(4))
        links["a:1"].drop()
        links["b:1"].drop()
        assert not pool.connected
    finally:
        pool.close()


def test_a_full_draft_refuses_a_start_and_the_request_goes_to_another():
    pool, links, _ = make_pool({"a:1": 1, "b:1": 1})
    try:
        response = exchange(pool, step(1, starts=[1, 2, 3], propose=[1, 2, 3]))
        assert set(response.unknown_request_ids) == {3}  # no slot anywhere: plain decoding for it
        assert placed_on(links) == {"a:1": {1}, "b:1": {2}}
        exchange(pool, step(2, releases=[2]))
        exchange(pool, step(3, starts=[3], propose=[3]))
        assert links["b:1"].live == {3}
    finally:
        pool.close()


def test_replicas_follow_dns_and_the_connected_gauge_follows_the_pool():
    pool, links, addresses = make_pool({"a:1": 4, "b:1": 4, "c:1": 4})
    try:
        exchange(pool, step(1, starts=range(3), propose=range(3)))
        on_c = set(links["c:1"].live)
        assert on_c
        addresses["now"] = ["a:1", "b:1"]
        pool._refresh()  # c left DNS (a scale-down): closed, its requests start over
        assert set(pool.replicas) == {"a:1", "b:1"} and not links["c:1"].connected
        response = exchange(pool, step(2, propose=range(3)))
        assert set(response.unknown_request_ids) == on_c
        assert pool.metrics.draft_replicas._value.get() == 2
        assert pool.metrics.draft_replicas_connected._value.get() == 2
        links["a:1"].drop()
        assert pool.metrics.draft_replicas_connected._value.get() == 1
        assert pool.metrics.draft_connected._value.get() == 1
        links["b:1"].drop()
        assert pool.metrics.draft_connected._value.get() == 0
    finally:
        pool.close()
