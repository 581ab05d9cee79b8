"""Fused kernels for the GPU forward: (residual-add +) RMSNorm, SiLU-and-mul, rotary + KV-cache write,
decode / verify attention over the live KV of each row (split-KV, flash-decoding style), and the write of
a feature draft's features into the target's FeatureStore.

In eager PyTorch each is a chain of small kernels (upcast, square, mean, rsqrt, scale, downcast, weight;
split, negate, concat, products, index_put; gather of the cache, two matmuls, mask, softmax). At small
batch these launches and the copies, not the weights, set the step time. Each Triton kernel here does
one pass. The torch references beside them are the CPU path of the model (common/layers/,
common/models/transformer.py) and tests/test_fused_kernels.py compares the two.
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import triton
import triton.language as tl
from torch import Tensor

# SPECSPLIT_FUSED_KERNELS=0 falls back to the torch references on the GPU too (for A/B comparisons).
ENABLED = os.environ.get("SPECSPLIT_FUSED_KERNELS", "1") != "0"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Set (per thread) while a --batch-invariant target runs its forward (common/kernels/invariant.py): its
# GEMMs take the invariant kernel, its attention one query block and one key chunking for every shape.
BATCH_INVARIANT: contextvars.ContextVar[bool] = contextvars.ContextVar("batch_invariant", default=False)
# Split count for attention calls outside CUDA graphs (see `eager_shapes`); None: `split_chunk` keys each.
_EAGER_SPLITS: list[int | None] = [None]


@contextmanager
def eager_shapes() -> Iterator[None]:
    """For eager forwards of any shape (a prefill, a draft's catch-up over several tokens).

    The attention kernel's split count is a `tl.constexpr` chosen from ctx_len: graphed steps
    have a few static shapes, all compiled at start-up, but eager forwards would compile a new variant
    for almost every new prompt length (~0.1-1 s each) in the middle of serving. Inside this context one
    split is used, so the variants reduce to the block size and the integer specialisations of L, all of
    which the services compile at start-up (`warm_eager_shapes`).
    """
    old = _EAGER_SPLITS[0]
    _EAGER_SPLITS[0] = 1
    try:
        yield
    finally:
        _EAGER_SPLITS[0] = old


# (batch, length) pairs whose eager forwards compile every kernel variant `eager_shapes` can use: the
# attention block sizes (group * L up to 16, 32, 64 and more) and Triton's integer specialisations of
# L and B * L (1, a multiple of 16, anything else).
EAGER_WARM_SHAPES = ((1, 1), (1, 2), (1, 3), (1, 7), (1, 16), (1, 33), (2, 8), (3, 3), (2, 1), (16, 1))


def on_gpu(x: Tensor) -> bool:
    """Whether the model runs these kernels for x (else the torch references: the CPU path)."""
    return x.is_cuda and ENABLED


# SPECSPLIT_PDL=0 launches every kernel in plain stream order (A/B comparisons).
_PDL_ENABLED = os.environ.get("SPECSPLIT_PDL", "1") != "0"
_PDL: dict[torch.device, bool] = {}


def pdl(x: Tensor) -> bool:
    """Whether kernels on x's device use programmatic dependent launch (Hopper and later, not the CPU
    interpreter). Such a kernel may start before the kernel ahead of it in the stream has finished: it
    signals `gdc_launch_dependents` at once (so the next kernel can start reading its weights) and calls
    `gdc_wait` before it reads anything the kernel ahead of it wrote, or writes anything at all (a later
    kernel's wait then covers every earlier kernel too)."""
    if x.device not in _PDL:
        _PDL[x.device] = (
            _PDL_ENABLED
            and x.is_cuda
            and not INTERPRETED
            and torch.cuda.get_device_capability(x.device)[0] >= 9
        )
    return _PDL[x.device]


def launch_options(x: Tensor) -> dict:
    """The keyword arguments every kernel here takes at launch: PDL (see `pdl`)."""
    on = pdl(x)
    return dict(PDL=on, launch_pdl=on)


@triton.jit
def _kernel_start(PDL: tl.constexpr):
    # Let the next kernel launch now (a skinny_linear reads its weight meanwhile), then wait for the
    # kernel ahead of us.
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def _add_residual(x, res_ptrs, mask, like_ptr):
    """x + the residual at res_ptrs (a block of pointers, masked), rounded to like_ptr's element type: the
    model dtype, as `x + residual` rounds in eager PyTorch (the stream a layer reads, and a feature)."""
    r = tl.load(res_ptrs, mask=mask, other=0.0)
    return (x.to(tl.float32) + r.to(tl.float32)).to(like_ptr.dtype.element_ty)


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [rows, dim] any float dtype, row stride `stride`
    res_ptr,  # [rows, dim] residual, row stride `res_stride` (read only when HAS_RESIDUAL)
    w_ptr,  # [dim] weight, same dtype as x
    out_ptr,  # [rows, dim] contiguous, x's dtype
    res_out_ptr,  # [rows, dim] contiguous: x + residual in x's dtype (written only when HAS_RESIDUAL)
    stride,
    res_stride,
    dim,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    _kernel_start(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(x_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x = _add_residual(x, res_ptr + row * res_stride + cols, mask, out_ptr)
        tl.store(res_out_ptr + row * dim + cols, x, mask=mask)
        x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / dim + eps)
    # As the reference: normalise in fp32, round to x's dtype, then multiply by the weight in that dtype.
    y = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * dim + cols, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def rows_of(x: Tensor) -> Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [..., dim], weight [dim] -> [..., dim] in x's dtype (one kernel)."""
    dim = x.shape[-1]
    x2 = rows_of(x)
    out = torch.empty((x2.shape[0], dim), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, x2, weight, out, out, x2.stride(0), x2.stride(0), dim, eps,
                                         HAS_RESIDUAL=False, BLOCK=triton.next_power_of_2(dim),
                                         **launch_options(x))  # fmt: skip
    return out.view(x.shape)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """x, residual [..., dim] -> (rms_norm(x + residual), x + residual), both in x's dtype (one kernel)."""
    dim = x.shape[-1]
    x2, r2 = rows_of(x), rows_of(residual)
    out = torch.empty((x2.shape[0], dim), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, out, res_out, x2.stride(0), r2.stride(0), dim, eps,
                                         HAS_RESIDUAL=True, BLOCK=triton.next_power_of_2(dim),
                                         **launch_options(x))  # fmt: skip
    return out.view(x.shape), res_out.view(x.shape)


@triton.jit
def _feature_write_kernel(
    x_ptr,  # [B * L, H] a layer's input stream before its residual add, row stride `x_stride`
    res_ptr,  # [B * L, H] the residual, row stride `res_stride` (read only when HAS_RESIDUAL)
    slots_ptr,  # [B] int64 each row's slot in the store
    positions_ptr,  # [B * L] int64 each token's position
    data_ptr,  # [S, T, F] the store, contiguous
    x_stride,
    res_stride,
    L,
    T,
    F,
    offset,  # the layer's first feature column: its index among the store's layers x H
    H,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    _kernel_start(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    v = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        v = _add_residual(v, res_ptr + row * res_stride + cols, mask, x_ptr)
    slot = tl.load(slots_ptr + row // L)
    pos = tl.load(positions_ptr + row)
    dst = data_ptr + (slot * T + pos) * F + offset + cols
    tl.store(dst, v.to(data_ptr.dtype.element_ty), mask=mask)


def feature_write(
    data: Tensor, slots: Tensor, positions: Tensor, x: Tensor, residual: Tensor | None, offset: int
) -> None:
    """data [S, T, F]; slots [B]; positions [B, L]; x, residual [B, L, H] -> data[slots[b], positions[b, l],
    offset : offset + H] = x + residual, rounded to x's dtype, then stored in data's: one launch per
    captured layer, where the eager add, concatenation and index_put take several per step."""
    x2 = rows_of(x)
    r2 = x2 if residual is None else rows_of(residual)
    batch, length = positions.shape
    if batch * length:
        _feature_write_kernel[(batch * length,)](x2, r2, slots, positions.contiguous(), data, x2.stride(0),
                                                 r2.stride(0), length, data.shape[1], data.shape[2], offset,
                                                 x.shape[-1], HAS_RESIDUAL=residual is not None,
                                                 BLOCK=triton.next_power_of_2(x.shape[-1]),
                                                 **launch_options(x))  # fmt: skip


def feature_write_reference(
    data: Tensor, slots: Tensor, positions: Tensor, x: Tensor, residual: Tensor | None, offset: int
) -> None:
    stream = x if residual is None else x + residual
    data[slots[:, None], positions, offset : offset + x.shape[-1]] = stream.to(data.dtype)


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_reference(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    summed = x + residual
    return rms_norm_reference(summed, weight, eps), summed


def apply_rotary_reference(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


@triton.jit
def silu_mul(gate, up):
    # silu(gate) * up in gate's dtype, rounded as the two eager ops round: silu(gate) to the dtype first,
    # then the product. Also the epilogue of stream_linear's GLU mode (the MLP's gate_up GEMM).
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    return (act * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [rows, 2 * n]: [gate | up], row stride `stride`
    out_ptr,  # [rows, n] contiguous, x's dtype
    stride,
    n,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    _kernel_start(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(x_ptr + row * stride + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride + n + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * n + cols, silu_mul(gate, up), mask=mask)


def silu_and_mul(x: Tensor) -> Tensor:
    """x [..., 2 * n] = [gate | up] -> silu(gate) * up [..., n] (one kernel)."""
    n = x.shape[-1] // 2
    x2 = rows_of(x)
    out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = min(1024, triton.next_power_of_2(n))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](
            x2, out, x2.stride(0), n, BLOCK=block, **launch_options(x)
        )
    return out.view(*x.shape[:-1], n)


def silu_and_mul_reference(x: Tensor) -> Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rotary_and_cache_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cos: Tensor,
    sin: Tensor,
    positions: Tensor,
    slots: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
) -> Tensor:
    """Rotates q and k and writes k, v into the cache at (slots[b], positions[b, l]); returns rotated q.
    Shapes as `rotary_attention`, whose first half this is."""
    cos, sin = cos[positions].unsqueeze(-2), sin[positions].unsqueeze(-2)  # [B, L, 1, D]
    rows = slots.unsqueeze(1)
    k_cache[rows, positions] = apply_rotary_reference(k, cos, sin)
    v_cache[rows, positions] = v
    return apply_rotary_reference(q, cos, sin)


@triton.jit
def _load_rotated(at, pos, cos_ptr, sin_ptr, mask, d, HEAD_DIM: tl.constexpr):
    # The rows at `at` ([R, 1] pointers to a head's lanes; lanes d [BLOCK_D]) rotated for their positions
    # pos [R] by the table rows cos_ptr / sin_ptr [positions, head_dim] fp32, rotate-half as
    # RotaryEmbedding: x * cos + (-x[d + half] | x[d - half]) * sin, fp32. One rounded product and one
    # explicit fused multiply-add per lane: every program that rotates a key writes the same bits,
    # whatever the compiler would have contracted.
    half: tl.constexpr = HEAD_DIM // 2
    x = tl.load(at + d[None, :], mask=mask, other=0.0).to(tl.float32)
    partner = tl.load(at + ((d + half) % HEAD_DIM)[None, :], mask=mask, other=0.0).to(tl.float32)
    rope_at = pos.to(tl.int64)[:, None] * HEAD_DIM + d[None, :]
    cos = tl.load(cos_ptr + rope_at, mask=mask, other=0.0)
    sin = tl.load(sin_ptr + rope_at, mask=mask, other=0.0)
    return tl.fma(x, cos, tl.where(d[None, :] < half, -partner, partner) * sin)


@triton.jit
def _write_step_kv(
    k_ptr,  # [B, L, num_kv_heads, head_dim] this step's keys, not rotated, token stride k_stride
    v_ptr,  # [B, L, num_kv_heads, head_dim] this step's values, token stride v_stride
    cos_ptr,  # [positions, head_dim] fp32
    sin_ptr,  # [positions, head_dim] fp32
    pos_ptr,  # [B, L] int64
    k_cache_ptr,  # [slots, max_len, num_kv_heads, head_dim]
    v_cache_ptr,  # [slots, max_len, num_kv_heads, head_dim]
    b,
    kv_head,
    kv_base,  # offset of (row b's slot, position 0, kv_head) in the caches
    row_stride,  # num_kv_heads * head_dim: one position
    start,
    end,
    k_stride,
    v_stride,
    seq_len,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    # The tokens of row b whose positions fall in [start, end) (the keys an attention program reads):
    # k rotated, k and v written to the cache at (slot, position, kv_head), BLOCK_T tokens a pass.
    # Every program that writes a token writes the same bits (`_load_rotated`).
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    for t0 in range(0, seq_len, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t_pos = tl.load(pos_ptr + b * seq_len + t, mask=t < seq_len, other=-1)
        fresh = ((t_pos >= start) & (t_pos < end))[:, None] & d_valid[None, :]
        t_tok = (b * seq_len + t).to(tl.int64)[:, None]
        k_at = k_ptr + t_tok * k_stride + kv_head * HEAD_DIM
        k_new = _load_rotated(k_at, t_pos, cos_ptr, sin_ptr, fresh, d, HEAD_DIM)
        v_new = tl.load(v_ptr + t_tok * v_stride + kv_head * HEAD_DIM + d[None, :], mask=fresh)
        cache_at = kv_base + t_pos.to(tl.int64)[:, None] * row_stride + d[None, :]
        tl.store(k_cache_ptr + cache_at, k_new.to(k_cache_ptr.dtype.element_ty), mask=fresh)
        tl.store(v_cache_ptr + cache_at, v_new, mask=fresh)


@triton.jit
def _attention_kernel(
    q_ptr,  # [B, L, num_heads, head_dim], token stride q_stride, heads contiguous; ROTARY: not yet rotated
    k_ptr,  # ROTARY: this step's keys [B, L, num_kv_heads, head_dim], token stride k_stride, not rotated
    v_ptr,  # ROTARY: this step's values [B, L, num_kv_heads, head_dim], token stride v_stride
    cos_ptr,  # ROTARY: [positions, head_dim] fp32 contiguous, row p for position p
    sin_ptr,  # ROTARY: [positions, head_dim] fp32 contiguous
    k_cache_ptr,  # [slots, max_len, num_kv_heads, head_dim]
    v_cache_ptr,  # [slots, max_len, num_kv_heads, head_dim]
    pos_ptr,  # [B, L] int64 contiguous, non-decreasing along L
    slot_ptr,  # [B] int64
    prefix_slot_ptr,  # [B] int64: the slot of row b's keys below prefix_len[b] (read only when HAS_PREFIX)
    prefix_len_ptr,  # [B] int64: keys at positions < prefix_len[b] come from prefix_slot[b] (HAS_PREFIX)
    out_ptr,  # SPLITS == 1: [B, L, num_heads, head_dim] q's dtype; else fp32 [B, L, heads, SPLITS, head_dim]
    lse_ptr,  # fp32 [B, L, num_heads, SPLITS] log2-sum-exp of each split (only when SPLITS > 1)
    qk_scale,  # softmax scale * log2(e)
    q_stride,
    k_stride,
    v_stride,
    seq_len,
    num_heads,
    num_kv_heads,
    max_len,
    chunk,  # keys per split, a multiple of BLOCK_N
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,  # the CPU interpreter's bf16/fp16 tl.dot is wrong: upcast there
    HAS_PREFIX: tl.constexpr,  # branch rows: a shared prefix read from another slot (False: plain rows)
    BLOCK_T: tl.constexpr,  # ROTARY: this step's tokens written per pass
    ROTARY: tl.constexpr,  # rotate q and this step's k here, write k and v to the cache (`rotary_attention`)
    PDL: tl.constexpr,
):
    _kernel_start(PDL)
    # One program: the GROUP * L query rows of one (row b, KV head) that fall in block `pid(1)`, against
    # the keys of split `pid(2)`. GQA without repeating K/V: the group's query heads are extra rows.
    b = tl.program_id(0) // num_kv_heads
    kv_head = tl.program_id(0) % num_kv_heads
    split = tl.program_id(2)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_valid = m < GROUP * seq_len
    tok = m % seq_len
    head = kv_head * GROUP + m // seq_len
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    row_mask = m_valid[:, None] & d_valid[None, :]
    q_at = q_ptr + (b * seq_len + tok).to(tl.int64)[:, None] * q_stride + (head * HEAD_DIM)[:, None]
    q_pos = tl.load(pos_ptr + b * seq_len + tok, mask=m_valid, other=-1)
    if ROTARY:
        q = _load_rotated(q_at, q_pos, cos_ptr, sin_ptr, row_mask, d, HEAD_DIM).to(q_ptr.dtype.element_ty)
    else:
        q = tl.load(q_at + d[None, :], mask=row_mask, other=0.0)
    slot = tl.load(slot_ptr + b)
    # Only the live keys: none past the last query position of this block (reads no stale or empty KV).
    start = split * chunk
    end = tl.minimum(start + chunk, tl.max(q_pos, axis=0) + 1)
    kv_base = slot * max_len * num_kv_heads * HEAD_DIM + kv_head * HEAD_DIM
    row_stride = num_kv_heads * HEAD_DIM
    if ROTARY:
        # This step's keys that this program reads go to the cache first, and the barrier makes its own
        # writes visible to all its threads: the key loop then reads them like any other, and no order
        # between programs is needed (those sharing a key write the same bits).
        _write_step_kv(k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, k_cache_ptr, v_cache_ptr, b, kv_head,
                       kv_base, row_stride, start, end, k_stride, v_stride, seq_len, HEAD_DIM, BLOCK_D,
                       BLOCK_T)  # fmt: skip
        tl.debug_barrier()
    if HAS_PREFIX:
        # A branch row shares its first prefix_len keys with another request's slot instead of holding a
        # copy: those keys are read there, the rest (its own tokens) in `slot`.
        prefix_slot = tl.load(prefix_slot_ptr + b)
        prefix_len = tl.load(prefix_len_ptr + b)
        prefix_base = prefix_slot * max_len * num_kv_heads * HEAD_DIM + kv_head * HEAD_DIM
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_valid = n < end
        if HAS_PREFIX:
            # Per key: a block may straddle prefix_len, so its keys can come from two slots.
            base = tl.where(n < prefix_len, prefix_base, kv_base)
            kv_off = base[:, None] + n.to(tl.int64)[:, None] * row_stride + d[None, :]
        else:
            kv_off = kv_base + n.to(tl.int64)[:, None] * row_stride + d[None, :]
        kv_mask = n_valid[:, None] & d_valid[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        if DOT_FP32:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * qk_scale
        else:
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(n_valid[None, :] & (n[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: keep zeros
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        if DOT_FP32:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    row = (b * seq_len + tok) * num_heads + head
    if SPLITS == 1:
        tl.store(out_ptr + row.to(tl.int64)[:, None] * HEAD_DIM + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & d_valid[None, :])  # fmt: skip
    else:
        part = row.to(tl.int64) * SPLITS + split
        tl.store(
            out_ptr + part[:, None] * HEAD_DIM + d[None, :], out, mask=m_valid[:, None] & d_valid[None, :]
        )
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + part, lse, mask=m_valid)


@triton.jit
def _attention_combine_kernel(
    part_ptr,  # fp32 [rows, SPLITS, head_dim]: each split's normalised output
    lse_ptr,  # fp32 [rows, SPLITS] log2-sum-exp of each split (-inf: an empty split)
    out_ptr,  # [rows, head_dim] q's dtype
    rows,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PDL: tl.constexpr,
):
    _kernel_start(PDL)
    # The splits are summed one by one in split order, not by a tree over a power-of-two block of them:
    # a tree's order depends on the block (4 splits at the 512-key bucket, 8 at 1024), a running sum's
    # does not, and the trailing empty splits of a longer bucket (weight 0, partial 0) add exact zeros.
    # So a row's output is the same whichever context bucket computes it (on the GPU a tree's is not:
    # tests/test_fused_kernels.py::test_attention_row_is_the_same_whatever_step_computes_it).
    row = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_valid = row < rows
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    lse_at = lse_ptr + row * SPLITS
    top = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for s in tl.static_range(SPLITS):
        top = tl.maximum(top, tl.load(lse_at + s, mask=row_valid, other=0.0))
    num = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    den = tl.zeros([BLOCK_R], tl.float32)
    mask = row_valid[:, None] & d_valid[None, :]
    for s in tl.static_range(SPLITS):  # unrolled: every split's loads in flight at once
        w = tl.exp2(tl.load(lse_at + s, mask=row_valid, other=0.0) - top)  # split 0 holds key 0: top finite
        parts = tl.load(part_ptr + (row * SPLITS + s)[:, None] * HEAD_DIM + d[None, :], mask=mask, other=0.0)
        num += parts * w[:, None]
        den += w
    out = (num / den[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row[:, None] * HEAD_DIM + d[None, :], out, mask=mask)


# Query rows per program of the split combine (four rows with the splits unrolled: 0.114 -> 0.042 ms per
# step at B=16, 400 keys).
COMBINE_ROWS = 4
# Keys per attention split: at least SPLIT_KEYS, and at most MAX_SPLITS splits over the whole cache (128
# keys up to the services' default 4096-token context).
SPLIT_KEYS, MAX_SPLITS = 128, 64
ATTENTION_BLOCK_N = 64  # keys per block (128-key blocks: 0.02 ms slower per step at B = 1 and 16)


def split_chunk(max_len: int, block_n: int) -> int:
    """Keys per split (flash-decoding) of every graphed attention call on a cache of `max_len` positions.

    One constant per cache, not per shape: a query's output then depends only on its own keys, never on
    the batch, the width or the context bucket of the step that computes it. A plain step (1 row, the
    bucket of p + 1) and the verify step (k + 1 rows, the bucket of p + k + 1) that reach position p must
    sum the same key ranges in the same order, or their bf16 hidden states, and the KV every later token
    reads, differ in the last bits (a split chosen per shape, e.g. for two waves of programs, changes
    between buckets, and bf16 speculative output then differs from plain). Empty trailing splits of a
    longer bucket add exact zeros in the combine. On caches of up to 8192 positions the chunk is 128
    keys."""
    return max(SPLIT_KEYS, triton.cdiv(triton.cdiv(max_len, MAX_SPLITS), block_n) * block_n)


def attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slots: Tensor,
    positions: Tensor,
    ctx_len: int,
    scale: float,
    num_splits: int | None = None,
    prefix_slots: Tensor | None = None,
    prefix_len: Tensor | None = None,
    block_m: int | None = None,
) -> Tensor:
    """Causal attention of q [B, L, H, D] (rotated) over the cached keys of each row's slot.

    A query at position p sees keys 0..p of its slot; keys at or past ctx_len are never read, nor keys
    past the last query position of a block (the live KV). The keys are split in chunks of
    `split_chunk(max_len)` (one size per cache, so a row's output does not depend on the step's shape);
    the split count depends only on ctx_len, so the call is CUDA-graph capturable. Returns [B, L, H, D]
    in q's dtype.

    Branch rows: with prefix_slots, prefix_len [B] int64 (device tensors, both or neither), row b reads
    the keys and values at positions < prefix_len[b] from slot prefix_slots[b] and the rest from
    slots[b], so a row diverging from another request after a shared prefix needs no copy of it. A row
    with prefix_len 0 is a plain row. Without them the kernel compiles to the plain variant (HAS_PREFIX).

    num_splits, block_m: force the split count / query rows per program (tests and
    bench/attention_invariance.py); by default chunks of `split_chunk` keys and the rows of the step.
    """
    return _attention(q.contiguous(), None, k_cache, v_cache, slots, positions, ctx_len, scale, num_splits,
                      prefix_slots, prefix_len, block_m)  # fmt: skip


def rotary_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cos: Tensor,
    sin: Tensor,
    positions: Tensor,
    slots: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    ctx_len: int,
    scale: float,
    num_splits: int | None = None,
    prefix_slots: Tensor | None = None,
    prefix_len: Tensor | None = None,
    block_m: int | None = None,
) -> Tensor:
    """Rotary on q and k, k and v written to the cache at (slots[b], positions[b, l]), and `attention`
    over it, in one kernel (rotary_and_cache_reference, then attention_reference).

    q [B, L, H, D], k, v [B, L, Hkv, D] not yet rotated (views into one qkv output are fine: only the
    last two dims must be contiguous); cos, sin [P, D] fp32, row p for position p
    (`RotaryEmbedding.table`); positions [B, L]; the rest as `attention`. Each program writes the keys
    and values of this step's tokens that it reads (programs reading the same ones write the same bits)
    and reads them back from the cache, in the same blocks as any other key: a query's sum does not
    depend on whether its keys are this step's or older. Fused, the attention does not wait for a
    separate rotary and cache-write kernel (2-3 us per layer at B = 1-16).
    """
    seq, head_dim = q.shape[1], q.shape[3]
    for t in (q, k, v):
        rows = t.shape[0] == 1 or t.stride(0) == seq * t.stride(1)  # token b * L + l at l's stride
        assert t.stride(-1) == 1 and t.stride(-2) == head_dim and rows, (tuple(t.shape), t.stride())
    for t in (cos, sin):
        assert t.dim() == 2 and t.shape[1] == head_dim and t.is_contiguous() and t.dtype == torch.float32
    return _attention(q, (k, v, cos, sin), k_cache, v_cache, slots, positions, ctx_len, scale, num_splits,
                      prefix_slots, prefix_len, block_m)  # fmt: skip


def _attention(q, rotary, k_cache, v_cache, slots, positions, ctx_len, scale, num_splits, prefix_slots,
               prefix_len, block_m) -> Tensor:  # fmt: skip
    bsz, seq, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    invariant = BATCH_INVARIANT.get()  # one query block and the graphs' key chunks for every shape
    block_m = block_m or (64 if invariant else max(16, min(64, triton.next_power_of_2(group * seq))))
    block_n = ATTENTION_BLOCK_N
    m_blocks = triton.cdiv(group * seq, block_m)
    forced = num_splits or (None if invariant else _EAGER_SPLITS[0])
    if forced:  # a given count (tests, eager forwards): even chunks
        chunk = triton.cdiv(triton.cdiv(ctx_len, forced), block_n) * block_n
    else:
        chunk = split_chunk(k_cache.shape[1], block_n)
    splits = triton.cdiv(ctx_len, chunk)
    has_prefix = prefix_slots is not None
    assert has_prefix == (prefix_len is not None), "prefix_slots and prefix_len: both or neither"
    if not has_prefix:
        prefix_slots, prefix_len = slots, slots  # never read (HAS_PREFIX=False)
    k, v, cos, sin = rotary if rotary is not None else (q, q, q, q)  # never read without ROTARY
    positions = positions.contiguous()
    out = torch.empty((bsz, seq, heads, head_dim), dtype=q.dtype, device=q.device)
    if splits == 1:
        part, lse = out, out  # lse unused
    else:
        part = torch.empty((bsz, seq, heads, splits, head_dim), dtype=torch.float32, device=q.device)
        lse = torch.empty((bsz, seq, heads, splits), dtype=torch.float32, device=q.device)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    block_d = max(16, triton.next_power_of_2(head_dim))
    _attention_kernel[(bsz * kv_heads, m_blocks, splits)](
        q, k, v, cos, sin, k_cache, v_cache, positions, slots, prefix_slots, prefix_len, part, lse,
        scale * 1.4426950408889634, q.stride(1), k.stride(1), v.stride(1), seq, heads, kv_heads,
        k_cache.shape[1], chunk, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m,
        BLOCK_N=block_n, SPLITS=splits, PRECISION=precision, DOT_FP32=INTERPRETED, HAS_PREFIX=has_prefix,
        BLOCK_T=min(16, triton.next_power_of_2(seq)) if rotary is not None else 1, ROTARY=rotary is not None,
        **launch_options(q),
    )  # fmt: skip
    if splits > 1:
        rows = bsz * seq * heads
        _attention_combine_kernel[(triton.cdiv(rows, COMBINE_ROWS),)](
            part, lse, out, rows, HEAD_DIM=head_dim, BLOCK_D=block_d, SPLITS=splits, BLOCK_R=COMBINE_ROWS,
            **launch_options(q),
        )  # fmt: skip
    return out


def attention_reference(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slots: Tensor,
    positions: Tensor,
    ctx_len: int,
    scale: float,
    num_splits: int | None = None,
    prefix_slots: Tensor | None = None,
    prefix_len: Tensor | None = None,
) -> Tensor:
    """The same attention in eager torch: gather the slots' first ctx_len keys, mask by position.

    With prefix_slots, prefix_len (branch rows, see `attention`): gather both slots' keys and take each
    key from prefix_slots[b] below prefix_len[b], from slots[b] from there on.
    """
    bsz, seq, heads, head_dim = q.shape
    nkv = k_cache.shape[2]
    group = heads // nkv
    assert (prefix_slots is None) == (prefix_len is None), "prefix_slots and prefix_len: both or neither"
    if BATCH_INVARIANT.get() and prefix_slots is None:
        return attention_per_query_reference(q, k_cache, v_cache, slots, positions, scale)
    keys = k_cache[:, :ctx_len][slots]  # [B, ctx, nkv, hd]
    values = v_cache[:, :ctx_len][slots]
    key_pos = torch.arange(ctx_len, device=q.device)
    if prefix_slots is not None:
        # torch.where, not a blend: the unselected slot's stale (even NaN) keys must not leak in.
        from_prefix = (key_pos < prefix_len.unsqueeze(-1))[:, :, None, None]  # [B, ctx, 1, 1]
        keys = torch.where(from_prefix, k_cache[:, :ctx_len][prefix_slots], keys)
        values = torch.where(from_prefix, v_cache[:, :ctx_len][prefix_slots], values)
    mask = (key_pos <= positions.unsqueeze(-1))[:, None, None]  # [B, 1, 1, L, ctx]
    # GQA without repeating K/V: the `group` query heads of one KV head become extra query rows.
    q = q.view(bsz, seq, nkv, group, head_dim).permute(0, 2, 3, 1, 4).reshape(bsz, nkv, group * seq, head_dim)
    scores = torch.matmul(q, keys.permute(0, 2, 3, 1)).float() * scale
    scores = scores.view(bsz, nkv, group, seq, ctx_len).masked_fill(~mask, float("-inf"))
    probs = scores.softmax(-1).to(values.dtype).view(bsz, nkv, group * seq, ctx_len)
    out = torch.matmul(probs, values.permute(0, 2, 1, 3))  # [B, nkv, group * seq, hd]
    return out.view(bsz, nkv, group, seq, head_dim).permute(0, 3, 1, 2, 4).reshape(bsz, seq, heads, head_dim)


def attention_per_query_reference(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, positions: Tensor, scale: float
) -> Tensor:
    """`attention_reference` one query at a time over exactly its live keys (positions 0..p of its slot):
    the same ops on the same shapes for a token at position p in any step, so its bits do not depend on the
    batch, the width or the context bucket (the CPU path of --batch-invariant). q [B, L, H, D]."""
    heads, head_dim = q.shape[2:]
    nkv = k_cache.shape[2]
    out = torch.empty_like(q)
    for b, (slot, row) in enumerate(zip(slots.tolist(), positions.tolist())):
        for i, p in enumerate(row):
            keys, values = k_cache[slot, : p + 1].transpose(0, 1), v_cache[slot, : p + 1].transpose(0, 1)
            query = q[b, i].view(nkv, heads // nkv, head_dim)  # [nkv, group, D]
            scores = torch.matmul(query, keys.transpose(1, 2)).float() * scale  # [nkv, group, p + 1]
            probs = scores.softmax(-1).to(values.dtype)
            out[b, i] = torch.matmul(probs, values).reshape(heads, head_dim)
    return out


def rotary_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cos: Tensor,
    sin: Tensor,
    positions: Tensor,
    slots: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    ctx_len: int,
    scale: float,
    prefix_slots: Tensor | None = None,
    prefix_len: Tensor | None = None,
) -> Tensor:
    """`rotary_attention` in eager torch: the rotary and cache write, then the attention over the cache."""
    q = rotary_and_cache_reference(q, k, v, cos, sin, positions, slots, k_cache, v_cache)
    prefix = dict(prefix_slots=prefix_slots, prefix_len=prefix_len)
    return attention_reference(q, k_cache, v_cache, slots, positions, ctx_len, scale, **prefix)
