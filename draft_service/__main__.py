"""`python -m draft_service` / `specsplit serve-draft`: the draft gRPC service."""

from __future__ import annotations

import logging
import sys
import time

from common.kv_cache import SlotTable
from common.logs import setup_logging
from common.service import build_front, serve_until_drained, service_metrics
from common.settings import parse_config
from common.tp_executor import launch_tp
from draft_service.config import DraftConfig
from draft_service.engine import DraftRunner, DraftState, tp_worker
from draft_service.server import DraftServicer
from specsplit.v1 import draft_pb2, draft_pb2_grpc

log = logging.getLogger("specsplit.draft")
SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name


def main(argv: list[str] | None = None) -> int:
    config = parse_config(DraftConfig, argv, "specsplit serve-draft", "Draft service for specsplit.")
    setup_logging(config.log_format, config.log_level, "draft")
    # The step loop, the gRPC threads and the streamer share the GIL: at the default 5 ms switch interval
    # a busy thread can hold up a message that has already arrived by up to 5 ms per thread hop.
    sys.setswitchinterval(0.0005)
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

    metrics = service_metrics(
        "draft",
        mc.name,
        config,
        comm.world_size,
        method=config.method,
        markov_head_mode=config.markov_head_mode if mc.markov_rank else "none",
    )
    state = DraftState(runner, SlotTable(config.max_batch_size))
    servicer = DraftServicer(
        config, state, metrics, mc.name, mc.vocab_size, comm.world_size, mc.markov_rank > 0
    )
    servicer.max_target_id = runner.max_target_id()

    try:
        front = build_front(
            config,
            SERVICE_NAME,
            lambda server: draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server),
        )
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    front.start()

    def drain() -> None:
        front.set_serving(False)
        # Targets fall back to plain decoding on their own; give open streams a moment.
        front.server.stop(grace=5).wait()

    serve_until_drained(drain)
    runner.executor.shutdown()
    for w in workers:
        w.join(timeout=10)
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
