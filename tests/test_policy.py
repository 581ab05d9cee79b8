"""The speculation policy on measured costs: k rises where the verify is memory-bound and acceptance is
high, falls to 0 where a wide verify costs more than the tokens it adds; probing keeps estimates fresh."""

from __future__ import annotations

import pytest

from target_service.detok import StreamDetokenizer
from target_service.policy import PLAIN_SETTLE, BranchGate, SpeculationPolicy, StepCosts, expected_tokens
from target_service.request import Request, check_stop

BUCKETS = [1, 2, 4, 8, 16, 32, 64]


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
    assert SpeculationPolicy("adaptive", c).choose(reqs(1, alpha=0.8)) == 4


def test_compute_bound_batch_stops_speculating():
    # B=64: each extra position costs a full plain step; alpha 0.3 never pays that back.
    c = costs(64, {w: 5e-3 * w for w in range(1, 6)}, draft=2e-3)
    policy = SpeculationPolicy("adaptive", c, probe_every=1000)
    assert policy.choose(reqs(64, alpha=0.3)) == 0


def test_intermediate_k_and_fixed_mode():
    # Positions 1-2 nearly free, 3-4 expensive: the best k is 2 at alpha 0.7.
    c = costs(16, {1: 1e-3, 2: 1.05e-3, 3: 1.1e-3, 4: 2.5e-3, 5: 4e-3}, draft=0.2e-3)
    batch = reqs(16, alpha=0.7)
    assert SpeculationPolicy("adaptive", c).choose(batch) == 2
    assert SpeculationPolicy("fixed", c).choose(batch) == 4  # fixed: each request's own k


def test_probe_when_plain_wins():
    c = costs(64, {w: 5e-3 * w for w in range(1, 6)})
    policy = SpeculationPolicy("adaptive", c, probe_every=4)
    chosen = [policy.choose(reqs(64, alpha=0.2)) for _ in range(8)]
    assert chosen == [0, 0, 0, 4, 4, 0, 0, 0]  # a probe: two speculative steps


def test_probes_back_off_while_plain_keeps_winning_and_return_when_speculation_wins():
    c = costs(64, {w: 5e-3 * w for w in range(1, 6)})
    policy = SpeculationPolicy("adaptive", c, probe_every=4, max_probe_every=16, probe_budget=0)
    losing = reqs(64, alpha=0.2)
    chosen = [policy.choose(losing) for _ in range(60)]
    probes = [i for i in range(1, len(chosen)) if chosen[i] and not chosen[i - 1]]
    # Plain steps before each probe: gap - 1 with the gap 4, then 8, 16, 16 (capped at max_probe_every).
    plain_runs = [b - a for a, b in zip([0, *(p + 2 for p in probes)], probes)]
    assert plain_runs == [3, 7, 15, 15]
    assert all(chosen[p + 1] == 4 for p in probes)  # each probe is two speculative steps
    # Speculation wins once (cheap wide steps, high acceptance): the gap is back to probe_every.
    cheap = costs(64, {w: 5e-3 for w in range(1, 6)})
    policy.costs = cheap
    assert policy.choose(reqs(64, alpha=0.9)) == 4
    assert policy.probe(64).gap == 4


def test_probe_gap_keeps_probing_within_its_budget():
    # A plain step of 1 ms, k = 4 steps of 2.5 ms: a probe costs 3 ms over plain, so at a 2% budget the
    # gap after the first losing probe is 3 ms / (0.02 * 1 ms) = 150 plain steps, not 2 x 4.
    c = costs(1, {1: 1e-3, 2: 1.4e-3, 3: 1.8e-3, 4: 2.2e-3, 5: 2.5e-3})
    c.observe_step(1, 0, 1e-3, verify=1e-3, draft_wait=0.0)
    c.observe_step(1, 4, 2.5e-3, verify=2.5e-3, draft_wait=0.0)
    policy = SpeculationPolicy("adaptive", c, probe_every=4, probe_budget=0.02)
    losing = reqs(1, alpha=0.1)
    chosen = [policy.choose(losing) for _ in range(400)]
    probes = [i for i in range(1, len(chosen)) if chosen[i] and not chosen[i - 1]]
    assert probes[:2] == [3, 3 + 2 + 149], probes
    assert policy.probe(1).gap == 300  # doubling wins once it is the longer
    assert policy.budget_gap(1, 4) == 150
    # A probe's first step also catches the draft up: timed at 9 ms, it makes a probe cost 9.5 ms.
    c.observe_catchup(1, 9e-3)
    assert c.probe_seconds(1, 4) == pytest.approx(9.5e-3)
    assert policy.budget_gap(1, 4) == 475


def test_a_new_bucket_borrows_the_draft_wait_and_residue_of_the_nearest_one():
    c = costs(16, {w: 1e-3 for w in range(1, 6)}, draft=3e-3)
    c.observe_step(16, 0, 1.5e-3, verify=1e-3, draft_wait=0.0)
    for width in range(1, 6):
        c.observe_verify(8, width, 1e-3)
    # Bucket 8 has no draft wait or residue of its own: bucket 16's (3 ms, 0.5 ms), not free.
    assert c.step_seconds(8, 4) == pytest.approx(1e-3 + 3e-3 + 0.5e-3)
    batch = reqs(8, alpha=0.3)
    assert SpeculationPolicy("adaptive", c, probe_every=1000).choose(batch) == 0


def test_batch_tokens_matches_expected_tokens():
    batch = reqs(3, alpha=0.6) + reqs(2, k=2, alpha=0.3)
    policy = SpeculationPolicy("adaptive", StepCosts(BUCKETS))
    prior = policy.prior_alpha
    want = [sum(expected_tokens(r.spec.alpha(prior), min(k, r.k)) for r in batch) for k in range(5)]
    assert policy.batch_tokens(batch, 4) == pytest.approx(want)


def test_a_win_at_a_small_batch_keeps_the_probe_gap_of_a_large_one():
    # Requests ramping up pass through B=1, where speculation wins; B=64, where it loses, keeps its gap.
    c = costs(64, {w: 5e-3 * w for w in range(1, 6)})
    for width in range(1, 6):
        c.observe_verify(1, width, 1e-3)
    policy = SpeculationPolicy("adaptive", c, probe_every=4, max_probe_every=64)
    losing = reqs(64, alpha=0.2)
    for _ in range(40):
        policy.choose(losing)
    gap = policy.probe(64).gap
    assert gap >= 16
    assert policy.choose(reqs(1, alpha=0.9)) == 4
    assert policy.probe(64).gap == gap and policy.probe(1).gap == 4


def test_whole_step_wall_time_outranks_its_parts():
    # The parts say k = 4 pays (a 2.6 ms verify + 0.3 ms wait for 1.56 tokens against a 2.5 ms plain
    # step), but whole steps at k = 4 took 6.2 ms: the policy goes by what the steps cost.
    c = costs(1, {1: 2.5e-3, 5: 2.6e-3}, draft=0.3e-3)
    batch = reqs(1, alpha=0.36)
    policy = SpeculationPolicy("adaptive", c, probe_every=1000)
    assert policy.choose(batch) > 0
    c.observe_step(1, 0, 2.7e-3, verify=2.5e-3, draft_wait=0.0)
    for k in range(1, 5):
        c.observe_step(1, k, 6.2e-3, verify=2.6e-3, draft_wait=0.3e-3)
    assert c.step_seconds(1, 4) == pytest.approx(6.2e-3)
    assert policy.choose(batch) == 0
    # An untimed k is its parts plus the host residue seen at this bucket (median of 0.2, 3.3 x 4 ms).
    c.step.pop((1, 2))
    assert c.step_seconds(1, 2) == pytest.approx(2.5e-3 + 0.3e-3 + 3.3e-3)


def test_unmeasured_batch_measures_plain_then_speculates():
    c = StepCosts(BUCKETS)
    policy = SpeculationPolicy("adaptive", c)
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
    policy = SpeculationPolicy("adaptive", c, probe_every=1000)
    assert policy.choose(reqs(1)) == 4  # prior 0.7: worth it
    for _ in range(200):  # the draft rarely agrees
        policy.observe(drafted=4, accepted=0)
    assert policy.prior_alpha < 0.1
    assert policy.choose(reqs(1)) == 0  # a fresh request does not re-learn that


def _gate_run(rate_on: float, rate_off: float, steps: int = 16 * 64) -> list[bool]:
    """The gate's choice at each step, when a step emits 4 tokens at `rate` tokens per second."""
    gate = BranchGate(StepCosts([1, 2, 4]))
    chosen = []
    for _ in range(steps):
        on = gate.want(1)
        chosen.append(on)
        gate.observe(1, 4, 4 / (rate_on if on else rate_off))
    return chosen


def test_branch_gate_keeps_the_faster_mode_and_still_tries_the_other():
    # Branches 1.5x faster: on almost always; off tried in one window of 16 out of every 16 windows.
    chosen = _gate_run(1500.0, 1000.0)
    assert chosen[:16] == [True] * 16 and chosen[16:32] == [False] * 16  # each measured once first
    late = chosen[64:]
    assert 0.85 <= sum(late) / len(late) < 1.0
    # Branches slower (a draft whose branch round outlasts the target's step): off almost always.
    late = _gate_run(700.0, 1000.0)[64:]
    assert 0.0 < sum(late) / len(late) <= 0.15


def test_branch_gate_per_batch_bucket():
    gate = BranchGate(StepCosts([1, 2, 4]))
    for _ in range(64):  # bucket 1: on wins; bucket 4: off wins
        gate.observe(1, 4, 4 / (1500.0 if gate.want(1) else 1000.0))
        gate.observe(4, 16, 16 / (3000.0 if gate.want(4) else 4000.0))
    assert gate.rate[(1, True)] > gate.rate[(1, False)] and gate.rate[(4, True)] < gate.rate[(4, False)]


def test_plain_steps_are_timed_while_speculation_wins():
    # Speculation wins by its estimates: every plain_gap speculative steps, PLAIN_SETTLE + 1 plain steps
    # (the last one timed as k = 0) check the estimate of k = 0, which nothing else would ever correct.
    c = costs(1, {1: 1.0e-3, 2: 1.02e-3, 3: 1.04e-3, 4: 1.07e-3, 5: 1.1e-3}, draft=0.3e-3)
    policy = SpeculationPolicy("adaptive", c, probe_every=4, max_probe_every=8)
    batch = reqs(1, alpha=0.8)
    chosen = [policy.choose(batch) for _ in range(36)]
    check = [0] * (PLAIN_SETTLE + 1)
    # The gap doubles after each check that speculation survives, up to max_probe_every.
    assert chosen == [4] * 3 + check + [4] * 7 + check + [4] * 7 + check + [4] * 7 + check
    # The timed plain step wins: plain decoding with probes, and the check gap is back to probe_every.
    c.observe_step(1, 0, 1.0e-3, verify=1.0e-3, draft_wait=0.0)
    c.observe_step(1, 4, 9.0e-3, verify=1.1e-3, draft_wait=7.9e-3)
    c.observe_draft(1, 4, 7.9e-3)
    assert policy.choose(batch) == 0
    assert policy.probe(1).plain_gap == 4
