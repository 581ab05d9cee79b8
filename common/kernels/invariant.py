"""Batch-invariant linear layers: a row's output bits do not depend on the other rows of the call.

Greedy speculative decoding is lossless in exact arithmetic, but in bf16 the target's verify of k + 1
positions per request runs its GEMMs over (k + 1) x B rows where a plain step runs B, and cuBLAS (like
any tuned GEMM) picks its algorithm, tile and split of K by row count: the same token's logits then
differ in the last bits, and where the target's top two candidates are that close, speculative output
takes the other one. `--batch-invariant` runs every GEMM of the target through the one kernel here, with
one tile shape for every row count and no split of K: each output element is the same fp32 sum over K in
the same order (BLOCK_K slices, ascending) wherever its row sits, so a token's logits are the same bits in
a plain step, a verify step and a prefill, at any batch.

Terms: a row is one token's activations [K]; M rows, N output features. The tiles are fixed, so the
kernel is slower than cuBLAS where cuBLAS would choose otherwise (few rows: one program per BLOCK_N
features, no split of K; many rows: a tile smaller than the best).

`invariant_linear_reference` is the CPU path: one GEMV per row, so a row's result cannot depend on the
others either.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from common.kernels import fused

# One tile per weight for every row count (a row's bits depend on the tile's K slices and, through the MMA
# instruction chosen, on its shape): 64 rows (Hopper's wgmma row block), 64-wide K slices, and BLOCK_N
# features chosen from the weight's N alone (`block_n`).
BLOCK_M, BLOCK_K = 64, 64
NUM_WARPS, NUM_STAGES = 4, 3
# A few-row step is bound by the weight read, and with no split of K only N / BLOCK_N programs read it:
# narrower tiles for narrow weights keep at least ~96 programs streaming (the 1.5B's o_proj and down
# projection, N = 1536: 96 programs of 16 features, against 24 of 64).
MIN_PROGRAMS = 96


def block_n(n: int) -> int:
    """Output features per program for a weight of n output features (never the row count)."""
    for width in (64, 32):
        if triton.cdiv(n, width) >= MIN_PROGRAMS:
            return width
    return 16


@contextmanager
def batch_invariant(on: bool = True) -> Iterator[None]:
    """Within this context (this thread), `active()` says whether the model's GEMMs and attention take
    their batch-invariant paths (a target's forward under --batch-invariant; CUDA graphs captured inside
    it keep those kernels)."""
    token = fused.BATCH_INVARIANT.set(on)
    try:
        yield
    finally:
        fused.BATCH_INVARIANT.reset(token)


def active() -> bool:
    return fused.BATCH_INVARIANT.get()


@triton.jit
def _invariant_linear_kernel(
    x_ptr,  # [M, K] activations, row stride stride_x, unit column stride
    w_ptr,  # [N, K] weight, contiguous
    b_ptr,  # [N] bias (read only when HAS_BIAS)
    out_ptr,  # [M, N] contiguous, x's dtype
    M,
    N,
    K,
    stride_x,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_FP32: tl.constexpr,  # the CPU interpreter's bf16 tl.dot is wrong: upcast there
):
    # Programs walk the rows fastest: those sharing a weight tile run together and share it through L2.
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_valid, n_valid = m < M, n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # ascending K slices: the same order for every row
        k = k0 + tl.arange(0, BLOCK_K)
        k_valid = k < K
        x = tl.load(x_ptr + m.to(tl.int64)[:, None] * stride_x + k[None, :],
                    mask=m_valid[:, None] & k_valid[None, :], other=0.0)  # fmt: skip
        w = tl.load(w_ptr + n.to(tl.int64)[:, None] * K + k[None, :],
                    mask=n_valid[:, None] & k_valid[None, :], other=0.0)  # fmt: skip
        if DOT_FP32:
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + m.to(tl.int64)[:, None] * N + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_valid[:, None] & n_valid[None, :])  # fmt: skip


def invariant_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [..., K] @ weight [N, K].T (+ bias [N]) -> [..., N] in x's dtype; row i's bits depend only on
    x's row i (one kernel, one tile shape for every row count)."""
    n, k = weight.shape
    x2 = fused.rows_of(x)
    rows = x2.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows:
        bn = block_n(n)
        grid = (triton.cdiv(rows, BLOCK_M), triton.cdiv(n, bn))
        _invariant_linear_kernel[grid](
            x2, weight.contiguous(), bias if bias is not None else weight, out, rows, n, k, x2.stride(0),
            BLOCK_M=BLOCK_M, BLOCK_N=bn, BLOCK_K=BLOCK_K, HAS_BIAS=bias is not None,
            DOT_FP32=fused.INTERPRETED or x.dtype == torch.float32,  # fp32: ieee, not tf32
            num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        )  # fmt: skip
    return out.view(*x.shape[:-1], n)


def invariant_linear_reference(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """The same contract in torch (the CPU path): one GEMV per row."""
    x2 = x.reshape(-1, x.shape[-1])
    rows = [F.linear(x2[i : i + 1], weight, bias) for i in range(x2.shape[0])]
    out = torch.cat(rows) if rows else x2.new_empty((0, weight.shape[0]))
    return out.view(*x.shape[:-1], weight.shape[0])


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """The batch-invariant GEMM for x's device: the kernel where the model runs Triton kernels, else the
    per-row reference."""
    if fused.on_gpu(x):
        return invariant_linear(x, weight, bias)
    return invariant_linear_reference(x, weight, bias)
