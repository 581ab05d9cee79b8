"""Summarises py-spy `--threads -f raw` profiles: samples per thread and the top leaf frames of each,
then, for the scheduler thread (an `--idle` profile shows its waits too), the share of its samples under
each function (inclusive): how a step splits into waits for the GPU or the draft and host work.

python bench/pyspy_summary.py /tmp/pyspy-gil-*.txt
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path


def main(paths: list[str]) -> None:
    for path in paths:
        per_thread: collections.Counter[str] = collections.Counter()
        leaves: collections.Counter[tuple[str, str]] = collections.Counter()
        inclusive: collections.Counter[str] = collections.Counter()  # scheduler thread, per function
        for line in open(path):
            stack, _, count = line.rstrip().rpartition(" ")
            frames = stack.split(";")
            thread = frames[0].split(": ", 1)[-1]
            per_thread[thread] += int(count)
            leaves[(thread, frames[-1])] += int(count)
            if "scheduler" in thread:
                for frame in set(frames[1:]):
                    inclusive[frame] += int(count)
        total = sum(per_thread.values()) or 1
        pid = Path(path).stem.rsplit("-", 1)[-1]
        cmd = Path(path).with_name(f"pyspy-cmd-{pid}.txt")
        what = cmd.read_text().strip() if cmd.exists() else ""
        print(f"== {path} ({what}): {total} samples")
        for thread, n in per_thread.most_common(8):
            print(f"  {thread:40s} {n / total:6.1%}")
        for (thread, leaf), n in leaves.most_common(25):
            print(f"    {n / total:6.1%} {thread[:20]:20s} {leaf[:110]}")
        sched = sum(n for t, n in per_thread.items() if "scheduler" in t) or 1
        if inclusive:
            print(f"  scheduler thread, inclusive ({sched} samples):")
        for frame, n in inclusive.most_common(45):
            print(f"    {n / sched:6.1%} {frame[:120]}")


if __name__ == "__main__":
    main(sys.argv[1:])
