"""The `specsplit` command as a real subprocess against real services (multi-process: marked slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from conftest_sdk import REPO, Stack, free_port

from specsplit import Client, __version__, cli

pytest_plugins = ["conftest_sdk"]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT = "3,14,15,92,65"


def specsplit(*args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != cli.TARGET_ENV} | env
    return subprocess.run(
        [sys.executable, "-m", "specsplit.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environ,
    )


def generate(target: str, max_new_tokens: int, *more: str) -> subprocess.CompletedProcess[str]:
    """`specsplit generate` of PROMPT's token ids."""
    return specsplit(
        "generate", "--target", target, "--token-ids", PROMPT, "--max-new-tokens", str(max_new_tokens), *more
    )


def assert_one_line_error(result: subprocess.CompletedProcess[str], exit_code: int, *needles: str) -> None:
    assert result.returncode == exit_code, (result.returncode, result.stderr)
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
    described = json.loads(info.stdout)
    assert (described["speculation_policy"], described["draft_kind"]) == ("fixed", "service")
    assert described["num_speculative_tokens"] == 4 and described["not_drafting_reason"] == ""
    ready = specsplit("health", "--target", sdk_stack.target.address, "--wait", "30")
    assert (ready.returncode, ready.stdout) == (0, "SERVING\n")
    table = specsplit("info", "--target", sdk_stack.target.address)
    assert "vocab_size" in table.stdout and "512" in table.stdout
    health = specsplit("health", "--target", sdk_stack.target.address)
    assert (health.returncode, health.stdout.strip()) == (0, "SERVING")


def test_errors_are_one_line_and_non_zero(sdk_stack: Stack) -> None:
    target = sdk_stack.target.address
    invalid = cli.EXIT_INVALID_REQUEST
    assert_one_line_error(generate(target, 0), invalid, "invalid_argument", "max_new_tokens")
    assert_one_line_error(
        generate(target, 100000, "--timeout", "0.2", "--ignore-eos"), invalid, "max_new_tokens"
    )
    assert_one_line_error(generate(target, 4, "--logprobs", "99"), invalid, "logprobs")
    with Client(target) as c:
        long = c.model_info().max_context_length - 5
    deadline = generate(target, long, "--timeout", "0.3", "--ignore-eos", "--request-id", "cli-deadline")
    assert_one_line_error(deadline, cli.EXIT_DEADLINE, "deadline_exceeded", "request cli-deadline")
    assert_one_line_error(specsplit("generate", "--target", target, "--token-ids", "1,x"), cli.EXIT_USAGE,
                          "--token-ids")  # fmt: skip
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
    assert_one_line_error(specsplit("info", *secure), cli.EXIT_AUTH, "unauthenticated")
    ok = specsplit("info", *secure, "--auth-token-file", str(sdk_stack.auth_token_file), "--json")
    assert ok.returncode == 0 and json.loads(ok.stdout)["vocab_size"] == 512, ok.stderr
    assert_one_line_error(
        specsplit("info", *secure, "--auth-token-file", "/nonexistent/token"), cli.EXIT_ERROR, "/nonexistent"
    )


def test_unreachable_server() -> None:
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    for command in ("health", "info"):
        start = time.monotonic()
        assert_one_line_error(
            specsplit(command, "--target", address), cli.EXIT_UNAVAILABLE, "unavailable", address
        )
        assert time.monotonic() - start < 5.0  # the interpreter's start included; the call itself < 1 s
    # --wait: waits for the server (not there: UNREACHABLE after the wait, exit 3).
    start = time.monotonic()
    waited = specsplit("health", "--target", address, "--wait", "1.5")
    assert (waited.returncode, waited.stdout) == (cli.EXIT_UNAVAILABLE, "UNREACHABLE\n")
    assert time.monotonic() - start >= 1.5
    assert_one_line_error(specsplit("generate", "--target", address, "--prompt", "hi"), cli.EXIT_UNAVAILABLE,
                          "unavailable")  # fmt: skip
    # --json: the error as one JSON object on stdout as well.
    result = specsplit("info", "--target", address, "--json")
    error = json.loads(result.stdout)["error"]
    assert error["code"] == "UNAVAILABLE" and error["exit_code"] == result.returncode == cli.EXIT_UNAVAILABLE


def test_the_draft_address_is_named_as_the_mistake(sdk_stack: Stack) -> None:
    draft = sdk_stack.draft.address
    for command in (["info"], ["health"], ["generate", "--token-ids", "1,2"]):
        result = specsplit(*command, "--target", draft)
        assert_one_line_error(result, cli.EXIT_WRONG_SERVICE, f"{draft} serves the draft service", "--target")


def test_did_you_mean_and_help() -> None:
    hint = specsplit("generate", "--prompt", "hi", "--max-tokens", "5")
    assert hint.returncode == cli.EXIT_USAGE
    assert "--max-tokens: did you mean --max-new-tokens?" in hint.stderr, hint.stderr
    close = specsplit("generate", "--prompt", "hi", "--temprature", "0")
    assert "--temprature: did you mean --temperature?" in close.stderr, close.stderr
    top = specsplit("--help").stdout
    assert "SmolLM2-135M-Instruct" in top and "tiny models" not in top and "serve" in top


def test_target_from_the_environment_version_and_json_everywhere(sdk_stack: Stack) -> None:
    env = {cli.TARGET_ENV: sdk_stack.target.address}
    health = specsplit("health", "--json", **env)
    assert health.returncode == 0, health.stderr
    want = {"target": sdk_stack.target.address, "service": "specsplit.v1.TargetService", "status": "SERVING"}
    assert json.loads(health.stdout) == want
    assert json.loads(specsplit("info", "--json", **env).stdout)["vocab_size"] == 512
    # Without the variable the documented default applies.
    assert "localhost:50051" in specsplit("health", "--help").stdout
    version = specsplit("--version")
    assert (version.returncode, version.stdout.strip()) == (0, f"specsplit {__version__}")


def test_generate_logprobs(sdk_stack: Stack) -> None:
    with Client(sdk_stack.target.address) as c:
        expected = c.generate([3, 14, 15, 92, 65], max_new_tokens=6, ignore_eos=True, logprobs=2)
    result = generate(sdk_stack.target.address, 6, "--ignore-eos", "--logprobs", "2", "--json")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert [lp["token_id"] for lp in payload["logprobs"]] == expected.token_ids
    assert [lp["logprob"] for lp in payload["logprobs"]] == pytest.approx(
        [lp.logprob for lp in expected.logprobs]
    )
    assert all(len(lp["top"]) == 2 for lp in payload["logprobs"])
    text = generate(sdk_stack.target.address, 6, "--ignore-eos", "--logprobs", "1")
    lines = text.stdout.strip().splitlines()
    # The streamed ids, then one line per token: id, logprob, the alternative as id:logprob.
    assert [int(t) for t in lines[0].split()] == expected.token_ids
    assert [int(line.split("\t")[0]) for line in lines[1:]] == expected.token_ids
    assert all(len(line.split("\t")) == 3 for line in lines[1:])


def test_dispatch_to_make_tiny_model(tmp_path) -> None:
    result = specsplit("make-tiny-model", str(tmp_path / "m"), "--seed", "1", "--vocab-size", "64")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "m" / "config.json").is_file()
    assert json.loads((tmp_path / "m" / "config.json").read_text())["vocab_size"] == 64
