"""A real target and a trained draft end to end through the two services, on held-out chat prompts.

    python bench/bench_real.py --target SmolLM2-135M-Instruct.Q4_1.gguf \\
        --draft drafts/smollm2-135m-instruct --device cuda --out real.json
    python bench/bench_real.py --target F.gguf --draft D --device cpu --dtype float32 \\
        --batches 1 2 --new-tokens 8 --repeats 1                              # a CPU smoke run
    bench/device.sh real                        # the same on the GPU machine (the GGUF carried by `transfer`)

The services and the measurement are bench/bench_e2e.py's (start_stack, run_batch, summarise): one draft
service and one target per mode (`plain`: no draft attached; `fixed`: k every step; `adaptive`: k per
step from measured costs), both services on one GPU (`--placement colocated`; pick it with
CUDA_VISIBLE_DEVICES), and with `--local-modes fixed adaptive` targets that run the draft inside them
(`--draft-local`, the one-GPU deployment); greedy, k = 4, `--repeats` interleaved rounds per batch size,
median and spread of wall-clock tok/s and TPOT, acceptance as accepted/drafted and as per-token alpha.
What differs from bench_e2e: the prompts are the HELD-OUT chat prompts (common/training/prompts.py, never
trained on) rendered with the target's chat template (B=16 takes the first 16; fewer prompts than B are
cycled), and generation stops at the template's EOS (`--ignore-eos` to always generate --new-tokens).

Correctness: after the timed runs the services stop and the project's own model computes the greedy
reference in `--reference-dtype` (float32) alone, B=1, on the same device. Every service output (plain
and speculative, every repeat) is compared with it token for token (`reference.match` in the JSON). For
each distinct divergence (at most 24) the target is reloaded alone in the serving dtype and in the
reference dtype and its top logits at the first differing token, on the common prefix, are reported
(`reference.margins`): the service's and the reference's tokens as the top-2 with a gap at the serving
dtype's rounding level (one bf16 ulp is 0.125 at logits 16-32) is a near-tie, not a bug. `--top N`
keeps N logits per divergence, which settles a tie among three or more tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_e2e import (
    base_mode,
    divergence_margins,
    local_lines,
    markdown_table,
    run_batch,
    start_stack,
    summarise,
)
from common.training import prompts as builtin_prompts

MAX_DIVERGENCES = 24  # distinct divergences whose margins are computed (each is one B=1 forward per dtype)


def chat_prompts(target: Path, count: int) -> list[list[int]]:
    """The held-out prompts as chat-template token ids, cycled to `count`."""
    from common.loader import load_tokenizer
    from common.training.train_draft import prompt_ids

    tokenizer = load_tokenizer(target)
    if not getattr(tokenizer, "chat_template", None):
        raise SystemExit(f"--target {target}: the model has no chat template")
    ids = prompt_ids(tokenizer, builtin_prompts.held_out_prompts(), chat=True)
    return [ids[i % len(ids)] for i in range(count)]


def eos_of(target: Path) -> set[int]:
    from common.config import ModelConfig
    from common.loader import load_tokenizer, open_checkpoint

    config: ModelConfig = open_checkpoint(target)[0]
    eos = config.eos_token_id
    ids = set(eos) if isinstance(eos, list) else ({eos} if eos is not None else set())
    tok = load_tokenizer(target).eos_token_id
    return ids | ({tok} if tok is not None else set())


def cut(ids: list[int], eos: set[int]) -> list[int]:
    """Output up to and including its first EOS (services and the reference agree on this form)."""
    for i, t in enumerate(ids):
        if t in eos:
            return ids[: i + 1]
    return ids


def reference_outputs(args, prompts: list[list[int]], eos: set[int]) -> list[list[int]]:
    """Greedy answers of the project's own model in --reference-dtype, each prompt alone (B=1)."""
    import torch

    from common.config import DTYPES
    from common.distributed import Comm
    from common.loader import load_model
    from common.models.generate import greedy_generate

    model = load_model(args.target, Comm(), device=args.device, dtype=DTYPES[args.reference_dtype])
    out = []
    for p in prompts:
        ids = greedy_generate(model, [p], args.new_tokens)[0]
        out.append(ids if args.ignore_eos else cut(ids, eos))
    del model
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return out


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token of two outputs, or None when one is a prefix of the other."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def compare_with_reference(args, prompts, all_runs, uniq, reference, eos) -> tuple[dict, list[dict]]:
    """Per (mode, batch): sequences identical to the reference and the mean matched-prefix fraction; and
    the distinct divergences (prompt = index into `uniq`, position, service token, reference token)."""
    index = {p: i for i, p in enumerate(uniq)}
    stats: dict = {}
    divergences: dict[tuple, dict] = {}
    for batch, runs in all_runs:
        for mode, rs in runs.items():
            same = total = 0
            prefix = 0.0
            for r in rs:
                for b, ids in enumerate(r["ids"]):
                    out = ids if args.ignore_eos else cut(ids, eos)
                    u = index[tuple(prompts[b])]
                    ref = reference[u]
                    total += 1
                    same += out == ref
                    j = first_difference(out, ref)
                    prefix += (min(len(out), len(ref)) if j is None else j) / max(1, len(ref))
                    if j is None:
                        continue
                    d = divergences.setdefault(
                        (u, j, out[j]),
                        {
                            "prompt": u,
                            "position": j,
                            "service_token": out[j],
                            "reference_token": ref[j],
                            "seen": 0,
                            "modes": [],
                        },
                    )
                    d["seen"] += 1
                    if f"{mode}/B{batch}" not in d["modes"]:
                        d["modes"].append(f"{mode}/B{batch}")
            stats[f"{mode}/B{batch}"] = {
                "identical": f"{same}/{total}",
                "matched_prefix": prefix / max(1, total),
            }
    return stats, sorted(divergences.values(), key=lambda d: (d["prompt"], d["position"]))


def margins(args, uniq, reference, found: list[dict]) -> list[dict]:
    """The target's top logits alone (B=1) at each divergence, on the common prefix, in the serving dtype
    and in the reference dtype: `top2_ids`, `top2_gap`, `top1_logit`, and the `--top` best as `top`
    ([token, logit] pairs). `pair_is_top2`: the service's and the reference's tokens are the top-2."""
    chosen = found[:MAX_DIVERGENCES]
    out = [dict(d) for d in chosen]
    for dtype in dict.fromkeys([args.dtype, args.reference_dtype]):
        mismatches = [
            (
                dtype,
                list(uniq[d["prompt"]]),
                [*reference[d["prompt"]][: d["position"]], d["service_token"]],
                reference[d["prompt"]],
                {"prompt": d["prompt"]},
            )
            for d in chosen
        ]
        found_margins = divergence_margins(Path(args.target), args.device, mismatches, top=args.top)
        for row, m in zip(out, found_margins):
            row[dtype] = {
                "top2_ids": m["top2_ids"],
                "top2_gap": m["top2_gap"],
                "top1_logit": m["top1_logit"],
                "top": [[t, v] for t, v in zip(m["top_ids"], m["top_logits"])],
            }
    for row in out:
        row["pair_is_top2"] = {row["service_token"], row["reference_token"]} == set(
            row[args.dtype]["top2_ids"]
        )
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True, help="the target: a .gguf file or checkpoint dir")
    ap.add_argument("--draft", type=Path, required=True, help="the draft checkpoint dir")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--reference-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--no-reference", action="store_true", help="skip the reference comparison")
    ap.add_argument(
        "--top",
        type=int,
        default=2,
        help="logits kept per divergence (more than 2 settles a tie of 3 or more tokens)",
    )
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--modes", nargs="+", default=["plain", "fixed", "adaptive"], choices=["plain", "fixed", "adaptive"]
    )
    ap.add_argument("--local-modes", nargs="*", default=[], choices=["fixed", "adaptive"],
                    help="also targets MODE@local with the draft inside them (--draft-local)")  # fmt: skip
    ap.add_argument("--k", type=int, default=4, help="tokens drafted per step (fixed; adaptive's maximum)")
    ap.add_argument("--new-tokens", type=int, default=128, help="most tokens generated per request")
    ap.add_argument("--ignore-eos", action="store_true", help="always generate --new-tokens")
    ap.add_argument("--placement", default="colocated", choices=["auto", "colocated", "split"])
    ap.add_argument("--draft-tp-size", type=int, default=1)
    ap.add_argument("--target-tp-size", type=int, default=1)
    ap.add_argument("--draft-args", default="", help="extra draft service flags")
    ap.add_argument("--target-args", default="", help="extra target service flags")
    ap.add_argument("--target-log-level", default="INFO",
                    help="DEBUG: phase times, policy costs and gates every 64 steps")  # fmt: skip
    ap.add_argument("--logs", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    return ap


def timed_runs(args, stack, prompts) -> tuple[list[dict], list[tuple[int, dict]]]:
    """Warm-up, then per batch size `--repeats` interleaved rounds over the modes; summarised rows."""
    for batch in args.batches:  # warm-up: allocator, connections, eager kernel variants
        for mode, t in stack.targets.items():
            k = 0 if base_mode(mode) == "plain" else args.k
            run_batch(t, stack.draft_of(mode), prompts[:batch], 8, k, args.ignore_eos)
    rows, all_runs = [], []
    for batch in args.batches:
        runs: dict[str, list[dict]] = {m: [] for m in stack.targets}
        for _ in range(args.repeats):
            for mode, t in stack.targets.items():
                k = 0 if base_mode(mode) == "plain" else args.k
                runs[mode].append(
                    run_batch(t, stack.draft_of(mode), prompts[:batch], args.new_tokens, k, args.ignore_eos)
                )
        row = summarise(args.dtype, batch, args.k, runs)
        row["output_tokens"] = {m: [sum(map(len, r["ids"])) for r in rs] for m, rs in runs.items()}
        if "plain" in runs:
            plain = runs["plain"][0]["ids"]
            for mode, rs in runs.items():
                row[mode]["identical_to_plain"] = [
                    f"{sum(a == b for a, b in zip(r['ids'], plain))}/{batch}" for r in rs
                ]
        rows.append(row)
        all_runs.append((batch, runs))
        print(json.dumps(row), flush=True)
    return rows, all_runs


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prompts = chat_prompts(args.target, max(args.batches))
    eos = eos_of(args.target)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="specsplit-real-"))
    logs.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    stack = start_stack(args, args.dtype, args.target, args.draft, logs)
    print(f"services ready in {time.perf_counter() - t0:.0f}s (logs: {logs})", flush=True)
    try:
        rows, all_runs = timed_runs(args, stack, prompts)
    finally:
        for t in stack.targets.values():
            t.stop()
        stack.draft.stop()
    print(
        f"\nreal pair: target {args.target.name}, draft {args.draft}, {args.device} {args.dtype}, "
        f"k={args.k}, <= {args.new_tokens} new tokens, {args.repeats} interleaved repeats (median [min-max])"
    )
    print(markdown_table(rows))
    for row in rows:
        for line in local_lines(row):
            print(line)
    result = {
        "target": str(args.target),
        "draft": str(args.draft),
        "device": args.device,
        "dtype": args.dtype,
        "placement": args.placement,
        "argv": sys.argv if argv is None else argv,
        "prompts": len(prompts),
        "ignore_eos": args.ignore_eos,
        "rows": rows,
    }
    if args.device == "cuda":
        import torch

        result["gpu"] = torch.cuda.get_device_name()
    if not args.no_reference:
        uniq = list(dict.fromkeys(tuple(p) for p in prompts))
        reference = reference_outputs(args, [list(p) for p in uniq], eos)
        stats, found = compare_with_reference(args, prompts, all_runs, uniq, reference, eos)
        result["reference"] = {
            "dtype": args.reference_dtype,
            "match": stats,
            "divergences": len(found),
            "margins": margins(args, uniq, reference, found) if found else [],
        }
        print(f"\nagainst the {args.reference_dtype} reference (B=1, alone): {json.dumps(stats)}")
        for m in result["reference"]["margins"]:
            s = m[args.dtype]
            print(
                f"divergence prompt {m['prompt']} token {m['position']}: service {m['service_token']} vs "
                f"reference {m['reference_token']}; {args.dtype} top-2 {s['top2_ids']} "
                f"gap {s['top2_gap']:.4g} at logit {s['top1_logit']:.4g}; {args.reference_dtype} gap "
                f"{m[args.reference_dtype]['top2_gap']:.4g} ({', '.join(m['modes'])})"
            )
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
