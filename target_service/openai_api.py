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
gRPC API's; target_service/openai_protocol.py maps OpenAI's parameters, results and errors onto it. The
bearer token is the gRPC one: an HTTP request must carry it, and it is passed on.
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

import uvicorn
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from specsplit import AsyncClient
from specsplit.client import Delta
from specsplit.errors import APIError
from target_service.openai_protocol import (
    DEFAULT_CHAT_TOKENS,
    DEFAULT_COMPLETION_TOKENS,
    FINISH,
    MAX_COMPLETION_LOGPROBS,
    MAX_TOP_LOGPROBS,
    ChatShape,
    CompletionShape,
    OpenAIError,
    TokenText,
    chat_messages,
    completion_prompt,
    from_api_error,
    generate_options,
    invalid,
    typed,
    usage_json,
)

log = logging.getLogger("specsplit.http")


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


def error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def _handler(fn: Callable[[Gateway, Request], Awaitable[Response]], gateway: Gateway) -> Callable:
    async def endpoint(request: Request) -> Response:
        try:
            return await fn(gateway, request)
        except OpenAIError as error:
            return error_response(error)
        except APIError as error:
            return error_response(from_api_error(error))

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
    logprobs = typed(body, "logprobs", (int,), "an integer")
    if logprobs is not None:
        if not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
            raise invalid("logprobs", f"must be in [0, {MAX_COMPLETION_LOGPROBS}], got {logprobs}")
        options["logprobs"] = logprobs
    stream = gw.client.stream(completion_prompt(body), **options)
    return await respond(gw, body, stream, CompletionShape(gw.text, logprobs is not None))


async def chat_completions(gw: Gateway, request: Request) -> Response:
    body = await gw.body(request)
    default = await gw.default_chat_tokens()
    options = generate_options(body, default, ("max_tokens", "max_completion_tokens"))
    if typed(body, "logprobs", (bool,), "a boolean", False):
        top = typed(body, "top_logprobs", (int,), "an integer", 0)
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise invalid("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
        options["logprobs"] = top
    elif body.get("top_logprobs") is not None:
        raise invalid("top_logprobs", "needs logprobs: true")
    stream = gw.client.chat_stream(chat_messages(body), **options)
    return await respond(gw, body, stream, ChatShape(gw.text, "logprobs" in options))


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
    if not typed(body, "stream", (bool,), "a boolean", False):
        builder = stream.received
        if first.finish_reason is None:
            async for _ in deltas:
                pass
        result = builder.build()
        return JSONResponse(
            {**head, "object": shape.object, **shape.whole(result), "usage": usage_json(result.usage)}
        )
    options = typed(body, "stream_options", (dict,), "an object", {})
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
        return error_response(OpenAIError(status, f"{request.method} {request.url.path}: no such route"))

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
