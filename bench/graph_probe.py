"""Why one batch's graphed forward runs at a different speed depending on what the process did before.

The twenty-fourth session measured B=4's width-5 forward at 1.556 ms in processes that never ran B=1 and
1.670 ms in processes that captured B=1 first (bench/profile_step.py, docs/benchmarks.md). This probe
captures a list of batches in a given order, optionally runs some batches eagerly first or gives each
graph its own memory pool, times one batch's graph (GPU ms per replay over 200 back-to-back replays, 3
repeats) and, with --kernels, lists that graph's kernels with their mean GPU time per replay:

    python bench/graph_probe.py --capture 1 4 --time 4 --kernels --out a.json
    python bench/graph_probe.py --capture 4 --time 4 --kernels --out b.json
    python bench/graph_probe.py --capture 4 1 --time 4           # B=1 captured after B=4
    python bench/graph_probe.py --eager 1 --capture 4 --time 4   # B=1 only eager, never captured
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.profile_step import Bench, one_kernel_graph
from common.distributed import init_tp


def graph_of(bench: Bench, batch: int, width: int):
    p = bench._batch(batch, width)
    bench.step(p.input_ids, p.positions, p.slots, p.ctx_len)  # captures on first use
    return bench.step.graphs[(batch, width, bench.step._bucket(bench.step.ctx_buckets, p.ctx_len))][0]


ENV_KNOBS = ("SPECSPLIT_PDL", "CUDA_MODULE_LOADING", "CUDA_DEVICE_MAX_CONNECTIONS")


def gaps(prof, replays: int) -> dict:
    """From the profile's kernel timeline: span per replay, summed kernel time per replay, and the mean
    gap (next start - previous end; negative: overlap) between each pair of consecutive kernels."""
    path = "/tmp/graph_probe_trace.json"
    prof.export_chrome_trace(path)
    events = [e for e in json.loads(Path(path).read_text())["traceEvents"] if e.get("cat") == "kernel"]
    events.sort(key=lambda e: e["ts"])
    pairs: dict[str, list[float]] = {}
    for prev, nxt in itertools.pairwise(events):
        key = f"{prev['name'][:40]} -> {nxt['name'][:40]}"
        pairs.setdefault(key, []).append(nxt["ts"] - prev["ts"] - prev["dur"])
    span = (events[-1]["ts"] + events[-1]["dur"] - events[0]["ts"]) / replays
    rows = [{"pair": k, "count_per_replay": len(v) / replays, "mean_gap_us": round(sum(v) / len(v), 3),
             "gap_us_per_replay": round(sum(v) / replays, 2)} for k, v in pairs.items()]  # fmt: skip
    rows.sort(key=lambda r: -abs(r["gap_us_per_replay"]))
    busy = sum(e["dur"] for e in events) / replays
    return {"span_us_per_replay": round(span, 1), "kernel_us_per_replay": round(busy, 1), "pairs": rows[:25]}


def kernels(graph, replays: int = 20, with_gaps: bool = False) -> list[dict] | dict:
    """Per-kernel GPU time inside graph replays (CUPTI records a graph's kernels one by one)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    if with_gaps:
        return gaps(prof, replays)
    rows = []
    for evt in prof.key_averages():
        if evt.device_type == torch.autograd.DeviceType.CUDA and evt.device_time_total > 0:
            rows.append({"kernel": evt.key[:120], "per_replay": evt.count / replays,
                         "us_per_replay": round(evt.device_time_total / replays, 2)})  # fmt: skip
    return sorted(rows, key=lambda r: -r["us_per_replay"])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--capture", type=int, nargs="+", required=True, help="batches captured, in this order")
    ap.add_argument("--eager", type=int, nargs="*", default=[], help="batches run eagerly before any capture")
    ap.add_argument("--time", type=int, required=True, help="the batch whose graph is timed")
    ap.add_argument("--width", type=int, default=5)
    ap.add_argument("--pool-per-graph", action="store_true", help="a fresh memory pool for every capture")
    ap.add_argument("--drop", action="store_true", help="free every other graph before timing")
    ap.add_argument("--trivial", type=int, default=0, help="one-kernel graphs captured after")
    ap.add_argument("--trivial-first", action="store_true", help="a one-kernel graph captured first")
    ap.add_argument("--no-empty-cache", action="store_true", help="empty_cache made a no-op")
    ap.add_argument("--empty-after", choices=["device", "host"], help="empty this cache after the captures")
    ap.add_argument("--trivial-kept", action="store_true", help="a one-kernel capture never instantiated")
    ap.add_argument("--replay-stream", action="store_true", help="replay on a side stream")
    ap.add_argument("--kernels", action="store_true")
    ap.add_argument("--gaps", action="store_true", help="the timeline's gaps between consecutive kernels")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.no_empty_cache:
        torch.cuda.empty_cache = lambda: None
        torch._C._host_emptyCache = lambda: None
    comm = init_tp(1, 0, device=torch.device("cuda", 0))
    batches = sorted(set(args.capture) | {args.time})
    spec = SimpleNamespace(model=None, preset="qwen1.5b", fp32_logits=False, context=100, batch=batches)
    spec.alone = True
    bench = Bench(comm, spec)
    for b in args.eager:
        bench.eager(b, args.width)
    torch.cuda.synchronize()
    keep = [one_kernel_graph(torch.device("cuda", 0))] if args.trivial_first else []
    for b in args.capture:
        if args.pool_per_graph:
            bench.step.pool = torch.cuda.graph_pool_handle()
        graph_of(bench, b, args.width)
    graph = graph_of(bench, args.time, args.width)
    if args.drop:
        for key in [k for k, v in bench.step.graphs.items() if v[0] is not graph]:
            del bench.step.graphs[key]
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    keep += [one_kernel_graph(torch.device("cuda", 0)) for _ in range(args.trivial)]
    if args.trivial_kept:  # captured (cudaStreamBeginCapture ... EndCapture) but no cudaGraphInstantiate
        x = torch.zeros(16, device="cuda")
        kept = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(kept):
            x.add_(1)
        keep.append((kept, x))
    if args.empty_after == "device":
        torch.cuda.empty_cache()
    elif args.empty_after == "host":
        torch._C._host_emptyCache()
    side = torch.cuda.Stream() if args.replay_stream else torch.cuda.current_stream()
    with torch.cuda.stream(side):
        for _ in range(3):
            bench.replay(args.time, args.width, 20)  # warm
        ms = [bench.replay(args.time, args.width, 200) for _ in range(3)]
    result = {"capture": args.capture, "eager": args.eager, "time": args.time, "width": args.width,
              "pool_per_graph": args.pool_per_graph, "drop": args.drop, "trivial": args.trivial,
              "trivial_first": args.trivial_first, "no_empty_cache": args.no_empty_cache,
              "empty_after": args.empty_after, "replay_stream": args.replay_stream,
              "trivial_kept": args.trivial_kept,
              "env": {k: os.environ[k] for k in ENV_KNOBS if k in os.environ},
              "graph_ms": [round(x, 4) for x in ms],
              "graph_ms_median": round(statistics.median(ms), 4)}  # fmt: skip
    print(json.dumps(result), flush=True)
    if args.kernels:
        result["kernels"] = kernels(graph)
    if args.gaps:
        result["gaps"] = kernels(graph, with_gaps=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
