"""A grpc.aio serving front on its own event-loop thread: streams cost no thread each.

The sync front (common.service.build_front) holds one pool thread per open stream, so the number of
concurrent Generate streams is capped by --grpc-workers. Here one asyncio loop serves every RPC; the
rest of the process (the scheduler thread, the drain thread, the main thread) talks to it through
`AioFront.call` (run a coroutine on the loop and wait) and `StreamOut` (a thread-safe sink that hands a
request's outputs to its handler coroutine).

Health, reflection, TLS/mTLS and the bearer token work as in the sync front (same flags, same errors).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.grpc_util import SERVER_OPTIONS, allowed, denial, read_token
from common.lifecycle import freeze_startup_heap
from common.metrics import start_metrics_server
from common.service import LOADING, PendingServicer
from common.settings import ServiceConfig
from common.tls import CertificateWatcher, add_port

log = logging.getLogger("specsplit")


class AioBearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without `authorization: Bearer <token>` with UNAUTHENTICATED (health and
    reflection stay open, as in common.grpc_util.BearerTokenInterceptor)."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED, "authorization: missing or invalid bearer token"
            )

        async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await deny(request, context)
            yield  # pragma: no cover  (makes this an async generator)

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_unary_stream = grpc.unary_stream_rpc_method_handler(deny_stream)
        self._deny_stream_stream = grpc.stream_stream_rpc_method_handler(deny_stream)

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        if allowed(details, self._expected):
            return await continuation(details)
        return denial(self, await continuation(details))


class StreamOut:
    """One request's output channel: `put_all` from any thread, `get` on the loop.

    The streamer thread hands items over with `put_all` (item: a response message, an Exception, or
    None for the end); they cross to the loop with call_soon_threadsafe. When more than `limit` items
    wait unread (the client stopped reading, so the handler is stuck in a write), `on_overflow` runs
    once on the loop: the caller cancels the request there, so a stuck stream neither holds a KV slot
    nor buffers without bound.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, limit: int, on_overflow: Callable[[], None]):
        self.loop = loop
        self.limit = limit
        self.on_overflow = on_overflow
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.overflowed = False
        self.request_id = ""  # the owner sets it before the request can produce output

    def _deliver(self, item: Any) -> None:
        if self.overflowed:
            return
        self.queue.put_nowait(item)
        if self.queue.qsize() > self.limit:
            self.overflowed = True
            self.on_overflow()

    async def get(self) -> Any:
        return await self.queue.get()

    def get_nowait(self) -> Any:
        return self.queue.get_nowait()

    def pending(self) -> int:
        return self.queue.qsize()


def put_all(items: list[tuple[StreamOut, Any]]) -> None:
    """Delivers `item` to `out` for every pair, with one loop wake-up per loop, not one per item.

    A step of B requests yields B outputs at once; each call_soon_threadsafe writes the loop's self-pipe
    and wakes it, and at small step times those wake-ups and their GIL hand-offs showed up as host time
    of the scheduler's step. Per-stream order is kept (pairs are delivered in list order).
    """
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[StreamOut, Any]]] = {}
    for out, item in items:
        by_loop.setdefault(out.loop, []).append((out, item))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver_all, batch)
        except RuntimeError:  # the loop is closed (server stopped): nobody is listening
            pass


def _deliver_all(batch: list[tuple[StreamOut, Any]]) -> None:
    for out, item in batch:
        out._deliver(item)


class PendingAioServicer(PendingServicer):
    """PendingServicer for the asyncio server: every RPC answers UNAVAILABLE ("the model is loading")
    until `attach`. A streaming RPC's servicer writes with `context.write`, so forwarding is one await."""

    def _forward(self, name: str) -> Callable:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            servicer = self._servicer
            if servicer is None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, LOADING)
            return await getattr(servicer, name)(request, context)

        return call


def _add_port(server: grpc.aio.Server, config: ServiceConfig, certificates: CertificateWatcher) -> int:
    """Plaintext, TLS or mTLS, as the sync servers bind (grpc.aio servers take the same calls)."""
    address = f"{config.host}:{config.port}"
    return add_port(server, address, config.tls_cert or None, config.tls_key or None,  # type: ignore[arg-type]
                    config.tls_client_ca or None, certificates)  # fmt: skip


class AioFront:
    """The aio server, its health servicer and the loop thread; the same surface as common.service.Front
    (set_serving, start) plus `call`, `stop` and `loop` for the servicer's StreamOut."""

    def __init__(
        self,
        config: ServiceConfig,
        service_name: str,
        register: Callable[[grpc.aio.Server], None],
        metrics_port: int | None = None,
        local_socket: str = "",
        certificates: CertificateWatcher | None = None,
    ):
        """Binds everything; raises ValueError naming the flag on bad TLS/token/port settings.
        `metrics_port`: /metrics is already served there (started before the model load).
        `local_socket`: also serve plaintext on this Unix socket (in-process gateways: the HTTP API).
        `certificates`: the process's TLS files (reloaded when they change), else a watcher of its own."""
        self.service_name = service_name
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="grpc-aio", daemon=True)
        self.thread.start()
        token = read_token(config.auth_token_file) if config.auth_token_file else None

        async def build() -> tuple[grpc.aio.Server, Any, int]:
            interceptors = [AioBearerTokenInterceptor(token)] if token else []
            server = grpc.aio.server(interceptors=interceptors, options=SERVER_OPTIONS)
            register(server)
            health_servicer = health.aio.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
            names = [service_name, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
            reflection.enable_server_reflection([*names, reflection.SERVICE_NAME], server)
            port = _add_port(
                server, config, certificates or CertificateWatcher(None, config.tls_reload_interval)
            )
            if local_socket and not server.add_insecure_port(f"unix:{local_socket}"):
                raise ValueError(f"cannot bind the local socket {local_socket}")
            return server, health_servicer, port

        try:
            self.server, self.health, self.port = self.call(build())
        except BaseException:
            self._close_loop()
            raise
        self.set_serving(False)
        if metrics_port is None:
            metrics_port = start_metrics_server(config.metrics_port) if config.metrics_port >= 0 else -1
        self.metrics_port = metrics_port

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        """Runs `coro` on the loop from another thread and returns its result."""
        fut: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout)

    def set_serving(self, serving: bool) -> None:
        codes = health_pb2.HealthCheckResponse
        status = codes.SERVING if serving else codes.NOT_SERVING

        async def set_all() -> None:
            for name in ("", self.service_name):
                await self.health.set(name, status)

        self.call(set_all())

    def open(self) -> None:
        """Starts serving RPCs with health NOT_SERVING (before the model loads: see PendingAioServicer)."""
        self.call(self.server.start())
        log.info("listening: grpc port %d (asyncio), metrics port %d (loading)", self.port, self.metrics_port)

    def start(self, detail: str = "") -> None:
        """The model is loaded: report SERVING."""
        freeze_startup_heap()  # the model and its graphs are loaded: as common.service.Front.start does
        self.set_serving(True)
        log.info("ready: grpc port %d (asyncio), metrics port %d%s", self.port, self.metrics_port, detail)
        # Launchers (specsplit.launch, the demo) wait for this line.
        print(f"SPECSPLIT_READY grpc={self.port} metrics={self.metrics_port}", flush=True)

    def stop(self, grace: float) -> None:
        """Stops the server (open RPCs get `grace` seconds) and the loop thread."""
        try:
            self.call(self.server.stop(grace), timeout=grace + 10)
        finally:
            self._close_loop()

    def _close_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()
