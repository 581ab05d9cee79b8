"""Prefills from padded static shapes (target_service/prefill.py) leave each request's KV and features as an
unpadded eager prefill does, and greedy decoding after them equals plain greedy decoding. On a GPU the
shapes replay CUDA graphs; on the CPU (where the runner itself prefills eagerly) the runner's
PrefillGraphs, called here, run the same padded shapes eagerly."""

from __future__ import annotations

import random

import pytest
import torch

from common.distributed import init_tp
from common.models.generate import greedy_generate
from common.settings import parse_config
from target_service.config import TargetConfig
from target_service.runner import StepRow, TargetRunner
from tests.tiny import make_tiny_model

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
MAX_BATCH = 12  # padded rows in slots 0.., eager ones from the top: never the same slot


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("prefill") / "target", vocab_size=256, num_layers=2)
    cfg = parse_config(TargetConfig, ["--model", str(path), "--max-batch-size", str(MAX_BATCH),
                                      "--num-speculative-tokens", "2", "--max-context-length", "96",
                                      "--draft-feature-layers", "0,1", "--prefill-graph-tokens", "128",
                                      "--device", DEVICE.type], "target")  # fmt: skip
    return TargetRunner(init_tp(1, 0, device=DEVICE), cfg)


def test_shapes_are_the_smallest_that_hold_the_rows(runner):
    graphs = runner.prefill_graphs
    assert graphs.lengths == [16, 32, 64, runner.max_len]  # the last bucket clipped to the longest row
    assert graphs.shape_for([[1] * 5]) == (1, 16)
    assert graphs.shape_for([[1] * 17, [2]]) == (2, 32)
    assert graphs.shape_for([[1] * 3] * 3) == (4, 16)
    assert graphs.shape_for([[1] * 40] * 3) is None  # 4 x 64 padded tokens > 128: eager
    assert graphs.shape_for([[1]] * 9) is None  # more rows than the largest batch
    assert graphs.shape_for([]) is None
    if DEVICE.type == "cuda":
        assert len(graphs.graphs) == len(graphs.shapes)  # all captured at start-up


def test_padded_prefill_writes_what_an_eager_one_does(runner):
    rng = random.Random(1)
    graphs = runner.prefill_graphs
    store = runner.feature_store
    for lengths in ([5], [17, 3], [9, 30, 2], [1, 1, 1, 1, 1]):
        rows = [[rng.randrange(256) for _ in range(n)] for n in lengths]
        padded_slots = list(range(len(rows)))
        eager_slots = [MAX_BATCH - 1 - i for i in range(len(rows))]
        # Stale KV in the padded slots: a padding position must not leave it readable either.
        for layer in runner.cache.k + runner.cache.v:
            layer[padded_slots] = 7.0
        before = graphs.replays
        assert graphs(rows, padded_slots)
        assert graphs.replays == before + 1
        runner.prefill_graphs.use_graphs, use = False, runner.prefill_graphs.use_graphs
        try:
            runner.prefill(rows, eager_slots)  # the eager path
        finally:
            runner.prefill_graphs.use_graphs = use
        for row, a, b in zip(rows, padded_slots, eager_slots):
            n = len(row)
            for layer in runner.cache.k + runner.cache.v:
                torch.testing.assert_close(layer[a, :n], layer[b, :n], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(store.data[a, :n], store.data[b, :n], rtol=1e-5, atol=1e-5)


def test_greedy_after_a_padded_prefill_equals_plain_greedy(runner):
    rng = random.Random(2)
    graphs = runner.prefill_graphs
    prompts = [[rng.randrange(256) for _ in range(rng.randint(2, 40))] for _ in range(3)]
    new = 8
    expected = greedy_generate(runner.model, prompts, new)
    slots = [0, 1, 2]
    assert graphs([p[:-1] for p in prompts], slots)
    tokens = [list(p) for p in prompts]
    for _ in range(new):
        rows = [StepRow(t[-1], [], len(t) - 1, s, 0.0, 0) for t, s in zip(tokens, slots)]
        result = runner.step(rows, 1)
        for t, out in zip(tokens, result.tokens):
            t.extend(out)
    assert [t[len(p) :] for t, p in zip(tokens, prompts)] == [e[:new] for e in expected]
