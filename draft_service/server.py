"""The draft service's gRPC front (TP rank 0): the RPCs over what every target stream shares
(stream.SharedDraft). A stream's own protocol is draft_service/stream.py."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator

import grpc

from common.distributed import comm_stats
from common.metrics import ServiceMetrics
from draft_service.config import DraftConfig
from draft_service.state import DraftState
from draft_service.stream import DraftStream, SharedDraft, StreamError
from specsplit.v1 import draft_pb2, draft_pb2_grpc

log = logging.getLogger("specsplit.draft")


class DraftServicer(SharedDraft, draft_pb2_grpc.DraftServiceServicer):
    def __init__(
        self,
        config: DraftConfig,
        state: DraftState,
        metrics: ServiceMetrics,
        model_name: str,
        vocab_size: int,
        tp_size: int,
        markov: bool,
        gpus: Iterable[str] = (),
    ):
        super().__init__(config, state, metrics, vocab_size, gpus)
        self.model_name = model_name
        self.tp_size = tp_size
        self.markov = markov

    # -- RPCs ------------------------------------------------------------------
    def Speculate(
        self, request_iterator: Iterator[draft_pb2.SpeculateRequest], context: grpc.ServicerContext
    ) -> Iterator[draft_pb2.SpeculateResponse]:
        # The messages are read here, in the servicer's own thread: a reader thread handing them over
        # through a queue cost one more GIL hand-off per message on the round trip.
        messages = iter(request_iterator)
        stream = DraftStream(self, context.peer())
        try:
            while True:
                try:
                    msg = next(messages)
                except (StopIteration, grpc.RpcError):
                    return
                arrived = time.perf_counter()
                if not context.is_active():
                    return
                self.metrics.count_grpc_message("received", "speculate_request", msg.ByteSize())
                try:
                    for response in stream.handle(msg, arrived):
                        kind = "speculate_branches" if response.branches else "speculate_response"
                        self.metrics.count_grpc_message("sent", kind, response.ByteSize())
                        yield response
                except StreamError as exc:
                    context.abort(exc.code, exc.details)
        finally:
            stream.close()

    def GetDraftInfo(
        self, request: draft_pb2.GetDraftInfoRequest, context: grpc.ServicerContext
    ) -> draft_pb2.GetDraftInfoResponse:
        return draft_pb2.GetDraftInfoResponse(
            model=self.model_name,
            vocab_size=self.vocab_size,
            tp_size=self.tp_size,
            method=self.config.method,
            max_speculative_tokens=self.config.max_speculative_tokens,
            sampled_top_k=self.config.sampled_top_k,
            markov_head=self.markov,
            markov_head_mode=self.config.markov_head_mode if self.markov else "",
            tp_bytes=sum(b for _, b in comm_stats().values()),
            draft_tokens=self.state.draft_tokens,
            draft_ahead_hits=self.state.ahead_hits,
            draft_ahead_misses=self.state.ahead_misses,
            max_batch_size=self.config.max_batch_size,
            free_slots=self.state.slots.num_free,
            feature_layers=list(self.state.runner.feature_layers or ()),
            feature_size=self.state.runner.model.config.feature_size,
        )
