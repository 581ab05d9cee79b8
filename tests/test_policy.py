"""The speculation policy on measured costs: k rises where the verify is memory-bound and acceptance is
high, falls to 0 where a wide verify costs more than the tokens it adds; stale timings are refreshed and
the gate measures whether speculation pays at all."""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import replace

import pytest

from target_service import policy as policy_module
from target_service import step_costs as step_costs_module
from target_service.detok import StreamDetokenizer
from target_service.gate import BRANCH_GATE, SPECULATION_GATE, GateConfig, ModeGate
from target_service.policy import SpeculationPolicy, expected_tokens
from target_service.request import Request, check_stop
from target_service.step_costs import STEP_WINDOW, AdmissionCosts, StepCosts

BUCKETS = [1, 2, 4, 8, 16, 32, 64]
# The model's tests take gate=False: the gate (measured windows, tested below) would hold the first
# window at the model's first choice.


def reqs(n: int, k: int = 4, alpha: float | None = None, trials: int = 200) -> list[Request]:
    out = []
    for i in range(n):
        r = Request(str(i), [1], 8, 0.0, 0, 1.0, 0, k, frozenset(), StreamDetokenizer(None))
        if alpha is not None:  # a long history at this per-token acceptance
            r.spec.successes, r.spec.trials = alpha * trials, float(trials)
        out.append(r)
    return out


def costs(batch: int, per_width: dict[int, float], draft: float = 0.0, k: int = 4) -> StepCosts:
    c = StepCosts(BUCKETS)
    for width, seconds in per_width.items():
        c.observe_verify(batch, width, seconds)
    c.observe_draft(batch, k, draft)
    return c


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(0.9, 0) == 1.0


def test_memory_bound_batch_speculates_fully():
    # B=1: width 5 costs 10% more than width 1; alpha 0.8 -> E = 3.36 tokens per step.
    c = costs(1, {1: 1.0e-3, 2: 1.02e-3, 3: 1.04e-3, 4: 1.07e-3, 5: 1.1e-3}, draft=0.3e-3)
    assert SpeculationPolicy("adaptive", c, gate=False).choose(reqs(1, alpha=0.8)) == 4


def test_compute_bound_batch_stops_speculating():
    # B=64: each extra position costs a full plain step; alpha 0.3 never pays that back.
    c = costs(64, {w: 5e-3 * w for w in range(1, 6)}, draft=2e-3)
    policy = SpeculationPolicy("adaptive", c, gate=False)
    assert policy.choose(reqs(64, alpha=0.3)) == 0
    # The reason is kept for GetModelInfo, the metrics and the request's usage; a drafting step clears it.
    assert policy.off_reason == policy_module.COST_ESTIMATED
    assert policy.off_reason.startswith("draft cost exceeds expected gain")
    assert policy.choose(reqs(64, k=0)) == 0 and policy.off_reason == ""  # the requests asked for k = 0


def test_intermediate_k_and_fixed_mode():
    # Positions 1-2 nearly free, 3-4 expensive: the best k is 2 at alpha 0.7.
    c = costs(16, {1: 1e-3, 2: 1.05e-3, 3: 1.1e-3, 4: 2.5e-3, 5: 4e-3}, draft=0.2e-3)
    batch = reqs(16, alpha=0.7)
    adaptive = SpeculationPolicy("adaptive", c, gate=False)
    assert adaptive.choose(batch) == 2 and adaptive.off_reason == ""
    assert SpeculationPolicy("fixed", c).choose(batch) == 4  # fixed: each request's own k


def test_a_new_bucket_borrows_the_draft_wait_and_residue_of_the_nearest_one():
    c = costs(16, {w: 1e-3 for w in range(1, 6)}, draft=3e-3)
    c.observe_step(16, 0, 1.5e-3, verify=1e-3, draft_wait=0.0)
    for width in range(1, 6):
        c.observe_verify(8, width, 1e-3)
    # Bucket 8 has no draft wait or residue of its own: bucket 16's (3 ms, 0.5 ms), not free.
    assert c.step_seconds(8, 4) == pytest.approx(1e-3 + 3e-3 + 0.5e-3)
    batch = reqs(8, alpha=0.3)
    assert SpeculationPolicy("adaptive", c, gate=False).choose(batch) == 0


def test_start_up_verify_timings_take_the_drift_that_served_steps_show():
    # One H200, colocated: the start-up timings of B=1 widths 2-4 were taken while the draft captured
    # its graphs on the same GPU, and the untimed k = 1-3 read 7.4-8.5 ms against 4.3-5.7 ms served at
    # k = 4. A width never served is scaled by served / start-up of the width served last at its bucket.
    c = StepCosts(BUCKETS)
    for b in (1, 16):
        for width in range(1, 6):
            c.observe_startup_verify(b, width, 5e-3)  # inflated by the draft's start-up on the GPU
    assert c.verify_seconds(1, 3) == pytest.approx(5e-3)  # nothing served yet: the start-up figure
    for _ in range(16):  # served steps at width 5 take 2 ms: the start-up sample is flushed out
        c.observe_verify(1, 5, 2e-3)
    assert c.verify_seconds(1, 5) == pytest.approx(2e-3)
    assert c.verify_seconds(1, 3) == pytest.approx(2e-3)  # 5 ms x 2 / 5
    assert c.verify_seconds(16, 3) == pytest.approx(5e-3)  # another bucket: its own drift, none yet
    c.observe_verify(1, 1, 1e-3)  # a served width keeps its own figure
    assert c.verify_seconds(1, 1) == pytest.approx(1e-3)  # the lower median of the start-up 5 and served 1
    assert c.verify_seconds(1, 3) == pytest.approx(5e-3 * 1e-3 / 5e-3)  # the latest served width's drift
    c.observe_verify(1, 1, 3e-3)
    assert c.verify_seconds(1, 1) == pytest.approx(3e-3)  # of three, the middle one


def test_one_stalled_verify_does_not_price_its_width_out():
    """A width's start-up timing and one stalled served sample: the lower of the two, not their mean (one
    H200, B=1: 107 ms beside ~2 priced k = 4 at 55 ms, and no k = 4 step ran again to correct it). Whole
    steps keep the plain median (power: the same two samples of a step average)."""
    c = StepCosts(BUCKETS)
    c.observe_startup_verify(1, 5, 2e-3)
    c.observe_verify(1, 5, 107e-3)
    assert c.verify_seconds(1, 5) == pytest.approx(2e-3)
    c.observe_step(1, 4, 2e-3, verify=1e-3, draft_wait=0.0)
    c.observe_step(1, 4, 107e-3, verify=1e-3, draft_wait=0.0)
    assert c.step_seconds(1, 4) == pytest.approx(54.5e-3)


def test_admission_surcharge_is_speculations_extra_per_start_times_the_starts_a_step_brings(monkeypatch):
    monkeypatch.setattr(AdmissionCosts, "HORIZON_TOKENS", float("inf"))  # no decay: exact sums
    c = StepCosts(BUCKETS)
    a = AdmissionCosts(c)
    for _ in range(4):  # steady steps: 10 ms plain, 15 ms at k = 4 (batch 8)
        c.observe_step(8, 0, 10e-3, 9e-3, 0.0)
        c.observe_step(8, 4, 15e-3, 11e-3, 1e-3)
    a.observe(8, 4, 0, 160, 15e-3, True)  # no start: counted in the rate, no sample
    assert a.surcharge(8, 20) is None  # speculation's starts not measured yet
    a.observe(8, 4, 2, 20, 215e-3, True)  # two starts cost 200 ms beyond a steady step ...
    assert a.surcharge(8, 20) is None  # ... and their sample waits for the next step (START_SETTLE)
    a.observe(8, 4, 0, 20, 35e-3, True)  # which they slow by 20 ms: 220 ms for two, 110 ms each
    assert a.surcharge(8, 20) == pytest.approx(0.11 * 20 * 2 / 200)  # plain's unmeasured anywhere: none
    a.observe(8, 0, 4, 8, 90e-3, False)  # not its mode's steady state (a catch-up, a draft round left)
    a.observe(8, 0, 0, 8, 10e-3, True)
    assert 8 not in a.per_start[False] and a.starts == 6
    a.observe(8, 0, 4, 8, 90e-3, True)  # plain starts 4 at once for 80 ms; the next step runs the other
    a.observe(8, 4, 0, 20, 45e-3, True)  # mode, so its time is not theirs: 20 ms each
    assert a.surcharge(8, 20) == pytest.approx(0.09 * 20 * 10 / 244)
    a.observe(8, 0, 1, 8, 5e-3, True)  # faster than steady: no negative extra
    a.observe(8, 0, 0, 8, 10e-3, True)
    assert a.per_start[False][8] == pytest.approx(0.01)  # the median of 20 ms and 0
    a.observe(16, 4, 1, 20, 1.0, True)  # another bucket's steady step is untimed: no sample there
    a.observe(16, 4, 0, 20, 1.0, True)
    assert 16 not in a.per_start[True] and a.surcharge(16, 20) is None
    c.observe_step(16, 4, 20e-3, 15e-3, 1e-3)
    a.observe(16, 4, 1, 20, 120e-3, True)  # 100 ms for one start; the next step starts one too, so its
    a.observe(16, 4, 1, 20, 50e-3, True)  # time is its own: 100 ms; plain's from the nearest bucket, 10 ms
    assert a.surcharge(16, 20) == pytest.approx(0.09 * 20 * a.starts / a.tokens)


def test_the_start_rate_forgets_over_its_token_horizon():
    a = AdmissionCosts(StepCosts(BUCKETS))
    a.observe(8, 0, 8, 8, 0.0, False)  # a wave: 8 starts
    for _ in range(int(a.HORIZON_TOKENS) // 64):  # one horizon of steps that start nothing
        a.observe(8, 0, 0, 64, 0.0, False)
    assert a.starts == pytest.approx(8 / math.e, rel=1e-3)


def test_batch_tokens_matches_expected_tokens():
    batch = reqs(3, alpha=0.6) + reqs(2, k=2, alpha=0.3)
    policy = SpeculationPolicy("adaptive", StepCosts(BUCKETS), gate=False)
    prior = policy.prior_alpha
    want = [sum(expected_tokens(r.spec.alpha(prior), min(k, r.k)) for r in batch) for k in range(5)]
    assert policy.batch_tokens(batch, 4) == pytest.approx(want)


def test_whole_step_wall_time_outranks_its_parts():
    # The parts say k = 4 pays (a 2.6 ms verify + 0.3 ms wait for 1.56 tokens against a 2.5 ms plain
    # step), but whole steps at k = 4 took 6.2 ms: the policy goes by what the steps cost.
    c = costs(1, {1: 2.5e-3, 5: 2.6e-3}, draft=0.3e-3)
    batch = reqs(1, alpha=0.36)
    policy = SpeculationPolicy("adaptive", c, gate=False)
    assert policy.choose(batch) > 0
    c.observe_step(1, 0, 2.7e-3, verify=2.5e-3, draft_wait=0.0)
    for k in range(1, 5):
        c.observe_step(1, k, 6.2e-3, verify=2.6e-3, draft_wait=0.3e-3)
    assert c.step_seconds(1, 4) == pytest.approx(6.2e-3)
    assert policy.choose(batch) == 0
    # An untimed k is its parts: the verify, the draft wait and the host residue seen at this bucket
    # (median of 0.2, 3.3 x 4 ms), scaled by whole / parts of the nearest timed k (k = 1: 6.2 / 6.1 ms).
    c.step.pop((1, 2))
    assert c.parts_seconds(1, 2) == pytest.approx(2.5e-3 + 0.3e-3 + 3.3e-3)
    assert c.step_seconds(1, 2) == pytest.approx(6.1e-3 * 6.2 / 6.1)


def test_an_untimed_k_is_interpolated_between_buckets_or_scaled_like_the_nearest_timed_step():
    # One H200, 1.5B preset, colocated: the parts said 22.8 ms for k = 4 at bucket 32 (a draining batch)
    # where whole steps at k = 4 took 5.8 ms at bucket 16 and 11.6 ms at 64; at B=1 they said 7-8 ms for
    # k = 1-3 against 5.5 ms timed at k = 4 (the draft wait of a steady exchange is a whole round trip,
    # which draft-ahead hides in most steps).
    c = StepCosts(BUCKETS)
    for b, verify in ((1, 2e-3), (16, 2.7e-3), (32, 3.5e-3), (64, 5e-3)):
        for width in range(1, 6):
            c.observe_verify(b, width, verify)
        c.observe_draft(b, 4, 3e-3)  # the wait of a steady exchange: a round trip
    c.observe_step(1, 4, 5.5e-3, verify=2e-3, draft_wait=0.5e-3)  # residue 3 ms
    c.observe_step(16, 4, 5.8e-3, verify=2.7e-3, draft_wait=0.5e-3)
    c.observe_step(64, 4, 11.6e-3, verify=5e-3, draft_wait=0.5e-3)
    c.observe_step(32, 2, 8.2e-3, verify=3.5e-3, draft_wait=0.5e-3)
    # Between buckets 16 and 64, linear in the batch: 5.8 + (11.6 - 5.8) * 16 / 48.
    assert c.step_seconds(32, 4) == pytest.approx(5.8e-3 + 5.8e-3 / 3)
    assert c.step_seconds(25, 4) == c.step_seconds(32, 4)  # batch 25 is bucket 32's
    # The policy at a batch of 25 then picks k = 4, not the one k timed there (k = 2 at 8.2 ms).
    batch = reqs(25, alpha=0.8)
    assert SpeculationPolicy("adaptive", c, gate=False).choose(batch) == 4
    # Nothing timed at k = 3 anywhere: its parts (2 + 3 + 3 ms at B=1) scaled by the nearest timed
    # step's whole / parts (k = 4 at B=1: 5.5 / 8 ms), not 8 ms. Here the draft-wait median (3 ms) is
    # not the timed step's own wait (0.5 ms), as when most waits are hidden by draft-ahead but the median
    # is not; where the parts of the timed step add up to it, the ratio is ~1 and changes nothing (the
    # start-up drift test below covers the case seen on the H200).
    assert c.parts_seconds(1, 3) == pytest.approx(8e-3)
    assert c.step_seconds(1, 3) == pytest.approx(8e-3 * 5.5 / 8)
    # Plain steps scale plain estimates only: k = 0 at B=1 untimed is its parts (2 ms verify + residue
    # 3 ms) until a plain step is timed somewhere; then it is scaled like it.
    assert c.step_seconds(1, 0) == pytest.approx(5e-3)
    c.observe_step(16, 0, 2.9e-3, verify=2.7e-3, draft_wait=0.0)
    residue_16 = c.residue_seconds(16)  # median of 2.6 and 0.2 ms
    assert c.step_seconds(1, 0) == pytest.approx(5e-3 * 2.9e-3 / (2.7e-3 + residue_16))


def test_unmeasured_batch_measures_plain_then_speculates():
    c = StepCosts(BUCKETS)
    policy = SpeculationPolicy("adaptive", c, gate=False)
    assert policy.choose(reqs(3)) == 0  # nothing known at this batch: a plain step first
    c.observe_verify(3, 1, 1e-3)
    assert policy.choose(reqs(3)) == 4  # wider steps assumed as cheap until measured: try the widest


def test_acceptance_estimate_tracks_verdicts():
    r = reqs(1)[0]
    prior = r.spec.alpha(0.7)
    for _ in range(30):
        r.spec.observe(drafted=4, accepted=0)
    assert r.spec.alpha(0.7) < 0.1 < prior
    for _ in range(60):
        r.spec.observe(drafted=4, accepted=4)
    assert r.spec.alpha(0.7) > 0.9
    assert (r.spec.drafted, r.spec.accepted, r.spec.steps) == (360, 240, 90)


def test_bad_policy_name():
    with pytest.raises(ValueError, match="--speculation-policy"):
        SpeculationPolicy("greedy", StepCosts(BUCKETS))


def test_check_stop():
    eos = frozenset({2})
    assert check_stop([5, 6, 7], frozenset({2, 9}), eos, 10) == ([5, 6, 7], 0)
    assert check_stop([5, 2, 7], frozenset({2}), eos, 10)[1] == 2  # EOS
    assert check_stop([5, 9, 7], frozenset({2, 9}), eos, 10) == ([5], 3)  # a stop token
    assert check_stop([5, 6, 7], frozenset(), eos, 2) == ([5, 6], 1)  # length


def test_new_requests_start_from_the_service_acceptance():
    c = costs(1, {1: 1.0e-3, 2: 1.05e-3, 3: 1.1e-3, 4: 1.15e-3, 5: 1.2e-3}, draft=0.3e-3)
    policy = SpeculationPolicy("adaptive", c, gate=False)
    assert policy.choose(reqs(1)) == 4  # prior 0.7: worth it
    for _ in range(200):  # the draft rarely agrees
        policy.observe([4], [0])
    assert policy.prior_alpha < 0.1
    assert policy.choose(reqs(1)) == 0  # a fresh request does not re-learn that


def test_a_draft_that_is_never_right_costs_no_tries():
    """Once the service's acceptance says no k can add MIN_GAIN tokens per step, the policy runs plain:
    no timing of an untimed k, no refresh, no gate window; one step in REPROBE_EVERY still tries, so a
    draft that gets better is noticed."""
    c = StepCosts(BUCKETS)  # nothing timed: a promising draft would make the policy measure every k
    c.observe_verify(16, 1, 2e-3)
    policy = SpeculationPolicy("adaptive", c)
    assert policy.choose(reqs(16)) > 0  # prior 0.7: measure a wider step
    for _ in range(2000):
        policy.observe([4], [0])
    chosen = [policy.choose(reqs(16)) for _ in range(2 * policy_module.REPROBE_EVERY)]
    assert chosen.count(0) == len(chosen) - 2 and sum(k > 0 for k in chosen) == 2, sorted(set(chosen))
    assert policy.choose(reqs(16)) == 0 and policy.off_reason == policy_module.LOW_ACCEPTANCE
    # Power: a draft right half the time is measured at once.
    for _ in range(2000):
        policy.observe([2], [1])
    assert policy.choose(reqs(16)) > 0


def test_a_draft_right_by_chance_rests():
    # A draft that is never right is accepted 2-4 % of the time by chance (SmolLM2-135M's at one stream):
    # under MIN_GAIN at k = 4, so it rests. Power: one accepted 8 % of the time is still measured.
    def alpha_after(accepted_every: int) -> SpeculationPolicy:
        c = StepCosts(BUCKETS)
        c.observe_verify(1, 1, 1e-3)
        policy = SpeculationPolicy("adaptive", c)
        for i in range(3000):
            policy.observe([4], [1 if i % accepted_every == 0 else 0])
        return policy

    chance = alpha_after(32)  # one success in 33 trials: alpha 0.03
    assert 0.02 < chance.prior_alpha < 0.045
    assert chance.choose(reqs(1)) == 0 and chance.off_reason == policy_module.LOW_ACCEPTANCE
    better = alpha_after(11)  # one in 12: alpha 0.083, 9 % more tokens at k = 4
    assert better.choose(reqs(1)) > 0 and better.off_reason != policy_module.LOW_ACCEPTANCE


def _bucket_windows(gate: ModeGate, batch: int, rate, steps: int, model=None) -> list[tuple[bool, int]]:
    """(mode, steps) of each window `gate` runs at `batch`, when a step emits 4 tokens at rate(step, on)
    tokens per second; model = (on, off): the policy's model rates, told to the gate every step."""
    windows, index, bucket = [], None, gate.costs.bucket(batch)
    for step in range(steps):
        on = gate.want(batch)
        if model is not None:
            gate.model_says(batch, *model)
        if gate.state[bucket].windows != index:
            index = gate.state[bucket].windows
            windows.append([gate.state[bucket].on, 0])
        windows[-1][1] += 1
        gate.observe(batch, 4, 4 / rate(step, on))
    return [tuple(w) for w in windows]


def _gate_windows(rate, steps: int = 16 * 64, config: GateConfig = BRANCH_GATE) -> list[tuple[bool, int]]:
    """The same for a fresh gate at B=1."""
    return _bucket_windows(ModeGate(StepCosts([1, 2, 4]), config), 1, rate, steps)


def _share_on(windows: list[tuple[bool, int]]) -> float:
    return sum(n for on, n in windows if on) / sum(n for _, n in windows)


def test_gate_keeps_the_faster_mode_and_still_tries_the_other():
    # Branches 1.5x faster: each mode first runs a warm-up half window, then a measured one; off (below
    # 0.7x on) ends its measured windows after 2 + 4 steps; then on, with tries of off (6 steps each) at
    # windows 20 and 52 (the wait doubles after each lost try).
    windows = _gate_windows(lambda step, on: 1500.0 if on else 1000.0)
    assert windows[:5] == [(True, 8), (True, 16), (False, 8), (False, 6), (True, 16)]
    assert [i for i, w in enumerate(windows) if w == (False, 6)] == [3, 20, 52]
    assert all(w == (True, 16) for i, w in enumerate(windows[4:-1], 4) if i not in (20, 52))  # [-1]: cut
    assert 0.97 <= _share_on(windows[4:]) < 1.0
    # Branches slower (a draft whose branch round outlasts the target's step): off almost always; on at
    # 0.78x is not a clear loss (early_loss 0.75), but its steps are longer (4 tokens in 5.1 ms against
    # 4 ms): a try lasts as long as an off window; at 0.6x it is (tries of 6 steps).
    windows = _gate_windows(lambda step, on: 780.0 if on else 1000.0)
    assert windows[:4] == [(True, 8), (True, 16), (False, 8), (False, 16)]
    assert 0.0 < _share_on(windows[4:]) <= 0.1 and {n for on, n in windows[4:] if on} == {15}
    windows = _gate_windows(lambda step, on: 600.0 if on else 1000.0)
    assert 0.0 < _share_on(windows[4:]) <= 0.05 and {n for on, n in windows[4:] if on} == {6}


def test_gate_tries_a_losing_mode_less_often_and_follows_a_change_at_once():
    # Branches 1.5x faster: off is tried after 16 windows, then 32, then every 64 (its cap).
    def rate(step: int, on: bool) -> float:
        if step < 16 * 150:
            return 1500.0 if on else 1000.0
        return 650.0 if on else 1000.0  # the world changes: branches now slow the step down

    windows = _gate_windows(rate, steps=16 * 212)
    starts = [sum(n for _, n in windows[:i]) for i in range(len(windows))]
    tries = [i for i, (on, _) in enumerate(windows) if not on and starts[i] < 16 * 150]
    assert tries == [2, 3, 20, 52, 116], tries  # warm-up and first measure, then 16, 32 and 64 windows on
    # The mode in use is measured every window: once it is slower, off within two windows (the second
    # ends early), and it stays off; on, having fallen (not lost a try), is tried again after one window
    # (one slow window may have been all it was), then after 2, 4, 8, 16 and 32, each try ending after
    # 6 steps.
    change = next(i for i, s in enumerate(starts) if s + windows[i][1] > 16 * 150)
    after = windows[change:]
    assert after[:3] == [(True, 16), (True, 6), (False, 16)], after[:3]
    ons = [i for i, (on, _) in enumerate(after) if on and i > 1]
    assert ons == [3, 5, 9, 17, 33, 65] and all(after[i] == (True, 6) for i in ons), ons


def test_one_slow_window_of_the_better_mode_costs_one_window_of_the_other():
    # One H200, B=1: branches on ran ~650 tok/s, off ~446 (here 420: the capped reading below stays above
    # early_loss 0.75 of it); one window on at ~270 (smoothed with the one before: 460) put them below
    # off, and off then held for the rest of the run (its next try was 16 windows away). Now the mode
    # that fell is tried again after one window, and stays.
    def rate(step: int, on: bool) -> float:
        if on:
            return 270.0 if 16 * 40 <= step < 16 * 41 else 650.0
        return 420.0

    def after_slow(config: GateConfig = BRANCH_GATE) -> list[tuple[bool, int]]:
        windows = _gate_windows(rate, 16 * 80, config)
        starts = [sum(n for _, n in windows[:i]) for i in range(len(windows))]
        slow = next(i for i, s in enumerate(starts) if s + windows[i][1] > 16 * 40)
        return windows[slow:]

    # Its steps at 2.4x the mode's mean count at stall_cap (2x): the slow window reads 325 (smoothed: 487),
    # still above off, and on holds (but for the usual tries of off, 16 windows apart).
    after = after_slow()
    assert after[:3] == [(True, 16), (True, 16), (True, 16)], after[:3]
    assert _share_on(after) > 0.9
    # Counted whole: the slow stretch (its second window ends early: below 0.75x off), then off for one
    # window, then on for good.
    after = after_slow(replace(BRANCH_GATE, stall_cap=float("inf")))
    assert after[:4] == [(True, 11), (True, 6), (False, 16), (True, 16)], after[:4]
    assert _share_on(after[3:]) > 0.9


def test_a_mode_that_stays_slow_is_left_despite_the_stall_cap():
    # The cap moves with the mode's mean: on at 650 tok/s, then for good at 270 (off 446) is left after
    # a few windows, and tried now and then.
    windows = _gate_windows(lambda step, on: (270.0 if step >= 16 * 40 else 650.0) if on else 446.0, 16 * 80)
    starts = [sum(n for _, n in windows[:i]) for i in range(len(windows))]
    slow = next(i for i, s in enumerate(starts) if s + windows[i][1] > 16 * 40)
    # The window it slows in reads 2x slower, the next (below 0.75x off) ends early, then off.
    assert windows[slow : slow + 3] == [(True, 15), (True, 6), (False, 16)], windows[slow : slow + 5]
    assert _share_on(windows[slow + 2 :]) < 0.1


def test_a_slow_first_window_does_not_hold_a_mode_off():
    # What one H200 showed at B=1: the first windows with speculation on ran 413 tok/s (the policy still
    # timing its k's), steady ones 580, plain 500. The first window of a mode is a warm-up, and a try
    # replaces the rate it measured windows ago: on from the first measured window, and it stays on.
    def run(slow_windows: int) -> list[bool]:
        gate, modes, on_windows, index = ModeGate(StepCosts([1, 2, 4])), [], 0, None
        for _ in range(16 * 40):
            on = gate.want(1)
            if gate.state[1].windows != index:
                index = gate.state[1].windows
                modes.append(on)
                on_windows += on
            rate = (413.0 if on_windows <= slow_windows else 580.0) if on else 500.0
            gate.observe(1, 1, 1 / rate)
        return modes

    modes = run(1)
    assert modes[:4] == [True, True, False, False] and modes[4:20] == [True] * 16 and modes[20] is False
    # A slow second window too: off wins at first; the try (16 windows after the first measure of off)
    # reads 580, fresh, and switches back on for good, but for the try of off 16 windows later.
    modes = run(2)
    assert modes[:19] == [True, True] + [False] * 17
    assert modes[19:36] == [True] * 17 and modes[36] is False and modes[37:] == [True] * len(modes[37:])
    # Had the try averaged its 580 with the stale 413 (496.5 < 500), off would have stayed: modes[19:]
    # above is that check (verified against the averaging gate before this change).


def test_a_new_bucket_starts_in_the_better_mode_of_the_nearest_measured_one():
    # A batch that drains (16, 8, ... as requests finish) meets new buckets: each would pay a window of
    # the worse mode. Bucket 1 measured both (on 1.5x off); bucket 2 starts on and tries off only after
    # 4 windows (then 8, 16), each try ending after 6 steps.
    def gate_after_bucket_1() -> ModeGate:
        gate = ModeGate(StepCosts([1, 2, 4]))
        assert _bucket_windows(gate, 1, lambda step, on: 1500.0 if on else 1000.0, 16 * 8)[:4] == [
            (True, 8), (True, 16), (False, 8), (False, 6)]  # fmt: skip
        return gate

    gate = gate_after_bucket_1()
    _bucket_windows(gate, 2, lambda step, on: 3000.0 if on else 2000.0, 16 * 3)
    assert ", B<=2 on (on/off 3000/~2000 tok/s, window 3)" in gate.describe()  # ~: estimated, not measured
    windows = _bucket_windows(gate_after_bucket_1(), 2, lambda step, on: 3000.0 if on else 2000.0, 16 * 40)
    assert [i for i, (on, _) in enumerate(windows) if not on] == [5, 13, 29]
    assert windows[:5] == [(True, 8)] + [(True, 16)] * 4 and windows[5] == (False, 6)
    # A wrong start costs at most those 4 windows: off measured, better here, it switches and stays.
    gate = gate_after_bucket_1()
    windows = _bucket_windows(gate, 2, lambda step, on: 1200.0 if on else 2000.0, 16 * 30)
    assert windows[:5] == [(True, 8)] + [(True, 16)] * 4 and windows[5:22] == [(False, 16)] * 17
    assert gate.rate[(2, False)] == pytest.approx(2000.0) and gate.rate[(2, True)] == pytest.approx(1200.0)
    # Power: a bucket with no measured neighbour measures both modes first (windows 2-3 off).
    fresh = _bucket_windows(
        ModeGate(StepCosts([1, 2, 4])), 2, lambda step, on: 3000.0 if on else 2000.0, 16 * 8
    )
    assert fresh[:4] == [(True, 8), (True, 16), (False, 8), (False, 6)]


def test_a_new_bucket_ignores_a_neighbour_whose_second_mode_has_only_warmed_up():
    # Bucket 16 measured on, then ran off's warm-up half window (off now has a rated_at but no rate); a
    # batch draining to 8 then starts bucket 8. That raised a KeyError inside the step (one in ~7 draining
    # runs of bench/host_path.py --drain), which failed every running request.
    gate = ModeGate(StepCosts([1, 2, 4, 8, 16]))
    windows = _bucket_windows(gate, 16, lambda step, on: 1500.0 if on else 1000.0, 8 + 16 + 8)
    assert windows == [(True, 8), (True, 16), (False, 8)]
    assert (16, False) in gate.rated_at and (16, False) not in gate.rate
    assert gate.want(8, default=False) is False  # no measured neighbour: the caller's default
    assert 8 not in gate.ratio


def test_a_first_window_the_model_clearly_rates_the_loser_ends_early():
    # The real SmolLM2 pair's shape: speculation measures 500 tok/s against 800 plain, and the policy's
    # model (from timed steps) says so. Told after each step, the gate leaves the bucket's first window
    # (on, a warm-up) after 2 + 4 steps, estimates on from the model's ratio and tries it after 4
    # windows, where the measured loss (below 0.7x) ends the try after 6 steps.
    def run(model: tuple[float, float] | None, steps: int = 16 * 12, on_rate: float = 500.0):
        gate = ModeGate(StepCosts([1, 2, 4]))
        return gate, _bucket_windows(gate, 1, lambda step, on: on_rate if on else 800.0, steps, model)

    gate, windows = run((500.0, 800.0))
    assert windows[:6] == [(True, 6), (False, 8), (False, 16), (False, 16), (False, 16), (False, 16)]
    assert windows[6] == (True, 6)  # the try
    assert gate.rate[(1, True)] == pytest.approx(500.0)  # measured by the try, no longer the estimate
    # Power: without the model the first window runs its warm-up and a full measured window (on has
    # nothing measured to lose against), 24 steps at 0.6x.
    _, windows = run(None)
    assert windows[:3] == [(True, 8), (True, 16), (False, 8)]
    # A model that rates them close (0.9x) leaves the gate to measure; and once a mode is measured in the
    # bucket, the model no longer ends windows there.
    _, windows = run((720.0, 800.0))
    assert windows[:3] == [(True, 8), (True, 16), (False, 8)]
    gate, _ = run(None, steps=16 * 3)
    state = gate.state[1]
    gate.model_says(1, 100.0, 800.0)
    assert gate.state[1] is state
    # The other way round: on (1500) measured first; plain's first window, a warm-up, ends after 6 steps,
    # its rate estimated from on's measured one and the model's ratio, and tried after 4 windows (ending
    # after 6 steps again, measured this time).
    gate, windows = run((1500.0, 800.0), on_rate=1500.0)
    assert windows[:7] == [(True, 8), (True, 16), (False, 6)] + [(True, 16)] * 4
    assert windows[7] == (False, 6)
    assert gate.rate[(1, False)] == pytest.approx(800.0) and gate.rated_at[(1, False)] >= 0


def test_gate_per_batch_bucket():
    gate = ModeGate(StepCosts([1, 2, 4]))
    for _ in range(64):  # bucket 1: on wins; bucket 4: off wins
        gate.observe(1, 4, 4 / (1500.0 if gate.want(1) else 1000.0))
        gate.observe(4, 16, 16 / (3000.0 if gate.want(4) else 4000.0))
    assert gate.rate[(1, True)] > gate.rate[(1, False)] and gate.rate[(4, True)] < gate.rate[(4, False)]
    # The log line: each bucket's mode now and its measured rates (on/off), smoothed over windows.
    text = gate.describe()
    assert text.startswith("B<=1 on (on/off 1500/1000 tok/s, window ")
    assert ", B<=4 off (on/off 3000/4000 tok/s, window " in text


def test_explain_gives_each_k_its_seconds_source_and_rate():
    c = costs(1, {1: 2e-3, 5: 2.5e-3}, draft=1e-3)
    c.observe_step(1, 4, 4e-3, verify=2.5e-3, draft_wait=1e-3)
    text = SpeculationPolicy("adaptive", c, gate=False).explain(reqs(1, alpha=0.8))
    parts = text.split("; ")
    assert [p.split()[0] for p in parts] == [f"k={k}" for k in range(5)]
    assert "4.00 ms (timed) x 3.36 tok = 839 tok/s" in parts[4]  # (1 + .8 + .64 + .512 + .4096) / 4 ms
    assert "(parts)" in parts[0]


def _gated_choices(policy, batch, seconds_per_step, steps=16 * 40) -> list[int]:
    """The policy's k at each step when a step at k emits E tokens in seconds_per_step(k)."""
    chosen = []
    for _ in range(steps):
        k = policy.choose(batch)
        chosen.append(k)
        tokens = policy.batch_tokens(batch, 4)[k]
        policy.observe_step(len(batch), round(tokens), seconds_per_step(k))
    return chosen


def test_measured_windows_overrule_the_model_both_ways():
    batch = reqs(1, alpha=0.8)
    # The model says k = 4 pays (a 1.1 ms verify, 0.3 ms draft wait), but whole speculative steps take
    # 9 ms against 1 ms plain (what the TP=2 pair did): after the first two windows, plain, with a window
    # of 16 speculative steps tried now and then.
    c = costs(1, {1: 1.0e-3, 2: 1.02e-3, 3: 1.04e-3, 4: 1.07e-3, 5: 1.1e-3}, draft=0.3e-3)
    gated = SpeculationPolicy("adaptive", c)
    chosen = _gated_choices(gated, batch, lambda k: 9e-3 if k else 1e-3)
    # the model first, then the other mode (each a warm-up half window, then a measured one)
    assert chosen[:24] == [4] * 24 and chosen[24:48] == [0] * 24
    # the last choice: plain by measurement, and it says so
    assert chosen[-1] == 0 and gated.off_reason == policy_module.COST_MEASURED
    late = chosen[64:]
    assert 0.85 <= sum(k == 0 for k in late) / len(late) < 1.0
    # The model says plain wins (speculative steps timed at 9 ms, and here the timings never refresh),
    # but whole speculative steps take 2 ms for 3.4 tokens against 1 ms per plain token. The model, rating
    # speculation below 0.7x from timed steps, ends its first window after 6 steps (ModeGate.model_says);
    # the try 4 windows later is measured whatever the model says, and from then on it is speculation
    # at the model's best k >= 1, mostly.
    c = costs(1, {1: 1.0e-3, 2: 1.02e-3, 3: 1.04e-3, 4: 1.07e-3, 5: 1.1e-3}, draft=0.3e-3)
    for k in range(5):
        c.observe_step(1, k, 9e-3 if k else 1e-3, verify=1e-3, draft_wait=0.0)
    policy = SpeculationPolicy("adaptive", c)
    chosen = _gated_choices(policy, batch, lambda k: 2e-3 if k else 1e-3)
    assert chosen[:24] == [0] * 24 and chosen[24:30] == [4] * 6 and chosen[30:94] == [0] * 64
    assert chosen[94:110] == [4] * 16  # the try, a whole measured window
    late = chosen[94:]
    assert 0.85 <= sum(k == 4 for k in late) / len(late) < 1.0
    # Without the gate the model alone decides: plain throughout (the power of the check above).
    assert set(_gated_choices(SpeculationPolicy("adaptive", c, gate=False), batch, lambda k: 2e-3)) == {0}


def _stale_k4_run(policy: SpeculationPolicy, c: StepCosts, steps: int = 400) -> list[int]:
    true = {0: 2e-3, 1: 6e-3, 2: 6e-3, 3: 4.3e-3, 4: 4.0e-3}  # steady whole steps at each k
    batch, chosen = reqs(1, alpha=0.8), []
    for _ in range(steps):
        k = policy.choose(batch)
        chosen.append(k)
        c.observe_step(1, k, true[k], verify=1e-3, draft_wait=0.0)
        # the gate's windows (with the gate: on at 3.4 tokens per 4 ms against plain at 1 per 2 ms)
        policy.observe_step(1, round(policy.batch_tokens(batch, 4)[k]), true[k])
    return chosen


@pytest.mark.parametrize("gate", [True, False])
def test_a_stale_timing_is_refreshed(gate, monkeypatch):
    # k = 4 was timed at 7 ms in the warm-up and never chosen again (what one H200 showed at B=1: 7.0 ms
    # logged, 5.0 ms steady); steady k = 4 steps take 4.0 ms, k = 3 steps 4.3 ms. The policy starts at
    # k = 3 on the stale figure, re-times k = 4 after REFRESH_AGE steps and keeps it.
    def fresh_costs() -> StepCosts:
        c = costs(1, {w: 1e-3 for w in range(1, 6)})
        for k, seconds in {0: 2e-3, 1: 6e-3, 2: 6e-3, 4: 7e-3, 3: 4.3e-3}.items():
            c.observe_step(1, k, seconds, verify=1e-3, draft_wait=0.0)
        return c

    c = fresh_costs()
    chosen = _stale_k4_run(SpeculationPolicy("adaptive", c, gate=gate), c)
    assert chosen[:16] == [3] * 16
    first_k4 = chosen.index(4)
    assert policy_module.REFRESH_AGE <= first_k4 <= policy_module.REFRESH_AGE + 20, first_k4
    late = chosen[first_k4 + policy_module.REFRESH_STEPS :]
    # k = 4 from then on, but for the refreshes of k = 3 (4 steps in about every 68)
    assert sum(k == 4 for k in late) / len(late) >= 0.85, chosen
    # Power: without refreshes the stale figure holds k = 3 throughout (with the gate: or k = 0).
    monkeypatch.setattr(policy_module, "REFRESH_AGE", 10**9)
    c = fresh_costs()
    assert 4 not in _stale_k4_run(SpeculationPolicy("adaptive", c, gate=gate), c)


def _steady_run(policy: SpeculationPolicy, c: StepCosts, true, steps: int) -> list[int]:
    """`steps` steps of one request at per-token acceptance 0.8, each k's step taking true(step, k)."""
    batch, chosen = reqs(1, alpha=0.8), []
    for i in range(steps):
        k = policy.choose(batch)
        chosen.append(k)
        c.observe_step(1, k, true(i, k), verify=1e-3, draft_wait=0.0)
    return chosen


def _timed_costs(true: dict[int, float]) -> StepCosts:
    c = costs(1, {w: 1e-3 for w in range(1, 6)})
    for k, seconds in true.items():
        c.observe_step(1, k, seconds, verify=1e-3, draft_wait=0.0)
    return c


def test_a_rival_that_keeps_losing_its_refreshes_is_refreshed_less_often(monkeypatch):
    """Steady costs where k = 2 and 3 stay within REFRESH_WITHIN of the best (k = 4) but below it, as with
    the draft's rounds chained at B=64 (the draft drafts 4 whatever is asked; a narrower verify saves
    little): each refresh they lose doubles their wait, so over 1500 steps they run < 5 % of the steps
    (2 x 4 steps at 64, 192, 448, 960). Power: without the back-off (REFRESH_AGE_MAX = REFRESH_AGE) they
    run every ~64 steps, > 9 %."""
    true = {1: 4.2e-3, 2: 4.1e-3, 3: 4.05e-3, 4: 4.0e-3}
    c = _timed_costs(true)
    chosen = _steady_run(SpeculationPolicy("adaptive", c, gate=False), c, lambda i, k: true[k], 1500)
    rivals = sum(k != 4 for k in chosen) / len(chosen)
    assert 0 < rivals < 0.05, rivals
    assert set(chosen) == {2, 3, 4}  # k = 1 (0.51 of k = 4's rate) is never tried
    monkeypatch.setattr(policy_module, "REFRESH_AGE_MAX", policy_module.REFRESH_AGE)
    c = _timed_costs(true)
    chosen = _steady_run(SpeculationPolicy("adaptive", c, gate=False), c, lambda i, k: true[k], 1500)
    assert sum(k != 4 for k in chosen) / len(chosen) > 0.09


def _refresh_through_unsampled_steps(steps: int = 190) -> list[int]:
    """k chosen per step where k = 3's median is stale (5 ms; its steps now take 3 ms, k = 4's 4 ms) and
    the first 6 steps at k = 3 are no cost samples (a run of starts: StepAccounting leaves them out)."""
    true = {1: 9e-3, 2: 9e-3, 3: 3e-3, 4: 4e-3}
    c = _timed_costs({**true, 3: 5e-3})
    policy, batch, chosen, unsampled = SpeculationPolicy("adaptive", c, gate=False), reqs(1, alpha=0.8), [], 0
    for _ in range(steps):
        k = policy.choose(batch)
        chosen.append(k)
        if k == 3 and unsampled < 6:
            unsampled += 1
            continue
        c.observe_step(1, k, true[k], verify=1e-3, draft_wait=0.0)
    return chosen


def test_a_refresh_whose_steps_are_no_samples_runs_on_until_one_is(monkeypatch):
    """The refresh of k = 3 comes after REFRESH_AGE steps, runs through its 6 unsampled steps to a sample,
    and k = 3 runs from then on. Power: a refresh of REFRESH_STEPS steps alone ends on the stale median,
    and k = 4 runs until the next refresh, REFRESH_AGE steps later."""
    chosen = _refresh_through_unsampled_steps()
    first = chosen.index(3)
    assert policy_module.REFRESH_AGE <= first <= policy_module.REFRESH_AGE + 2, first
    assert chosen[first : first + 7] == [3] * 7
    assert chosen[first:].count(3) / len(chosen[first:]) > 0.95, chosen
    monkeypatch.setattr(policy_module, "REFRESH_MAX_STEPS", policy_module.REFRESH_STEPS)
    capped = _refresh_through_unsampled_steps()
    assert capped[first : first + policy_module.REFRESH_STEPS] == [3] * policy_module.REFRESH_STEPS
    assert 3 not in capped[first + policy_module.REFRESH_STEPS : first + policy_module.REFRESH_AGE], capped


def test_a_rival_that_grows_faster_is_found_within_the_longest_wait():
    """k = 3 loses its refreshes for 1000 steps (its wait grows to REFRESH_AGE_MAX), then its steps take
    half the time: the policy picks it up within REFRESH_AGE_MAX steps and keeps it. A best k that grows
    slower is left at once: its own steps keep its median current."""
    true = {1: 4.2e-3, 2: 4.1e-3, 3: 4.05e-3, 4: 4.0e-3}

    c = _timed_costs(true)
    policy = SpeculationPolicy("adaptive", c, gate=False)
    assert set(_steady_run(policy, c, lambda i, k: true[k], 1000)) == {2, 3, 4}
    assert policy.refresh_age[1, 3] == policy_module.REFRESH_AGE_MAX
    chosen = _steady_run(policy, c, lambda i, k: 2.0e-3 if k == 3 else true[k], 1000)
    found = chosen.index(3)
    assert found <= policy_module.REFRESH_AGE_MAX + policy_module.REFRESH_STEPS, found
    assert chosen[found + 8 :].count(3) / len(chosen[found + 8 :]) > 0.9
    # The best growing slower: k = 4 steps take 8 ms from step 300 on; k = 3 (4.05 ms) takes over once
    # half of k = 4's window of STEP_WINDOW steps has the new cost.
    c = _timed_costs(true)
    chosen = _steady_run(SpeculationPolicy("adaptive", c, gate=False), c,
                         lambda i, k: 8e-3 if k == 4 and i >= 300 else true[k], 600)  # fmt: skip
    left = next(i for i in range(300, 600) if chosen[i] != 4)
    settled = 300 + STEP_WINDOW // 2 + 1
    assert left <= settled and chosen[settled + 8 :].count(4) / len(chosen[settled + 8 :]) < 0.05, left


def test_steps_without_speculating_requests_do_not_count_in_the_gate():
    c = costs(1, {w: 1e-3 for w in range(1, 6)})
    policy = SpeculationPolicy("adaptive", c)
    assert policy.choose(reqs(1, k=0)) == 0
    for _ in range(40):
        policy.observe_step(1, 1, 1e-3)
    assert policy.gate.state == {}


def test_a_try_of_the_mode_with_longer_steps_lasts_one_window_of_the_other_modes_time():
    # One H200, B=64: a speculative step emits ~210 tokens in ~11 ms (19 k tok/s), a plain one 64 in
    # 2.7 ms (23.7 k). A 16-step try of speculation then took four plain windows' time; now it lasts one
    # plain window's time (16 x 2.7 ms: 4 counted steps + 2 settling), and so does every on window.
    gate, batch = ModeGate(StepCosts(BUCKETS)), 64
    step = {True: (210, 11e-3), False: (64, 2.7e-3)}
    windows, index, seconds = [], None, {True: 0.0, False: 0.0}
    for _ in range(16 * 200):
        on = gate.want(batch)
        w = gate.state[64]
        if w.windows != index:
            index = w.windows
            windows.append([on, 0])
        windows[-1][1] += 1
        gate.observe(batch, *step[on])
        seconds[on] += step[on][1]
    first = [tuple(w) for w in windows[:4]]
    assert first == [(True, 8), (True, 16), (False, 8), (False, 16)]  # warm-ups, then a measured window each
    tries = [n for on, n in windows[4:] if on]
    assert tries and set(tries) == {6}, tries
    # Time with speculation on after the first measures: a try every 16, then 32, then 64 windows.
    late = sum(n * step[on][1] for on, n in windows[4:] if on) / sum(n * step[on][1] for on, n in windows[4:])
    assert late < 0.04, late


def test_exploring_is_a_try_or_a_second_modes_first_windows_and_best_is_the_faster_mode():
    gate, batch = ModeGate(StepCosts([1, 2, 4])), 1
    assert not gate.exploring(batch) and gate.best(batch) is True  # nothing yet: the default mode
    seen = []
    for _ in range(16 * 40):
        on = gate.want(batch)
        w = gate.state[1]
        seen.append((on, w.trying, gate.exploring(batch), gate.best(batch)))
        gate.observe(batch, 4, 4 / (1500.0 if on else 1000.0))  # on is faster
    # The first mode (on) is never exploring; off's first windows (after on was measured) and its later
    # tries are; once both are measured the best mode is on throughout.
    assert all(not exploring for on, _, exploring, _ in seen if on)
    assert all(exploring for on, _, exploring, _ in seen if not on)
    first_off = next(i for i, (on, *_) in enumerate(seen) if not on)
    assert all(best for *_, best in seen[first_off:])
    assert any(trying for _, trying, _, _ in seen)


def _near_tie_share_on(
    seed: int,
    on_tokens: int = 210,
    config: GateConfig = BRANCH_GATE,
    stall_every: int = 0,
    priced: bool = False,
) -> tuple[float, int]:
    """(share of time with speculation on, switches) at B=64 for speculation's gate when speculative steps
    run 0.94x plain's rate (210 tokens in 9.4 ms against 64 in 2.7 ms; `on_tokens` sets another) and every
    40 ms of GPU time the rates move together by a lognormal factor (sigma 0.08: one H200's B=64 plain
    windows ranged 17.5-23.8 k tok/s), after the first eight windows; every `stall_every`-th step (0:
    none) stalls 7 ms more (one H200, B=64: single 8.9-9.7 ms steps among 2.6 ms ones). `priced`: the
    steps carry their starts' surcharge (ModeGate.observe)."""
    gate, rng = ModeGate(StepCosts(BUCKETS), config), random.Random(seed)
    step = {True: (on_tokens, 9.4e-3), False: (64, 2.7e-3)}
    t, period, factor, time_on, time_all, switches, last = 0.0, -1, 1.0, 0.0, 0.0, 0, None
    for i in range(16 * 400):
        on = gate.want(64)
        if int(t / 0.04) != period:
            period, factor = int(t / 0.04), rng.lognormvariate(0.0, 0.08)
        tokens, seconds = step[on][0], step[on][1] * factor
        if stall_every and i % stall_every == stall_every - 1:
            seconds += 7e-3
        gate.observe(64, tokens, seconds, priced=priced)
        t += seconds
        if i >= 16 * 8:
            time_all += seconds
            time_on += seconds if on else 0.0
            switches += last is not None and on != last
        last = on
    return time_on / time_all, switches


def test_a_near_tie_in_noisy_windows_keeps_the_better_mode():
    # The mode held best stays so within `hysteresis`: a quarter as many switches (each costs the draft a
    # catch-up on every token since: 5-28 ms on one H200), 7-28 % of the time on (seeds 0-4). Without the
    # margin every window that dips below the other mode's rate switched: 130-196 switches in 6400 steps,
    # 30-46 % of the time on with speculation 6 % slower (the power of the check; measured, seeds 0-4).
    for seed in range(5):
        share, switches = _near_tie_share_on(seed)
        assert share < 0.3 and switches < 60, (seed, share, switches)
    no_margin = replace(BRANCH_GATE, hysteresis=0.0)
    flapping = [_near_tie_share_on(seed, config=no_margin) for seed in range(5)]
    assert all(share > 0.29 and switches > 100 for share, switches in flapping), flapping


def test_speculation_must_win_by_its_handicap():
    # Speculation's costs outside its windows (catch-ups, requests put out of step) make a tie a loss:
    # one H200, B=64, windows tied at ~22 k tok/s and speculation held for 98 of 151 steps gave 0.90x
    # plain. Handicapped by SPECULATION_GATE's on_handicap, a tie (223 tokens
    # per 9.4 ms step = plain's rate) runs speculation 4-19 % of the time after the first eight windows,
    # seeds 0-4; without the handicap 42-76 % (the power of the check). A 15 % win keeps it on 87-97 %
    # of the time (98-99 % without), a 25 % one 98-99 %. Measured, seeds 0-4.
    tie = [_near_tie_share_on(seed, 223, SPECULATION_GATE)[0] for seed in range(5)]
    assert max(tie) < 0.25, tie
    unhandicapped = [_near_tie_share_on(seed, 223)[0] for seed in range(5)]
    assert min(unhandicapped) > 0.4, unhandicapped
    wins = [_near_tie_share_on(seed, 256, SPECULATION_GATE)[0] for seed in range(5)]
    assert min(wins) > 0.85, wins
    assert SpeculationPolicy("adaptive", StepCosts(BUCKETS)).gate.config == SPECULATION_GATE


def test_windows_whose_starts_are_priced_carry_no_handicap():
    # Steps that carry the admission surcharge already pay for the requests speculation puts out of step;
    # the handicap on top counted them twice. A 7.7 % win (240 tokens per 9.4 ms step) under the drift of
    # _near_tie_share_on keeps speculation on 94-98 % of the time when its windows are priced, 30-64 % when
    # handicapped as well (the power of the check; seeds 0-4, measured).
    priced = [_near_tie_share_on(seed, 240, SPECULATION_GATE, priced=True)[0] for seed in range(5)]
    assert min(priced) > 0.9, priced
    handicapped = [_near_tie_share_on(seed, 240, SPECULATION_GATE)[0] for seed in range(5)]
    assert max(handicapped) < 0.7, handicapped


def _share_on_after_a_bad_start(config: GateConfig, batch: int) -> float:
    """Share of steps with speculation on, at `batch`, when plain runs first (a bucket's first window
    follows the model), speculation's first measured windows rate it at 0.95x plain (an acceptance not
    yet learnt) and it then runs at 1.1x plain: 2.2 tokens per 2 ms step against 1 per 1 ms."""
    gate, on_steps, steps = ModeGate(StepCosts(BUCKETS), config), 0, 16 * 400
    gate.want(batch, default=False)
    for i in range(steps):
        on = gate.want(batch)
        tokens = (1.9 if i < 16 * 4 else 2.2) if on else 1.0
        gate.observe(batch, tokens * batch, 2e-3 if on else 1e-3)
        on_steps += on
    return on_steps / steps


def test_speculation_has_no_handicap_at_one_stream():
    # At one stream no request is put out of step and a catch-up comes only with a switch: speculation at
    # 1.1x plain, rated below plain at first, is switched on by its next try and runs 93 % of the steps.
    # With the handicap there too (the power of the check), a try must beat plain by 14 % (the handicap
    # and the hysteresis) and it runs only its tries, 1.5 %; as at 16 requests, where the handicap
    # applies.
    assert _share_on_after_a_bad_start(SPECULATION_GATE, 1) > 0.8
    assert _share_on_after_a_bad_start(replace(SPECULATION_GATE, handicap_from=1), 1) < 0.1
    assert _share_on_after_a_bad_start(SPECULATION_GATE, 16) < 0.1


def _drain_switches_on(report_batch) -> bool:
    """Whether speculation's gate turns speculation on as its better mode (not a scheduled try) while a
    batch of 64 drains to 33 (one request fewer every 4 steps) with plain decoding the better mode
    (speculative steps 0.81x its rate): both modes measured at B=64 first. `report_batch(b)` is the batch
    size the gate is told."""
    gate = ModeGate(StepCosts(BUCKETS))
    for _ in range(16 * 12):  # both modes measured at B=64: off wins
        on = gate.want(64)
        gate.observe(64, 180 if on else 64, 9.4e-3 if on else 2.7e-3)
    assert not gate.want(64) and gate.rate[64, False] > gate.rate[64, True]
    for i in range(4 * 31):
        b = 64 - i // 4
        if gate.want(b) and not gate.state[64].trying:
            return True
        on = gate.want(b)  # a try's steps: speculation at its B=64 rate per request
        gate.observe(report_batch(b), round(180 * b / 64) if on else b, 9.4e-3 if on else 2.7e-3)
    return False


def test_a_draining_batch_keeps_its_buckets_mode():
    # Rates are of the bucket's whole batch (ModeGate.observe). One H200, B=64: unscaled, plain's rate
    # at B=38-47 fell below speculation's from B=64 and turned it on for the last steps of every run.
    assert not _drain_switches_on(lambda b: b)
    assert _drain_switches_on(lambda b: 64)  # told the bucket's size: unscaled (the power of the check)


def test_a_stalled_step_does_not_switch_the_mode():
    # One step in 100 stalls 7 ms (one H200, B=64: single 8.9-9.7 ms steps among ~2.6 ms ones switched
    # speculation on for 32 steps); speculation runs at 0.94x plain. Counted at most stall_cap times the
    # mode's mean step, speculation ran 3-7 % of the time with 14-34 switches (seeds 0-4, handicapped as
    # the speculation gate is); uncapped 6-19 %, 28-72 switches (the power of the check). Measured.
    def runs(config: GateConfig):
        return [_near_tie_share_on(seed, 210, config, stall_every=100) for seed in range(5)]

    capped = runs(SPECULATION_GATE)
    assert max(s for s, _ in capped) < 0.1 and sum(n for _, n in capped) / 5 < 30, capped
    uncapped = runs(replace(SPECULATION_GATE, stall_cap=float("inf")))
    assert sum(s for s, _ in uncapped) / 5 > 0.1 and sum(n for _, n in uncapped) / 5 > 45, uncapped


def test_a_batch_near_its_end_does_not_switch_speculation_back_on():
    """After plain steps, requests that have decoded a while and end within SWITCH_ON_MIN_LEFT tokens stay
    plain (the draft's catch-up would cost more than their last steps win); speculation already on goes
    on, and fresh requests speculate whatever their length."""
    c = costs(1, {1: 1.0e-3, 2: 1.02e-3, 3: 1.04e-3, 4: 1.07e-3, 5: 1.1e-3}, draft=0.3e-3)
    policy = SpeculationPolicy("adaptive", c, gate=False)
    n = policy_module.SWITCH_ON_MIN_LEFT

    def batch(done: int, left: int) -> list[Request]:
        out = reqs(1, alpha=0.8)
        out[0].output, out[0].max_new_tokens = [7] * done, done + left
        return out

    policy.last_k = 0  # the last step was plain
    assert policy.choose(batch(10 * n, n - 1)) == 0
    assert policy.last_k == 0 and not policy.gated
    # Power: the same batch with enough left, a fresh short request, and speculation already on all get k=4.
    assert policy.choose(batch(10 * n, n)) == 4
    assert policy.choose(batch(10 * n, n - 1)) == 4  # last_k is 4 now: speculation stays on to the end
    policy.last_k = 0
    assert policy.choose(batch(0, n - 1)) == 4
    policy.last_k = 0
    assert SpeculationPolicy("fixed", c).choose(batch(10 * n, 1)) == 4  # fixed k is never held back


@pytest.mark.parametrize("gate", [True, False])
def test_an_untimed_k_is_tried_once_its_bucket_is_old(gate, monkeypatch):
    """k = 4 never timed, its estimate from parts inflated by a long draft wait measured for it (5.2 ms
    against 4.0 ms steady), so k = 2 (3.5 ms timed) rates best. Once the bucket is UNTIMED_AGE steady steps
    old k = 4 is tried, timed and kept (one H200, the draft in the target: the policy sat at k = 2; B=64:
    at k = 3 for 27 steps)."""
    true = {0: 2e-3, 1: 6e-3, 2: 3.5e-3, 3: 6e-3, 4: 4.0e-3}

    def run() -> list[int]:
        c = costs(1, {w: 1e-3 for w in range(1, 6)})
        c.observe_draft(1, 2, 0.5e-3)
        c.observe_draft(1, 4, 3e-3)
        for k in (0, 1, 2, 3):
            c.observe_step(1, k, true[k], verify=1e-3, draft_wait=0.0)
        policy, batch, chosen = SpeculationPolicy("adaptive", c, gate=gate), reqs(1, alpha=0.8), []
        assert not c.timed(1, 4) and c.step_seconds(1, 4) > true[4] * 1.2
        for _ in range(300):
            k = policy.choose(batch)
            chosen.append(k)
            c.observe_step(1, k, true[k], verify=1e-3, draft_wait=0.0)
            policy.observe_step(1, round(policy.batch_tokens(batch, 4)[k]), true[k])
        return chosen

    chosen = run()
    first_k4 = chosen.index(4)
    # the bucket is 4 steady steps old when the policy starts (the timings above)
    assert policy_module.UNTIMED_AGE - 4 <= first_k4 <= policy_module.UNTIMED_AGE, chosen[:20]
    assert chosen[:first_k4] == [2] * first_k4, chosen[:first_k4]
    late = chosen[first_k4 + policy_module.REFRESH_STEPS :]
    assert sum(k == 4 for k in late) / len(late) >= 0.85, chosen
    # Power: with the timed k's wait (REFRESH_AGE) k = 4 comes only after 60 steps at k = 2; without tries
    # of untimed (or stale) k, k = 2 holds throughout.
    monkeypatch.setattr(policy_module, "UNTIMED_AGE", policy_module.REFRESH_AGE)
    assert run().index(4) >= policy_module.REFRESH_AGE - 4
    monkeypatch.setattr(policy_module, "UNTIMED_AGE", 10**9)
    monkeypatch.setattr(policy_module, "REFRESH_AGE", 10**9)
    assert 4 not in run()


# Whole steps of Qwen2.5-Coder-1.5B + its feature draft at 16 streams, ms per k (k = 0, 3 and 4: step-trace
# medians on an H100; 1 and 2 between): k = 4 has 3.5 % more goodput than k = 3 at per-token acceptance
# 0.657. Single steps spread by 10 % (lognormal) and one in 50 stalls at 3x.
NEAR_TIE_MS = {0: 1.99, 1: 2.45, 2: 2.58, 3: 2.75, 4: 2.83}


def _near_tie_share(seed: int, steps: int = 5000, alpha: float = 0.657, batch: int = 16) -> float:
    """Share of the steps at k = 4 of the adaptive policy (with its gate, as served) in a batch whose k = 3
    and k = 4 are NEAR_TIE_MS apart, each request drawing its accepted drafts at `alpha`."""
    rng = random.Random(seed)
    c = StepCosts(BUCKETS)
    for width in range(1, 6):  # the start-up timings of the verify
        c.observe_startup_verify(batch, width, (1.6 + 0.15 * width) * 1e-3)
    policy, running = SpeculationPolicy("adaptive", c), reqs(batch, alpha=alpha, trials=20)
    at_4, plain_run = 0, 0
    for _ in range(steps):
        k = policy.choose(running)
        noise = math.exp(rng.gauss(0.0, 0.1)) * (3.0 if rng.random() < 0.02 else 1.0)
        wall, verify, emitted = NEAR_TIE_MS[k] * 1e-3 * noise, (1.6 + 0.15 * (k + 1)) * 1e-3 * noise, 0
        for r in running:
            accepted = next((i for i in range(k) if rng.random() >= alpha), k)
            r.spec.observe(k, accepted)
            policy.observe([k], [accepted])
            emitted += accepted + 1
        c.observe_verify(batch, k + 1, verify)
        plain_run = plain_run + 1 if k == 0 else 0
        if k:
            c.observe_draft(batch, k, 0.15e-3)
            c.observe_step(batch, k, wall, verify, 0.15e-3)
        elif plain_run > 2:
            c.observe_step(batch, 0, wall, verify, 0.0)
        policy.observe_step(batch, emitted, wall)
        at_4 += k == 4
    return at_4 / steps


def test_of_two_k_within_the_noise_of_single_steps_the_better_runs_most_steps(monkeypatch):
    """Medians of STEP_WINDOW (32) steps: k = 4 in a median of at least 90 % of the steps over 6 runs (0.89-
    0.94 each). Power: over 16-step medians the median is below 90 % (0.80-0.88 each: the worse k = 3 runs
    up to a fifth of the steps)."""
    shares = [_near_tie_share(seed) for seed in range(6)]
    assert statistics.median(shares) >= 0.90, shares
    monkeypatch.setattr(step_costs_module, "STEP_WINDOW", 16)
    shares_16 = [_near_tie_share(seed) for seed in range(6)]
    assert statistics.median(shares_16) < 0.90, shares_16
