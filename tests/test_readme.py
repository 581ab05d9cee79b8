"""README.md's "Running the services yourself" commands, pasted into bash in order, work without a sleep:
the services open their ports at once and `specsplit health --wait` returns once the target is loaded.

The block runs as written, but for `make venv` (the test runs in that venv already), the venv's path, the
scratch directory and the ports (free ones, so that tests may run side by side)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from specsplit.launch import REPO, free_port

pytestmark = pytest.mark.slow


def readme_block(heading: str) -> str:
    text = (REPO / "README.md").read_text()
    section = text[text.index(heading) :]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def test_running_the_services_yourself(tmp_path: Path) -> None:
    block = readme_block("## Running the services yourself")
    assert "--wait" in block and "sleep" not in block
    lines = [line for line in block.splitlines() if line.strip() and line.strip() != "make venv"]
    script = "\n".join(lines)
    bin_dir = str(Path(sys.executable).parent)
    script = script.replace(".venv/bin/", bin_dir + "/").replace("/tmp/m/", f"{tmp_path}/m/")
    for port in ("50051", "50052", "9400", "9401"):
        script = script.replace(port, str(free_port()))
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    # set -e: a failed `health --wait` or `generate` ends the script; the services are the script's jobs.
    full = f"set -euo pipefail\ncd {REPO}\n{script}\nkill -TERM $(jobs -p)\nwait\n"
    proc = subprocess.Popen(["bash", "-c", full], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-4000:]
    assert "SERVING" in out and re.search(r"\[\d+ tokens, finish", out), out[-4000:]
