"""`specsplit eval-draft`: a trained draft's held-out acceptance table, on any device, without training.

    specsplit eval-draft --draft drafts/qwen2.5-coder-1.5b-instruct-feature --prompt-set coding \
        --prompts 16 --max-new-tokens 128 --k 1,2,3,4,5,6 [--target MODEL] [--out eval.json]

The target answers the built-in held-out prompts greedily (common/training/prompts.py; no training prompt
names their subjects), and the draft's rounds are replayed against those answers as served: a feature
draft through its real chain (target features up to the committed tokens, then its own), a layer draft
from its teacher-forced next-token choices. Per k: E[a] (drafted tokens accepted per round), the
per-token alpha solved from it and accepted / drafted; a feature draft's table adds, at each round's
first drafted position, how often the target's token is the draft's first or second choice and how often
its vocabulary lacks it. The target defaults to the one the draft's config names for its shared tensors.
--answers keeps the target's answers in a file and reads them back on the next run (they cost most of
the time on a CPU).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from common.config import DTYPES
from common.distributed import Comm
from common.draft_checkpoint import resolve_target_path, shared_weights_spec
from common.loader import load_model, load_tokenizer
from common.models.feature_draft import FeatureDraft
from common.training import prompts as builtin_prompts
from common.training.feature_train import feature_table
from common.training.train_draft import eos_ids, held_out_answers, layer_table, parse_ints


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specsplit eval-draft", description=__doc__.splitlines()[0])
    ap.add_argument("--draft", type=Path, required=True, help="trained draft directory")
    ap.add_argument(
        "--target",
        default=None,
        help="target model: path or catalogue name (default: the one the draft's config names)",
    )
    ap.add_argument("--prompt-set", choices=sorted(builtin_prompts.PROMPT_SETS), default="general",
                    help="held-out prompts: general chat, or coding")  # fmt: skip
    ap.add_argument("--prompts", type=int, default=16, help="held-out prompts to answer")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="tokens of each greedy answer")
    ap.add_argument("--k", type=parse_ints, default=[1, 2, 3, 4, 5, 6], help="drafted tokens per round")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=list(DTYPES))
    ap.add_argument(
        "--no-chat", action="store_true", help="plain prompts even when the target has a template"
    )
    ap.add_argument("--answers", type=Path, default=None,
                    help="JSON of the target's answers: read when it exists, else written")  # fmt: skip
    ap.add_argument("--out", type=Path, default=None, help="also write the table here (JSON)")
    return ap


def default_target(draft_dir: Path) -> Path:
    spec = shared_weights_spec(draft_dir)
    if spec is None:
        raise SystemExit(f"--target: {draft_dir} names no target (no shared_weights in its config); give one")
    return resolve_target_path(draft_dir, spec["path"]).resolve()


def answers_for(args, target, tokenizer) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, the target's greedy answers), from --answers when that file exists (else written there)."""
    if args.answers is not None and args.answers.exists():
        given = json.loads(args.answers.read_text())
        return given["prompts"], given["answers"]
    chat = bool(getattr(tokenizer, "chat_template", None)) and not args.no_chat
    heldout = held_out_answers(target, tokenizer, args.prompt_set, args.prompts, args.max_new_tokens, chat,
                               eos_ids(tokenizer, target))  # fmt: skip
    if args.answers is not None:
        args.answers.write_text(json.dumps({"prompts": heldout[0], "answers": heldout[1]}) + "\n")
    return heldout


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not (args.draft / "config.json").is_file():
        raise SystemExit(f"--draft {args.draft}: no config.json (not a trained draft directory)")
    if args.prompts < 1 or args.max_new_tokens < 1 or not args.k or min(args.k) < 1:
        raise SystemExit("--prompts, --max-new-tokens and every --k must be at least 1")
    target_path = args.target or default_target(args.draft)
    dtype = DTYPES[args.dtype]
    target = load_model(target_path, Comm(), device=args.device, dtype=dtype)
    draft = load_model(args.draft, Comm(), device=args.device, dtype=dtype)
    if draft.config.vocab_size != target.config.vocab_size:
        raise SystemExit(f"--draft {args.draft}: vocab {draft.config.vocab_size}, the target's is "
                         f"{target.config.vocab_size}")  # fmt: skip
    heldout = answers_for(args, target, load_tokenizer(target_path))
    if isinstance(draft, FeatureDraft):
        kind, table = "feature", feature_table(draft, target, heldout, args.k)
    else:
        kind = "trained_markov" if draft.config.markov_rank else "trained_head_off"
        table = layer_table(draft, draft.config.markov_rank > 0, heldout, args.k)
    prompts, answers = heldout
    result = {"draft": str(args.draft), "target": str(target_path), "prompt_set": args.prompt_set,
              "prompts": len(prompts), "answer_tokens": sum(map(len, answers)),
              "drafts": {kind: table}}  # fmt: skip
    text = json.dumps(result, indent=2) + "\n"
    if args.out is not None:
        args.out.write_text(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
