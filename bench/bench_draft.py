"""Draft quality and cost: held-out acceptance at several k, and the draft step time with / without the
Markov head.

    python bench/bench_draft.py --target TARGET --draft markov=RUN/draft --draft plain=RUN0/draft \\
        --truncated 2 --k 2,4,6 --step-time --json out.json

Acceptance (common/training/measure.py): the target's greedy answers to the held-out prompts (never used
in training), then, per draft, the mean accepted length E[a] of greedy speculative rounds at each k and
the per-token α solved from E[a] = Σ_{i=1..k} α^i. `--truncated N` adds the target's first N layers
with no training as a baseline. A draft with a Markov head is measured with it and, as `NAME-head-off`,
without it. Step time: one decode step (one token, logits, argmax) at batch 1 and 16, context 256.
`--shape-only CONFIG --layers N --markov-rank R` times random-weight drafts of that shape (no target).
`--prompt-set training|unseen-topics` measures on other prompts than the held-out ones (see PROMPT_SETS).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.config import DTYPES, ModelConfig
from common.distributed import Comm
from common.loader import load_model, load_tokenizer
from common.models.transformer import Transformer
from common.training import prompts as builtin_prompts
from common.training.draft import build_draft, draft_config
from common.training.measure import (
    acceptance,
    agreement_by_confidence,
    draft_step_seconds,
    match_flags,
    target_confidence,
    target_texts,
)
from common.training.train_draft import eos_ids, parse_ints, prompt_ids

# Where the draft's acceptance is measured: the gap from training prompts to unseen topics in the same
# forms is memorisation, from there to the held-out chat prompts the forms (common/training/self_instruct.py).
PROMPT_SETS = {
    "held-out": builtin_prompts.held_out_prompts,
    "training": lambda: builtin_prompts.training_prompts(seed=0),
    "unseen-topics": builtin_prompts.unseen_topic_prompts,
}


def named_drafts(args, target: Transformer | None) -> dict[str, tuple[Transformer, bool]]:
    drafts: dict[str, tuple[Transformer, bool]] = {}
    if args.truncated and target is not None:
        layers = list(range(args.truncated))
        truncated = build_draft(target, layers, 0, 0, device=args.device, dtype=DTYPES[args.dtype])
        drafts["truncated_target"] = (truncated, False)
    for spec in args.draft:
        name, _, path = spec.partition("=")
        model = load_model(path, Comm(), device=args.device, dtype=DTYPES[args.dtype])
        drafts[name] = (model, True)
        if model.markov_head is not None:
            drafts[f"{name}-head-off"] = (model, False)
    return drafts


def shape_drafts(args) -> dict[str, tuple[Transformer, bool]]:
    """Random-weight drafts of the target's shape: step time does not depend on the weights."""
    base = ModelConfig.from_pretrained(args.shape_only)
    cfg = draft_config(base, args.layers, args.markov_rank)
    model = Transformer(cfg, Comm(), dtype=DTYPES[args.dtype], device=args.device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return {f"random-{args.layers}layers-markov{args.markov_rank}": (model, True), "head-off": (model, False)}


def measure_acceptance(args, target, drafts) -> dict:
    if args.answers:  # the target's answers computed before (e.g. where the target could not go)
        given = json.loads(args.answers.read_text())
        prompts, answers = given["prompts"], given["answers"]
    else:
        tokenizer = load_tokenizer(args.target)
        chat = bool(getattr(tokenizer, "chat_template", None)) and not args.no_chat
        texts = PROMPT_SETS[args.prompt_set]()[: args.eval_prompts]
        prompts = prompt_ids(tokenizer, texts, chat)
        answers = target_texts(target, prompts, args.max_new_tokens, eos_ids(tokenizer, target))
    out = {"prompts": len(prompts), "answer_tokens": sum(map(len, answers)), "drafts": {}}
    confidence = target_confidence(target, prompts, answers) if args.by_confidence else None
    for name, (model, use_markov) in drafts.items():
        matches = match_flags(model, prompts, answers, use_markov)
        out["drafts"][name] = {f"k{k}": acceptance(matches, k).as_dict() for k in args.k}
        if confidence is not None:
            out["drafts"][name]["by_target_confidence"] = agreement_by_confidence(matches, confidence)
    return out


def measure_step_time(args, drafts) -> dict:
    out = {}
    for name, (model, use_markov) in drafts.items():
        for batch in (1, 16):
            ms = 1e3 * draft_step_seconds(model, use_markov, context=256, iters=args.iters, batch=batch)
            out[f"{name}/B{batch}"] = round(ms, 4)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, help="target checkpoint dir or .gguf file")
    ap.add_argument("--draft", action="append", default=[], help="NAME=PATH of a trained draft (repeatable)")
    ap.add_argument("--truncated", type=int, default=0, help="add the target's first N layers, untrained")
    ap.add_argument("--k", type=parse_ints, default=[2, 4, 6])
    ap.add_argument("--eval-prompts", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument(
        "--prompt-set",
        choices=list(PROMPT_SETS),
        default="held-out",
        help="held-out chat prompts; training: the first training prompts (seed-0 order, trained on); "
        "unseen-topics: training templates on topics no prompt names",
    )
    ap.add_argument("--no-chat", action="store_true")
    ap.add_argument(
        "--answers",
        type=Path,
        default=None,
        help='JSON {"prompts": [[ids]], "answers": [[ids]]} instead of generating them',
    )
    ap.add_argument(
        "--by-confidence",
        action="store_true",
        help="also the agreement among positions grouped by the target's own probability of its token",
    )
    ap.add_argument("--step-time", action="store_true", help="also time one draft step per draft")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--shape-only", type=Path, default=None, help="config.json: time random drafts only")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--markov-rank", type=int, default=32)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    result: dict = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                    "dtype": args.dtype}  # fmt: skip
    if args.shape_only:
        result["step_ms"] = measure_step_time(args, shape_drafts(args))
    else:
        target = load_model(args.target, Comm(), device=args.device, dtype=DTYPES[args.dtype])
        drafts = named_drafts(args, target)
        result["acceptance"] = measure_acceptance(args, target, drafts)
        if args.step_time:
            result["step_ms"] = measure_step_time(args, drafts)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
