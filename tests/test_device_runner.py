"""bench/device.sh: the transfer verb rebuilds a file from parts carried one call at a time."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_transfer_installs_two_files_split_side_by_side_into_the_model_cache(tmp_path):
    """.gguf/NAME/cN parts of two files, one part per call in any order: each file lands in
    $SPECSPLIT_MODEL_CACHE/NAME/ with the sha256 stamp the catalogue's cache check reads."""
    files = {}
    for name, size, parts in (("model-a", 200_003, 2), ("model-b", 90_001, 3)):
        src = tmp_path / f"{name}.gguf"
        src.write_bytes(os.urandom(size))
        files[name] = src
        assert (
            gguf_chunks.main(["split", str(src), str(tmp_path / "parts" / name), "--parts", str(parts)]) == 0
        )
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "bench", tree / "bench")
    cache = tmp_path / "models"
    env = {**os.environ, "PY": sys.executable, "SPECSPLIT_MODEL_CACHE": str(cache),
           "STASH": str(tmp_path / "stash"), "OUT": str(tmp_path / "out")}  # fmt: skip
    codes = []
    for name, part in (
        ("model-b", "c2"),
        ("model-a", "c1"),
        ("model-b", "c1"),
        ("model-a", "c2"),
        ("model-b", "c3"),
    ):
        shutil.rmtree(tree / ".gguf", ignore_errors=True)
        shutil.copytree(tmp_path / "parts" / name / part, tree / ".gguf" / name / part)
        run = subprocess.run(["bash", "bench/device.sh", "transfer"], cwd=tree, env=env, capture_output=True)
        codes.append(run.returncode)
    assert codes == [3, 3, 3, 0, 0]
    for name, src in files.items():
        installed = cache / name / src.name
        assert installed.read_bytes() == src.read_bytes()
        stamp = installed.with_name(installed.name + ".sha256").read_text().strip()
        assert stamp == gguf_chunks.sha256(src)


def test_device_tree_moves_unneeded_draft_weights_aside_and_back(tmp_path):
    """bench/device_tree.sh: a call that needs one draft carries only its weights; `back` restores all."""
    root, stash = tmp_path / "repo", tmp_path / "aside"
    for name, size in (("big", 5000), ("wanted", 700), ("other", 900)):
        (root / "drafts" / name).mkdir(parents=True)
        (root / "drafts" / name / "model.safetensors").write_bytes(os.urandom(size))
        (root / "drafts" / name / "config.json").write_text("{}")
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    env = {**os.environ, "ROOT": str(root), "STASH": str(stash)}
    script = str(ROOT / "bench" / "device_tree.sh")
    run = subprocess.run(["bash", script, "aside", "wanted"], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    left = sorted(str(p.relative_to(root)) for p in root.rglob("model.safetensors"))
    assert left == ["drafts/wanted/model.safetensors"]
    assert (root / "drafts" / "big" / "config.json").exists()  # only weights move
    assert f"{700 + 3 * 2} bytes" in run.stdout  # what stays: the wanted weights and the configs
    run = subprocess.run(["bash", script, "back"], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before


def _mps_env(tmp_path, calls: Path) -> tuple[Path, dict]:
    """A device tree, and an environment whose PY records the bench script's view of MPS in `calls`
    (running nothing on a GPU) and runs Python for the rest."""
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "bench", tree / "bench")
    py = tmp_path / "py"
    record = f'echo "verb $CUDA_MPS_PIPE_DIRECTORY" >> {calls}; exit 0'
    py.write_text(f'#!/bin/sh\ncase "$1" in bench/*) {record};; esac\nexec {sys.executable} "$@"\n')
    py.chmod(0o755)
    env = {**os.environ, "PY": str(py), "MPS": "1", "OUT": str(tmp_path / "out")}
    env["SITE"] = str(tmp_path / "site")
    return tree, env


def _kernels(tree: Path, env: dict) -> subprocess.CompletedProcess:
    command = ["bash", "bench/device.sh", "kernels"]
    return subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)


def test_mps_runs_the_verb_under_a_daemon_started_before_and_stopped_after(tmp_path):
    calls = tmp_path / "calls"
    tree, env = _mps_env(tmp_path, calls)
    control = tmp_path / "bin" / "nvidia-cuda-mps-control"
    control.parent.mkdir()
    daemon = f'echo "daemon $CUDA_MPS_PIPE_DIRECTORY" >> {calls}'
    control.write_text(f'#!/bin/sh\nif [ "$1" = -d ]; then {daemon}; else cat >> {calls}; fi\n')
    control.chmod(0o755)
    env["PATH"] = f"{control.parent}:{env['PATH']}"
    run = _kernels(tree, env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert calls.read_text().splitlines() == ["daemon /tmp/mps-pipe", "verb /tmp/mps-pipe", "quit"]


def test_mps_without_its_control_program_stops_before_the_verb(tmp_path):
    if shutil.which("nvidia-cuda-mps-control"):
        pytest.skip("this machine has MPS")
    calls = tmp_path / "calls"
    tree, env = _mps_env(tmp_path, calls)
    run = _kernels(tree, env)
    assert run.returncode == 6
    assert "nvidia-cuda-mps-control" in run.stdout
    assert not calls.exists()  # the verb never ran
