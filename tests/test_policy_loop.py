"""The adaptive policy inside the real serving loop (Scheduler, DraftSession, streamer, event loop), with
the GPU step and the draft round trip simulated by sleeps (bench/host_path.py's SimulatedRunner and
SimulatedDraft): it must stop speculating where speculation loses and keep speculating where it wins.
The simulated costs are ones measured on two GPUs with both services at TP=2: a 2.63 ms plain step,
+0.1 ms per verify position, a 3.1 ms draft round trip."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import replace

import pytest

from bench.host_path import SimulatedDraft, SimulatedRunner, run
from target_service.gate import SPECULATION_GATE, ModeGate
from target_service.step_costs import AdmissionCosts

PLAIN_STEP, PER_POSITION, ROUND_TRIP = 2.63e-3, 0.1e-3, 3.1e-3


def speculative_share(alpha: float, per_position: float, tokens: int = 400) -> tuple[int, int]:
    """(speculative steps, all steps) of one greedy request of `tokens` under the adaptive policy."""
    runner = SimulatedRunner(alpha, PLAIN_STEP, per_position)
    run(1, tokens, None, 4, runner, SimulatedDraft(ROUND_TRIP), policy="adaptive")
    return sum(w > 1 for w in runner.widths), len(runner.widths)


def median_of_runs(share: Callable[[], float], runs: int = 3) -> float:
    """The median of `share()` over `runs` independent serving runs: one gate window that a stall on the
    busy test machine rates wrong holds the gate 16 windows (256 steps) in the worse mode, most of one
    400-token request, so a single run measures the machine as much as the policy."""
    return statistics.median(share() for _ in range(runs))


def median_share(alpha: float, per_position: float) -> float:
    """The median over three runs of one request's share of speculative steps (`speculative_share`)."""

    def share() -> float:
        speculative, steps = speculative_share(alpha, per_position)
        return speculative / steps

    return median_of_runs(share)


def test_adaptive_stops_speculating_where_it_loses():
    # alpha 0.36: a width-5 step yields 1.55 tokens for 3.03 ms + a 3.1 ms wait; a plain step 1 per 2.63 ms.
    assert median_share(alpha=0.36, per_position=PER_POSITION) <= 0.1


def test_adaptive_keeps_speculating_where_it_wins():
    # alpha 0.9 and nearly free extra positions: k = 4 yields 4.1 tokens per 6.2 ms against 2.63 ms each.
    assert median_share(alpha=0.9, per_position=0.01e-3) >= 0.8


# A draft too slow for speculation to pay, at sleeps far above scheduling noise on 2 busy cores: a 20 ms
# plain step, +4 ms per verify position, alpha 0.85 (3.7 tokens at k = 4). Speculating costs a 36 ms
# verify plus the wait for the draft and the host work of the ask, over 25 ms per token; plain: 20 ms.
SLOW = dict(plain=20e-3, per_position=4e-3, alpha=0.85)
WARM_UP = 32  # steps before the policy is judged: the gate's first two windows, one per mode


class AskingDraft(SimulatedDraft):
    """A simulated draft whose ask costs the target `send_seconds` of host work before it leaves
    (serialising and sending it: a speculative step pays that, a plain step sends nothing)."""

    def __init__(self, round_trip: float, send_seconds: float = 0.0):
        super().__init__(round_trip)
        self.send_seconds = send_seconds

    def send(self, msg, epoch: int) -> bool:
        time.sleep(self.send_seconds)
        return super().send(msg, epoch)


def widths_after_warm_up(alpha, plain, per_position, round_trip, send_seconds=0.0, plain_prior=1.0,
                         tokens=200) -> list[int]:  # fmt: skip
    """Step widths (1: plain) of one greedy request under the adaptive policy, past WARM_UP. The runner
    hands the scheduler start-up verify timings, as TargetRunner.time_steps does: exact, but the plain
    one (width 1) `plain_prior` times the real step (timed while other services started on the GPUs)."""
    runner = timed_runner(alpha, plain, per_position, plain_prior=plain_prior)
    run(1, tokens, None, 4, runner, AskingDraft(round_trip, send_seconds), policy="adaptive")
    return runner.widths[WARM_UP:]


def timed_runner(alpha, plain, per_position, buckets=(1,), plain_prior=1.0) -> SimulatedRunner:
    """A simulated runner with the start-up verify timings TargetRunner.time_steps would hand over for
    `buckets`: exact, but the plain one (width 1) `plain_prior` times the real step."""
    runner = SimulatedRunner(alpha, plain, per_position)
    runner.step_costs = {(b, w): (plain + per_position * (w - 1)) * (plain_prior if w == 1 else 1.0)
                         for b in buckets for w in range(1, 6)}  # fmt: skip
    return runner


# Why k = 0 was never timed: its estimate (the start-up verify plus the host residue of speculative steps)
# came out above what speculation cost, and nothing made the policy try k = 0 while k > 0 won.
SLOW_CASES = {
    # the ask's host work (30 ms here; on the TP=2 H200 pair 2.1 ms per speculative step against 0.7 ms
    # per plain one) counted into the estimate of a plain step: 50 ms against 20 ms real
    "host work of speculative steps": dict(round_trip=40e-3, send_seconds=30e-3),
    "start-up plain timing 3x too high": dict(round_trip=60e-3, plain_prior=3.0),
}


@pytest.mark.parametrize("case", SLOW_CASES)
def test_slow_draft_settles_on_plain_steps(case):
    widths = widths_after_warm_up(**SLOW, **SLOW_CASES[case])
    plain = sum(w == 1 for w in widths)
    assert plain >= 0.8 * len(widths), (plain, len(widths))


@pytest.mark.parametrize("case", SLOW_CASES)
def test_slow_draft_without_the_gate_stays_speculative(case, monkeypatch):
    # The power of the test above: with the model alone (the gate following it), k = 0's estimate stays
    # too high and the policy keeps speculating at ~0.7x plain (what the TP=2 pair did at k = 3.9).
    monkeypatch.setattr(ModeGate, "want", lambda self, batch, default=True: default)
    monkeypatch.setattr(ModeGate, "mode", lambda self, batch: None)
    widths = widths_after_warm_up(**SLOW, **SLOW_CASES[case])
    plain = sum(w == 1 for w in widths)
    assert plain < 0.2 * len(widths), (plain, len(widths))


def test_fast_draft_keeps_speculating_despite_the_gate():
    # alpha 0.9, +1 ms per position, a 5 ms round trip and 5 ms of host work per ask: k = 4 yields 4.1
    # tokens per ~34 ms against 20 ms per token; the gate's plain windows (the second window, then one
    # in 16) take few steps.
    widths = widths_after_warm_up(0.9, 20e-3, 1e-3, round_trip=5e-3, send_seconds=5e-3, tokens=300)
    speculative = sum(w > 1 for w in widths)
    assert speculative >= 0.8 * len(widths), (speculative, len(widths))


def widths_under_churn(tokens: int, requests: int, batch: int = 8) -> list[int]:
    """Step widths past WARM_UP of the slow draft's "host work" case with `batch` requests of `tokens`
    running at once, each replaced as it finishes until `requests` were submitted: every step starts or
    finishes some when requests are short."""
    runner = timed_runner(SLOW["alpha"], SLOW["plain"], SLOW["per_position"], buckets=(1, 2, 4, 8))
    draft = AskingDraft(**SLOW_CASES["host work of speculative steps"])
    run(batch, tokens, None, 4, runner, draft, policy="adaptive", requests=requests)
    return runner.widths[WARM_UP:]


def test_slow_draft_settles_on_plain_steps_when_every_step_churns():
    # 24-token requests, 8 at a time: each finishes in about 6 speculative steps, so every step starts or
    # finishes requests (a burst, a quarter of the batch). The speculation gate leaves such steps out of
    # its windows, unless a bucket has seen nothing else for GATE_STARVED steps.
    widths = widths_under_churn(tokens=24, requests=160)
    plain = sum(w == 1 for w in widths)
    assert plain >= 0.6 * len(widths), (plain, len(widths))


def test_slow_draft_under_churn_without_the_starvation_rule_stays_speculative(monkeypatch):
    # The power of the test above: without counting churned steps the gate never completes a window and
    # the cost model's choice (speculation, whose ask's host work it misprices) stands for good.
    monkeypatch.setattr("target_service.step_accounting.GATE_STARVED", 10**9)
    widths = widths_under_churn(tokens=24, requests=160)
    plain = sum(w == 1 for w in widths)
    assert plain <= 0.1 * len(widths), (plain, len(widths))


# Steady speculative steps that win while the draft's prefill of each new prompt (100 ms here, 10x a plain
# step: a 0.5B classic draft's prefill before a 1.5B target's verify) loses it all: 8 requests of 60
# tokens, alpha 0.6, k = 4 yields 2.3 tokens per request per 15 ms step (1.5x plain's rate at 10 ms),
# but a start per 60 tokens adds 1.7 ms per token: 2.5 ms per token in all against plain's 1.25. The
# gate's windows leave steps that start requests out; the admission surcharge charges speculation's extra
# per start to its steady steps. Shares are of the steps after LEARNING (the gate's first windows and tries).
LEARNING = 160


def speculative_share_with_starts(start_seconds: float) -> float:
    """The median over three serving runs (`median_of_runs`: a stall can lift one run's share of 0.04-0.12
    at costly starts past 0.15) of the share of speculative steps past LEARNING."""

    def share() -> float:
        runner = timed_runner(0.6, 10e-3, 1e-3, buckets=(1, 2, 4, 8))
        run(8, 60, None, 4, runner, SimulatedDraft(1e-3, start_seconds), policy="adaptive", requests=128)
        widths = runner.widths[LEARNING:]
        return sum(w > 1 for w in widths) / len(widths)

    return median_of_runs(share)


def test_speculation_whose_starts_cost_more_than_it_wins_settles_on_plain():
    assert speculative_share_with_starts(0.1) <= 0.15


def test_without_the_admission_surcharge_speculation_with_costly_starts_stays_on(monkeypatch):
    # The power of the test above: the gate then rates the steady steps alone, which win.
    monkeypatch.setattr(AdmissionCosts, "surcharge", lambda self, batch, emitted: 0.0)
    assert speculative_share_with_starts(0.1) >= 0.8


def test_speculation_whose_starts_are_cheap_stays_on_with_the_surcharge():
    # 10 ms per start: 0.98 ms per token in all against plain's 1.25, so speculation still wins.
    assert speculative_share_with_starts(0.01) >= 0.7


def test_the_admission_surcharge_reaches_the_speculation_gate_alone(monkeypatch):
    """A steady speculative step is rated by the speculation gate with speculation's extra per start added,
    by the branch gate (which compares speculative steps only) as it ran."""
    from prometheus_client import CollectorRegistry

    from common.metrics import ServiceMetrics
    from target_service.config import TargetConfig
    from target_service.gate import _Window
    from target_service.runner import StepResult
    from target_service.scheduler import Scheduler
    from target_service.step_accounting import BRANCH_SETTLE, StepReport

    metrics = ServiceMetrics("target", "surcharge", registry=CollectorRegistry())
    config = TargetConfig(model="none", max_batch_size=1, speculation_policy="adaptive")
    sched = Scheduler(SimulatedRunner(), config, metrics, SimulatedDraft(), frozenset())
    acc = sched.accounting
    monkeypatch.setattr(AdmissionCosts, "surcharge", lambda self, batch, emitted: 0.25 * emitted)
    seen = {}
    monkeypatch.setattr(type(sched.policy), "observe_step", lambda self, b, tokens, seconds, expected=None,
                        priced=False: seen.__setitem__("speculation", seconds))  # fmt: skip
    monkeypatch.setattr(type(acc.branch_gate), "observe", lambda self, b, tokens, seconds:
                        seen.__setitem__("branches", seconds))  # fmt: skip
    acc.spec_run = BRANCH_SETTLE + 1  # a steady speculative step, as the branch gate counts
    marks = (0.0, 0.0, 0.0, 0.0, 1e-3)
    acc.observe(StepReport([object()], 3, StepResult([[1, 2, 3]], [2], 0.0), marks=marks))
    assert seen == {"speculation": pytest.approx(1e-3 + 0.75), "branches": pytest.approx(1e-3)}
    seen.clear()
    acc.observe(StepReport([object()], 1, StepResult([[1]], [0], 0.0), marks=marks))  # a plain step
    assert seen == {"speculation": pytest.approx(1e-3)}
    sched.policy.gate.state[1] = _Window(False)  # a plain window: drafts only for requests pinning their k
    acc.observe(StepReport([object()], 3, StepResult([[1, 2, 3]], [2], 0.0), marks=marks))
    assert seen["speculation"] == pytest.approx(1e-3)
    del sched.policy.gate.state[1]
    # A step that starts a request, counted in the windows because every step churns (GATE_STARVED):
    # its wall carries its start already.
    monkeypatch.setattr("target_service.step_accounting.GATE_STARVED", 0)
    acc.spec_run = BRANCH_SETTLE + 1
    acc.observe(StepReport([object()], 3, StepResult([[1, 2, 3]], [2], 0.0), started=1, marks=marks))
    assert seen == {"speculation": pytest.approx(1e-3)}


def test_branch_gate_counts_only_steady_speculative_steps():
    """The branch gate compares speculative steps with branches asked for or not: plain steps, the first
    BRANCH_SETTLE speculative steps after plain ones (no branches exist yet either way) and a step that
    starts a request on the draft (its prefill) would weigh on whichever window they fall in."""
    from prometheus_client import CollectorRegistry

    from common.metrics import ServiceMetrics
    from target_service.config import TargetConfig
    from target_service.runner import StepResult
    from target_service.scheduler import Scheduler
    from target_service.step_accounting import BRANCH_SETTLE, StepReport

    metrics = ServiceMetrics("target", "gate", registry=CollectorRegistry())
    config = TargetConfig(model="none", max_batch_size=1, speculation_policy="adaptive")
    sched = Scheduler(SimulatedRunner(), config, metrics, SimulatedDraft(), frozenset())
    marks = (0.0, 0.0, 0.0, 0.0, 1e-3)

    def counted(width: int, started: bool = False) -> int:
        gate = sched.accounting.branch_gate
        before = gate.state[1].steps if 1 in gate.state else 0
        sched.accounting.observe(
            StepReport([object()], width, StepResult([[1]], [0], 0.0), started, marks=marks)
        )
        return gate.state[1].steps - before if 1 in gate.state else 0

    assert [counted(1) for _ in range(3)] == [0, 0, 0]  # plain
    assert [counted(5) for _ in range(BRANCH_SETTLE + 2)] == [0] * BRANCH_SETTLE + [1, 1]
    assert counted(5, started=True) == 0
    assert counted(1) == 0 and counted(5) == 0  # after a plain step the settle starts again


def test_step_host_time_leaves_out_the_wait_for_a_busy_gpu():
    """A step whose GPU work queues behind other work on the GPU (a draft on the same GPU) is not host
    time: specsplit_step_host_seconds leaves out the whole wait for the GPU and the draft, and the queueing
    is specsplit_step_gpu_queue_seconds. The simulated step: 2 ms of GPU time after 3 ms in the queue."""
    queue, gpu = 3e-3, 2e-3
    result = run(1, 60, None, 4, SimulatedRunner(0.5, gpu, 0.0, queue), SimulatedDraft(1e-3), policy="fixed")
    # The host's own work per step here is ~0.2 ms on the 2-core dev machine; the queue would add 3.
    assert result["step_host_ms"] < 1.5, result["step_host_ms"]
    # time.sleep overshoots by up to ~0.1 ms (plus scheduling on a busy CI machine) and nothing shortens it.
    assert 1e3 * queue <= result["step_gpu_queue_ms"] < 1e3 * queue + 1.5, result["step_gpu_queue_ms"]
    # Power: with no queue the same loop reports none, and the host time stays below the queue's 3 ms.
    idle = run(1, 60, None, 4, SimulatedRunner(0.5, gpu, 0.0, 0.0), SimulatedDraft(1e-3), policy="fixed")
    assert idle["step_gpu_queue_ms"] < 1.0 and idle["step_host_ms"] < 1.5, idle


def test_a_failing_policy_or_gate_costs_speculation_not_requests(monkeypatch, caplog):
    """The policy, the gates and the step's accounting only choose k and learn costs: when they raise,
    the step goes on (k = 0 for that ask) and every request still gets all its tokens (`run` raises
    when some never come), its verified tokens not lost to a bug there. (The simulated runner accepts
    made-up drafts, so its text is no reference: the services' lossless tests compare outputs.)"""
    from target_service.policy import SpeculationPolicy

    calls = {"choose": 0, "observe": 0}
    choose, observe = SpeculationPolicy.choose, ModeGate.observe

    def flaky_choose(self, batch):
        calls["choose"] += 1
        if calls["choose"] % 3 == 0:
            raise RuntimeError("policy bug")
        return choose(self, batch)

    def flaky_observe(self, *args):
        calls["observe"] += 1
        if calls["observe"] % 4 == 0:
            raise KeyError("gate bug")
        return observe(self, *args)

    monkeypatch.setattr(SpeculationPolicy, "choose", flaky_choose)
    monkeypatch.setattr(ModeGate, "observe", flaky_observe)
    runner = SimulatedRunner(0.8)
    with caplog.at_level("ERROR", logger="specsplit.target"):
        spec = run(4, 60, None, 4, runner, SimulatedDraft(), policy="adaptive")  # raises if tokens are lost
    assert [len(out) for out in spec["outputs"]] == [60] * 4
    assert any(w > 1 for w in runner.widths) and calls["choose"] >= 3 and calls["observe"] >= 4  # both failed
    assert "the speculation policy failed" in caplog.text
    assert "failing the running requests" not in caplog.text


def test_one_gate_explores_at_a_time():
    """The speculation gate does not count speculative steps of a branch gate's try (one H200, B=1: the
    windows without branches, 385 tok/s against 755, fell in the speculation gate's windows with
    speculation on, which then rated it below plain and turned it off, while fixed k = 4 ran 1.2x plain);
    while the speculation gate explores, branches run at their best mode and their gate counts nothing."""
    from prometheus_client import CollectorRegistry

    from common.metrics import ServiceMetrics
    from target_service.config import TargetConfig
    from target_service.detok import StreamDetokenizer
    from target_service.gate import _Window
    from target_service.request import Request
    from target_service.runner import StepResult
    from target_service.scheduler import Scheduler
    from target_service.step_accounting import BRANCH_SETTLE, StepReport

    metrics = ServiceMetrics("target", "gates", registry=CollectorRegistry())
    config = TargetConfig(model="none", max_batch_size=1, speculation_policy="adaptive")
    sched = Scheduler(SimulatedRunner(), config, metrics, SimulatedDraft(), frozenset())
    spec, branches = sched.policy.gate, sched.accounting.branch_gate
    marks = (0.0, 0.0, 0.0, 0.0, 1e-3)

    def set_gate(gate, on: float, off: float, window_on: bool, trying: bool) -> None:
        gate.rate[1, True], gate.rate[1, False] = on, off
        gate.rated_at[1, True] = gate.rated_at[1, False] = 0
        gate.state[1] = _Window(window_on, windows=1, trying=trying)

    def step(width: int) -> tuple[int, int]:
        """Steps each gate counted for one step of `width`."""
        before = spec.state[1].steps, branches.state[1].steps
        sched.policy.gated = True  # the step is one of the speculation gate's (choose sets it)
        sched.accounting.spec_run = BRANCH_SETTLE + 1  # a steady speculative step, as the branch gate counts
        sched.accounting.observe(StepReport([object()], width, StepResult([[1]], [0], 0.0), marks=marks))
        return spec.state[1].steps - before[0], branches.state[1].steps - before[1]

    # Speculation on (its best); the branch gate tries off, its worse mode.
    set_gate(spec, 650.0, 550.0, window_on=True, trying=False)
    set_gate(branches, 750.0, 390.0, window_on=False, trying=True)
    assert step(5) == (0, 1)  # the branch gate's try: not a rate of speculation
    set_gate(branches, 750.0, 390.0, window_on=True, trying=False)
    assert step(5) == (1, 1)  # both at their best: both count
    # The speculation gate tries off / on: the branch gate counts nothing, and branches run at their best
    # mode even where their gate's window is a try of the other.
    set_gate(spec, 650.0, 700.0, window_on=True, trying=True)
    set_gate(branches, 750.0, 390.0, window_on=False, trying=True)
    assert step(5) == (1, 0)
    req = Request("r", [1, 2], 8, 0.0, 0, 1.0, 0, 4, frozenset(), StreamDetokenizer(None))
    sched.session.register(req)
    req.tokens = list(req.prompt)
    sched._ask([req])
    assert sched.session.want_branches is True
    set_gate(spec, 650.0, 550.0, window_on=True, trying=False)
    sched._ask([req])
    assert sched.session.want_branches is False  # the branch gate's own window again


def test_steps_that_start_or_finish_requests_are_no_gates_rate_nor_step_cost():
    """A step that starts or finishes requests, the step after a start (START_SETTLE) and the BURST_SETTLE
    steps after a burst of them (a quarter of the batch or more), count in neither gate's window nor in the
    policy's step costs: the host work of first and last messages is every mode's and every k's: at B=64
    such plain windows read 13.5-16 k tok/s against 23-24 k and switched speculation on (and a run's tail
    rated its k worst)."""
    from prometheus_client import CollectorRegistry

    from common.metrics import ServiceMetrics
    from target_service.config import TargetConfig
    from target_service.gate import _Window
    from target_service.runner import StepResult
    from target_service.scheduler import Scheduler
    from target_service.step_accounting import BRANCH_SETTLE, BURST_SETTLE, START_SETTLE, StepReport

    metrics = ServiceMetrics("target", "churn", registry=CollectorRegistry())
    config = TargetConfig(model="none", max_batch_size=8, speculation_policy="adaptive")
    sched = Scheduler(SimulatedRunner(), config, metrics, SimulatedDraft(), frozenset())
    spec, branches = sched.policy.gate, sched.accounting.branch_gate
    bucket = sched.costs.bucket(8)
    for gate in (spec, branches):
        gate.rate[bucket, True], gate.rate[bucket, False] = 700.0, 500.0
        gate.rated_at[bucket, True] = gate.rated_at[bucket, False] = 0
        gate.state[bucket] = _Window(True, windows=1)

    def counted(started: int = 0, finished: int = 0) -> tuple[int, int, int]:
        """Whether the step counted in (the speculation gate, the branch gate, the k = 4 step costs)."""
        before = spec.state[bucket].steps, branches.state[bucket].steps, sched.costs.steps_at[bucket]
        sched.policy.gated = True
        sched.accounting.spec_run = BRANCH_SETTLE + 1
        sched.session.last_wait_steady = True  # no draft prefill in its wait
        result = StepResult([[1]] * 8, [0] * 8, 0.0)
        sched.accounting.observe(
            StepReport([object()] * 8, 5, result, started, finished, marks=(0, 0, 0, 0, 1e-3))
        )
        after = spec.state[bucket].steps, branches.state[bucket].steps, sched.costs.steps_at[bucket]
        return tuple(a - b for a, b in zip(after, before))

    assert counted() == (1, 1, 1)  # power: a steady step counts in all three
    assert sched.costs.step[bucket, 4] == pytest.approx(1e-3)
    assert counted(started=1) == (0, 0, 0)
    assert [counted() for _ in range(START_SETTLE)] == [(0, 0, 0)] * START_SETTLE  # its work slows these
    assert counted() == (1, 1, 1)
    assert counted(finished=1) == (0, 0, 0)
    assert counted() == (1, 1, 1)  # one finish: that step only
    assert counted(finished=2) == (0, 0, 0)  # a burst (2 of 8): it and the next BURST_SETTLE steps
    assert [counted() for _ in range(BURST_SETTLE)] == [(0, 0, 0)] * BURST_SETTLE
    assert counted() == (1, 1, 1)


def test_verify_of_a_step_that_started_requests_is_no_verify_sample():
    """A step that started requests waited in its verify for their prefills, and the next step's verify
    still runs slower: neither verify time is a verify sample: a run's first step can time width 5 at
    107 ms, and k = 4 estimated from it and the start-up timing is never chosen again."""
    from prometheus_client import CollectorRegistry

    from common.metrics import ServiceMetrics
    from target_service.config import TargetConfig
    from target_service.runner import StepResult
    from target_service.scheduler import Scheduler
    from target_service.step_accounting import StepReport

    metrics = ServiceMetrics("target", "prefill", registry=CollectorRegistry())
    config = TargetConfig(model="none", max_batch_size=1, speculation_policy="adaptive")
    sched = Scheduler(SimulatedRunner(), config, metrics, SimulatedDraft(), frozenset())
    bucket = sched.costs.bucket(1)
    sched.accounting.observe(
        StepReport([object()], 5, StepResult([[1]], [0], 0.0), 1, marks=(0, 0, 0, 0.107, 0.108))
    )
    assert (bucket, 5) not in sched.costs.verify
    sched.accounting.observe(
        StepReport([object()], 5, StepResult([[1]], [0], 0.0), 0, marks=(0, 0, 0, 9e-3, 10e-3))
    )
    assert (bucket, 5) not in sched.costs.verify  # nor is the next one's: their work still slows it
    sched.accounting.observe(
        StepReport([object()], 5, StepResult([[1]], [0], 0.0), 0, marks=(0, 0, 0, 2e-3, 3e-3))
    )
    assert sched.costs.verify[bucket, 5] == pytest.approx(2e-3)  # power: a steady step's verify counts


def test_step_trace_has_a_line_per_step(tmp_path):
    """--step-trace: one JSON line per step of the real loop, its tokens those the clients received."""
    import itertools
    import json

    path = tmp_path / "steps.jsonl"
    runner = SimulatedRunner(0.7, 1e-3, 0.0)
    result = run(4, 40, None, 4, runner, SimulatedDraft(1e-3), policy="adaptive", step_trace=str(path))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == len(runner.widths) > 0
    assert [r["w"] for r in rows] == runner.widths
    assert sum(r["tok"] for r in rows) >= result["tokens"] == 4 * 40
    assert any(r["w"] > 1 and r["tok"] > r["B"] for r in rows)  # speculative steps that accepted drafts
    assert all(1 <= r["B"] <= 4 and r["gate"] in (0, 1, None) for r in rows)
    assert all(a["t"] < b["t"] for a, b in itertools.pairwise(rows))
    assert rows[0]["new"] and all(
        r[p] >= 0 for r in rows for p in ("gap", "plan", "propose", "verify", "commit")
    )


def test_step_trace_summary_splits_a_batch_into_fill_full_and_tail(tmp_path):
    """bench/step_trace_summary.py: runs are split at idle gaps; a run's steps before its batch first
    reaches its largest size are fill, then full until it first drops, then tail; each part's time is its
    steps' walls plus the gaps before them (not the gap before the run)."""
    import json

    from bench.step_trace_summary import runs_of, split

    def row(b, w, tok, gap=0.1):
        return dict(t=0.0, B=b, w=w, tok=tok, k=4, new=False, gate=None, gap=gap, plan=0.1, propose=0.2,
                    verify=1.0, commit=0.2)  # fmt: skip

    steps = [row(1, 5, 3, gap=500.0), row(4, 5, 9), row(4, 1, 4), row(4, 5, 12), row(2, 1, 2)]
    steps += [row(4, 1, 4, gap=80.0)]  # the next run, after an idle gap
    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in steps))
    runs = runs_of(path, idle_ms=50.0)
    assert [len(r) for r in runs] == [5, 1]
    parts = split(runs[0])
    assert parts["fill spec"] == dict(steps=1, tok=3, ms=1.5)  # the run's first gap is not its time
    assert parts["full spec"] == dict(steps=2, tok=21, ms=2 * 1.6)
    assert parts["full plain"] == dict(steps=1, tok=4, ms=1.6)
    assert parts["tail plain"] == dict(steps=1, tok=2, ms=1.6)
    assert parts["all"]["steps"] == 5 and parts["all"]["tok"] == 30


def test_the_gpu_gap_is_observed_only_for_steps_no_prefill_preceded():
    """specsplit_step_gpu_gap_seconds: the GPU time between two steps (StepResult.gap_seconds, CUDA events)
    is host and draft time unless a prefill ran in between (a step that started requests): those steps are
    left out, the others observed as measured."""
    from prometheus_client import CollectorRegistry

    from common.metrics import ServiceMetrics
    from target_service.config import TargetConfig
    from target_service.runner import StepResult
    from target_service.scheduler import Scheduler
    from target_service.step_accounting import StepReport

    registry = CollectorRegistry()
    metrics = ServiceMetrics("target", "gap", registry=registry)
    config = TargetConfig(model="none", max_batch_size=8, speculation_policy="fixed")
    sched = Scheduler(SimulatedRunner(), config, metrics, SimulatedDraft(), frozenset())
    labels = {"role": "target", "model": "gap"}

    def account(started: int, gap: float) -> None:
        result = StepResult([[1]] * 8, [0] * 8, 2e-3, None, 2e-3, gap)
        sched.accounting.observe(StepReport([object()] * 8, 5, result, started, marks=(0, 0, 0, 0, 3e-3)))

    account(0, 4e-4)
    account(3, 9e-3)  # a prefill before it: not observed
    account(0, 6e-4)
    count = registry.get_sample_value("specsplit_step_gpu_gap_seconds_count", labels)
    total = registry.get_sample_value("specsplit_step_gpu_gap_seconds_sum", labels)
    assert count == 2 and total == pytest.approx(1e-3)


def accounting_calls(alpha: float, monkeypatch) -> tuple[int, int, int]:
    """(steps, speculative steps, steps whose costs and gates were fed) of 4 greedy requests of 300
    tokens under the adaptive policy, with a draft right at `alpha` per token."""
    from target_service.step_accounting import StepAccounting

    fed = []
    real = StepAccounting._feed_gates
    monkeypatch.setattr(StepAccounting, "_feed_gates", lambda self, *a: (fed.append(1), real(self, *a)))
    runner = timed_runner(alpha, 1e-3, 0.1e-3, buckets=(1, 2, 4))
    run(4, 300, None, 4, runner, SimulatedDraft(0.3e-3), policy="adaptive")
    return len(runner.widths), sum(w > 1 for w in runner.widths), len(fed)


def test_a_resting_policy_feeds_no_costs_or_gates(monkeypatch):
    """Once a never-right draft's acceptance leaves nothing to win, the policy rests (plain steps, one try
    in REPROBE_EVERY) and its steps skip the cost samples and gate windows, which nothing reads then: the
    host time of a plain target's step. Power: a useful draft's steps feed them every step."""
    steps, speculative, fed = accounting_calls(0.0, monkeypatch)
    assert steps >= 290 and speculative <= 40, (steps, speculative)
    assert fed <= speculative + 8, (steps, speculative, fed)
    steps, speculative, fed = accounting_calls(0.9, monkeypatch)
    assert speculative > 0 and fed == steps, (steps, speculative, fed)


def off_steps_sampled(monkeypatch) -> tuple[int, int, int]:
    """(plain steps while the gate held speculation off by measurement, those that were step-cost samples,
    steps whose gate windows were fed) of one request with a draft that settles on plain steps."""
    from target_service import step_accounting
    from target_service.policy import COST_MEASURED

    off, sampled, fed = [], [], []
    acc = step_accounting.StepAccounting
    real_observe, real_learn, real_feed = acc.observe, acc._learn_costs, acc._feed_gates

    def observe(self, step):
        is_off = step.width == 1 and self.policy.off_reason == COST_MEASURED and not self.session.last_asked
        off.append(is_off)
        return real_observe(self, step)

    def learn(self, *args):
        sampled.append(off[-1])
        return real_learn(self, *args)

    monkeypatch.setattr(acc, "observe", observe)
    monkeypatch.setattr(acc, "_learn_costs", learn)
    monkeypatch.setattr(acc, "_feed_gates", lambda self, *a: (fed.append(1), real_feed(self, *a)))
    widths_after_warm_up(**SLOW, **SLOW_CASES["host work of speculative steps"])
    return sum(off), sum(sampled), len(fed)


def test_plain_steps_held_off_by_the_gate_are_one_cost_sample_in_eight(monkeypatch):
    """While the gate holds speculation off by measurement, one plain step in OFF_SAMPLE_EVERY (8) is a
    step-cost sample (nothing reads the costs then), and every step still feeds the gate's windows, so
    its tries of speculation come as often. Power: with a sample every step, all of them are."""
    from target_service import step_accounting

    off, sampled, fed = off_steps_sampled(monkeypatch)
    assert off >= 50, off  # the slow draft settles on plain steps (test_slow_draft_settles_on_plain_steps)
    assert sampled <= off // 8 + 2, (off, sampled)
    assert fed >= off, (off, fed)
    monkeypatch.setattr(step_accounting, "OFF_SAMPLE_EVERY", 1)
    off, sampled, fed = off_steps_sampled(monkeypatch)
    assert off >= 50 and sampled == off, (off, sampled)


# SmolLM2-135M with its feature draft in the target at one stream (one H100), times 5 to stand above the
# scheduling noise of 2 busy cores: a 3.6 ms plain step, +0.075 ms per verify position, a 2.3 ms draft
# round, alpha 0.51. k = 4 yields 1.96 tokens per 6.2 ms against one per 3.6 ms: 1.14x.
MODEST = dict(alpha=0.51, plain=3.6e-3, per_position=0.075e-3, round_trip=2.3e-3, tokens=1000)


def _handicap_at_one_stream(monkeypatch):
    init = ModeGate.__init__

    def handicapped(self, costs, config=SPECULATION_GATE):
        init(self, costs, replace(config, handicap_from=1))

    monkeypatch.setattr(ModeGate, "__init__", handicapped)


def _modest_share(seed: int) -> float:
    """The share of speculative steps past WARM_UP of one request at MODEST's costs, the simulated
    acceptance drawn from `seed`."""
    runner = timed_runner(MODEST["alpha"], MODEST["plain"], MODEST["per_position"])
    runner.rng = random.Random(seed)
    run(1, MODEST["tokens"], None, 4, runner, AskingDraft(MODEST["round_trip"]), policy="adaptive")
    widths = runner.widths[WARM_UP:]
    return sum(w > 1 for w in widths) / len(widths)


@pytest.mark.parametrize("variant", ["served", "handicap at one stream"])
def test_a_modest_win_at_one_stream_keeps_speculating(variant, monkeypatch):
    # Speculation's handicap applies from two requests up (GateConfig.handicap_from), and the gate rates
    # windows of the mode held by their expected tokens (ModeGate.observe). Served, 69-77 % of the steps
    # past the warm-up speculate on average over seeds 1-5 (93 % in most runs; the gate's tries of plain
    # steps are the rest; a run whose first windows drew a low acceptance waits for a try to win). The
    # power of the check: with the handicap at one stream too, a try must beat plain by 14 % and the
    # mean is 37-42 %. Measured, 3 runs each.
    if variant == "handicap at one stream":
        _handicap_at_one_stream(monkeypatch)
    shares = [_modest_share(seed) for seed in range(1, 6)]
    print(variant, [round(s, 3) for s in shares])
    assert (sum(shares) / len(shares) >= 0.6) == (variant == "served"), shares


def _k4_share_through_starts(seed: int, steps: int = 4000, alpha: float = 0.657, batch: int = 16) -> float:
    """Share of the steps at k = 4 when the adaptive policy learns through StepAccounting (its sample and
    window rules) at test_policy's NEAR_TIE_MS costs (k = 4 3.5 % ahead of k = 3, 10 % step noise), with
    starts in bursts (half the steps start a request for ~10 steps in about every 50) and alone (8 % of
    the steps otherwise): a step that starts one runs 1.8x a steady one, the step after it 1.25x (H100 E's
    step traces at 16 streams: 5.7 and 4.0 against 3.1 ms)."""
    import math

    from prometheus_client import CollectorRegistry

    from common.metrics import ServiceMetrics
    from target_service.config import TargetConfig
    from target_service.runner import StepResult
    from target_service.scheduler import Scheduler
    from target_service.step_accounting import StepReport
    from tests.test_policy import NEAR_TIE_MS, reqs

    rng = random.Random(seed)
    metrics = ServiceMetrics("target", f"starts{seed}", registry=CollectorRegistry())
    config = TargetConfig(model="none", max_batch_size=batch, speculation_policy="adaptive")
    sched = Scheduler(SimulatedRunner(), config, metrics, SimulatedDraft(), frozenset())
    accounting, running = sched.accounting, reqs(batch, alpha=alpha, trials=20)
    for width in range(1, 6):  # the start-up timings of the verify
        accounting.costs.observe_startup_verify(batch, width, (1.6 + 0.15 * width) * 1e-3)
    burst, after, at_4 = False, False, 0
    for _ in range(steps):
        k = accounting.policy.choose(running)
        burst = rng.random() < (0.9 if burst else 0.02)
        started = int(rng.random() < (0.5 if burst else 0.08))
        noise = math.exp(rng.gauss(0.0, 0.1)) * (1.8 if started else 1.25 if after else 1.0)
        after = bool(started)
        tokens = []
        for r in running:
            accepted = next((i for i in range(k) if rng.random() >= alpha), k)
            r.spec.observe(k, accepted)
            accounting.policy.observe([k], [accepted])
            tokens.append([1] * (accepted + 1))
        sched.session.last_wait_steady, sched.session.last_asked = True, k > 0
        wall, verify = NEAR_TIE_MS[k] * 1e-3 * noise, (1.6 + 0.15 * (k + 1)) * 1e-3 * noise
        result = StepResult(tokens, [len(t) - 1 for t in tokens], 0.0)
        accounting.observe(StepReport(running, k + 1, result, started, marks=(0.0, 0.0, 0.0, verify, wall)))
        at_4 += k == 4
    return at_4 / steps


def test_the_step_after_a_start_does_not_price_the_k_that_ran_it(monkeypatch):
    """With the step after a start left out of the samples (START_SETTLE) and refreshes that run on to a
    sample (REFRESH_MAX_STEPS), k = 4 runs a median of at least 91 % of the steps over 8 runs (0.88-0.95
    each). Power: counting that step and ending a refresh after REFRESH_STEPS steps whatever they sampled,
    the median is under 90 % (0.80-0.93 each)."""
    import statistics

    from target_service import policy as policy_module
    from target_service import step_accounting

    shares = [_k4_share_through_starts(seed) for seed in range(8)]
    assert statistics.median(shares) >= 0.91, shares
    monkeypatch.setattr(step_accounting, "START_SETTLE", 0)
    monkeypatch.setattr(policy_module, "REFRESH_MAX_STEPS", policy_module.REFRESH_STEPS)
    shares_before = [_k4_share_through_starts(seed) for seed in range(8)]
    assert statistics.median(shares_before) < 0.90, shares_before
