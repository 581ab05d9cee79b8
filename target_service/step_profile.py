"""`--profile-dir DIR`: torch.profiler over a window of serving steps, for finding where a step's time goes.

The window opens at the FIRST-th step of the process and closes COUNT steps later (`--profile-steps
FIRST,COUNT`); the warm-up and the CUDA-graph captures stay outside it. It records the scheduler
thread's host ops and the device kernels of the whole process (an in-process draft's too: the device
side is recorded process-wide, host ops only on the thread that starts the profiler). It writes:
  DIR/trace.json    the timeline (chrome://tracing or Perfetto);
  DIR/kernels.txt   device time per kernel and per host op, summed over the window;
  DIR/summary.json  steps, window wall seconds, device-busy seconds (the union of kernel intervals):
                    busy / wall below 1 means the device waited on the host.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

log = logging.getLogger("specsplit.target")


def parse_window(text: str) -> tuple[int, int]:
    """'FIRST,COUNT' -> (first, count); a bad value raises naming --profile-steps."""
    try:
        first, count = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--profile-steps: {text!r} is not FIRST,COUNT (two integers)") from None
    if first < 0 or count < 1:
        raise ValueError(f"--profile-steps: {text!r} needs FIRST >= 0 and COUNT >= 1")
    return first, count


def busy_seconds(events) -> float:
    """The union of the device kernels' intervals, in seconds (overlapping kernels count once)."""
    cuda = torch.autograd.DeviceType.CUDA
    spans = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type == cuda)
    total, end = 0.0, float("-inf")
    for start, stop in spans:
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total / 1e6  # microseconds


class StepProfile:
    def __init__(self, out_dir: str, window: str):
        self.out = Path(out_dir)
        self.first, self.count = parse_window(window)
        self.steps = 0
        self.prof = None
        self.started = 0.0

    def step(self) -> None:
        """Called once per serving step, before it runs."""
        if self.steps == self.first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities)
            self.prof.__enter__()
            self.started = time.perf_counter()
        elif self.prof is not None and self.steps == self.first + self.count:
            self.finish()
        self.steps += 1

    def finish(self) -> None:
        if self.prof is None:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.started
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        self.out.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.out / "trace.json"))
        averages = prof.key_averages()
        with open(self.out / "kernels.txt", "w") as f:
            f.write(averages.table(sort_by="self_device_time_total", row_limit=60) + "\n")
            f.write(averages.table(sort_by="cpu_time_total", row_limit=60) + "\n")
        busy = busy_seconds(prof.events()) if torch.cuda.is_available() else 0.0
        summary = dict(steps=self.count, wall_s=round(wall, 6), device_busy_s=round(busy, 6))
        (self.out / "summary.json").write_text(json.dumps(summary) + "\n")
        log.info("profiled %d steps into %s: %s", self.count, self.out, summary)
