"""The draft round trip on the host: where the time between the target's ask and the draft's answer goes,
without a GPU. The real target serving loop (scheduler, streamer, event loop; `bench/host_path.py`)
around a runner whose verify is a sleep, asks a draft service through the real DraftLink, k = 4 for every
request at every step. The draft is `bench/instant_draft.py` (the real gRPC front and servicer, a round
that is a sleep of --draft-round-ms), or with --model-draft a tiny random model on the CPU.

    python bench/link_rtt.py --batch 1 16 --steps 200 --step-ms 2 [--repeats 3]

Reported per run: the round trip the target measures (ask sent to answer received), the draft's own
handling of a message (`specsplit_draft_handle_seconds`: arrival to answer handed to gRPC) and their
difference, the transport: serialisation, the loopback socket and the Python threads each message
passes through in the two processes. On the H200 pair (docs/benchmarks.md) the transport was 1.4 ms
at B=1 and 1.8 ms at B=16.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prometheus_client import CollectorRegistry

from bench.bench_e2e import make_models
from bench.host_path import SimulatedRunner, load_tokenizer, run
from common.metrics import ServiceMetrics
from specsplit.launch import metric_sum, start_service
from target_service.draft_link import DraftLink

HANDLE = "specsplit_draft_handle_seconds"


def one_run(draft, batch: int, steps: int, step_seconds: float, tokenizer, yield_after_send: bool) -> dict:
    metrics = ServiceMetrics("target", "link-rtt", registry=CollectorRegistry())
    link = DraftLink(draft.address, metrics, target_vocab_size=512)
    link.yield_after_send = yield_after_send
    link.start()
    if not link.wait_connected(60):
        raise SystemExit(f"draft at {draft.address} not reachable")
    before = draft.scrape()
    try:
        # alpha 0: every draft token rejected, so each step commits one token and the draft catches up
        # one token per round (the steady round of a long generation, and the same work every step).
        result = run(batch, steps, tokenizer, 4, SimulatedRunner(0.0, step_seconds), link, policy="fixed")
    finally:
        link.close()
    after = draft.scrape()
    n = metric_sum(after, HANDLE + "_count") - metric_sum(before, HANDLE + "_count")
    handle = metric_sum(after, HANDLE + "_sum") - metric_sum(before, HANDLE + "_sum")
    handle_ms = 1e3 * handle / max(1.0, n)
    rt = result["round_trip_ms"]
    return {"batch": batch, "round_trip_ms": rt, "draft_handle_ms": handle_ms,
            "transport_ms": rt - handle_ms, "ms_per_step": result["ms_per_step"], "messages": n}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--step-ms", type=float, default=2.0, help="the simulated verify (a sleep)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--draft-args", default="", help="extra draft flags")
    ap.add_argument("--model-draft", action="store_true",
                    help="a tiny random draft model on the CPU, not bench/instant_draft.py")  # fmt: skip
    ap.add_argument("--draft-round-ms", type=float, default=1.0, help="the instant draft's round (a sleep)")
    ap.add_argument("--compare-yield", action="store_true",
                    help="interleave runs with and without the link's GIL yield after each send")  # fmt: skip
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    log = Path(tempfile.mkdtemp(prefix="link-rtt-")) / "draft.log"
    if args.model_draft:
        _, draft_dir = make_models(Path(tempfile.gettempdir()) / "specsplit-bench-models", "tiny")
        flags = ["--model", str(draft_dir), "--device", "cpu", "--dtype", "float32", "--max-batch-size", "64"]
        draft = start_service("draft_service", [*flags, *args.draft_args.split()], log)
    else:
        env = {"INSTANT_DRAFT_ROUND_MS": str(args.draft_round_ms)}
        flags = ["--model", "none", "--max-batch-size", "64", *args.draft_args.split()]
        draft = start_service("bench.instant_draft", flags, log, env=env)
    draft.wait_ready(300)
    tokenizer = load_tokenizer()
    variants = {"yield": True, "no-yield": False} if args.compare_yield else {"default": True}
    runs: dict[tuple[str, int], list[dict]] = {(v, b): [] for v in variants for b in args.batch}
    try:
        for _ in range(args.repeats):
            for b in args.batch:
                for v, flag in variants.items():  # interleaved
                    r = one_run(draft, b, args.steps, args.step_ms / 1e3, tokenizer, flag)
                    runs[v, b].append(r)
                    print(json.dumps({"variant": v, **r}), flush=True)
                    time.sleep(0.2)
    finally:
        draft.stop()
    summary = []
    for (v, b), rs in runs.items():
        keys = ("round_trip_ms", "draft_handle_ms", "transport_ms", "ms_per_step")
        row = {"variant": v, "batch": b, **{key: statistics.median(r[key] for r in rs) for key in keys}}
        row["transport_runs"] = [round(r["transport_ms"], 3) for r in rs]
        summary.append(row)
        print(f"{v} B={b}: round trip {row['round_trip_ms']:.2f} ms = draft {row['draft_handle_ms']:.2f} + "
              f"transport {row['transport_ms']:.2f} (runs {row['transport_runs']}), "
              f"{row['ms_per_step']:.2f} ms/step")  # fmt: skip
    if args.out:
        raw = {f"{v}/B{b}": rs for (v, b), rs in runs.items()}
        args.out.write_text(json.dumps({"argv": sys.argv, "rows": summary, "runs": raw}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
