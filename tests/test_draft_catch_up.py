"""A draft round's catch-up (a new request's prompt, or every token since the target's plain steps) in
chunks of fixed widths (CUDA graphs on the GPU, the same padded chunks eagerly on the CPU) must leave the
same KV and propose the same tokens as one forward over all the tokens (the path kept for long prompts).
fp32: the drafts compare exactly, the KV to float tolerance."""

from __future__ import annotations

import pytest
import torch

import draft_service.rounds as runner_mod
from common.distributed import init_tp
from draft_service.config import DraftConfig
from draft_service.rounds import CATCH_UP_WIDTHS
from draft_service.runner import DraftRunner
from tests.tiny import make_tiny_model

K = 3
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("catch_up") / "draft", num_layers=2, markov_rank=8, seed=5)
    config = DraftConfig(model=str(path), device=DEVICE, dtype="float32", max_batch_size=8,
                         max_context_length=256, num_speculative_tokens=K, log_format="json")  # fmt: skip
    return DraftRunner(init_tp(1, 0, device=torch.device(DEVICE)), config)


def tokens(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 500, (n,), generator=g).tolist()


def rounds(runner, slots: list[int], pending: list[int], monkeypatch, eager: bool):
    """A prompt round, then a catch-up of pending[b] tokens per row; returns both rounds' drafts, the
    positions written per row and the shapes of the chunks the catch-ups ran."""
    chunks = []
    real = runner.rounds.catch_up
    with monkeypatch.context() as m:  # undone on return, leaving the caller's own patches in place
        if eager:
            m.setattr(runner_mod, "EAGER_CATCH_UP", 0)
        m.setattr(runner.rounds, "catch_up", lambda ids, *a: chunks.append(tuple(ids.shape)) or real(ids, *a))
        prompts = [tokens(b, 5 + b) for b in range(len(slots))]
        first, _ = runner.rounds.run(prompts, [0] * len(slots), slots, K)
        rows = [tokens(100 + b, n) for b, n in enumerate(pending)]
        starts = [len(p) for p in prompts]
        second, _ = runner.rounds.run(rows, starts, slots, K)
    written = [s + len(r) for s, r in zip(starts, rows)]
    return first, second, written, chunks


@pytest.mark.parametrize("pending", [[3, 70, 1, 17], [130], [2, 2, 5]])
def test_chunked_catch_up_equals_one_forward(runner, pending, monkeypatch):
    n = len(pending)
    chunked = rounds(runner, list(range(n)), pending, monkeypatch, eager=False)
    eager = rounds(runner, list(range(4, 4 + n)), pending, monkeypatch, eager=True)
    assert chunked[0] == eager[0] and chunked[1] == eager[1]
    assert all(len(d) == K for d in chunked[1])
    # The chunked run used the fixed widths only, the longest row taking several chunks.
    assert chunked[3] and all(w in CATCH_UP_WIDTHS for _, w in chunked[3])
    assert sum(w for _, w in chunked[3][1:]) >= max(pending) - 1  # the prompt round's chunk first
    assert not eager[3]
    for layer in (*runner.cache.k, *runner.cache.v):
        for b, end in enumerate(chunked[2]):
            torch.testing.assert_close(layer[b, :end], layer[4 + b, :end], rtol=1e-5, atol=1e-5)


def test_long_prompts_take_one_forward(runner, monkeypatch):
    """Past EAGER_CATCH_UP tokens the catch-up is one eager forward (no chunks)."""
    monkeypatch.setattr(runner_mod, "EAGER_CATCH_UP", 16)
    _, _, _, chunks = rounds(runner, [0, 1], [40, 3], monkeypatch, eager=False)
    assert chunks == [(2, 16)]  # the prompts (4 and 5 early tokens) only
