"""External tools the tests run (promtool, prometheus, kubectl, buf, ...): skipped when missing, except
in CI (SPECSPLIT_CI set), where a missing tool fails the test."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest


def need(tool: str, path: Path | None = None) -> str:
    """`path` when it exists, else `tool` on PATH; skips (fails in CI) when neither is there."""
    found = str(path) if path is not None and path.exists() else shutil.which(tool)
    if found is None:
        if os.environ.get("SPECSPLIT_CI"):
            pytest.fail(f"{tool} is required in CI (scripts/ci_deps.sh installs it)")
        pytest.skip(f"{tool} not installed (run scripts/ci_deps.sh)")
    return found
