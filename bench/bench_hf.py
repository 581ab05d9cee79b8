"""Hugging Face on the same weights: is our model the same function, and how fast is HF?

    python bench/bench_hf.py --preset qwen1.5b --device cuda --out hf.json

Loads the bench_e2e checkpoints with transformers (AutoModelForCausalLM, eager attention) and with
specsplit's loader. Checks that greedy decoding gives the same tokens in fp32 (batch 1, same prompts
as bench_e2e), then times HF `generate` plain and with assisted generation (the draft as assistant,
k = 4 draft tokens per step) at batch 1 in bf16.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_e2e import PRESETS, make_models

from common.distributed import init_tp
from common.loader import load_model
from common.models.generate import greedy_generate


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_generate(model, prompt: list[int], n: int, assistant=None, k: int = 4) -> tuple[list[int], float]:
    ids = torch.tensor([prompt], device=model.device)
    kw = {}
    if assistant is not None:
        assistant.generation_config.num_assistant_tokens = k
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        kw["assistant_model"] = assistant
    sync(model.device)
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0, **kw)  # fmt: skip
    sync(model.device)
    return out[0, len(prompt) :].tolist(), time.perf_counter() - t0


def main() -> int:
    from transformers import AutoModelForCausalLM

    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen1.5b", choices=list(PRESETS))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--models", type=Path, default=Path("/tmp/specsplit-bench-models"))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    target_dir, draft_dir = make_models(args.models, args.preset)
    rng = random.Random(0)  # the same prompts as bench_e2e
    vocab = PRESETS[args.preset]["vocab_size"]
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    result: dict = {"preset": args.preset}

    # 1. Same function: greedy tokens, fp32, HF vs specsplit.
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32, attn_implementation="eager")
    hf = hf.to(args.device).eval()
    ours = load_model(target_dir, init_tp(1, 0, device=torch.device(args.device)), device=args.device)
    same = 0
    for p in prompts:
        with torch.inference_mode():
            mine = greedy_generate(ours, [p], args.new_tokens)[0]
        theirs, _ = hf_generate(hf, p, args.new_tokens)
        same += mine == theirs
        if mine != theirs:
            j = next(i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b)
            print(f"fp32 HF vs specsplit differ at token {j}: {theirs[j]} vs {mine[j]}")
    result["fp32_identical_to_hf"] = f"{same}/{len(prompts)}"
    print(f"fp32 greedy, HF vs specsplit model: {same}/{len(prompts)} sequences identical", flush=True)
    del hf, ours

    # 2. HF speed in bf16, plain and assisted, batch 1.
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).to(args.device).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.bfloat16).to(args.device).eval()
    hf_generate(hf, prompts[0], 8)
    hf_generate(hf, prompts[0], 8, draft)
    times: dict[str, list[float]] = {"plain": [], "assisted": []}
    assisted_same = 0
    for p in prompts:
        plain, t_plain = hf_generate(hf, p, args.new_tokens)
        assisted, t_assisted = hf_generate(hf, p, args.new_tokens, draft)
        times["plain"].append(t_plain / args.new_tokens)
        times["assisted"].append(t_assisted / args.new_tokens)
        assisted_same += assisted == plain
    result["bf16_hf_assisted_identical_to_plain"] = f"{assisted_same}/{len(prompts)}"
    for name, values in times.items():
        result[f"hf_{name}_ms_per_token_bf16_b1"] = 1e3 * sorted(values)[len(values) // 2]
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
