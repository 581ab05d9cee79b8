"""`python -m draft_service` / `specsplit serve-draft`: the draft gRPC service."""

from __future__ import annotations

import logging
import sys
import time

from common.kv_cache import SlotTable
from common.logs import setup_logging
from common.service import model_label, open_front, serve_until_drained, service_metrics
from common.settings import parse_config
from common.tp_executor import launch_tp, torchrun_rank, tp_gpu_uuids
from draft_service.config import DraftConfig
from draft_service.runner import DraftRunner, tp_worker
from draft_service.server import DraftServicer
from draft_service.state import DraftState
from specsplit.v1 import draft_pb2, draft_pb2_grpc

log = logging.getLogger("specsplit.draft")
SERVICE = draft_pb2.DESCRIPTOR.services_by_name["DraftService"]


def main(argv: list[str] | None = None) -> int:
    config = parse_config(DraftConfig, argv, "specsplit serve-draft", "Draft service for specsplit.")
    setup_logging(config.log_format, config.log_level, "draft")
    # The step loop, the gRPC threads and the streamer share the GIL: at the default 5 ms switch interval
    # a busy thread can hold up a message that has already arrived by up to 5 ms per thread hop.
    sys.setswitchinterval(config.switch_interval)
    if torchrun_rank() > 0:
        # torchrun runs main() on every rank: ranks > 0 hold a model shard and serve rank 0's steps; the
        # ports (gRPC, health, /metrics) belong to rank 0 alone. launch_tp does not return here.
        launch_tp(config.tp_size, config.device, tp_worker, config)
    # Metrics, health (NOT_SERVING) and the gRPC port (UNAVAILABLE) come up before the model loads.
    metrics = service_metrics("draft", config, method=config.method)
    try:
        front = open_front(config, SERVICE, draft_pb2_grpc.add_DraftServiceServicer_to_server, metrics)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    log.info(
        "loading draft model %s (tp=%d, %s, %s, %s)",
        config.model,
        config.tp_size,
        config.device,
        config.dtype,
        config.method,
    )
    t0 = time.perf_counter()
    try:
        comm, workers = launch_tp(config.tp_size, config.device, tp_worker, config)
        runner = DraftRunner(comm, config)
    except (ValueError, FileNotFoundError) as exc:
        log.error("cannot load the draft model: %s", exc)
        front.stop(grace=0)
        return 2
    mc = runner.model.config
    log.info(
        "draft model loaded in %.1fs: %s, vocab %d, markov head %s, %d CUDA graphs",
        time.perf_counter() - t0,
        mc.name,
        mc.vocab_size,
        f"rank {mc.markov_rank} ({config.markov_head_mode})" if mc.markov_rank else "off",
        runner.graphs,
    )
    metrics.set_info(
        tp_size=comm.world_size,
        device=config.device,
        dtype=config.dtype,
        method=config.method,
        markov_head_mode=config.markov_head_mode if mc.markov_rank else "none",
    )
    state = DraftState(runner, SlotTable(config.max_batch_size))
    gpus = tp_gpu_uuids(config.device, comm.world_size)  # a target on one of them gets no draft-ahead
    servicer = DraftServicer(
        config, state, metrics, model_label(config), mc.vocab_size, comm.world_size, mc.markov_rank > 0, gpus
    )
    servicer.max_target_id = runner.max_target_id()
    front.start(servicer)

    def drain() -> None:
        front.set_serving(False)
        # Targets fall back to plain decoding on their own; give open streams a moment.
        front.stop(grace=5)

    serve_until_drained(drain)
    code = workers.stop(runner.executor)
    log.info("stopped")
    return code


if __name__ == "__main__":
    sys.exit(main())
