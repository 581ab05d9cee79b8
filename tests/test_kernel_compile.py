"""The forward's Triton kernels compiled for the H200 (sm_90) on the CPU, without a GPU: Triton's own
compiler and ptxas (shipped in its wheel) check what the CPU interpreter cannot. Each kernel launched
with programmatic dependent launch carries its `griddepcontrol` instructions (and none without PDL), and
skinny_linear's largest tile fits the H200's shared memory (under Triton 3.6 a 32-row block did not:
328 KB of 227; this Triton lays that one out in 192 KB, so the check's power is shown on a 64-row
block), and its dot is one chain of MMAs over K, in K order (the summation the cuBLAS verify shares;
common/kernels/skinny.py says why). Compiler versions
differ in their layouts: the GPU tests (tests/test_skinny_linear.py on the device) remain the final word.

Compiled in a subprocess: the suite runs under TRITON_INTERPRET=1, where `triton.jit` builds
interpreted functions that Triton cannot compile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

H200_SHARED_BYTES = 232448  # the per-block opt-in maximum of sm_90 (227 KB), as Triton reports it

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from common.kernels import fused, skinny

    FP32_PTRS = {"cos_ptr", "sin_ptr", "lse_ptr", "part_ptr"}
    INT_PTRS = {"pos_ptr", "slot_ptr", "prefix_slot_ptr", "prefix_len_ptr", "slots_ptr", "positions_ptr"}

    def signature(fn):
        sig = {}
        for p in fn.params:
            if p.is_constexpr:
                sig[p.name] = "constexpr"
            elif p.name.endswith("_ptr"):
                sig[p.name] = "*fp32" if p.name in FP32_PTRS else "*i64" if p.name in INT_PTRS else "*bf16"
            else:
                sig[p.name] = "fp32" if p.name in ("eps", "qk_scale") else "i32"
        return sig

    def compile_(fn, num_warps=4, **constexprs):
        # Every pointer and integer argument divisible by 16, as the launcher specialises the model's
        # shapes at run time: only then are the loads async copies and the software pipeline's stages in
        # shared memory (without it stream_glu's narrow tiles at 128 rows report 48 KB; at run time 240 KB)
        sig = signature(fn)
        attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t != "constexpr"}
        src = ASTSource(fn, sig, constexprs=constexprs, attrs=attrs)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
        ptx = k.asm["ptx"]
        return {"shared": k.metadata.shared, "wait": "griddepcontrol.wait" in ptx,
                "launch": "griddepcontrol.launch_dependents" in ptx, "mma": ptx.count("mma.sync")}

    skinny_consts = dict(BLOCK_N=skinny.BLOCK_N, BLOCK_K=triton.next_power_of_2(skinny.MAX_K), HAS_BIAS=True,
                         DOT_FP32=False)
    attention = dict(GROUP=6, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=32, BLOCK_N=64, SPLITS=1, PRECISION="tf32",
                     DOT_FP32=False, HAS_PREFIX=False, BLOCK_T=8)
    out = {
        "skinny": compile_(skinny._skinny_linear_kernel, BLOCK_M=skinny.BLOCK_M, PDL=True, **skinny_consts),
        "skinny_64_rows": compile_(skinny._skinny_linear_kernel, BLOCK_M=64, PDL=True, **skinny_consts),
        "skinny_k1024": compile_(skinny._skinny_linear_kernel, BLOCK_M=skinny.BLOCK_M, PDL=True,
                                 **{**skinny_consts, "BLOCK_K": 1024}),
        "skinny_no_pdl": compile_(skinny._skinny_linear_kernel, BLOCK_M=skinny.BLOCK_M, PDL=False,
                                  **skinny_consts),
        **{f"stream_glu_{name}": compile_(skinny._stream_linear_kernel, K_PER_SPLIT=1536, BLOCK_M=block_m,
                                          BLOCK_N=tiles["block_n"], BLOCK_K=tiles["block_k"], SPLIT_K=1,
                                          NUM_STAGES=tiles["stages"], PREFETCH=True, HAS_BIAS=False, GLU=True,
                                          PDL=True, DOT_FP32=False)
           for name, block_m, tiles in [("16", 16, skinny.GLU_TILES), ("128", 128, skinny.GLU_TILES_WIDE),
                                        ("128_narrow", 128, skinny.GLU_TILES)]},
        "rms_norm": compile_(fused._rms_norm_kernel, HAS_RESIDUAL=True, BLOCK=2048, PDL=True),
        "feature_write": compile_(fused._feature_write_kernel, HAS_RESIDUAL=True, BLOCK=2048, PDL=True),
        "silu_and_mul": compile_(fused._silu_and_mul_kernel, BLOCK=1024, PDL=True),
        "attention": compile_(fused._attention_kernel, PDL=True, ROTARY=False, **attention),
        "rotary_attention": compile_(fused._attention_kernel, PDL=True, ROTARY=True, **attention),
        "attention_no_pdl": compile_(fused._attention_kernel, PDL=False, ROTARY=True, **attention),
        "attention_combine": compile_(fused._attention_combine_kernel, HEAD_DIM=128, BLOCK_D=128, SPLITS=4,
                                      BLOCK_R=4, PDL=True),
    }
    json.dump(out, sys.stdout)
    """
)


@pytest.fixture(scope="module")
def compiled():
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=root, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_pdl_kernels_carry_griddepcontrol(compiled):
    for name in (
        "skinny",
        "rms_norm",
        "feature_write",
        "silu_and_mul",
        "attention",
        "rotary_attention",
        "attention_combine",
    ):
        assert compiled[name]["wait"] and compiled[name]["launch"], name
    for name in ("skinny_no_pdl", "attention_no_pdl"):  # power: the check tells the variants apart
        assert not compiled[name]["wait"] and not compiled[name]["launch"], name


def test_rotary_attention_keeps_the_attention_shared_memory(compiled):
    """The fused rotary + KV write + attention writes this step's keys before its key loop, which then
    reads them from the cache like any other: read in the loop from k and v instead, their loads took
    the software pipeline's shared-memory stages to 160 KB at bf16 and 516 KB at fp32 (Triton 3.6, the
    GPU machine's: an fp32 forward could not launch there), and the kernel 3x the time."""
    assert compiled["rotary_attention"]["shared"] == compiled["attention"]["shared"] <= H200_SHARED_BYTES


def test_skinny_linear_tile_fits_the_h200_shared_memory(compiled):
    assert compiled["skinny"]["shared"] <= H200_SHARED_BYTES
    # stream_linear's GLU tiles (gate and up weight tiles per stage): up to 16 rows, and the wide-K tiles
    # linear() takes for a 128-row block (an 80-row verify); the narrow ones would not fit there
    for name in ("stream_glu_16", "stream_glu_128"):
        assert compiled[name]["shared"] <= H200_SHARED_BYTES and compiled[name]["wait"], name
    assert compiled["stream_glu_128_narrow"]["shared"] > H200_SHARED_BYTES
    assert compiled["skinny_64_rows"]["shared"] > H200_SHARED_BYTES  # power: an oversized tile is seen


def test_skinny_linear_dot_is_one_chain_in_k_order(compiled):
    """skinny_linear's dot runs over all of K in one chain of 16-wide MMA steps per warp (its 8 output
    features), fp32-accumulated in K order as cuBLAS does; common/kernels/skinny.py says why (a plain
    step's rows must round as the cuBLAS verify's do: K split into 8 slices summed after left 0/16 bf16
    speculative sequences equal to plain at B=16, against 14/16). The count follows the chain's length
    (power: 64 MMAs at K = 1024)."""
    assert compiled["skinny"]["mma"] == 2048 // 16  # BLOCK_K = skinny.MAX_K = 2048 in the compile above
    assert compiled["skinny_k1024"]["mma"] == 1024 // 16
