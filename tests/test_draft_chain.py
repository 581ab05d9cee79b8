"""Chained draft rounds (`DraftState.chain`, `GreedyRounds.launch_chained`): with the draft in the
target's process, its next round is launched from the verify's output on the device before the verdict
reaches it. Driven here like the target drives it, against a second draft state that drafts the usual way
(verdict, then a round) from the same model: every proposal and the slot's KV bookkeeping must be the
same, and the chained state must not have run a round of its own. On CPU (eager) always, on CUDA (graphs,
the pinned copy and its event) where there is a GPU.
"""

from __future__ import annotations

import pytest
import torch
from service_util import prompts

from common.distributed import init_tp
from common.kv_cache import SlotTable
from common.settings import parse_config
from draft_service.config import DraftConfig
from draft_service.runner import DraftRunner
from draft_service.state import DraftState

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
K = 4


def _state(draft_dir, device: str) -> DraftState:
    argv = ["--model", str(draft_dir), "--device", device, "--dtype", "float32", "--max-batch-size", "4",
            "--num-speculative-tokens", str(K)]  # fmt: skip
    config = parse_config(DraftConfig, argv, "draft", env=False)
    runner = DraftRunner(init_tp(1, 0, device=torch.device(device)), config)
    return DraftState(runner, SlotTable(config.max_batch_size))


def _packed(emitted: list[list[int]], width: int, device: str) -> torch.Tensor:
    """The target's verify output: per row its emitted tokens (-1 past them, as the rejection kernel
    leaves them), its accepted count and its emitted count."""
    rows = [[*e, *[-1] * (width - len(e)), len(e) - 1, len(e)] for e in emitted]
    return torch.tensor(rows, dtype=torch.int64, device=device)


def _verdict(proposal: list[int], accepted: int, vocab: int) -> list[int]:
    """What a target emits after accepting `accepted` drafts: those drafts, then its own token (which
    differs from the draft's where it rejected it)."""
    if accepted < len(proposal):
        return [*proposal[:accepted], (proposal[accepted] + 1) % vocab]
    return [*proposal, (proposal[-1] * 7 + 3) % vocab]


@pytest.mark.parametrize("device", DEVICES)
def test_chained_rounds_propose_what_the_draft_would_have(demo_models, device):
    plain, chained = _state(demo_models.draft, device), _state(demo_models.draft, device)
    vocab = plain.runner.model.config.vocab_size
    ids = prompts(2, seed=11)
    reqs_p = [plain.start(i, p, K, 0.0, 0) for i, p in enumerate(ids)]
    reqs_c = [chained.start(i, p, K, 0.0, 0) for i, p in enumerate(ids)]
    props_p = plain.propose(reqs_p)
    props_c = chained.propose(reqs_c)
    assert props_p == props_c
    # Accepted counts per step and request: none, some, all (width 2 rows), and mixed batches; then the
    # k the target asks next (an adaptive target's, below the requests' k and back up).
    schedule = [((0, 4), K), ((4, 4), 2), ((2, 0), K), ((1, 2), 1), ((1, 1), 3), ((3, 4), K), ((4, 4), K)]
    for accepted, asked in schedule:
        proposals = [props_p[r.request_id].tokens for r in reqs_p]
        accepted = [min(a, len(p)) for a, p in zip(accepted, proposals)]
        emitted = [_verdict(p, a, vocab) for p, a in zip(proposals, accepted)]
        starts = [len(r.committed) for r in reqs_c]
        by_id = {r.request_id: r for r in reqs_c}
        rows = [(i, r.request_id, p) for i, (r, p) in enumerate(zip(reqs_c, proposals))]
        launched = chained.chain(by_id, rows, _packed(emitted, K + 1, device), K + 1)
        assert launched is not None and sorted(launched.index) == sorted(by_id)
        for rp, rc, start, e in zip(reqs_p, reqs_c, starts, emitted):
            assert plain.apply_verdict(rp, start, e) is None
            assert chained.apply_verdict(rc, start, e) is None
        props_p = plain.propose(reqs_p, [asked] * len(reqs_p))
        assert plain.round_ran
        props_c = chained.propose(reqs_c, [asked] * len(reqs_c))
        assert not chained.round_ran, "the chained round should have been the proposal"
        assert {i: p.tokens for i, p in props_c.items()} == {i: p.tokens for i, p in props_p.items()}
        # What the target reads from the round without waiting for the answer (DraftSession's chained
        # asks) is the proposal the draft answers with.
        assert {i: launched.tokens(i, asked) for i in by_id} == {i: p.tokens for i, p in props_c.items()}
        assert all(len(p.tokens) == asked for p in props_c.values()), "drafts were made"
        for rp, rc in zip(reqs_p, reqs_c):
            assert rc.committed == rp.committed
            # The chained round drafted each request's own k: its slot holds as many drafts' KV as a
            # round of k leaves, the first of them those of the proposal.
            assert rc.kv_tokens[: len(rp.kv_tokens)] == rp.kv_tokens
            assert len(rc.kv_tokens) == len(rc.committed) + K - 1


@pytest.mark.parametrize("device", DEVICES)
def test_a_verdict_unlike_the_chained_round_drafts_afresh(demo_models, device):
    """A chained round fed something else than the verdict says (here: the target re-sends an older
    context) is dropped, its KV writes forgotten, and the draft's own round proposes as usual."""
    plain, chained = _state(demo_models.draft, device), _state(demo_models.draft, device)
    vocab = plain.runner.model.config.vocab_size
    ids = prompts(1, seed=12)[0]
    rp, rc = plain.start(1, ids, K, 0.0, 0), chained.start(1, ids, K, 0.0, 0)
    proposal = plain.propose([rp])[1].tokens
    assert chained.propose([rc])[1].tokens == proposal
    emitted = _verdict(proposal, 2, vocab)
    launched = chained.chain({1: rc}, [(0, 1, proposal)], _packed([emitted], K + 1, device), K + 1)
    assert list(launched.index) == [1]
    # The target's verdict restarts two tokens earlier with other tokens.
    start = len(ids) - 2
    resent = [*ids[start:], *emitted[:1], (emitted[1] + 5) % vocab]
    plain.apply_verdict(rp, start, resent)
    chained.apply_verdict(rc, start, resent)
    assert rc.chained is None and rc.ready is None
    assert chained.propose([rc])[1].tokens == plain.propose([rp])[1].tokens
    assert chained.round_ran


def test_chain_skips_requests_it_cannot_continue(demo_models):
    state = _state(demo_models.draft, "cpu")
    vocab = state.runner.model.config.vocab_size
    ids = prompts(3, seed=13)
    greedy, sampled, stale = (state.start(i, p, K, 0.0 if i != 1 else 0.7, 0) for i, p in enumerate(ids))
    props = state.propose([greedy, sampled, stale])
    drafts = [props[i].tokens for i in range(3)]
    drafts[2] = [(t + 1) % vocab for t in drafts[2]]  # not what this draft proposed: its KV holds others
    emitted = [_verdict(d, 1, vocab) for d in drafts]
    rows = [(i, i, d) for i, d in enumerate(drafts)]
    by_id = {0: greedy, 1: sampled, 2: stale}
    assert list(state.chain(by_id, rows, _packed(emitted, K + 1, "cpu"), K + 1).index) == [0]
    assert greedy.chained is not None and sampled.chained is None and stale.chained is None
