"""The verify step's packed inputs (target_service.runner.StepBuffers): every field of every row, real
and padding, after steps of different sizes through the same buffer (nothing of an earlier step left)."""

from __future__ import annotations

import random

import pytest
import torch

from target_service.runner import StepBuffers

SCRATCH = 9


def expected(batch: int, width: int, tokens, starts, slots, seeds, temps) -> dict[str, list]:
    """Row by row, written out plainly: real rows first, then padding rows."""
    out: dict[str, list] = {k: [] for k in ("input_ids", "positions", "slots", "draft_ids", "num_draft",
                                             "seeds", "commit_len", "temperatures")}  # fmt: skip
    for b in range(batch):
        real = b < len(tokens)
        row = tokens[b] if real else []
        start = starts[b] if real else 0
        out["input_ids"].append([row[j] if j < len(row) else 0 for j in range(width)])
        out["positions"].append([start + j for j in range(width)])
        out["slots"].append(slots[b] if real else SCRATCH)
        out["draft_ids"].append([row[j + 1] if j + 1 < len(row) else -1 for j in range(width - 1)])
        out["num_draft"].append(len(row) - 1 if real else 0)
        out["seeds"].append(seeds[b] if real else 0)
        out["commit_len"].append(start + 1 if real else 0)
        out["temperatures"].append(temps[b] if real else 0.0)
    return out


@pytest.mark.parametrize("batch,width", [(1, 1), (1, 5), (4, 3), (8, 5)])
def test_load_writes_every_field_and_clears_the_previous_step(batch: int, width: int):
    buf = StepBuffers(batch, width, SCRATCH, torch.device("cpu"))
    rng = random.Random(batch * 10 + width)
    # A full step, then fewer rows (no stale values); rows of different lengths, then all of one length
    # (written as one array), then narrower than the buffer.
    for n, same in ((batch, False), (max(1, batch // 2), True), (batch, True), (batch, False), (1, False)):
        lengths = [rng.randint(1, width)] * n if same else [rng.randint(1, width) for _ in range(n)]
        tokens = [[rng.randrange(1, 500) for _ in range(m)] for m in lengths]
        starts = [rng.randrange(0, 100) for _ in range(n)]
        slots = rng.sample(range(SCRATCH), n)
        seeds = [rng.randrange(1, 1 << 40) for _ in range(n)]
        temps = [rng.choice([0.0, 0.7, 1.3]) for _ in range(n)]
        buf.load(tokens, starts, slots, seeds, temps)
        want = expected(batch, width, tokens, starts, slots, seeds, temps)
        assert buf.floats.tolist() == pytest.approx(want.pop("temperatures"))
        for name, value in want.items():
            assert buf.view(name).tolist() == value, name
