"""Synchronous client of the specsplit target service, and the result types both clients share."""

from __future__ import annotations

import operator
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from enum import StrEnum
from types import TracebackType
from typing import Any, TypedDict, Unpack

import grpc
from grpc_health.v1 import health_pb2

from specsplit._channel import (
    HEALTH_CHECK_METHOD,
    TARGET_SERVICE,
    RetryPolicy,
    TLSConfig,
    auth_metadata,
    sync_channel,
)
from specsplit.errors import InvalidRequestError, error_from_rpc
from specsplit.v1 import sampling_pb2, target_pb2, target_pb2_grpc

DEFAULT_MAX_NEW_TOKENS = 128
# Unary calls (abort, info, health) are quick; without any deadline a dead peer would hang them forever.
DEFAULT_UNARY_TIMEOUT_S = 30.0


class FinishReason(StrEnum):
    LENGTH = "length"
    EOS = "eos"
    STOP_TOKEN = "stop_token"
    STOP_STRING = "stop_string"
    ABORTED = "aborted"


_FINISH_REASON_FROM_PROTO = {
    target_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    target_pb2.FINISH_REASON_EOS: FinishReason.EOS,
    target_pb2.FINISH_REASON_STOP_TOKEN: FinishReason.STOP_TOKEN,
    target_pb2.FINISH_REASON_STOP_STRING: FinishReason.STOP_STRING,
    target_pb2.FINISH_REASON_ABORTED: FinishReason.ABORTED,
}


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    output_tokens: int
    drafted_tokens: int
    accepted_tokens: int
    steps: int

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / drafted tokens; None when nothing was drafted (e.g. the draft was unreachable)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None

    @classmethod
    def from_proto(cls, msg: target_pb2.Usage) -> Usage:
        return cls(msg.prompt_tokens, msg.output_tokens, msg.drafted_tokens, msg.accepted_tokens, msg.steps)


@dataclass(frozen=True)
class Delta:
    """One streamed message: the tokens new since the previous one. The last carries finish and usage."""

    request_id: str
    token_ids: list[int]
    # Empty when the target has no tokenizer, or while a multi-byte character / stop string is pending.
    text: str
    finish_reason: FinishReason | None = None
    usage: Usage | None = None

    @classmethod
    def from_proto(cls, msg: target_pb2.GenerateResponse) -> Delta:
        finished = msg.finish_reason != target_pb2.FINISH_REASON_UNSPECIFIED
        return cls(
            request_id=msg.request_id,
            token_ids=list(msg.token_ids),
            text=msg.text,
            finish_reason=_FINISH_REASON_FROM_PROTO[msg.finish_reason] if finished else None,
            usage=Usage.from_proto(msg.usage) if msg.HasField("usage") else None,
        )


@dataclass(frozen=True)
class GenerateResult:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    usage: Usage


@dataclass
class ResultBuilder:
    """Folds a stream of deltas into a `GenerateResult`."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    usage: Usage | None = None

    def add(self, delta: Delta) -> None:
        self.token_ids.extend(delta.token_ids)
        self.text_parts.append(delta.text)
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.usage = delta.usage or self.usage
        self.request_id = delta.request_id or self.request_id

    def build(self) -> GenerateResult:
        if self.finish_reason is None or self.usage is None:
            raise RuntimeError(f"request {self.request_id}: stream ended without a finish reason and usage")
        return GenerateResult(
            self.request_id, self.token_ids, "".join(self.text_parts), self.finish_reason, self.usage
        )


@dataclass(frozen=True)
class ModelInfo:
    target_model: str
    draft_model: str
    vocab_size: int
    target_tp_size: int
    draft_tp_size: int
    num_speculative_tokens: int
    max_speculative_tokens: int
    draft_method: str
    max_context_length: int
    max_batch_size: int
    max_queued_requests: int
    max_top_k: int
    draft_connected: bool
    eos_token_id: int | None  # None: the model has no end-of-sequence token
    dtype: str

    @classmethod
    def from_proto(cls, msg: target_pb2.GetModelInfoResponse) -> ModelInfo:
        values = {f.name: getattr(msg, f.name) for f in fields(cls)}
        if not msg.HasField("eos_token_id"):
            values["eos_token_id"] = None
        return cls(**values)


class GenerateOptions(TypedDict, total=False):
    """Keyword arguments of `generate` and `stream` on both clients."""

    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float | None
    seed: int | None
    stop_token_ids: Sequence[int]
    stop_strings: Sequence[str]
    num_speculative_tokens: int | None
    ignore_eos: bool
    request_id: str | None


def _invalid(details: str) -> InvalidRequestError:
    return InvalidRequestError(grpc.StatusCode.INVALID_ARGUMENT, details)


def _integer(name: str, value: int, non_negative: bool = False) -> int:
    # operator.index accepts numpy/torch integer scalars and refuses floats and strings.
    try:
        index = operator.index(value)
    except TypeError:
        raise _invalid(f"{name}: must be an int, got {value!r}") from None
    if isinstance(value, bool) or (non_negative and index < 0):
        raise _invalid(f"{name}: must be an int >= 0, got {value!r}")
    return index


def build_request(
    prompt: str | Iterable[int], **options: Unpack[GenerateOptions]
) -> target_pb2.GenerateRequest:
    """The GenerateRequest for a text prompt or token ids. Only what the proto cannot hold (negative or
    non-integer ids) is refused here, naming the field; the server validates the values."""
    request = target_pb2.GenerateRequest(
        request_id=options.get("request_id") or uuid.uuid4().hex,
        max_new_tokens=_integer("max_new_tokens", options.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)),
        stop_token_ids=[
            _integer("stop_token_ids", t, non_negative=True) for t in options.get("stop_token_ids", ())
        ],
        stop_strings=list(options.get("stop_strings", ())),
        ignore_eos=options.get("ignore_eos", False),
        sampling=sampling_pb2.SamplingParams(
            temperature=float(options.get("temperature", 0.0)),
            top_k=_integer("sampling.top_k", options.get("top_k", 0)),
        ),
    )
    if isinstance(prompt, str):
        request.text = prompt
    elif isinstance(prompt, Iterable):
        request.token_ids.ids.extend([_integer("token_ids", t, non_negative=True) for t in prompt])
    else:
        raise _invalid(f"prompt: expected str or token ids, got {type(prompt).__name__}")
    top_p = options.get("top_p")
    if top_p is not None:
        request.sampling.top_p = float(top_p)
    seed = options.get("seed")
    if seed is not None:
        request.sampling.seed = _integer("sampling.seed", seed, non_negative=True)
    num_speculative_tokens = options.get("num_speculative_tokens")
    if num_speculative_tokens is not None:
        request.num_speculative_tokens = _integer("num_speculative_tokens", num_speculative_tokens)
    return request


ChatMessages = Sequence[Mapping[str, str]]  # [{"role": "user", "content": "..."}, ...]


def build_chat_request(
    messages: ChatMessages, **options: Unpack[GenerateOptions]
) -> target_pb2.GenerateRequest:
    """A GenerateRequest whose prompt is chat turns; the target renders its model's chat template."""
    raw: object = messages  # callers outside mypy pass anything
    if isinstance(raw, (str, bytes)) or not isinstance(raw, Sequence):
        raise _invalid(f"messages: expected a list of {{role, content}} dicts, got {type(messages).__name__}")
    request = build_request("", **options)
    chat = request.messages
    chat.SetInParent()  # selects the oneof's messages branch (an empty conversation stays one)
    for i, m in enumerate(messages):
        if (
            not isinstance(m, Mapping)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content", ""), str)
        ):
            raise _invalid(f"messages[{i}]: expected {{'role': str, 'content': str}}, got {m!r}")
        chat.messages.add(role=m["role"], content=m.get("content", ""))
    return request


def resolve_tls(tls: TLSConfig | bool | None) -> TLSConfig | None:
    if tls is True:
        return TLSConfig()
    return tls or None


def collect(deltas: Iterable[Delta], request_id: str) -> GenerateResult:
    builder = ResultBuilder(request_id)
    for delta in deltas:
        builder.add(delta)
    return builder.build()


@dataclass(frozen=True)
class CallSettings:
    """What every call of a client carries: default deadline, auth metadata, wait-for-ready."""

    timeout: float | None
    metadata: tuple[tuple[str, str], ...]
    wait_for_ready: bool

    def kwargs(self, timeout: float | None, unary: bool) -> dict[str, Any]:
        deadline = timeout if timeout is not None else self.timeout
        if deadline is None and unary:
            deadline = DEFAULT_UNARY_TIMEOUT_S
        return {"timeout": deadline, "metadata": self.metadata, "wait_for_ready": self.wait_for_ready}


class GenerateStream:
    """Iterator of `Delta`s for one generation. Leaving it early (the `with` block, a `break` out of the
    loop, an exception) cancels the RPC, so the server drops the request from its batch at once."""

    def __init__(self, call: Any, request_id: str) -> None:
        self._call = call
        self.request_id = request_id

    def __iter__(self) -> Iterator[Delta]:
        try:
            for msg in self._call:
                yield Delta.from_proto(msg)
        except grpc.RpcError as err:
            raise error_from_rpc(err) from None
        finally:
            self.cancel()

    def cancel(self) -> None:
        """Cancel the RPC; a no-op once the stream has finished."""
        self._call.cancel()

    def __enter__(self) -> GenerateStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


class Client:
    """Blocking client of a specsplit target service.

    `target` is a gRPC target: `host:port`, or `dns:///name:port` to spread calls round-robin over every
    address of a headless Kubernetes service. `timeout` is the default deadline in seconds of every call
    (None: no deadline for generations, 30 s for unary calls); each method takes its own `timeout` too.
    `tls=True` uses the system roots; a `TLSConfig` sets roots, a client certificate (mTLS) and the server
    name. `auth_token` is sent as `authorization: Bearer <token>`. `retry=None` turns retries off;
    `wait_for_ready=True` makes calls wait (up to their deadline) for an unreachable server instead of
    failing with UnavailableError.
    """

    def __init__(
        self,
        target: str,
        *,
        timeout: float | None = None,
        tls: TLSConfig | bool | None = None,
        auth_token: str | None = None,
        retry: RetryPolicy | None = RetryPolicy(),  # noqa: B008 (frozen dataclass)
        wait_for_ready: bool = False,
        channel_options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self.target = target
        self._settings = CallSettings(timeout, auth_metadata(auth_token), wait_for_ready)
        self._channel = sync_channel(target, retry, resolve_tls(tls), tuple(channel_options))
        self._stub = target_pb2_grpc.TargetServiceStub(self._channel)
        # grpc_health's stub is untyped; the typed multicallable is the same RPC.
        self._health_check = self._channel.unary_unary(
            HEALTH_CHECK_METHOD,
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )

    def stream(
        self, prompt: str | Iterable[int], *, timeout: float | None = None, **options: Unpack[GenerateOptions]
    ) -> GenerateStream:
        request = build_request(prompt, **options)
        call = self._stub.Generate(request, **self._settings.kwargs(timeout, unary=False))
        return GenerateStream(call, request.request_id)

    def generate(
        self, prompt: str | Iterable[int], *, timeout: float | None = None, **options: Unpack[GenerateOptions]
    ) -> GenerateResult:
        with self.stream(prompt, timeout=timeout, **options) as stream:
            return collect(stream, stream.request_id)

    def chat_stream(
        self, messages: ChatMessages, *, timeout: float | None = None, **options: Unpack[GenerateOptions]
    ) -> GenerateStream:
        """Streams the assistant's reply to `messages` (rendered with the model's chat template)."""
        request = build_chat_request(messages, **options)
        call = self._stub.Generate(request, **self._settings.kwargs(timeout, unary=False))
        return GenerateStream(call, request.request_id)

    def chat(
        self, messages: ChatMessages, *, timeout: float | None = None, **options: Unpack[GenerateOptions]
    ) -> GenerateResult:
        """The assistant's reply to `messages`; generation stops at the template's end-of-turn token."""
        with self.chat_stream(messages, timeout=timeout, **options) as stream:
            return collect(stream, stream.request_id)

    def abort(self, request_id: str, *, timeout: float | None = None) -> bool:
        """Abort a running or queued request; False when the server had no request with that id."""
        request = target_pb2.AbortRequest(request_id=request_id)
        try:
            return self._stub.Abort(request, **self._settings.kwargs(timeout, unary=True)).found
        except grpc.RpcError as err:
            raise error_from_rpc(err) from None

    def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        try:
            request = target_pb2.GetModelInfoRequest()
            msg = self._stub.GetModelInfo(request, **self._settings.kwargs(timeout, unary=True))
        except grpc.RpcError as err:
            raise error_from_rpc(err) from None
        return ModelInfo.from_proto(msg)

    def health(self, service: str = TARGET_SERVICE, *, timeout: float | None = None) -> str:
        """The grpc.health.v1 status name of `service` ("" for the whole server): "SERVING", ..."""
        request = health_pb2.HealthCheckRequest(service=service)
        try:
            msg = self._health_check(request, **self._settings.kwargs(timeout, unary=True))
        except grpc.RpcError as err:
            raise error_from_rpc(err) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(msg.status)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
