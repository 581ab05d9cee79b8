"""--batch-invariant: a token's logits do not depend on the step that computes them, so bf16 greedy output
with speculation equals plain decoding at any batch.

The kernel and the CPU path (common/kernels/invariant.py, fused.attention_per_query_reference) are held
to bitwise row invariance; a bf16 model's logits to equal bits in a verify step, a decode step and a step
alone (and, the power of that check, the tuned path to unequal ones: the CPU's bf16 GEMMs sum a row
differently at 1, 5 and 35 rows at K = 1536); the served target in bf16, speculating at 16 concurrent
requests, to token equality with plain decoding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from service_util import (
    assert_same_tokens,
    generate_many,
    prompts,
    request,
    running,
    start_draft,
    start_target,
)

from common.distributed import Comm
from common.kernels import fused, invariant
from common.kv_cache import KVCache
from common.loader import load_model
from common.models.generate import forward_rows
from common.tiny import make_tiny_model

ROWS = (1, 5, 16, 80, 130)


def _case(dtype: torch.dtype, k: int = 200, n: int = 72, bias: bool = True):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(max(ROWS), k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("path", ["kernel", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_same_bits_in_any_batch(path, dtype):
    """Every row of a call over M rows equals the same row computed alone, bit for bit, for M = 1..130
    (the kernel: one 64-row block, two, three; K = 200 leaves a partial K slice, N = 72 a partial tile);
    and the result is F.linear's to rounding."""
    if path == "kernel" and not (fused.INTERPRETED or torch.cuda.is_available()):
        pytest.skip("the Triton kernel needs a GPU or TRITON_INTERPRET=1")
    fn = invariant.invariant_linear if path == "kernel" else invariant.invariant_linear_reference
    x, w, b = _case(dtype)
    if path == "kernel" and torch.cuda.is_available():
        x, w, b = x.cuda(), w.cuda(), b.cuda()
    alone = torch.cat([fn(x[i : i + 1], w, b) for i in range(max(ROWS))])
    for m in ROWS:
        out = fn(x[:m], w, b)
        assert out.shape == (m, w.shape[0]) and out.dtype == dtype
        assert torch.equal(out, alone[:m]), f"{m} rows: {int((out != alone[:m]).any(-1).sum())} rows differ"
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(alone.float(), F.linear(x, w, b).float(), rtol=tol, atol=tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the 1.5B target's GEMM shapes on the GPU")
@pytest.mark.parametrize("k, n", [(1536, 2048), (1536, 17920), (8960, 1536), (1536, 151936)])
def test_the_kernel_is_row_invariant_at_the_1_5b_shapes(k, n):
    """qkv, gate_up, down and the LM head of Qwen2.5-1.5B in bf16: rows 1..320 (a plain step at 1-64
    streams, a k = 4 verify at 64) give every row the bits it has alone."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(320, k, generator=g).to(torch.bfloat16).cuda()
    w = (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16).cuda()
    alone = torch.cat([invariant.invariant_linear(x[i : i + 1], w) for i in range(0, 320, 7)])
    for m in (1, 5, 16, 64, 80, 320):
        out = invariant.invariant_linear(x[:m], w)
        assert torch.equal(out[::7], alone[: len(out[::7])]), m
    torch.testing.assert_close(alone.float(), F.linear(x[::7], w).float(), rtol=2e-2, atol=2e-2)


def test_the_power_of_the_row_check():
    """The check above fails a GEMM whose sum depends on the row count: the CPU's own fp32 F.linear (a GEMV
    for one row, a blocked GEMM for 80) on the same shapes."""
    x, w, b = _case(torch.float32)
    alone = torch.cat([F.linear(x[i : i + 1], w, b) for i in range(80)])
    assert not torch.equal(F.linear(x[:80], w, b), alone)


def test_attention_per_query_is_the_reference_and_shape_free():
    """The per-query attention equals `attention_reference` (to rounding), and a query's output is the same
    bits whether its row has 1 or 5 queries and whatever the context bucket."""
    g = torch.Generator().manual_seed(1)
    slots_n, max_len, nkv, group, hd = 3, 40, 2, 3, 16
    k_cache = torch.randn(slots_n, max_len, nkv, hd, generator=g)
    v_cache = torch.randn(slots_n, max_len, nkv, hd, generator=g)
    q = torch.randn(2, 5, nkv * group, hd, generator=g)
    slots = torch.tensor([2, 0])
    positions = torch.tensor([[10, 11, 12, 13, 14], [3, 4, 5, 6, 7]])
    want = fused.attention_reference(q, k_cache, v_cache, slots, positions, 32, 0.25)
    with invariant.batch_invariant():
        wide = fused.attention_reference(q, k_cache, v_cache, slots, positions, 32, 0.25)
        narrow = fused.attention_reference(
            q[:1, 2:3], k_cache, v_cache, slots[:1], positions[:1, 2:3], 40, 0.25
        )
    torch.testing.assert_close(wide, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(narrow[0, 0], wide[0, 2])


def _logits_by_step_shape(model) -> dict[str, torch.Tensor]:
    """bf16 logits of the same 7 requests' next 5 tokens, computed as one 5-wide verify of all 7, as 5
    one-token steps of all 7, and as 5 one-token steps of each request alone ([7, 5, V] each)."""
    gen = torch.Generator().manual_seed(5)
    prompts_ = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (12, 5, 17, 8, 3, 11, 9)]
    nxt = [torch.randint(0, 512, (5,), generator=gen).tolist() for _ in prompts_]

    def run(batch: list[int], width: int) -> torch.Tensor:
        cache = KVCache.for_model(model, 7, 64)
        forward_rows(model, cache, batch, [0] * len(batch), [prompts_[i] for i in batch])
        outs = []
        for j in range(0, 5, width):
            starts = [len(prompts_[i]) + j for i in batch]
            hidden = forward_rows(model, cache, batch, starts, [nxt[i][j : j + width] for i in batch])
            outs.append(model.compute_logits(hidden.flatten(0, 1)).view(len(batch), width, -1))
        return torch.cat(outs, 1)

    every = list(range(7))
    alone = torch.cat([run([i], 1) for i in every])
    return {"verify": run(every, 5), "decode": run(every, 1), "alone": alone}


@pytest.fixture(scope="module")
def wide_bf16_model(tmp_path_factory):
    """One layer of width 1536 in bf16: the CPU's GEMMs are not row-invariant at this K (at the demo
    models' 128 they happen to be)."""
    shape = dict(hidden_size=1536, num_layers=1, num_heads=12, num_kv_heads=2, intermediate_size=1536)
    path = make_tiny_model(tmp_path_factory.mktemp("wide"), **shape, dtype="bfloat16", tokenizer=False)
    return load_model(path, Comm(), dtype=torch.bfloat16)


def test_a_tokens_logits_are_the_same_bits_in_any_step(wide_bf16_model):
    """With the model's batch_invariant set, a token's bf16 logits are the same bits in a 5-wide verify of
    7 requests, a one-token step of 7 and a one-token step alone; without it (the power of the check)
    they are not."""
    model = wide_bf16_model
    model.batch_invariant = False
    tuned = _logits_by_step_shape(model)
    same = torch.equal(tuned["verify"], tuned["decode"]) and torch.equal(tuned["decode"], tuned["alone"])
    assert not same, "the tuned path gave equal bits: the check has no power here"
    model.batch_invariant = True
    try:
        got = _logits_by_step_shape(model)
    finally:
        model.batch_invariant = False
    assert torch.equal(got["verify"], got["decode"]) and torch.equal(got["decode"], got["alone"])
    torch.testing.assert_close(got["verify"], tuned["verify"], rtol=0.05, atol=0.05)


def test_the_mode_is_scoped_to_its_context():
    assert not invariant.active()
    with invariant.batch_invariant():
        assert invariant.active()
        with invariant.batch_invariant(False):
            assert not invariant.active()
        assert invariant.active()
    assert not invariant.active()


N_PROMPTS, NEW_TOKENS, CONCURRENCY = 24, 40, 16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.slow
def test_bf16_speculative_output_equals_plain_at_16_streams(demo_models, tmp_path):
    """The served target with --batch-invariant in bf16 (on the GPU where there is one), a draft
    proposing at 16 streams: every request's output equals plain decoding. (Its power on the CPU is
    `test_a_tokens_logits_are_the_same_bits_in_any_step`'s: at the demo models' width the CPU's tuned
    GEMMs happen to agree too; on the GPU, without the flag, bench-serve --check-greedy finds divergences
    at 16 streams, docs/benchmarks.md.)"""
    flags = ("--dtype", "bfloat16", "--device", DEVICE, "--max-batch-size", "16", "--batch-invariant")
    draft = start_draft(demo_models.draft, tmp_path, "--device", DEVICE).wait_ready()
    target = start_target(demo_models.target, tmp_path, draft, *flags).wait_ready()
    ps = prompts(N_PROMPTS, seed=11)
    with running(draft, target):
        spec = generate_many(target.address, [request(p, max_new_tokens=NEW_TOKENS) for p in ps], CONCURRENCY)
        plain = generate_many(
            target.address, [request(p, k=0, max_new_tokens=NEW_TOKENS) for p in ps], CONCURRENCY
        )
    drafted = sum(r.usage.drafted_tokens for r in spec)
    accepted = sum(r.usage.accepted_tokens for r in spec)
    assert drafted > 0 and accepted / drafted > 0.3, (drafted, accepted)
    assert all(r.usage.drafted_tokens == 0 for r in plain)
    assert_same_tokens(spec, plain)
