"""`pip install ./client` (the specsplit-client distribution, client/pyproject.toml): the SDK and the
client commands work with grpcio/protobuf only (no torch, triton, numpy, prometheus_client) against real
running services, and the install puts nothing into site-packages but the `specsplit` package (no
top-level `common`, `draft_service`, `target_service`).

Offline: the wheel is built from this checkout; a fresh venv (no system site-packages) installs it
with --no-deps and sees only grpc, protobuf and grpc_health (linked in through a .pth directory), so
anything else the client imported would fail here. The wheel's metadata is checked to require
exactly those three.
"""

from __future__ import annotations

import email
import json
import os
import re
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import grpc
import grpc_health
import pytest
import typing_extensions
from google import protobuf
from service_util import running, start_draft, start_target

from specsplit.launch import REPO

CLIENT_DEPS = {"grpcio", "protobuf", "grpcio-health-checking"}


def _build_wheel(out: Path) -> Path:
    # From a copy (client/specsplit, a link to the package, copied as files): setuptools leaves build/
    # and *.egg-info in the source tree.
    src = out.parent / "src"
    shutil.copytree(REPO / "client", src, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out)]
    subprocess.run([*cmd, str(src)], check=True, timeout=300)
    return next(out.glob("specsplit_client-*.whl"))


def _requires(wheel: Path) -> set[str]:
    """The wheel's requirements, as bare names."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = email.message_from_bytes(z.read(meta))
    return {re.split(r"[;<>=!~ ]", req, maxsplit=1)[0].lower() for req in msg.get_all("Requires-Dist") or []}


def _client_venv(root: Path, wheel: Path) -> Path:
    venv.EnvBuilder(with_pip=False, system_site_packages=False).create(root)
    py = root / "bin" / "python"
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(subprocess.check_output([py, "-c", purelib], text=True).strip())
    # Only the three client dependencies (and what grpcio needs), from this interpreter's site-packages.
    deps = root / "client-deps"
    (deps / "google").mkdir(parents=True)
    (deps / "grpc").symlink_to(Path(grpc.__file__).parent)
    (deps / "grpc_health").symlink_to(Path(grpc_health.__path__[0]))
    (deps / "typing_extensions.py").symlink_to(Path(typing_extensions.__file__))  # grpcio's own dependency
    (deps / "google" / "protobuf").symlink_to(Path(protobuf.__file__).parent)
    upb = Path(protobuf.__file__).parent.parent / "_upb"
    if upb.exists():
        (deps / "google" / "_upb").symlink_to(upb)
    (site / "client-deps.pth").write_text(str(deps) + "\n")
    # Without PYTHONPATH: pip would find this checkout's specsplit there and install nothing.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    pip = [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-index"]
    subprocess.run([*pip, str(wheel)], check=True, timeout=300, env=env)
    return root, site


@pytest.mark.slow
def test_client_only_install(demo_models, tmp_path):
    wheel = _build_wheel(tmp_path / "dist")
    assert _requires(wheel) == CLIENT_DEPS, _requires(wheel)

    env_root, site = _client_venv(tmp_path / "venv", wheel)
    py, cli = env_root / "bin" / "python", env_root / "bin" / "specsplit"
    # Nothing generic in site-packages: the package, its metadata, and this test's .pth.
    installed = {p.name for p in site.iterdir()} - {"client-deps.pth", "__pycache__"}
    assert {n for n in installed if not n.startswith(("pip", "_distutils"))} == {
        "specsplit", "specsplit_client-0.1.0.dist-info"}, installed  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    listed = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "list", "--format", "json"],
                            capture_output=True, text=True, check=True, env=env)  # fmt: skip
    names = {d["name"].lower() for d in json.loads(listed.stdout)}
    assert "specsplit-client" in names and not names & {"torch", "triton", "numpy", "prometheus-client"}, (
        names
    )
    clean = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}  # no PYTHONPATH: only the venv
    no_torch = subprocess.run([py, "-c", "import torch"], capture_output=True, env=clean)
    assert no_torch.returncode != 0, "the client venv must not see torch"

    draft = start_draft(demo_models.draft, tmp_path).wait_ready()
    target = start_target(demo_models.target, tmp_path, draft, "--max-context-length", "128").wait_ready()
    with running(draft, target):

        def run(*args: str | Path) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [*map(str, args)], capture_output=True, text=True, env=clean, timeout=120, cwd=tmp_path
            )

        health = run(cli, "health", "--target", target.address)
        assert health.returncode == 0 and "SERVING" in health.stdout, health
        gen = run(
            cli,
            "generate",
            "--target",
            target.address,
            "--token-ids",
            "1,2,3",
            "--max-new-tokens",
            "8",
            "--temperature",
            "0",
            "--ignore-eos",
            "--json",
        )
        assert gen.returncode == 0, gen
        sdk = run(py, "-c", f"""
import sys, specsplit
with specsplit.Client({target.address!r}) as c:
    spec = c.generate([1, 2, 3], max_new_tokens=8, temperature=0.0, ignore_eos=True)
    plain = c.generate([1, 2, 3], max_new_tokens=8, temperature=0.0, ignore_eos=True,
                       num_speculative_tokens=0)
assert spec.token_ids == plain.token_ids and len(spec.token_ids) == 8, (spec, plain)
assert spec.usage.drafted_tokens > 0, spec.usage
heavy = ("torch", "triton", "numpy", "safetensors", "prometheus_client", "common")
heavy = sorted(m for m in heavy if m in sys.modules)
assert not heavy, heavy
print(spec.token_ids)
""")  # fmt: skip
        assert sdk.returncode == 0, sdk
        assert json.loads(gen.stdout)["token_ids"] == json.loads(sdk.stdout), (gen.stdout, sdk.stdout)
        for command in ("serve-target", "serve", "demo"):
            server_side = run(cli, command, "--help")
            assert server_side.returncode != 0 and "specsplit[serve]" in server_side.stderr, server_side
        # A did-you-mean for another tool's flag, and a clear error for the draft's port.
        hint = run(cli, "generate", "--target", target.address, "--prompt", "hi", "--max-tokens", "4")
        assert hint.returncode == 2 and "did you mean --max-new-tokens" in hint.stderr, hint
        wrong = run(cli, "info", "--target", draft.address)
        assert wrong.returncode == 9 and "serves the draft service" in wrong.stderr, wrong


def test_the_demo_installs_the_runtime_set_only():
    """`make demo` installs requirements.txt (the services' runtime); `make test` adds the dev set on top.
    The runtime set names none of the test and lint tools, and the dev set includes it whole."""
    makefile = (REPO / "Makefile").read_text()
    demo = re.search(r"^demo: (.*)$", makefile, re.M).group(1).split()
    assert demo == ["$(RUNTIME)"], demo
    runtime_recipe = makefile[makefile.index("$(RUNTIME):") : makefile.index("$(STAMP):")]
    assert "-r requirements.txt" in runtime_recipe and "requirements-dev" not in runtime_recipe

    def names(path: Path) -> set[str]:
        lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
        return {re.split(r"[<>=!~\[ ]", line, maxsplit=1)[0].lower() for line in lines if line}

    runtime, dev = names(REPO / "requirements.txt"), names(REPO / "requirements-dev.txt")
    tools = {"pytest", "pytest-xdist", "ruff", "mypy", "transformers", "accelerate", "hypothesis", "openai",
             "scipy", "grpcio-tools"}  # fmt: skip
    assert not runtime & tools and tools <= dev, (runtime & tools, tools - dev)
    assert "-r requirements.txt" in (REPO / "requirements-dev.txt").read_text().splitlines()
    assert {"torch", "grpcio", "starlette", "uvicorn", "gguf"} <= runtime
