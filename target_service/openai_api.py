"""An OpenAI-compatible HTTP API in the target process: /v1/models, /v1/completions, /v1/chat/completions
(streamed as server-sent events or not), /health and /metrics' HTTP counters.

Built on Starlette, served by uvicorn. Starlette rather than FastAPI: the API is five routes of JSON and
one kind of event stream, and its errors must take OpenAI's shape with the offending parameter named;
FastAPI's pydantic validation answers 422 in a shape of its own that would have to be overridden route by
route, and would add pydantic to the server's dependencies for nothing. Both run on the same ASGI stack
(FastAPI is Starlette underneath); uvicorn is the ASGI server both recommend.

It is a gateway over the gRPC API, not a second path into the scheduler: each HTTP request becomes one
Generate call through the SDK's AsyncClient on a Unix socket of the target's own gRPC server. Validation,
admission, cancellation (a client that disconnects cancels its RPC), auth and the gRPC metrics are the
gRPC API's; this module maps OpenAI's parameters and errors onto it. The bearer token is the gRPC one:
an HTTP request must carry it, and it is passed on.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import uvicorn
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from specsplit import AsyncClient, FinishReason, GenerateResult, Usage
from specsplit.client import Delta, TokenLogprob
from specsplit.errors import APIError, InvalidRequestError

log = logging.getLogger("specsplit.http")

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

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


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
def _typed(body: dict[str, Any], name: str, types: tuple[type, ...], what: str, default: Any = None) -> Any:
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
    n = _typed(body, "n", (int,), "an integer", 1)
    if n != 1:
        raise invalid("n", f"only n=1 is supported, got {n}")
    max_tokens = default_tokens
    for name in max_tokens_names:
        if body.get(name) is not None:
            max_tokens = _typed(body, name, (int,), "an integer")
            if max_tokens < 1:
                raise invalid(name, f"must be >= 1, got {max_tokens}")
    options: dict[str, Any] = {
        "max_new_tokens": max_tokens,
        "temperature": float(_typed(body, "temperature", (int, float), "a number", 1.0)),
        "stop_strings": _stop(body),
    }
    top_p = _typed(body, "top_p", (int, float), "a number")
    if top_p is not None:
        options["top_p"] = float(top_p)
    seed = _typed(body, "seed", (int,), "an integer")
    if seed is not None:
        if seed < 0:
            raise invalid("seed", f"must be >= 0, got {seed}")
        options["seed"] = seed
    k = _typed(body, "num_speculative_tokens", (int,), "an integer")  # extension (extra_body)
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


# -- metrics ---------------------------------------------------------------------------------------------
class HTTPMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY):
        self.requests = Counter(
            "specsplit_http_requests",
            "OpenAI-compatible HTTP API: requests by route and HTTP status.",
            ("route", "status"),
            registry=registry,
        )
        self.duration = Histogram(
            "specsplit_http_request_duration_seconds",
            "OpenAI-compatible HTTP API: request start to the end of its response (a stream's last event).",
            ("route",),
            registry=registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
        )


ROUTES = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health")


class MetricsMiddleware:
    """Counts each response by route (one of ROUTES, else "other": no label per unknown path) and status."""

    def __init__(self, app: Any, metrics: HTTPMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in ROUTES else "other"
        start, status = time.perf_counter(), [500]

        async def counted(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counted)
        finally:
            self.metrics.requests.labels(route, str(status[0])).inc()
            self.metrics.duration.labels(route).observe(time.perf_counter() - start)


# -- the app ---------------------------------------------------------------------------------------------
@dataclass
class Gateway:
    """The routes' state: the gRPC client of this target, its served name, the token."""

    client: AsyncClient
    model: str
    token: str | None
    text: TokenText = field(default_factory=TokenText)
    created: int = field(default_factory=lambda: int(time.time()))
    chat_tokens: int = 0  # chat's default max_tokens, once the context length is known

    async def default_chat_tokens(self) -> int:
        if not self.chat_tokens:
            context = (await self.client.model_info()).max_context_length
            self.chat_tokens = max(1, min(DEFAULT_CHAT_TOKENS, context // 2))
        return self.chat_tokens

    def check_auth(self, request: Request) -> None:
        if self.token is None:
            return
        if request.headers.get("authorization", "") != f"Bearer {self.token}":
            raise OpenAIError(401, "authorization: missing or invalid bearer token", None,
                              "authentication_error", "invalid_api_key")  # fmt: skip

    def check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is not None and model != self.model:
            raise OpenAIError(404, f"model: {model!r} is not served here (this server serves {self.model!r})",
                              "model", "invalid_request_error", "model_not_found")  # fmt: skip

    async def body(self, request: Request) -> dict[str, Any]:
        self.check_auth(request)
        try:
            body = await request.json()
        except ValueError:
            raise OpenAIError(400, "body: not valid JSON") from None
        if not isinstance(body, dict):
            raise OpenAIError(400, "body: expected a JSON object")
        self.check_model(body)
        return body


def _handler(fn: Callable[[Gateway, Request], Awaitable[Response]], gateway: Gateway) -> Callable:
    async def endpoint(request: Request) -> Response:
        try:
            return await fn(gateway, request)
        except OpenAIError as error:
            return error.response()
        except APIError as error:
            return from_api_error(error).response()

    return endpoint


async def list_models(gw: Gateway, request: Request) -> Response:
    gw.check_auth(request)
    model = {"id": gw.model, "object": "model", "created": gw.created, "owned_by": "specsplit"}
    return JSONResponse({"object": "list", "data": [model]})


async def health(gw: Gateway, request: Request) -> Response:
    status = await gw.client.health()
    return JSONResponse({"status": status}, status_code=200 if status == "SERVING" else 503)


async def completions(gw: Gateway, request: Request) -> Response:
    body = await gw.body(request)
    options = generate_options(body, DEFAULT_COMPLETION_TOKENS, ("max_tokens",))
    logprobs = _typed(body, "logprobs", (int,), "an integer")
    if logprobs is not None:
        if not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
            raise invalid("logprobs", f"must be in [0, {MAX_COMPLETION_LOGPROBS}], got {logprobs}")
        options["logprobs"] = logprobs
    stream = gw.client.stream(completion_prompt(body), **options)
    return await respond(gw, body, stream, CompletionShape(gw, logprobs is not None))


async def chat_completions(gw: Gateway, request: Request) -> Response:
    body = await gw.body(request)
    default = await gw.default_chat_tokens()
    options = generate_options(body, default, ("max_tokens", "max_completion_tokens"))
    if _typed(body, "logprobs", (bool,), "a boolean", False):
        top = _typed(body, "top_logprobs", (int,), "an integer", 0)
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise invalid("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
        options["logprobs"] = top
    elif body.get("top_logprobs") is not None:
        raise invalid("top_logprobs", "needs logprobs: true")
    stream = gw.client.chat_stream(chat_messages(body), **options)
    return await respond(gw, body, stream, ChatShape(gw, "logprobs" in options))


class CompletionShape:
    """The JSON of /v1/completions: whole and as chunks."""

    object, chunk_object, prefix = "text_completion", "text_completion", "cmpl-"

    def __init__(self, gw: Gateway, logprobs: bool):
        self.gw, self.logprobs, self.offset = gw, logprobs, 0

    def choice(self, text: str, lps: list[TokenLogprob], finish: str | None) -> dict[str, Any]:
        out: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        if self.logprobs:
            out["logprobs"] = completion_logprobs(lps, self.gw.text, self.offset)
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

    def __init__(self, gw: Gateway, logprobs: bool):
        self.gw, self.logprobs = gw, logprobs

    def _lps(self, lps: list[TokenLogprob]) -> dict[str, Any] | None:
        return chat_logprobs(lps, self.gw.text) if self.logprobs else None

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


async def respond(
    gw: Gateway, body: dict[str, Any], stream: Any, shape: CompletionShape | ChatShape
) -> Response:
    """The whole response, or an event stream. A stream's first message is awaited before the response
    starts, so a request the target refuses gets its HTTP status (400, 429, 503), not a 200 and an error
    event; a failure after that is one error event (OpenAI's error shape) before the stream ends."""
    head = {"id": shape.prefix + uuid.uuid4().hex, "created": int(time.time()), "model": gw.model}
    deltas = stream.__aiter__()
    try:
        first = await deltas.__anext__()
    except StopAsyncIteration:
        raise OpenAIError(500, "the target ended the stream without a result") from None
    if not _typed(body, "stream", (bool,), "a boolean", False):
        builder = stream.received
        if first.finish_reason is None:
            async for _ in deltas:
                pass
        result = builder.build()
        return JSONResponse(
            {**head, "object": shape.object, **shape.whole(result), "usage": usage_json(result.usage)}
        )
    options = _typed(body, "stream_options", (dict,), "an object", {})
    include_usage = bool(options.get("include_usage"))

    def event(payload: dict[str, Any]) -> str:
        return f"data: {json.dumps({**head, 'object': shape.chunk_object, **payload})}\n\n"

    async def events() -> AsyncIterator[str]:
        try:
            for payload in shape.first():
                yield event(payload)
            delta: Delta | None = first
            while delta is not None:
                finish = FINISH[delta.finish_reason] if delta.finish_reason is not None else None
                if delta.token_ids or delta.text or finish is not None:
                    yield event(shape.chunk(delta, finish))
                if finish is not None:
                    if include_usage:
                        yield event({"choices": [], "usage": usage_json(delta.usage)})
                    break
                delta = await anext(deltas, None)
            yield "data: [DONE]\n\n"
        except APIError as error:
            yield f"data: {json.dumps(from_api_error(error).body())}\n\n"
        finally:
            stream.cancel()  # a client that left: the RPC is cancelled, its slot freed

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})  # fmt: skip


def build_app(gateway: Gateway, metrics: HTTPMetrics) -> Any:
    routes = [
        Route("/v1/models", _handler(list_models, gateway), methods=["GET"]),
        Route("/v1/completions", _handler(completions, gateway), methods=["POST"]),
        Route("/v1/chat/completions", _handler(chat_completions, gateway), methods=["POST"]),
        Route("/health", _handler(health, gateway), methods=["GET"]),
    ]

    async def not_found(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        return OpenAIError(status, f"{request.method} {request.url.path}: no such route").response()

    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found})
    return MetricsMiddleware(app, metrics)


# -- serving ---------------------------------------------------------------------------------------------
class HTTPFront:
    """uvicorn on its own thread and event loop, bound at once (before the model loads: requests then get
    503 "the model is loading" from the gRPC API behind it)."""

    def __init__(self, host: str, port: int, grpc_target: str, model: str, token: str | None,
                 registry: CollectorRegistry = REGISTRY):  # fmt: skip
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError as exc:
            self.sock.close()
            raise ValueError(f"--http-port: cannot bind {host}:{port}: {exc.strerror}") from None
        self.port = int(self.sock.getsockname()[1])
        self.gateway = Gateway(AsyncClient(grpc_target, auth_token=token), model, token)
        app = build_app(self.gateway, HTTPMetrics(registry))
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="http", daemon=True)  # fmt: skip

    def start(self) -> None:
        self.thread.start()
        log.info("OpenAI-compatible HTTP API on port %d", self.port)
        print(f"SPECSPLIT_HTTP port={self.port}", flush=True)  # launchers that passed --http-port 0

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()
