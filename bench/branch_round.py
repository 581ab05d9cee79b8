"""The draft's branch round on the GPU: what a round of R branch rows costs against a fresh round, with
and without the second-choice pick (a masked copy and a second argmax; torch.topk(2) measured slower,
docs/bench/branch-round-h200.json), and the whole `DraftState.draft_branches` call (its Python and the
KV copies included) as the service runs it.

    python bench/branch_round.py --rows 5 20 40 80 --out branch_round.json

Per shape: wall ms per round (200 rounds after 10 warm-up), GPU kernel ms (torch.profiler, 20 rounds),
and the five costliest kernels at the largest shape.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_e2e import make_models
from common.distributed import init_tp
from common.kv_cache import SlotTable
from draft_service.config import DraftConfig
from draft_service.runner import DraftRunner
from draft_service.state import DraftState


def timed(fn, rounds: int = 200) -> tuple[float, float, list[tuple[str, float]]]:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(rounds):
        fn()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / rounds
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
    per: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and "Memcpy" not in e.name:
            per[e.name[:90]] = per.get(e.name[:90], 0.0) + e.device_time / 20 / 1e3  # us -> ms per round
    top = sorted(per.items(), key=lambda kv: -kv[1])[:5]
    return wall * 1e3, sum(per.values()), top


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[5, 20, 40, 80])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--models", default="/tmp/models")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    _, draft_dir = make_models(Path(args.models), "qwen1.5b")
    results = []
    for top2, method in ((True, "mask"), (False, "none")):
        config = DraftConfig(model=str(draft_dir), device="cuda", dtype="bfloat16", max_batch_size=16,
                             num_speculative_tokens=args.k, draft_branches=top2, log_format="json",
                             draft_branch_slots=max(args.rows), max_context_length=1024)  # fmt: skip
        runner = DraftRunner(init_tp(1, 0, device=torch.device("cuda")), config)
        off = runner.branch_slot_offset if top2 else 0
        for rows in [1, 16] + (args.rows if top2 else []):
            branch = rows not in (1, 16)
            slots = [off + i for i in range(rows)] if branch else list(range(rows))
            prefix = ([0] * rows, [100] * rows) if branch else (None, None)
            k = args.k + 1 if branch else args.k

            def one(runner=runner, rows=rows, slots=slots, prefix=prefix, k=k):
                return runner.rounds.run([[7]] * rows, [100] * rows, slots, k, *prefix)

            wall, kernel, top = timed(one)
            row = {"top2": method, "kind": "branch" if branch else "fresh", "rows": rows, "k": k,
                   "wall_ms": wall, "kernel_ms": kernel, "top_kernels": top}  # fmt: skip
            results.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "top_kernels"}), flush=True)
        if top2:  # the service's call: B requests' branches after a fresh proposal, verdicts, copies
            for b in (1, 4):
                state = DraftState(runner, SlotTable(config.max_batch_size))
                reqs = [state.start(i, list(range(1, 101)), args.k, 0.0, 0) for i in range(b)]
                props = state.propose(reqs)

                def call(state=state, reqs=reqs, props=props):
                    state.draft_branches(reqs, props)
                    for r in reqs:  # a verdict that picks the all-accepted branch, then its proposal
                        key = next(x.key for x in r.branches if len(x.key) == args.k + 1)
                        state.apply_verdict(r, len(r.committed), key)
                    fresh = state.propose(reqs)
                    props.clear()
                    props.update(fresh)

                wall, kernel, top = timed(call, 100)
                row = {"top2": method, "kind": "draft_branches+verdict", "requests": b, "wall_ms": wall,
                       "kernel_ms": kernel, "top_kernels": top}  # fmt: skip
                results.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "top_kernels"}), flush=True)
        for row in results[-3:]:
            print(row["kind"], row.get("rows", row.get("requests")), row["top_kernels"], flush=True)
        runner = None
        torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps({"argv": sys.argv, "rows": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
