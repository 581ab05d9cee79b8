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

Every row is the same sum in the same order whatever M is (one tl.dot over K per row block): a row's
output does not depend on the batch it is in, for M up to MAX_ROWS (one row block).

Keep that one dot over K, accumulated in K order as cuBLAS does: a plain step at B <= 16 runs qkv and
o_proj here while the verify of a speculative step at B >= 4 (20-80 rows) runs them in cuBLAS, and the two
must round alike for bf16 speculative output to equal plain output. Splitting the dot into 8 K-slices on 8
warps, summed after (seventeenth session, 28d95eb), saved 0.01-0.02 ms at B=1 but at B=16 left 0/16
speculative sequences equal to plain against 14/16 (every divergence a tie of 0-2 bf16 steps: lossless,
but eight times as many; docs/benchmarks.md).
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


@triton.jit
def _skinny_linear_kernel(
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
    PDL: tl.constexpr,
    DOT_FP32: tl.constexpr,  # the CPU interpreter's bf16 tl.dot is wrong: upcast there
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
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
        tl.store(out_ptr + m.to(tl.int64)[:, None] * N + n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=m_valid[:, None] & n_valid[None, :])  # fmt: skip


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


def skinny_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [..., K] @ weight [N, K].T (+ bias [N]) -> [..., N] in x's dtype, one kernel; `fits` must hold."""
    n, k = weight.shape
    x2 = fused.rows_of(x)
    rows = x2.shape[0]
    assert fits(rows, weight), (tuple(x.shape), tuple(weight.shape))
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    _skinny_linear_kernel[(triton.cdiv(n, BLOCK_N),)](
        x2, weight, bias if bias is not None else weight, out, rows, n, k, x2.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=max(16, triton.next_power_of_2(k)),
        HAS_BIAS=bias is not None, DOT_FP32=fused.INTERPRETED, num_warps=4, **fused.launch_options(x),
    )  # fmt: skip
    return out.view(*x.shape[:-1], n)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear, through skinny_linear on the GPU where it fits (every linear layer of the model calls it)."""
    if (
        ENABLED
        and fused.on_gpu(x)
        and (fused.pdl(x) or not REQUIRE_PDL)
        and fits(x.numel() // x.shape[-1], weight)
    ):
        return skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def describe(x: Tensor) -> str:
    """The forward's kernel path for a model whose tensors are like x, for the start-up log."""
    if not fused.on_gpu(x):
        return "torch references"
    if not fused.pdl(x):
        return "Triton fused kernels, PDL off, cuBLAS GEMMs"
    small = f"skinny_linear up to {MAX_ROWS} rows" if ENABLED else "skinny_linear off"
    return f"Triton fused kernels with PDL, {small}, cuBLAS elsewhere"
