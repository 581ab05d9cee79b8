"""The few-row GEMMs with their producer fused in front (common/kernels/small_linear.py) against their torch
references: (residual add +) RMSNorm -> linear (+ bias), SiLU-and-mul -> linear, plain linear. Shapes
that are not multiples of the tiles (rows, N and K) exercise every mask. CPU: under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

from common.kernels import small_linear as sl

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _tol(dtype, k):
    # fp32: summation order only. bf16: the output's rounding step (2^-8 relative) on values of size
    # ~sqrt(k) (unit-variance inputs and weights of std 1/sqrt(k) give outputs of ~1).
    return (1e-4, 1e-4) if dtype == torch.float32 else (2e-2, 2e-2)


def _data(m, n, k, dtype, seed, gate_up=False):
    g = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(m, 2 * k if gate_up else k, generator=g)).to(dtype)
    res = torch.randn(m, k, generator=g).to(dtype)
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    return [t.to(DEVICE) for t in (x, res, nw, w, b)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 48, 64), (5, 40, 96), (20, 33, 160)])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_norm_linear_matches_reference(dtype, m, n, k, with_residual, with_bias):
    x, res, nw, w, b = _data(m, n, k, dtype, seed=m + n)
    res = res if with_residual else None
    b = b if with_bias else None
    got, got_res = sl.norm_linear(x, res, nw, 1e-6, w, b)
    want, want_res = sl.norm_linear_reference(x, res, nw, 1e-6, w, b)
    assert got.shape == want.shape == (m, n) and got.dtype == dtype
    rtol, atol = _tol(dtype, k)
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)
    if with_residual and (DEVICE == "cuda" or dtype == torch.float32):
        assert torch.equal(got_res, want_res)  # the residual stream is the plain add, bit for bit
    else:  # no residual: x itself; or the interpreter's fp32 -> bf16 truncation (not round to nearest)
        torch.testing.assert_close(got_res.float(), want_res.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 32, 64), (5, 24, 200)])
def test_silu_linear_matches_reference(dtype, m, n, k):
    x, _, _, w, _ = _data(m, n, k, dtype, seed=7 + m, gate_up=True)
    got, want = sl.silu_linear(x, w), sl.silu_linear_reference(x, w)
    assert got.shape == want.shape == (m, n)
    torch.testing.assert_close(got.float(), want.float(), rtol=_tol(dtype, k)[0], atol=_tol(dtype, k)[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_matches_torch_and_keeps_leading_dims(dtype):
    x, _, _, w, b = _data(10, 36, 80, dtype, seed=11)
    x = x.view(2, 5, 80)
    got = sl.linear(x, w, b)
    assert got.shape == (2, 5, 36)
    want = torch.nn.functional.linear(x, w, b)
    torch.testing.assert_close(got.float(), want.float(), rtol=_tol(dtype, 80)[0], atol=_tol(dtype, 80)[1])


def test_norm_linear_reads_strided_rows():
    """The model hands views (a [B, L, K] slice of a wider buffer); rows are read through the stride."""
    x, res, nw, w, b = _data(6, 24, 64, torch.float32, seed=13)
    wide = torch.zeros(6, 100, device=DEVICE)
    wide[:, 10:74] = x
    view = wide[:, 10:74]
    got, _ = sl.norm_linear(view, res, nw, 1e-6, w, b)
    want, _ = sl.norm_linear_reference(x, res, nw, 1e-6, w, b)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_use_small_m_on_the_kernel_path_below_the_row_limit_unless_tuned_off(monkeypatch):
    w = torch.zeros(16, 8)
    assert not sl.use_small_m(torch.zeros(2, 8), w)  # CPU: the torch path
    monkeypatch.setattr(sl.fused, "on_gpu", lambda x: True)
    assert sl.use_small_m(torch.zeros(sl.MAX_ROWS, 8), w)
    assert not sl.use_small_m(torch.zeros(sl.MAX_ROWS + 1, 8), w)
    monkeypatch.setitem(sl.CONFIGS, (16, 8, 16), None)  # tuning found the unfused path faster
    assert not sl.use_small_m(torch.zeros(5, 8), w)
    assert sl.use_small_m(torch.zeros(17, 8), w)  # another row bucket


def test_tuned_configs_load_from_the_bench_json(tmp_path, monkeypatch):
    monkeypatch.setattr(sl, "CONFIGS", {})
    path = tmp_path / "small_linear.json"
    path.write_text('{"configs": {"2048,1536,16": [32, 256, 4, 3], "1536,8960,128": null}}')
    sl.load_configs(str(path))
    assert sl.CONFIGS == {(2048, 1536, 16): (32, 256, 4, 3), (1536, 8960, 128): None}
