"""The .proto sources lint clean (buf STANDARD) and the committed stubs match them exactly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tools import need

ROOT = Path(__file__).resolve().parents[1]
PROTOS = ROOT / "protos"
GENERATED = ROOT / "specsplit" / "v1"
BUF = ROOT / ".venv" / "buf" / "node_modules" / ".bin" / "buf"


def test_stubs_match_protos(tmp_path):
    venv_bin = Path(sys.executable).parent
    env = os.environ | {"PATH": f"{venv_bin}:{os.environ['PATH']}"}
    protos = sorted(str(p.relative_to(PROTOS)) for p in (PROTOS / "specsplit" / "v1").glob("*.proto"))
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTOS}", f"--python_out={tmp_path}",
         f"--grpc_python_out={tmp_path}", f"--mypy_out={tmp_path}", f"--mypy_grpc_out={tmp_path}", *protos],
        check=True, env=env, cwd=PROTOS,
    )  # fmt: skip
    fresh = sorted((tmp_path / "specsplit" / "v1").iterdir())
    assert fresh, "protoc produced nothing"
    for f in fresh:
        committed = GENERATED / f.name
        assert committed.exists(), f"{f.name} is not committed: run `make protos`"
        assert committed.read_text() == f.read_text(), f"{f.name} drifted from protos/: run `make protos`"
    names = {f.name for f in fresh}
    stale = {p.name for p in GENERATED.glob("*_pb2*")} - names
    assert not stale, f"generated files without a .proto: {stale}"


def test_stubs_import_on_grpcio_184_0():
    """The GPU machines run grpcio 1.84.0: stubs from a newer grpcio-tools refuse to import there."""
    text = (GENERATED / "target_pb2_grpc.py").read_text()
    assert "GRPC_GENERATED_VERSION = '1.84.0'" in text


def test_buf_lint_standard():
    buf = need("buf", BUF)
    result = subprocess.run([buf, "lint"], cwd=PROTOS, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
