"""The target's side of the draft protocol: what the draft knows of each request, and proposals.

One object owns the protocol state the scheduler must not see: the stream epoch (a new stream means the
draft knows nothing: every request is started again), pending releases, each request's synced length,
and the one ask in flight. A step works in two halves so the draft's round overlaps the target's host
work: `ask` sends starts/verdicts and the list of requests to draft for, without waiting; `collect`
waits for that answer (bounded by --draft-timeout) just before the verify forward needs it. Requests
admitted after the ask get an ask of their own, so they are drafted for from their first step.

A step that wants no proposals sends nothing and waits for nothing: verdicts stay pending (the next ask
sends everything the draft has not seen), and so do releases until RELEASE_BATCH of them wait or the
batch empties; then they go out without waiting for an answer.

Branches: after answering, a greedy draft drafts the next proposal for each likely outcome of verifying
the one it sent, and sends them as candidates keyed by the tokens the verdict will append. When every
request of an ask finds its committed sequence among them, the step verifies those and does not wait
for the answer (dropped when it comes): the draft's round and the transport overlap the target's
verify instead of adding to it. When only some do, the step goes on without waiting if that yields
more tokens per second than waiting would (the others decode one token plainly this step; the draft
sends a candidate for that outcome too). A candidate is a draft for exactly the committed sequence it
is keyed by, so using one is lossless whatever was verified before.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from common.features import FEATURE_PROTOCOL, FeatureStore, to_wire
from common.metrics import ServiceMetrics
from specsplit.v1 import draft_pb2
from target_service.draft_link import ChainedRound, DraftLink
from target_service.request import Request

log = logging.getLogger("specsplit.target")
# Releases a step that asks for nothing keeps back until this many wait (an ask, or an empty batch, sends
# them at once): each message hands the draft's thread the GIL inside the step, and at 64 streams requests
# end every few steps. The draft applies a message's releases before its starts, so slots held meanwhile
# never keep a new request out.
RELEASE_BATCH = 64


@dataclass
class Proposal:
    """A checked proposal: k draft tokens, and the sparse q when the draft sampled them."""

    tokens: list[int]
    topk_ids: list[int] | None = None  # k * topk_width ids
    topk_probs: list[float] | None = None
    topk_width: int = 0


def checked_tokens(request_id: int, tokens, k: int, vocab_size: int) -> list[int]:
    """The first k drafted tokens, or none when one of them is outside the target's vocabulary (it would
    index past the embedding table)."""
    out = list(tokens[:k])
    if out and max(out) >= vocab_size:
        log.warning("dropping a draft proposal for request %d: token outside the vocabulary", request_id)
        return []
    return out


def checked_proposal(p: draft_pb2.Proposal | None, k: int, vocab_size: int) -> Proposal:
    """A proposal's first k tokens and its sparse q; empty when it is malformed.

    A draft is a separate service: a proposal whose top-K lists do not match its tokens, or whose
    probabilities are not a distribution, is dropped (the request decodes plainly this step) instead
    of failing the batch or biasing the output.
    """
    if p is None:
        return Proposal([])
    tokens = checked_tokens(p.request_id, p.token_ids, k, vocab_size)
    if not tokens:
        return Proposal([])
    if not p.top_k:
        return Proposal(tokens)
    width = p.top_k
    ids, probs = list(p.topk_ids), list(p.topk_probs)
    if len(ids) != len(probs) or len(ids) < len(tokens) * width or max(ids) >= vocab_size:
        log.warning(
            "dropping a malformed draft proposal for request %d: top-K lists do not match", p.request_id
        )
        return Proposal([])
    for i, tok in enumerate(tokens):
        row, row_ids = probs[i * width : (i + 1) * width], ids[i * width : (i + 1) * width]
        if tok not in row_ids or not all(0.0 <= x <= 1.0 for x in row) or abs(sum(row) - 1.0) > 1e-3:
            log.warning("dropping a malformed draft proposal for request %d: q is not a distribution "
                        "containing the drafted token", p.request_id)  # fmt: skip
            return Proposal([])
    n = len(tokens) * width
    return Proposal(tokens, ids[:n], probs[:n], width)


@dataclass
class Ask:
    step: int
    epoch: int
    sent: float
    ks: dict[int, int]  # draft id -> tokens asked
    # No starts and no verdict longer than a round: the draft's answer time is a round's cost, not a
    # prefill's or a catch-up's (after plain steps), so the speculation policy may learn from it.
    steady: bool = True
    # The draft's round chained to the last verify (draft in this process), drafting for every asked
    # request: its tokens are the answer's, read from the round without waiting for the draft's thread.
    chained: ChainedRound | None = None


class DraftSession:
    def __init__(
        self,
        link: DraftLink | None,
        metrics: ServiceMetrics,
        timeout: float,
        features: FeatureStore | None = None,
    ):
        self.link = link
        self.features = features  # the target's features, for a draft that reads them (common/features.py)
        self._feature_check: tuple[int, bool] = (-1, False)  # (epoch, whether the draft's layers match)
        # The draft runs in this process (an InProcessDraft: draft_local.py) and shares its GIL.
        self.draft_in_process = bool(getattr(link, "in_process", False))
        self.metrics = metrics
        self.timeout = timeout
        self.step_no = 0
        self.epoch = 0
        self.releases: list[int] = []
        self.inflight: list[Ask] = []  # asks sent, answers not yet collected (in step order)
        self.decided: set[int] = set()  # draft ids asked for (or decided k = 0) since the last collect
        self._ids = itertools.count(1)
        self.last_wait = 0.0  # seconds the last collect() blocked
        self.last_wait_steady = False  # whether that wait was for steady-state asks only
        self.last_asked = False  # whether any ask was in flight at that collect
        # draft id -> (committed length, {appended tokens: proposal}) from the latest branches message
        self.candidates: dict[int, tuple[int, dict[tuple[int, ...], list[int]]]] = {}
        # Running figures for going on with part of the branches: accepted drafts per speculating
        # request and step, verify seconds per step, and the draft's round trip.
        self.want_branches = True  # ask the draft for branches (the adaptive policy's branch gate decides)
        self.accepted_per_row = 1.0
        self.verify_seconds = 0.0
        self.round_trip = 0.0
        # New requests were started without proposals since the last chained round (`ask` with warm): the
        # next verify chains a round for them even when no request verifies drafts.
        self.warmed = False
        self.longest_verdict = 0  # tokens of the longest verdict in the latest message (_message)

    def chain(self, batch: list[Request], drafts: list[list[int]], packed, width: int) -> None:
        """With the draft in this process: its next round for the greedy requests that verified drafts
        (a feature draft's: every greedy request, it re-feeds what the verify emitted), launched from the
        verify output `packed` on the device (InProcessDraft.chain)."""
        self.warmed = False
        every = self.draft_reads_features()
        rows = [(i, req.draft.draft_id, d) for i, (req, d) in enumerate(zip(batch, drafts))
                if (d or every) and req.temperature <= 0]  # fmt: skip
        if rows and self.link is not None and self.link.epoch == self.epoch:
            self.link.chain(rows, packed, width, self.epoch)

    @property
    def attached(self) -> bool:
        return self.link is not None

    @property
    def connected(self) -> bool:
        return self.link is not None and self.link.connected

    def register(self, req: Request) -> None:
        req.draft.draft_id = next(self._ids)

    def release(self, req: Request) -> None:
        """The request left the batch: free its draft state with the next message."""
        self.candidates.pop(req.draft.draft_id, None)
        if req.draft.synced >= 0:
            self.releases.append(req.draft.draft_id)
            req.draft.synced = -1

    def _new_epoch(self, epoch: int, batch: list[Request]) -> None:
        """A new stream: the draft knows nothing (releases moot, every request starts again)."""
        self.epoch = epoch
        self.releases.clear()
        self.candidates.clear()
        for req in batch:
            req.draft.synced = -1

    def _message(self, want: list[Request], ks: dict[int, int]) -> draft_pb2.SpeculateRequest:
        """The next message: releases, starts and verdicts of `want`, and the proposals `ks` asks for.
        Sets `longest_verdict` (tokens of its longest verdict)."""
        self.step_no += 1
        msg = draft_pb2.SpeculateRequest(
            step=self.step_no,
            releases=self.releases,
            want_branches=self.want_branches,
            protocol_version=FEATURE_PROTOCOL,
        )
        self.releases = []
        # A draft in this process reads the features in the target's store: a start names its slot, a
        # verdict needs none. Otherwise (part, slot, first position, end): features the draft lacks.
        reads_features = self.draft_reads_features()
        in_place = reads_features and self.draft_in_process
        feature_rows = []
        # add() builds each part in the message (append() would copy it): at B=64 a third of the ask.
        add_start, add_verdict = msg.starts.add, msg.verdicts.add
        longest = 0
        for req in want:
            d, tokens = req.draft, req.tokens
            synced, end = d.synced, len(tokens)
            if synced < 0:
                start = add_start(request_id=d.draft_id, token_ids=tokens, sampling=req.sampling,
                                  num_speculative_tokens=req.k)  # fmt: skip
                if in_place:
                    start.target_slot = req.slot
                elif reads_features:
                    feature_rows.append((start, req.slot, 0, end - 1))
            elif synced < end:
                verdict = add_verdict(request_id=d.draft_id, start=synced, token_ids=tokens[synced:],
                                      accepted=d.last_accepted)  # fmt: skip
                longest = max(longest, end - synced)
                if reads_features and not in_place:
                    feature_rows.append((verdict, req.slot, max(synced - 1, 0), end - 1))
            d.synced = end
        self.longest_verdict = longest
        if feature_rows:
            self._attach_features(feature_rows)
        msg.propose.extend(ks)
        msg.propose_k.extend(ks.values())
        return msg

    def draft_reads_features(self) -> bool:
        """Whether the draft reads target features and this target captures its layers. A mismatch is
        logged once per stream and leaves the draft unused (plain decoding), not fed wrong features."""
        info = getattr(self.link, "info", None)
        if info is None or not info.feature_layers:
            return False
        epoch = self.link.epoch
        if self._feature_check[0] != epoch:
            have = self.features.layers if self.features is not None else ()
            ok = tuple(info.feature_layers) == tuple(have)
            if not ok:
                log.error("the draft reads the target's features of layers %s; this target captures %s: "
                          "start it with --draft-feature-layers %s", list(info.feature_layers), list(have),
                          ",".join(map(str, info.feature_layers)))  # fmt: skip
            self._feature_check = (epoch, ok)
        return self._feature_check[1]

    def _attach_features(self, rows: list) -> None:
        """Each (start or verdict, slot, first, end) gets the features of positions first..end - 1 as bf16
        bytes: views of the store joined by one copy, read back once."""
        data = self.features.data
        gathered = torch.cat([data[slot, first:end] for _, slot, first, end in rows])
        payload = to_wire(gathered)
        row_bytes = 2 * self.features.size
        at = 0
        for part, _, first, end in rows:
            n = max(end - first, 0) * row_bytes
            part.features = payload[at : at + n]
            at += n
        # Part of the messages counted by kind "speculate", and apart under their own kind.
        self.metrics.grpc_bytes("sent", "target_features").inc(len(payload))

    def ask(self, batch: list[Request], k: int, max_context: int, warm: bool = False) -> None:
        """Ask for min(k, r.k) tokens for every request of `batch` that can take them; no waiting.
        k = 0 sends nothing but releases, once RELEASE_BATCH wait or `batch` is empty. `warm` (new
        requests, before their first step): with a feature draft in this process that chains its rounds,
        greedy new requests are only started, held back with the draft's catch-up over their prompts
        until the verify is launched; they verify no drafts in their first step and the round chained to
        it drafts for them, where an ask now would make the step wait for a round of their own before its
        verify."""
        link = self.link
        self.decided.update(r.draft.draft_id for r in batch)
        if link is None:
            return
        if not link.connected:
            if k > 0 and any(r.k > 0 for r in batch):
                self.metrics.fallback_steps.inc()
            return
        if link.epoch != self.epoch:
            self._new_epoch(link.epoch, batch)
        # The round chained to the verify just committed drafts for the next step; any later ask is for
        # another context (after a plain step, say) and must not take it.
        chained = link.take_chained(self.epoch) if self.draft_in_process else None
        ks = {}
        want = []
        # A plain step (k = 0) asks for nothing unless a request pins its k: no per-request pass then (at
        # B=64 that pass made the adaptive target's plain steps ~4 % slower than a target without a draft).
        for r in batch if k > 0 or any(r.pinned_k for r in batch) else ():
            # A seeded sampled request keeps its own k: its output then depends on its seed alone, not
            # on the batch it shares (the policy's k does; greedy output never depends on k).
            n = r.k if r.pinned_k else min(k, r.k)
            if n > 0 and len(r.tokens) + n < max_context:
                want.append(r)
                ks[r.draft.draft_id] = n
        if not want:
            if self.releases and (len(self.releases) >= RELEASE_BATCH or not batch):
                link.send(self._message([], {}), self.epoch)  # bookkeeping only: its answer is dropped
            return
        if warm and self._warms(link, want):
            sent = link.send(self._message(want, {}), self.epoch, hold=True)
            self.warmed = self.warmed or sent
            return
        msg = self._message(want, ks)
        if chained is not None and (msg.starts or any(rid not in chained.index for rid in ks)):
            chained = None
        # An ask the chained round answers is held back on the draft's side (InProcessDraft.send).
        sent = link.send(msg, self.epoch, hold=True) if chained is not None else link.send(msg, self.epoch)
        if sent:
            steady = not msg.starts and self.longest_verdict <= max(ks.values()) + 1
            self.inflight.append(Ask(msg.step, self.epoch, time.perf_counter(), ks, steady, chained))
        else:
            self.metrics.fallback_steps.inc()

    def _warms(self, link, want: list[Request]) -> bool:
        return (
            self.draft_in_process
            and getattr(link, "queues_held", False)
            and self.draft_reads_features()
            and all(r.draft.synced < 0 and r.temperature <= 0 for r in want)
        )

    def covered(self) -> set[int]:
        """Draft ids asked for (or decided k = 0) since the last collect: the others still need an ask."""
        return self.decided

    def collect(
        self, batch: list[Request], before_wait: Callable[[], None] | None = None
    ) -> dict[int, Proposal]:
        """The proposals of every ask in flight, by draft id ({} where none was asked or it came too late).
        `before_wait` runs before the first wait for an answer (none when the branches cover the step)."""
        asks, self.inflight = self.inflight, []
        self.decided = set()
        self.last_wait = 0.0
        self.last_asked = bool(asks)
        self.last_wait_steady = self.last_asked and all(a.steady for a in asks)
        out: dict[int, Proposal] = {}
        if self.link is None:
            return out
        t0 = time.perf_counter()
        for ask in asks:
            out.update(self._collect(ask, batch, before_wait))
            before_wait = None
        self.last_wait = time.perf_counter() - t0
        return out

    def _store_candidates(self, response: draft_pb2.SpeculateResponse) -> None:
        for p in response.proposals:
            table = {tuple(c.appended): list(c.token_ids) for c in p.candidates}
            self.candidates[p.request_id] = (p.context_length, table)

    def note_step(self, drafted_rows: int, accepted: int, verify_seconds: float) -> None:
        """One step's outcome (from the scheduler): what going on without some proposals would lose."""
        if drafted_rows:
            self.accepted_per_row = 0.9 * self.accepted_per_row + 0.1 * accepted / drafted_rows
        self.verify_seconds = verify_seconds if not self.verify_seconds else (
            0.9 * self.verify_seconds + 0.1 * verify_seconds)  # fmt: skip

    def _from_candidates(self, ask: Ask, batch: list[Request]) -> dict[int, Proposal] | None:
        """Asked requests' proposals from the branches: all of them, or those that have one when going on
        without the others beats waiting for the answer (and they are at least half); None: wait."""
        assert self.link is not None
        out: dict[int, Proposal] = {}
        pinned = False  # a seeded sampled request always verifies its own k drafts: never left out
        for req in batch:
            rid = req.draft.draft_id
            k, entry = ask.ks.get(rid), self.candidates.get(rid)
            if k is None:
                continue
            tokens = None
            if entry is not None and len(req.tokens) > entry[0]:
                tokens = entry[1].get(tuple(req.tokens[entry[0] :]))
            tokens = checked_tokens(rid, tokens, k, self.link.target_vocab_size) if tokens else None
            if tokens:
                out[rid] = Proposal(tokens)
            else:
                pinned = pinned or req.pinned_k
        missed = len(ask.ks) - len(out)
        if not out:
            return None
        if len(out) < missed or (missed and (pinned or not self._go_on(len(out), missed, ask))):
            return None
        self.metrics.pipelined_steps.inc()
        return out

    def _go_on(self, hits: int, missed: int, ask: Ask) -> bool:
        """Tokens per second of this step with `missed` requests decoding one token plainly, now, against
        all of them speculating after the rest of the round trip (the step's verify the same)."""
        if not self.verify_seconds:
            return False
        tokens = 1.0 + self.accepted_per_row
        wait = max(0.0, self.round_trip - (time.perf_counter() - ask.sent))
        verify = self.verify_seconds
        return (hits * tokens + missed) * (verify + wait) >= (hits + missed) * tokens * verify

    def _from_chained(self, ask: Ask) -> dict[int, Proposal] | None:
        """The proposals of an ask the round chained to the last verify answers: read from the round once
        the GPU has run it, without waiting for the draft's thread (its answer would carry the same
        tokens: DraftState.apply_verdict takes the round as its proposal). None: the stream is gone."""
        link = self.link
        assert link is not None and ask.chained is not None
        if ask.epoch != link.epoch or not link.connected:
            return None
        vocab = link.target_vocab_size
        out = {
            rid: Proposal(checked_tokens(rid, ask.chained.tokens(rid, k), k, vocab))
            for rid, k in ask.ks.items()
        }
        self.metrics.pipelined_steps.inc()
        return out

    def _collect(self, ask: Ask, batch: list[Request], before_wait: Callable[[], None] | None = None
                 ) -> dict[int, Proposal]:  # fmt: skip
        assert self.link is not None
        if ask.chained is not None and (chained := self._from_chained(ask)) is not None:
            return chained
        # A steady ask (verdicts of one step, no starts) may be covered by the branches already here.
        hits = self._from_candidates(ask, batch) if ask.steady and self.candidates else None
        if hits is not None:
            return hits

        def on_branches(response: draft_pb2.SpeculateResponse) -> bool:
            nonlocal hits
            self._store_candidates(response)
            if ask.steady:
                hits = self._from_candidates(ask, batch)
            return hits is not None

        if before_wait is not None:
            before_wait()
        response = self.link.receive(ask.step, ask.epoch, ask.sent + self.timeout, on_branches)
        if hits is not None:
            return hits
        now = time.perf_counter()
        if response is None:
            self.metrics.fallback_steps.inc()
            if self.link.connected and self.link.epoch == ask.epoch:
                log.warning("draft answered step %d too late; verified it with k = 0", ask.step)
            return {}
        self.metrics.round_trip.observe(now - ask.sent)
        self.round_trip = (
            now - ask.sent if not self.round_trip else 0.9 * self.round_trip + 0.1 * (now - ask.sent)
        )
        if response.unknown_request_ids:
            unknown = set(response.unknown_request_ids)
            for req in batch:
                if req.draft.draft_id in unknown:
                    req.draft.synced = -1  # started again with the next ask
        return {
            p.request_id: checked_proposal(p, ask.ks.get(p.request_id, 0), self.link.target_vocab_size)
            for p in response.proposals
            if p.request_id in ask.ks
        }
