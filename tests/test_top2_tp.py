"""The draft's best and second-choice token with a vocabulary-sharded LM head (`top2_tokens`): on one
rank and on two gloo ranks, the best id equals the full logits' argmax (exact ties: the lowest id) and
the second equals the argmax with the best masked out, padding never chosen."""

from __future__ import annotations

import torch

from common.distributed import Comm, run_local_world
from common.layers.logits import LogitsProcessor, top2_tokens
from common.layers.vocab import ParallelLMHead

VOCAB, DIM, ROWS = 101, 8, 32  # 101 rows: padded, so the last shard holds padding


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(VOCAB, DIM, generator=gen)
    hidden = torch.randn(ROWS, DIM, generator=gen)
    hidden[:4] = 0.0  # rows of all-zero scores: every id ties, and padding would tie too unless masked
    return weight, hidden


def _reference(weight: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scores = LogitsProcessor().process(hidden @ weight.T)
    best = scores.argmax(-1)
    return best, scores.scatter(-1, best[:, None], float("-inf")).argmax(-1)


def _top2(comm: Comm) -> tuple[torch.Tensor, torch.Tensor]:
    weight, hidden = _inputs()
    head = ParallelLMHead(VOCAB, DIM, comm)
    head.weight.zero_()
    head.weight[: head.shard_valid] = weight[head.shard_start : head.shard_start + head.shard_valid]
    return top2_tokens(LogitsProcessor().local_scores(head, hidden), head)


def test_top2_single_rank():
    best, second = _top2(Comm())
    ref_best, ref_second = _reference(*_inputs())
    assert torch.equal(best, ref_best) and torch.equal(second[4:], ref_second[4:])
    assert (best != second).all() and (second < VOCAB).all()


def test_top2_two_gloo_ranks_match_the_full_vocabulary():
    # run_local_world destroys each rank's process group before it exits: this test's own spawn did not,
    # and a rank once died at exit in gloo's teardown (SIGABRT, "terminate called without an active
    # exception") under a busy 2-core CI.
    ref_best, ref_second = _reference(*_inputs())
    for best, second in run_local_world(2, _top2):
        assert torch.equal(best, ref_best)  # ties (rows 0-3) go to the lowest id, as the argmax
        assert torch.equal(second[4:], ref_second[4:])
        assert (best != second).all() and (second < VOCAB).all()
