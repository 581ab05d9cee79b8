"""Fused RMSNorm and rotary kernels (the GPU path of the model) against their torch references."""

from __future__ import annotations

import pytest
import torch

from common.kernels.fused import apply_rotary, apply_rotary_reference, rms_norm, rms_norm_reference
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 96])
def test_rotary_matches_reference(dtype, head_dim):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 4, head_dim, generator=g).to(dtype).to(DEVICE)
    positions = torch.tensor([[0, 1, 2], [7, 8, 40]], device=DEVICE)
    rope = RotaryEmbedding(head_dim, 10000.0, None, device=DEVICE)
    cos, sin = rope(positions)
    got, want = apply_rotary(x, cos, sin), apply_rotary_reference(x, cos, sin)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
