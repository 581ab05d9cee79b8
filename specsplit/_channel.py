"""Channel construction shared by the sync and asyncio clients: options, credentials, service config."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

TARGET_SERVICE = "specsplit.v1.TargetService"
HEALTH_SERVICE = "grpc.health.v1.Health"
HEALTH_CHECK_METHOD = f"/{HEALTH_SERVICE}/Check"
DRAFT_SERVICE = "specsplit.v1.DraftService"
DRAFT_INFO_METHOD = f"/{DRAFT_SERVICE}/GetDraftInfo"

# A client's first connection: how long to wait for it to succeed or fail before the call goes ahead
# anyway (a slow network). A refused or unresolvable address fails within milliseconds.
CONNECT_CHECK_S = 5.0
# wait_ready(): seconds between health checks.
READY_POLL_S = 0.25
_SETTLED = (
    grpc.ChannelConnectivity.READY,
    grpc.ChannelConnectivity.TRANSIENT_FAILURE,
    grpc.ChannelConnectivity.SHUTDOWN,
)

# Token ids for a long prompt are a few MB at most; 64 MiB leaves room without being unbounded.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# A stream can sit in the queue for minutes without data; pings keep NAT/LB idle timers from dropping it.
# A server answers pings more frequent than its min_ping_interval_without_data (specsplit's: 10 s, gRPC's
# default: 5 min) with GOAWAY, which would kill the stream: 30 s suits specsplit's servers; raise it
# (channel_options) for a server or proxy with gRPC's default policy.
KEEPALIVE_TIME_MS = 30_000
KEEPALIVE_TIMEOUT_MS = 20_000


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff for UNAVAILABLE, applied by gRPC itself (service config `retryPolicy`).

    gRPC commits a call once the server sends response headers or a message, so a stream that already
    produced tokens is never replayed; only a call that failed before its first response is retried.
    gRPC caps `max_attempts` at 5 and draws each backoff uniformly from [0, current backoff].
    """

    max_attempts: int = 5
    initial_backoff_s: float = 0.25
    max_backoff_s: float = 2.0
    backoff_multiplier: float = 2.0

    def __post_init__(self) -> None:
        if not 2 <= self.max_attempts <= 5:
            raise ValueError(f"max_attempts: must be in [2, 5] (gRPC's limit), got {self.max_attempts}")
        if self.initial_backoff_s <= 0 or self.max_backoff_s < self.initial_backoff_s:
            raise ValueError("initial_backoff_s/max_backoff_s: need 0 < initial_backoff_s <= max_backoff_s")
        if self.backoff_multiplier < 1:
            raise ValueError(f"backoff_multiplier: must be >= 1, got {self.backoff_multiplier}")


@dataclass(frozen=True)
class TLSConfig:
    """Server authentication (and, with a client certificate and key, mTLS), all PEM bytes.

    `root_certificates=None` uses the system roots. `server_name` overrides the name checked against
    the server certificate (e.g. connecting by IP to a certificate issued for a DNS name).
    """

    root_certificates: bytes | None = None
    certificate_chain: bytes | None = None
    private_key: bytes | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.certificate_chain is None) != (self.private_key is None):
            raise ValueError("certificate_chain/private_key: a client certificate needs its key and back")

    @classmethod
    def from_files(
        cls,
        ca_cert: str | Path | None = None,
        client_cert: str | Path | None = None,
        client_key: str | Path | None = None,
        server_name: str | None = None,
    ) -> TLSConfig:
        def read(path: str | Path | None) -> bytes | None:
            return Path(path).read_bytes() if path is not None else None

        return cls(read(ca_cert), read(client_cert), read(client_key), server_name)


def service_config(retry: RetryPolicy | None) -> str:
    """round_robin over every address the name resolves to (a headless Kubernetes service gives one
    per pod with `dns:///name:port`), plus the retry policy for every method this SDK calls."""
    config: dict[str, Any] = {"loadBalancingConfig": [{"round_robin": {}}]}
    if retry is not None:
        config["methodConfig"] = [
            {
                "name": [{"service": TARGET_SERVICE}, {"service": HEALTH_SERVICE}],
                "retryPolicy": {
                    "maxAttempts": retry.max_attempts,
                    "initialBackoff": f"{retry.initial_backoff_s}s",
                    "maxBackoff": f"{retry.max_backoff_s}s",
                    "backoffMultiplier": retry.backoff_multiplier,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    return json.dumps(config)


def channel_options(
    retry: RetryPolicy | None, tls: TLSConfig | None, extra: tuple[tuple[str, Any], ...] = ()
) -> list[tuple[str, Any]]:
    options: dict[str, Any] = {
        "grpc.service_config": service_config(retry),
        "grpc.enable_retries": 1 if retry is not None else 0,
        "grpc.max_send_message_length": MAX_MESSAGE_BYTES,
        "grpc.max_receive_message_length": MAX_MESSAGE_BYTES,
        "grpc.keepalive_time_ms": KEEPALIVE_TIME_MS,
        "grpc.keepalive_timeout_ms": KEEPALIVE_TIMEOUT_MS,
        "grpc.keepalive_permit_without_calls": 0,
        "grpc.http2.max_pings_without_data": 0,
        # gRPC's default reconnect backoff grows to 120 s; a client of an inference service that restarts
        # (a pod rollout) should find it again within seconds.
        "grpc.initial_reconnect_backoff_ms": 200,
        "grpc.min_reconnect_backoff_ms": 200,
        "grpc.max_reconnect_backoff_ms": 5_000,
    }
    if tls is not None and tls.server_name is not None:
        options["grpc.ssl_target_name_override"] = tls.server_name
    options.update(dict(extra))
    return list(options.items())


def _credentials(tls: TLSConfig) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(tls.root_certificates, tls.private_key, tls.certificate_chain)


def sync_channel(
    target: str, retry: RetryPolicy | None, tls: TLSConfig | None, extra: tuple[tuple[str, Any], ...]
) -> grpc.Channel:
    options = channel_options(retry, tls, extra)
    if tls is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, _credentials(tls), options=options)


def aio_channel(
    target: str, retry: RetryPolicy | None, tls: TLSConfig | None, extra: tuple[tuple[str, Any], ...]
) -> grpc.aio.Channel:
    options = channel_options(retry, tls, extra)
    if tls is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, _credentials(tls), options=options)


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    # Sent as plain metadata rather than call credentials so a token also works on an insecure
    # loopback/sidecar channel; use TLS whenever the token crosses a network.
    return (("authorization", f"Bearer {token}"),) if token else ()


def first_connect(channel: grpc.Channel, timeout: float | None) -> grpc.ChannelConnectivity | None:
    """Connects and waits up to `timeout` (at most CONNECT_CHECK_S) for READY or a failure; None when
    neither came in time. A client checks its first connection this way: gRPC's retry policy would
    otherwise retry a wrong address with backoff for seconds before saying it is unreachable."""
    settled: list[grpc.ChannelConnectivity] = []
    done = threading.Event()

    def on_change(state: grpc.ChannelConnectivity) -> None:
        if state in _SETTLED and not done.is_set():
            settled.append(state)
            done.set()

    channel.subscribe(on_change, try_to_connect=True)
    try:
        done.wait(min(timeout, CONNECT_CHECK_S) if timeout is not None else CONNECT_CHECK_S)
    finally:
        channel.unsubscribe(on_change)
    return settled[0] if settled else None


async def first_connect_aio(
    channel: grpc.aio.Channel, timeout: float | None
) -> grpc.ChannelConnectivity | None:
    """`first_connect` for an asyncio channel."""
    wait = min(timeout, CONNECT_CHECK_S) if timeout is not None else CONNECT_CHECK_S
    deadline = time.monotonic() + wait
    state = channel.get_state(try_to_connect=True)
    while state not in _SETTLED:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        try:
            await asyncio.wait_for(channel.wait_for_state_change(state), left)
        except TimeoutError:
            return None
        state = channel.get_state(try_to_connect=True)
    return state


def unreachable_message(target: str, tls: bool) -> str:
    why = (
        "nothing listens there, the name does not resolve, or the TLS handshake failed"
        if tls
        else ("nothing listens there, or the name does not resolve")
    )
    return f"cannot connect to {target} ({why})"


def wrong_service_message(target: str) -> str:
    return (
        f"{target}: this is a draft service, not a target (it serves {DRAFT_SERVICE}); point the client "
        "at the target service (default port 50051)"
    )
