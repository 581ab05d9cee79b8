"""Continuous batching for the target: plan → propose → verify → commit, one step at a time.

One loop on TP rank 0. A step reads in four lines (`_step`):
- plan: drop cancelled requests, admit waiting ones (prefill), and let the speculation policy pick k;
- propose: the draft's proposals for this batch (`DraftSession`: asked at the end of the previous step,
  so the draft round overlaps this loop's host work; a step with k = 0 sends nothing, waits for nothing);
- verify: one graph replay for the forward over [t_n, d_1..d_k] of every request and the rejection
  kernel, one small read-back (`TargetRunner.step`);
- commit: stop checks on token ids, the next ask to the draft; the new tokens go to the streamer thread
  (`target_service/streamer.py`) once the next step's forward is launched, off the critical path. What
  the step teaches the policy and its gates, and its metrics: `StepAccounting` (step_accounting.py).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from functools import partial

from common.kv_cache import SlotTable
from common.metrics import ServiceMetrics
from target_service.config import TargetConfig
from target_service.draft_link import DraftLink
from target_service.draft_session import DraftSession, Proposal, checked_proposal
from target_service.logprobs import add_pending_logprobs
from target_service.request import FINISH, Request, Status, check_stop
from target_service.runner import StepRow, TargetRunner
from target_service.step_accounting import StepAccounting, StepReport
from target_service.step_profile import StepProfile
from target_service.streamer import Streamer

__all__ = ["NotAccepting", "QueueFull", "Request", "Scheduler", "checked_proposal"]

log = logging.getLogger("specsplit.target")


class QueueFull(Exception):
    pass


class NotAccepting(Exception):
    pass


class Scheduler:
    def __init__(
        self,
        runner: TargetRunner,
        config: TargetConfig,
        metrics: ServiceMetrics,
        link: DraftLink | None,
        eos_ids: frozenset[int],
    ):
        self.runner = runner
        self.config = config
        self.metrics = metrics
        self.captures_counted = 0  # runner.captures_at_serving already in the serving_captures metric
        self.link = link
        self.eos_ids = eos_ids
        self.session = DraftSession(link, metrics, config.draft_timeout, runner.feature_store)
        # The accounting feeds the policy's costs and gates after each step; the plan (_ask) reads the policy.
        acc = self.accounting = StepAccounting(
            config, runner.batch_buckets, runner.step_costs, self.session, metrics
        )
        self.policy, self.costs, self.trace = acc.policy, acc.costs, acc.trace
        self.profile = StepProfile(config.profile_dir, config.profile_steps) if config.profile_dir else None
        self.policy_errors = 0  # exceptions the policy, gates or accounting raised (_safely)
        self.slots = SlotTable(config.max_batch_size)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.deferred_steps = 0  # steps the waiting requests that fit have waited for their group (_due)
        self.batch_peak = 0  # the most requests running at once since the batch was last empty (_due)
        self.by_id: dict[str, Request] = {}
        self.delivering = 0  # finished requests whose last message the streamer has not written yet
        self.lock = threading.Condition()
        self.accepting = True
        self.stopped = threading.Event()
        self.verify_backend = runner.verify_backend
        self.streamer = Streamer(
            metrics, self._delivered, config.stream_interval, config.stream_messages_per_step
        )
        # A step's tokens wait here until the next step's forward is launched (or the draft's answer is
        # awaited): the streamer and the event loop then take the GIL while the GPU works, not while the
        # launch is prepared. First tokens, finishing steps and an idle batch hand them over at once.
        self.to_stream: list[tuple[Request, list[int]]] = []
        self.to_stream_at = 0.0
        self.asked_k = 0  # the k of the latest ask for the whole batch (the step trace)
        self.not_drafting = ""  # why the latest ask drafted nothing though the batch allowed it
        # Labelled series exist from the start, so rate() sees their first increase.
        for reason in ("length", "eos", "stop_token", "stop_string", "aborted"):
            metrics.finished(reason)
        self.thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)

    # -- called from gRPC threads ------------------------------------------------
    def submit(self, req: Request) -> None:
        with self.lock:
            if not self.accepting:
                raise NotAccepting("the server is draining")
            if req.request_id in self.by_id:
                raise ValueError(f"request_id: {req.request_id!r} is already running")
            if len(self.waiting) >= self.config.max_queued_requests:
                raise QueueFull(f"queue full: {len(self.waiting)} requests waiting")
            self.session.register(req)
            req.tokens = list(req.prompt)
            self.by_id[req.request_id] = req
            self.waiting.append(req)
            self.metrics.waiting.set(len(self.waiting))
            self.lock.notify()

    def cancel(self, request_id: str, reason: str) -> bool:
        with self.lock:
            req = self.by_id.get(request_id)
            if req is None:
                return False
            req.cancelled = req.cancelled or reason
            self.lock.notify()
            return True

    def stop_accepting(self) -> None:
        with self.lock:
            self.accepting = False

    def num_active(self) -> int:
        with self.lock:
            return len(self.waiting) + len(self.running) + self.delivering

    def start(self) -> None:
        self.streamer.start()
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()
        with self.lock:
            self.lock.notify()
        self.thread.join(timeout=30)
        self._hand_over_tokens()
        self.streamer.stop()
        if self.trace is not None:
            self.trace.close()
        if self.profile is not None:
            self.profile.finish()

    # -- the loop ----------------------------------------------------------------
    def _loop(self) -> None:
        while not self.stopped.is_set():
            with self.lock:
                while not (self.waiting or self.running or self.session.releases or self.stopped.is_set()):
                    self.lock.wait(timeout=0.5)
            try:
                self._drop_cancelled()
                self._admit()
                if self.running:
                    self._step()
                else:
                    self._hand_over_tokens()
                    if self.trace is not None:
                        self.trace.flush()
                    if self.session.releases:  # nothing running: free the draft's state now
                        self.session.ask([], 0, self.runner.max_context)
            except Exception:  # keep serving; fail the requests of this step loudly
                log.exception("step failed; failing the running requests")
                self.session.inflight, self.session.decided = [], set()
                for req in list(self.running):
                    self._finish(req, FINISH.FINISH_REASON_ABORTED, error="internal error in the step")
        with self.lock:
            left = list(self.waiting) + list(self.running)
        for req in left:
            self._finish(req, FINISH.FINISH_REASON_ABORTED, error="server stopped")

    def _drop_cancelled(self) -> None:
        with self.lock:
            gone = [r for r in (*self.waiting, *self.running) if r.cancelled]
        for req in gone:
            reason = FINISH.FINISH_REASON_STOP_STRING if req.cancelled == "stop_string" else None
            self._finish(req, reason or FINISH.FINISH_REASON_ABORTED)

    def _due(self, fits: int) -> bool:
        """With --admit-wait-steps N > 0 and a batch decoding: whether the `fits` waiting requests that fit
        join it now, i.e. they fill --admit-group of the batch (its peak since it was last empty: slots of
        finished requests whose clients have not sent the next one yet count) or have waited N steps. A
        join costs a prefill forward however few its rows."""
        group = max(1, int(max(self.batch_peak, len(self.running) + fits) * self.config.admit_group))
        return fits >= group or self.deferred_steps >= self.config.admit_wait_steps

    def _admit(self) -> None:
        admitted = []
        with self.lock:
            if not self.running:
                self.batch_peak = 0
            fits = min(len(self.waiting), self.config.max_batch_size - len(self.running), self.slots.num_free)
            if fits and self.running and self.config.admit_wait_steps and not self._due(fits):
                self.deferred_steps += 1
                return
            self.deferred_steps = 0
            for _ in range(fits):
                req = self.waiting.popleft()
                req.slot = self.slots.alloc()
                req.admitted = time.perf_counter()
                req.status = Status.RUNNING
                admitted.append(req)
            self.metrics.waiting.set(len(self.waiting))
        if not admitted:
            return
        for req in admitted:
            self.metrics.queue_time.observe(req.admitted - req.arrival)
        needs_prefill = [r for r in admitted if len(r.prompt) > 1]
        if needs_prefill:
            self.runner.executor.run(
                "prefill", rows=[r.prompt[:-1] for r in needs_prefill], slots=[r.slot for r in needs_prefill]
            )
        for req in admitted:
            self.slots.lengths[req.slot] = len(req.prompt) - 1
        with self.lock:
            self.running.extend(admitted)
            self.batch_peak = max(self.batch_peak, len(self.running))
        self._update_gauges()

    def _update_gauges(self) -> None:
        self.metrics.running.set(len(self.running))
        self.metrics.batch_size.set(len(self.running))
        self.metrics.kv_slots_used.set(self.slots.num_used)

    # -- one step ----------------------------------------------------------------
    def _step(self) -> None:
        if self.profile is not None:
            self.profile.step()
        t0 = time.perf_counter()
        batch = list(self.running)
        covered = self.session.covered()
        new = [r for r in batch if r.draft.draft_id not in covered]
        if new:  # admitted since the last ask (or the first step): ask for them too, from their first step
            self._ask(batch, new)
        t1 = time.perf_counter()
        # propose: the last step's tokens go to the streamer while the draft's answer is awaited, unless the
        # draft runs in this process (--draft-local): there the streamer and the event loop would take the
        # GIL from the draft's round, and the runner hands them over once the verify is launched instead.
        hand_over = None if self.session.draft_in_process else self._hand_over_tokens
        proposals = self.session.collect(batch, hand_over)
        t2 = time.perf_counter()
        rows, drafts = self._rows(batch, proposals)
        width = max(len(d) for d in drafts) + 1
        chain = None
        if self.session.draft_in_process and self.config.draft_chain and (width > 1 or self.session.warmed):
            chain = partial(self.session.chain, batch, drafts, width=width)
        result = self.runner.step(rows, width, self._hand_over_tokens, chain)  # verify
        if self.runner.captures_at_serving != self.captures_counted:
            self.metrics.serving_captures.inc(self.runner.captures_at_serving - self.captures_counted)
            self.captures_counted = self.runner.captures_at_serving
        add_pending_logprobs(batch, result.logits, width, result.tokens)
        t3 = time.perf_counter()
        drafted_rows, accepted, finished, ask_seconds = self._commit(
            batch, drafts, result.tokens, result.accepted
        )
        t4 = time.perf_counter()
        self.session.note_step(drafted_rows, accepted, t3 - t2)
        marks = (t0, t1, t2, t3, t4)
        report = StepReport(batch, width, result, len(new), finished, ask_seconds, self.asked_k, marks)
        self._safely("the step's accounting", self.accounting.observe, None, report)

    def _safely(self, what: str, fn, default, *args):
        """fn(*args), or `default` when it raises: the policy, the gates and the step's accounting only
        choose k or learn costs, and a bug there must cost speculation, not the batch's requests (the
        step's tokens are verified by then)."""
        try:
            return fn(*args)
        except Exception:
            self.policy_errors += 1
            if self.policy_errors <= 3 or self.policy_errors % 1000 == 0:
                log.exception("%s failed (%d times so far); decoding on", what, self.policy_errors)
            return default

    def _ask(self, batch: list[Request], subset: list[Request] | None = None) -> None:
        """Ask the draft for the policy's k (chosen for the whole batch) for `subset` (default: all)."""
        k, reason = 0, ""
        if self.session.attached:
            k = self._safely("the speculation policy", self.policy.choose, 0, batch)
            reason = self.policy.why_not(k, self.session.connected)
        if self.accounting.branch_gate is not None:
            self.session.want_branches = self._safely("the branch gate", self.accounting.want_branches, True,
                                                      len(batch))  # fmt: skip
        warm = subset is not None and self.config.draft_chain  # new requests: drafted from the chained round
        self.session.ask(batch if subset is None else subset, k, self.runner.max_context, warm)
        if subset is None:
            self.metrics.step_k.observe(k)
            self.asked_k = k
            if reason != self.not_drafting and batch:  # an empty batch keeps the last one's (usage)
                self.not_drafting = reason
                self.metrics.set_not_drafting(reason)

    def _rows(self, batch: list[Request], proposals: dict[int, Proposal]):
        rows, drafts = [], []
        for req in batch:
            p = proposals.get(req.draft.draft_id) or Proposal([])
            drafts.append(p.tokens)
            rows.append(
                StepRow(
                    last_token=req.tokens[-1],
                    drafts=p.tokens,
                    start=len(req.tokens) - 1,
                    slot=req.slot,
                    temperature=req.temperature,
                    seed=req.seed,
                    top_k=req.top_k,
                    top_p=req.top_p,
                    topk_ids=p.topk_ids,
                    topk_probs=p.topk_probs,
                    topk_width=p.topk_width,
                )
            )
        return rows, drafts

    def _commit(
        self, batch: list[Request], drafts: list[list[int]], tokens: list[list[int]], accepted: list[int]
    ) -> tuple[int, int, int, float]:
        """Stop checks on token ids, the next ask to the draft, then the new tokens wait for the next
        step's launch (`_hand_over_tokens`). Returns (requests that verified drafts, drafts accepted,
        requests finished, seconds of the ask)."""
        finished: list[tuple[Request, int]] = []
        items: list[tuple[Request, list[int]]] = []  # (request, new tokens) of those that have any
        first = False  # a request's first tokens: handed over at once (time to first token)
        num_drafts, num_accepted = self.accounting.observe_verdicts(batch, drafts, accepted)
        for req, out in zip(batch, tokens):
            new, finish = check_stop(out, req.stop_ids, self.eos_ids, req.max_new_tokens - len(req.output))
            req.tokens.extend(out)  # the KV must match what the draft is told
            req.output.extend(new)
            self.slots.lengths[req.slot] = len(req.tokens) - 1
            if new:
                items.append((req, new))
                first = first or len(req.output) == len(new)
            if finish != FINISH.FINISH_REASON_UNSPECIFIED:
                finished.append((req, finish))
        done = {id(r) for r, _ in finished}
        t0 = time.perf_counter()
        self._ask([r for r in batch if id(r) not in done and not r.cancelled])
        ask_seconds = time.perf_counter() - t0
        if items:
            self.to_stream = items
            self.to_stream_at = time.perf_counter()
            if finished or first:
                self._hand_over_tokens()
        for req, finish in finished:
            self._finish(req, finish)
        return num_drafts, num_accepted, len(finished), ask_seconds

    def _hand_over_tokens(self) -> None:
        """The last step's tokens to the streamer (called once the next step's forward is launched)."""
        if self.to_stream:
            items, self.to_stream = self.to_stream, []
            self.streamer.tokens(items, self.to_stream_at)

    def _finish(self, req: Request, reason: int, error: str = "") -> None:
        self._hand_over_tokens()  # a request's tokens reach its stream before its end
        with self.lock:
            if req.status == Status.FINISHED:
                return
            if req in self.running:
                self.running.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
            req.status = Status.FINISHED
            self.by_id.pop(req.request_id, None)
            if req.slot >= 0:
                self.slots.free(req.slot)
                req.slot = -1
            self.session.release(req)
            self.metrics.waiting.set(len(self.waiting))
            self.delivering += 1
        self.streamer.finish(req, reason, req.usage(self.policy.note(req, self.not_drafting)), error)
        self._update_gauges()

    def _delivered(self, req: Request) -> None:
        with self.lock:
            self.delivering -= 1
