"""Which CUDA graph serves a draft round (draft_service/rounds.py): a shape with no graph of its own replays
a captured graph that drafts more positions (its first k tokens), else runs eagerly, and is captured only
once asked for CAPTURE_AFTER times. A capture while serving stalls a step for 0.1-1 s, so an adaptive
policy trying k = 1..3, or one long catch-up, must not cause one."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from draft_service import rounds
from draft_service.rounds import GreedyRounds, stand_in, wider_graphs


def test_stand_in_is_the_fewest_extra_positions_that_fit_the_context() -> None:
    graphs = {(1, 2, 4, 256): 0, (1, 2, 4, 512): 0, (1, 2, 6, 256): 0, (1, 3, 4, 256): 0, (2, 2, 4, 256): 0}
    cands = wider_graphs(graphs, (1, 2, 2, 256))
    assert cands == [(1, 2, 4, 256), (1, 2, 4, 512), (1, 2, 6, 256)]
    assert stand_in(cands, 2, needed=100, max_len=1024) == (1, 2, 4, 256)
    # 2 extra positions past 255 leave the 256 bucket: the 512 one holds them
    assert stand_in(cands, 2, needed=255, max_len=1024) == (1, 2, 4, 512)
    # ... but not past the cache's end
    assert stand_in(cands, 2, needed=511, max_len=512) is None
    assert wider_graphs(graphs, (1, 2, 4, 256)) == [(1, 2, 6, 256)]  # only more positions stand in
    assert wider_graphs(graphs, (4, 2, 1, 256)) == []


class FakeGraph:
    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


def fake_rounds(top2: bool) -> GreedyRounds:
    """GreedyRounds' graph bookkeeping with stand-in graphs and rounds (the real ones need CUDA)."""
    r = object.__new__(GreedyRounds)
    r.use_graphs = True
    r.runner = SimpleNamespace(max_len=1024, top2=top2)
    r.graphs, r.stand_ins, r.misses = {}, {}, {}
    r.eager_rounds = r.serving_captures = 0
    r.eager, r.captured = [], []

    def result(k: int) -> torch.Tensor:  # drafted tokens 10.., second choices 20..
        cols = list(range(10, 10 + k)) + (list(range(20, 20 + k)) if top2 else [])
        return torch.tensor([cols])

    def capture(batch, width, k, ctx):
        r.captured.append((batch, width, k, ctx))
        return FakeGraph(), result(k), {}

    r._capture = capture
    r.round = lambda static, k, ctx: r.eager.append(k) or result(k)
    r.graphs[(1, 1, 4, 256)] = capture(1, 1, 4, 256)
    r.captured.clear()
    return r


def test_a_narrower_round_replays_the_wider_graph_and_keeps_its_first_k() -> None:
    for top2 in (False, True):
        r = fake_rounds(top2)
        out = r._replay({}, 1, 1, 2, 256, needed=50)
        assert out.tolist() == ([[10, 11, 20, 21]] if top2 else [[10, 11]])
        assert r.graphs[(1, 1, 4, 256)][0].replays == 1 and not r.eager and not r.captured


def test_a_shape_without_any_graph_runs_eagerly_until_it_has_been_asked_often() -> None:
    r = fake_rounds(False)
    for _ in range(rounds.CAPTURE_AFTER - 1):
        assert r._replay({}, 1, 7, 4, 256, needed=50).tolist() == [[10, 11, 12, 13]]
    assert r.eager == [4] * (rounds.CAPTURE_AFTER - 1) and not r.captured
    assert (r.eager_rounds, r.serving_captures) == (rounds.CAPTURE_AFTER - 1, 0)
    r._replay({}, 1, 7, 4, 256, needed=50)
    assert r.captured == [(1, 7, 4, 256)] and r.serving_captures == 1
    r._replay({}, 1, 7, 4, 256, needed=50)
    assert r.graphs[(1, 7, 4, 256)][0].replays == 2 and len(r.eager) == rounds.CAPTURE_AFTER - 1
    # a new graph can stand in for narrower rounds of its shape at once
    assert r._replay({}, 1, 7, 3, 256, needed=50).tolist() == [[10, 11, 12]]
    assert r.graphs[(1, 7, 4, 256)][0].replays == 3


def test_graphless_rounds_reach_the_draft_metrics() -> None:
    """The draft's stream adds the rounds run eagerly and captured while serving to its counters, once."""
    from prometheus_client import CollectorRegistry

    from common.metrics import ServiceMetrics
    from draft_service.stream import SharedDraft

    registry = CollectorRegistry()
    stream = SimpleNamespace(metrics=ServiceMetrics("draft", "m", registry), _graphless=(0, 0))
    counts = SimpleNamespace(eager_rounds=3, serving_captures=1)
    for _ in range(2):  # the second call has nothing new
        SharedDraft.count_graphless(stream, counts)
    counts.eager_rounds = 5
    SharedDraft.count_graphless(stream, counts)

    def value(name: str) -> float:
        return registry.get_sample_value(name, {"role": "draft", "model": "m"})

    assert value("specsplit_draft_eager_rounds_total") == 5
    assert value("specsplit_serving_captures_total") == 1
