"""GEMMs for decode / verify steps (few rows), each with the op that produces its input fused in front.

At B=1 a verify step has 5 rows. There cuBLAS reads the small matrices (o_proj 4.7 MB, qkv 6.3 MB on the
1.5B model) at 0.8-1.2 TB/s, and each RMSNorm and SiLU-and-mul between the GEMMs is one more CUDA-graph
node (about 4 us each: 85 of a step's 294). Here one kernel streams the weight once and computes its
input on the fly:

- `norm_linear`:  (x + residual ->) RMSNorm -> @ W.T (+ bias)    input_layernorm + qkv_proj,
                                                                  post_attention_layernorm + gate_up_proj
- `silu_linear`:  silu(gate) * up -> @ W.T                        SiLU-and-mul + down_proj
- `linear`:       x @ W.T                                         o_proj

Every program computes the RMSNorm statistics of all the rows itself (a [M, K] read from L2, where K is
the hidden size: cheaper than a launch); program 0 alone writes the residual stream x + residual. No
split-K, so the sum order, hence the result, does not depend on the launch. The roundings are those of
the unfused path (fused.add_rms_norm, fused.silu_and_mul, then a GEMM with fp32 accumulation), whose torch
references are the `*_reference` functions here; tests/test_small_linear.py compares the two.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import triton
import triton.language as tl
from torch import Tensor

from common.kernels import fused
from common.kernels.fused import add_rms_norm_reference, rms_norm_reference, silu_and_mul_reference

# Rows up to which the model takes these kernels (B=16 x width 5 = 80 fits); above, cuBLAS and the
# separate norm / SiLU kernels win. SPECSPLIT_SMALL_M_LINEAR=0 turns them off (A/B on the GPU).
MAX_ROWS = 128
ENABLED = os.environ.get("SPECSPLIT_SMALL_M_LINEAR", "1") != "0"
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

NONE, NORM, ADD_NORM, SILU = 0, 1, 2, 3  # the prologue: what the kernel computes its input from


def use_small_m(x: Tensor, weight: Tensor) -> bool:
    """Whether x [..., K] @ weight [N, K].T goes through these kernels: on the kernel path, with few
    enough rows, unless tuning found the unfused path faster for this shape."""
    rows = x.numel() // x.shape[-1]
    return ENABLED and fused.on_gpu(x) and rows <= MAX_ROWS and _config(rows, *weight.shape) is not None


@triton.jit
def _input_tile(
    x_ptr,
    res_ptr,
    nw_ptr,
    m,
    k,
    m_valid,
    k_valid,
    rstd,
    x_stride,
    res_stride,
    n_half,
    PROLOGUE: tl.constexpr,
    DTYPE: tl.constexpr,
):
    """The GEMM's input at rows m, columns k ([BLOCK_M, BLOCK_K] in DTYPE), computed from the producer's."""
    mask = m_valid[:, None] & k_valid[None, :]
    if PROLOGUE == 3:  # SILU: x = [gate | up], n_half columns each
        gate = tl.load(x_ptr + m[:, None] * x_stride + k[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + m[:, None] * x_stride + n_half + k[None, :], mask=mask, other=0.0)
        act = (gate / (1.0 + tl.exp(-gate))).to(DTYPE).to(tl.float32)
        return (act * up.to(tl.float32)).to(DTYPE)
    a = tl.load(x_ptr + m[:, None] * x_stride + k[None, :], mask=mask, other=0.0)
    if PROLOGUE == 2:  # ADD_NORM: the residual add rounds to the model dtype first, as eager x + r does
        r = tl.load(res_ptr + m[:, None] * res_stride + k[None, :], mask=mask, other=0.0)
        a = (a.to(tl.float32) + r.to(tl.float32)).to(DTYPE)
    if PROLOGUE == 1 or PROLOGUE == 2:
        y = (a.to(tl.float32) * rstd[:, None]).to(DTYPE).to(tl.float32)
        w = tl.load(nw_ptr + k, mask=k_valid, other=0.0).to(tl.float32)
        a = (y * w[None, :]).to(DTYPE)
    return a.to(DTYPE)


@triton.jit
def _small_m_linear_kernel(
    x_ptr,  # NONE/NORM/ADD_NORM: [M, K], row stride x_stride; SILU: [M, 2K] = [gate | up]
    res_ptr,  # [M, K] residual, row stride res_stride (ADD_NORM only)
    nw_ptr,  # [K] RMSNorm weight (NORM, ADD_NORM)
    w_ptr,  # [N, K] contiguous: the nn.Linear weight
    b_ptr,  # [N] bias (HAS_BIAS only)
    out_ptr,  # [M, N] contiguous, x's dtype
    res_out_ptr,  # [M, K] contiguous: x + residual (ADD_NORM only; written by program 0)
    M,
    N,
    K,
    x_stride,
    res_stride,
    eps,
    PROLOGUE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    pid = tl.program_id(0)
    m = tl.arange(0, BLOCK_M)
    m_valid = m < M
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = n < N
    dtype = out_ptr.dtype.element_ty
    rstd = tl.zeros([BLOCK_M], tl.float32)
    if PROLOGUE == 1 or PROLOGUE == 2:
        # RMSNorm statistics over the whole row, before the first weight tile can be used.
        sq = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_valid = k < K
            mask = m_valid[:, None] & k_valid[None, :]
            a = tl.load(x_ptr + m[:, None] * x_stride + k[None, :], mask=mask, other=0.0)
            if PROLOGUE == 2:
                r = tl.load(res_ptr + m[:, None] * res_stride + k[None, :], mask=mask, other=0.0)
                a = (a.to(tl.float32) + r.to(tl.float32)).to(dtype)
                if pid == 0:
                    tl.store(res_out_ptr + m[:, None] * K + k[None, :], a, mask=mask)
            af = a.to(tl.float32)
            sq += tl.sum(af * af, axis=1)
        rstd = 1.0 / tl.sqrt(sq / K + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_valid = k < K
        a = _input_tile(x_ptr, res_ptr, nw_ptr, m, k, m_valid, k_valid, rstd, x_stride, res_stride, K,
                        PROLOGUE, dtype)  # fmt: skip
        w = tl.load(w_ptr + n.to(tl.int64)[:, None] * K + k[None, :],
                    mask=n_valid[:, None] & k_valid[None, :], other=0.0)  # fmt: skip
        if DOT_FP32:
            acc += tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + m[:, None] * N + n[None, :], acc.to(dtype), mask=m_valid[:, None] & n_valid[None, :])


# (BLOCK_N, BLOCK_K, num_warps, num_stages) per (N, K, BLOCK_M), tuned on one H200 (bench/small_linear.py);
# None: the unfused path measured faster for that shape. Other shapes take `_default_config`.
# SPECSPLIT_SMALL_M_CONFIGS=<bench/small_linear.py's JSON> adds to / overrides them.
Config = tuple[int, int, int, int]
CONFIGS: dict[tuple[int, int, int], Config | None] = {}


def load_configs(path: str) -> None:
    for key, config in json.loads(Path(path).read_text())["configs"].items():
        n, k, block_m = (int(v) for v in key.split(","))
        CONFIGS[n, k, block_m] = tuple(config) if config is not None else None


if os.environ.get("SPECSPLIT_SMALL_M_CONFIGS"):
    load_configs(os.environ["SPECSPLIT_SMALL_M_CONFIGS"])


def _block_m(rows: int) -> int:
    return max(16, triton.next_power_of_2(rows))


def _config(rows: int, n: int, k: int) -> Config | None:
    block_m = _block_m(rows)
    key = (n, k, block_m)
    return CONFIGS[key] if key in CONFIGS else _default_config(block_m, n, k)


def _default_config(block_m: int, n: int, k: int) -> Config:
    """Enough programs to cover the SMs (N / BLOCK_N >= ~100 on the 1.5B shapes), deep K tiles so that
    each SM keeps enough weight bytes in flight."""
    block_n = 16 if n <= 8192 else 64
    block_k = 256 if block_m <= 16 else 64
    return block_n, block_k, 4, 4


def _launch(x2: Tensor, residual: Tensor | None, norm_weight: Tensor | None, eps: float, weight: Tensor,
            bias: Tensor | None, prologue: int) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    m = x2.shape[0]
    n, k = weight.shape
    out = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    res_out = torch.empty((m, k), dtype=x2.dtype, device=x2.device) if prologue == ADD_NORM else None
    if m == 0:
        return out, res_out
    block_m = _block_m(m)
    block_n, block_k, warps, stages = _config(m, n, k) or _default_config(block_m, n, k)
    if _INTERPRETED:
        block_k = min(block_k, 64)  # the interpreter's cost grows with the tile, not the launch count
    _small_m_linear_kernel[(triton.cdiv(n, block_n),)](
        x2, residual if residual is not None else x2, norm_weight if norm_weight is not None else weight,
        weight, bias if bias is not None else weight, out, res_out if res_out is not None else out,
        m, n, k, x2.stride(0), residual.stride(0) if residual is not None else 0, eps,
        PROLOGUE=prologue, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_FP32=_INTERPRETED or x2.dtype == torch.float32, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out, res_out


def _rows(x: Tensor) -> Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def norm_linear(
    x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float, weight: Tensor, bias: Tensor | None
) -> tuple[Tensor, Tensor]:
    """x, residual [..., K] (residual may be None) -> (rms_norm(x + residual) @ W.T + b [..., N],
    x + residual [..., K]); with residual None the second is x itself. One kernel."""
    x2 = _rows(x)
    r2 = _rows(residual) if residual is not None else None
    prologue = ADD_NORM if residual is not None else NORM
    out, res_out = _launch(x2, r2, norm_weight, eps, weight, bias, prologue)
    out = out.view(*x.shape[:-1], weight.shape[0])
    return out, (res_out.view(x.shape) if res_out is not None else x)


def silu_linear(x: Tensor, weight: Tensor) -> Tensor:
    """x [..., 2K] = [gate | up] -> (silu(gate) * up) @ W.T [..., N]. One kernel."""
    x2 = _rows(x)
    return _launch(x2, None, None, 0.0, weight, None, SILU)[0].view(*x.shape[:-1], weight.shape[0])


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [..., K] @ W.T (+ b) -> [..., N]. One kernel."""
    x2 = _rows(x)
    return _launch(x2, None, None, 0.0, weight, bias, NONE)[0].view(*x.shape[:-1], weight.shape[0])


def norm_linear_reference(
    x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float, weight: Tensor, bias: Tensor | None
) -> tuple[Tensor, Tensor]:
    if residual is None:
        h, summed = rms_norm_reference(x, norm_weight, eps), x
    else:
        h, summed = add_rms_norm_reference(x, residual, norm_weight, eps)
    return torch.nn.functional.linear(h, weight, bias), summed


def silu_linear_reference(x: Tensor, weight: Tensor) -> Tensor:
    return torch.nn.functional.linear(silu_and_mul_reference(x), weight)
