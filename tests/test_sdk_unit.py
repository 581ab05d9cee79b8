"""SDK pieces that need no server: request building, error mapping, channel configuration, typing."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest

import specsplit
from specsplit import errors
from specsplit._channel import RetryPolicy, TLSConfig, channel_options, service_config
from specsplit.client import build_request

REPO = Path(__file__).resolve().parents[1]


def test_build_request_token_ids_and_sampling() -> None:
    request = build_request(
        np.array([5, 6, 7]), max_new_tokens=9, temperature=0.5, top_k=3, top_p=0.9, seed=11,
        stop_token_ids=[2], stop_strings=["\n"], num_speculative_tokens=4, ignore_eos=True, request_id="r1",
    )  # fmt: skip
    assert list(request.token_ids.ids) == [5, 6, 7] and request.WhichOneof("prompt") == "token_ids"
    assert (request.request_id, request.max_new_tokens, request.num_speculative_tokens) == ("r1", 9, 4)
    assert request.sampling.top_k == 3 and request.sampling.seed == 11 and request.ignore_eos
    assert request.sampling.top_p == pytest.approx(0.9) and request.sampling.temperature == 0.5
    assert list(request.stop_token_ids) == [2] and list(request.stop_strings) == ["\n"]


def test_build_request_defaults_leave_optionals_unset() -> None:
    request = build_request("hello")
    assert request.text == "hello" and len(request.request_id) == 32
    assert not request.HasField("num_speculative_tokens")
    assert not request.sampling.HasField("top_p") and not request.sampling.HasField("seed")
    assert build_request("x").request_id != request.request_id


@pytest.mark.parametrize(
    ("prompt", "options", "field"),
    [
        ([1, -2], {}, "token_ids"),
        ([1], {"stop_token_ids": [-1]}, "stop_token_ids"),
        ([1], {"seed": -3}, "sampling.seed"),
    ],
)
def test_build_request_refuses_what_the_proto_cannot_hold(prompt: object, options: dict, field: str) -> None:
    with pytest.raises(specsplit.InvalidRequestError) as info:
        build_request(prompt, **options)  # type: ignore[arg-type]
    assert info.value.field == field and info.value.code == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(
    ("prompt", "options", "message"),
    [
        # Unknown keywords: named, with the option meant when it is another client's spelling.
        ([1], {"max_tokens": 5}, "unexpected keyword argument 'max_tokens'; did you mean max_new_tokens?"),
        ([1], {"stop": ["a"]}, "unexpected keyword argument 'stop'; did you mean stop_strings"),
        ([1], {"temprature": 0.5}, "unexpected keyword argument 'temprature'; did you mean temperature?"),
        ([1], {"frobnicate": 1}, "unexpected keyword argument 'frobnicate'"),
        # A str where a list belongs would iterate as characters.
        ([1], {"stop_strings": "as"}, "stop_strings: expected a list of strings, got str 'as'"),
        ([1], {"stop_strings": [b"as"]}, "stop_strings: expected str, got bytes"),
        ([1], {"stop_token_ids": 2}, "stop_token_ids: expected a list of ints, got int 2"),
        ([1], {"stop_token_ids": "2"}, "stop_token_ids: expected a list of ints, got str"),
        # bytes would iterate as byte values, i.e. token ids [104, 105].
        (b"hi", {}, "prompt: got bytes"),
        (bytearray(b"hi"), {}, "prompt: got bytes"),
        (42, {}, "prompt: expected str or a list of token ids, got int"),
        ({1: 2}, {}, "prompt: expected str or a list of token ids, got dict"),
        ([1.5], {}, "token_ids: expected an int, got float 1.5"),
        (np.array([1.0]), {}, "token_ids: expected an int, got float"),
        ([1], {"max_new_tokens": "8"}, "max_new_tokens: expected an int, got str '8'"),
        ([1], {"max_new_tokens": 8.0}, "max_new_tokens: expected an int, got float"),
        ([1], {"top_k": True}, "top_k: expected an int, got bool"),
        ([1], {"temperature": "0.5"}, "temperature: expected a number, got str"),
        ([1], {"top_p": "0.9"}, "top_p: expected a number, got str"),
        ([1], {"ignore_eos": 1}, "ignore_eos: expected a bool, got int"),
        ([1], {"request_id": 7}, "request_id: expected str, got int"),
        ([1], {"logprobs": 2.0}, "logprobs: expected an int, got float"),
    ],
)
def test_call_mistakes_are_type_errors(prompt: object, options: dict, message: str) -> None:
    with pytest.raises(TypeError) as info:
        build_request(prompt, **options)  # type: ignore[arg-type]
    assert message in str(info.value)
    assert not isinstance(info.value, specsplit.SpecSplitError)  # a wrong call, not a server answer


def test_both_clients_refuse_mistakes_before_any_call() -> None:
    """Nothing listens on port 1: the TypeError comes before any RPC (and AsyncClient needs no loop)."""
    with specsplit.Client("127.0.0.1:1", retry=None) as client:
        with pytest.raises(TypeError, match="max_tokens"):
            client.generate([1], max_tokens=5)  # type: ignore[call-arg]
        with pytest.raises(TypeError, match="stop_strings"):
            client.stream("hi", stop_strings="as")  # type: ignore[arg-type]
    aclient = specsplit.AsyncClient("127.0.0.1:1", retry=None)  # no running loop here
    with pytest.raises(TypeError, match="prompt: got bytes"):
        aclient.stream(b"hi")  # type: ignore[arg-type]


def test_closed_clients_raise_client_closed_error() -> None:
    client = specsplit.Client("127.0.0.1:1")
    client.close()
    client.close()  # idempotent
    for call in (client.model_info, client.health, lambda: client.generate([1]), lambda: client.abort("r")):
        with pytest.raises(specsplit.ClientClosedError, match=r"127\.0\.0\.1:1"):
            call()

    async def closed_async() -> None:
        aclient = specsplit.AsyncClient("127.0.0.1:1")
        await aclient.close()
        with pytest.raises(specsplit.ClientClosedError):
            await aclient.model_info()
        with pytest.raises(specsplit.ClientClosedError):
            aclient.stream([1])

    asyncio.run(closed_async())


def test_usage_acceptance_rate_is_always_a_float() -> None:
    plain = specsplit.Usage(prompt_tokens=3, output_tokens=5, drafted_tokens=0, accepted_tokens=0, steps=5)
    assert plain.acceptance_rate == 0.0 and isinstance(plain.acceptance_rate, float)
    assert specsplit.Usage(3, 5, 8, 6, 2).acceptance_rate == 0.75


def test_errors_carry_request_id_and_partial_output() -> None:
    code = grpc.StatusCode.DEADLINE_EXCEEDED
    error = errors.error_from_status(code, "Deadline Exceeded", "r9", [4, 5], "ab")
    assert isinstance(error, specsplit.DeadlineExceededError)
    assert (error.request_id, error.token_ids, error.text) == ("r9", [4, 5], "ab")
    assert "request r9" in str(error)
    assert errors.error_from_status(grpc.StatusCode.INTERNAL, "x").request_id is None


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, specsplit.InvalidRequestError),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, specsplit.OverloadedError),
        (grpc.StatusCode.UNAVAILABLE, specsplit.UnavailableError),
        (grpc.StatusCode.DEADLINE_EXCEEDED, specsplit.DeadlineExceededError),
        (grpc.StatusCode.UNAUTHENTICATED, specsplit.AuthenticationError),
        (grpc.StatusCode.CANCELLED, specsplit.RequestCancelledError),
        (grpc.StatusCode.INTERNAL, specsplit.APIError),
    ],
)
def test_status_codes_map_to_one_error_each(code: grpc.StatusCode, cls: type) -> None:
    error = errors.error_from_status(code, "details here")
    assert type(error) is cls and isinstance(error, specsplit.SpecSplitError)
    assert error.code == code and error.details == "details here"


def test_invalid_request_error_names_the_field() -> None:
    for details, field in [
        ("max_new_tokens: must be > 0", "max_new_tokens"),
        ("sampling.top_p: must be in (0, 1]", "sampling.top_p"),
        ("token_ids[3]: 900 >= vocab_size 512", "token_ids[3]"),
        ("queue full", None),
    ]:
        error = errors.error_from_status(grpc.StatusCode.INVALID_ARGUMENT, details)
        assert isinstance(error, specsplit.InvalidRequestError) and error.field == field


def test_service_config_round_robin_and_retry_on_unavailable_only() -> None:
    config = json.loads(service_config(RetryPolicy(max_attempts=4, initial_backoff_s=0.1, max_backoff_s=1.0)))
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    (method,) = config["methodConfig"]
    assert {"service": "specsplit.v1.TargetService"} in method["name"]
    assert method["retryPolicy"] == {
        "maxAttempts": 4, "initialBackoff": "0.1s", "maxBackoff": "1.0s",
        "backoffMultiplier": 2.0, "retryableStatusCodes": ["UNAVAILABLE"],
    }  # fmt: skip
    assert "methodConfig" not in json.loads(service_config(None))
    options = dict(
        channel_options(None, TLSConfig(server_name="svc.internal"), (("grpc.enable_retries", 1),))
    )
    assert options["grpc.ssl_target_name_override"] == "svc.internal" and options["grpc.enable_retries"] == 1


def test_bad_policy_and_tls_config_name_the_field() -> None:
    with pytest.raises(ValueError, match="max_attempts"):
        RetryPolicy(max_attempts=9)
    with pytest.raises(ValueError, match="private_key"):
        TLSConfig(certificate_chain=b"cert")


def test_public_api_exports() -> None:
    assert specsplit.__version__ == "0.1.0"
    for name in specsplit.__all__:
        assert hasattr(specsplit, name), name


def test_mypy_strict_on_the_sdk_package() -> None:
    """The whole `specsplit` package (SDK, CLI, demo, launcher) type-checks under --strict."""
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "-p", "specsplit"],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
