"""skinny_linear (common/kernels/skinny.py: the few-row GEMM that reads its weight before the kernel ahead
of it has finished) and stream_linear (the few-row GEMM for a long K, split-K) against F.linear; each row's
output independent of the rows beside it; which GEMMs the model sends to each; and on the GPU, a bf16
model's graphed forward with them and programmatic dependent launch (PDL) against the same forward in
plain stream order, replay after replay (a read before its `gdc_wait` would show up there as a replay
that differs). On the CPU under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.distributed import Comm, init_tp
from common.kernels import fused, onednn, skinny
from common.kv_cache import KVCache
from common.loader import load_model
from common.models.generate import forward_rows
from tests.tiny import make_tiny_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _operands(rows: int, n: int, k: int, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).bfloat16().to(DEVICE)
    w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16().to(DEVICE)
    b = torch.randn(n, generator=g).bfloat16().to(DEVICE) if bias else None
    return x, w, b


@pytest.mark.parametrize(
    "rows,n,k,bias",
    [(1, 48, 40, True), (5, 64, 96, False), (5, 2048, 1536, True), (16, 33, 64, True), (16, 16, 2048, False)],
)
def test_skinny_linear_matches_f_linear(rows, n, k, bias):
    """Against F.linear in fp32 on the same bf16 operands: within one bf16 rounding of the output (N not a
    multiple of BLOCK_N, K not a power of 2, 1-16 rows, with and without bias)."""
    x, w, b = _operands(rows, n, k, bias)
    got = skinny.skinny_linear(x, w, b)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # bf16 keeps 8 bits: half an ulp is 2^-8 relative; the CPU interpreter truncates instead (a whole ulp).
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=2**-7 * want.abs().max().item())


def test_skinny_linear_rows_are_independent_of_the_batch():
    """Each row's output is bit-for-bit the same alone, among 5 rows, or among 16 (what makes a request's
    verify independent of its batch-mates up to 16 rows: no cuBLAS kernel switch by M)."""
    x, w, b = _operands(16, 96, 160, True, seed=1)
    full = skinny.skinny_linear(x, w, b)
    five = skinny.skinny_linear(x[:5], w, b)
    assert torch.equal(five, full[:5])
    for r in (0, 3, 15):
        assert torch.equal(skinny.skinny_linear(x[r : r + 1], w, b), full[r : r + 1])


def test_fits_keeps_cublas_for_wide_long_or_fp32():
    w = torch.empty(2048, 1536, dtype=torch.bfloat16)
    assert skinny.fits(1, w) and skinny.fits(16, w)
    assert not skinny.fits(17, w) and not skinny.fits(0, w)
    assert not skinny.fits(5, torch.empty(17920, 1536, dtype=torch.bfloat16))  # gate_up of the 1.5B
    assert not skinny.fits(5, torch.empty(1536, 8960, dtype=torch.bfloat16))  # down of the 1.5B
    assert not skinny.fits(5, torch.empty(2048, 1536))  # fp32: the tile would not fit in registers


@pytest.mark.parametrize(
    "rows,n,k,bias,split_k",
    [(1, 64, 8960, False, None), (5, 96, 1000, True, 3), (16, 40, 640, True, 1), (3, 64, 4096, False, 2)],
)
def test_stream_linear_matches_f_linear(rows, n, k, bias, split_k):
    """Against F.linear in fp32 on the same bf16 operands, within one bf16 rounding: K split (the default
    rule: 8960 -> 5 splits of 7 tiles) or not, N not a multiple of the tile, K not a multiple of a split
    or a tile, the bias added once (in the split sum when K is split)."""
    x, w, b = _operands(rows, n, k, bias, seed=2)
    tiles = dict(block_n=32, block_k=64, stages=2) if k < 8960 else {}
    got = skinny.stream_linear(x, w, b, split_k=split_k, **tiles)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=2**-7 * want.abs().max().item())


def test_stream_linear_rows_are_independent_of_the_batch():
    """A row's output is bit-for-bit the same alone, among 5 or among 16 rows, and from 16- or 32-row
    blocks: what keeps a B=1 plain step (1 row) and its width-5 verify (5 rows) alike."""
    x, w, b = _operands(16, 64, 1280, True, seed=3)
    tiles = dict(block_n=32, block_k=64, stages=2, split_k=4)
    full = skinny.stream_linear(x, w, b, **tiles)
    assert torch.equal(skinny.stream_linear(x[:5], w, b, **tiles), full[:5])
    assert torch.equal(skinny.stream_linear(x, w, b, block_m=32, **tiles), full)
    for r in (0, 7, 15):
        assert torch.equal(skinny.stream_linear(x[r : r + 1], w, b, **tiles), full[r : r + 1])


@pytest.mark.parametrize("rows,bias,block_m", [(1, False, 16), (5, True, 16), (20, True, 32)])
def test_stream_linear_glu_is_the_gemm_then_silu_and_mul(rows, bias, block_m):
    """glu: the gate and up halves' sums, rounded, then silu_and_mul's arithmetic in the epilogue: bit for
    bit the unfused GEMM (same tiles, K not split) followed by the silu_and_mul kernel; the bias added to
    both halves; N not a multiple of the tile."""
    x, w, b = _operands(rows, 2 * 40, 192, bias, seed=8)
    tiles = dict(block_n=16, block_k=64, stages=2, block_m=block_m)
    got = skinny.stream_linear(x, w, b, glu=True, **tiles)
    assert got.shape == (rows, 40) and got.dtype == torch.bfloat16
    assert torch.equal(got, fused.silu_and_mul(skinny.stream_linear(x, w, b, split_k=1, **tiles)))
    with pytest.raises(AssertionError):
        skinny.stream_linear(x, w, b, glu=True, split_k=2, **tiles)  # the epilogue needs whole sums


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_glu_path_sums_as_cublas_on_the_1_5b_gate_up(monkeypatch):
    """The lossless premise of GLU_MAX_ROWS: on the 1.5B's gate_up (2 x 8960 x 1536, bf16) `linear(glu=True)`
    through stream_linear gives bit for bit those rows of cuBLAS's 80-row GEMM then silu_and_mul (B=16's
    verify), at the rows it serves by default (1, 5, 16: plain steps and B=1's verify) and at 80 with the
    wide tiles (a raised limit), so a plain step in it and that verify in cuBLAS pick the same tokens.
    Power: the silu_and_mul of a GEMM whose K is summed in another order (two halves added) differs."""
    monkeypatch.setattr(skinny, "GLU_MAX_ROWS", 80)
    monkeypatch.setattr(skinny, "REQUIRE_PDL", False)
    x, w, _ = _operands(80, 2 * 8960, 1536, False, seed=11)
    want = fused.silu_and_mul(F.linear(x, w))
    for rows in (1, 5, 16, 80):
        assert skinny.glu_streams(rows, w)
        assert torch.equal(skinny.linear(x[:rows], w, glu=True), want[:rows]), rows
    halves = F.linear(x[:, :768], w[:, :768]).float() + F.linear(x[:, 768:], w[:, 768:]).float()
    assert not torch.equal(fused.silu_and_mul(halves.bfloat16()), want)


def test_glu_tiles_by_row_block_and_their_flag():
    """SPECSPLIT_GLU_TILES overrides the tiles of some row blocks (forward A/Bs); a bad entry is a
    load-time error naming the flag and the entry."""
    table = skinny._glu_tiles_by_block("")
    assert table[16] == table[64] == skinny.GLU_TILES and table[128] == skinny.GLU_TILES_WIDE
    table = skinny._glu_tiles_by_block("128=128,64,3,8;32=64,128,3,4")
    assert table[128] == dict(block_n=128, block_k=64, stages=3, warps=8)
    assert table[32] == dict(block_n=64, block_k=128, stages=3, warps=4) and table[16] == skinny.GLU_TILES
    for bad in ("24=64,64,3,8", "128=64,64,3", "128=a,64,3,8"):
        with pytest.raises(ValueError, match=f"SPECSPLIT_GLU_TILES: '{bad}'"):
            skinny._glu_tiles_by_block(bad)


def test_model_sends_gate_up_to_the_glu_kernel_when_on(tmp_path, monkeypatch):
    """With GLU_MAX_ROWS at 64, each layer's gate_up GEMM and SiLU-and-mul are one stream_linear(glu) call
    at 5 rows and at 40 (no silu_and_mul kernel); with stream_linear off the GEMM then silu_and_mul. The
    hidden states match within bf16 rounding."""
    path = make_tiny_model(tmp_path / "m", seed=9, num_layers=2, architecture="Qwen2ForCausalLM")
    model = load_model(path, Comm(), device=DEVICE, dtype=torch.bfloat16)
    cfg = model.config
    monkeypatch.setattr(skinny, "STREAM_MIN_K", 1 << 20)  # the down projection stays on cuBLAS here
    calls = []
    real, real_silu = skinny.stream_linear, fused.silu_and_mul
    monkeypatch.setattr(
        skinny,
        "stream_linear",
        lambda x, w, b=None, **kw: calls.append((tuple(w.shape), kw["glu"])) or real(x, w, b, **kw),
    )
    monkeypatch.setattr(fused, "silu_and_mul", lambda x: calls.append("silu") or real_silu(x))
    monkeypatch.setattr(skinny, "GLU_MAX_ROWS", 64)
    runs = _forwards_with_and_without(model, monkeypatch, "STREAM_ENABLED", calls)
    gate_up = ((2 * cfg.intermediate_size, cfg.hidden_size), True)
    assert runs[True] == ([gate_up] * 2, [gate_up] * 4)
    assert runs[False] == (["silu"] * 2, ["silu"] * 4)


def test_streams_takes_a_long_k_at_few_rows_only():
    down = torch.empty(1536, 8960, dtype=torch.bfloat16)  # the 1.5B's down projection
    assert skinny.streams(1, down) and skinny.streams(5, down) and not skinny.fits(5, down)
    assert not skinny.streams(6, down) and not skinny.streams(0, down)  # B=1's plain and verify steps only
    assert not skinny.streams(5, torch.empty(17920, 1536, dtype=torch.bfloat16))  # gate_up: cuBLAS
    assert not skinny.streams(5, torch.empty(1536, 8960))  # fp32
    assert not skinny.streams(5, down.t())  # not contiguous
    assert not skinny.streams(5, torch.empty(3584, 18944, dtype=torch.bfloat16))  # the 7B's: cuBLAS


def _forwards_with_and_without(model, monkeypatch, switch: str, calls: list) -> dict:
    """A bf16 model on the kernel path (interpreted on the CPU), skinny's flag `switch` on and off: a 5-row
    forward, then a 40-row prefill. {on: (calls during the 5 rows, all calls)}; the two hidden states of the
    5 rows match within bf16 rounding."""
    monkeypatch.setattr(fused, "on_gpu", lambda x: True)
    runs, outs = {}, {}
    for enabled in (True, False):
        monkeypatch.setattr(skinny, switch, enabled)
        calls.clear()
        cache = KVCache.for_model(model, 2, 64)
        with torch.inference_mode():
            outs[enabled] = forward_rows(model, cache, [0], [0], [[5, 6, 7, 8, 9]]).float()
            five = list(calls)
            forward_rows(model, cache, [1], [0], [list(range(40))])
        runs[enabled] = (five, list(calls))
    torch.testing.assert_close(outs[True], outs[False], rtol=0.05, atol=0.05)
    return runs


def test_model_sends_its_small_projections_to_skinny(tmp_path, monkeypatch):
    """qkv and o_proj of each layer (and the small MLP here) go to skinny_linear at 5 rows, to cuBLAS at 40
    rows or with skinny_linear off; the hidden states match the all-cuBLAS path within bf16 rounding."""
    path = make_tiny_model(tmp_path / "m", seed=4, num_layers=2, architecture="Qwen2ForCausalLM")
    model = load_model(path, Comm(), device=DEVICE, dtype=torch.bfloat16)
    calls = []
    real = skinny.skinny_linear
    monkeypatch.setattr(
        skinny, "skinny_linear", lambda x, w, b=None: calls.append(tuple(w.shape)) or real(x, w, b)
    )
    runs = _forwards_with_and_without(model, monkeypatch, "ENABLED", calls)
    five, everything = runs[True]
    cfg = model.config
    hd = cfg.head_dim
    qkv = ((cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd, cfg.hidden_size)
    assert five.count(qkv) == 2 and five.count((cfg.hidden_size, cfg.num_attention_heads * hd)) == 2
    assert everything == five  # the 40-row prefill: none
    assert runs[False] == ([], [])


def test_model_sends_its_down_projection_to_stream(tmp_path, monkeypatch):
    """With the long-K threshold at the tiny model's MLP width, each layer's down projection goes to
    stream_linear at 5 rows and to cuBLAS at 40 (the prefill); the hidden states match the all-cuBLAS path
    within bf16 rounding."""
    path = make_tiny_model(tmp_path / "m", seed=5, num_layers=2, architecture="Qwen2ForCausalLM")
    model = load_model(path, Comm(), device=DEVICE, dtype=torch.bfloat16)
    cfg = model.config
    monkeypatch.setattr(skinny, "ENABLED", False)  # skinny_linear off: only the stream path differs
    monkeypatch.setattr(skinny, "STREAM_MIN_K", cfg.intermediate_size)
    monkeypatch.setattr(skinny, "GLU_MAX_ROWS", 0)  # gate_up stays on cuBLAS: only the down projection
    calls = []
    real = skinny.stream_linear
    monkeypatch.setattr(
        skinny, "stream_linear", lambda x, w, b=None: calls.append(tuple(w.shape)) or real(x, w, b)
    )
    runs = _forwards_with_and_without(model, monkeypatch, "STREAM_ENABLED", calls)
    down = (cfg.hidden_size, cfg.intermediate_size)
    assert runs[True] == ([down] * 2, [down] * 2) and runs[False] == ([], [])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("stream_min_k,glu_rows", [(4096, 0), (1024, 0), (4096, 80)])
def test_graphed_pdl_forward_equals_stream_order(tmp_path, monkeypatch, stream_min_k, glu_rows):
    """bf16, the GPU kernel path: 30 replays of a CUDA graph captured with PDL (and skinny_linear) each
    give bit-for-bit the hidden states of the same forward run eagerly without PDL. A kernel reading the
    previous kernel's output before its wait would make replays differ from it (and from each other).
    With the long-K threshold at 1024 the MLP's down projection runs in stream_linear too; with glu_rows
    its gate_up and SiLU-and-mul in stream_linear(glu=True)."""
    from common.cuda_graphs import capture

    if not fused.pdl(torch.empty(1, device="cuda")):
        pytest.skip("PDL needs compute capability 9.0+")
    shape = dict(vocab_size=1000, hidden_size=512, num_heads=8, num_kv_heads=2, intermediate_size=1024,
                 num_layers=4, architecture="Qwen2ForCausalLM")  # fmt: skip
    path = make_tiny_model(tmp_path / "m", seed=6, **shape)
    model = load_model(path, init_tp(1, 0, device=torch.device("cuda")), device="cuda", dtype=torch.bfloat16)
    cache = KVCache.for_model(model, 2, 128)
    ids = (torch.arange(5, device="cuda") * 37 % 1000).view(1, 5)
    positions = torch.arange(60, 65, device="cuda").view(1, 5)
    slots = torch.tensor([0], device="cuda")
    with torch.inference_mode():
        forward_rows(model, cache, [0], [0], [list(range(3, 63))])  # a context to attend over

        def step():
            return model(ids, positions, slots, cache, 128)

        monkeypatch.setattr(skinny, "STREAM_MIN_K", stream_min_k)
        monkeypatch.setattr(skinny, "GLU_MAX_ROWS", glu_rows)
        monkeypatch.setattr(fused, "pdl", lambda x: False)
        monkeypatch.setattr(skinny, "REQUIRE_PDL", False)  # the same kernels, in stream order
        want = step().clone()
        monkeypatch.undo()
        monkeypatch.setattr(skinny, "STREAM_MIN_K", stream_min_k)
        monkeypatch.setattr(skinny, "GLU_MAX_ROWS", glu_rows)
        graph, out, _ = capture(step, torch.device("cuda"), None)
        for _ in range(30):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want)


def test_describe_names_the_kernel_path(monkeypatch):
    """The start-up log's account of the forward's kernels, per switch."""
    x = torch.empty(1)
    assert skinny.describe(x) == "torch references, oneDNN packed linears"  # the CPU
    monkeypatch.setattr(onednn, "ENABLED", False)
    assert skinny.describe(x) == "torch references"
    monkeypatch.setattr(fused, "on_gpu", lambda t: True)
    monkeypatch.setattr(fused, "pdl", lambda t: False)
    assert skinny.describe(x) == "Triton fused kernels, PDL off, cuBLAS GEMMs"
    monkeypatch.setattr(fused, "pdl", lambda t: True)
    assert "skinny_linear up to 16 rows" in skinny.describe(x)
    assert "stream_linear for K >= 4096 up to 5 rows" in skinny.describe(x)
    assert "and for gate_up + SiLU up to 16 rows" in skinny.describe(x)  # the GLU kernel's default
    monkeypatch.setattr(skinny, "GLU_MAX_ROWS", 0)
    assert "gate_up" not in skinny.describe(x)
    monkeypatch.setattr(skinny, "ENABLED", False)
    monkeypatch.setattr(skinny, "STREAM_ENABLED", False)
    assert "skinny_linear off" in skinny.describe(x) and "stream_linear off" in skinny.describe(x)
