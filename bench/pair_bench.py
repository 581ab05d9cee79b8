"""A target with its drafts under `specsplit bench-serve`, every config against a plain target, in one run.

    python bench/pair_bench.py --target MODEL --draft FEATURE_DRAFT [--classic SMALL_LM] --prompts coding \\
        --device cuda --dtype bfloat16 --work /tmp/pair --out pair.json

All targets start at once on one device (`--configs`, each its own process):
  plain     the target with no draft (the baseline);
  adaptive  the feature draft inside the target (--draft-local), adaptive policy;
  fixed     the same, fixed k (--k);
  never     adaptive with a draft that is never right: the feature draft with a zero final norm (every
            logit 0: it drafts one token always);
  classic   a plain small LM as the draft inside the target (--classic), adaptive;
  remote    the feature draft as its own service (python -m draft_service) on the same device, the target
            with --draft-address, adaptive; only at --remote-batches;
  remote-fixed  the same with the fixed policy (k = --k every step);
  plain-grouped, adaptive-grouped, fixed-grouped  plain, adaptive and fixed with requests joining the
            batch in groups (--admit-wait-steps 8), not at once;
  plain-invariant, adaptive-invariant, fixed-invariant  plain, adaptive and fixed with
            --batch-invariant (every GEMM in one fixed-tile kernel: greedy output equals plain decoding at
            any batch); their x plain is over plain-invariant where it ran, else over plain.
Then --repeats interleaved rounds: per round, per batch (streams), every config in turn runs bench-serve
over the held-out prompts (--prompts: chat or coding, common/training/prompts.py, never trained on) with
--check-greedy. Each run's JSON and its metric deltas go to --out as they finish; past --deadline-s no
new run starts and the summary covers what ran. Every target writes its step trace to
--work/CONFIG-steps.jsonl (target_service/step_trace.py; bench/step_trace_summary.py splits it up).

The summary: per config and batch, x plain (output tok/s over the plain target's in the same round:
median and range over rounds), accepted / drafted and tokens per request per step (bench-serve's
counts, the timed run only), greedy mismatches and failed requests (and of the mismatches probed, how
many diverged at a near-tie of the target's top two: bench-serve's `divergence`), and c = one draft
position / one plain step: the draft's mean round time (specsplit_draft_step_seconds; rounds chained to
the verify are timed on the GPU) over its tokens per round (draft_tokens / drafts) over the plain
target's mean step at that batch in the same round (specsplit_verify_step_seconds). A config whose draft
ran no round has no c.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.draft_checkpoint import SHARED_WEIGHTS_KEY  # noqa: E402
from common.training.prompts import PROMPT_SETS  # noqa: E402
from specsplit.catalog import CATALOG, cached_path, is_fetched  # noqa: E402
from specsplit.launch import ServiceProcess, _samples, free_port, metric_sum, start_service  # noqa: E402

CONFIGS = (
    "plain",
    "adaptive",
    "fixed",
    "never",
    "classic",
    "remote",
    "remote-fixed",
    "plain-grouped",
    "adaptive-grouped",
    "fixed-grouped",
    "plain-invariant",
    "adaptive-invariant",
    "fixed-invariant",
)
# A config name's suffix adds flags to the config before it.
SUFFIX_FLAGS = {"-grouped": ["--admit-wait-steps", "8"], "-invariant": ["--batch-invariant"]}


def base_config(name: str) -> tuple[str, list[str]]:
    """(the config `name` modifies, the flags its suffix adds)."""
    for suffix, flags in SUFFIX_FLAGS.items():
        if name.endswith(suffix):
            return name.removesuffix(suffix), list(flags)
    return name, []


REMOTE = ("remote", "remote-fixed")
PROMPT_KINDS = {"chat": "general", "coding": "coding"}
TARGET_SERIES = {
    "verify_sum": "specsplit_verify_step_seconds_sum",
    "verify_n": "specsplit_verify_step_seconds_count",
    # a draft service's: the target's wait for its answer, and the draft's own part of it (handle)
    "round_trip_sum": "specsplit_draft_round_trip_seconds_sum",
    "round_trip_n": "specsplit_draft_round_trip_seconds_count",
}
DRAFT_SERIES = {
    "round_sum": "specsplit_draft_step_seconds_sum",
    "round_n": "specsplit_draft_step_seconds_count",
    "drafts": "specsplit_spec_drafts_total",
    "draft_tokens": "specsplit_spec_draft_tokens_total",
    "handle_sum": "specsplit_draft_handle_seconds_sum",
    "handle_n": "specsplit_draft_handle_seconds_count",
}


def model_path(name: str) -> str:
    """A path as it is; a catalogue name: its file in the model cache (no download here)."""
    if Path(name).exists() or name not in CATALOG:
        if not Path(name).exists():
            raise SystemExit(f"{name}: no such file or catalogue name")
        return name
    if not is_fetched(CATALOG[name]):
        raise SystemExit(
            f"{name}: not in the model cache ({cached_path(CATALOG[name])}); transfer or fetch it"
        )
    return str(cached_path(CATALOG[name]))


def write_prompts(target: str, kind: str, path: Path) -> int:
    """The held-out prompts of `kind` as bench-serve's JSONL of prompt ids (the target's chat template)."""
    from common.loader import load_tokenizer

    tok = load_tokenizer(target)
    texts = PROMPT_SETS[PROMPT_KINDS[kind]].held_out()
    with open(path, "w") as f:
        for text in texts:
            if getattr(tok, "chat_template", None):
                ids = tok.apply_chat_template([{"role": "user", "content": text}])
            else:
                ids = tok.encode(text)
            f.write(json.dumps({"prompt_ids": list(ids)}) + "\n")
    return len(texts)


def never_right(draft: Path, out: Path) -> Path:
    """A copy of `draft` with a zero final norm (every logit 0: it always drafts the same token); a
    relative path to the target's shared tensors is made absolute so the copy finds them."""
    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((draft / "config.json").read_text())
    shared = config.get(SHARED_WEIGHTS_KEY)
    if shared and not Path(shared["path"]).is_absolute() and (draft / shared["path"]).exists():
        shared["path"] = str((draft / shared["path"]).resolve())
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = load_file(str(draft / "model.safetensors"))
    tensors["model.norm.weight"] = torch.zeros_like(tensors["model.norm.weight"])
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def scrape(port: int) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return _samples(list(text_string_to_metric_families(r.read().decode())))


class Config:
    """One target (and the draft service of a remote config) under test; metrics_port of its draft, if any."""

    def __init__(self, name: str, target: ServiceProcess, draft_port: int | None, draft=None):
        self.name, self.target, self.draft_port, self.draft = name, target, draft_port, draft

    def snapshot(self) -> dict[str, float]:
        snap = {k: metric_sum(self.target.scrape(), v) for k, v in TARGET_SERIES.items()}
        if self.draft_port is not None:
            samples = scrape(self.draft_port)
            snap |= {k: metric_sum(samples, v) for k, v in DRAFT_SERIES.items()}
        return snap

    def stop(self) -> None:
        for proc in (self.target, self.draft):
            if proc is not None:
                proc.stop()


def start_configs(args, draft: Path | None, never: Path | None, logs: Path) -> dict[str, Config]:
    common = ["--model", args.target, "--device", args.device, "--dtype", args.dtype,
              "--max-batch-size", str(max(args.batches)), "--max-context-length", str(args.max_context),
              "--num-speculative-tokens", str(args.k)]  # fmt: skip
    started: dict[str, tuple] = {}
    for name in args.configs:
        base, extra = base_config(name)
        draft_port = None
        draft_proc = None
        model = {"adaptive": draft, "fixed": draft, "never": never, "classic": args.classic}.get(base)
        if base in ("adaptive", "fixed", "never", "classic"):
            draft_port = free_port()
            extra += ["--draft-local", f"--model {model} --metrics-port {draft_port}",
                      "--speculation-policy", "fixed" if base == "fixed" else "adaptive"]  # fmt: skip
        elif name in REMOTE:
            draft_proc = start_service(
                "draft_service",
                ["--model", str(draft), "--device", args.device, "--dtype", args.dtype,
                 "--max-batch-size", str(max(args.batches))],
                logs / f"{name}-draft.log",
            )  # fmt: skip
            layers = json.loads((draft / "config.json").read_text())["feature_layers"]
            policy = "fixed" if name == "remote-fixed" else "adaptive"
            extra += ["--draft-address", f"127.0.0.1:{draft_proc.port}", "--speculation-policy", policy,
                     "--draft-feature-layers", ",".join(map(str, layers))]  # fmt: skip
        trace = ["--step-trace", str(logs / f"{name}-steps.jsonl")]
        started[name] = (
            start_service("target_service", common + extra + trace, logs / f"{name}.log"),
            draft_port,
            draft_proc,
        )
    configs = {}
    for name, (target, draft_port, draft_proc) in started.items():
        if draft_proc is not None:
            draft_proc.wait_ready(args.ready_timeout)
            draft_port = draft_proc.metrics_port
        configs[name] = Config(name, target.wait_ready(args.ready_timeout), draft_port, draft_proc)
    return configs


def bench_serve(
    args, cfg: Config, prompts: Path, batch: int, num: int, out_len: int, result: Path | None
) -> dict:
    cmd = [sys.executable, "-m", "specsplit.cli", "bench-serve", "--target", cfg.target.address,
           "--dataset", str(prompts), "--num-prompts", str(num), "--max-concurrency", str(batch),
           "--output-len", str(out_len), "--no-ignore-eos", "--check-greedy", "--no-progress"]  # fmt: skip
    if result is not None:
        cmd += ["--result-json", str(result)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if result is None:
        return {}
    if not result.exists():
        return {"error": f"bench-serve exited {done.returncode}: {done.stderr[-2000:]}"}
    return json.loads(result.read_text())


def num_prompts(args, batch: int) -> int:
    return args.prompts_at_1 if batch == 1 else args.waves * batch


def run(args) -> dict:
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    (work / "json").mkdir(parents=True)
    args.target = model_path(args.target)
    if args.classic:
        args.classic = model_path(args.classic)
    draft = Path(args.draft) if args.draft else None
    drafted = ("adaptive", "fixed", "never", *REMOTE)
    needs_draft = {n for n in args.configs if base_config(n)[0] in drafted}
    if needs_draft and (draft is None or not (draft / "config.json").exists()):
        raise SystemExit(
            f"--draft: {args.draft!r} is no draft directory (configs {sorted(needs_draft)} need one)"
        )
    if "classic" in args.configs and not args.classic:
        raise SystemExit("--classic: the classic draft's model is needed for the classic config")
    if "plain" not in args.configs:
        raise SystemExit("--configs: plain is the baseline every x-plain figure needs")
    prompts = work / "prompts.jsonl"
    count = write_prompts(args.target, args.prompts, prompts)
    never = never_right(draft, work / "never") if "never" in args.configs else None
    t0 = time.monotonic()
    configs = start_configs(args, draft, never, work)
    report = {"args": vars(args), "prompts": count, "startup_s": round(time.monotonic() - t0, 1), "runs": {},
              # every process on the GPU through NVIDIA's Multi-Process Service (bench/device.sh MPS=1)
              "mps": bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY"))}  # fmt: skip
    print(f"{len(configs)} targets ready in {report['startup_s']} s", flush=True)
    try:
        for cfg in configs.values():  # warm-up: graphs, the adaptive policy's first step costs; not recorded
            bench_serve(args, cfg, prompts, min(4, max(args.batches)), 4, 32, None)
        for rep in range(1, args.repeats + 1):
            for batch in args.batches:
                for name, cfg in configs.items():
                    if name in REMOTE and batch not in args.remote_batches:
                        continue
                    if time.monotonic() - t0 > args.deadline_s:
                        report["stopped"] = f"deadline {args.deadline_s} s before {name} b{batch} r{rep}"
                        return report
                    before = cfg.snapshot()
                    out_len = args.output_len
                    result = bench_serve(args, cfg, prompts, batch, num_prompts(args, batch), out_len,
                                         work / "json" / f"{name}-b{batch}-r{rep}.json")  # fmt: skip
                    after = cfg.snapshot()
                    result["metrics_delta"] = {k: after[k] - before.get(k, 0.0) for k in after}
                    report["runs"][f"{name}-b{batch}-r{rep}"] = result
                    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
                    print(
                        f"{name} b{batch} r{rep}: {result.get('output_throughput', 0):.0f} tok/s", flush=True
                    )
    finally:
        for cfg in configs.values():
            cfg.stop()
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return report


def ratio(d: dict, a: str, b: str) -> float | None:
    return d[a] / d[b] if d.get(b) else None


def c_of(run: dict, plain: dict) -> float | None:
    """One draft position over one plain step (module docstring), or None where not timed."""
    d, p = run.get("metrics_delta", {}), plain.get("metrics_delta", {})
    round_s, per_round, step_s = ratio(d, "round_sum", "round_n"), ratio(d, "draft_tokens", "drafts"), None
    step_s = ratio(p, "verify_sum", "verify_n")
    if not (round_s and per_round and step_s):
        return None
    return round_s / per_round / step_s


def summarize(report: dict) -> list[dict]:
    runs = report["runs"]
    rows = []
    keys = sorted(
        {k.rsplit("-", 1)[0] for k in runs},
        key=lambda k: (int(k.split("-b")[1]), CONFIGS.index(k.split("-b")[0])),
    )
    for key in keys:
        name, batch = key.split("-b")
        reps = sorted(int(k.rsplit("-r", 1)[1]) for k in runs if k.rsplit("-", 1)[0] == key)
        x, cs, tput = [], [], []
        drafted = accepted = mismatches = probed = ties = 0
        per_step = []
        for r in reps:
            baseline = "plain-invariant" if name.endswith("-invariant") else "plain"
            plain = runs.get(f"{baseline}-b{batch}-r{r}") or runs.get(f"plain-b{batch}-r{r}", {})
            run = runs[f"{key}-r{r}"]
            tput.append(run.get("output_throughput", 0.0))
            if plain.get("output_throughput"):
                x.append(run.get("output_throughput", 0.0) / plain["output_throughput"])
            if (c := c_of(run, plain)) is not None:
                cs.append(c)
            drafted += run.get("drafted_tokens", 0)
            accepted += run.get("accepted_tokens", 0)
            mismatches += run.get("greedy_check", {}).get("mismatches", 0) + run.get("failed", 0)
            mismatches += 1 if "error" in run else 0
            probes = run.get("greedy_check", {}).get("divergences", [])
            probed, ties = probed + len(probes), ties + sum(bool(d.get("near_tie")) for d in probes)
            if run.get("tokens_per_step"):
                per_step.append(run["tokens_per_step"])
        rows.append({
            "config": name, "batch": int(batch), "repeats": len(reps),
            "tok_s_median": statistics.median(tput) if tput else None,
            "x_plain_median": statistics.median(x) if x else None,
            "x_plain_range": [min(x), max(x)] if x else None,
            "accepted_over_drafted": accepted / drafted if drafted else None,
            "drafted": drafted, "accepted": accepted,
            "tokens_per_step": statistics.median(per_step) if per_step else None,
            "c_median": statistics.median(cs) if cs else None,
            "greedy_mismatches_or_failures": mismatches,
            "divergences_probed": probed, "near_ties": ties,
        })  # fmt: skip
    return rows


def table(rows: list[dict]) -> str:
    def f(v, fmt="{:.3f}"):
        return "-" if v is None else fmt.format(v)

    lines = ["| config | B | tok/s | x plain (median) | range | acc/drafted | tok/step | c | mismatches "
             "| near-ties / probed |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        rng = (
            "-" if r["x_plain_range"] is None else f"{r['x_plain_range'][0]:.3f}-{r['x_plain_range'][1]:.3f}"
        )
        lines.append(
            f"| {r['config']} | {r['batch']} | {f(r['tok_s_median'], '{:.0f}')} | {f(r['x_plain_median'])} "
            f"| {rng} "
            f"| {f(r['accepted_over_drafted'])} | {f(r['tokens_per_step'], '{:.2f}')} | {f(r['c_median'])} "
            f"| {r['greedy_mismatches_or_failures']} "
            f"| {r.get('near_ties', 0)} / {r.get('divergences_probed', 0)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="target model: path or catalogue name")
    ap.add_argument("--draft", help="feature draft directory")
    ap.add_argument("--classic", help="classic draft model (a plain small LM): path or catalogue name")
    ap.add_argument("--prompts", choices=sorted(PROMPT_KINDS), default="chat", help="held-out prompt set")
    ap.add_argument("--configs", nargs="+", choices=CONFIGS, default=["plain", "adaptive", "fixed", "never"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64], help="concurrent streams")
    ap.add_argument("--remote-batches", nargs="+", type=int, default=[1], help="remote configs' batches")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--k", type=int, default=4, help="draft tokens per step (fixed; the adaptive policy's most)"
    )
    ap.add_argument("--output-len", type=int, default=192, help="max new tokens per request")
    ap.add_argument("--prompts-at-1", type=int, default=12, help="requests of a one-stream run")
    # Requests per stream: a run's last requests finish while other streams have none left (speculative
    # requests end at spread steps as their acceptance differs), a smaller part of the run the more it has.
    ap.add_argument("--waves", type=int, default=8, help="requests per stream of a multi-stream run")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-context", type=int, default=1024, help="each target's --max-context-length")
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    ap.add_argument("--deadline-s", type=float, default=1e9, help="start no run after this many seconds")
    ap.add_argument(
        "--work", default="/tmp/pair-bench", help="prompts, the never-right draft, logs, run JSON"
    )
    ap.add_argument("--out", required=True, help="the report (every run's JSON and metric deltas)")
    ap.add_argument("--summary", help="also write the summary table here")
    args = ap.parse_args(argv)
    report = run(args)
    rows = summarize(report)
    report["summary"] = rows
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    text = table(rows) + (f"\n\nstopped: {report['stopped']}" if "stopped" in report else "")
    text += f"\nstartup {report['startup_s']} s; {len(report['runs'])} runs"
    text += f"; {report['prompts']} held-out {args.prompts} prompts"
    print(text)
    if args.summary:
        Path(args.summary).write_text(text + "\n")
    bad = sum(r["greedy_mismatches_or_failures"] for r in rows)
    return 1 if bad else (3 if "stopped" in report else 0)


if __name__ == "__main__":
    raise SystemExit(main())
