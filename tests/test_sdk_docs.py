"""docs/sdk.md and README.md's SDK examples are run against real services and type-checked with
`mypy --strict` against the installed package, so the docs cannot drift from the SDK (multi-process)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest_sdk import AUTH_TOKEN, REPO, Stack

pytest_plugins = ["conftest_sdk"]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SDK_DOCS = REPO / "docs" / "sdk.md"
DOCS_TARGET = "127.0.0.1:50051"
DOCS_SECURE_TARGET = "target.example:443"
DOCS_TOKEN = "s3cret"


def blocks(path: Path, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", path.read_text(), flags=re.S | re.M)


def sample_app() -> str:
    """docs/sdk.md's Python blocks in order: one program."""
    return "\n\n".join(blocks(SDK_DOCS, "python"))


def run_python(code: str, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def test_sdk_docs_python_examples_run(sdk_stack: Stack) -> None:
    code = (
        sample_app()
        .replace(DOCS_TARGET, sdk_stack.target.address)
        .replace(DOCS_SECURE_TARGET, sdk_stack.secure_target.address)
        .replace(DOCS_TOKEN, AUTH_TOKEN)
    )
    # The TLS example reads ca.pem, client.pem and client.key from the working directory.
    result = run_python(code, cwd=sdk_stack.certs.ca.parent)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "did you mean max_new_tokens?" in out and "stop_strings: expected a list of strings" in out
    assert "\nTrue\naborted\n" in out  # the abort example
    assert "max_new_tokens max_new_tokens: must be > 0, got 0 my-request" in out
    assert out.count("SERVING") == 1  # the mTLS example
    assert "acceptance " in out and " drafted" in out


def test_readme_sdk_example_runs(sdk_stack: Stack, tmp_path: Path) -> None:
    readme = REPO / "README.md"
    (code,) = [b for b in blocks(readme, "python") if "from specsplit import Client" in b]
    result = run_python(code.replace(DOCS_TARGET, sdk_stack.target.address), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    first = result.stdout.splitlines()[0]  # token ids, finish reason, acceptance rate
    assert first.startswith("[") and first.split()[-2] in ("length", "eos") and float(first.split()[-1]) >= 0


def test_sdk_docs_cli_examples_run(sdk_stack: Stack) -> None:
    """The CLI block's commands (generate, info, health, --version) exit 0 against the real target."""
    (cli_block,) = [b for b in blocks(SDK_DOCS, "bash") if "specsplit --version" in b]
    commands = [line.split("  #")[0] for line in cli_block.splitlines() if line.startswith("specsplit ")]
    assert len(commands) == 8
    for command in commands:
        argv = shlex.split(command.replace(DOCS_TARGET, sdk_stack.target.address))
        result = subprocess.run([sys.executable, "-m", "specsplit.cli", *argv[1:]], cwd=REPO,
                                capture_output=True, text=True, timeout=120)  # fmt: skip
        assert result.returncode == 0, (command, result.stderr)


def test_sdk_docs_sample_app_passes_mypy_strict_against_the_installed_package(tmp_path: Path) -> None:
    """Outside the repository and without PYTHONPATH, mypy must find `specsplit` where pip installed it
    (`make venv` installs the editable package in compat mode for this)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MYPYPATH")}
    find = "import specsplit; print(specsplit.__file__)"
    where = subprocess.run([sys.executable, "-c", find], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=60)  # fmt: skip
    assert where.returncode == 0, f"specsplit is not installed: {where.stderr}"
    installed = Path(where.stdout.strip()).resolve().parent
    if installed != (REPO / "specsplit").resolve():  # e.g. a second worktree sharing one venv
        pytest.skip(f"the installed specsplit is {installed}, another checkout than {REPO}")
    app = tmp_path / "app.py"
    app.write_text(sample_app())
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", str(app)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
