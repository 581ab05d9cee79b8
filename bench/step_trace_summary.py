"""Where a batch's wall time goes, from the targets' step traces (`bench_e2e.py --step-traces`).

    python bench/step_trace_summary.py LOGS/target-*-steps.jsonl [--batch 64]

A trace holds every run of its target (warm-ups, repeats, batch sizes); a run is a stretch of steps
with no gap over --idle-ms. Per run of --batch requests (the runs whose largest B is it), the steps are
split into fill (before B first reaches its maximum), full (B at its maximum) and tail (after it first
drops), and speculative (w > 1) or plain: steps, tokens, milliseconds (step walls plus the gaps before
them). Printed per trace as the median over its runs of that batch.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def runs_of(path: Path, idle_ms: float) -> list[list[dict]]:
    runs: list[list[dict]] = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if not runs or row["gap"] > idle_ms:
            runs.append([])
        runs[-1].append(row)
    return runs


def wall_ms(row: dict, first: bool) -> float:
    step = row["plan"] + row["propose"] + row["verify"] + row["commit"]
    return step + (0.0 if first else row["gap"])


def split(run: list[dict]) -> dict[str, dict[str, float]]:
    top = max(r["B"] for r in run)
    full_at = next(i for i, r in enumerate(run) if r["B"] == top)
    tail_at = next((i for i in range(full_at, len(run)) if run[i]["B"] < top), len(run))
    parts: dict[str, dict[str, float]] = {}
    for i, r in enumerate(run):
        phase = "fill" if i < full_at else "full" if i < tail_at else "tail"
        part = parts.setdefault(f"{phase} {'spec' if r['w'] > 1 else 'plain'}", dict(steps=0, tok=0, ms=0.0))
        part["steps"] += 1
        part["tok"] += r["tok"]
        part["ms"] += wall_ms(r, i == 0)
    total_ms = sum(p["ms"] for p in parts.values())
    parts["all"] = dict(steps=len(run), tok=sum(r["tok"] for r in run), ms=total_ms)
    return parts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+", type=Path, help="LOGS/target-*-steps.jsonl")
    ap.add_argument("--batch", type=int, default=64, help="the runs whose largest B is this")
    ap.add_argument("--idle-ms", type=float, default=50.0, help="a gap this long starts a new run")
    ap.add_argument("--min-tokens", type=int, default=1000, help="runs with fewer tokens are warm-ups")
    args = ap.parse_args()
    for path in args.traces:
        runs = [r for r in runs_of(path, args.idle_ms) if max(x["B"] for x in r) == args.batch]
        runs = [r for r in runs if sum(x["tok"] for x in r) >= args.min_tokens]
        if not runs:
            print(f"{path.name}: no run of B={args.batch}")
            continue
        splits = [split(r) for r in runs]
        print(f"{path.name}: {len(runs)} runs of B={args.batch} (median per run)")
        for key in sorted({k for s in splits for k in s}, key=lambda k: (k == "all", k)):
            vals = {
                f: statistics.median(s.get(key, {}).get(f, 0) for s in splits) for f in ("steps", "tok", "ms")
            }
            rate = vals["tok"] / vals["ms"] * 1e3 if vals["ms"] else 0.0
            print(
                f"  {key:<11} {vals['steps']:6.0f} steps {vals['tok']:8.0f} tok {vals['ms']:8.1f} ms",
                f"{rate:8.0f} tok/s",
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
