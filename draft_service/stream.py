"""One target's stream of SpeculateRequests, whatever carries it: a gRPC Speculate call
(server.DraftServicer.Speculate) or a target in the same process (target_service/draft_local.py). What
every stream shares is a `SharedDraft`; the gRPC front (server.DraftServicer) is one.

Per message: releases, starts and verdicts are applied, then one round drafts for the requests the target
asked about, and the answer goes back; then, where it pays, the next round is drafted ahead while the
target verifies (branches are a second message). A message the draft must refuse raises StreamError
naming the field; the gRPC front turns it into that status and ends the stream.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator

import grpc

from common.features import FEATURE_PROTOCOL, from_wire
from common.metrics import ServiceMetrics
from draft_service.config import DraftConfig
from draft_service.state import DraftRequest, DraftState, Proposal
from specsplit.v1 import draft_pb2

log = logging.getLogger("specsplit.draft")
INVALID = grpc.StatusCode.INVALID_ARGUMENT


class StreamError(Exception):
    """A message the draft refuses: the stream ends with `code` and `details` (which name the field)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class SharedDraft:
    """What every target stream shares: the model's state and its lock, config, metrics, the draft's
    vocabulary and GPUs, and the open streams."""

    def __init__(
        self,
        config: DraftConfig,
        state: DraftState,
        metrics: ServiceMetrics,
        vocab_size: int,
        gpus: Iterable[str] = (),
    ):
        """`gpus`: the UUIDs of the GPUs of the draft's TP group (common.tp_executor.tp_gpu_uuids)."""
        self.config = config
        self.state = state
        self.metrics = metrics
        self._graphless = (0, 0)  # (eager rounds, captures while serving) already counted
        self.vocab_size = vocab_size
        self.gpus = frozenset(gpus)
        self.engine_lock = threading.Lock()  # one model, many target streams
        self.streams = 0
        self.max_target_id = -1
        # In the target's process (target_service/draft_local.py): its FeatureStore, read in place.
        self.target_features = None

    def update_gauges(self) -> None:
        self.metrics.kv_slots_used.set(self.state.slots.num_used)
        self.metrics.running.set(self.state.slots.num_used)

    def count_graphless(self, rounds) -> None:
        """The rounds that ran with no CUDA graph of their own since the last message (eagerly, or captured
        while serving: GreedyRounds._replay) go to their counters."""
        seen, now = self._graphless, (rounds.eager_rounds, rounds.serving_captures)
        if now != seen:
            self.metrics.draft_eager_rounds.inc(now[0] - seen[0])
            self.metrics.serving_captures.inc(now[1] - seen[1])
            self._graphless = now


class DraftStream:
    def __init__(self, draft: SharedDraft, peer: str):
        """`draft` holds what every stream shares: the model's state, its lock, config and metrics."""
        self.draft = draft
        self.peer = peer
        self.reqs: dict[int, DraftRequest] = {}
        self.last_step = -1
        self.ahead = draft.config.draft_ahead
        draft.streams += 1
        log.info("target stream opened (%s), %d open", peer, draft.streams)

    def close(self) -> None:
        """Frees every request of the stream (the target re-sends them on its next stream)."""
        draft = self.draft
        with draft.engine_lock:
            for req in self.reqs.values():
                draft.state.release(req)
            self.reqs.clear()
            draft.update_gauges()
        draft.streams -= 1
        log.info("target stream closed (%s), %d open", self.peer, draft.streams)

    def handle(
        self, msg: draft_pb2.SpeculateRequest, arrived: float, answer: bool = True
    ) -> Iterator[draft_pb2.SpeculateResponse]:
        """The answer to `msg` (which arrived at perf_counter `arrived`), then any branches drafted ahead.
        `answer` False: the target does not want the proposals (it read them from the round chained to
        its verify, target_service/draft_local.py), so the answer carries none.

        Draft-ahead runs after the answer is taken from this generator, i.e. while the target verifies."""
        draft = self.draft
        if msg.step <= self.last_step:
            raise StreamError(
                grpc.StatusCode.INVALID_ARGUMENT, f"step: {msg.step} not after {self.last_step}"
            )
        if self.last_step < 0:  # the stream's first message names the target's GPUs
            self.ahead = self._ahead_for(msg.target_gpus)
        self.last_step = msg.step
        if msg.target_vocab_size and draft.max_target_id >= msg.target_vocab_size:
            raise StreamError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"target_vocab_size: {msg.target_vocab_size} is smaller than the draft's vocabulary "
                f"({draft.max_target_id + 1})",
            )
        if draft.state.reads_features and msg.protocol_version < FEATURE_PROTOCOL:
            raise StreamError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"protocol_version: {msg.protocol_version}; this draft reads the target's features "
                f"(feature_layers {list(draft.state.runner.feature_layers)}): it needs a target of protocol "
                f"version {FEATURE_PROTOCOL} started with --draft-feature-layers",
            )
        self._check(msg)
        with draft.engine_lock:
            response, proposed = self._step(msg, answer)
        draft.metrics.draft_handle.observe(time.perf_counter() - arrived)
        yield response
        # A single guess spares the target nothing unless every request's hits; branches pay per request
        # (the target verifies the hits and decodes the rest plainly meanwhile).
        branching = draft.state.branching and msg.want_branches
        if (
            self.ahead
            and proposed
            and draft.state.ahead_worthwhile(
                draft.config.draft_ahead_min_hit_rate, 1 if branching else len(proposed[0])
            )
        ):
            branches = self._draft_ahead(proposed, msg.step, branching)
            if branches:
                yield branches

    def _ahead_for(self, target_gpus: Iterable[str]) -> bool:
        """Whether to draft ahead for a target that runs on `target_gpus`: not where one of them is the
        draft's own (unless --draft-ahead-shared-gpu), since there the round overlaps nothing and only
        delays the target's verify (B=1: verify 2.72 ms instead of 2.17, 1.24x plain, not 1.29x)."""
        config = self.draft.config
        if not config.draft_ahead:
            return False
        shared = ", ".join(sorted(self.draft.gpus.intersection(target_gpus)))
        if not shared:
            return True
        if config.draft_ahead_shared_gpu:
            log.info("target shares GPU %s with the draft: draft-ahead anyway (--draft-ahead-shared-gpu)",
                     shared)  # fmt: skip
            return True
        log.info("target shares GPU %s with the draft: no draft-ahead for this stream", shared)
        return False

    def _check(self, msg: draft_pb2.SpeculateRequest) -> None:
        reqs, vocab = self.reqs, self.draft.vocab_size
        for s in msg.starts:
            if s.request_id in reqs:
                raise StreamError(
                    grpc.StatusCode.INVALID_ARGUMENT, f"starts.request_id: {s.request_id} already live"
                )
            if not s.token_ids:
                raise StreamError(
                    grpc.StatusCode.INVALID_ARGUMENT, f"starts.token_ids: empty for {s.request_id}"
                )
            if max(s.token_ids) >= vocab:
                raise StreamError(INVALID, f"starts.token_ids: id >= vocab {vocab}")
        for v in msg.verdicts:
            if v.request_id in reqs and v.start > len(reqs[v.request_id].committed):
                raise StreamError(
                    grpc.StatusCode.INVALID_ARGUMENT, f"verdicts.start: {v.start} beyond the context"
                )

    def _step(self, msg: draft_pb2.SpeculateRequest, answer: bool = True):
        draft, state, metrics, reqs = self.draft, self.draft.state, self.draft.metrics, self.reqs
        for rid in msg.releases:
            req = reqs.pop(rid, None)
            if req is not None:
                state.release(req)
        unknown: list[int] = []
        for s in msg.starts:
            try:
                reqs[s.request_id] = state.start(
                    s.request_id,
                    list(s.token_ids),
                    # A target may allow more than this draft drafts: propose fewer, never fail the stream.
                    min(s.num_speculative_tokens, draft.config.max_speculative_tokens),
                    s.sampling.temperature,
                    s.sampling.seed,
                )
            except RuntimeError:  # out of KV slots: this request is not drafted for; the target re-sends it
                unknown.append(s.request_id)
                continue
            if state.reads_features:
                req = reqs[s.request_id]
                if s.HasField("target_slot") and draft.target_features is not None:
                    req.target_slot = s.target_slot
                    state.map_features(req, s.target_slot)  # read where the target wrote them
                else:
                    rows = self._features(req, 0, len(s.token_ids) - 1, s.features, "starts")
                    state.add_features(req, 0, rows)
        for v in msg.verdicts:
            if v.request_id not in reqs:
                unknown.append(v.request_id)
                continue
            req = reqs[v.request_id]
            if state.reads_features and req.target_slot < 0:
                first = max(v.start - 1, 0)
                rows = self._features(req, first, v.start + len(v.token_ids) - 1, v.features, "verdicts")
                state.add_features(req, first, rows)
            hit = state.apply_verdict(req, v.start, list(v.token_ids))
            if hit is True:
                metrics.draft_ahead_hits.inc()
            elif hit is False:
                metrics.draft_ahead_misses.inc()
        if state.reads_features and msg.starts:  # started, not asked for: caught up now, drafted later
            asked_ids = set(msg.propose)
            state.warm([reqs[x.request_id] for x in msg.starts
                        if x.request_id in reqs and x.request_id not in asked_ids])  # fmt: skip
        unknown += [r for r in msg.propose if r not in reqs and r not in unknown]
        asked = [(reqs[r], msg.propose_k[i] if i < len(msg.propose_k) else 0)
                 for i, r in enumerate(msg.propose) if r in reqs]  # fmt: skip
        targets = [r for r, _ in asked]
        t0 = time.perf_counter()
        proposals = state.propose(targets, [k for _, k in asked]) if targets else {}
        elapsed = time.perf_counter() - t0
        # Rounds chained to the target's verify (DraftState.chain) ran before this message: their GPU time.
        for seconds in state.chained_seconds:
            metrics.draft_step.observe(seconds)
        state.chained_seconds.clear()
        draft.count_graphless(state.runner.rounds)
        if targets:
            if state.round_ran:  # a round of the model, not only proposals drafted ahead
                metrics.draft_step.observe(elapsed)
            metrics.drafts.inc(sum(1 for p in proposals.values() if p.tokens))
            metrics.draft_tokens.inc(sum(len(p.tokens) for p in proposals.values()))
        draft.update_gauges()
        response = draft_pb2.SpeculateResponse(
            step=msg.step,
            # At B=64 the proposals' messages are a quarter of a held ask's handling (CPU profile), which
            # must end within the target's verify for the next chained round to follow it.
            proposals=[self._to_pb(rid, p) for rid, p in proposals.items()] if answer else [],
            unknown_request_ids=unknown,
            draft_seconds=elapsed,
            free_slots=state.slots.num_free,  # targets sharing this draft place requests by it
        )
        return response, (targets, proposals) if targets else None

    def _features(self, req: DraftRequest, first: int, end: int, data: bytes, field: str):
        """The target's features of positions first..end - 1 for `req`, from the message's bf16 bytes."""
        size = self.draft.state.runner.model.config.feature_size
        try:
            rows = from_wire(data, size, f"{field}.features")
        except ValueError as exc:
            raise StreamError(INVALID, str(exc)) from exc
        if len(rows) != max(end - first, 0):
            raise StreamError(
                INVALID,
                f"{field}.features: {len(rows)} rows for request {req.request_id}, expected {end - first} "
                "(one per position before each new token)",
            )
        return rows

    def _to_pb(self, request_id: int, p: Proposal) -> draft_pb2.Proposal:
        return draft_pb2.Proposal(
            request_id=request_id,
            token_ids=p.tokens,
            top_k=self.draft.config.sampled_top_k if p.topk_ids else 0,
            topk_ids=p.topk_ids,
            topk_probs=p.topk_probs,
            draft_ahead_hit=p.ahead_hit,
        )

    def _draft_ahead(self, proposed, step: int, branching: bool) -> draft_pb2.SpeculateResponse | None:
        """The next round for the likely outcomes of this one: branches, sent to the target at once (it
        may start its next step on them), or one all-accepted guess kept here (sampled drafting)."""
        draft = self.draft
        with draft.engine_lock:
            t0 = time.perf_counter()
            if not branching:
                if draft.state.draft_ahead(*proposed):
                    draft.metrics.draft_ahead_step.observe(time.perf_counter() - t0)
                return None
            branches = draft.state.draft_branches(*proposed)
            if not branches:  # none fitted: no round ran, nothing to time or send
                return None
            draft.metrics.draft_ahead_step.observe(time.perf_counter() - t0)
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
        return response
