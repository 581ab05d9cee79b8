"""`specsplit demo` (`make demo`): both services on this machine, tiny generated models.

Starts a draft service (TP=2 over gloo by default) and a target service as
subprocesses, streams one generation with speculation to the terminal, runs the
same prompt again with speculation off, and reports whether the outputs are
identical, the acceptance, TPOT and the draft's TP bytes per draft token (read
from its Prometheus endpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from specsplit.launch import metric_sum, start_service
from specsplit.v1 import draft_pb2, draft_pb2_grpc, sampling_pb2, target_pb2, target_pb2_grpc

DEFAULT_PROMPT = "Speculative decoding splits one model into a fast guess and a careful check."


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


def generate(
    stub: target_pb2_grpc.TargetServiceStub, prompt: str, max_new_tokens: int, k: int | None, echo: bool
) -> dict[str, Any]:
    req = target_pb2.GenerateRequest(
        text=prompt,
        max_new_tokens=max_new_tokens,
        ignore_eos=True,
        sampling=sampling_pb2.SamplingParams(temperature=0.0),
    )
    if k is not None:
        req.num_speculative_tokens = k
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
    return {
        "ids": ids,
        "text": "".join(text),
        "usage": usage,
        "tpot": (last - first) / max(1, len(ids) - 1),
        "seconds": time.perf_counter() - t0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specsplit demo", description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument(
        "--draft-tp-size",
        type=int,
        default=1,
        help="2 shows the draft's TP communication (slow on 2 CPU cores)",
    )
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--markov-rank", type=int, default=0, help="give the draft a Markov head of this rank")
    ap.add_argument("--models", type=Path, default=None, help="model directory (default: a cache dir)")
    ap.add_argument("--json", action="store_true", help="print one machine-readable summary")
    args = ap.parse_args(argv)

    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    models = args.models or cache / "specsplit-demo-v2"
    models.mkdir(parents=True, exist_ok=True)
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    say(f"models: {models} (tiny, random weights; generated once)")
    target_dir, draft_dir = make_demo_models(models, args.markov_rank)
    logs = Path(tempfile.mkdtemp(prefix="specsplit-demo-"))
    draft = start_service(
        "draft_service", ["--model", str(draft_dir), "--tp-size", str(args.draft_tp_size)], logs / "draft.log"
    )
    procs = [draft]
    try:
        draft.wait_ready()
        target = start_service(
            "target_service",
            [
                "--model",
                str(target_dir),
                "--draft-address",
                f"127.0.0.1:{draft.port}",
                "--num-speculative-tokens",
                str(args.num_speculative_tokens),
            ],
            logs / "target.log",
        )
        procs.append(target)
        target.wait_ready()
        say(f"draft: tp={args.draft_tp_size} port {draft.port}; target: port {target.port}; logs in {logs}")
        with grpc.insecure_channel(f"127.0.0.1:{target.port}") as channel:
            stub = target_pb2_grpc.TargetServiceStub(channel)
            info = stub.GetModelInfo(target_pb2.GetModelInfoRequest(), timeout=10)
            generate(stub, args.prompt, 8, None, echo=False)  # warm-up
            draft_before = draft.scrape()
            say(f"\n--- speculative (k={args.num_speculative_tokens}, {info.draft_method}) ---")
            spec = generate(stub, args.prompt, args.max_new_tokens, None, echo=not args.json)
            draft_after = draft.scrape()
            say("--- plain decoding (k=0) ---")
            plain = generate(stub, args.prompt, args.max_new_tokens, 0, echo=False)
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
    usage = spec["usage"]
    steps = max(1, usage.steps)
    summary = {
        "lossless": spec["ids"] == plain["ids"],
        "output_tokens": usage.output_tokens,
        "acceptance_rate": usage.accepted_tokens / max(1, usage.drafted_tokens),
        "mean_accepted_length": usage.accepted_tokens / steps,
        "tokens_per_step": usage.output_tokens / steps,
        "tpot_seconds": spec["tpot"],
        "plain_tpot_seconds": plain["tpot"],
        "speedup": plain["seconds"] / spec["seconds"],
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
            f"{summary['plain_tpot_seconds'] * 1e3:.1f} ms without (CPU, tiny models)"
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
