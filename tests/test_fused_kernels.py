"""Fused kernels (the GPU path of the model) against their torch references: RMSNorm (with the residual
add), rotary, SiLU-and-mul, attention over the live KV (split and unsplit), and the rotary + KV write +
attention kernel the model runs.
On the CPU they run under TRITON_INTERPRET=1 (as `make test` sets it)."""

from __future__ import annotations

import pytest
import torch

from common.kernels import fused
from common.kernels.fused import rms_norm, rms_norm_reference
from common.layers.rotary import RotaryEmbedding

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 96])
def test_rms_norm_matches_reference(dtype, dim):
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(2, 5, dim, generator=g)).to(dtype).to(DEVICE)
    w = (1 + 0.1 * torch.randn(dim, generator=g)).to(dtype).to(DEVICE)
    got, want = rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6)
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: one rounding step of the output
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_rms_norm_non_contiguous_rows():
    x = torch.randn(4, 3, 64).to(DEVICE).transpose(0, 1)  # [3, 4, 64], rows not in memory order
    w = torch.rand(64).to(DEVICE)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6), rtol=1e-5, atol=1e-5)


BF16, FP32 = torch.bfloat16, torch.float32


@pytest.mark.parametrize("x_dtype, store_dtype", [(BF16, BF16), (BF16, FP32), (FP32, FP32)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_feature_write_equals_reference_bit_for_bit(x_dtype, store_dtype, with_residual):
    g = torch.Generator().manual_seed(3)
    hidden, layers = 48, 3
    x = (
        (4 * torch.randn(3, 2, hidden, generator=g)).to(x_dtype).to(DEVICE).transpose(0, 1)
    )  # [2, 3, H], strided
    residual = (4 * torch.randn(2, 3, hidden, generator=g)).to(x_dtype).to(DEVICE) if with_residual else None
    slots, positions = (
        torch.tensor([2, 0], device=DEVICE),
        torch.tensor([[5, 6, 7], [0, 1, 2]], device=DEVICE),
    )
    before = torch.randn(4, 9, layers * hidden, generator=g).to(store_dtype).to(DEVICE)
    stores = [before.clone(), before.clone()]
    fused.feature_write(stores[0], slots, positions, x, residual, hidden)  # the middle layer's columns
    fused.feature_write_reference(stores[1], slots, positions, x, residual, hidden)
    if fused.INTERPRETED and with_residual and x_dtype == torch.bfloat16:
        # The CPU interpreter truncates the fp32 sum to bf16 (-11.035 -> -11.0, torch's add rounds to the
        # nearest, -11.0625); the GPU rounds to nearest as torch does and is held to equality.
        torch.testing.assert_close(stores[0], stores[1], rtol=2**-7, atol=0)
    else:
        assert torch.equal(stores[0], stores[1])
    assert not torch.equal(stores[0], before)  # it wrote


def _tol(dtype):
    return 1e-5 if dtype == torch.float32 else 2e-2  # bf16: a rounding step or two of the output


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_matches_reference(dtype):
    g = torch.Generator().manual_seed(2)
    x = (3 * torch.randn(2, 5, 64, generator=g)).to(dtype).to(DEVICE)
    res = torch.randn(2, 5, 64, generator=g).to(dtype).to(DEVICE)
    w = (1 + 0.1 * torch.randn(64, generator=g)).to(dtype).to(DEVICE)
    (got, got_res), (want, want_res) = (
        fused.add_rms_norm(x, res, w, 1e-6),
        fused.add_rms_norm_reference(x, res, w, 1e-6),
    )
    if DEVICE == "cuda" or dtype == torch.float32:
        assert torch.equal(got_res, want_res)  # the residual stream is the plain add, bit for bit
    else:  # the CPU interpreter truncates fp32 -> bf16 instead of rounding to nearest
        torch.testing.assert_close(got_res.float(), want_res.float(), rtol=_tol(dtype), atol=_tol(dtype))
    torch.testing.assert_close(got.float(), want.float(), rtol=_tol(dtype), atol=_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_reference(dtype):
    x = (2 * torch.randn(3, 2, 2 * 80, generator=torch.Generator().manual_seed(3))).to(dtype).to(DEVICE)
    got, want = fused.silu_and_mul(x), fused.silu_and_mul_reference(x)
    assert got.shape == (3, 2, 80)
    torch.testing.assert_close(got.float(), want.float(), rtol=_tol(dtype), atol=_tol(dtype))


def test_rotary_table_rows_are_the_positions_rows():
    """The table a forward reads by position holds, row p, what `RotaryEmbedding` computes for p (bit for
    bit: the same elementwise ops), built once and reused for any shorter length."""
    rope = RotaryEmbedding(64, 1e6, {"rope_type": "llama3", "factor": 8.0}, device=DEVICE)
    positions = torch.tensor([[0, 1, 2, 3], [37, 38, 200, 511]], device=DEVICE)
    cos, sin = rope.table(512)
    want_cos, want_sin = rope(positions)
    assert cos.shape == sin.shape == (512, 64)
    assert torch.equal(cos[positions], want_cos.squeeze(-2)) and torch.equal(
        sin[positions], want_sin.squeeze(-2)
    )
    assert rope.table(100)[0] is cos  # a shorter length reuses it
    assert rope.table(600)[0].shape == (600, 64)  # a longer one rebuilds it


def _cache_case(dtype, bsz=3, seq=4, heads=4, kv_heads=2, head_dim=32, slots_n=5, max_len=40, seed=4):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(bsz, seq, heads + 2 * kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    q, k, v = qkv.split((heads, kv_heads, kv_heads), dim=2)  # views, as the model passes them
    caches = [
        torch.randn(slots_n, max_len, kv_heads, head_dim, generator=g).to(dtype).to(DEVICE) for _ in "kv"
    ]
    starts = torch.tensor([0, 9, 30][:bsz], device=DEVICE)
    positions = starts[:, None] + torch.arange(seq, device=DEVICE)
    slots = torch.tensor([4, 0, 2][:bsz], device=DEVICE)
    return q, k, v, caches, positions, slots


@pytest.mark.parametrize(
    "dtype,head_dim,splits,prefix",
    [
        (torch.float32, 32, 1, False),
        (torch.bfloat16, 32, 2, False),  # split keys: only split 0's programs write the cache
        (torch.float32, 96, None, False),  # half a head is not a power of two (masked lanes)
        (torch.bfloat16, 32, 1, True),  # branch rows: a prefix from another slot, up to the row's start
    ],
)
def test_rotary_attention_matches_reference(dtype, head_dim, splits, prefix):
    """Rotary + KV write + attention in one kernel against the reference (rotary_and_cache_reference,
    attention_reference): the output, every cache entry it writes, and none it should not."""
    q, k, v, (kc, vc), positions, slots = _cache_case(dtype, head_dim=head_dim)
    cos, sin = RotaryEmbedding(head_dim, 10000.0, None, device=DEVICE).table(kc.shape[1])
    kc2, vc2 = kc.clone(), vc.clone()
    branch = {}
    if prefix:  # rows 1, 2 read their first 9 / 30 keys (all below their start) from slots 1 / 3
        branch = dict(prefix_slots=torch.tensor([1, 1, 3], device=DEVICE),
                      prefix_len=torch.tensor([0, 9, 30], device=DEVICE))  # fmt: skip
    args = (positions, slots)
    got = fused.rotary_attention(
        q, k, v, cos, sin, *args, kc, vc, 40, head_dim**-0.5, num_splits=splits, **branch
    )
    want = fused.rotary_attention_reference(q, k, v, cos, sin, *args, kc2, vc2, 40, head_dim**-0.5, **branch)
    assert got.shape == q.shape and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=_tol(dtype), atol=_tol(dtype))
    torch.testing.assert_close(kc.float(), kc2.float(), rtol=_tol(dtype), atol=_tol(dtype))
    assert torch.equal(vc, vc2)  # V is copied, untouched
    untouched = torch.ones(kc.shape[:2], dtype=torch.bool, device=DEVICE)
    untouched[slots[:, None], positions] = False
    assert torch.equal(kc[untouched], kc2[untouched])


def host_dot_is_row_invariant() -> bool:
    """Whether this host's float32 matmul, the Triton interpreter's tl.dot, gives a row the same bits
    wherever it sits in a block. On a GPU every row of an MMA sums in one order; OpenBLAS on an AVX2 CPU
    (AMD EPYC, its Haswell kernels) does not: one query at rows 5 and 9 of an attention block came out
    one ulp apart there (AVX-512 hosts agree)."""
    import numpy as np

    rng = np.random.default_rng(0)
    for k, n in ((32, 64), (64, 32)):  # the attention's q @ k^T and p @ v at head_dim 32, 64 keys a block
        x, w = rng.standard_normal((16, k), dtype=np.float32), rng.standard_normal((k, n), dtype=np.float32)
        if not np.array_equal(np.roll(x, 5, axis=0) @ w, np.roll(x @ w, 5, axis=0)):
            return False
    return True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_attention_caches_the_keys_it_attended_to(dtype):
    """Each program writes the step's keys it reads to the cache and reads them back from there, so a
    query attends to the same bits in the verify step that computes it as in a later step that reads
    them back, and as a plain step does. Step A: 5 tokens at positions 10-14; step B: 5 tokens at 14-18,
    its first token A's last; step C: a plain step of that token alone. B's first output equals C's bit
    for bit (both the first row of their block) and so does every cache entry A wrote; A's last output
    (its block's fifth and tenth rows: GQA group 2) equals them where the dot rounds a row the same at
    every row of a block (a GPU; not every CPU's BLAS under the Triton interpreter)."""
    g = torch.Generator().manual_seed(12)
    heads, kv_heads, head_dim, max_len = 4, 2, 32, 64
    kc, vc = (torch.randn(1, max_len, kv_heads, head_dim, generator=g).to(dtype).to(DEVICE) for _ in "kv")
    qkv = torch.randn(1, 9, heads + 2 * kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    cos, sin = RotaryEmbedding(head_dim, 10000.0, None, device=DEVICE).table(max_len)
    slots = torch.tensor([0], device=DEVICE)

    def step(first, width=5):
        q, k, v = qkv[:, first : first + width].split((heads, kv_heads, kv_heads), dim=2)
        positions = torch.arange(10 + first, 10 + first + width, device=DEVICE)[None]
        return fused.rotary_attention(q, k, v, cos, sin, positions, slots, kc, vc, max_len, head_dim**-0.5)

    a = step(0)
    written = kc[0, 10:15].clone()
    c = step(4, width=1)
    assert torch.equal(kc[0, 10:15], written)  # the plain step rewrote position 14 with A's bits
    b = step(4)
    assert torch.equal(b[0, 0], c[0, 0])  # the verify's re-read of A's keys == a plain step's
    assert torch.equal(kc[0, 10:14], written[:4])  # B rewrote position 14 only, with the same bits
    assert torch.equal(kc[0, 14], written[4])
    assert not torch.equal(b[0, 1], a[0, 4])  # power: another token's output differs
    if DEVICE == "cuda" or host_dot_is_row_invariant():
        assert torch.equal(b[0, 0], a[0, 4])


@pytest.mark.parametrize(
    "dtype,seq,heads,head_dim,splits",
    [
        (torch.float32, 4, 4, 32, 1),  # verify width, GQA group 2, one split
        (torch.float32, 4, 4, 32, 3),  # split keys (flash-decoding), with empty splits past the live KV
        (torch.float32, 1, 6, 64, None),  # decode, group 3, automatic split count
        (torch.bfloat16, 5, 4, 32, 2),
        (torch.float32, 3, 4, 24, 2),  # head_dim not a power of two (padded lanes)
    ],
)
def test_attention_matches_reference(dtype, seq, heads, head_dim, splits):
    q, _, _, (kc, vc), positions, slots = _cache_case(dtype, seq=seq, heads=heads, head_dim=head_dim)
    q = q.contiguous()
    ctx_len = 40  # the cache's whole length: keys past each row's position hold random stale values
    scale = head_dim**-0.5
    got = fused.attention(q, kc, vc, slots, positions, ctx_len, scale, num_splits=splits)
    want = fused.attention_reference(q, kc, vc, slots, positions, ctx_len, scale)
    torch.testing.assert_close(got.float(), want.float(), rtol=_tol(dtype), atol=_tol(dtype))
    # The live-KV claim: poisoning every key past the last query position of a row changes nothing.
    for b in range(q.shape[0]):
        kc[slots[b], int(positions[b, -1]) + 1 :] = float("nan")
        vc[slots[b], int(positions[b, -1]) + 1 :] = float("nan")
    again = fused.attention(q, kc, vc, slots, positions, ctx_len, scale, num_splits=splits)
    assert torch.equal(again, got)


def test_attention_row_is_the_same_whatever_step_computes_it():
    """A query's output, bit for bit, does not depend on the step around it: alone (B=1) or beside 63
    other rows, at a context bucket of 512 or 1024 keys. Plain and verify steps that reach the same
    position differ in exactly these, and bf16 speculative output equals plain output only if they agree
    (`fused.split_chunk`; the combine sums splits in order: on the GPU a tree over a block of 4 or 8
    splits fails this at (1, 1024)). A short row also at the 128-key bucket
    (one split, stored without the combine) and the 256-key one (two). On the GPU also one token (a
    plain step) against the first of five (a verify: another query-block size; the CPU interpreter's
    numpy matmul rounds those differently)."""
    g = torch.Generator().manual_seed(11)
    heads, kv_heads, head_dim, max_len, rows = 4, 2, 32, 1024, 64
    kc, vc = (torch.randn(rows, max_len, kv_heads, head_dim, generator=g).to(DEVICE) for _ in "kv")
    q = torch.randn(rows, 5, heads, head_dim, generator=g).to(DEVICE)
    positions = torch.randint(200, 500, (rows, 1), generator=g).to(DEVICE) + torch.arange(5, device=DEVICE)
    slots = torch.arange(rows, device=DEVICE)
    scale = head_dim**-0.5

    def first_row(b, seq, ctx_len):
        sel = slice(0, b)
        out = fused.attention(
            q[sel, :seq].contiguous(), kc, vc, slots[sel], positions[sel, :seq], ctx_len, scale
        )
        return out[0, 0]

    want = first_row(1, 1, 512)
    for b, ctx_len in ((rows, 512), (1, 1024), (rows, 1024)):
        assert torch.equal(first_row(b, 1, ctx_len), want), (b, ctx_len)
    if DEVICE == "cuda":
        assert torch.equal(first_row(rows, 5, 512), want)
        assert torch.equal(first_row(1, 5, 1024), want)
    # A short row: one split at the 128-key bucket (no combine), two at 256, four at 512.
    positions[0] = torch.arange(60, 65, device=DEVICE)
    want = first_row(1, 1, 128)
    for b, ctx_len in ((1, 256), (rows, 256), (1, 512)):
        assert torch.equal(first_row(b, 1, ctx_len), want), (b, ctx_len)


def _branch_case(dtype, seq, heads, head_dim=32):
    """Four rows whose first prefix_len keys live in another slot (branch rows), on a cache long enough
    (160) for two splits of 128 keys. prefix_len per row: 0 (a plain row), 9 (the row's first query
    position), 66 (inside the row's second key block, below its queries), 130 (inside the second split;
    with seq > 1 rows, keys of the row's own positions too)."""
    g = torch.Generator().manual_seed(7)
    kv_heads, max_len = 2, 160
    q = torch.randn(4, seq, heads, head_dim, generator=g).to(dtype).to(DEVICE)
    caches = [torch.randn(8, max_len, kv_heads, head_dim, generator=g).to(dtype).to(DEVICE) for _ in "kv"]
    starts = torch.tensor([0, 9, 70, 129], device=DEVICE)
    positions = starts[:, None] + torch.arange(seq, device=DEVICE)
    slots = torch.tensor([4, 0, 2, 5], device=DEVICE)
    prefix_slots = torch.tensor([1, 3, 6, 7], device=DEVICE)  # each row's own prefix slot: see the poisoning
    prefix_len = torch.tensor([0, 9, 66, 130], device=DEVICE)
    return q, caches, positions, slots, prefix_slots, prefix_len, max_len


@pytest.mark.parametrize(
    "dtype,seq,heads,splits",
    [
        (torch.float32, 1, 4, 1),  # decode, GQA group 2, one split
        (torch.float32, 2, 4, 2),  # two query tokens, two splits (prefix_len 130 inside the second)
        (torch.float32, 2, 6, 1),  # group 3
        (torch.float32, 1, 4, None),  # automatic split count
        (torch.bfloat16, 2, 4, 2),
    ],
)
def test_attention_with_prefix_slots_matches_reference(dtype, seq, heads, splits):
    q, (kc, vc), positions, slots, prefix_slots, prefix_len, ctx_len = _branch_case(dtype, seq, heads)
    scale = 32**-0.5
    prefix = dict(prefix_slots=prefix_slots, prefix_len=prefix_len)
    got = fused.attention(q, kc, vc, slots, positions, ctx_len, scale, num_splits=splits, **prefix)
    want = fused.attention_reference(q, kc, vc, slots, positions, ctx_len, scale, **prefix)
    torch.testing.assert_close(got.float(), want.float(), rtol=_tol(dtype), atol=_tol(dtype))
    plain = fused.attention(q, kc, vc, slots, positions, ctx_len, scale, num_splits=splits)
    assert not torch.allclose(got[1:].float(), plain[1:].float())  # the prefix did change what was read
    assert torch.equal(got[0], plain[0])  # prefix_len 0: a plain row
    # Each key is read from one slot only: poisoning the other slot's copy of it changes nothing.
    for b in range(q.shape[0]):
        n = int(prefix_len[b])
        for cache in (kc, vc):
            cache[slots[b], :n] = float("nan")
            cache[prefix_slots[b], n:] = float("nan")
    again = fused.attention(q, kc, vc, slots, positions, ctx_len, scale, num_splits=splits, **prefix)
    assert torch.equal(again, got)
    again_ref = fused.attention_reference(q, kc, vc, slots, positions, ctx_len, scale, **prefix)
    assert torch.equal(again_ref, want)


@pytest.mark.parametrize("seq", [1, 2])
def test_attention_reference_prefix_equals_copied_prefix(seq):
    """The semantics, independent of the kernel: reading keys < prefix_len[b] from prefix_slots[b] is the
    plain attention on a cache where they were copied into the row's own slot."""
    q, (kc, vc), positions, slots, prefix_slots, prefix_len, ctx_len = _branch_case(torch.float32, seq, 4)
    scale = 32**-0.5
    got = fused.attention_reference(
        q, kc, vc, slots, positions, ctx_len, scale, prefix_slots=prefix_slots, prefix_len=prefix_len
    )
    kc2, vc2 = kc.clone(), vc.clone()
    for b in range(q.shape[0]):
        n = int(prefix_len[b])
        kc2[slots[b], :n] = kc[prefix_slots[b], :n]
        vc2[slots[b], :n] = vc[prefix_slots[b], :n]
    want = fused.attention_reference(q, kc2, vc2, slots, positions, ctx_len, scale)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "architecture,num_kv_heads",
    [("Qwen2ForCausalLM", 2), ("Qwen3ForCausalLM", 2), ("LlamaForCausalLM", 4)],  # qk-norm; no GQA
)
def test_whole_model_kernel_path_matches_reference_path(tmp_path, monkeypatch, architecture, num_kv_heads):
    """The model with every fused kernel (interpreted on the CPU) against its torch-reference path: a
    ragged prefill, a 4-wide verify and a decode, through merged projections and the rotary + KV write +
    attention kernel (Qwen3: q and k normalised first, so not views of the qkv output; Llama here: one
    query head per KV head)."""
    from common.distributed import Comm
    from common.kv_cache import KVCache
    from common.loader import load_model
    from common.models.generate import forward_rows
    from tests.tiny import make_tiny_model

    path = make_tiny_model(
        tmp_path / "m", seed=2, num_layers=2, architecture=architecture, num_kv_heads=num_kv_heads
    )
    model = load_model(path, Comm(), device=DEVICE)
    script = [
        ([0, 1], [0, 0], [[5, 6, 7, 8, 9, 10], [11, 12]]),
        ([0, 1], [6, 2], [[1, 2, 3, 4], [4, 3, 2, 1]]),
        ([1, 0], [6, 10], [[7], [8]]),
    ]
    outs = {}
    for kernels in (False, True):
        monkeypatch.setattr(fused, "on_gpu", lambda x, k=kernels: k)
        cache = KVCache.for_model(model, 2, 16)
        with torch.inference_mode():
            outs[kernels] = [forward_rows(model, cache, *step) for step in script]
    for got, want in zip(outs[True], outs[False]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernels", [False, True])
def test_whole_model_branch_row_matches_fresh_forward(tmp_path, monkeypatch, kernels):
    """A branch row (slot 1) that reads the first 8 positions of a 12-token prompt from slot 0 and feeds
    its own continuation at 8..11 has the hidden states of the full sequence prompt[:8] + continuation
    written into a fresh slot from scratch; the plain row beside it (slot 0 decoding on past the prompt,
    prefix_len 0) is unaffected. Both paths: torch references and the fused kernels (interpreted on the
    CPU)."""
    from common.distributed import Comm
    from common.kv_cache import KVCache
    from common.loader import load_model
    from common.models.generate import forward_rows
    from tests.tiny import make_tiny_model

    path = make_tiny_model(tmp_path / "m", seed=3, num_layers=2, architecture="Qwen2ForCausalLM")
    model = load_model(path, Comm(), device=DEVICE)
    monkeypatch.setattr(fused, "on_gpu", lambda x: kernels)
    prompt = [5, 17, 3, 99, 250, 7, 64, 12, 31, 8, 200, 45]
    cont = [400, 2, 77, 150]  # a different continuation from position 8 on
    with torch.inference_mode():
        cache = KVCache.for_model(model, 3, 16)
        forward_rows(model, cache, [0], [0], [prompt])
        # Row 0: the branch (slot 1, prefix slot 0, prefix_len 8); row 1: slot 0's next token, padded.
        ids = torch.tensor([cont, [9] * 4], device=DEVICE)
        positions = torch.tensor([[8, 9, 10, 11], [12, 13, 14, 15]], device=DEVICE)
        prefix = (torch.tensor([0, 0], device=DEVICE), torch.tensor([8, 0], device=DEVICE))
        got = model(ids, positions, torch.tensor([1, 0], device=DEVICE), cache, 16, prefix=prefix)
        fresh = forward_rows(model, cache, [2], [0], [prompt[:8] + cont])
        cache_ref = KVCache.for_model(model, 1, 16)
        plain = forward_rows(model, cache_ref, [0], [0], [[*prompt, 9]])
    torch.testing.assert_close(got[0], fresh[0, 8:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1, 0], plain[0, 12], rtol=1e-5, atol=1e-5)
