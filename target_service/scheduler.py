"""Continuous batching for the target: plan → propose → verify → commit, one step at a time.

One loop on TP rank 0. A step reads in four lines (`_step`):
- plan: drop cancelled requests, admit waiting ones (prefill), and let the speculation policy pick k;
- propose: the draft's proposals for this batch (`DraftSession`: asked at the end of the previous step,
  so the draft round overlaps this loop's host work; a step with k = 0 sends nothing, waits for nothing);
- verify: one graph replay for the forward over [t_n, d_1..d_k] of every request and the rejection
  kernel, one small read-back (`TargetRunner.step`);
- commit: stop checks on token ids, the next ask to the draft; the new tokens go to the streamer thread
  (`target_service/streamer.py`) once the next step's forward is launched: it detokenizes, matches stop
  strings and writes to the clients off the critical path.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from functools import partial

from common.kv_cache import SlotTable
from common.metrics import ServiceMetrics
from specsplit.v1 import target_pb2
from target_service.config import TargetConfig
from target_service.draft_link import DraftLink
from target_service.draft_session import DraftSession, Proposal, checked_proposal
from target_service.gate import ModeGate
from target_service.logprobs import add_pending_logprobs
from target_service.policy import ADAPTIVE, SpeculationPolicy
from target_service.request import FINISH, Request, Status, check_stop
from target_service.runner import StepResult, StepRow, TargetRunner
from target_service.step_costs import PLAIN_SETTLE, StepCosts
from target_service.step_trace import StepTrace
from target_service.streamer import Streamer

__all__ = ["NotAccepting", "QueueFull", "Request", "Scheduler", "checked_proposal"]

LOG_EVERY = 64  # steps between the DEBUG phase and policy lines
NO_DRAFT = "draft not connected"  # why a target with a draft drafts nothing while its link is down
BRANCH_SETTLE = 2  # speculative steps after plain ones that the branch gate does not count
# Steps that start or finish requests are neither mode's rate in the gates' windows: finishing requests
# and first tokens cost host work (last messages, streams closed, first messages) in whatever mode, and
# after a burst (a quarter of the batch or more) the next BURST_SETTLE steps still carry it. One H200,
# B=64 (thirteenth session): plain steps ran 3.0-5.7 ms while requests put out of step finished (2.7 ms
# otherwise), the gate read those windows at 13.5-16 k tok/s against 23-24 k, switched speculation on,
# and the next run started speculating, which put its requests out of step again.
BURST_SETTLE = 2

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
        self.link = link
        self.eos_ids = eos_ids
        self.session = DraftSession(link, metrics, config.draft_timeout, runner.model.feature_store)
        self.costs = StepCosts(runner.batch_buckets)
        for (batch, width), seconds in runner.step_costs.items():
            self.costs.observe_startup_verify(batch, width, seconds)
        self.policy = SpeculationPolicy(config.speculation_policy, self.costs)
        # Only the adaptive policy with a draft reads the step costs: nobody else pays for keeping them.
        self.learn_costs = config.speculation_policy == ADAPTIVE and link is not None
        # The adaptive policy also measures whether the draft's branches pay (fixed: always asked for).
        self.branch_gate = ModeGate(self.costs) if self.learn_costs else None
        # Plain steps in a row that waited for no ask: past PLAIN_SETTLE of them, one is timed as k = 0.
        self.plain_run = PLAIN_SETTLE  # at start the draft runs nothing
        self.spec_run = 0  # speculative steps in a row (the branch gate's settle)
        self.finished_in_step = 0  # requests the latest commit finished
        self.burst_settle = 0  # steps after a burst of starts or finishes that the gates do not count
        self.policy_errors = 0  # exceptions the policy, gates or accounting raised (_safely)
        # The ask for the next step is sent in this step's commit: its seconds are the next step's cost
        # (a plain step that precedes a speculative one would otherwise pay for it, and the last step of
        # a run at k, followed by a plain one, would not).
        self.ask_seconds = 0.0  # the ask sent in the latest step's commit
        self.asked_seconds = 0.0  # the ask sent for the latest step (in the commit before it)
        self.slots = SlotTable(config.max_batch_size)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.by_id: dict[str, Request] = {}
        self.delivering = 0  # finished requests whose last message the streamer has not written yet
        self.lock = threading.Condition()
        self.accepting = True
        self.stopped = threading.Event()
        self.verify_backend = runner.verify_backend
        self.streamer = Streamer(
            metrics, self._delivered, config.stream_interval, config.stream_messages_per_step
        )
        # A step's tokens wait here until the next step's forward is launched (or the scheduler waits for
        # the draft's answer): the streamer thread and the event loop then take the GIL while the GPU
        # works, not while the scheduler prepares the launch (every GIL-releasing call before it, a copy
        # or an event, could cost it up to a switch interval). First tokens, finishing steps and an idle
        # batch hand them over at once.
        self.to_stream: list[tuple[Request, list[int]]] = []
        self.to_stream_at = 0.0
        self.phase_seconds = dict.fromkeys(("plan", "propose", "verify", "commit"), 0.0)
        self.steps = 0
        self.asked_k = 0  # the k of the latest ask for the whole batch (the step trace)
        self.not_drafting = ""  # why the latest ask drafted nothing though the batch allowed it
        self.trace = StepTrace(config.step_trace) if config.step_trace else None
        # Labelled series exist from the start, so rate() sees their first increase.
        for pos in range(config.max_speculative_tokens):
            metrics.accepted_at_position(pos)
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

    def _admit(self) -> None:
        admitted = []
        with self.lock:
            while (
                self.waiting
                and len(self.running) + len(admitted) < self.config.max_batch_size
                and self.slots.num_free > 0
            ):
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
        self._update_gauges()

    def _update_gauges(self) -> None:
        self.metrics.running.set(len(self.running))
        self.metrics.batch_size.set(len(self.running))
        self.metrics.kv_slots_used.set(self.slots.num_used)

    # -- one step ----------------------------------------------------------------
    def _step(self) -> None:
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
        if self.session.draft_in_process and self.config.draft_chain and width > 1:
            chain = partial(self.session.chain, batch, drafts, width=width)
        result = self.runner.step(rows, width, self._hand_over_tokens, chain)  # verify
        add_pending_logprobs(batch, result.logits, width, result.tokens)
        t3 = time.perf_counter()
        drafted_rows, accepted = self._commit(batch, drafts, result.tokens, result.accepted)
        t4 = time.perf_counter()
        self.session.note_step(drafted_rows, accepted, t3 - t2)
        marks = (t0, t1, t2, t3, t4)
        self._safely("the step's accounting", self._account, None, batch, width, result, len(new), *marks)

    def _safely(self, what: str, fn, default, *args):
        """fn(*args), or `default` when it raises: the policy, the gates and the step's accounting only
        choose k or learn costs, and a bug there must cost speculation, not the batch's requests (the
        step's tokens are verified by then). A gate bug failed every running request of draining
        batches before (ModeGate._first_window)."""
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
            reason = self.policy.off_reason if not k else ""
            if not self.session.connected and self.policy.allowed_k:
                reason = NO_DRAFT
        if self.branch_gate is not None:
            # One gate explores at a time (ModeGate.exploring): a try of speculation runs beside the
            # branches' better mode, not beside a try of theirs.
            gate = self.branch_gate
            want = gate.best if self._speculation_exploring(len(batch)) else gate.want
            self.session.want_branches = self._safely("the branch gate", want, True, len(batch))
        self.session.ask(batch if subset is None else subset, k, self.runner.max_context)
        if subset is None:
            self.metrics.step_k.observe(k)
            self.asked_k = k
            if reason != self.not_drafting and batch:  # an empty batch keeps the last one's (usage)
                self.not_drafting = reason
                self.metrics.set_not_drafting(reason)

    def _speculation_exploring(self, batch: int) -> bool:
        gate = self.policy.gate
        return gate is not None and gate.exploring(batch)

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
    ) -> tuple[int, int]:
        """Stop checks on token ids, the next ask to the draft, then the new tokens wait for the next
        step's launch (`_hand_over_tokens`). Returns (requests that verified drafts, drafts accepted)."""
        finished: list[tuple[Request, int]] = []
        items: list[tuple[Request, list[int]]] = []  # (request, new tokens) of those that have any
        first = False  # a request's first tokens: handed over at once (time to first token)
        # Counters summed over the batch, then one inc each: a labelled inc costs microseconds of GIL
        # per call, which at B=64 is a visible share of a ~2 ms step.
        num_drafts = num_drafted = num_accepted = 0
        at_position = [0] * (max(accepted, default=0) + 1)  # at_position[a]: rows that accepted exactly a
        for req, drafted, out, acc in zip(batch, drafts, tokens, accepted):
            req.spec.observe(len(drafted), acc)
            self.policy.observe(len(drafted), acc)
            req.draft.last_accepted = acc
            if drafted:
                num_drafts += 1
                num_drafted += len(drafted)
                num_accepted += acc
                at_position[acc] += 1
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
        self.finished_in_step = len(finished)
        t0 = time.perf_counter()
        self._ask([r for r in batch if id(r) not in done and not r.cancelled])
        self.ask_seconds = time.perf_counter() - t0
        if items:
            self.to_stream = items
            self.to_stream_at = time.perf_counter()
            if finished or first:
                self._hand_over_tokens()
        if num_drafts:
            self.metrics.drafts.inc(num_drafts)
            self.metrics.draft_tokens.inc(num_drafted)
            self.metrics.accepted_tokens.inc(num_accepted)
            reaching = num_drafts - at_position[0]  # rows whose accepted run reached position pos
            for pos in range(1, len(at_position)):
                self.metrics.accepted_at_position(pos - 1).inc(reaching)
                reaching -= at_position[pos]
        for req, finish in finished:
            self._finish(req, finish)
        return num_drafts, num_accepted

    def _churned(self, batch: int, started: int) -> bool:
        """Whether this step started or finished requests, or follows a burst of them (BURST_SETTLE)."""
        churn = started + self.finished_in_step
        if 4 * churn >= batch:
            self.burst_settle = BURST_SETTLE
            return True
        settling, self.burst_settle = self.burst_settle > 0, max(0, self.burst_settle - 1)
        return churn > 0 or settling

    def _account(self, batch, width: int, result: StepResult, started: int, *marks: float) -> None:
        """`started`: requests this step started on the draft (admitted since the last ask)."""
        t0, t1, t2, t3, t4 = marks
        emitted = sum(len(out) for out in result.tokens)
        churned = self._churned(len(batch), started)
        if self.learn_costs:
            wall = t4 - t0 - self.ask_seconds + self.asked_seconds  # the step with the ask made for it
            self.asked_seconds = self.ask_seconds
            self._learn_costs(len(batch), width, wall, t3 - t2, churned, started)
        # One gate explores at a time (ModeGate.exploring).
        speculation_exploring = self._speculation_exploring(len(batch))
        branch_exploring = (
            self.branch_gate is not None and width > 1 and self.branch_gate.exploring(len(batch))
        )
        if (speculation_exploring or not branch_exploring) and not churned:
            self.policy.observe_step(len(batch), emitted, t4 - t0)
        # Branches only change steady speculative steps: not plain ones, not the first ones after plain
        # steps (no branches yet, whether asked for or not), not one that starts or finishes requests.
        self.spec_run = self.spec_run + 1 if width > 1 else 0
        if self.branch_gate is not None and self.spec_run > BRANCH_SETTLE and not churned:
            if not speculation_exploring:
                self.branch_gate.observe(len(batch), emitted, t4 - t0)
        self.metrics.verify_step.observe(t3 - t2)
        if result.gpu_seconds:
            # Host time: the step's wall time with the thread blocked on neither the draft nor the GPU.
            # The GPU wait beyond the step's own GPU time is queueing, apart: a draft on the same GPU can
            # delay the target's kernels with its own (a branch round during the verify). Both were one
            # figure before (one H200, B=1: 1.2-1.35 ms per speculative step with the draft on the same
            # GPU, 0.44 ms with it on its own).
            self.metrics.step_gpu.observe(result.gpu_seconds)
            self.metrics.step_host.observe(max(0.0, (t4 - t0) - (t2 - t1) - result.wait_seconds))
            self.metrics.step_gpu_queue.observe(max(0.0, result.wait_seconds - result.gpu_seconds))
            if not started and result.gap_seconds:  # no prefill ran since the last step
                self.metrics.step_gpu_gap.observe(result.gap_seconds)
        self.steps += 1
        if self.trace is not None:
            gate = self.policy.gate.mode(len(batch)) if self.policy.gate is not None else None
            self.trace.step(len(batch), width, emitted, self.asked_k, gate, started > 0, *marks)
        for phase, a, b in (("plan", t0, t1), ("propose", t1, t2), ("verify", t2, t3), ("commit", t3, t4)):
            self.phase_seconds[phase] += b - a
        if self.steps % LOG_EVERY == 0 and log.isEnabledFor(logging.DEBUG):
            phases = ", ".join(f"{k} {v / LOG_EVERY * 1e3:.2f}" for k, v in self.phase_seconds.items())
            log.debug("mean ms per step over %d steps: %s", LOG_EVERY, phases)
            log.debug("policy costs (bucket, k): %s", self.costs.describe())
            if self.learn_costs:
                log.debug("policy at B=%d: %s", len(batch), self.policy.explain(batch))
                gates = {"speculate": self.policy.gate, "branches": self.branch_gate}
                log.debug("gates: %s", "; ".join(f"{n} {g.describe()}" for n, g in gates.items() if g))
            self.phase_seconds = dict.fromkeys(self.phase_seconds, 0.0)

    def _learn_costs(
        self, batch: int, width: int, wall: float, verify: float, churned: bool, started: int
    ) -> None:
        """The step's costs for the adaptive policy. A plain step is a sample of k = 0 only when it
        waited for no ask (not a fallback after a late or empty answer), nor did the PLAIN_SETTLE steps
        before it (the draft's work after its last answer may still share the target's GPUs); a
        speculative one is a steady sample when no draft prefill (a start, or a catch-up after plain
        steps) hid in its wait. Neither is a sample when it started or finished requests (`_churned`):
        their first and last messages cost host time whatever k the step ran. One H200, B=64: the steps
        of a run's tail, finishing 1-7 requests each, took 7-9 ms against 6 ms steady, all at the k of
        the moment; its median then rated that k worst, and the next run started at another (the
        adaptive target ran long stretches of k = 3, 1.21-1.34x plain where fixed k = 4 ran 1.35-1.46x).
        Nor is the verify of a step that started requests a verify sample: their prefills (the target's, and
        the draft's where it runs in this process) are queued on the GPU ahead of it. One H200, B=1, the
        draft in the target: a run's first step timed width 5 at 107 ms; beside the start-up timing (a
        median of two is their mean) it priced k = 4 at 55 ms, so the policy never chose k = 4 again to
        replace it and ran k = 2.6 at 1.53-1.73x plain where fixed k = 4 ran 1.94-1.95x (twenty-third
        session)."""
        session = self.session
        if not started:
            self.costs.observe_verify(batch, width, verify)
        plain = width == 1 and not session.last_asked
        self.plain_run = self.plain_run + 1 if plain else 0
        if churned:
            return
        if self.plain_run > PLAIN_SETTLE:
            self.costs.observe_step(batch, 0, wall, verify, 0.0)
        elif width > 1 and session.last_wait_steady:
            self.costs.observe_draft(batch, width - 1, session.last_wait)
            self.costs.observe_step(batch, width - 1, wall, verify, session.last_wait)

    def _usage(self, req: Request) -> target_pb2.Usage:
        # A request that allowed drafting and got none is told why (the last step's reason).
        note = self.not_drafting if req.k and not req.spec.drafted else ""
        return target_pb2.Usage(
            prompt_tokens=len(req.prompt),
            output_tokens=len(req.output),
            drafted_tokens=req.spec.drafted,
            accepted_tokens=req.spec.accepted,
            steps=req.spec.steps,
            speculation_note=f"{self.policy.mode} policy: {note}" if note and note != NO_DRAFT else note,
        )

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
        self.streamer.finish(req, reason, self._usage(req), error)
        self._update_gauges()

    def _delivered(self, req: Request) -> None:
        with self.lock:
            self.delivering -= 1
