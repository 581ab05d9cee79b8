"""asyncio client of the specsplit target service (grpc.aio); same surface as `specsplit.Client`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Sequence
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
    build_chat_request,
    build_request,
    resolve_tls,
)
from specsplit.errors import error_from_rpc
from specsplit.v1 import target_pb2, target_pb2_grpc


class AsyncGenerateStream:
    """Async iterator of `Delta`s. Leaving `async with` early, an exception, or cancelling the task that
    iterates cancels the RPC, so the server drops the request from its batch at once."""

    def __init__(self, call: Any, request_id: str) -> None:
        self._call = call
        self.request_id = request_id

    async def __aiter__(self) -> AsyncIterator[Delta]:
        try:
            async for msg in self._call:
                yield Delta.from_proto(msg)
        except grpc.aio.AioRpcError as err:
            raise error_from_rpc(err) from None
        finally:
            self.cancel()

    def cancel(self) -> None:
        """Cancel the RPC; a no-op once the stream has finished."""
        self._call.cancel()

    async def __aenter__(self) -> AsyncGenerateStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()


class AsyncClient:
    """asyncio twin of `specsplit.Client` (same arguments and methods, awaitable). Create it inside the
    event loop that uses it: a grpc.aio channel belongs to one loop."""

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
        self._channel = aio_channel(target, retry, resolve_tls(tls), tuple(channel_options))
        self._stub = target_pb2_grpc.TargetServiceStub(self._channel)
        # grpc_health's stub is untyped; the typed multicallable is the same RPC.
        self._health_check = self._channel.unary_unary(
            HEALTH_CHECK_METHOD,
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )

    def stream(
        self, prompt: str | Iterable[int], *, timeout: float | None = None, **options: Unpack[GenerateOptions]
    ) -> AsyncGenerateStream:
        request = build_request(prompt, **options)
        call = self._stub.Generate(request, **self._settings.kwargs(timeout, unary=False))
        return AsyncGenerateStream(call, request.request_id)

    async def generate(
        self, prompt: str | Iterable[int], *, timeout: float | None = None, **options: Unpack[GenerateOptions]
    ) -> GenerateResult:
        async with self.stream(prompt, timeout=timeout, **options) as stream:
            builder = ResultBuilder(stream.request_id)
            async for delta in stream:
                builder.add(delta)
            return builder.build()

    def chat_stream(
        self, messages: ChatMessages, *, timeout: float | None = None, **options: Unpack[GenerateOptions]
    ) -> AsyncGenerateStream:
        """Streams the assistant's reply to `messages` (rendered with the model's chat template)."""
        request = build_chat_request(messages, **options)
        call = self._stub.Generate(request, **self._settings.kwargs(timeout, unary=False))
        return AsyncGenerateStream(call, request.request_id)

    async def chat(
        self, messages: ChatMessages, *, timeout: float | None = None, **options: Unpack[GenerateOptions]
    ) -> GenerateResult:
        """The assistant's reply to `messages`; generation stops at the template's end-of-turn token."""
        async with self.chat_stream(messages, timeout=timeout, **options) as stream:
            builder = ResultBuilder(stream.request_id)
            async for delta in stream:
                builder.add(delta)
            return builder.build()

    async def abort(self, request_id: str, *, timeout: float | None = None) -> bool:
        """Abort a running or queued request; False when the server had no request with that id."""
        request = target_pb2.AbortRequest(request_id=request_id)
        try:
            response = await self._stub.Abort(request, **self._settings.kwargs(timeout, unary=True))
        except grpc.aio.AioRpcError as err:
            raise error_from_rpc(err) from None
        return response.found

    async def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        request = target_pb2.GetModelInfoRequest()
        try:
            msg = await self._stub.GetModelInfo(request, **self._settings.kwargs(timeout, unary=True))
        except grpc.aio.AioRpcError as err:
            raise error_from_rpc(err) from None
        return ModelInfo.from_proto(msg)

    async def health(self, service: str = TARGET_SERVICE, *, timeout: float | None = None) -> str:
        """The grpc.health.v1 status name of `service` ("" for the whole server): "SERVING", ..."""
        request = health_pb2.HealthCheckRequest(service=service)
        try:
            msg = await self._health_check(request, **self._settings.kwargs(timeout, unary=True))
        except grpc.aio.AioRpcError as err:
            raise error_from_rpc(err) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(msg.status)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
