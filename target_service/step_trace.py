"""One JSON line per step (`--step-trace FILE`): where a serving loop's time goes, step by step.

Metrics and the DEBUG log average over steps; a run's shape needs each step: the batch filling at the
start, which steps speculated, gaps between steps, the tail of requests that finish late. The fields:
t (seconds since the trace opened, at the step's start), B (requests), w (verify width: 1 + the most
drafts of a request), tok (tokens emitted), k (the k asked for the next step), gate (the speculation
gate's mode at this batch: 1 on, 0 off, null none), new (the step started requests on the draft), and
milliseconds: gap (since the last step ended: admission, prefill, idle), plan, propose, verify, commit.
Lines are buffered and flushed when the batch empties and at stop, not per step.
"""

from __future__ import annotations

import json
import time


class StepTrace:
    def __init__(self, path: str):
        self.file = open(path, "a", buffering=1 << 16)  # closed in close()
        self.start = time.perf_counter()
        self.last_end = self.start

    def step(self, batch: int, width: int, emitted: int, k: int, gate: bool | None, new: bool, *marks):
        t0, t1, t2, t3, t4 = marks
        ms = [
            round((b - a) * 1e3, 3) for a, b in ((self.last_end, t0), (t0, t1), (t1, t2), (t2, t3), (t3, t4))
        ]
        self.last_end = t4
        row = dict(t=round(t0 - self.start, 6), B=batch, w=width, tok=emitted, k=k, new=new)
        row["gate"] = None if gate is None else int(gate)
        row.update(zip(("gap", "plan", "propose", "verify", "commit"), ms))
        self.file.write(json.dumps(row, separators=(",", ":")) + "\n")

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        self.file.close()
