"""Fused kernels (the GPU path of the model) against their torch references: RMSNorm (with the residual
add), rotary, SiLU-and-mul, rotary + KV write, and attention over the live KV (split and unsplit).
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 96])  # 96: half a head is not a power of two (masked lanes)
def test_rotary_and_cache_matches_reference(dtype, head_dim):
    q, k, v, (kc, vc), positions, slots = _cache_case(dtype, head_dim=head_dim)
    cos, sin = RotaryEmbedding(head_dim, 10000.0, None, device=DEVICE)(positions)
    kc2, vc2 = kc.clone(), vc.clone()
    got = fused.rotary_and_cache(q, k, v, cos, sin, positions, slots, kc, vc)
    want = fused.rotary_and_cache_reference(q, k, v, cos, sin, positions, slots, kc2, vc2)
    torch.testing.assert_close(got.float(), want.float(), rtol=_tol(dtype), atol=_tol(dtype))
    torch.testing.assert_close(kc.float(), kc2.float(), rtol=_tol(dtype), atol=_tol(dtype))
    assert torch.equal(vc, vc2)  # V is copied, untouched
    untouched = torch.ones(kc.shape[:2], dtype=torch.bool, device=DEVICE)
    untouched[slots[:, None], positions] = False
    assert torch.equal(kc[untouched], kc2[untouched])


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


def test_whole_model_kernel_path_matches_reference_path(tmp_path, monkeypatch):
    """The model with every fused kernel (interpreted on the CPU) against its torch-reference path: a
    ragged prefill, a 4-wide verify and a decode, through merged projections and the split-KV attention."""
    from common.distributed import Comm
    from common.kv_cache import KVCache
    from common.loader import load_model
    from common.models.generate import forward_rows
    from common.tiny import make_tiny_model

    path = make_tiny_model(tmp_path / "m", seed=2, num_layers=2, architecture="Qwen2ForCausalLM")
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
