"""A draft service whose rounds take no time: the real gRPC front and DraftServicer (checks, verdicts,
proposals, draft-ahead bookkeeping) over a runner that proposes at once. `bench/link_rtt.py` times the
target-draft round trip against it, so what it measures is the transport and the thread hand-offs alone.

    python -m bench.instant_draft --model none --port P --metrics-port M [--draft-round-ms 0]
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.kv_cache import SlotTable
from common.service import open_front, serve_until_drained, service_metrics
from common.settings import parse_config
from draft_service.config import DraftConfig
from draft_service.runner import RoundOutput
from draft_service.server import DraftServicer
from draft_service.state import DraftState
from specsplit.v1 import draft_pb2, draft_pb2_grpc

VOCAB = 512


class InstantRunner:
    """The DraftRunner surface DraftState uses; `executor.run("draft_round", ...)` answers k tokens per
    row after `delay` seconds (a sleep: the GIL is free, as while a GPU round runs)."""

    def __init__(self, config: DraftConfig, delay: float):
        self.config, self.delay, self.max_len = config, delay, 1 << 20
        self.executor = self
        self.num_branch_slots = self.branch_slot_offset = 0  # no branches: its rounds draft no second choice

    def run(self, op: str, rows, starts, slots, k, temperatures, seeds, **_prefix) -> RoundOutput:
        if self.delay:
            time.sleep(self.delay)
        return RoundOutput([[(r[-1] + i + 1) % VOCAB for i in range(k)] for r in rows])


def main() -> int:
    config = parse_config(DraftConfig, sys.argv[1:], "instant-draft", "A draft service with instant rounds.")
    sys.setswitchinterval(config.switch_interval)
    metrics = service_metrics("draft", config, method=config.method)
    front = open_front(config, draft_pb2.DESCRIPTOR.services_by_name["DraftService"],
                       draft_pb2_grpc.add_DraftServiceServicer_to_server, metrics)  # fmt: skip
    delay = float(os.environ.get("INSTANT_DRAFT_ROUND_MS", "0")) / 1e3
    state = DraftState(InstantRunner(config, delay), SlotTable(config.max_batch_size))
    front.start(DraftServicer(config, state, metrics, "instant", VOCAB, 1, False))
    serve_until_drained(lambda: front.stop(grace=0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
