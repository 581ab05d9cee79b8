"""The target's verify step (padded to batch buckets, one replay with the rejection kernel inside) equals
plain greedy decoding for every batch bucket, every width, with drafts right and wrong."""

from __future__ import annotations

import random
from functools import partial

import pytest
import torch

from common.distributed import init_tp
from common.models.generate import greedy_generate
from common.settings import parse_config
from target_service.config import TargetConfig
from target_service.runner import StepRow, TargetRunner
from tests.tiny import make_tiny_model

MAX_BATCH = 6  # buckets 1, 2, 4, 6
NEW = 6


@pytest.fixture(scope="module", params=["torch", "triton"])
def runner(request, tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("runner") / "target", vocab_size=256, num_layers=2)
    cfg = parse_config(TargetConfig, ["--model", str(path), "--max-batch-size", str(MAX_BATCH),
                                      "--num-speculative-tokens", "3", "--max-context-length", "128",
                                      "--verify-backend", request.param], "target")  # fmt: skip
    if request.param == "triton":
        pytest.importorskip("triton")
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the Triton backend needs TRITON_INTERPRET=1 on the CPU")
    return TargetRunner(init_tp(1, 0, device=torch.device("cpu")), cfg)


def test_every_bucket_and_width_matches_plain_greedy(runner):
    rng = random.Random(0)
    assert runner.batch_buckets == [1, 2, 4, 6]
    assert runner.widths == [1, 2, 3, 4]
    assert set(runner.step_costs) >= {(1, 1), (1, 4)}  # the policy start-up costs
    # The Triton kernels run in the (slow) interpreter on the CPU: three batch sizes cover every bucket kind.
    sizes = range(1, MAX_BATCH + 1) if runner.verify_backend == "torch" else (1, 3, 6)
    for batch in sizes:
        prompts = [[rng.randrange(256) for _ in range(rng.randint(2, 9))] for _ in range(batch)]
        expected = greedy_generate(runner.model, prompts, NEW)
        tokens = [list(p) for p in prompts]
        slots = list(range(batch))
        runner.prefill([p[:-1] for p in prompts], slots)
        step = 0
        hand_overs: list[int] = []
        while min(len(t) - len(p) for t, p in zip(tokens, prompts)) < NEW:
            width = 1 + step % 4  # every width; drafts: the true continuation, then a wrong token
            rows = []
            for b, (t, p) in enumerate(zip(tokens, prompts)):
                done = len(t) - len(p)
                truth = expected[b][done : done + width - 1]
                drafts = truth[: max(0, len(truth) - (b % 2))]
                if b % 2 and len(drafts) < width - 1:
                    drafts = [*drafts, (truth[len(drafts)] + 1) % 256] if len(truth) > len(drafts) else drafts
                rows.append(StepRow(t[-1], drafts, len(t) - 1, slots[b], 0.0, b))
            result = runner.step(rows, width, partial(hand_overs.append, step))
            assert hand_overs == list(range(step + 1))  # the scheduler's hand-over: once per step
            for b, out in enumerate(result.tokens):
                assert 1 <= len(out) <= len(rows[b].drafts) + 1
                assert result.accepted[b] == len(out) - 1
                tokens[b] += out
            step += 1
        for b in range(batch):
            got = tokens[b][len(prompts[b]) :][:NEW]
            assert got == expected[b], f"batch {batch}, row {b}"
