"""The `specsplit` command as a real subprocess against real services (multi-process: marked slow)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest_sdk import REPO, Stack, free_port

from specsplit import Client

pytest_plugins = ["conftest_sdk"]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT = "3,14,15,92,65"


def specsplit(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "specsplit.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def generate(target: str, max_new_tokens: int, *more: str) -> subprocess.CompletedProcess[str]:
    """`specsplit generate` of PROMPT's token ids."""
    return specsplit(
        "generate", "--target", target, "--token-ids", PROMPT, "--max-new-tokens", str(max_new_tokens), *more
    )


def assert_one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_generate_streams_ids_and_a_stats_line(sdk_stack: Stack) -> None:
    with Client(sdk_stack.target.address) as c:
        expected = c.generate([3, 14, 15, 92, 65], max_new_tokens=12, ignore_eos=True).token_ids
    result = generate(sdk_stack.target.address, 12, "--ignore-eos")
    assert result.returncode == 0, result.stderr
    assert [int(t) for t in result.stdout.split()] == expected
    stats = result.stderr.strip()
    assert stats.startswith("[12 tokens, finish length, acceptance ") and "TPOT " in stats and " ms" in stats


def test_generate_json(sdk_stack: Stack) -> None:
    result = generate(
        sdk_stack.target.address,
        6,
        "--json",
        "--ignore-eos",
        "--request-id",
        "cli-json",
        "--temperature",
        "0.8",
        "--top-k",
        "20",
        "--seed",
        "7",
    )
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["request_id"] == "cli-json" and payload["finish_reason"] == "length"
    assert len(payload["token_ids"]) == payload["usage"]["output_tokens"] == 6
    assert payload["ttft_s"] > 0 and payload["e2e_s"] >= payload["ttft_s"]
    # Same seed, same sampled tokens.
    again = json.loads(specsplit(*result.args[3:]).stdout)
    assert again["token_ids"] == payload["token_ids"]


def test_info_and_health(sdk_stack: Stack) -> None:
    info = specsplit("info", "--target", sdk_stack.target.address, "--json")
    assert info.returncode == 0 and json.loads(info.stdout)["vocab_size"] == 512
    table = specsplit("info", "--target", sdk_stack.target.address)
    assert "vocab_size" in table.stdout and "512" in table.stdout
    health = specsplit("health", "--target", sdk_stack.target.address)
    assert (health.returncode, health.stdout.strip()) == (0, "SERVING")


def test_errors_are_one_line_and_non_zero(sdk_stack: Stack) -> None:
    target = sdk_stack.target.address
    assert_one_line_error(generate(target, 0), "invalid_argument", "max_new_tokens")
    assert_one_line_error(generate(target, 100000, "--timeout", "0.2", "--ignore-eos"), "max_new_tokens")
    with Client(target) as c:
        long = c.model_info().max_context_length - 5
    assert_one_line_error(generate(target, long, "--timeout", "0.3", "--ignore-eos"), "deadline_exceeded")
    assert_one_line_error(specsplit("generate", "--target", target, "--token-ids", "1,x"), "--token-ids")
    # The secure target wants TLS with a client certificate and a token.
    secure = [
        "--target",
        sdk_stack.secure_target.address,
        "--ca-cert",
        str(sdk_stack.certs.ca),
        "--client-cert",
        str(sdk_stack.certs.client_cert),
        "--client-key",
        str(sdk_stack.certs.client_key),
    ]
    assert_one_line_error(specsplit("info", *secure), "unauthenticated")
    ok = specsplit("info", *secure, "--auth-token-file", str(sdk_stack.auth_token_file), "--json")
    assert ok.returncode == 0 and json.loads(ok.stdout)["vocab_size"] == 512, ok.stderr
    assert_one_line_error(
        specsplit("info", *secure, "--auth-token-file", "/nonexistent/token"), "/nonexistent"
    )


def test_unreachable_server() -> None:
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    for command in ("health", "info"):
        assert_one_line_error(specsplit(command, "--target", address), "unavailable", address)
    assert_one_line_error(specsplit("generate", "--target", address, "--prompt", "hi"), "unavailable")


def test_dispatch_to_make_tiny_model(tmp_path) -> None:
    result = specsplit("make-tiny-model", str(tmp_path / "m"), "--seed", "1", "--vocab-size", "64")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "m" / "config.json").is_file()
    assert json.loads((tmp_path / "m" / "config.json").read_text())["vocab_size"] == 64
