"""Why speculation collapsed at batch 16: the rejection kernels' launch constants depend on the shape.

`verify` derives NUM_CHUNKS (a tl.constexpr) from rows = B * (k + 1) and MAX_K from k, so every new
(batch size, width) pair the old scheduler produced (requests finishing and arriving change B; a short
proposal changes the width) compiled four Triton kernels in the middle of serving. This script times
the first and the second call of `verify` for the shapes a B=16 run walks through: the first call of a
shape pays the compile. The serving loop now pads every step to a (batch bucket, width) captured at
start-up, so no step pays it.

    python bench/verify_shapes.py --out verify_shapes.json      # on the GPU
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.kernels.rejection import verify


def call(batch: int, width: int, vocab: int) -> float:
    dev = torch.device("cuda")
    logits = torch.randn(batch * width, vocab, device=dev, dtype=torch.float32)
    drafts = torch.randint(0, vocab, (batch, width - 1), device=dev)
    t0 = time.perf_counter()
    res = verify(
        logits,
        drafts,
        torch.full((batch,), width - 1, dtype=torch.int32, device=dev),
        torch.zeros(batch, device=dev),
        torch.zeros(batch, dtype=torch.int64, device=dev),
        torch.full((batch,), 100, dtype=torch.int64, device=dev),
    )
    res.num_emitted.cpu()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rows = []
    for batch in (16, 15, 14, 13, 12):
        for width in (5, 4, 1):
            first = call(batch, width, args.vocab)
            second = call(batch, width, args.vocab)
            rows.append({"batch": batch, "width": width, "first_ms": 1e3 * first, "second_ms": 1e3 * second})
            print(json.dumps(rows[-1]), flush=True)
    total = sum(r["first_ms"] - r["second_ms"] for r in rows)
    print(f"{len(rows)} shapes: {total:.0f} ms of first-call (compile) time")
    if args.out:
        args.out.write_text(json.dumps({"rows": rows, "first_call_extra_ms": total}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
