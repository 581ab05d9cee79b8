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
    DRAFT_INFO_METHOD,
    HEALTH_CHECK_METHOD,
    TARGET_SERVICE,
    RetryPolicy,
    TLSConfig,
    aio_channel,
    auth_metadata,
    first_connect_aio,
)
from specsplit.client import (
    CallSettings,
    ChatMessages,
    Delta,
    GenerateOptions,
    GenerateResult,
    ModelInfo,
    ReadyWait,
    ResultBuilder,
    _text,
    build_chat_request,
    build_request,
    closed_error,
    may_be_wrong_service,
    resolve_tls,
    unreachable,
    wrong_service,
)
from specsplit.errors import APIError, DeadlineExceededError, UnavailableError, error_from_rpc
from specsplit.v1 import draft_pb2, target_pb2, target_pb2_grpc


class AsyncGenerateStream:
    """Async iterator of `Delta`s. Leaving `async with` early, an exception, or cancelling the task that
    iterates cancels the RPC, so the server drops the request from its batch at once. A failure raises
    an `APIError` carrying `request_id` and the output streamed before it."""

    def __init__(self, call: Any, request_id: str, client: AsyncClient | None = None) -> None:
        self._call = call
        self.request_id = request_id
        self.received = ResultBuilder(request_id)  # what the stream has yielded so far
        self._client = client

    async def __aiter__(self) -> AsyncIterator[Delta]:
        try:
            if self._client is not None:
                await self._client._check_connected(None)
            async for msg in self._call:
                delta = Delta.from_proto(msg)
                self.received.add(delta)
                yield delta
        except grpc.aio.AioRpcError as err:
            got = self.received
            error = error_from_rpc(err, self.request_id, got.token_ids, got.text)
            raise (await self._client._explain(error) if self._client else error) from None
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
    draft_info: Any
    connected: bool = False


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
            draft_info = channel.unary_unary(
                DRAFT_INFO_METHOD,
                request_serializer=draft_pb2.GetDraftInfoRequest.SerializeToString,
                response_deserializer=draft_pb2.GetDraftInfoResponse.FromString,
            )
            stub = target_pb2_grpc.TargetServiceStub(channel)
            self._current = _LoopChannel(loop, channel, stub, health_check, draft_info)
        return self._current

    async def _check_connected(self, timeout: float | None) -> None:
        """A first connection that fails raises UnavailableError at once (as `Client` does)."""
        current = self._open()
        if current.connected or self._settings.wait_for_ready:
            return
        wait = timeout if timeout is not None else self._settings.timeout
        state = await first_connect_aio(current.channel, wait)
        if state == grpc.ChannelConnectivity.TRANSIENT_FAILURE:
            raise unreachable(self.target, self._tls)
        current.connected = state == grpc.ChannelConnectivity.READY

    async def _explain(self, error: APIError) -> APIError:
        """A target method unknown to the server: WrongServiceError when the server is a draft service."""
        if not may_be_wrong_service(error):
            return error
        try:
            probe = self._open().draft_info(draft_pb2.GetDraftInfoRequest(), timeout=5,
                                            metadata=self._settings.metadata)  # fmt: skip
            await probe
        except grpc.aio.AioRpcError:
            return error
        return wrong_service(self.target, error)

    def stream(
        self, prompt: str | Iterable[int], *, timeout: float | None = None, **options: Unpack[GenerateOptions]
    ) -> AsyncGenerateStream:
        request = build_request(prompt, **options)
        call = self._open().stub.Generate(request, **self._settings.kwargs(timeout, unary=False))
        return AsyncGenerateStream(call, request.request_id, self)

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
        return AsyncGenerateStream(call, request.request_id, self)

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
        await self._check_connected(timeout)
        stub = self._open().stub
        try:
            response = await stub.Abort(request, **self._settings.kwargs(timeout, unary=True))
        except grpc.aio.AioRpcError as err:
            raise await self._explain(error_from_rpc(err, request_id)) from None
        return response.found

    async def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        request = target_pb2.GetModelInfoRequest()
        await self._check_connected(timeout)
        stub = self._open().stub
        try:
            msg = await stub.GetModelInfo(request, **self._settings.kwargs(timeout, unary=True))
        except grpc.aio.AioRpcError as err:
            raise await self._explain(error_from_rpc(err)) from None
        return ModelInfo.from_proto(msg)

    async def health(self, service: str = TARGET_SERVICE, *, timeout: float | None = None) -> str:
        """The grpc.health.v1 status name of `service` ("" for the whole server): "SERVING", ..."""
        request = health_pb2.HealthCheckRequest(service=_text("service", service))
        await self._check_connected(timeout)
        check = self._open().health_check
        try:
            msg = await check(request, **self._settings.kwargs(timeout, unary=True))
        except grpc.aio.AioRpcError as err:
            error = error_from_rpc(err)
            raise (await self._explain(error) if service == TARGET_SERVICE else error) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(msg.status)

    async def wait_ready(self, timeout: float = 300.0, service: str = TARGET_SERVICE) -> None:
        """Waits until `service` reports SERVING (see `Client.wait_ready`)."""
        wait = ReadyWait(self.target, timeout)
        while True:
            try:
                status = await self.health(service, timeout=max(min(wait.left(), 5.0), 0.05))
                if status == "SERVING":
                    return
                wait.saw(status)
            except (UnavailableError, DeadlineExceededError) as error:
                wait.saw(error)
            await asyncio.sleep(wait.pause())

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
