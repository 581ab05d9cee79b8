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
must round alike for bf16 speculative output to equal plain output. Splitting the dot into K-slices
summed after saves 0.01-0.02 ms at B=1 but makes bf16 speculative output diverge from plain far more often.

`stream_linear` is the other few-row GEMM: for a long K (the MLP's down projection, 1536 x 8960 in the
1.5B), where one register tile per program cannot hold the weight and cuBLAS runs a split-K GEMM and a
reduce kernel at 2.3 TB/s. Its programs stream [BLOCK_N, BLOCK_K] weight tiles through a software
pipeline over their split of K (the first tile read before `gdc_wait`), and a PDL kernel sums the splits'
fp32 partials in split order.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from common.kernels import fused, invariant, onednn

# SPECSPLIT_SKINNY_LINEAR=0 keeps cuBLAS for every GEMM (A/B comparisons).
ENABLED = os.environ.get("SPECSPLIT_SKINNY_LINEAR", "1") != "0"
# One row block: the graphed 1.5B forward gains at B=1 (5 rows) with PDL, and loses at 20 rows or without PDL.
MAX_ROWS = 16
BLOCK_M = 16  # 32 needs 328 KB of shared memory for the dot's operands at K = 2048 (sm_90 has 227)
# On a GPU only with PDL (without it cuBLAS is faster); under the CPU interpreter (tests) in stream order.
REQUIRE_PDL = not fused.INTERPRETED
MAX_K = 2048  # BLOCK_K = next power of 2 of K: the tile [BLOCK_N, BLOCK_K] bf16 stays in registers
# One wave of programs (N / BLOCK_N <= 2 x 132 SMs): only the first wave reads its weight early (gate_up's
# 17920 features made the B=1 forward 2.27 ms against 1.55).
MAX_N = 4096
BLOCK_N = 16

# stream_linear pays on a long K only: the 1.5B's down projection at 1-16 rows takes 9.1-9.5 us against
# cuBLAS's 11.7-12.0 (K split in 5, tiles 64 x 256, 4 stages), 80 rows 15.7 against 11.7. On weights over
# 64 MB (the 7B's down projection) cuBLAS streams faster (3.6 TB/s against 3.1-3.4).
STREAM_ENABLED = os.environ.get("SPECSPLIT_STREAM_LINEAR", "1") != "0"
STREAM_MIN_K = 4096
STREAM_MAX_BYTES = 64 << 20
STREAM_TILES = dict(block_n=64, block_k=256, stages=4)
STREAM_TILES_PER_SPLIT = 7  # K = 8960: 35 tiles of 256 -> 5 splits of 7
# Rows: a B=1 step, plain (1 row) and its width-5 verify (5 rows), both here, so they sum alike. More rows
# would run a plain step here and its verify (20-80 rows) in cuBLAS, which sums K in another order, and bf16
# speculative output would then diverge from plain; k <= 4 fits.
STREAM_MAX_ROWS = 5
# The MLP's gate_up GEMM with SiLU-and-mul in its epilogue (`stream_linear(glu=True)`) up to this many
# rows; 0: off (cuBLAS, then silu_and_mul). The 1.5B's graphed forward gains up to 16 rows (1.441 -> 1.356
# ms at 5, 1.597 -> 1.489 at 16) and loses from 20; a row's bits equal cuBLAS's (the GPU test
# test_glu_path_sums_as_cublas_on_the_1_5b_gate_up), so a plain step here and a verify in cuBLAS agree.
GLU_MAX_ROWS = int(os.environ.get("SPECSPLIT_GLU_MAX_ROWS", "16"))
GLU_TILES = dict(block_n=32, block_k=128, stages=4)
# A 128-row block (over 64 rows: a raised SPECSPLIT_GLU_MAX_ROWS) with 128-wide K tiles needs 240 KB of
# shared memory (sm_90 has 227): 64-wide K tiles there (the sweep's 36.7 us at 80 rows).
GLU_TILES_WIDE = dict(block_n=32, block_k=64, stages=4)


def _glu_tiles_by_block(spec: str) -> dict[int, dict]:
    """Row block -> tiles of stream_linear(glu=True): 16-64-row blocks GLU_TILES, 128 GLU_TILES_WIDE, with
    SPECSPLIT_GLU_TILES="BLOCK_M=block_n,block_k,stages,warps;..." overriding some (forward A/Bs of the
    tiles bench/glu_sweep.py --wide finds)."""
    table = {16: GLU_TILES, 32: GLU_TILES, 64: GLU_TILES, 128: GLU_TILES_WIDE}
    for item in filter(None, spec.split(";")):
        block, _, values = item.partition("=")
        try:
            bn, bk, stages, warps = (int(v) for v in values.split(","))
            if int(block) not in table:
                raise ValueError(f"row block {block} is not one of {sorted(table)}")
        except ValueError as e:
            want = "want BLOCK_M=block_n,block_k,stages,warps"
            raise ValueError(f"SPECSPLIT_GLU_TILES: {item!r}: {want} ({e})") from None
        table[int(block)] = dict(block_n=bn, block_k=bk, stages=stages, warps=warps)
    return table


GLU_TILES_BY_BLOCK = _glu_tiles_by_block(os.environ.get("SPECSPLIT_GLU_TILES", ""))


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


@triton.jit
def _dot_acc(x, w, acc, DOT_FP32: tl.constexpr):
    # acc [M, N] fp32 += x [M, K] @ w [N, K].T; the CPU interpreter's bf16 tl.dot is wrong: upcast there
    if DOT_FP32:
        return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(x, tl.trans(w), acc)


@triton.jit
def _stream_linear_kernel(
    x_ptr,  # [M, K] activations, row stride stride_x, unit column stride
    w_ptr,  # [N, K] weight, contiguous (GLU: [2N, K] = [gate; up])
    b_ptr,  # [N] bias (GLU: [2N]; read only when HAS_BIAS and SPLIT_K == 1)
    out_ptr,  # SPLIT_K == 1: [M, N] contiguous in x's dtype; else [SPLIT_K, M, N] fp32 partial sums
    M,
    N,
    K,
    stride_x,
    K_PER_SPLIT: tl.constexpr,  # a multiple of BLOCK_K
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PREFETCH: tl.constexpr,  # read the first weight tile before gdc_wait
    HAS_BIAS: tl.constexpr,
    GLU: tl.constexpr,  # out = silu(x @ gate.T) * (x @ up.T), each rounded to x's dtype first (SPLIT_K == 1)
    PDL: tl.constexpr,
    DOT_FP32: tl.constexpr,  # the CPU interpreter's bf16 tl.dot is wrong: upcast there
):
    # grid (N blocks, splits, row blocks). A row's sum: its split's K tiles in order, then the splits in
    # order (_split_sum_kernel): the same whatever the row count or BLOCK_M (16-128 rows a block gave the
    # same bits on the GPU).
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    kk = tl.arange(0, BLOCK_K)
    n_valid = n < N
    m_valid = m < M
    k_start = tl.program_id(1) * K_PER_SPLIT
    w_rows = w_ptr + n.to(tl.int64)[:, None] * K
    up_rows = w_rows + N * K  # GLU: the up projection's rows, N rows past the gate's
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_x
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)  # GLU only
    k_first = k_start
    if PREFETCH:  # the weight does not depend on the previous kernel: its first tile is read meanwhile
        w_mask = n_valid[:, None] & (k_start + kk < K)[None, :]
        w = tl.load(w_rows + (k_start + kk)[None, :], mask=w_mask, other=0.0)
        if GLU:
            w_up = tl.load(up_rows + (k_start + kk)[None, :], mask=w_mask, other=0.0)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    if PREFETCH:
        x = tl.load(x_rows + (k_start + kk)[None, :], mask=m_valid[:, None] & (k_start + kk < K)[None, :],
                    other=0.0)  # fmt: skip
        acc = _dot_acc(x, w, acc, DOT_FP32)
        if GLU:
            acc_up = _dot_acc(x, w_up, acc_up, DOT_FP32)
        k_first = k_start + BLOCK_K
    for k0 in tl.range(k_first, k_start + K_PER_SPLIT, BLOCK_K, num_stages=NUM_STAGES):
        k = k0 + kk
        w_mask = n_valid[:, None] & (k < K)[None, :]
        w = tl.load(w_rows + k[None, :], mask=w_mask, other=0.0)
        if GLU:
            w_up = tl.load(up_rows + k[None, :], mask=w_mask, other=0.0)
        x = tl.load(x_rows + k[None, :], mask=m_valid[:, None] & (k < K)[None, :], other=0.0)
        acc = _dot_acc(x, w, acc, DOT_FP32)
        if GLU:
            acc_up = _dot_acc(x, w_up, acc_up, DOT_FP32)
    out_mask = m_valid[:, None] & n_valid[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
            if GLU:
                acc_up += tl.load(b_ptr + N + n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
        out = acc.to(out_ptr.dtype.element_ty)
        if GLU:  # as the GEMM's output then silu_and_mul round it: gate and up to x's dtype, then the rest
            out = fused.silu_mul(out, acc_up.to(out_ptr.dtype.element_ty))
        tl.store(out_ptr + m.to(tl.int64)[:, None] * N + n[None, :], out, mask=out_mask)
    else:
        part = out_ptr + tl.program_id(1).to(tl.int64) * M * N
        tl.store(part + m.to(tl.int64)[:, None] * N + n[None, :], acc, mask=out_mask)


@triton.jit
def _split_sum_kernel(
    part_ptr,  # [SPLIT_K, total] fp32 partial sums
    b_ptr,  # [N] bias (read only when HAS_BIAS)
    out_ptr,  # [total] = [M, N] contiguous, the output dtype
    total,  # M * N
    N,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr,
):
    fused._kernel_start(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = i < total
    acc = tl.load(part_ptr + i, mask=valid, other=0.0)
    for s in tl.static_range(1, SPLIT_K):  # in split order, one by one
        acc += tl.load(part_ptr + s * total + i, mask=valid, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + i % N, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=valid)


def glu_streams(rows: int, weight: Tensor) -> bool:
    """Whether stream_linear(glu=True) serves rows x weight [2N, K] in the model (`GLU_MAX_ROWS`)."""
    return 0 < rows <= GLU_MAX_ROWS and weight.element_size() == 2 and weight.is_contiguous()


def _row_block(rows: int) -> int:
    # One row block up to 128 rows (16-128-row blocks give a row the same bits on the GPU).
    return min(128, max(16, triton.next_power_of_2(rows)))


def streams(rows: int, weight: Tensor) -> bool:
    """Whether stream_linear serves rows x weight [N, K] in the model (else cuBLAS): a long K, 16-bit."""
    return (
        0 < rows <= STREAM_MAX_ROWS
        and weight.shape[1] >= STREAM_MIN_K
        and weight.numel() * weight.element_size() <= STREAM_MAX_BYTES
        and weight.element_size() == 2
        and weight.is_contiguous()
    )


def stream_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    block_n: int = STREAM_TILES["block_n"],
    block_k: int = STREAM_TILES["block_k"],
    stages: int = STREAM_TILES["stages"],
    split_k: int | None = None,
    prefetch: bool = True,
    block_m: int = 16,
    warps: int = 4,
    glu: bool = False,
) -> Tensor:
    """x [..., K] @ weight [N, K].T (+ bias [N]) -> [..., N] in x's dtype: the streaming kernel, then (K
    split in more than one) the split sum. glu: weight [2N, K] = [gate; up] (bias [2N]) and the result is
    silu(gate's) * up's [..., N], the activation in the GEMM's epilogue (the MLP's gate_up and
    SiLU-and-mul in one kernel; K not split). The keywords are the tiles (bench/stream_sweep.py and
    bench/glu_sweep.py sweep them); split_k None: STREAM_TILES_PER_SPLIT tiles of K per split."""
    n, k = weight.shape
    x2 = fused.rows_of(x)
    rows = x2.shape[0]
    tiles = triton.cdiv(k, block_k)
    if glu:
        assert n % 2 == 0 and split_k in (None, 1), (tuple(weight.shape), split_k)
        n, split_k = n // 2, 1
    if split_k is None:
        split_k = max(1, round(tiles / STREAM_TILES_PER_SPLIT))
    k_per_split = triton.cdiv(tiles, split_k) * block_k
    split_k = triton.cdiv(k, k_per_split)  # no empty split
    opts = fused.launch_options(x)
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    target = out if split_k == 1 else torch.empty((split_k, rows, n), dtype=torch.float32, device=x.device)
    _stream_linear_kernel[(triton.cdiv(n, block_n), split_k, triton.cdiv(rows, block_m))](
        x2, weight, bias if bias is not None else weight, target, rows, n, k, x2.stride(0),
        K_PER_SPLIT=k_per_split, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
        NUM_STAGES=stages, PREFETCH=prefetch, HAS_BIAS=bias is not None, GLU=glu, DOT_FP32=fused.INTERPRETED,
        num_warps=warps, **opts,
    )  # fmt: skip
    if split_k > 1:
        block = 1024
        _split_sum_kernel[(triton.cdiv(rows * n, block),)](
            target, bias if bias is not None else weight, out, rows * n, n, SPLIT_K=split_k, BLOCK=block,
            HAS_BIAS=bias is not None, **opts,
        )  # fmt: skip
    return out.view(*x.shape[:-1], n)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, glu: bool = False) -> Tensor:
    """F.linear, through skinny_linear or stream_linear on the GPU where they fit (every linear layer of
    the model calls it). Which kernel serves a call depends only on its row count and the weight.

    glu: weight [2N, K] = [gate; up] and the result silu(gate's) * up's [..., N] (the MLP's gate_up):
    one stream_linear where `glu_streams`, else the GEMM and then `fused.silu_and_mul`. Inside
    `invariant.batch_invariant()`: the batch-invariant GEMM for every row count."""
    if invariant.active():
        out = invariant.linear(x, weight, bias)
        if not glu:
            return out
        return fused.silu_and_mul(out) if fused.on_gpu(x) else fused.silu_and_mul_reference(out)
    kernels = fused.on_gpu(x) and (fused.pdl(x) or not REQUIRE_PDL)
    rows = x.numel() // x.shape[-1]
    if glu:
        if kernels and STREAM_ENABLED and glu_streams(rows, weight):
            block_m = _row_block(rows)
            return stream_linear(x, weight, bias, glu=True, block_m=block_m, **GLU_TILES_BY_BLOCK[block_m])
        out = linear(x, weight, bias)
        return fused.silu_and_mul(out) if fused.on_gpu(x) else fused.silu_and_mul_reference(out)
    if kernels:
        if ENABLED and fits(rows, weight):
            return skinny_linear(x, weight, bias)
        if STREAM_ENABLED and streams(rows, weight):
            return stream_linear(x, weight, bias)
    elif (out := onednn.linear(x, weight, bias)) is not None:  # the CPU, a weight packed at load
        return out
    return F.linear(x, weight, bias)


def describe(x: Tensor) -> str:
    """The forward's kernel path for a model whose tensors are like x, for the start-up log."""
    if not fused.on_gpu(x):
        return "torch references, oneDNN packed linears" if onednn.available() else "torch references"
    if not fused.pdl(x):
        return "Triton fused kernels, PDL off, cuBLAS GEMMs"
    small = f"skinny_linear up to {MAX_ROWS} rows" if ENABLED else "skinny_linear off"
    long = "stream_linear off"
    if STREAM_ENABLED:
        long = f"stream_linear for K >= {STREAM_MIN_K} up to {STREAM_MAX_ROWS} rows"
        if GLU_MAX_ROWS:
            long += f" and for gate_up + SiLU up to {GLU_MAX_ROWS} rows"
    return f"Triton fused kernels with PDL, {small}, {long}, cuBLAS elsewhere"
