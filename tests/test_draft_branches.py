"""Draft branches: the next proposal for every likely outcome of a verification, drafted in one round
that reads the shared prefix from the request's own slot. A picked branch must propose exactly what a
fresh round on the same committed sequence proposes (fp32, CPU), also one level further on (after its
KV was copied into the request's slot). On the GPU the same runs through the Triton kernels and the
draft's CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from common.distributed import init_tp
from common.kv_cache import SlotTable
from draft_service.config import DraftConfig
from draft_service.runner import DraftRunner
from draft_service.state import DraftState
from tests.tiny import make_tiny_model

K = 3
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on the GPU: the Triton kernels and CUDA graphs


@pytest.fixture(scope="module")
def state(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("branches") / "draft", num_layers=2, markov_rank=8, seed=3)
    config = DraftConfig(model=str(path), device=DEVICE, dtype="float32", max_batch_size=8,
                         num_speculative_tokens=K, log_format="json")  # fmt: skip
    runner = DraftRunner(init_tp(1, 0, device=torch.device(DEVICE)), config)
    return DraftState(runner, SlotTable(config.max_batch_size))


def fresh(state: DraftState, committed: list[int]) -> list[int]:
    """A new request's proposal for `committed`, from scratch in its own slot."""
    req = state.start(99, committed, K, 0.0, 0)
    try:
        return state.propose([req])[99].tokens
    finally:
        state.release(req)


def test_each_branch_proposes_what_a_fresh_round_would(state):
    prompt = [5, 17, 42, 8, 99, 23, 7, 61, 3, 250, 11]
    for j in range(K + 2):  # pick branch j: j tokens accepted, then the draft's guess (K + 1: plain step)
        req = state.start(1, prompt, K, 0.0, 0)
        first = state.propose([req])[1]
        assert len(first.tokens) == K and len(first.seconds) == K
        assert all(s != t for s, t in zip(first.seconds, first.tokens))
        base, branches = state.draft_branches([req], {1: first})[1]
        assert base == len(prompt) and len(branches) == K + 2
        plain = next(b for b in branches if b.key == first.tokens[:1])  # a plain step emitting draft 1
        branches = [b for b in branches if b is not plain] + [plain]
        keys = [b.key for b in branches]
        assert keys[:K] == [[*first.tokens[:i], first.seconds[i]] for i in range(K)]
        assert keys[K + 1] == first.tokens[:1]
        assert keys[K][:K] == first.tokens and len(keys[K]) == K + 1
        hits = state.ahead_hits
        assert state.apply_verdict(req, len(prompt), keys[j]) is True and state.ahead_hits == hits + 1
        committed = prompt + keys[j]
        got = state.propose([req])[1]
        assert got.ahead_hit and got.tokens == branches[j].proposal.tokens == fresh(state, committed)
        # One level further: the picked branch's KV now lives in the request's slot.
        _, second = state.draft_branches([req], {1: got})[1]
        pick = second[-1]  # all accepted
        assert state.apply_verdict(req, len(committed), pick.key) is True
        committed += pick.key
        assert state.propose([req])[1].tokens == pick.proposal.tokens == fresh(state, committed)
        # A verdict no branch predicted: a miss, and the next round is a fresh one that agrees.
        state.draft_branches([req], {1: state.propose([req])[1]})
        assert state.apply_verdict(req, len(committed), [400, 401]) is False
        assert state.propose([req])[1].tokens == fresh(state, [*committed, 400, 401])
        state.release(req)
    assert state.branch_slots.num_used == 0
