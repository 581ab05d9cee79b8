"""Logprobs and the drain timeout through the SDK, against the real services of conftest_sdk (whose draft
shares the target's first layer, so speculation accepts and rejects drafts; multi-process: slow).

Logprobs are checked against Hugging Face transformers' forward of the same checkpoint over the
generated sequence, and speculative values against plain decoding's (k = 0).
"""

from __future__ import annotations

import signal

import pytest
import torch
import transformers
from conftest_sdk import STARTUP_TIMEOUT_S, Stack
from service_util import running, start_target

import specsplit
from specsplit import Client, FinishReason, GenerateResult

HFModel = transformers.PreTrainedModel
pytest_plugins = ["conftest_sdk"]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]
ATOL = 1e-4  # fp32 on CPU: batched verify rows against one unbatched transformers forward


@pytest.fixture(scope="module")
def hf(sdk_stack: Stack) -> HFModel:
    return transformers.AutoModelForCausalLM.from_pretrained(
        sdk_stack.model, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def reference_logprobs(hf: HFModel, prompt: list[int], result: GenerateResult,
                       temperature: float = 0.0, top_k: int = 0) -> torch.Tensor:  # fmt: skip
    """[n, V] log-probabilities of each output position: transformers' logits over prompt + output,
    tempered and top-k truncated as the request sampled (greedy: temperature 1, untruncated)."""
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + result.token_ids])).logits[0, len(prompt) - 1 : -1].double()
    if temperature > 0:
        logits = logits / temperature
        if top_k:
            kth = logits.topk(top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
    return logits.log_softmax(-1)


def assert_logprobs_match(result: GenerateResult, want: torch.Tensor, num_top: int) -> None:
    assert [lp.token_id for lp in result.logprobs] == result.token_ids
    for j, lp in enumerate(result.logprobs):
        assert lp.logprob == pytest.approx(float(want[j, lp.token_id]), abs=ATOL), f"token {j}"
        top = want[j].topk(num_top)
        assert [t for t, _ in lp.top] == top.indices.tolist(), f"token {j}"
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=ATOL)


def test_greedy_logprobs_equal_transformers_and_plain_decoding(sdk_stack: Stack, hf: HFModel) -> None:
    with Client(sdk_stack.target.address, timeout=120) as client:
        spec = client.generate(PROMPT, max_new_tokens=16, ignore_eos=True, logprobs=5)
        plain = client.generate(PROMPT, max_new_tokens=16, ignore_eos=True, logprobs=5,
                                num_speculative_tokens=0)  # fmt: skip
    # Speculation really ran: drafts were accepted, and some rejected.
    assert 0 < spec.usage.accepted_tokens < spec.usage.drafted_tokens, spec.usage
    assert plain.usage.drafted_tokens == 0 and plain.token_ids == spec.token_ids
    want = reference_logprobs(hf, PROMPT, spec)
    assert_logprobs_match(spec, want, 5)
    assert_logprobs_match(plain, want, 5)
    for a, b in zip(spec.logprobs, plain.logprobs):
        assert a.logprob == pytest.approx(b.logprob, abs=ATOL)


def test_sampled_logprobs_follow_temperature_and_top_k(sdk_stack: Stack, hf: HFModel) -> None:
    with Client(sdk_stack.target.address, timeout=120) as client:
        result = client.generate(PROMPT, max_new_tokens=16, ignore_eos=True, temperature=0.8, top_k=20,
                                 seed=3, logprobs=3)  # fmt: skip
    assert result.usage.accepted_tokens > 0, result.usage
    assert_logprobs_match(result, reference_logprobs(hf, PROMPT, result, 0.8, 20), 3)


def test_logprobs_travel_with_their_tokens_in_every_delta(sdk_stack: Stack) -> None:
    """Text prompts and stop strings make the target hold tokens back; logprobs stay aligned."""
    with Client(sdk_stack.target.address, timeout=120) as client:
        first = client.generate("Once upon a time", max_new_tokens=24, ignore_eos=True)
        assert len(first.text) > 12, first.text
        stop = first.text[8:12]
        with client.stream("Once upon a time", max_new_tokens=24, ignore_eos=True, stop_strings=[stop],
                           logprobs=0) as stream:  # fmt: skip
            deltas = list(stream)
    assert deltas[-1].finish_reason == FinishReason.STOP_STRING
    for delta in deltas:
        assert [lp.token_id for lp in delta.logprobs] == delta.token_ids
        assert all(lp.top == [] for lp in delta.logprobs)
    streamed = [t for d in deltas for t in d.token_ids]
    assert streamed == first.token_ids[: len(streamed)] and streamed


def test_logprobs_out_of_range_name_the_field(sdk_stack: Stack) -> None:
    with Client(sdk_stack.target.address) as client:
        for n in (-1, 21):
            with pytest.raises(specsplit.InvalidRequestError) as error:
                client.generate(PROMPT, logprobs=n, request_id=f"lp{n}")
            assert error.value.field == "logprobs" and error.value.request_id == f"lp{n}"
        assert client.generate(PROMPT, max_new_tokens=2).logprobs == []  # not asked: none sent


def test_stream_stopped_at_the_drain_timeout_is_unavailable(sdk_stack: Stack, tmp_path) -> None:
    """SIGTERM with a stream running past --drain-timeout: UnavailableError (retry elsewhere), not
    INTERNAL, carrying the request id and the tokens received before the stop."""
    target = start_target(sdk_stack.model, tmp_path, sdk_stack.draft, "--drain-timeout", "0.2",
                          "--max-context-length", "100000")  # fmt: skip
    with running(target):
        target.wait_ready(STARTUP_TIMEOUT_S)
        with Client(target.address) as client:
            max_new_tokens = client.model_info().max_context_length - len(PROMPT)
            stream = client.stream(PROMPT, max_new_tokens=max_new_tokens, ignore_eos=True)
            received: list[int] = []
            with pytest.raises(specsplit.UnavailableError) as error, stream:
                for delta in stream:
                    if not received:
                        target.signal(signal.SIGTERM)
                    received += delta.token_ids
        assert error.value.request_id == stream.request_id
        assert error.value.token_ids == received and 0 < len(received) < max_new_tokens
        assert "server stopped" in error.value.details
