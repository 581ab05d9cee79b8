"""What both services' gRPC servers share: TLS/mTLS, bearer-token auth, health, reflection."""

from __future__ import annotations

import hmac
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

# Long generations: keep idle streams alive, allow big prompts.
SERVER_OPTIONS = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
]
CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
]
# Health and reflection stay open so Kubernetes probes and grpcurl work without a token.
UNAUTHENTICATED_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")


def read_file(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"{what}: cannot read {path!r}: {exc.strerror}") from exc


def read_token(path: str) -> str:
    token = read_file(path, "--auth-token-file").decode().strip()
    if not token:
        raise ValueError(f"--auth-token-file: {path!r} is empty")
    return token


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Rejects calls without `authorization: Bearer <token>` with UNAUTHENTICATED."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "authorization: missing or invalid bearer token")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_unary_stream = grpc.unary_stream_rpc_method_handler(deny)
        self._deny_stream_stream = grpc.stream_stream_rpc_method_handler(deny)

    def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails) -> Any:
        if allowed(handler_call_details, self._expected):
            return continuation(handler_call_details)
        return denial(self, continuation(handler_call_details))


def allowed(details: grpc.HandlerCallDetails, expected: bytes) -> bool:
    """An open method (health, reflection) or the right bearer token (compared in constant time)."""
    if details.method.startswith(UNAUTHENTICATED_PREFIXES):
        return True
    metadata = dict(details.invocation_metadata or ())
    return hmac.compare_digest(str(metadata.get("authorization", "")).encode(), expected)


def denial(interceptor: Any, handler: Any) -> Any:
    """The interceptor's UNAUTHENTICATED handler of the same streaming kind as `handler` (None: unknown)."""
    if handler is None:
        return None
    if handler.request_streaming and handler.response_streaming:
        return interceptor._deny_stream_stream
    if handler.response_streaming:
        return interceptor._deny_unary_stream
    return interceptor._deny_unary


def make_server(max_workers: int, auth_token_file: str | None) -> grpc.Server:
    interceptors = [BearerTokenInterceptor(read_token(auth_token_file))] if auth_token_file else []
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
        interceptors=interceptors,
        options=SERVER_OPTIONS,
    )


def add_health_and_reflection(server: grpc.Server, service_names: Sequence[str]) -> health.HealthServicer:
    servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection(
        [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
        server,
    )
    set_health(servicer, service_names, serving=False)
    return servicer


def set_health(servicer: health.HealthServicer, service_names: Sequence[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", *service_names):
        servicer.set(name, status)
