"""`specsplit demo` end to end on CPU: SmolLM2 and its feature draft as two services (real subprocesses,
real gRPC), one held-out question; the speculative answer equals plain decoding and the draft's tokens
were accepted. Speed is the benchmark's to hold (docs/benchmarks.md), not this test's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specsplit.demo import DEMO_K, FEATURE_DRAFT


@pytest.mark.parametrize("which", [[], ["--classic"]], ids=["feature-draft", "classic-draft"])
def test_demo_serves_smollm2_losslessly_with_drafts_accepted(which: list[str], tmp_path) -> None:
    question = "Describe the life cycle of a butterfly."
    cmd = [sys.executable, "-m", "specsplit.cli", "demo", "--json", "--max-new-tokens", "24",
           "--question", question, "--models", str(tmp_path), *which]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert summary["lossless"] is True
    assert summary["output_tokens"] == 24
    assert summary["acceptance_rate"] > 0 and summary["tokens_per_step"] > 1.0
    # c comes from the target's own histograms: the draft's round trip and the plain step, both timed.
    k = DEMO_K["classic" if which else "feature"]
    assert 0 < summary["draft_cost"] < 5
    assert summary["ideal_speedup"] == pytest.approx(
        (1 + summary["mean_accepted_length"]) / (k * summary["draft_cost"] + 1)
    )
    assert summary["speedup"] > 0
    if not which:
        assert FEATURE_DRAFT.name in done.stderr  # the default draft is the feature draft


def test_demo_draft_flag_names_a_bad_directory(tmp_path) -> None:
    cmd = [sys.executable, "-m", "specsplit.cli", "demo", "--draft", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and f"--draft {tmp_path}: no config.json" in done.stderr
