"""Skinny linear (few rows, a weight small enough to sit in the SMs' registers) that loads its weight
before the previous kernel has finished.

At B=1 a verify step has 5 rows; the qkv (2048 x 1536) and o_proj (1536 x 1536) GEMMs of the 1.5B
target read 6.3 and 4.7 MB and cuBLAS takes ~5.5 us for each (0.8-1.2 TB/s): too few bytes per SM to
hide the DRAM latency, plus the launch. Here each program owns BLOCK_N output features and loads their
whole [BLOCK_N, K] weight tile into registers *before* `gdc_wait`: launched with programmatic dependent
launch (PDL, Hopper on), the program starts while the kernel before it (an RMSNorm or the attention,
which signal `gdc_launch_dependents` at their start) still runs, so the weight read overlaps it. Only
the activations are read after the wait. Without PDL (older GPUs, SPECSPLIT_PDL=0) the same kernel runs
in the usual order.

A weight with more input features than one tile holds (the down projection: K = 8960 on the 1.5B) is
split over K: program (n, s) holds the [BLOCK_N, SPLIT_K] tile of chunk s and writes fp32 partial sums;
a second kernel (PDL too) adds the chunks in a fixed order and rounds once. cuBLAS does the same at these
shapes (split-K plus its own reduce kernel), but launches both without PDL and reads at 2.3 TB/s.

Every row is the same sum in the same order whatever M is (one tl.dot over K, or over each K chunk, per
row block): a row's output does not depend on the batch it is in, for M up to MAX_ROWS (one row block).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from common.kernels import fused

# SPECSPLIT_SKINNY_LINEAR=0 keeps cuBLAS for every GEMM (A/B comparisons).
ENABLED = os.environ.get("SPECSPLIT_SKINNY_LINEAR", "1") != "0"
# One H200, graphed 1.5B forward (docs/benchmarks.md, sixteenth session): with PDL, 1.586 -> 1.546 ms at
# B=1 (5 rows); at B=4 (20 rows, two row blocks) 1.709 -> 1.758 ms, a loss; without PDL a loss at both.
MAX_ROWS = 16
BLOCK_M = 16  # 32 needs 328 KB of shared memory for the dot's operands at K = 2048 (the H200 has 227)
# On a GPU only with PDL (without it cuBLAS is faster); under the CPU interpreter (tests) in stream order.
REQUIRE_PDL = not fused.INTERPRETED
MAX_K = 2048  # BLOCK_K = next power of 2 of K: the tile [BLOCK_N, BLOCK_K] bf16 stays in registers
# One wave of programs (N / BLOCK_N <= 2 x 132 SMs): only the first wave reads its weight early. With
# gate_up (17920 features) too, the B=1 forward took 2.27 ms against 1.55 (sixteenth session).
MAX_N = 4096
BLOCK_N = 16
# Split over K (see above): chunk size, and the most rows (a row block of 16 at a time, the weight tile
# held across them). Overridable for the A/B sweeps of bench/device_s17.sh.
SPLIT_K = int(os.environ.get("SPECSPLIT_SKINNY_SPLIT_K", "1024"))
SPLIT_BLOCK_N = int(os.environ.get("SPECSPLIT_SKINNY_SPLIT_BLOCK_N", "16"))
SPLIT_MAX_ROWS = int(os.environ.get("SPECSPLIT_SKINNY_SPLIT_ROWS", "16"))
SPLIT_WARPS = int(os.environ.get("SPECSPLIT_SKINNY_SPLIT_WARPS", "8"))  # 4 at 1024: 159 registers
SPLIT_MAX_K = 32768


@triton.jit
def _skinny_linear_kernel(
    x_ptr,  # [M, K] activations, row stride stride_x, unit column stride
    w_ptr,  # [N, K] weight, contiguous
    b_ptr,  # [N] bias (read only when HAS_BIAS)
    out_ptr,  # [M, N] contiguous, x's dtype; with SPLIT fp32 [cdiv(K, BLOCK_K), M, N], chunk s's sums
    M,
    N,
    K,
    stride_x,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,  # program_id(1) is the K chunk (no bias then)
    PDL: tl.constexpr,
    DOT_FP32: tl.constexpr,  # the CPU interpreter's bf16 tl.dot is wrong: upcast there
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    k = split * BLOCK_K + tl.arange(0, BLOCK_K)
    n_valid = n < N
    k_valid = k < K
    # The weight does not depend on the previous kernel: read it while that kernel still runs.
    w = tl.load(w_ptr + n.to(tl.int64)[:, None] * K + k[None, :], mask=n_valid[:, None] & k_valid[None, :],
                other=0.0)  # fmt: skip
    if HAS_BIAS:
        bias = tl.load(b_ptr + n, mask=n_valid, other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()  # the previous kernel's outputs (our x) are complete and visible
        tl.extra.cuda.gdc_launch_dependents()
    for m0 in range(0, M, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        m_valid = m < M
        x = tl.load(x_ptr + m.to(tl.int64)[:, None] * stride_x + k[None, :],
                    mask=m_valid[:, None] & k_valid[None, :], other=0.0)  # fmt: skip
        if DOT_FP32:
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w))  # 16-bit operands (`fits`), fp32 accumulation
        if HAS_BIAS:
            acc += bias[None, :]
        row = m
        if SPLIT:
            row += split * M
        tl.store(out_ptr + row.to(tl.int64)[:, None] * N + n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=m_valid[:, None] & n_valid[None, :])  # fmt: skip


@triton.jit
def _split_sum_kernel(
    part_ptr,  # fp32 [SPLITS, M, N]: the K chunks' partial sums
    out_ptr,  # [M, N] contiguous, the model dtype
    M,
    N,
    SPLITS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()  # the partial sums are complete
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLITS):  # a fixed order: the same sum whatever the batch
        acc += tl.load(part_ptr + (s * M + row).to(tl.int64) * N + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row.to(tl.int64) * N + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def fits(rows: int, weight: Tensor) -> bool:
    """Whether skinny_linear serves rows x weight [N, K] (else cuBLAS): contiguous 16-bit weights only
    (an fp32 tile would not fit in the registers)."""
    n, k = weight.shape
    return (
        0 < rows <= MAX_ROWS
        and k <= MAX_K
        and n <= MAX_N
        and weight.element_size() == 2
        and weight.is_contiguous()
    )


def fits_split(rows: int, weight: Tensor, bias: Tensor | None = None) -> bool:
    """Whether skinny_linear serves rows x weight [N, K] split over K (K > MAX_K, no bias)."""
    n, k = weight.shape
    return (
        0 < rows <= SPLIT_MAX_ROWS
        and MAX_K < k <= SPLIT_MAX_K
        and n <= MAX_N
        and bias is None
        and weight.element_size() == 2
        and weight.is_contiguous()
    )


def skinny_linear(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, split_k: int | None = None
) -> Tensor:
    """x [..., K] @ weight [N, K].T (+ bias [N]) -> [..., N] in x's dtype: one kernel where `fits` holds,
    else split over K in chunks of split_k (default SPLIT_K) and summed by a second (`fits_split`)."""
    n, k = weight.shape
    x2 = fused.rows_of(x)
    rows = x2.shape[0]
    opts = dict(DOT_FP32=fused.INTERPRETED, **fused.launch_options(x))
    if fits(rows, weight):
        out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
        _skinny_linear_kernel[(triton.cdiv(n, BLOCK_N),)](
            x2, weight, bias if bias is not None else weight, out, rows, n, k, x2.stride(0),
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=max(16, triton.next_power_of_2(k)),
            HAS_BIAS=bias is not None, SPLIT=False, num_warps=4, **opts,
        )  # fmt: skip
        return out.view(*x.shape[:-1], n)
    assert fits_split(rows, weight, bias), (tuple(x.shape), tuple(weight.shape), bias is not None)
    chunk = split_k or SPLIT_K
    splits = triton.cdiv(k, chunk)
    part = torch.empty((splits, rows, n), dtype=torch.float32, device=x.device)
    _skinny_linear_kernel[(triton.cdiv(n, SPLIT_BLOCK_N), splits)](
        x2, weight, weight, part, rows, n, k, x2.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=SPLIT_BLOCK_N,
        BLOCK_K=chunk, HAS_BIAS=False, SPLIT=True, num_warps=SPLIT_WARPS, **opts,
    )  # fmt: skip
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(n))
    _split_sum_kernel[(rows, triton.cdiv(n, block))](
        part, out, rows, n, SPLITS=splits, BLOCK=block, **fused.launch_options(x)
    )
    return out.view(*x.shape[:-1], n)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear, through skinny_linear on the GPU where it fits (every linear layer of the model calls it)."""
    if (
        ENABLED
        and fused.on_gpu(x)
        and (fused.pdl(x) or not REQUIRE_PDL)
        and (fits(rows := x.numel() // x.shape[-1], weight) or fits_split(rows, weight, bias))
    ):
        return skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def describe(x: Tensor) -> str:
    """The forward's kernel path for a model whose tensors are like x, for the start-up log."""
    if not fused.on_gpu(x):
        return "torch references"
    if not fused.pdl(x):
        return "Triton fused kernels, PDL off, cuBLAS GEMMs"
    small = (
        f"skinny_linear up to {MAX_ROWS} rows (split over K up to {SPLIT_MAX_ROWS})"
        if ENABLED
        else "skinny_linear off"
    )
    return f"Triton fused kernels with PDL, {small}, cuBLAS elsewhere"
