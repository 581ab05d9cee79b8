"""The gRPC front both services share: server, TLS, auth, health, reflection, metrics port, drain.

Start-up order (both services): `open_front` binds and starts the gRPC port, the optional plaintext
health port and /metrics BEFORE the model loads. Until `Front.start` the health service answers
NOT_SERVING, every RPC answers UNAVAILABLE (`PendingServicer`), and `specsplit_ready` is 0; so a
kubelet probe or a Prometheus scrape during a ten-minute model load sees a live process that is not
ready yet, not a dead one (SpecsplitServiceDown keys on the scrape failing).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health, health_pb2_grpc
from prometheus_client import REGISTRY, CollectorRegistry

from common.distributed import comm_stats
from common.grpc_util import add_health_and_reflection, make_server, set_health
from common.lifecycle import freeze_startup_heap, install_drain_handler, release_startup_heap
from common.metrics import ServiceMetrics, announce_metrics_port, start_metrics_server
from common.settings import ServiceConfig
from common.tls import CertificateWatcher, add_port

log = logging.getLogger("specsplit")
LOADING = "the model is loading; retry when ready"  # UNAVAILABLE's details before the model is loaded


class PendingServicer:
    """Stands in for a service's servicer until `attach`: every RPC answers UNAVAILABLE before that.

    gRPC needs its handlers before the server starts, and the real servicer needs the loaded model; this
    lets the port (and health, NOT_SERVING) come up first. One method per RPC of `service`.
    """

    def __init__(self, service: ServiceDescriptor):
        self._servicer: Any = None
        for method in service.methods:
            setattr(self, method.name, self._forward(method.name))

    def attach(self, servicer: object) -> None:
        self._servicer = servicer

    def _forward(self, name: str) -> Callable:
        def call(request: Any, context: grpc.ServicerContext) -> Any:
            servicer = self._servicer
            if servicer is None:
                context.abort(grpc.StatusCode.UNAVAILABLE, LOADING)
            return getattr(servicer, name)(request, context)

        return call


@dataclass
class Front:
    server: grpc.Server
    health: health.HealthServicer
    service_name: str
    port: int
    metrics_port: int
    metrics: ServiceMetrics
    pending: PendingServicer
    health_server: grpc.Server | None = None
    health_port: int = -1

    def set_serving(self, serving: bool) -> None:
        set_health(self.health, [self.service_name], serving)
        self.metrics.ready.set(1 if serving else 0)

    def start(self, servicer: object, detail: str = "") -> None:
        """The model is loaded: route RPCs to `servicer` and report SERVING."""
        freeze_startup_heap()
        self.pending.attach(servicer)
        self.set_serving(True)
        log.info("ready: grpc port %d, metrics port %d%s", self.port, self.metrics_port, detail)
        # Launchers (specsplit.launch, the demo) wait for this line.
        print(f"SPECSPLIT_READY grpc={self.port} metrics={self.metrics_port}", flush=True)

    def stop(self, grace: float) -> None:
        self.server.stop(grace=grace).wait()
        if self.health_server is not None:
            self.health_server.stop(grace=0).wait()


def model_label(config: ServiceConfig) -> str:
    """The `model` metric label and served model name: --served-model-name, else the checkpoint's name."""
    return config.served_model_name or Path(config.model.rstrip("/")).name


def service_metrics(
    role: str, config: ServiceConfig, registry: CollectorRegistry = REGISTRY, **info: object
) -> ServiceMetrics:
    """The service's metrics with the facts every service exports (KV capacity, TP size, device, dtype).
    A second service in one process (the target's --draft-local) passes a registry of its own."""
    metrics = ServiceMetrics(role, model_label(config), registry, comm_stats=comm_stats)
    metrics.kv_slots_total.set(config.max_batch_size)
    metrics.ready.set(0)
    metrics.set_info(tp_size=config.tp_size, device=config.device, dtype=config.dtype, **info)
    return metrics


def open_front(
    config: ServiceConfig,
    service: ServiceDescriptor,
    register: Callable[[object, grpc.Server], None],
    metrics: ServiceMetrics,
) -> Front:
    """Binds and starts gRPC (NOT_SERVING, RPCs UNAVAILABLE), the health port and /metrics.

    `register(servicer, server)` is the generated add_<Service>Servicer_to_server. Raises ValueError
    naming the flag on bad TLS/token/port settings.
    """
    pending = PendingServicer(service)
    server = make_server(config.grpc_workers, config.auth_token_file or None)
    register(pending, server)
    health_servicer = add_health_and_reflection(server, [service.full_name])
    certificates = CertificateWatcher(metrics.set_tls_expiry, config.tls_reload_interval)
    port = add_port(server, f"{config.host}:{config.port}", config.tls_cert or None, config.tls_key or None,
                    config.tls_client_ca or None, certificates)  # fmt: skip
    health_server, health_port = None, -1
    if config.health_port >= 0:
        health_server, health_port = _health_only_server(config, health_servicer)
    metrics_port = start_metrics_server(config.metrics_port) if config.metrics_port >= 0 else -1
    announce_metrics_port(metrics_port)
    server.start()
    if health_server is not None:
        health_server.start()
    log.info("listening: grpc port %d, health port %d, metrics port %d (loading)", port, health_port,
             metrics_port)  # fmt: skip
    return Front(server, health_servicer, service.full_name, port, metrics_port, metrics, pending,
                 health_server, health_port)  # fmt: skip


def _health_only_server(
    config: ServiceConfig, health_servicer: health.HealthServicer
) -> tuple[grpc.Server, int]:
    """Plaintext grpc.health.v1 only, same status as the main port: kubelet's gRPC probes speak no TLS."""
    server = make_server(4, None)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(f"{config.host}:{config.health_port}")
    if port == 0:
        raise ValueError(f"--health-port: cannot bind {config.host}:{config.health_port}")
    return server, port


def serve_until_drained(drain: Callable[[], None]) -> None:
    """Blocks until SIGTERM/SIGINT has started `drain` and it has returned."""
    stopped = threading.Event()

    def run_drain() -> None:
        try:
            drain()
        finally:
            stopped.set()

    install_drain_handler(run_drain)
    stopped.wait()
    release_startup_heap()


@dataclass
class HealthPort:
    """A plaintext grpc.health.v1-only server for a front that has none of its own (the target's aio
    front): up from process start, NOT_SERVING until `set_serving(True)`."""

    server: grpc.Server
    health: health.HealthServicer
    names: list[str]

    @classmethod
    def open(cls, config: ServiceConfig, service_name: str) -> HealthPort | None:
        if config.health_port < 0:
            return None
        servicer = health.HealthServicer(experimental_non_blocking=True)
        server, _ = _health_only_server(config, servicer)
        set_health(servicer, [service_name], False)
        server.start()
        return cls(server, servicer, [service_name])

    def set_serving(self, serving: bool) -> None:
        set_health(self.health, self.names, serving)

    def stop(self) -> None:
        self.server.stop(grace=0).wait()
