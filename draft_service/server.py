"""The draft service's gRPC front (TP rank 0)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator

import grpc

from common.distributed import comm_stats
from common.metrics import ServiceMetrics
from draft_service.config import DraftConfig
from draft_service.state import DraftRequest, DraftState, Proposal
from specsplit.v1 import draft_pb2, draft_pb2_grpc

log = logging.getLogger("specsplit.draft")


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
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
        """`gpus`: the UUIDs of the GPUs of the draft's TP group (common.tp_executor.tp_gpu_uuids)."""
        self.config = config
        self.state = state
        self.metrics = metrics
        self.model_name = model_name
        self.vocab_size = vocab_size
        self.tp_size = tp_size
        self.markov = markov
        self.gpus = frozenset(gpus)
        self.engine_lock = threading.Lock()  # one model, many target streams
        self.streams = 0
        self.max_target_id = -1

    # -- helpers -------------------------------------------------------------
    def _update_gauges(self) -> None:
        self.metrics.kv_slots_used.set(self.state.slots.num_used)
        self.metrics.running.set(self.state.slots.num_used)

    def _check_request(
        self, msg: draft_pb2.SpeculateRequest, reqs: dict[int, DraftRequest], context: grpc.ServicerContext
    ) -> None:
        for s in msg.starts:
            if s.request_id in reqs:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"starts.request_id: {s.request_id} already live"
                )
            if not s.token_ids:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"starts.token_ids: empty for {s.request_id}")
            if max(s.token_ids) >= self.vocab_size:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"starts.token_ids: id >= vocab {self.vocab_size}"
                )
        for v in msg.verdicts:
            if v.request_id in reqs and v.start > len(reqs[v.request_id].committed):
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"verdicts.start: {v.start} beyond the context"
                )

    def _to_pb(self, request_id: int, p: Proposal) -> draft_pb2.Proposal:
        return draft_pb2.Proposal(
            request_id=request_id,
            token_ids=p.tokens,
            top_k=self.config.sampled_top_k if p.topk_ids else 0,
            topk_ids=p.topk_ids,
            topk_probs=p.topk_probs,
            draft_ahead_hit=p.ahead_hit,
        )

    def _ahead_for_stream(self, target_gpus: Iterable[str]) -> bool:
        """Whether to draft ahead for a stream whose target runs on `target_gpus`: not where one of them is
        the draft's own (unless --draft-ahead-shared-gpu), since there the round overlaps nothing and only
        delays the target's verify (one H200, B=1: verify 2.72 ms instead of 2.17, 1.24x plain, not 1.29x)."""
        if not self.config.draft_ahead:
            return False
        shared = ", ".join(sorted(self.gpus.intersection(target_gpus)))
        if not shared:
            return True
        if self.config.draft_ahead_shared_gpu:
            log.info("target shares GPU %s with the draft: draft-ahead anyway (--draft-ahead-shared-gpu)",
                     shared)  # fmt: skip
            return True
        log.info("target shares GPU %s with the draft: no draft-ahead for this stream", shared)
        return False

    # -- RPCs ------------------------------------------------------------------
    def Speculate(
        self, request_iterator: Iterator[draft_pb2.SpeculateRequest], context: grpc.ServicerContext
    ) -> Iterator[draft_pb2.SpeculateResponse]:
        # The messages are read here, in the servicer's own thread: a reader thread handing them over
        # through a queue cost one more GIL hand-off per message on the round trip.
        messages = iter(request_iterator)
        reqs: dict[int, DraftRequest] = {}
        self.streams += 1
        log.info("target stream opened (%s), %d open", context.peer(), self.streams)
        last_step = -1
        ahead = self.config.draft_ahead
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
                if msg.step <= last_step:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"step: {msg.step} not after {last_step}")
                if last_step < 0:  # the stream's first message names the target's GPUs
                    ahead = self._ahead_for_stream(msg.target_gpus)
                last_step = msg.step
                if msg.target_vocab_size and self.max_target_id >= msg.target_vocab_size:
                    context.abort(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"target_vocab_size: {msg.target_vocab_size} is smaller than the draft's "
                        f"vocabulary ({self.max_target_id + 1})",
                    )
                self._check_request(msg, reqs, context)
                with self.engine_lock:
                    response, proposed = self._step(msg, reqs, context)
                self.metrics.count_grpc_message("sent", "speculate_response", response.ByteSize())
                self.metrics.draft_handle.observe(time.perf_counter() - arrived)
                yield response
                # Draft-ahead runs while the target verifies. A single guess spares the target nothing
                # unless every request's hits; branches pay per request (the target verifies the hits
                # and decodes the rest plainly meanwhile).
                branching = self.state.branching and msg.want_branches
                if (
                    ahead
                    and proposed
                    and self.state.ahead_worthwhile(
                        self.config.draft_ahead_min_hit_rate, 1 if branching else len(proposed[0])
                    )
                ):
                    branches = self._draft_ahead(proposed, msg.step, branching)
                    if branches:
                        yield branches
        finally:
            with self.engine_lock:
                for req in reqs.values():
                    self.state.release(req)
                self._update_gauges()
            self.streams -= 1
            log.info("target stream closed (%s), %d open", context.peer(), self.streams)

    def _draft_ahead(self, proposed, step: int, branching: bool) -> draft_pb2.SpeculateResponse | None:
        """The next round for the likely outcomes of this one: branches, sent to the target at once (it
        may start its next step on them), or one all-accepted guess kept here (sampled drafting)."""
        with self.engine_lock:
            t0 = time.perf_counter()
            if not branching:
                if self.state.draft_ahead(*proposed):
                    self.metrics.draft_ahead_step.observe(time.perf_counter() - t0)
                return None
            branches = self.state.draft_branches(*proposed)
            if not branches:  # none fitted: no round ran, nothing to time or send
                return None
            self.metrics.draft_ahead_step.observe(time.perf_counter() - t0)
        response = draft_pb2.SpeculateResponse(step=step, branches=True)
        for rid, (base, items) in branches.items():
            response.proposals.append(
                draft_pb2.Proposal(
                    request_id=rid,
                    context_length=base,
                    candidates=[
                        draft_pb2.Candidate(appended=b.key, token_ids=b.proposal.tokens) for b in items
                    ],
                )
            )
        self.metrics.count_grpc_message("sent", "speculate_branches", response.ByteSize())
        return response

    def _step(
        self, msg: draft_pb2.SpeculateRequest, reqs: dict[int, DraftRequest], context: grpc.ServicerContext
    ):
        for rid in msg.releases:
            req = reqs.pop(rid, None)
            if req is not None:
                self.state.release(req)
        unknown: list[int] = []
        for s in msg.starts:
            try:
                reqs[s.request_id] = self.state.start(
                    s.request_id,
                    list(s.token_ids),
                    # A target may allow more than this draft drafts: propose fewer, never fail the stream.
                    min(s.num_speculative_tokens, self.config.max_speculative_tokens),
                    s.sampling.temperature,
                    s.sampling.seed,
                )
            except RuntimeError:  # out of KV slots: this request is not drafted for; the target re-sends it
                unknown.append(s.request_id)
        for v in msg.verdicts:
            if v.request_id not in reqs:
                unknown.append(v.request_id)
                continue
            hit = self.state.apply_verdict(reqs[v.request_id], v.start, list(v.token_ids))
            if hit is True:
                self.metrics.draft_ahead_hits.inc()
            elif hit is False:
                self.metrics.draft_ahead_misses.inc()
        unknown += [r for r in msg.propose if r not in reqs and r not in unknown]
        asked = [(reqs[r], msg.propose_k[i] if i < len(msg.propose_k) else 0)
                 for i, r in enumerate(msg.propose) if r in reqs]  # fmt: skip
        targets = [r for r, _ in asked]
        t0 = time.perf_counter()
        proposals = self.state.propose(targets, [k for _, k in asked]) if targets else {}
        elapsed = time.perf_counter() - t0
        if targets:
            if self.state.round_ran:  # a round of the model, not only proposals drafted ahead
                self.metrics.draft_step.observe(elapsed)
            self.metrics.drafts.inc(sum(1 for p in proposals.values() if p.tokens))
            self.metrics.draft_tokens.inc(sum(len(p.tokens) for p in proposals.values()))
        self._update_gauges()
        response = draft_pb2.SpeculateResponse(
            step=msg.step,
            proposals=[self._to_pb(rid, p) for rid, p in proposals.items()],
            unknown_request_ids=unknown,
            draft_seconds=elapsed,
            free_slots=self.state.slots.num_free,  # targets sharing this draft place requests by it
        )
        return response, (targets, proposals) if targets else None

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
        )
