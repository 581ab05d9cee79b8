"""What a finished step teaches the adaptive policy, and what it reports: the scheduler's last arrow.

After commit the scheduler hands over a `StepReport`. `StepAccounting.observe` then decides whether the
step is a sample at all (steps that start or finish requests are not), feeds the policy's step costs and
the two mode gates (speculation, the draft's branches; one explores at a time), and records the step's
metrics, its `--step-trace` line and the periodic DEBUG lines.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.metrics import ServiceMetrics
from target_service.config import TargetConfig
from target_service.draft_session import DraftSession
from target_service.gate import ModeGate
from target_service.policy import ADAPTIVE, COST_MEASURED, SpeculationPolicy, expected_tokens
from target_service.request import Request
from target_service.step_costs import PLAIN_SETTLE, AdmissionCosts, StepCosts
from target_service.step_trace import StepTrace

if TYPE_CHECKING:
    from target_service.runner import StepResult

LOG_EVERY = 64  # steps between the DEBUG phase and policy lines
BRANCH_SETTLE = 2  # speculative steps after plain ones that the branch gate does not count
# Steps that start or finish requests are neither mode's rate in the gates' windows: finishing requests
# and first tokens cost host work (last messages, streams closed, first messages) in whatever mode, and
# after a burst (a quarter of the batch or more) the next BURST_SETTLE steps still carry it: counted, such
# slow plain windows switch speculation on, which puts the requests out of step again.
BURST_SETTLE = 2
# The step after one that started requests is no steady step either, whatever the mode: its verify ran
# 0.55-0.95 ms longer than a steady one's (Qwen2.5-Coder-1.5B on an H100, plain and speculative alike: at
# 16 streams 3.3 against 2.6 ms at k = 4, 2.75 against 2.2 ms plain; step-trace medians). Counted, it
# priced whichever k ran through a run of starts above the others: the adaptive policy then held k = 3 for
# 203 of 495 steps where k = 4 yielded 11 % more per ms.
START_SETTLE = 1
# Unless every step churns: short requests at a high concurrency start or finish some in every step, and
# the speculation gate would never complete a window there, leaving the mode the cost model chose for
# good. After GATE_STARVED churned steps in a row at a bucket (two windows' worth), churned steps count
# in its windows too, in both modes alike, until a step that does not churn comes.
GATE_STARVED = 32
# While the speculation gate holds speculation off by measurement (COST_MEASURED), one plain step in
# OFF_SAMPLE_EVERY is a step-cost sample: nothing reads the costs then, and a sample every step is host
# time a small target's plain step feels (a 135M one's is 0.75 ms). The gate's windows still count
# every step, so its tries of speculation come as often.
OFF_SAMPLE_EVERY = 8
PHASES = ("plan", "propose", "verify", "commit")

log = logging.getLogger("specsplit.target")


@dataclass
class StepReport:
    """One step as the scheduler ran it."""

    batch: list[Request]
    width: int  # verify width: 1 + the most drafts of a request
    result: StepResult
    started: int = 0  # requests this step started on the draft (admitted since the last ask)
    finished: int = 0  # requests its commit finished
    ask_seconds: float = 0.0  # the ask sent in its commit (for the next step)
    asked_k: int = 0  # the k of the latest ask for the whole batch
    marks: tuple[float, ...] = (0.0,) * 5  # perf_counter at plan, propose, verify and commit, and the end


class StepAccounting:
    def __init__(
        self,
        config: TargetConfig,
        batch_buckets: list[int],
        startup_verify: dict[tuple[int, int], float],
        session: DraftSession,
        metrics: ServiceMetrics,
    ):
        """`startup_verify`: (batch, width) -> seconds, the runner's start-up timings of the verify."""
        self.session, self.metrics = session, metrics
        self.costs = StepCosts(batch_buckets)
        self.admissions = AdmissionCosts(self.costs)  # what starts add, charged to the gate's speculation
        for (batch, width), seconds in startup_verify.items():
            self.costs.observe_startup_verify(batch, width, seconds)
        self.policy = SpeculationPolicy(config.speculation_policy, self.costs)
        self.trace = StepTrace(config.step_trace) if config.step_trace else None
        # Only the adaptive policy with a draft reads the step costs: nobody else pays for keeping them.
        self.learn_costs = config.speculation_policy == ADAPTIVE and session.link is not None
        # The adaptive policy also measures whether the draft's branches pay (fixed: always asked for).
        self.branch_gate = ModeGate(self.costs) if self.learn_costs else None
        # Plain steps in a row that waited for no ask: past PLAIN_SETTLE of them, one is timed as k = 0.
        self.plain_run = PLAIN_SETTLE  # at start the draft runs nothing
        self.spec_run = 0  # speculative steps in a row (the branch gate's settle)
        self.burst_settle = 0  # steps after a burst of starts or finishes that the gates do not count
        self.start_settle = 0  # steps that a recent start still slows (START_SETTLE)
        self.churned_run: collections.Counter = collections.Counter()  # bucket -> churned steps in a row
        # The ask for the next step is sent in this step's commit: its seconds are the next step's cost
        # (a plain step that precedes a speculative one would otherwise pay for it, and the last step of
        # a run at k, followed by a plain one, would not).
        self.asked_seconds = 0.0  # the ask sent for the latest step (in the commit before it)
        self.phase_seconds = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        self.expected = 0.0  # the latest verdicts' tokens expected at the service's acceptance (one stream)
        for pos in range(config.max_speculative_tokens):  # labelled series exist from the start for rate()
            metrics.accepted_at_position(pos)

    def observe_verdicts(
        self, batch: list[Request], drafts: list[list[int]], accepted: list[int]
    ) -> tuple[int, int]:
        """Each request's verdict to its own and the service's acceptance, and the acceptance counters.
        Returns (requests that verified drafts, drafts accepted)."""
        # Counters summed over the batch, then one inc each: a labelled inc costs microseconds of GIL
        # per call, which at B=64 is a visible share of a ~2 ms step.
        num_drafts = num_drafted = num_accepted = 0
        at_position = [0] * (max(accepted, default=0) + 1)  # at_position[a]: rows that accepted exactly a
        # One stream: the tokens expected at the service's acceptance before this verdict (the gate's)
        if len(drafts) == 1:
            self.expected = expected_tokens(self.policy.prior_alpha, len(drafts[0]))
        lengths = [len(d) for d in drafts]
        self.policy.observe(lengths, accepted)
        for req, n, acc in zip(batch, lengths, accepted):
            req.spec.observe(n, acc)
            req.draft.last_accepted = acc
            if n:
                num_drafts += 1
                num_drafted += n
                num_accepted += acc
                at_position[acc] += 1
        if num_drafts:
            self.metrics.drafts.inc(num_drafts)
            self.metrics.draft_tokens.inc(num_drafted)
            self.metrics.accepted_tokens.inc(num_accepted)
            reaching = num_drafts - at_position[0]  # rows whose accepted run reached position pos
            for pos in range(1, len(at_position)):
                self.metrics.accepted_at_position(pos - 1).inc(reaching)
                reaching -= at_position[pos]
        return num_drafts, num_accepted

    def want_branches(self, batch: int) -> bool:
        """The branch gate's mode for the next ask. One gate explores at a time (ModeGate.exploring): a
        try of speculation runs beside the branches' better mode, not beside a try of theirs."""
        gate = self.branch_gate
        return gate.best(batch) if self.speculation_exploring(batch) else gate.want(batch)

    def speculation_exploring(self, batch: int) -> bool:
        gate = self.policy.gate
        return gate is not None and gate.exploring(batch)

    def observe(self, step: StepReport) -> None:
        t0, _, t2, t3, t4 = step.marks
        batch, width, result = len(step.batch), step.width, step.result
        emitted = sum(len(out) for out in result.tokens)
        # A step that starts requests, and the START_SETTLE steps after it, run their work in the verify.
        slowed = step.started > 0 or self.start_settle > 0
        self.start_settle = START_SETTLE if step.started else max(0, self.start_settle - 1)
        churned = self._churned(batch, step.started, step.finished) or slowed
        # While the policy rests (a draft that is never right, SpeculationPolicy.resting) a plain step
        # teaches the costs and gates nothing they are read for: skipping them keeps its host time a
        # plain target's.
        resting = self.policy.resting and width == 1
        surcharge: float | None = 0.0  # None: a steady speculative step whose starts are not priced yet
        if self.learn_costs:
            wall = t4 - t0 - step.ask_seconds + self.asked_seconds  # the step with the ask made for it
            self.asked_seconds = step.ask_seconds
            if not resting and not self._unsampled(width):
                self._learn_costs(batch, width, wall, t3 - t2, churned, slowed)
            if not resting:
                steady = self._steady_mode(width)
                self.admissions.observe(batch, width - 1, step.started, emitted, wall, steady)
                # Not on a churned step (counted when starved, it carries its own starts), nor in a plain
                # window (a step there drafts only for requests that pin their k).
                gate = self.policy.gate
                if width > 1 and not churned and (gate is None or gate.mode(batch) is not False):
                    surcharge = self.admissions.surcharge(batch, emitted)
        if not resting:
            self._feed_gates(batch, width, emitted, t4 - t0, churned, surcharge)
        self._observe_metrics(step)
        self.steps += 1
        if self.trace is not None:
            gate = self.policy.gate.mode(batch) if self.policy.gate is not None else None
            self.trace.step(batch, width, emitted, step.asked_k, gate, step.started > 0, *step.marks)
        for phase, a, b in zip(PHASES, step.marks, step.marks[1:]):
            self.phase_seconds[phase] += b - a
        if self.steps % LOG_EVERY == 0 and log.isEnabledFor(logging.DEBUG):
            self._log(step.batch)

    def _steady_mode(self, width: int) -> bool:
        """Whether the step ran in its mode's steady state, so that what starting requests added to it is
        a sample of that mode's (AdmissionCosts): a speculative step after a speculative one (not the
        catch-up of every request after plain steps; spec_run counts the steps before this one), a plain
        one that waited for no ask past PLAIN_SETTLE such steps (no draft round left on the GPU; plain_run
        counts this one, as for the plain step costs, and restarts at a step that waited for one)."""
        if width > 1:
            return self.spec_run > 0
        return self.plain_run > PLAIN_SETTLE

    def _unsampled(self, width: int) -> bool:
        """A plain step while the gate holds speculation off by measurement that is not a cost sample
        (OFF_SAMPLE_EVERY). A step that waited for an ask is always one: it ends the plain run."""
        off = width == 1 and self.policy.off_reason == COST_MEASURED and not self.session.last_asked
        return off and self.steps % OFF_SAMPLE_EVERY != 0

    def _churned(self, batch: int, started: int, finished: int) -> bool:
        """Whether this step started or finished requests, or follows a burst of them (BURST_SETTLE)."""
        churn = started + finished
        if 4 * churn >= batch:
            self.burst_settle = BURST_SETTLE
            return True
        settling, self.burst_settle = self.burst_settle > 0, max(0, self.burst_settle - 1)
        return churn > 0 or settling

    def _feed_gates(
        self, batch: int, width: int, emitted: int, wall: float, churned: bool, surcharge: float | None
    ) -> None:
        """`surcharge`: seconds the speculation gate adds to this speculative step (AdmissionCosts; None: its
        starts are not priced yet, and the gate's handicap stands in for them); the branch gate compares
        speculative steps only, so it rates the step as it ran."""
        # One gate explores at a time (ModeGate.exploring).
        speculation_exploring = self.speculation_exploring(batch)
        branch_exploring = self.branch_gate is not None and width > 1 and self.branch_gate.exploring(batch)
        bucket = self.costs.bucket(batch)
        self.churned_run[bucket] = self.churned_run[bucket] + 1 if churned else 0
        starved = self.churned_run[bucket] > GATE_STARVED  # every step churns here: count them (GATE_STARVED)
        if (speculation_exploring or not branch_exploring) and (not churned or starved):
            # Expected tokens at one stream only: there a window holds one request's draws of acceptance;
            # from two up they average over the requests, and the service's acceptance understates a
            # mixed batch's expected tokens (E is convex in alpha): Qwen2.5-Coder at 16 streams fell from
            # 1.41-1.44x to 1.33-1.35x plain with them.
            expected, priced = self.expected if batch == 1 else None, surcharge is not None
            self.policy.observe_step(batch, emitted, wall + (surcharge or 0.0), expected, priced)
        # Branches only change steady speculative steps: not plain ones, not the first ones after plain
        # steps (no branches yet, whether asked for or not), not one that starts or finishes requests.
        self.spec_run = self.spec_run + 1 if width > 1 else 0
        if self.branch_gate is not None and self.spec_run > BRANCH_SETTLE and not churned:
            if not speculation_exploring:
                self.branch_gate.observe(batch, emitted, wall)

    def _learn_costs(
        self, batch: int, width: int, wall: float, verify: float, churned: bool, slowed: bool
    ) -> None:
        """The step's costs for the adaptive policy. A plain step is a sample of k = 0 only when it
        waited for no ask (not a fallback after a late or empty answer), nor did the PLAIN_SETTLE steps
        before it (the draft's work after its last answer may still share the target's GPUs); a
        speculative one is a steady sample when no draft prefill (a start, or a catch-up after plain
        steps) hid in its wait. Neither is a sample when it started or finished requests (`_churned`):
        their first and last messages cost host time whatever k the step ran, and a tail's slow steps
        would rate the k of the moment worst. Nor is the verify of a step that started requests, or of the
        START_SETTLE steps after it (`slowed`), a verify sample: their prefills (the target's, and the
        draft's where it runs in this process) are queued on the GPU ahead of it and their work slows the
        next verify too, and one such sample can price a k out of the policy's choices for good."""
        session = self.session
        if not slowed:
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

    def _observe_metrics(self, step: StepReport) -> None:
        t0, t1, t2, t3, t4 = step.marks
        result = step.result
        self.metrics.verify_step.observe(t3 - t2)
        if not result.gpu_seconds:
            return
        # Host time: the step's wall time with the thread blocked on neither the draft nor the GPU. The
        # GPU wait beyond the step's own GPU time is queueing, apart: a draft on the same GPU can delay
        # the target's kernels with its own (a branch round during the verify).
        self.metrics.step_gpu.observe(result.gpu_seconds)
        self.metrics.step_host.observe(max(0.0, (t4 - t0) - (t2 - t1) - result.wait_seconds))
        self.metrics.step_gpu_queue.observe(max(0.0, result.wait_seconds - result.gpu_seconds))
        if not step.started and result.gap_seconds:  # no prefill ran since the last step
            self.metrics.step_gpu_gap.observe(result.gap_seconds)

    def _log(self, batch: list[Request]) -> None:
        phases = ", ".join(f"{k} {v / LOG_EVERY * 1e3:.2f}" for k, v in self.phase_seconds.items())
        log.debug("mean ms per step over %d steps: %s", LOG_EVERY, phases)
        log.debug("policy costs (bucket, k): %s", self.costs.describe())
        if self.learn_costs:
            log.debug("policy at B=%d: %s", len(batch), self.policy.explain(batch))
            log.debug(
                "extra ms per start (bucket, speculative): %s",
                {
                    (b, spec): round(v * 1e3, 2)
                    for spec, m in self.admissions.per_start.items()
                    for b, v in m.items()
                },
            )
            gates = {"speculate": self.policy.gate, "branches": self.branch_gate}
            log.debug("gates: %s", "; ".join(f"{n} {g.describe()}" for n, g in gates.items() if g))
        self.phase_seconds = dict.fromkeys(self.phase_seconds, 0.0)
