"""Does a query row get the same attention output, bit for bit, as one row of a plain step (L = 1) and as
the first row of a verify step (L = 5)? Per split count and query-block size (BLOCK_M), on the GPU.

Plain and verify steps of the same request must agree for bf16 speculative output to equal plain output.
On the H200 (the eighteenth session's call 6) every configuration agreed: with the key split fixed, the
row does not depend on L or BLOCK_M; what can differ is the key split between steps of another batch
or context bucket (`fused.split_chunk`). Under TRITON_INTERPRET=1 the BLOCK_M pairs differ (numpy's
matmul rounds by shape), so the answer is the GPU's. Prints one JSON line per configuration.
    python bench/attention_invariance.py
"""

from __future__ import annotations

import json
import sys

import torch
import triton

from common.kernels import fused


def run(q, kc, vc, slots, positions, ctx_len, splits, block_m):
    """fused.attention's launch with the split count and BLOCK_M forced."""
    bsz, seq, heads, hd = q.shape
    kv_heads = kc.shape[2]
    group = heads // kv_heads
    m_blocks = triton.cdiv(group * seq, block_m)
    chunk = triton.cdiv(triton.cdiv(ctx_len, splits), 64) * 64
    splits = triton.cdiv(ctx_len, chunk)
    out = torch.empty_like(q)
    if splits == 1:
        part, lse = out, out
    else:
        part = torch.empty((bsz, seq, heads, splits, hd), dtype=torch.float32, device=q.device)
        lse = torch.empty((bsz, seq, heads, splits), dtype=torch.float32, device=q.device)
    fused._attention_kernel[(bsz * kv_heads, m_blocks, splits)](
        q, kc, vc, positions, slots, slots, slots, part, lse, hd**-0.5 * 1.4426950408889634, seq, heads,
        kv_heads, kc.shape[1], chunk, GROUP=group, HEAD_DIM=hd, BLOCK_D=hd, BLOCK_M=block_m, BLOCK_N=64,
        SPLITS=splits, PRECISION="tf32", DOT_FP32=fused.INTERPRETED, HAS_PREFIX=False,
        **fused.launch_options(q),
    )  # fmt: skip
    if splits > 1:
        fused._attention_combine_kernel[(bsz * seq * heads,)](
            part, lse, out, HEAD_DIM=hd, BLOCK_D=hd, SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits),
            **fused.launch_options(q),
        )  # fmt: skip
    return out


def main() -> int:
    torch.manual_seed(0)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: TRITON_INTERPRET=1
    bsz, heads, kv_heads, hd, max_len = 16, 12, 2, 128, 512
    kc = torch.randn(bsz, max_len, kv_heads, hd, device=dev).bfloat16()
    vc = torch.randn(bsz, max_len, kv_heads, hd, device=dev).bfloat16()
    results = []
    for ctx_len, starts in ((256, range(40, 250, 13)), (512, range(260, 500, 15))):
        start = torch.tensor(list(starts)[:bsz], device=dev)
        slots = torch.arange(bsz, device=dev)
        q5 = torch.randn(bsz, 5, heads, hd, device=dev).bfloat16()
        pos5 = start[:, None] + torch.arange(5, device=dev)
        q1, pos1 = q5[:, :1].contiguous(), pos5[:, :1].contiguous()
        for splits in (1, 2, 4):
            for bm1, bm5 in ((16, 32), (32, 32), (16, 16)):
                a = run(q1, kc, vc, slots, pos1, ctx_len, splits, bm1)
                b = run(q5, kc, vc, slots, pos5, ctx_len, splits, bm5)[:, :1]
                diff = (a.float() - b.float()).abs()
                rows = diff.amax(-1) > 0  # [B, 1, heads]
                r = dict(ctx=ctx_len, splits=splits, block_m_plain=bm1, block_m_verify=bm5, rows=rows.numel(),
                         rows_differing=int(rows.sum()), max_diff=float(diff.max()))  # fmt: skip
                results.append(r)
                print(json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
