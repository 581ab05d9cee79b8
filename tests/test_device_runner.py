"""bench/device.sh: the transfer verb rebuilds a file from parts carried one call at a time."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from bench import gguf_chunks

ROOT = Path(__file__).resolve().parents[1]


def test_transfer_rebuilds_the_file_from_parts_sent_one_call_at_a_time(tmp_path):
    big = tmp_path / "model.gguf"
    big.write_bytes(os.urandom(300_001))
    assert gguf_chunks.main(["split", str(big), str(tmp_path / "parts"), "--parts", "3"]) == 0
    tree = tmp_path / "tree"  # the device's working copy: the runner and one carried part per call
    shutil.copytree(ROOT / "bench", tree / "bench")
    install = tmp_path / "site" / "pkg"
    env = {**os.environ, "PY": sys.executable, "INSTALL": str(install), "STASH": str(tmp_path / "stash")}
    env["OUT"] = str(tmp_path / "out")
    codes = []
    for part in ("c1", "c2", "c3"):
        shutil.rmtree(tree / ".gguf", ignore_errors=True)
        shutil.copytree(tmp_path / "parts" / part, tree / ".gguf" / part)
        run = subprocess.run(["bash", "bench/device.sh", "transfer"], cwd=tree, env=env, capture_output=True)
        codes.append(run.returncode)
    assert codes == [3, 3, 0]
    assert (install / "model.gguf").read_bytes() == big.read_bytes()
    assert (install / "__init__.py").exists()


def test_an_unknown_verb_prints_the_verbs():
    run = subprocess.run(["bash", "bench/device.sh", "nope"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 2
    assert "bench/device.sh e2e" in run.stdout and "transfer" in run.stdout
