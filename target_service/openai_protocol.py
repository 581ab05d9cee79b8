"""OpenAI's API in terms of specsplit's: request bodies to the SDK's generate options, results to
OpenAI's JSON (whole and as stream chunks, usage with the speculation fields, logprobs), and gRPC errors
to OpenAI's error shape and HTTP status. No I/O here: target_service/openai_api.py serves it."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from specsplit import FinishReason, GenerateResult, Usage
from specsplit.client import Delta, TokenLogprob
from specsplit.errors import APIError, InvalidRequestError

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
DEFAULT_CHAT_TOKENS = 512  # at most half the context: the prompt needs room too
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
# OpenAI parameters this server cannot honour: refused by name rather than silently ignored, unless at
# their no-op value.
UNSUPPORTED = {
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "logit_bias": None,
    "best_of": 1,
    "echo": False,
    "suffix": None,
    "tools": None,
    "functions": None,
    "response_format": None,
}
# The gRPC field in an INVALID_ARGUMENT message -> the OpenAI parameter.
PARAM_OF_FIELD = {
    "max_new_tokens": "max_tokens",
    "stop_strings": "stop",
    "sampling.temperature": "temperature",
    "sampling.top_p": "top_p",
    "sampling.seed": "seed",
    "text": "prompt",
    "token_ids": "prompt",
    "prompt": "prompt",
    "num_speculative_tokens": "num_speculative_tokens",
}
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}
FINISH = {
    FinishReason.LENGTH: "length",
    FinishReason.EOS: "stop",
    FinishReason.STOP_TOKEN: "stop",
    FinishReason.STOP_STRING: "stop",
    FinishReason.ABORTED: "stop",
}


class OpenAIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "", code: str = ""):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")
        self.code = code or None

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, f"{param}: {message}", param)


def from_api_error(error: APIError) -> OpenAIError:
    status, type_ = HTTP_STATUS.get(error.code, (500, "server_error"))
    param, message = None, error.details
    if isinstance(error, InvalidRequestError) and error.field:
        param = PARAM_OF_FIELD.get(error.field, error.field)
        message = message.replace(error.field, param)  # "max_new_tokens: ..." -> "max_tokens: ..."
    return OpenAIError(status, message, param, type_, error.code.name.lower())


# -- request parsing -------------------------------------------------------------------------------------
def typed(body: dict[str, Any], name: str, types: tuple[type, ...], what: str, default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in types:
        raise invalid(name, f"expected {what}, got {json.dumps(value)}")
    if not isinstance(value, types):
        raise invalid(name, f"expected {what}, got {json.dumps(value)[:80]}")
    return value


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise invalid("stop", "expected a string or a list of strings")


def generate_options(body: dict[str, Any], default_tokens: int, max_tokens_names: tuple[str, ...]) -> dict:
    """The SDK's generate options from an OpenAI body (both endpoints)."""
    for name, neutral in UNSUPPORTED.items():
        if name in body and body[name] not in (neutral, None):
            raise invalid(name, "not supported by this server")
    n = typed(body, "n", (int,), "an integer", 1)
    if n != 1:
        raise invalid("n", f"only n=1 is supported, got {n}")
    max_tokens = default_tokens
    for name in max_tokens_names:
        if body.get(name) is not None:
            max_tokens = typed(body, name, (int,), "an integer")
            if max_tokens < 1:
                raise invalid(name, f"must be >= 1, got {max_tokens}")
    options: dict[str, Any] = {
        "max_new_tokens": max_tokens,
        "temperature": float(typed(body, "temperature", (int, float), "a number", 1.0)),
        "stop_strings": _stop(body),
    }
    top_p = typed(body, "top_p", (int, float), "a number")
    if top_p is not None:
        options["top_p"] = float(top_p)
    seed = typed(body, "seed", (int,), "an integer")
    if seed is not None:
        if seed < 0:
            raise invalid("seed", f"must be >= 0, got {seed}")
        options["seed"] = seed
    k = typed(body, "num_speculative_tokens", (int,), "an integer")  # extension (extra_body)
    if k is not None:
        options["num_speculative_tokens"] = k
    return options


def completion_prompt(body: dict[str, Any]) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return prompt
    raise invalid(
        "prompt",
        "expected a string or a list of token ids (one prompt: n and batches of prompts are not supported)",
    )


def chat_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "expected a non-empty list of {role, content}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise invalid(f"messages[{i}]", "expected an object with a string role")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):  # content parts: text only
            parts = []
            for part in content:
                if (
                    not isinstance(part, dict)
                    or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)
                ):
                    raise invalid(f"messages[{i}].content", "only text content parts are supported")
                parts.append(part["text"])
            content = "".join(parts)
        elif not isinstance(content, str):
            raise invalid(f"messages[{i}].content", "expected a string or a list of text parts")
        out.append({"role": m["role"], "content": content})
    return out


# -- responses -------------------------------------------------------------------------------------------
def usage_json(usage: Usage | None) -> dict[str, Any] | None:
    """OpenAI's usage plus the speculation fields."""
    if usage is None:
        return None
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.output_tokens,
        "total_tokens": usage.prompt_tokens + usage.output_tokens,
        "drafted_tokens": usage.drafted_tokens,
        "accepted_tokens": usage.accepted_tokens,
        "acceptance_rate": usage.acceptance_rate,
        "verify_steps": usage.steps,
        "speculation_note": usage.speculation_note,
    }


@dataclass
class TokenText:
    """Token id -> its text (logprobs name tokens), from the target's tokenizer once it is loaded."""

    decode: Callable[[list[int]], str] | None = None

    def __call__(self, token_id: int) -> str:
        return self.decode([token_id]) if self.decode is not None else f"<{token_id}>"


def chat_logprobs(lps: list[TokenLogprob], text: TokenText) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        s = text(token_id)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode())}

    return {"content": [entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in lps]}  # fmt: skip


def completion_logprobs(lps: list[TokenLogprob], text: TokenText, offset: int = 0) -> dict[str, Any]:
    tokens = [text(lp.token_id) for lp in lps]
    offsets = []
    for s in tokens:
        offsets.append(offset)
        offset += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{text(t): v for t, v in lp.top} for lp in lps],
        "text_offset": offsets,
    }


class CompletionShape:
    """The JSON of /v1/completions: whole and as chunks."""

    object, chunk_object, prefix = "text_completion", "text_completion", "cmpl-"

    def __init__(self, text: TokenText, logprobs: bool):
        self.text, self.logprobs, self.offset = text, logprobs, 0

    def choice(self, text: str, lps: list[TokenLogprob], finish: str | None) -> dict[str, Any]:
        out: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        if self.logprobs:
            out["logprobs"] = completion_logprobs(lps, self.text, self.offset)
            self.offset += sum(len(t) for t in out["logprobs"]["tokens"])
        return out

    def whole(self, result: GenerateResult) -> dict[str, Any]:
        return {"choices": [self.choice(result.text, result.logprobs, FINISH[result.finish_reason])]}

    def first(self) -> list[dict[str, Any]]:
        return []

    def chunk(self, delta: Delta, finish: str | None) -> dict[str, Any]:
        return {"choices": [self.choice(delta.text, delta.logprobs, finish)]}


class ChatShape:
    """The JSON of /v1/chat/completions: whole and as chunks."""

    object, chunk_object, prefix = "chat.completion", "chat.completion.chunk", "chatcmpl-"

    def __init__(self, text: TokenText, logprobs: bool):
        self.text, self.logprobs = text, logprobs

    def _lps(self, lps: list[TokenLogprob]) -> dict[str, Any] | None:
        return chat_logprobs(lps, self.text) if self.logprobs else None

    def whole(self, result: GenerateResult) -> dict[str, Any]:
        message = {"role": "assistant", "content": result.text}
        choice = {"index": 0, "message": message, "logprobs": self._lps(result.logprobs),
                  "finish_reason": FINISH[result.finish_reason]}  # fmt: skip
        return {"choices": [choice]}

    def first(self) -> list[dict[str, Any]]:
        """The role comes first, in a chunk of its own (as OpenAI sends it)."""
        delta = {"role": "assistant", "content": ""}
        return [{"choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]}]

    def chunk(self, delta: Delta, finish: str | None) -> dict[str, Any]:
        content = {"content": delta.text} if delta.text or finish is None else {}
        return {"choices": [{"index": 0, "delta": content, "logprobs": self._lps(delta.logprobs),
                             "finish_reason": finish}]}  # fmt: skip
