"""`python -m target_service` / `specsplit serve-target`: the target gRPC service."""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
from typing import TYPE_CHECKING

from common.aio_front import AioFront, PendingAioServicer
from common.grpc_util import read_token
from common.logs import setup_logging
from common.metrics import ServiceMetrics, announce_metrics_port, start_metrics_server
from common.service import HealthPort, model_label, serve_until_drained, service_metrics
from common.settings import parse_config
from common.tls import CertificateWatcher
from common.tokenizer import load_tokenizer
from common.tp_executor import launch_tp, torchrun_rank, tp_gpu_uuids
from specsplit.v1 import target_pb2, target_pb2_grpc
from target_service.config import TargetConfig
from target_service.draft_link import DraftLink
from target_service.draft_local import LocalDraft, draft_feature_layers, local_draft_config
from target_service.draft_pool import DraftPool, default_server_name
from target_service.runner import TargetRunner, tp_worker
from target_service.scheduler import Scheduler
from target_service.server import TargetServicer

if TYPE_CHECKING:
    from target_service.openai_api import HTTPFront

log = logging.getLogger("specsplit.target")
SERVICE = target_pb2.DESCRIPTOR.services_by_name["TargetService"]
SERVICE_NAME = SERVICE.full_name


def _eos_ids(eos: int | list[int] | None, tokenizer) -> frozenset[int]:
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if tok_eos is not None:
        ids.add(tok_eos)
    return frozenset(ids)


def open_http(config: TargetConfig, local_socket: str) -> HTTPFront | None:
    """The OpenAI-compatible HTTP API (--http-port), bound now, over the gRPC API on `local_socket`."""
    if config.http_port < 0:
        return None
    from target_service.openai_api import HTTPFront  # starlette/uvicorn: only when asked for

    token = read_token(config.auth_token_file) if config.auth_token_file else None
    return HTTPFront(config.host, config.http_port, f"unix:{local_socket}", model_label(config), token)


def stop_fronts(front: AioFront, http: HTTPFront | None, grace: float = 0) -> None:
    if http is not None:
        http.stop()
    front.stop(grace=grace)


def main(argv: list[str] | None = None) -> int:
    config = parse_config(TargetConfig, argv, "specsplit serve-target", "Target service for specsplit.")
    setup_logging(config.log_format, config.log_level, "target")
    # The step loop, the gRPC threads and the streamer share the GIL: at the default 5 ms switch interval
    # a busy thread can hold up a message that has already arrived by up to 5 ms per thread hop.
    sys.setswitchinterval(config.switch_interval)
    # --draft-local's flags are checked before the target loads: a typo fails in seconds.
    draft_config = local_draft_config(config) if config.draft_local else None
    if draft_config is not None and not config.draft_feature_layers:
        config.draft_feature_layers = draft_feature_layers(draft_config.model)
    if torchrun_rank() > 0:
        # torchrun runs main() on every rank: ranks > 0 hold a model shard and serve rank 0's steps; the
        # ports (gRPC, health, /metrics) belong to rank 0 alone. launch_tp does not return here.
        launch_tp(config.tp_size, config.device, tp_worker, config)
    # Plaintext health for kubelet probes (TLS-proof), NOT_SERVING from now until the model is loaded.
    try:
        health_port = HealthPort.open(config, SERVICE_NAME)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    # /metrics is up during the load too (specsplit_ready 0), so a scrape-based ServiceDown alert does not
    # fire on every start.
    metrics = service_metrics("target", config, verify_backend=config.verify_backend)
    metrics.draft_connected.set(0)
    try:
        metrics_port = start_metrics_server(config.metrics_port) if config.metrics_port >= 0 else -1
    except OSError as exc:
        log.error("--metrics-port: %s", exc)
        return 2
    announce_metrics_port(metrics_port)
    # Server and draft-link certificates, reloaded when cert-manager renews them (expiry on /metrics).
    certificates = CertificateWatcher(metrics.set_tls_expiry, config.tls_reload_interval)
    # The gRPC port opens now, NOT_SERVING, each RPC UNAVAILABLE ("the model is loading") until loaded.
    pending = PendingAioServicer(SERVICE)
    local_socket = (
        os.path.join(tempfile.mkdtemp(prefix="specsplit-"), "grpc.sock") if config.http_port >= 0 else ""
    )
    try:
        front = AioFront(
            config,
            SERVICE_NAME,
            lambda server: target_pb2_grpc.add_TargetServiceServicer_to_server(pending, server),
            metrics_port=metrics_port,
            local_socket=local_socket,
            certificates=certificates,
        )
        http = open_http(config, local_socket)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    front.open()
    if http is not None:
        http.start()
    log.info(
        "loading target model %s (tp=%d, %s, %s)", config.model, config.tp_size, config.device, config.dtype
    )
    t0 = time.perf_counter()
    try:
        comm, workers = launch_tp(config.tp_size, config.device, tp_worker, config)
        runner = TargetRunner(comm, config)
        tokenizer = load_tokenizer(config.model)
    except (ValueError, FileNotFoundError) as exc:
        log.error("cannot load the target model: %s", exc)
        stop_fronts(front, http)
        return 2
    mc = runner.model.config
    log.info(
        "target model loaded in %.1fs: %s, vocab %d, context %d, %d CUDA graphs",
        time.perf_counter() - t0,
        mc.name,
        mc.vocab_size,
        runner.max_context,
        runner.num_graphs,
    )

    try:
        link = None
        # Sent to each draft: one on the same GPUs drafts nothing ahead (it would delay the verify).
        target_gpus = tp_gpu_uuids(config.device, comm.world_size)
        if draft_config is not None:
            link = LocalDraft(draft_config, metrics, mc.vocab_size, target_gpus, runner.feature_store)
        elif config.draft_address:
            token = read_token(config.draft_auth_token_file) if config.draft_auth_token_file else None
            creds = certificates.channel_credentials(
                config.draft_tls_ca or None, config.draft_tls_cert or None, config.draft_tls_key or None
            )
            # Replicas are dialled by IP: under TLS, check the certificate against the name the flag gives.
            server_name = config.draft_tls_server_name or (
                default_server_name(config.draft_address) if creds is not None else None
            )

            def make_link(address: str, link_metrics: ServiceMetrics) -> DraftLink:
                return DraftLink(address, link_metrics, mc.vocab_size, creds, token, server_name,
                                 config.draft_backoff_max, target_gpus=target_gpus)  # fmt: skip

            link = DraftPool(config.draft_address, make_link, metrics)
        eos_ids = _eos_ids(mc.eos_token_id, tokenizer)
        scheduler = Scheduler(runner, config, metrics, link, eos_ids)
        model_info = target_pb2.GetModelInfoResponse(
            target_model=model_label(config),
            vocab_size=mc.vocab_size,
            target_tp_size=comm.world_size,
            num_speculative_tokens=config.num_speculative_tokens if link else 0,
            max_speculative_tokens=config.max_speculative_tokens,
            draft_method="none",
            max_context_length=runner.max_context,
            max_batch_size=config.max_batch_size,
            max_queued_requests=config.max_queued_requests,
            max_top_k=mc.vocab_size,
            eos_token_id=min(eos_ids) if eos_ids else None,
            dtype=config.dtype,
            speculation_policy=config.speculation_policy,
            draft_kind="local" if draft_config is not None else "service" if link is not None else "none",
        )
        servicer = TargetServicer(config, scheduler, metrics, tokenizer, model_info)
    except (ValueError, FileNotFoundError) as exc:
        log.error("%s", exc)
        stop_fronts(front, http)
        return 2

    scheduler.start()
    if link is not None:
        link.start()
        if not link.wait_connected(timeout=5.0):
            log.warning("draft %s not reachable yet: plain decoding until it is", config.draft_address)
    servicer.ready = True
    pending.attach(servicer)
    if http is not None and tokenizer is not None:
        http.gateway.text.decode = tokenizer.decode  # logprobs name their tokens
    front.start(f", verify backend {scheduler.verify_backend}")
    metrics.ready.set(1)
    if health_port is not None:
        health_port.set_serving(True)

    def drain() -> None:
        scheduler.stop_accepting()
        front.set_serving(False)
        metrics.ready.set(0)
        if health_port is not None:
            health_port.set_serving(False)
        deadline = time.monotonic() + config.drain_timeout
        while scheduler.num_active() and time.monotonic() < deadline:
            time.sleep(0.05)
        left = scheduler.num_active()
        if left:
            log.warning("drain timeout: aborting %d requests", left)
        scheduler.stop()
        stop_fronts(front, http, grace=2)
        if health_port is not None:
            health_port.stop()

    serve_until_drained(drain)
    if link is not None:
        link.close()
    code = workers.stop(runner.executor)
    log.info("stopped")
    return code


if __name__ == "__main__":
    sys.exit(main())
