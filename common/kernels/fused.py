"""Fused elementwise kernels for the GPU forward: RMSNorm and rotary embeddings.

In eager PyTorch each is a chain of 6-8 small kernels (upcast, square, mean, rsqrt, scale, downcast,
weight; split, negate, concat, two products, sum, downcast). A 28-layer model runs four norms and two
rotations per layer, so at small batch these launches, not the weights, set the step time. Each Triton
kernel here does one pass. The torch references are the CPU path of the model (common/layers/) and the
tests compare the two.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

# SPECSPLIT_FUSED_KERNELS=0 falls back to the torch references on the GPU too (for A/B comparisons).
ENABLED = os.environ.get("SPECSPLIT_FUSED_KERNELS", "1") != "0"


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [rows, dim] any float dtype, row stride `stride`
    w_ptr,  # [dim] weight, same dtype as x
    out_ptr,  # [rows, dim] contiguous, x's dtype
    stride,
    dim,
    eps,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(x_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / dim + eps)
    # As the reference: normalise in fp32, round to x's dtype, then multiply by the weight in that dtype.
    y = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * dim + cols, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [..., dim], weight [dim] -> [..., dim] in x's dtype (one kernel)."""
    dim = x.shape[-1]
    x2 = x.reshape(-1, dim)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], dim), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, out, x2.stride(0), dim, eps,
                                         BLOCK=triton.next_power_of_2(dim))  # fmt: skip
    return out.view(x.shape)


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@triton.jit
def _rotary_kernel(
    x_ptr,  # [tokens, heads, head_dim] contiguous
    cos_ptr,  # [tokens, head_dim] fp32 contiguous
    sin_ptr,  # [tokens, head_dim] fp32 contiguous
    out_ptr,  # [tokens, heads, head_dim] x's dtype
    heads,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK)
    mask = d < HALF
    base = (token * heads + head) * (2 * HALF)
    x1 = tl.load(x_ptr + base + d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + base + HALF + d, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + token * 2 * HALF + d, mask=mask, other=0.0)
    c2 = tl.load(cos_ptr + token * 2 * HALF + HALF + d, mask=mask, other=0.0)
    s1 = tl.load(sin_ptr + token * 2 * HALF + d, mask=mask, other=0.0)
    s2 = tl.load(sin_ptr + token * 2 * HALF + HALF + d, mask=mask, other=0.0)
    # rotate-half: [x1, x2] -> [x1 * c1 - x2 * s1, x2 * c2 + x1 * s2]
    tl.store(out_ptr + base + d, (x1 * c1 - x2 * s1).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + base + HALF + d, (x2 * c2 + x1 * s2).to(out_ptr.dtype.element_ty), mask=mask)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, L, heads, head_dim]; cos, sin [B, L, 1, head_dim] fp32 -> rotated x (one kernel)."""
    bsz, seq, heads, head_dim = x.shape
    x = x.contiguous()
    out = torch.empty_like(x)
    tokens = bsz * seq
    if tokens:
        cos2 = cos.reshape(tokens, head_dim).contiguous()
        sin2 = sin.reshape(tokens, head_dim).contiguous()
        half = head_dim // 2
        _rotary_kernel[(tokens, heads)](x, cos2, sin2, out, heads, HALF=half,
                                        BLOCK=triton.next_power_of_2(half))  # fmt: skip
    return out


def apply_rotary_reference(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)
