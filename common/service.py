"""The gRPC front both services share: server, TLS, auth, health, reflection, metrics port, drain."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health

from common.distributed import comm_stats
from common.grpc_util import add_health_and_reflection, add_port, make_server, set_health
from common.lifecycle import install_drain_handler
from common.metrics import ServiceMetrics, start_metrics_server
from common.settings import ServiceConfig

log = logging.getLogger("specsplit")


@dataclass
class Front:
    server: grpc.Server
    health: health.HealthServicer
    service_name: str
    port: int
    metrics_port: int

    def set_serving(self, serving: bool) -> None:
        set_health(self.health, [self.service_name], serving)

    def start(self, detail: str = "") -> None:
        self.server.start()
        self.set_serving(True)
        log.info("ready: grpc port %d, metrics port %d%s", self.port, self.metrics_port, detail)
        # Launchers (specsplit.launch, the demo) wait for this line.
        print(f"SPECSPLIT_READY grpc={self.port} metrics={self.metrics_port}", flush=True)


def service_metrics(
    service: str, model: str, config: ServiceConfig, tp_size: int, **info: object
) -> ServiceMetrics:
    """The service's metrics with the facts every service exports (KV capacity, TP size, device, dtype)."""
    metrics = ServiceMetrics(service, model, comm_stats=comm_stats)
    metrics.kv_slots_total.set(config.max_batch_size)
    metrics.set_info(tp_size=tp_size, device=config.device, dtype=config.dtype, **info)
    return metrics


def build_front(config: ServiceConfig, service_name: str, register: Callable[[grpc.Server], None]) -> Front:
    """Binds everything; raises ValueError naming the flag on bad TLS/token/port settings."""
    server = make_server(config.grpc_workers, config.auth_token_file or None)
    register(server)
    health_servicer = add_health_and_reflection(server, [service_name])
    port = add_port(server, f"{config.host}:{config.port}", config.tls_cert or None, config.tls_key or None,
                    config.tls_client_ca or None)  # fmt: skip
    metrics_port = start_metrics_server(config.metrics_port) if config.metrics_port >= 0 else -1
    return Front(server, health_servicer, service_name, port, metrics_port)


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
