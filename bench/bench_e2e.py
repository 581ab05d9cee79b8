"""End-to-end throughput: plain target vs speculative decoding, measured honestly.

    python bench/bench_e2e.py --preset qwen1.5b --device cuda --dtypes bfloat16 --out e2e.json
    python bench/bench_e2e.py --preset tiny --device cpu --batches 1 4 --repeats 1   # a smoke run

Writes a random-weight target (Qwen2.5-1.5B shapes for `qwen1.5b`) and a draft that shares its
embeddings, head and first layers (the target's later layers are damped so the draft agrees often:
random weights have no language to agree on otherwise). Starts one draft and three targets per dtype:
  - `plain`: a target with no draft attached (the baseline),
  - `fixed`: draft attached, --speculation-policy fixed (every step asks k),
  - `adaptive`: draft attached, --speculation-policy adaptive (k per step from measured costs),
and, for every batch size, runs `--repeats` interleaved rounds (plain, k=0 through the `fixed` target,
fixed, adaptive, then again) of B concurrent greedy requests. Reported per mode: wall-clock output
tokens/s (the primary figure: total output tokens / wall time of the batch), TPOT (median over requests
of decode time / (tokens - 1)), both as median and spread (min-max) over the repeats; acceptance as
accepted/drafted and as per-token alpha solved from the mean accepted length per speculative step
(E[a] = sum_{i=1..k} alpha^i); c = one draft position / one plain step (draft round time / k over the
plain run's step time, both timed); the ideal speedup (1 + E[a]) / (k c + 1); the target's step GPU time
and host time (wall minus GPU) from its metrics; and the k the adaptive policy chose. With two or more
GPUs the draft runs on GPU 0 and the targets on GPU 1 (one GPU: all share it).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.tiny import make_model_pair
from common.training.measure import solve_alpha
from specsplit.bench_serve import ideal_speedup
from specsplit.launch import ServiceProcess, free_port, metric_sum, start_service
from specsplit.v1 import sampling_pb2, target_pb2, target_pb2_grpc

PRESETS = {
    # Qwen2.5-1.5B shapes: 1.54B parameters.
    "qwen1.5b": dict(
        vocab_size=151936,
        hidden_size=1536,
        num_layers=28,
        num_heads=12,
        num_kv_heads=2,
        intermediate_size=8960,
        draft_layers=2,
    ),
    # Qwen2.5-7B shapes: 7.6B parameters, the model that needs TP (issue 11's TP=2 <= 0.7 x TP=1).
    # Written in bf16: 15 GB instead of 30, each target loads it in its own dtype.
    "qwen7b": dict(
        vocab_size=152064,
        hidden_size=3584,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        intermediate_size=18944,
        draft_layers=2,
        tie_word_embeddings=False,
        dtype="bfloat16",
    ),
    "tiny": dict(
        vocab_size=512,
        hidden_size=128,
        num_layers=6,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=256,
        draft_layers=1,
    ),
}
# Damping of the target's layers past the draft's. At 0.02 the 1.5B pair agrees on 88% of greedy next tokens
# (teacher-forced, measured on CPU): about what a good trained draft reaches on real text.
LATE_LAYER_SCALE = {"qwen1.5b": 0.02, "qwen7b": 0.02, "tiny": 0.1}


def make_models(root: Path, preset: str, markov_rank: int = 0) -> tuple[Path, Path]:
    shape = dict(PRESETS[preset])
    draft_layers, target_layers = shape.pop("draft_layers"), shape.pop("num_layers")
    draft = root / (f"{preset}-draft-markov{markov_rank}" if markov_rank else f"{preset}-draft")
    return make_model_pair(root / f"{preset}-target", draft, draft_layers=draft_layers,
                           target_layers=target_layers, late_layer_scale=LATE_LAYER_SCALE[preset],
                           markov_rank=markov_rank, max_position_embeddings=4096, **shape)  # fmt: skip


def one(stub, ids: list[int], n: int, k: int, ignore_eos: bool = True) -> dict:
    req = target_pb2.GenerateRequest(
        token_ids=target_pb2.TokenIds(ids=ids),
        max_new_tokens=n,
        ignore_eos=ignore_eos,
        num_speculative_tokens=k,
        sampling=sampling_pb2.SamplingParams(temperature=0),
    )
    out: list[int] = []
    first = last = 0.0
    usage = None
    for msg in stub.Generate(req, timeout=1800):
        now = time.perf_counter()
        if msg.token_ids:
            first = first or now
            last = now
        out += msg.token_ids
        if msg.HasField("usage"):
            usage = msg.usage
    return {"ids": out, "tpot": (last - first) / max(1, len(out) - 1), "usage": usage}


# Target metrics read before and after each run (sums and counts of histograms, counters).
SERIES = {
    "verify_sum": "specsplit_verify_step_seconds_sum",
    "verify_n": "specsplit_verify_step_seconds_count",
    "gpu_sum": "specsplit_step_gpu_seconds_sum",
    "gpu_n": "specsplit_step_gpu_seconds_count",
    "host_sum": "specsplit_step_host_seconds_sum",
    "host_n": "specsplit_step_host_seconds_count",
    "queue_sum": "specsplit_step_gpu_queue_seconds_sum",
    "queue_n": "specsplit_step_gpu_queue_seconds_count",
    "gap_sum": "specsplit_step_gpu_gap_seconds_sum",
    "gap_n": "specsplit_step_gpu_gap_seconds_count",
    "k_sum": "specsplit_spec_step_tokens_sum",
    "k_n": "specsplit_spec_step_tokens_count",
    "fallbacks": "specsplit_spec_fallback_steps_total",
    "captures": "specsplit_serving_captures_total",
    "rt_sum": "specsplit_draft_round_trip_seconds_sum",
    "rt_n": "specsplit_draft_round_trip_seconds_count",
    "pipelined": "specsplit_spec_pipelined_steps_total",
}


def snapshot(target, draft) -> dict[str, float]:
    samples = target.scrape()
    snap = {key: metric_sum(samples, name) for key, name in SERIES.items()}
    if draft is not None:
        d = draft.scrape()
        snap["draft_sum"] = metric_sum(d, "specsplit_draft_step_seconds_sum")
        snap["draft_n"] = metric_sum(d, "specsplit_draft_step_seconds_count")
        snap["handle_sum"] = metric_sum(d, "specsplit_draft_handle_seconds_sum")
        snap["handle_n"] = metric_sum(d, "specsplit_draft_handle_seconds_count")
        snap["draft_tp_bytes"] = metric_sum(d, "specsplit_tp_comm_bytes_total")  # draft rank 0's sends
        snap["ahead_hits"] = metric_sum(d, "specsplit_draft_ahead_hits_total")
        snap["ahead_misses"] = metric_sum(d, "specsplit_draft_ahead_misses_total")
        snap["ahead_sum"] = metric_sum(d, "specsplit_draft_ahead_step_seconds_sum")
        snap["ahead_n"] = metric_sum(d, "specsplit_draft_ahead_step_seconds_count")
    return snap


def ratio(delta: dict, a: str, b: str) -> float:
    return delta.get(a, 0.0) / delta[b] if delta.get(b) else 0.0


# Streams per client process. One Python process reading 64 streams (a message per token each) bounded
# plain decoding at B=64 below the target's step rate (TPOT 11.9 ms against a 4.4 ms step); larger
# batches are spread over client processes, each with its own channel.
STREAMS_PER_CLIENT = 16
_clients: ProcessPoolExecutor | None = None


def client_chunk(address: str, prompts: list[list[int]], n: int, k: int, ignore_eos: bool) -> list[dict]:
    """One client's share of a batch: a stream per prompt on one channel, a thread each."""
    with grpc.insecure_channel(address) as ch:
        stub = target_pb2_grpc.TargetServiceStub(ch)
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda p: one(stub, p, n, k, ignore_eos), prompts))
    for r in results:  # plain values: they cross a process boundary
        usage = r.pop("usage")
        r["drafted"], r["accepted"] = usage.drafted_tokens, usage.accepted_tokens
    return results


def run_clients(address: str, prompts: list[list[int]], n: int, k: int, ignore_eos: bool) -> list[dict]:
    if len(prompts) <= STREAMS_PER_CLIENT:
        return client_chunk(address, prompts, n, k, ignore_eos)
    global _clients
    chunks = [prompts[i : i + STREAMS_PER_CLIENT] for i in range(0, len(prompts), STREAMS_PER_CLIENT)]
    if _clients is None or _clients._max_workers < len(chunks):
        # spawn, not fork: a forked gRPC process can hang. Started by the warm-up runs, kept after.
        _clients = ProcessPoolExecutor(len(chunks), mp_context=multiprocessing.get_context("spawn"))
    futures = [_clients.submit(client_chunk, address, c, n, k, ignore_eos) for c in chunks]
    return [r for f in futures for r in f.result()]


def run_batch(service, draft, prompts: list[list[int]], n: int, k: int, ignore_eos: bool = True) -> dict:
    before = snapshot(service, draft)
    t0 = time.perf_counter()
    results = run_clients(service.address, prompts, n, k, ignore_eos)
    wall = time.perf_counter() - t0
    after = snapshot(service, draft)
    delta = {key: after[key] - before.get(key, 0.0) for key in after}
    drafted = sum(r["drafted"] for r in results)
    accepted = sum(r["accepted"] for r in results)
    return {
        "ids": [r["ids"] for r in results],
        "tokens_per_s": sum(len(r["ids"]) for r in results) / wall,
        "tpot_ms": 1e3 * statistics.median(r["tpot"] for r in results),
        "drafted": drafted,
        "accepted": accepted,
        "verify_step_ms": 1e3 * ratio(delta, "verify_sum", "verify_n"),
        "step_gpu_ms": 1e3 * ratio(delta, "gpu_sum", "gpu_n"),
        "step_host_ms": 1e3 * ratio(delta, "host_sum", "host_n"),
        "step_gpu_queue_ms": 1e3 * ratio(delta, "queue_sum", "queue_n"),
        "step_gpu_gap_ms": 1e3 * ratio(delta, "gap_sum", "gap_n"),
        "mean_k": ratio(delta, "k_sum", "k_n"),
        "draft_round_ms": 1e3 * ratio(delta, "draft_sum", "draft_n"),
        "round_trip_ms": 1e3 * ratio(delta, "rt_sum", "rt_n"),
        "draft_handle_ms": 1e3 * ratio(delta, "handle_sum", "handle_n"),
        "draft_tp_bytes_per_drafted_token": delta.get("draft_tp_bytes", 0.0) / drafted if drafted else 0.0,
        "fallback_steps": delta.get("fallbacks", 0.0),
        "serving_captures": delta.get("captures", 0.0),
        # Steps verified on the draft's branches without waiting for its answer, of all steps.
        "pipelined_fraction": ratio(delta, "pipelined", "verify_n"),
        "ahead_hit_rate": delta.get("ahead_hits", 0.0)
        / max(1.0, delta.get("ahead_hits", 0.0) + delta.get("ahead_misses", 0.0)),
        "draft_ahead_round_ms": 1e3 * ratio(delta, "ahead_sum", "ahead_n"),
    }


def gpu_split(
    device: str, draft_tp: int, target_tp: int, placement: str = "auto"
) -> tuple[dict[str, str], dict[str, str]]:
    """Separate GPUs for the two services when the machine has enough and placement allows (each TP
    group from its device 0); `colocated` puts both groups on the first GPUs. GPU ids come from this
    process's CUDA_VISIBLE_DEVICES when set: the services' own value replaces it ("0" = physical GPU 0)."""
    if device != "cuda":
        return {}, {}
    import os

    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    if placement == "colocated":
        shared = ",".join(gpus[: max(draft_tp, target_tp)])
        return {"CUDA_VISIBLE_DEVICES": shared}, {"CUDA_VISIBLE_DEVICES": shared}
    if torch.cuda.device_count() < draft_tp + target_tp:
        if placement == "split":
            raise SystemExit(f"--placement split needs {draft_tp + target_tp} GPUs")
        return {}, {}  # both share the visible GPUs (one H200: both on it)
    ids = gpus[: draft_tp + target_tp]
    return {"CUDA_VISIBLE_DEVICES": ",".join(ids[:draft_tp])}, {
        "CUDA_VISIBLE_DEVICES": ",".join(ids[draft_tp:])
    }


def divergence_margins(target_dir: Path, device: str, mismatches, top: int = 2) -> list[dict]:
    """For each mismatch (dtype, prompt, spec, plain, where): the target's `top` logits at the first token
    where spec and plain differ, computed alone (B=1, eager) on the common prefix, with the keys of `where`
    (batch, mode, request, ...). A top-2 gap at the dtype's rounding level is a near-tie."""
    import torch

    from common.distributed import init_tp
    from common.kv_cache import KVCache
    from common.loader import load_model
    from common.models.generate import forward_rows

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    out = []
    for dtype in sorted({m[0] for m in mismatches}):
        model = load_model(target_dir, init_tp(1, 0, device=torch.device(device)), device=device,
                           dtype=dtypes[dtype])  # fmt: skip
        for _, prompt, spec, plain, where in (m for m in mismatches if m[0] == dtype):
            j = next(i for i, (a, b) in enumerate(zip(spec, plain)) if a != b)
            context = prompt + plain[:j]
            cache = KVCache.for_model(model, 1, len(context) + 1)
            with torch.inference_mode():
                hidden = forward_rows(model, cache, [0], [0], [context])[0, -1:]
                best = model.compute_logits(hidden)[0].topk(max(2, top))
            values, ids = best.values.tolist(), best.indices.tolist()
            out.append(
                dict(dtype=dtype, **where, position=j, spec_token=spec[j], plain_token=plain[j],
                     top2_ids=ids[:2], top2_gap=values[0] - values[1], top1_logit=values[0], top_ids=ids,
                     top_logits=values)
            )  # fmt: skip
        del model
    return out


def median_spread(values: list[float]) -> dict:
    med = statistics.median(values)
    spread = 100 * max(abs(v - med) for v in values) / med if med else 0.0
    return {"median": med, "min": min(values), "max": max(values), "spread_pct": spread, "runs": values}


@dataclass
class Stack:
    draft: object
    targets: dict  # mode -> ServiceProcess
    local_drafts: dict  # MODE@local -> the /metrics of the draft inside that target (--draft-local)

    def draft_of(self, name: str):
        return self.local_drafts.get(name, self.draft)


def target_names(modes: list[str], variant_modes: list[str]) -> list[str]:
    """One target per mode, each followed by its `MODE+v` twin (started with --variant-args) where asked:
    the repeats then run each pair back to back, an interleaved A/B of the flags."""
    return [n for m in modes for n in ([m, f"{m}+v"] if m in variant_modes else [m])]


def base_mode(name: str) -> str:
    """plain, fixed or adaptive: the policy of a target named MODE, MODE+v or MODE@local."""
    return name.split("+")[0].split("@")[0]


def start_stack(args, dtype: str, target_dir: Path, draft_dir: Path, logs: Path) -> Stack:
    draft_env, target_env = gpu_split(args.device, args.draft_tp_size, args.target_tp_size, args.placement)
    common = ["--device", args.device, "--dtype", dtype]
    max_batch = str(max(args.batches))
    # The draft's flags, as a service or inside a target (--draft-local); --draft-args come last and win.
    draft_flags = ["--model", str(draft_dir), "--max-batch-size", str(2 * max(args.batches)),
                   "--num-speculative-tokens", str(args.k)]  # fmt: skip
    draft = start_service(
        "draft_service",
        [*draft_flags, *common, "--tp-size", str(args.draft_tp_size), *args.draft_args.split()],
        logs / f"draft-{dtype}.log",
        env=draft_env,
    )
    draft.wait_ready(900)

    def start_target(name: str, extra: list[str], tp_size: int = args.target_tp_size, env=target_env):
        extra = [*extra, "--log-level", getattr(args, "target_log_level", "INFO"),
                 *getattr(args, "target_args", "").split()]  # fmt: skip
        if getattr(args, "step_traces", False):
            extra += ["--step-trace", str(logs / f"target-{name}-{dtype}-steps.jsonl")]
        return start_service(
            "target_service",
            ["--model", str(target_dir), *common, "--tp-size", str(tp_size),
             "--num-speculative-tokens", str(args.k), "--max-batch-size", max_batch, *extra],
            logs / f"target-{name}-{dtype}.log",
            env=env,
        )  # fmt: skip

    targets = {}
    variant = getattr(args, "variant_args", "").split()
    for name in target_names(args.modes, getattr(args, "variant_modes", []) if variant else []):
        mode = base_mode(name)
        extra = [] if mode == "plain" else ["--draft-address", draft.address, "--speculation-policy", mode]
        targets[name] = start_target(name, extra + (variant if name != mode else []))
    for tp in getattr(args, "plain_tp", []):  # plain targets at other TP sizes, interleaved with the rest
        env = gpu_split(args.device, args.draft_tp_size, tp, "colocated")[1]
        targets[f"plain@tp{tp}"] = start_target(f"plain@tp{tp}", [], tp_size=tp, env=env)
    local_drafts = {}
    for mode in getattr(args, "local_modes", []):  # the draft inside the target: --draft-local
        policy, _, nochain = mode.partition("-")
        name, port = f"{policy}@local" + ("-nochain" if nochain else ""), free_port()
        local = " ".join([*draft_flags, "--metrics-port", str(port), *args.draft_args.split()])
        chain = ["--no-draft-chain"] if nochain else []
        targets[name] = start_target(name, ["--draft-local", local, "--speculation-policy", policy, *chain])
        local_drafts[name] = ServiceProcess("draft_service", targets[name].popen, 0, port, targets[name].log)
    for t in targets.values():
        t.wait_ready(900)
    return Stack(draft, targets, local_drafts)


def summarise(dtype: str, batch: int, k: int, runs: dict[str, list[dict]]) -> dict:
    row: dict = {"dtype": dtype, "batch": batch, "k": k}
    for mode, rs in runs.items():
        row[mode] = {
            "tokens_per_s": median_spread([r["tokens_per_s"] for r in rs]),
            "tpot_ms": median_spread([r["tpot_ms"] for r in rs]),
            "step_gpu_ms": statistics.median(r["step_gpu_ms"] for r in rs),
            "step_host_ms": statistics.median(r["step_host_ms"] for r in rs),
            "step_gpu_queue_ms": statistics.median(r.get("step_gpu_queue_ms", 0.0) for r in rs),
            "step_gpu_gap_ms": statistics.median(r.get("step_gpu_gap_ms", 0.0) for r in rs),
            "verify_step_ms": statistics.median(r["verify_step_ms"] for r in rs),
            "serving_captures": sum(r["serving_captures"] for r in rs),
            "fallback_steps": sum(r["fallback_steps"] for r in rs),
        }
        if mode != "plain" and "plain" in runs:
            row[mode]["speedup_vs_plain"] = (
                row[mode]["tokens_per_s"]["median"] / row["plain"]["tokens_per_s"]["median"]
            )
            row[mode]["speedup_each_repeat"] = [
                a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(rs, runs["plain"])
            ]
        if base_mode(mode) in ("fixed", "adaptive"):
            drafted, accepted = sum(r["drafted"] for r in rs), sum(r["accepted"] for r in rs)
            mean_acc = accepted / (drafted / k) if drafted else 0.0  # per speculative step of k drafts
            row[mode].update(
                accepted_over_drafted=accepted / drafted if drafted else 0.0,
                mean_accepted=mean_acc,
                alpha=solve_alpha(mean_acc, k),
                mean_k=statistics.median(r["mean_k"] for r in rs),
                draft_round_ms=statistics.median(r["draft_round_ms"] for r in rs),
                round_trip_ms=statistics.median(r["round_trip_ms"] for r in rs),
                draft_handle_ms=statistics.median(r["draft_handle_ms"] for r in rs),
                pipelined_fraction=statistics.median(r["pipelined_fraction"] for r in rs),
                ahead_hit_rate=statistics.median(r["ahead_hit_rate"] for r in rs),
                draft_ahead_round_ms=statistics.median(r["draft_ahead_round_ms"] for r in rs),
                draft_tp_bytes_per_drafted_token=statistics.median(
                    r["draft_tp_bytes_per_drafted_token"] for r in rs),
            )  # fmt: skip
    for mode in ("fixed", "fixed@local-nochain", "fixed@local"):
        if mode not in row or "plain" not in row:
            continue
        f = row[mode]
        # c: one draft position (a round of k, measured on the draft) over one plain step (measured TPOT
        # of the plain target at this batch: one token per request per step). A target whose rounds run
        # chained to its verify times only its other rounds (first ones, catch-ups): its twin without
        # chaining times the same rounds of the same draft, in the same process.
        rounds = f["draft_round_ms"]
        if mode == "fixed@local" and "fixed@local-nochain" in row:
            rounds = row["fixed@local-nochain"]["draft_round_ms"]
            f["c_from"] = "fixed@local-nochain"
        c = (rounds / k) / row["plain"]["tpot_ms"]["median"] if rounds else 0.0
        ideal = ideal_speedup(f["mean_accepted"], k, c)
        f.update(
            cost_ratio_c=c, ideal_speedup=ideal, efficiency=f["speedup_vs_plain"] / ideal if ideal else 0.0
        )
        if mode == "fixed":  # the row's own figures: the two-service placement
            row.update(cost_ratio_c=c, ideal_speedup=ideal, efficiency=f["efficiency"])
    return row


def local_lines(row: dict) -> list[str]:
    """One line per target of a summarised row whose draft runs inside it (MODE@local)."""
    lines = []
    for mode in (m for m in row if "@local" in m):
        m = row[mode]
        t, each = m["tokens_per_s"], ", ".join(f"{x:.2f}" for x in m.get("speedup_each_repeat", []))
        eff = f", efficiency {m['efficiency']:.2f}" if "efficiency" in m else ""
        lines.append(f"{mode} (draft in the target), {row['dtype']} B={row['batch']}: {t['median']:.0f} "
                     f"[{t['min']:.0f}-{t['max']:.0f}] tok/s, / plain: {each}; round trip "
                     f"{m['round_trip_ms']:.2f} ms, draft round {m['draft_round_ms']:.2f} ms, host "
                     f"{m['step_host_ms']:.2f} ms, GPU gap {m['step_gpu_gap_ms']:.2f} ms, mean k "
                     f"{m['mean_k']:.2f}{eff}")  # fmt: skip
    return lines


def markdown_table(rows: list[dict]) -> str:
    head = ["dtype", "B", "plain tok/s", "k=0 + draft tok/s", "fixed tok/s", "adaptive tok/s", "fixed x",
            "adaptive x", "TPOT plain / fixed / adaptive ms", "alpha", "E[a]", "c", "ideal",
            "host ms/step plain, fixed", "GPU queue ms/step plain, fixed", "adaptive mean k"]  # fmt: skip

    def tps(row: dict, mode: str) -> str:
        if mode not in row:
            return "-"
        t = row[mode]["tokens_per_s"]
        return f"{t['median']:.0f} [{t['min']:.0f}-{t['max']:.0f}]"

    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        f, a, p = r.get("fixed", {}), r.get("adaptive", {}), r.get("plain", {})
        modes = [m for m in ("plain", "fixed", "adaptive") if m in r]
        cells = [
            r["dtype"], str(r["batch"]), tps(r, "plain"), tps(r, "k0_with_draft"), tps(r, "fixed"),
            tps(r, "adaptive"), f"{f.get('speedup_vs_plain', 0):.2f}", f"{a.get('speedup_vs_plain', 0):.2f}",
            " / ".join(f"{r[m]['tpot_ms']['median']:.2f}" for m in modes), f"{f.get('alpha', 0):.2f}",
            f"{f.get('mean_accepted', 0):.2f}", f"{r.get('cost_ratio_c', 0):.3f}",
            f"{r.get('ideal_speedup', 0):.2f}",
            f"{p.get('step_host_ms', 0):.2f}, {f.get('step_host_ms', 0):.2f}",
            f"{p.get('step_gpu_queue_ms', 0):.2f}, {f.get('step_gpu_queue_ms', 0):.2f}",
            f"{a.get('mean_k', 0):.2f}",
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--preset",
        default="tiny",
        choices=list(PRESETS),
        help="model shapes: qwen1.5b (Qwen2.5-1.5B), qwen7b (Qwen2.5-7B), tiny (CPU runs)",
    )
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16"], help="serving dtypes, each a run of its own")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16, 64],
                    help="concurrent requests per run, in this order")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds over the modes per batch")
    ap.add_argument("--probe-divergences", type=int, default=2, metavar="N",
                    help="per batch and mode, the target's top-2 gap at the first N distinct sequences that "
                    "differ from plain (a near-tie, or a bug)")  # fmt: skip
    ap.add_argument("--modes", nargs="+", default=["plain", "fixed", "adaptive"],
                    choices=["plain", "fixed", "adaptive"])  # fmt: skip
    ap.add_argument(
        "--no-k0",
        action="store_true",
        help="skip the k=0 runs through the fixed target (a profile of fixed steps alone)",
    )
    ap.add_argument("--k", type=int, default=4, help="tokens drafted per step (fixed; adaptive's maximum)")
    ap.add_argument("--local-modes", nargs="*", default=[],
                    choices=["fixed", "adaptive", "fixed-nochain", "adaptive-nochain"],
                    help="also run targets MODE@local whose draft runs inside them (--draft-local), "
                         "interleaved with the others; MODE-nochain: MODE@local-nochain, with "
                         "--no-draft-chain")  # fmt: skip
    ap.add_argument("--placement", default="auto", choices=["auto", "colocated", "split"],
                    help="split: each service on its own GPUs; auto: split if enough")  # fmt: skip
    ap.add_argument("--draft-tp-size", type=int, default=1, help="the draft service's TP ranks")
    ap.add_argument("--plain-tp", nargs="*", type=int, default=[], metavar="N",
                    help="also run a plain target at target TP=N (on the first N GPUs), interleaved with "
                         "the others: its TPOT against the plain target's, repeat by repeat")  # fmt: skip
    ap.add_argument("--target-tp-size", type=int, default=1, help="each target's TP ranks")
    ap.add_argument(
        "--draft-args", default="", help="extra draft flags, e.g. '--no-use-local-argmax-reduction'"
    )
    ap.add_argument("--target-args", default="", help="extra target flags, e.g. '--stream-interval 4'")
    ap.add_argument("--variant-args", default="",
                    help="an interleaved A/B of target flags: each of --variant-modes gets a twin "
                         "target MODE+v with these flags too, run right after it in each repeat")  # fmt: skip
    ap.add_argument("--variant-modes", nargs="+", default=["plain"], choices=["plain", "fixed", "adaptive"],
                    help="the modes that get a --variant-args twin")  # fmt: skip
    ap.add_argument("--target-log-level", default="INFO",
                    help="DEBUG: phase times, policy costs and gates every 64 steps")  # fmt: skip
    ap.add_argument("--step-traces", action="store_true",
                    help="each target writes a JSON line per step to LOGS/target-MODE-DTYPE-steps.jsonl "
                         "(bench/step_trace_summary.py reads them)")  # fmt: skip
    ap.add_argument("--draft-markov-rank", type=int, default=0, help="draft Markov head rank")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens generated per request")
    ap.add_argument("--prompt-len", type=int, default=64, help="random prompt tokens per request")
    ap.add_argument(
        "--models",
        type=Path,
        default=None,
        help="where the random checkpoints go (reused when present; default: a temp dir)",
    )
    ap.add_argument("--logs", type=Path, default=None, help="the services' logs (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=None, help="the raw JSON: every row, argv, the GPU's name")
    args = ap.parse_args()

    root = args.models or Path(tempfile.gettempdir()) / "specsplit-bench-models"
    t0 = time.perf_counter()
    target_dir, draft_dir = make_models(root, args.preset, args.draft_markov_rank)
    print(f"models ready in {time.perf_counter() - t0:.0f}s at {root}", flush=True)
    vocab = PRESETS[args.preset]["vocab_size"]
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(max(args.batches))]
    logs = args.logs or Path(tempfile.mkdtemp(prefix="specsplit-bench-"))
    logs.mkdir(parents=True, exist_ok=True)
    rows = []
    # (dtype, prompt, spec ids, plain ids, {batch, mode, request}) of the divergences to probe
    mismatches: list[tuple[str, list[int], list[int], list[int], dict]] = []
    for dtype in args.dtypes:
        t0 = time.perf_counter()
        stack = start_stack(args, dtype, target_dir, draft_dir, logs)
        print(f"services ready in {time.perf_counter() - t0:.0f}s", flush=True)
        try:
            for batch in args.batches:  # warm-up: allocator, connections (graphs are captured at start)
                for mode, t in stack.targets.items():
                    k = 0 if base_mode(mode) == "plain" else args.k
                    run_batch(t, stack.draft_of(mode), prompts[:batch], 8, k)
            for batch in args.batches:
                runs: dict[str, list[dict]] = {m: [] for m in [*stack.targets, "k0_with_draft"]}
                if "fixed" not in stack.targets or args.no_k0:
                    runs.pop("k0_with_draft")
                for _ in range(args.repeats):  # interleaved: plain, k=0 with draft, fixed, adaptive, ...
                    for mode, t in stack.targets.items():
                        k = 0 if base_mode(mode) == "plain" else args.k
                        runs[mode].append(
                            run_batch(t, stack.draft_of(mode), prompts[:batch], args.new_tokens, k)
                        )
                        if "k0_with_draft" in runs and mode == "fixed":
                            runs["k0_with_draft"].append(
                                run_batch(t, stack.draft, prompts[:batch], args.new_tokens, 0)
                            )
                row = summarise(dtype, batch, args.k, runs)
                for mode, rs in runs.items():
                    # Each target against the plain target with the same flags: a +v twin against plain+v.
                    plain = "plain+v" if mode.endswith("+v") and "plain+v" in runs else "plain"
                    if plain not in runs:
                        continue
                    reference = runs[plain][0]["ids"]
                    probed: set = set()  # (row, spec output): a divergence repeated by the repeats
                    for r in rs:
                        same = sum(a == b for a, b in zip(r["ids"], reference))
                        row[mode].setdefault("identical_sequences", []).append(f"{same}/{batch}")
                        for i, (a, b) in enumerate(zip(r["ids"], reference)):
                            # The first --probe-divergences distinct ones of each (batch, mode): the
                            # B=64 ones were never probed while the first 8 of the run all came from B=1.
                            key = (i, tuple(a))
                            if a != b and len(probed) < args.probe_divergences and key not in probed:
                                probed.add(key)
                                mismatches.append((dtype, prompts[i], a, b, dict(batch=batch, mode=mode,
                                                                                request=i)))  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            for t in stack.targets.values():
                t.stop()
            stack.draft.stop()
    print(f"\n{args.preset}, device {args.device}, k={args.k}, {args.new_tokens} new tokens, "
          f"prompt {args.prompt_len}, {args.repeats} interleaved repeats (median [min-max])")  # fmt: skip
    print(markdown_table(rows))
    for r in rows:
        if "plain" in r:
            p = r["plain"]
            print(f"plain, {r['dtype']} B={r['batch']}: GPU gap {p.get('step_gpu_gap_ms', 0):.2f} ms "
                  f"per step, host {p['step_host_ms']:.2f} ms")  # fmt: skip
        for line in local_lines(r):
            print(line)
        for mode in (m for m in r if m.startswith("plain@tp")):
            t, base = r[mode]["tpot_ms"], r["plain"]["tpot_ms"]
            each = ", ".join(f"{a / b:.2f}" for a, b in zip(t["runs"], base["runs"]))
            tps = r[mode]["tokens_per_s"]
            print(f"{mode}, {r['dtype']} B={r['batch']}: TPOT {t['median']:.2f} "
                  f"[{t['min']:.2f}-{t['max']:.2f}] ms against TP={args.target_tp_size}'s "
                  f"{base['median']:.2f}, ratio each repeat {each}; "
                  f"{tps['median']:.0f} [{tps['min']:.0f}-{tps['max']:.0f}] tok/s")  # fmt: skip
        for mode in (m for m in r if m.endswith("+v")):
            t, base = r[mode]["tokens_per_s"], r[base_mode(mode)]["tokens_per_s"]["runs"]
            each = ", ".join(f"{a / b:.2f}" for a, b in zip(t["runs"], base))
            print(f"{mode} ({args.variant_args}), {r['dtype']} B={r['batch']}: {t['median']:.0f} "
                  f"[{t['min']:.0f}-{t['max']:.0f}] tok/s, / {base_mode(mode)}: {each}")  # fmt: skip
    margins = divergence_margins(target_dir, args.device, mismatches) if mismatches else []
    for m in margins:
        print(f"divergence ({m['dtype']}, B={m['batch']} {m['mode']} request {m['request']}) at token "
              f"{m['position']}: spec {m['spec_token']} vs plain "
              f"{m['plain_token']}; target alone: top-2 {m['top2_ids']}, gap {m['top2_gap']:.4g} at logit "
              f"{m['top1_logit']:.4g}")  # fmt: skip
    if args.out:
        result = {"preset": args.preset, "device": args.device, "placement": args.placement,
                  "argv": sys.argv, "rows": rows, "divergences": margins}  # fmt: skip
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
