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

from common.kernels import fused


def main() -> int:
    torch.manual_seed(0)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: TRITON_INTERPRET=1
    bsz, heads, kv_heads, hd, max_len = 16, 12, 2, 128, 512
    scale = hd**-0.5
    kc = torch.randn(bsz, max_len, kv_heads, hd, device=dev).bfloat16()
    vc = torch.randn(bsz, max_len, kv_heads, hd, device=dev).bfloat16()
    for ctx_len, starts in ((256, range(40, 250, 13)), (512, range(260, 500, 15))):
        start = torch.tensor(list(starts)[:bsz], device=dev)
        slots = torch.arange(bsz, device=dev)
        q5 = torch.randn(bsz, 5, heads, hd, device=dev).bfloat16()
        pos5 = start[:, None] + torch.arange(5, device=dev)
        q1, pos1 = q5[:, :1].contiguous(), pos5[:, :1].contiguous()
        for splits in (1, 2, 4):
            for bm1, bm5 in ((16, 32), (32, 32), (16, 16)):
                a = fused.attention(q1, kc, vc, slots, pos1, ctx_len, scale, num_splits=splits, block_m=bm1)
                b = fused.attention(q5, kc, vc, slots, pos5, ctx_len, scale, num_splits=splits, block_m=bm5)
                b = b[:, :1]
                diff = (a.float() - b.float()).abs()
                rows = diff.amax(-1) > 0  # [B, 1, heads]
                r = dict(ctx=ctx_len, splits=splits, block_m_plain=bm1, block_m_verify=bm5, rows=rows.numel(),
                         rows_differing=int(rows.sum()), max_diff=float(diff.max()))  # fmt: skip
                print(json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
