"""Synchronous client of the specsplit target service, and the result types both clients share."""

from __future__ import annotations

import difflib
import numbers
import operator
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from enum import StrEnum
from types import TracebackType
from typing import Any, TypedDict, TypeVar, Unpack

import grpc
from grpc_health.v1 import health_pb2

from specsplit._channel import (
    DRAFT_INFO_METHOD,
    HEALTH_CHECK_METHOD,
    READY_POLL_S,
    TARGET_SERVICE,
    RetryPolicy,
    TLSConfig,
    auth_metadata,
    first_connect,
    sync_channel,
    unreachable_message,
    wrong_service_message,
)
from specsplit.errors import (
    APIError,
    ClientClosedError,
    DeadlineExceededError,
    InvalidRequestError,
    UnavailableError,
    WrongServiceError,
    error_from_rpc,
)
from specsplit.v1 import draft_pb2, sampling_pb2, target_pb2, target_pb2_grpc

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
    # Why nothing was drafted for a request that allowed it (e.g. "adaptive policy: draft cost exceeds
    # expected gain", "draft not connected"); empty when it was drafted for.
    speculation_note: str = ""

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens in [0, 1]; 0.0 when nothing was drafted (plain decoding, e.g. the
        draft was unreachable or `num_speculative_tokens=0`: check `drafted_tokens` to tell them apart)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @classmethod
    def from_proto(cls, msg: target_pb2.Usage) -> Usage:
        return cls(msg.prompt_tokens, msg.output_tokens, msg.drafted_tokens, msg.accepted_tokens, msg.steps,
                   msg.speculation_note)  # fmt: skip


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability under the distribution it was drawn from (the target's,
    after temperature, top-k and top-p; greedy: temperature 1, untruncated), and the `logprobs` most
    likely tokens as (token id, log-probability), most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]

    @classmethod
    def from_proto(cls, msg: target_pb2.TokenLogprob) -> TokenLogprob:
        return cls(msg.token_id, msg.logprob, list(zip(msg.top_token_ids, msg.top_logprobs)))


@dataclass(frozen=True)
class Delta:
    """One streamed message: the tokens new since the previous one. The last carries finish and usage."""

    request_id: str
    token_ids: list[int]
    # Empty when the target has no tokenizer, or while a multi-byte character / stop string is pending.
    text: str
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    # One per token of `token_ids` when the request asked for `logprobs`, else empty.
    logprobs: list[TokenLogprob] = field(default_factory=list)

    @classmethod
    def from_proto(cls, msg: target_pb2.GenerateResponse) -> Delta:
        finished = msg.finish_reason != target_pb2.FINISH_REASON_UNSPECIFIED
        return cls(
            request_id=msg.request_id,
            token_ids=list(msg.token_ids),
            text=msg.text,
            finish_reason=_FINISH_REASON_FROM_PROTO[msg.finish_reason] if finished else None,
            usage=Usage.from_proto(msg.usage) if msg.HasField("usage") else None,
            logprobs=[TokenLogprob.from_proto(lp) for lp in msg.logprobs],
        )


@dataclass(frozen=True)
class GenerateResult:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    usage: Usage
    # One per token of `token_ids` when the request asked for `logprobs`, else empty.
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class ResultBuilder:
    """Folds a stream of deltas into a `GenerateResult`."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def add(self, delta: Delta) -> None:
        self.token_ids.extend(delta.token_ids)
        self.text_parts.append(delta.text)
        self.logprobs.extend(delta.logprobs)
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.usage = delta.usage or self.usage
        self.request_id = delta.request_id or self.request_id

    def build(self) -> GenerateResult:
        if self.finish_reason is None or self.usage is None:
            raise RuntimeError(f"request {self.request_id}: stream ended without a finish reason and usage")
        return GenerateResult(
            self.request_id, self.token_ids, self.text, self.finish_reason, self.usage, self.logprobs
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
    speculation_policy: str  # "fixed" or "adaptive"
    draft_kind: str  # "local" (in the target process), "service" or "none"
    not_drafting_reason: str  # why the last step drafted nothing though allowed ("" while drafting)

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
    # Not Sequence[str]: a str is one, and "as" would mean the stops "a" and "s".
    stop_strings: list[str] | tuple[str, ...]
    num_speculative_tokens: int | None
    ignore_eos: bool
    request_id: str | None
    logprobs: int | None


OPTION_NAMES = frozenset(GenerateOptions.__optional_keys__)
# Names other clients use (openai, TGI) for options this SDK spells differently.
_OPTION_HINTS = {
    "stop": "stop_strings (text) or stop_token_ids (ids)",
    "max_tokens": "max_new_tokens",
    "top_logprobs": "logprobs",
    "stop_sequences": "stop_strings",
}


def _invalid(details: str) -> InvalidRequestError:
    return InvalidRequestError(grpc.StatusCode.INVALID_ARGUMENT, details)


def check_option_names(options: Mapping[str, object], method: str) -> None:
    """TypeError for a keyword that is not an option, as Python raises for a wrong call: an ignored
    `max_tokens=5` would silently generate 128 tokens."""
    for name in options:
        if name not in OPTION_NAMES:
            hint = _OPTION_HINTS.get(name) or next(iter(difflib.get_close_matches(name, OPTION_NAMES, 1)), "")
            more = f"; did you mean {hint}?" if hint else ""
            raise TypeError(f"{method}() got an unexpected keyword argument {name!r}{more}")


def _integer(name: str, value: object, non_negative: bool = False) -> int:
    # operator.index accepts numpy/torch integer scalars and refuses floats and strings.
    try:
        index = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}") from None
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected an int, got bool {value!r}")
    if non_negative and index < 0:
        raise _invalid(f"{name}: must be an int >= 0, got {value!r}")
    return index


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__} {value!r}")
    return float(value)


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__} {value!r}")
    return value


_T = TypeVar("_T")


def _items(name: str, value: object, item: Callable[[str, object], _T], what: str) -> list[_T]:
    """A list of items; a bare str/bytes (which would iterate as characters) or a scalar is refused."""
    if isinstance(value, str | bytes | bytearray) or not isinstance(value, Iterable):
        raise TypeError(f"{name}: expected a list of {what}, got {type(value).__name__} {value!r}")
    return [item(name, v) for v in value]


def _text(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected str, got {type(value).__name__} {value!r}")
    return value


def _token_id(name: str, value: object) -> int:
    return _integer(name, value, non_negative=True)


def build_request(prompt: str | Iterable[int], **options: Any) -> target_pb2.GenerateRequest:
    """The GenerateRequest for a text prompt or token ids.

    Call mistakes (an unknown keyword, a wrong type: `stop_strings="as"`, `b"hi"` as a prompt) raise
    TypeError naming the option; values the proto cannot hold (negative ids) raise InvalidRequestError
    naming the field; the server validates everything else.
    """
    check_option_names(options, "generate")
    request_id = options.get("request_id")
    request = target_pb2.GenerateRequest(
        request_id=_text("request_id", request_id) if request_id else uuid.uuid4().hex,
        max_new_tokens=_integer("max_new_tokens", options.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)),
        stop_token_ids=_items("stop_token_ids", options.get("stop_token_ids", ()), _token_id, "ints"),
        stop_strings=_items("stop_strings", options.get("stop_strings", ()), _text, "strings"),
        ignore_eos=_flag("ignore_eos", options.get("ignore_eos", False)),
        sampling=sampling_pb2.SamplingParams(
            temperature=_number("temperature", options.get("temperature", 0.0)),
            top_k=_integer("top_k", options.get("top_k", 0)),
        ),
    )
    if isinstance(prompt, str):
        request.text = prompt
    elif isinstance(prompt, bytes | bytearray | memoryview):
        raise TypeError("prompt: got bytes; pass text as str (decode it) or token ids as a list of ints")
    elif isinstance(prompt, Iterable) and not isinstance(prompt, Mapping):
        request.token_ids.ids.extend(_items("token_ids", prompt, _token_id, "ints"))
    else:
        raise TypeError(f"prompt: expected str or a list of token ids, got {type(prompt).__name__}")
    if (top_p := options.get("top_p")) is not None:
        request.sampling.top_p = _number("top_p", top_p)
    if (seed := options.get("seed")) is not None:
        request.sampling.seed = _integer("sampling.seed", seed, non_negative=True)
    if (num_speculative_tokens := options.get("num_speculative_tokens")) is not None:
        request.num_speculative_tokens = _integer("num_speculative_tokens", num_speculative_tokens)
    if (logprobs := options.get("logprobs")) is not None:
        request.logprobs = _integer("logprobs", logprobs)
    return request


ChatMessages = Sequence[Mapping[str, str]]  # [{"role": "user", "content": "..."}, ...]


def build_chat_request(
    messages: ChatMessages, **options: Unpack[GenerateOptions]
) -> target_pb2.GenerateRequest:
    """A GenerateRequest whose prompt is chat turns; the target renders its model's chat template.
    A wrong type raises TypeError naming `messages[i]`, as build_request does for its options."""
    raw: object = messages  # callers outside mypy pass anything
    if isinstance(raw, str | bytes) or not isinstance(raw, Sequence):
        raise TypeError(f"messages: expected a list of {{role, content}} dicts, got {type(raw).__name__}")
    request = build_request("", **options)
    chat = request.messages
    chat.SetInParent()  # selects the oneof's messages branch (an empty conversation stays one)
    for i, m in enumerate(messages):
        if (
            not isinstance(m, Mapping)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content", ""), str)
        ):
            raise TypeError(f"messages[{i}]: expected {{'role': str, 'content': str}}, got {m!r}")
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


def closed_error(target: str) -> ClientClosedError:
    return ClientClosedError(f"the client of {target} is closed; create a new one")


def unreachable(target: str, tls: TLSConfig | None) -> UnavailableError:
    return UnavailableError(grpc.StatusCode.UNAVAILABLE, unreachable_message(target, tls is not None))


def wrong_service(target: str, error: APIError) -> WrongServiceError:
    return WrongServiceError(
        error.code, wrong_service_message(target), error.request_id, error.token_ids, error.text
    )


def may_be_wrong_service(error: APIError) -> bool:
    """UNIMPLEMENTED: the server has no TargetService (NOT_FOUND: its health service knows no such name)."""
    return error.code in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.NOT_FOUND)


class ReadyWait:
    """wait_ready()'s clock and the last thing it saw, for both clients."""

    def __init__(self, target: str, timeout: float):
        self.target, self.timeout = target, timeout
        self.deadline = time.monotonic() + timeout
        self.last = "no answer yet"

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def saw(self, status: str | APIError) -> None:
        """A health status, or an UnavailableError / DeadlineExceededError of one check."""
        self.last = status if isinstance(status, str) else f"{status.code.name}: {status.details}"

    def pause(self) -> float:
        """Seconds to sleep before the next check; raises DeadlineExceededError once time is up."""
        left = self.left()
        if left <= 0:
            raise DeadlineExceededError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"{self.target} not ready after {self.timeout:g} s (last: {self.last})",
            )
        return min(READY_POLL_S, left)


class GenerateStream:
    """Iterator of `Delta`s for one generation. Leaving it early (the `with` block, a `break` out of the
    loop, an exception) cancels the RPC, so the server drops the request from its batch at once.
    A failure raises an `APIError` carrying `request_id` and the output streamed before it."""

    def __init__(
        self, call: Any, request_id: str, explain: Callable[[APIError], APIError] = lambda error: error
    ) -> None:
        self._call = call
        self.request_id = request_id
        self.received = ResultBuilder(request_id)  # what the stream has yielded so far
        self._explain = explain

    def __iter__(self) -> Iterator[Delta]:
        try:
            for msg in self._call:
                delta = Delta.from_proto(msg)
                self.received.add(delta)
                yield delta
        except grpc.RpcError as err:
            got = self.received
            raise self._explain(error_from_rpc(err, self.request_id, got.token_ids, got.text)) from None
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
    failing with UnavailableError; `wait_ready()` waits for a starting server to have loaded its model.
    A client that has never reached its server fails at once (UnavailableError) when the address
    refuses or does not resolve; once connected, UNAVAILABLE is retried with `retry`'s backoff.
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
        self.target = _text("target", target)
        self._settings = CallSettings(timeout, auth_metadata(auth_token), wait_for_ready)
        self._tls = resolve_tls(tls)
        self._channel = sync_channel(target, retry, self._tls, tuple(channel_options))
        self._stub = target_pb2_grpc.TargetServiceStub(self._channel)
        # grpc_health's stub is untyped; the typed multicallable is the same RPC.
        self._health_check = self._channel.unary_unary(
            HEALTH_CHECK_METHOD,
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        self._draft_info = self._channel.unary_unary(
            DRAFT_INFO_METHOD,
            request_serializer=draft_pb2.GetDraftInfoRequest.SerializeToString,
            response_deserializer=draft_pb2.GetDraftInfoResponse.FromString,
        )
        self._closed = False
        self._connected = False

    def _check_open(self, timeout: float | None = None) -> None:
        """Raises on a closed client, and on a first connection that fails (see the class docstring)."""
        if self._closed:
            raise closed_error(self.target)
        if self._connected or self._settings.wait_for_ready:
            return
        state = first_connect(self._channel, timeout if timeout is not None else self._settings.timeout)
        if state == grpc.ChannelConnectivity.TRANSIENT_FAILURE:
            raise unreachable(self.target, self._tls)
        self._connected = state == grpc.ChannelConnectivity.READY

    def _explain(self, error: APIError) -> APIError:
        """A target method unknown to the server: WrongServiceError when the server is a draft service."""
        if not may_be_wrong_service(error):
            return error
        try:
            self._draft_info(draft_pb2.GetDraftInfoRequest(), timeout=5, metadata=self._settings.metadata)
        except grpc.RpcError:
            return error
        return wrong_service(self.target, error)

    def stream(
        self, prompt: str | Iterable[int], *, timeout: float | None = None, **options: Unpack[GenerateOptions]
    ) -> GenerateStream:
        request = build_request(prompt, **options)
        self._check_open(timeout)
        call = self._stub.Generate(request, **self._settings.kwargs(timeout, unary=False))
        return GenerateStream(call, request.request_id, self._explain)

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
        self._check_open(timeout)
        call = self._stub.Generate(request, **self._settings.kwargs(timeout, unary=False))
        return GenerateStream(call, request.request_id, self._explain)

    def chat(
        self, messages: ChatMessages, *, timeout: float | None = None, **options: Unpack[GenerateOptions]
    ) -> GenerateResult:
        """The assistant's reply to `messages`; generation stops at the template's end-of-turn token."""
        with self.chat_stream(messages, timeout=timeout, **options) as stream:
            return collect(stream, stream.request_id)

    def abort(self, request_id: str, *, timeout: float | None = None) -> bool:
        """Abort a running or queued request; False when the server had no request with that id."""
        request = target_pb2.AbortRequest(request_id=_text("request_id", request_id))
        self._check_open(timeout)
        try:
            return self._stub.Abort(request, **self._settings.kwargs(timeout, unary=True)).found
        except grpc.RpcError as err:
            raise self._explain(error_from_rpc(err, request_id)) from None

    def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        self._check_open(timeout)
        try:
            request = target_pb2.GetModelInfoRequest()
            msg = self._stub.GetModelInfo(request, **self._settings.kwargs(timeout, unary=True))
        except grpc.RpcError as err:
            raise self._explain(error_from_rpc(err)) from None
        return ModelInfo.from_proto(msg)

    def health(self, service: str = TARGET_SERVICE, *, timeout: float | None = None) -> str:
        """The grpc.health.v1 status name of `service` ("" for the whole server): "SERVING", ..."""
        request = health_pb2.HealthCheckRequest(service=_text("service", service))
        self._check_open(timeout)
        try:
            msg = self._health_check(request, **self._settings.kwargs(timeout, unary=True))
        except grpc.RpcError as err:
            error = error_from_rpc(err)
            raise (self._explain(error) if service == TARGET_SERVICE else error) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(msg.status)

    def wait_ready(self, timeout: float = 300.0, service: str = TARGET_SERVICE) -> None:
        """Blocks until `service` reports SERVING: the target has loaded its model. A server that is not
        listening yet (its process starting) is waited for too. Raises DeadlineExceededError naming the
        last status seen after `timeout` seconds; a wrong token or service raises at once."""
        wait = ReadyWait(self.target, timeout)
        while True:
            try:
                status = self.health(service, timeout=max(min(wait.left(), 5.0), 0.05))
                if status == "SERVING":
                    return
                wait.saw(status)
            except (UnavailableError, DeadlineExceededError) as error:
                wait.saw(error)
            time.sleep(wait.pause())

    def close(self) -> None:
        """Close the channel (idempotent); later calls raise ClientClosedError."""
        self._closed = True
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
