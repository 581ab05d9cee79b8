"""The draft's best and second-choice token with a vocabulary-sharded LM head (`top2_tokens`): on one
rank and on two gloo ranks, the best id equals the full logits' argmax (exact ties: the lowest id) and
the second equals the argmax with the best masked out, padding never chosen."""

from __future__ import annotations

import tempfile

import torch
import torch.multiprocessing as mp

from common.distributed import Comm, init_tp
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


def _rank(rank: int, world: int, rdv: str, out: str) -> None:
    comm = init_tp(world, rank, init_method=rdv)
    torch.save(_top2(comm), f"{out}/rank{rank}.pt")


def test_top2_single_rank():
    best, second = _top2(Comm())
    ref_best, ref_second = _reference(*_inputs())
    assert torch.equal(best, ref_best) and torch.equal(second[4:], ref_second[4:])
    assert (best != second).all() and (second < VOCAB).all()


def test_top2_two_gloo_ranks_match_the_full_vocabulary():
    ref_best, ref_second = _reference(*_inputs())
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(2, f"file://{tmp}/rdv", tmp), nprocs=2, join=True)
        for rank in range(2):
            best, second = torch.load(f"{tmp}/rank{rank}.pt")
            assert torch.equal(best, ref_best)  # ties (rows 0-3) go to the lowest id, as the argmax
            assert torch.equal(second[4:], ref_second[4:])
            assert (best != second).all() and (second < VOCAB).all()
