"""asyncio client of the specsplit target service (grpc.aio); same surface as `specsplit.Client`.

A grpc.aio channel belongs to the event loop it was made in, so `AsyncClient` makes its channel lazily,
on the first call inside a running loop: the client itself can be built anywhere (module level, a
constructor, before `asyncio.run`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Unpack

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2

from specsplit._channel import (
    HEALTH_CHECK_METHOD,
    TARGET_SERVICE,
    RetryPolicy,
    TLSConfig,
    aio_channel,
    auth_metadata,
)
from specsplit.client import (
    CallSettings,
    ChatMessages,
    Delta,
    GenerateOptions,
    GenerateResult,
    ModelInfo,
    ResultBuilder,
    _text,
    build_chat_request,
    build_request,
    closed_error,
    resolve_tls,
)
from specsplit.errors import error_from_rpc
from specsplit.v1 import target_pb2, target_pb2_grpc


class AsyncGenerateStream:
    """Async iterator of `Delta`s. Leaving `async with` early, an exception, or cancelling the task that
    iterates cancels the RPC, so the server drops the request from its batch at once. A failure raises
    an `APIError` carrying `request_id` and the output streamed before it."""

    def __init__(self, call: Any, request_id: str) -> None:
        self._call = call
        self.request_id = request_id
        self.received = ResultBuilder(request_id)  # what the stream has yielded so far

    async def __aiter__(self) -> AsyncIterator[Delta]:
        try:
            async for msg in self._call:
                delta = Delta.from_proto(msg)
                self.received.add(delta)
                yield delta
        except grpc.aio.AioRpcError as err:
            got = self.received
            raise error_from_rpc(err, self.request_id, got.token_ids, got.text) from None
        finally:
            self.cancel()

    def cancel(self) -> None:
        """Cancel the RPC; a no-op once the stream has finished."""
        self._call.cancel()

    async def __aenter__(self) -> AsyncGenerateStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()


@dataclass
class _LoopChannel:
    """The channel and stubs of one event loop."""

    loop: asyncio.AbstractEventLoop
    channel: grpc.aio.Channel
    stub: target_pb2_grpc.TargetServiceAsyncStub
    health_check: Any


class AsyncClient:
    """asyncio twin of `specsplit.Client` (same arguments and methods, awaitable). Build it anywhere; its
    channel is made on the first call, in the running loop. Used from a second loop (a later
    `asyncio.run`), it makes a new channel there."""

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
        self._retry, self._tls, self._options = retry, resolve_tls(tls), tuple(channel_options)
        self._current: _LoopChannel | None = None
        self._closed = False

    def _open(self) -> _LoopChannel:
        if self._closed:
            raise closed_error(self.target)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError("AsyncClient: call its methods inside a running event loop") from None
        if self._current is None or self._current.loop is not loop:
            channel = aio_channel(self.target, self._retry, self._tls, self._options)
            # grpc_health's stub is untyped; the typed multicallable is the same RPC.
            health_check = channel.unary_unary(
                HEALTH_CHECK_METHOD,
                request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                response_deserializer=health_pb2.HealthCheckResponse.FromString,
            )
            stub = target_pb2_grpc.TargetServiceStub(channel)
            self._current = _LoopChannel(loop, channel, stub, health_check)
        return self._current

    def stream(
        self, prompt: str | Iterable[int], *, timeout: float | None = None, **options: Unpack[GenerateOptions]
    ) -> AsyncGenerateStream:
        request = build_request(prompt, **options)
        call = self._open().stub.Generate(request, **self._settings.kwargs(timeout, unary=False))
        return AsyncGenerateStream(call, request.request_id)

    async def generate(
        self, prompt: str | Iterable[int], *, timeout: float | None = None, **options: Unpack[GenerateOptions]
    ) -> GenerateResult:
        async with self.stream(prompt, timeout=timeout, **options) as stream:
            async for _ in stream:
                pass
            return stream.received.build()

    def chat_stream(
        self, messages: ChatMessages, *, timeout: float | None = None, **options: Unpack[GenerateOptions]
    ) -> AsyncGenerateStream:
        """Streams the assistant's reply to `messages` (rendered with the model's chat template)."""
        request = build_chat_request(messages, **options)
        call = self._open().stub.Generate(request, **self._settings.kwargs(timeout, unary=False))
        return AsyncGenerateStream(call, request.request_id)

    async def chat(
        self, messages: ChatMessages, *, timeout: float | None = None, **options: Unpack[GenerateOptions]
    ) -> GenerateResult:
        """The assistant's reply to `messages`; generation stops at the template's end-of-turn token."""
        async with self.chat_stream(messages, timeout=timeout, **options) as stream:
            async for _ in stream:
                pass
            return stream.received.build()

    async def abort(self, request_id: str, *, timeout: float | None = None) -> bool:
        """Abort a running or queued request; False when the server had no request with that id."""
        request = target_pb2.AbortRequest(request_id=_text("request_id", request_id))
        stub = self._open().stub
        try:
            response = await stub.Abort(request, **self._settings.kwargs(timeout, unary=True))
        except grpc.aio.AioRpcError as err:
            raise error_from_rpc(err, request_id) from None
        return response.found

    async def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        request = target_pb2.GetModelInfoRequest()
        stub = self._open().stub
        try:
            msg = await stub.GetModelInfo(request, **self._settings.kwargs(timeout, unary=True))
        except grpc.aio.AioRpcError as err:
            raise error_from_rpc(err) from None
        return ModelInfo.from_proto(msg)

    async def health(self, service: str = TARGET_SERVICE, *, timeout: float | None = None) -> str:
        """The grpc.health.v1 status name of `service` ("" for the whole server): "SERVING", ..."""
        request = health_pb2.HealthCheckRequest(service=_text("service", service))
        check = self._open().health_check
        try:
            msg = await check(request, **self._settings.kwargs(timeout, unary=True))
        except grpc.aio.AioRpcError as err:
            raise error_from_rpc(err) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(msg.status)

    async def close(self) -> None:
        """Close the channel (idempotent); later calls raise ClientClosedError."""
        self._closed = True
        current, self._current = self._current, None
        # A channel of another loop (an earlier asyncio.run) cannot be awaited from this one.
        if current is not None and current.loop is asyncio.get_running_loop():
            await current.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
