"""`python -m common.graceful_torchrun ARGS`: torchrun ARGS, where SIGTERM drains the ranks and exits 0.

torchrun's agent turns SIGTERM into an exception that it re-raises once its workers are stopped, so even a
clean drain ends non-zero (a failed pod, a restart). Here the signal goes to the ranks instead: rank 0
drains and tells the others to stop, every rank exits 0, and torchrun, whose workers all succeeded,
exits 0. A rank that fails still makes torchrun exit non-zero (ChildFailedError, naming the rank).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path


def children(pid: int) -> list[int]:
    """The direct children of `pid` (Linux /proc): torchrun's worker processes."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:  # the task ended meanwhile
            continue
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args])

    def forward(signum: int, _frame) -> None:
        # Before the workers exist there is nothing to drain: torchrun stops as it would.
        for pid in children(agent.pid) or [agent.pid]:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    return agent.wait()


if __name__ == "__main__":
    raise SystemExit(main())
