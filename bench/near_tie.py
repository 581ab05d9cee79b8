"""The target's top logits at one position of a greedy answer, eager at B=1: settles whether a bf16
divergence is a near-tie when the recorded top-2 margins do not.

    python bench/near_tie.py --target $GGUF --prompt 6 --position 41 [--dtype float32] [--top 6]

The prompt is bench/bench_real.py's held-out chat prompt of that index; the prefix is the target's own
greedy answer (in --dtype) up to `position`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_real import chat_prompts

from common.config import DTYPES
from common.distributed import Comm
from common.kv_cache import KVCache
from common.loader import load_model
from common.models.generate import forward_rows, greedy_generate


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--prompt", type=int, required=True, help="index into bench_real.py's prompts")
    ap.add_argument("--position", type=int, required=True, help="answer position to inspect")
    ap.add_argument("--dtype", default="float32", choices=list(DTYPES))
    ap.add_argument("--top", type=int, default=6)
    args = ap.parse_args()
    prompt = chat_prompts(args.target, args.prompt + 1)[args.prompt]
    model = load_model(args.target, Comm(), device="cpu", dtype=DTYPES[args.dtype])
    answer = greedy_generate(model, [prompt], args.position + 1)[0]
    ids = prompt + answer[: args.position]
    cache = KVCache.for_model(model, 1, len(ids) + 1)
    with torch.inference_mode():
        hidden = forward_rows(model, cache, [0], [0], [ids])
        logits = model.compute_logits(hidden[0, -1:]).float()[0]
    top = torch.topk(logits, args.top)
    rows = [{"token": int(i), "logit": float(v), "behind_top1": float(top.values[0] - v)}
            for v, i in zip(top.values, top.indices)]  # fmt: skip
    print(json.dumps({"prompt": args.prompt, "position": args.position, "dtype": args.dtype, "top": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
