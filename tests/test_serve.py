"""`specsplit serve MODEL`: one command serves gRPC, the OpenAI-compatible HTTP API and /metrics, with the
draft in the target's process (--draft) or as services (--draft-address); `info` shows the policy, k and
the draft's kind, and why the target drafts nothing when it does not."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch
from service_util import running

from specsplit import Client, catalog
from specsplit.launch import REPO, free_port, start_service
from target_service import serve

pytestmark = pytest.mark.slow


def test_target_argv(demo_models, tmp_path: Path) -> None:
    model, draft = str(demo_models.target), str(demo_models.draft)
    argv = serve.target_argv([model, "--draft", draft, "--device", "cpu", "--port", "1234"])
    assert argv == ["--model", model, "--device", "cpu", "--dtype", "float32", "--http-port", "8000",
                    "--draft-local", f"--model {draft} --metrics-port 9401", "--port", "1234"]  # fmt: skip
    with pytest.raises(
        ValueError, match=r"MODEL: .*no such file or directory, nor a catalogue name \(smollm2"
    ):
        serve.target_argv([str(tmp_path / "nothing")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"MODEL: .*neither a checkpoint directory"):
        serve.target_argv([str(tmp_path / "empty")])
    with pytest.raises(ValueError, match="--draft: give either"):
        serve.target_argv([model, "--draft", draft, "--draft-address", "127.0.0.1:1"])


def test_a_catalogue_name_serves_its_file_with_its_draft(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A catalogue name resolves to the fetched file (specsplit.catalog.fetch, tested in test_catalog.py;
    here it records what was asked for) and to the draft made for it."""
    fetched: list[str] = []

    def fetch(name: str) -> Path:
        fetched.append(name)
        return tmp_path / f"{name}.gguf"

    monkeypatch.setattr(catalog, "fetch", fetch)
    argv = serve.target_argv(["qwen2.5-coder-1.5b-instruct", "--device", "cpu", "--http-port", "-1"])
    assert fetched == ["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"]
    assert argv[:2] == ["--model", str(tmp_path / "qwen2.5-coder-1.5b-instruct.gguf")]
    assert argv[argv.index("--draft-local") + 1].startswith(
        f"--model {tmp_path}/qwen2.5-coder-0.5b-instruct.gguf"
    )
    smollm2 = serve.target_argv(["smollm2-135m-instruct", "--device", "cpu"])
    assert smollm2[1] == str(tmp_path / "smollm2-135m-instruct.gguf")
    assert smollm2[smollm2.index("--draft-local") + 1].startswith(f"--model {serve.TRAINED_DRAFT}")
    # --draft overrides the catalogue's; a path that exists is a path even where a name would match.
    own = serve.target_argv(["smollm2-135m-instruct", "--draft", "/d", "--device", "cpu"])
    assert own[own.index("--draft-local") + 1].startswith("--model /d ")


def test_device_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert serve.resolve_device("auto", "auto") == ("cpu", "float32")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert serve.resolve_device("auto", "auto") == ("cuda", "bfloat16")
    assert serve.resolve_device("auto", "float16") == ("cuda", "float16")
    assert serve.resolve_device("cpu", "auto") == ("cpu", "float32")


def _http_models(log: str) -> list[str]:
    port = int(re.search(r"SPECSPLIT_HTTP port=(\d+)", log).group(1))
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as r:
        return [m["id"] for m in json.load(r)["data"]]


def test_serve_with_the_draft_in_process(demo_models, tmp_path: Path) -> None:
    args = [str(demo_models.target), "--draft", str(demo_models.draft), "--http-port", "0",
            "--draft-metrics-port", "0", "--speculation-policy", "fixed",
            "--verify-backend", "torch"]  # fmt: skip
    target = start_service("target_service.serve", args, tmp_path / "serve.log")
    with running(target.wait_ready()):
        with Client(target.address) as client:
            info = client.model_info()
            result = client.generate([1, 2, 3], max_new_tokens=8, ignore_eos=True)
        assert (info.draft_kind, info.speculation_policy, info.num_speculative_tokens) == (
            "local",
            "fixed",
            4,
        )
        assert info.dtype == "float32" and info.draft_connected
        assert result.usage.drafted_tokens > 0 and result.usage.speculation_note == ""
        assert _http_models(target.log_text()) == [demo_models.target.name]
        table = subprocess.run([sys.executable, "-m", "specsplit.cli", "info", "--target", target.address],
                               capture_output=True, text=True, cwd=REPO, timeout=60)  # fmt: skip
        lines = dict(line.split(None, 1) for line in table.stdout.splitlines() if " " in line.strip())
        assert lines["speculation_policy"].strip() == "fixed" and lines["draft_kind"].strip() == "local"
        assert lines["num_speculative_tokens"].strip() == "4"


def test_a_target_that_drafts_nothing_says_why(demo_models, tmp_path: Path) -> None:
    """A draft address nothing answers: requests that allow k = 4 get none, and the reason is in their
    usage, in GetModelInfo and in specsplit_not_drafting."""
    nowhere = f"127.0.0.1:{free_port()}"
    args = [
        str(demo_models.target),
        "--draft-address",
        nowhere,
        "--http-port",
        "-1",
        "--verify-backend",
        "torch",
    ]
    target = start_service("target_service.serve", args, tmp_path / "serve.log")
    with running(target.wait_ready()):
        with Client(target.address) as client:
            result = client.generate([1, 2, 3], max_new_tokens=4, ignore_eos=True, num_speculative_tokens=4)
            info = client.model_info()
            assert result.usage.drafted_tokens == 0 and result.usage.speculation_note == "draft not connected"
            assert (info.draft_kind, info.speculation_policy) == ("service", "adaptive")
            assert info.not_drafting_reason == "draft not connected" and not info.draft_connected
            assert target.metric("specsplit_not_drafting", reason="draft not connected") == 1
            # A request that asks for no drafts is not told why it got none; the reason clears.
            plain = client.generate([1, 2, 3], max_new_tokens=4, ignore_eos=True, num_speculative_tokens=0)
            assert plain.usage.speculation_note == "" and client.model_info().not_drafting_reason == ""
            assert target.metric("specsplit_not_drafting", reason="draft not connected") == 0
        assert "SPECSPLIT_HTTP" not in target.log_text()
