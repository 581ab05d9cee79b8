"""The serving loop against real services: plain steps never wait for the draft, a k=0 request rides
beside speculating ones, and the adaptive policy's k (whatever it picks) never changes greedy output."""

from __future__ import annotations

import pytest
from service_util import (
    assert_same_tokens,
    generate_many,
    prompts,
    request,
    start_draft,
    start_target,
    wait_for,
)

from target_service.gate import BRANCH_GATE

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(demo_models, tmp_path_factory):
    logs = tmp_path_factory.mktemp("serving")
    draft = start_draft(demo_models.draft, logs).wait_ready()
    target = start_target(demo_models.target, logs, draft, "--speculation-policy", "adaptive").wait_ready()
    yield draft, target
    target.stop()
    draft.stop()


def speculate_messages(draft, target) -> tuple[float, float]:
    return (
        target.metric("specsplit_grpc_messages_total", direction="sent", kind="speculate_request"),
        draft.metric("specsplit_grpc_messages_total", direction="received", kind="speculate_request"),
    )


def test_plain_steps_send_nothing_to_the_draft(stack):
    draft, target = stack
    # The link connects after the target reports ready. Under the adaptive policy a request surely
    # speculates once it outlasts the gate's first mode, whatever the start-up timings made that: a
    # warm-up half window and a measured window (8 + 16 steps, target_service/gate.py), then the other
    # mode. 24 tokens were not enough on a CI machine whose start-up timings chose plain first.
    wait_for(lambda: target.metric("specsplit_draft_connected") == 1, 30, "the draft link")
    first_mode_steps = BRANCH_GATE.window // 2 + BRANCH_GATE.window
    generate_many(
        target.address, [request(prompts(1, seed=5)[0], k=2, max_new_tokens=first_mode_steps + 16)], 1
    )
    before = speculate_messages(draft, target)
    assert before[0] > 0 and before[1] > 0  # the series exist and count: a rename would fail here
    plain = generate_many(target.address, [request(p, k=0, max_new_tokens=12) for p in prompts(6)], 6)
    assert all(r.usage.steps >= 12 and r.usage.drafted_tokens == 0 for r in plain)
    # The speculating request's release may follow once, without an answer being awaited: never one per step.
    after = speculate_messages(draft, target)
    assert after[0] - before[0] <= 1 and after[1] - before[1] <= 1, (before, after)


def test_k0_request_beside_speculating_ones(stack):
    _, target = stack
    ps = prompts(8, seed=3)
    plain = generate_many(target.address, [request(p, k=0, max_new_tokens=20) for p in ps], 8)
    mixed = generate_many(
        target.address, [request(p, k=0 if i % 2 else 4, max_new_tokens=20) for i, p in enumerate(ps)], 8
    )
    assert_same_tokens(mixed, plain)
    for i, r in enumerate(mixed):
        if i % 2:
            assert r.usage.drafted_tokens == 0, i
    drafted = sum(r.usage.drafted_tokens for r in mixed)
    accepted = sum(r.usage.accepted_tokens for r in mixed)
    assert drafted > 0 and accepted > 0, (drafted, accepted)


def test_adaptive_k_varies_and_output_stays_plain(stack):
    _, target = stack

    def chosen(le: str) -> float:
        return target.metric("specsplit_spec_step_tokens_bucket", le=le)

    before = {le: chosen(le) for le in ("0.0", "4.0", "+Inf")}
    ps = prompts(12, seed=4)
    plain = generate_many(target.address, [request(p, k=0, max_new_tokens=24) for p in ps], 12)
    spec = generate_many(target.address, [request(p, k=4, max_new_tokens=24) for p in ps], 12)
    assert_same_tokens(spec, plain)
    after = {le: chosen(le) for le in before}
    plain_steps = after["0.0"] - before["0.0"]
    total = after["+Inf"] - before["+Inf"]
    speculating = total - plain_steps
    # New batch sizes start unmeasured: the policy times a plain step and a speculative one at least.
    assert plain_steps >= 1 and speculating >= 1, (plain_steps, total)
    assert sum(r.usage.drafted_tokens for r in spec) > 0 and sum(r.usage.accepted_tokens for r in spec) > 0
