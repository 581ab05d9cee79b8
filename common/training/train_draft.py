"""`specsplit train-draft`: distils a draft (N layers + a DSpark Markov head) for a given target.

    specsplit train-draft --target TARGET --out RUN_DIR [--layers 2 --markov-rank 32 --steps 2000 ...]

1. data: the target answers the built-in prompts (common/training/prompts.py), and with
   --self-instruct N the prompts it wrote itself first, at a few temperatures; its top-K distribution
   at every position is kept (RUN_DIR/data/part-*.safetensors, self_instruct.json);
2. train: KL(target top-K || draft) on the answer positions, AdamW, cosine schedule; the embedding and
   LM head are the target's and stay frozen unless --train-shared (RUN_DIR/train_state.pt);
3. export: RUN_DIR/draft/ holds config.json (naming the target for the shared tensors) and the
   draft-only tensors; RUN_DIR/eval.json the held-out acceptance of the truncated target, the draft
   without and with its Markov head.

Every stage resumes: run the same command again after a time limit (--max-minutes) stopped it. The
run is deterministic per --seed on one device. RUN_DIR/train.log has one JSON line per event.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

from common.config import DTYPES
from common.distributed import Comm
from common.kernels import fused
from common.kv_cache import KVCache
from common.loader import load_model, load_tokenizer
from common.models.feature_draft import default_feature_layers
from common.models.transformer import Transformer
from common.training import prompts as builtin_prompts
from common.training.data import Sequences, generate_batch, write_whole
from common.training.draft import build_draft, save_draft, target_reference
from common.training.feature_cache import FeatureCache, auto_budget
from common.training.feature_train import (
    build_feature_draft,
    draft_vocab_ids,
    feature_acceptance,
    feature_table,
    init_feature_draft,
    ttt_loss,
)
from common.training.measure import acceptance, match_flags, target_texts
from common.training.self_instruct import self_instruct_prompts

STATE_FILE = "train_state.pt"
SELF_INSTRUCT_FILE = "self_instruct.json"


class RunLog:
    """One JSON object per line in RUN_DIR/train.log, echoed to stderr when not under a progress bar."""

    def __init__(self, path: Path):
        self.file = open(path, "a")

    def __call__(self, event: str, echo: bool = True, **fields) -> None:
        line = json.dumps({"time": round(time.time(), 1), "event": event, **fields})
        self.file.write(line + "\n")
        self.file.flush()
        if echo:
            print(line, file=sys.stderr)


def progress(total: int, initial: int, desc: str):
    try:
        from tqdm import tqdm
    except ImportError:  # no bar; the log still says where the run is
        return None
    return tqdm(total=total, initial=initial, desc=desc, file=sys.stderr, dynamic_ncols=True)


# ------------------------------------------------------------------------------------------------ prompts
def prompt_ids(tokenizer, texts: list[str], chat: bool) -> list[list[int]]:
    """Token ids of each prompt: rendered with the target's chat template when it has one."""
    if chat:
        return [tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    return [tokenizer.encode(t) for t in texts]


def eos_ids(tokenizer, target: Transformer) -> set[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    eos = target.config.eos_token_id
    ids |= set(eos) if isinstance(eos, list) else ({eos} if eos is not None else set())
    return ids


# ------------------------------------------------------------------------------------------------ stage 1
def self_instructed(args, target, tokenizer, chat: bool, eos: set[int], log: RunLog) -> list[str]:
    """The prompts the target wrote itself for this data (--self-instruct): made once, kept in the data
    directory, where every later run on that data (training runs with --existing-data-only too) reads
    them, so their data parts line up with the same prompt batches."""
    path = (args.data_dir or args.out / "data") / SELF_INSTRUCT_FILE
    if path.exists():
        saved = json.loads(path.read_text())
        if args.self_instruct not in (0, saved["instructions"]):
            raise SystemExit(f"--self-instruct {args.self_instruct}: the data in {path.parent} was made "
                             f"with --self-instruct {saved['instructions']}")  # fmt: skip
        return saved["prompts"]
    if not args.self_instruct or args.existing_data_only:
        return []
    if args.data_shard[0]:
        raise SystemExit(f"--data-shard {args.data_shard[0]}/{args.data_shard[1]}: shard 0 writes the "
                         f"self-instruct prompts; start this one once {path} exists")  # fmt: skip
    t0 = time.monotonic()
    prompts, counts = self_instruct_prompts(
        target, tokenizer, lambda texts: prompt_ids(tokenizer, texts, chat), eos, args.self_instruct,
        args.seed, args.gen_batch_size, args.prompt_set,
    )  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({**counts, "seed": args.seed, "prompts": prompts}, indent=1) + "\n"
    write_whole(path, lambda side: side.write_text(text))  # shards waiting for the file never read half
    log("self_instruct", seconds=round(time.monotonic() - t0, 1), **counts)
    return prompts


def make_data(args, target: Transformer, prompts: list[list[int]], eos: set[int], log: RunLog, deadline):
    """Generates the missing data parts; returns all data, or None when the deadline came first."""
    jobs = [
        (p, t)
        for p in prompts
        for t in args.temperatures
        for _ in range(1 if t == 0 else args.samples_per_prompt)
    ]
    random.Random(args.seed).shuffle(jobs)
    jobs.sort(key=lambda job: job[1])  # one temperature per batch (stable: shuffled within each)
    batches = [jobs[i : i + args.gen_batch_size] for i in range(0, len(jobs), args.gen_batch_size)]
    data_dir = args.data_dir or args.out / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    shard, shards = args.data_shard
    mine = [i for i in range(len(batches)) if i % shards == shard]
    done = sum((data_dir / f"part-{i:05d}.safetensors").exists() for i in mine)
    bar = progress(len(mine), done, "data") if done < len(mine) else None
    device = target.model.embed_tokens.weight.device
    for i in mine:
        batch = batches[i]
        part = data_dir / f"part-{i:05d}.safetensors"
        if part.exists() or args.existing_data_only:
            continue
        if time.monotonic() > deadline:
            log("time_limit", stage="data", parts_done=i)
            return None
        seqs = []  # a batch at a temperature boundary is generated in two parts
        for temp in sorted({t for _, t in batch}):
            gen = torch.Generator(device=device).manual_seed(args.seed * 100_003 + i * 31 + int(temp * 100))
            rows = [p for p, t in batch if t == temp]
            seqs.append(generate_batch(target, rows, temp, args.max_new_tokens, args.top_k, eos, gen))
        Sequences.concat(seqs).save(part)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    if shards > 1:  # the other shards may still be writing: the run that trains reads every part
        log("data_shard", shard=shard, shards=shards, parts=len(mine))
        return None
    parts = [p for i in range(len(batches)) if (p := data_dir / f"part-{i:05d}.safetensors").exists()]
    if not parts:
        raise SystemExit(f"--data-dir {data_dir}: no data parts (generate them without --existing-data-only)")
    data = Sequences.concat([Sequences.load(p) for p in parts])
    log("data", sequences=data.num_seqs, tokens=len(data.tokens), trained_tokens=int(data.trained.sum()))
    return data


# ------------------------------------------------------------------------------------------------ stage 2
def batch_order(num_seqs: int, seed: int, epoch: int) -> list[int]:
    """The sequence order of one epoch: a function of (seed, epoch) only, so a resumed run repeats it."""
    gen = torch.Generator().manual_seed(seed * 7919 + epoch)
    return torch.randperm(num_seqs, generator=gen).tolist()


def batch_rows(data: Sequences, step: int, batch_size: int, seed: int) -> list[int]:
    """The sequences of training step `step`: epochs of batch_order, each cut into whole batches."""
    per_epoch = max(1, data.num_seqs // batch_size)
    order = batch_order(data.num_seqs, seed, step // per_epoch)
    return order[(step % per_epoch) * batch_size : (step % per_epoch + 1) * batch_size]


def get_batch(data: Sequences, rows: list[int], max_len: int):
    """(ids [B, L], topk_ids [B, L, K], topk_probs [B, L, K], mask [B, L]) of the sequences `rows`, each
    cut to max_len tokens and padded to the longest."""
    slices = [data.row(i) for i in rows]
    width = min(max_len, max(s.stop - s.start for s in slices))
    k = data.topk_ids.shape[1]
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    tk_ids = torch.zeros(len(rows), width, k, dtype=torch.int64)
    tk_probs = torch.zeros(len(rows), width, k)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, s in enumerate(slices):
        n = min(width, s.stop - s.start)
        ids[b, :n] = data.tokens[s][:n]
        tk_ids[b, :n] = data.topk_ids[s][:n]
        tk_probs[b, :n] = data.topk_probs[s][:n]
        mask[b, :n] = data.trained[s][:n]
    return ids, tk_ids, tk_probs, mask


def distill_loss(draft: Transformer, ids, tk_ids, tk_probs, mask, use_markov: bool = True):
    """(soft cross-entropy, KL) of the draft against the target's renormalised top-K, over `mask`."""
    bsz, width = ids.shape
    cache = KVCache.for_model(draft, bsz, width)  # fresh: training needs no history across batches
    positions = torch.arange(width, device=ids.device).expand(bsz, width)
    hidden = draft(ids, positions, torch.arange(bsz, device=ids.device), cache, width)
    hidden, prev = hidden[mask], ids[mask]
    logits = draft.compute_logits(hidden, prev if use_markov else None)
    logq = torch.log_softmax(logits, -1).gather(-1, tk_ids[mask])
    p = tk_probs[mask]
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-9)
    ce = -(p * logq).sum(-1).mean()
    entropy = -(p * p.clamp_min(1e-9).log()).sum(-1).mean()
    return ce, ce - entropy


def lr_at(step: int, args) -> float:
    """Linear warm-up, then cosine down to 10% of the peak."""
    if step < args.warmup:
        return (step + 1) / args.warmup
    frac = (step - args.warmup) / max(1, args.steps - args.warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))


def make_optimizer(draft: Transformer, args) -> torch.optim.Optimizer:
    markov = [p for n, p in draft.named_parameters() if p.requires_grad and n.startswith("markov_head.")]
    rest = [p for n, p in draft.named_parameters() if p.requires_grad and not n.startswith("markov_head.")]
    groups = [{"params": rest, "lr": args.lr}]
    if markov:
        groups.append({"params": markov, "lr": args.markov_lr, "weight_decay": 0.0})
    return torch.optim.AdamW(groups, weight_decay=args.weight_decay, betas=(0.9, 0.98))


def train(args, draft: Transformer, data: Sequences, log: RunLog, deadline, probe=None, loss_fn=None,
          stats=None) -> int:  # fmt: skip
    """Trains up to args.steps, saving state every --save-every steps; returns the step reached (less than
    args.steps when the deadline or --chunk-steps stopped it). `probe(draft)` -> dict, when given, is
    logged every --eval-every steps (held-out acceptance: is more training still helping?).
    `loss_fn(draft, rows, ids, topk_ids, topk_probs, mask)` -> (loss, KL) replaces distill_loss (rows:
    the batch's sequences); `stats()` -> dict, when given, joins each log line."""
    opt = make_optimizer(draft, args)
    peak = [g["lr"] for g in opt.param_groups]
    state_file = args.out / STATE_FILE
    step = 0
    if state_file.exists():
        state = torch.load(state_file, map_location=args.device, weights_only=True)
        draft.load_state_dict(state["model"], strict=False)
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
        log("resume", step=step)
    device = torch.device(args.device)
    # fp32 weights and activations (TF32 matmuls on GPUs): the model's KV-cache writes need one dtype,
    # which autocast's mixed bf16 / fp32 outputs break, and a 2-layer draft is cheap either way.
    torch.set_float32_matmul_precision("high")
    # Autograd needs the torch reference path: the fused Triton kernels of the GPU forward have no backward.
    fused.ENABLED = False
    bar = progress(args.steps, step, "train") if step < args.steps else None

    def save() -> None:
        trainable = {n: p.detach() for n, p in draft.named_parameters() if p.requires_grad}
        torch.save({"model": trainable, "optimizer": opt.state_dict(), "step": step}, state_file)

    t0, tokens, window = time.monotonic(), 0, []
    stop_at = step + args.chunk_steps if args.chunk_steps else args.steps
    while step < args.steps:
        if time.monotonic() > deadline or step >= stop_at:
            save()
            log("time_limit", stage="train", step=step)
            return step
        rows = batch_rows(data, step, args.batch_size, args.seed)
        batch = [t.to(device) for t in get_batch(data, rows, args.max_len)]
        scale = lr_at(step, args)
        for g, lr in zip(opt.param_groups, peak):
            g["lr"] = lr * scale
        ce, kl = loss_fn(draft, rows, *batch) if loss_fn else distill_loss(draft, *batch)
        opt.zero_grad(set_to_none=True)
        ce.backward()
        torch.nn.utils.clip_grad_norm_([p for p in draft.parameters() if p.requires_grad], 1.0)
        opt.step()
        step += 1
        tokens += int(batch[3].sum())
        window.append((ce.item(), kl.item()))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(kl=f"{kl.item():.3f}")
        if step % args.log_every == 0 or step == args.steps:
            # means over the steps since the last line: single batches are too noisy to compare
            ce_mean, kl_mean = (sum(v) / len(window) for v in zip(*window))
            window.clear()
            rate = tokens / max(1e-6, time.monotonic() - t0)
            log(
                "train",
                echo=bar is None,
                step=step,
                loss=round(ce_mean, 4),
                kl=round(kl_mean, 4),
                lr_scale=round(scale, 4),
                tokens_per_s=round(rate),
                **(stats() if stats else {}),
            )
        if probe is not None and args.eval_every and step % args.eval_every == 0:
            log("heldout", echo=bar is None, step=step, **probe(draft))
        if step % args.save_every == 0 and step < args.steps:
            save()
    if bar is not None:
        bar.close()
    save()
    return step


# ------------------------------------------------------------------------------------------------ stage 3
def held_out_answers(target, tokenizer, prompt_set: str, num: int, max_new_tokens: int, chat: bool,
                     eos: set[int]) -> tuple[list[list[int]], list[list[int]]]:  # fmt: skip
    """(the first `num` held-out prompts of `prompt_set`, the target's greedy answers to them)."""
    texts = builtin_prompts.PROMPT_SETS[prompt_set].held_out()[:num]
    prompts = prompt_ids(tokenizer, texts, chat)
    return prompts, target_texts(target, prompts, max_new_tokens, eos)


def held_out(args, target, tokenizer, chat, eos) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, the target's greedy answers) of the held-out prompts."""
    if args.eval_answers:  # precomputed where the whole target could not go (see --existing-data-only)
        given = json.loads(args.eval_answers.read_text())
        return given["prompts"], given["answers"]
    return held_out_answers(target, tokenizer, args.prompt_set, args.eval_prompts, args.eval_max_new_tokens,
                            chat, eos)  # fmt: skip


def layer_table(draft: Transformer, use_markov: bool, heldout, ks) -> dict:
    """{"k<k>": Acceptance.as_dict()} of a layer draft's teacher-forced choices on (prompts, answers)."""
    matches = match_flags(draft, *heldout, use_markov)
    return {f"k{k}": acceptance(matches, k).as_dict() for k in ks}


def evaluate(args, heldout, drafts: dict[str, tuple[Transformer, bool]]) -> dict:
    """Held-out acceptance at each k for each named (draft, use_markov)."""
    prompts, answers = heldout
    result = {"prompts": len(prompts), "answer_tokens": sum(map(len, answers)), "drafts": {}}
    for name, (model, use_markov) in drafts.items():
        result["drafts"][name] = layer_table(model, use_markov, heldout, args.eval_k)
    return result


def parse_floats(text: str) -> list[float]:
    return [float(x) for x in text.replace(",", " ").split()]


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.replace(",", " ").split()]


def parse_shard(text: str) -> tuple[int, int]:
    """ "1/3" -> (1, 3): this process makes the data batches whose index is 1 modulo 3."""
    try:
        shard, shards = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not I/N (e.g. 0/3)") from None
    if not 0 <= shard < shards:
        raise argparse.ArgumentTypeError(f"{text!r}: I must be in 0..N-1")
    return shard, shards


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specsplit train-draft", description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, required=True, help="target checkpoint dir or .gguf file")
    ap.add_argument("--out", type=Path, required=True, help="run directory (data, state, log, draft/)")
    ap.add_argument(
        "--kind",
        choices=("layers", "feature"),
        default="layers",
        help="layers: a short stack of the target's layers reading tokens only; feature: one layer "
        "reading the target's own features (EAGLE-3 style, common/models/feature_draft.py)",
    )
    ap.add_argument(
        "--feature-layers",
        type=parse_ints,
        default=None,
        help="--kind feature: target layers whose input streams the draft reads (default: 2, L/2, L-3)",
    )
    ap.add_argument(
        "--ttt-depth", type=int, default=4, help="--kind feature: drafted positions unrolled in training"
    )
    ap.add_argument(
        "--draft-intermediate-size",
        type=int,
        default=None,
        metavar="N",
        help="--kind feature: MLP width of the draft's layer (default: the target's); a narrower one keeps "
        "the N channels of the target's last layer that contribute most on a training batch",
    )
    ap.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        metavar="N",
        help="--kind feature: the draft's LM head covers only the N tokens the target most often predicts "
        "in the training answers (a d2t table maps them back); its rows are read from the target at load",
    )
    ap.add_argument(
        "--init-draft",
        type=Path,
        default=None,
        metavar="DIR",
        help="--kind feature: start from this trained feature draft (its feature layers and Markov head) "
        "instead of the target's last layer; with --draft-vocab its head keeps only those rows, and "
        "--steps 0 re-exports it at once (then evaluated as any run)",
    )
    ap.add_argument("--layers", type=int, default=2, help="draft transformer layers")
    ap.add_argument(
        "--init-layers",
        type=parse_ints,
        default=None,
        help="target layer each draft layer starts from (default: the first --layers)",
    )
    ap.add_argument("--markov-rank", type=int, default=32, help="rank of the Markov head (0 = none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--target-dtype", default="float32", choices=list(DTYPES))
    # data
    ap.add_argument("--temperatures", type=parse_floats, default=[0.0, 0.7, 1.0])
    ap.add_argument("--samples-per-prompt", type=int, default=1, help="answers per prompt at each T > 0")
    ap.add_argument("--num-prompts", type=int, default=None, help="use only the first N training prompts")
    ap.add_argument(
        "--prompt-set",
        choices=sorted(builtin_prompts.PROMPT_SETS),
        default="general",
        help="built-in training, held-out and self-instruct prompts (common/training/prompts.py): general "
        "chat, or coding for a code model",
    )
    ap.add_argument(
        "--self-instruct",
        type=int,
        default=0,
        metavar="N",
        help="also the prompts the target writes in answer to N instructions (numbered lists of "
        "questions; common/training/self_instruct.py), kept in the data directory",
    )
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=16, help="target probabilities kept per position")
    ap.add_argument(
        "--data-dir", type=Path, default=None, help="data parts (default RUN_DIR/data; share between runs)"
    )
    ap.add_argument("--gen-batch-size", type=int, default=256)
    ap.add_argument(
        "--data-shard",
        type=parse_shard,
        default=(0, 1),
        metavar="I/N",
        help="with --data-only: make only the data batches whose index is I modulo N, so N processes "
        "share one GPU and one --data-dir (start them once the self-instruct prompts are there)",
    )
    ap.add_argument(
        "--no-chat", action="store_true", help="plain prompts even when the target has a template"
    )
    # training
    ap.add_argument("--steps", type=int, default=3500)
    ap.add_argument("--batch-size", type=int, default=48, help="sequences per step")
    ap.add_argument("--max-len", type=int, default=384, help="tokens per sequence in training (cut)")
    # The training defaults are the shipped SmolLM2 draft's (drafts/smollm2-135m-instruct/train.sh); lr
    # 4e-3 was the best of 5e-4 to 4e-3 there.
    ap.add_argument("--lr", type=float, default=4e-3, help="peak learning rate of the draft's layers")
    ap.add_argument("--markov-lr", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument(
        "--train-shared",
        action="store_true",
        help="fine-tune the embedding / LM head too (then they are saved with the draft)",
    )
    ap.add_argument(
        "--feature-cache-gb",
        type=float,
        default=None,
        metavar="GB",
        help="--kind feature: keep the target's features of the training sequences on the device, up to "
        "this many GB, so that later epochs skip the target's forward (default: 40 %% of the GPU memory free "
        "once the models are loaded; none on the CPU)",
    )
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--save-every", type=int, default=200)
    ap.add_argument("--chunk-steps", type=int, default=None, help="stop (resumable) after this many steps")
    ap.add_argument(
        "--export-partial",
        action="store_true",
        help="when the time limit stops training, still export and evaluate the draft so far",
    )
    ap.add_argument(
        "--existing-data-only",
        action="store_true",
        help="train on the data parts already in --data-dir, generate none (then --target may "
        "be a checkpoint holding only the tensors the draft starts from)",
    )
    ap.add_argument(
        "--eval-answers",
        type=Path,
        default=None,
        help='JSON {"prompts": [[ids]], "answers": [[ids]]}: the target\'s greedy held-out answers',
    )
    ap.add_argument("--data-only", action="store_true", help="stop after generating the data")
    ap.add_argument("--max-minutes", type=float, default=None, help="stop (resumable) after this long")
    # export and evaluation
    ap.add_argument("--save-dtype", default="bfloat16", choices=list(DTYPES))
    ap.add_argument("--include-shared", action="store_true", help="also write the shared tensors")
    ap.add_argument(
        "--target-ref",
        default=None,
        help="how the draft's config names the target (default: path relative to the draft)",
    )
    ap.add_argument("--eval-prompts", type=int, default=24)
    ap.add_argument("--eval-max-new-tokens", type=int, default=128)
    ap.add_argument("--eval-k", type=parse_ints, default=[2, 4, 6])
    ap.add_argument(
        "--eval-every", type=int, default=0, help="log the held-out alpha every N training steps (0: never)"
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.init_draft is not None and args.kind != "feature":
        parser.error("--init-draft: only with --kind feature (a trained feature draft to start from)")
    if args.data_shard[1] > 1 and not args.data_only:
        parser.error("--data-shard: only with --data-only (a later run with --existing-data-only trains)")
    if args.self_instruct < 0:
        parser.error(f"--self-instruct: {args.self_instruct} is negative (instructions to answer, 0 = none)")
    deadline = time.monotonic() + (args.max_minutes * 60 if args.max_minutes else math.inf)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    log = RunLog(args.out / "train.log")
    log("start", argv=sys.argv[1:] if argv is None else argv, seed=args.seed, device=args.device)
    target = load_model(args.target, Comm(), device=args.device, dtype=DTYPES[args.target_dtype])
    tokenizer = load_tokenizer(args.target)
    chat = bool(getattr(tokenizer, "chat_template", None)) and not args.no_chat
    eos = eos_ids(tokenizer, target)
    texts = builtin_prompts.PROMPT_SETS[args.prompt_set].training(args.seed)[: args.num_prompts]
    texts += self_instructed(args, target, tokenizer, chat, eos, log)
    data = make_data(args, target, prompt_ids(tokenizer, texts, chat), eos, log, deadline)
    if data is None or args.data_only:
        return 0
    if args.kind == "feature":
        return train_feature_draft(args, target, tokenizer, chat, eos, data, log, deadline, argv)
    layer_map = args.init_layers or list(range(args.layers))
    if len(layer_map) != args.layers:
        raise SystemExit(f"--init-layers: {len(layer_map)} layers given, --layers is {args.layers}")
    draft = build_draft(target, layer_map, args.markov_rank, args.seed, args.train_shared, args.device)
    heldout = held_out(args, target, tokenizer, chat, eos)

    def probe(model: Transformer) -> dict:
        matches = match_flags(model, *heldout, use_markov=args.markov_rank > 0)
        return {f"k{k}": acceptance(matches, k).as_dict()["alpha"] for k in args.eval_k}

    steps_done = train(args, draft, data, log, deadline, probe)
    if steps_done < args.steps and not (args.export_partial and steps_done > 0):
        return 0
    draft.eval()
    target_ref = target_reference(args.target, args.out / "draft", args.target_ref)
    extra = {
        "seed": args.seed,
        "init_layers": layer_map,
        "steps": steps_done,
        "command": "specsplit train-draft " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    size = save_draft(draft, args.out / "draft", target_ref, args.save_dtype, args.include_shared, extra)
    truncated = build_draft(target, layer_map, 0, args.seed, device=args.device)
    drafts = {"truncated_target": (truncated, False), "trained_head_off": (draft, False)}
    if args.markov_rank:
        drafts["trained_markov"] = (draft, True)
    result = evaluate(args, heldout, drafts)
    result["draft_bytes"] = size
    (args.out / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    log("done", draft=str(args.out / "draft"), draft_bytes=size, eval=result["drafts"])
    return 0


def init_training(path: Path | None) -> dict | None:
    """The draft_training record of --init-draft's config (None without one)."""
    if path is None:
        return None
    return json.loads((path / "config.json").read_text()).get("draft_training")


def train_feature_draft(args, target, tokenizer, chat, eos, data, log: RunLog, deadline, argv) -> int:
    """`--kind feature`: train with training-time test, export, and measure held-out acceptance as served
    (feature_acceptance: real draft chains, not per-position agreement)."""
    layers = tuple(args.feature_layers or default_feature_layers(target.config.num_hidden_layers))
    # The MLP's channels are ranked on one training batch's MLP inputs of the target's last layer.
    sample = get_batch(data, batch_rows(data, 0, min(16, args.batch_size), args.seed), args.max_len)[0]
    sample = sample.to(args.device)
    vocab_ids = None
    if args.draft_vocab is not None:
        try:
            vocab_ids, coverage = draft_vocab_ids(
                data.topk_ids[:, 0], data.trained, args.draft_vocab, target.config.vocab_size
            )
        except ValueError as e:
            raise SystemExit(str(e)) from None
        log("draft_vocab", size=args.draft_vocab, coverage=round(coverage, 4))
    if args.init_draft is not None:
        try:
            draft = init_feature_draft(args.init_draft, target, vocab_ids, args.device)
        except (ValueError, FileNotFoundError) as e:
            raise SystemExit(str(e)) from None
        layers = tuple(draft.config.feature_layers)  # the trained draft's, whatever --feature-layers says
        log("init_draft", path=str(args.init_draft), feature_layers=list(layers),
            markov_rank=draft.config.markov_rank)  # fmt: skip
    else:
        draft = build_feature_draft(
            target, layers, args.markov_rank, args.seed, args.device, args.draft_intermediate_size, sample,
            vocab_ids,
        )  # fmt: skip
    use_markov = draft.config.markov_rank > 0
    heldout = held_out(args, target, tokenizer, chat, eos)

    gb = args.feature_cache_gb
    budget = auto_budget(torch.device(args.device)) if gb is None else int(gb * 1e9)
    cache = FeatureCache(target, layers, data.offsets.diff(), args.max_len, budget)
    log("feature_cache", capacity_tokens=cache.capacity, data_tokens=int(cache.lengths.sum()),
        bytes=cache.capacity * cache.size * cache.dtype.itemsize)  # fmt: skip

    def loss_fn(model, rows, ids, tk_ids, tk_probs, mask):
        feats = cache.features(rows, ids)
        return ttt_loss(model, feats, ids, tk_ids, tk_probs, mask, args.ttt_depth, use_markov)

    def probe(model) -> dict:
        return {f"k{k}": feature_acceptance(model, target, *heldout, k).alpha for k in args.eval_k}

    steps_done = train(args, draft, data, log, deadline, probe, loss_fn, cache.stats)
    cache.close()  # its memory back before the export and the evaluation
    if steps_done < args.steps and not (args.export_partial and steps_done > 0):
        return 0
    draft.eval()
    extra = {
        "seed": args.seed,
        "steps": steps_done,
        "ttt_depth": args.ttt_depth,
        "prompt_set": args.prompt_set,
        "draft_vocab": args.draft_vocab,
        "init_draft": str(args.init_draft) if args.init_draft else None,
        # how the draft it started from was trained (its config's draft_training), kept with it
        "init_draft_training": init_training(args.init_draft),
        "command": "specsplit train-draft " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    target_ref = target_reference(args.target, args.out / "draft", args.target_ref)
    size = save_draft(draft, args.out / "draft", target_ref, args.save_dtype, args.include_shared, extra)
    table = feature_table(draft, target, heldout, args.eval_k)
    result = {"prompts": len(heldout[0]), "answer_tokens": sum(map(len, heldout[1])),
              "drafts": {"feature": table}, "draft_bytes": size}  # fmt: skip
    (args.out / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    log("done", draft=str(args.out / "draft"), draft_bytes=size, eval=result["drafts"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
