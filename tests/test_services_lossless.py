"""End to end over loopback gRPC: speculative output equals plain decoding, token for token.

Plain decoding is the same target with num_speculative_tokens = 0 (every token comes
from a one-position verify, i.e. the target alone). Greedy comparisons are exact.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from service_util import (
    assert_same_tokens,
    generate_many,
    prompts,
    request,
    running,
    speculative_equals_plain,
    start_draft,
    start_target,
)

from common.distributed import init_tp
from common.loader import load_model
from common.models.generate import greedy_generate
from specsplit.launch import ServiceProcess, free_port

pytestmark = pytest.mark.slow

N_PROMPTS = 24
CONCURRENCY = 16


@pytest.fixture(scope="module")
def stack(demo_models, tmp_path_factory):
    logs = tmp_path_factory.mktemp("lossless")
    # Draft-ahead always on (min hit rate 0): at 16 concurrent requests the default pauses it (a round
    # is spared only when all 16 guesses hit), and these tests check that its hits and misses never
    # change the output.
    draft = start_draft(demo_models.draft, logs, "--draft-ahead-min-hit-rate", "0").wait_ready()
    target = start_target(demo_models.target, logs, draft).wait_ready()
    yield draft, target
    target.stop()
    draft.stop()


def test_greedy_lossless_concurrent(stack):
    draft, target = stack
    ps = prompts(N_PROMPTS)
    spec, plain = speculative_equals_plain(target.address, ps, CONCURRENCY)
    drafted = sum(r.usage.drafted_tokens for r in spec)
    accepted = sum(r.usage.accepted_tokens for r in spec)
    assert all(r.usage.drafted_tokens > 0 for r in spec), "every request should have been speculated"
    assert all(r.usage.drafted_tokens == 0 for r in plain)
    # The demo draft shares the target's first layer: acceptance must be well above chance.
    assert accepted / drafted > 0.3, f"acceptance {accepted}/{drafted}"
    # Draft-ahead (always on in this stack) must have been tried, and misses never change the output.
    hits = draft.metric("specsplit_draft_ahead_hits_total")
    misses = draft.metric("specsplit_draft_ahead_misses_total")
    assert hits > 0 and misses > 0, (hits, misses)
    # Every Speculate message was timed inside the draft (arrival to answer), and took some time.
    assert draft.metric("specsplit_draft_handle_seconds_count") > 0
    assert draft.metric("specsplit_draft_handle_seconds_sum") > 0


def test_branches_let_steps_start_without_the_draft_answer(stack):
    """One request at a time: the draft sends its branches after each answer, and the target verifies
    the one its verdict picked without waiting; the output still equals plain decoding."""
    draft, target = stack
    before = target.metric("specsplit_spec_pipelined_steps_total")
    hits = draft.metric("specsplit_draft_ahead_hits_total")
    spec, _ = speculative_equals_plain(target.address, prompts(4, seed=5), 1)
    assert all(r.usage.accepted_tokens > 0 for r in spec)
    pipelined = target.metric("specsplit_spec_pipelined_steps_total") - before
    steps = sum(r.usage.steps for r in spec)
    assert pipelined > 0 and draft.metric("specsplit_draft_ahead_hits_total") > hits, (pipelined, steps)


def test_greedy_lossless_mixed_k(stack):
    _, target = stack
    ps = prompts(12, seed=1)
    plain = generate_many(target.address, [request(p, k=0, max_new_tokens=16) for p in ps], 12)
    spec = generate_many(
        target.address, [request(p, k=1 + i % 6, max_new_tokens=16) for i, p in enumerate(ps)], 12
    )
    assert_same_tokens(spec, plain)


def test_sampled_same_seed_same_output_whatever_concurrency(stack):
    _, target = stack
    ps = prompts(8, seed=2)
    reqs = [request(p, temperature=0.8, seed=100 + i, max_new_tokens=16) for i, p in enumerate(ps)]
    alone = generate_many(target.address, reqs, 1)
    together = generate_many(target.address, reqs, 8)
    assert [r.ids for r in alone] == [r.ids for r in together]
    others = generate_many(
        target.address, [request(p, temperature=0.8, seed=999, max_new_tokens=16) for p in ps], 8
    )
    assert [r.ids for r in others] != [r.ids for r in alone], "the seed must matter"


def test_draft_tp2_markov_head_lossless(demo_models, tmp_path):
    draft = start_draft(demo_models.markov_draft, tmp_path, "--tp-size", "2").wait_ready()
    target = start_target(demo_models.target, tmp_path, draft).wait_ready()
    with running(draft, target):
        ps = prompts(10, seed=3)
        spec, _ = speculative_equals_plain(target.address, ps, 10)
        assert sum(r.usage.drafted_tokens for r in spec) > 0
        # Local argmax with a replicated Markov head: the head adds no collective at all.
        assert draft.metric("specsplit_tp_comm_calls_total", site="lm_head_argmax") > 0
        assert draft.metric("specsplit_tp_comm_calls_total", site="markov_head") == 0
        assert draft.metric("specsplit_tp_comm_calls_total", site="logits_gather") == 0


def test_sampled_drafting_and_no_draft_ahead(demo_models, tmp_path):
    """Sampled top-K drafting (sparse q over the wire) and draft-ahead off: still lossless at T=0,
    seeded sampling reproducible."""
    draft = start_draft(
        demo_models.draft,
        tmp_path,
        "--draft-sampling",
        "sampled",
        "--no-use-local-argmax-reduction",
        "--no-draft-ahead",
    ).wait_ready()
    target = start_target(demo_models.target, tmp_path, draft).wait_ready()
    with running(draft, target):
        ps = prompts(8, seed=4)
        speculative_equals_plain(target.address, ps, 8)
        sampled = [request(p, temperature=1.0, seed=7 + i) for i, p in enumerate(ps)]
        a = generate_many(target.address, sampled, 1)
        b = generate_many(target.address, sampled, 8)
        assert [r.ids for r in a] == [r.ids for r in b]
        assert sum(r.usage.accepted_tokens for r in a) > 0
        assert draft.metric("specsplit_draft_ahead_hits_total") == 0
        assert draft.metric("specsplit_draft_ahead_misses_total") == 0


def test_target_tp2_lossless_and_json_logs(demo_models, tmp_path):
    """The target's own TP group (2 gloo ranks spawned by the service): speculative output equals its
    plain decoding; logs are one JSON object per line."""
    draft = start_draft(demo_models.draft, tmp_path).wait_ready()
    target = start_target(
        demo_models.target, tmp_path, draft, "--tp-size", "2", "--log-format", "json"
    ).wait_ready()
    with running(draft, target):
        ps = prompts(8, seed=5)
        spec, plain = speculative_equals_plain(target.address, ps, 8)
        assert sum(r.usage.drafted_tokens for r in spec) > 0
        assert sum(r.usage.accepted_tokens for r in spec) > 0
        # An independent reference for the TP=2 service path: one process, no TP, no service, fp32.
        model = load_model(demo_models.target, init_tp(1, 0, device=torch.device("cpu")), device="cpu")
        assert [r.ids for r in plain] == greedy_generate(model, ps, len(plain[0].ids))
        # The verify forward all-reduces inside the model and all-gathers the logits.
        assert target.metric("specsplit_tp_comm_calls_total", site="logits_gather") > 0
        assert target.metric("specsplit_tp_comm_calls_total", site="attn_out") > 0
        assert target.metric("specsplit_service_info", tp_size="2") == 1
    records = [json.loads(line) for line in target.log_text().splitlines() if line.startswith("{")]
    messages = [r["msg"] for r in records]
    assert any(m.startswith("ready:") for m in messages), messages
    assert any(m.startswith("draft connected") for m in messages), messages
    assert all({"ts", "level", "logger", "msg"} <= r.keys() for r in records)


def test_draft_tp2_started_by_torchrun(demo_models, tmp_path):
    """`torchrun --nproc-per-node 2 -m draft_service`: every rank joins through the environment, rank 0
    serves; speculation through it stays lossless."""
    port, metrics_port = free_port(), free_port()
    log = tmp_path / "torchrun-draft.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), "-m", "draft_service", "--model", str(demo_models.draft), "--tp-size", "2",
           "--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(metrics_port)]  # fmt: skip
    with open(log, "wb") as out:
        popen = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=os.environ | {"PYTHONUNBUFFERED": "1"}
        )
    draft = ServiceProcess("draft_service", popen, port, metrics_port, log).wait_ready()
    target = start_target(demo_models.target, tmp_path, draft).wait_ready()
    with running(draft, target):
        ps = prompts(6, seed=6)
        spec, _ = speculative_equals_plain(target.address, ps, 6)
        assert sum(r.usage.accepted_tokens for r in spec) > 0
        assert draft.metric("specsplit_service_info", tp_size="2") == 1
    # torchrun itself exits non-zero when signalled, but rank 0 drained and stopped its workers cleanly.
    text = draft.log_text()
    assert "draft INFO stopped" in text, text[-3000:]
    assert "[rank1]" not in text and "Connection reset" not in text, text[-3000:]


def test_draft_with_a_smaller_k_limit_proposes_fewer(demo_models, tmp_path):
    """The target allows k=8, the draft drafts at most 2: proposals are clamped, nothing fails."""
    draft = start_draft(demo_models.draft, tmp_path, "--max-speculative-tokens", "2").wait_ready()
    target = start_target(demo_models.target, tmp_path, draft).wait_ready()
    with running(draft, target):
        ps = prompts(4, seed=8)
        spec, _ = speculative_equals_plain(target.address, ps, 4, k=8)
        for r in spec:
            assert 0 < r.usage.drafted_tokens <= 2 * r.usage.steps
        assert target.metric("specsplit_spec_fallback_steps_total") == 0


def test_draft_out_of_kv_slots_keeps_the_stream(demo_models, tmp_path):
    """The draft has 2 KV slots, the target runs 6 requests: the extra ones decode plainly until a slot
    frees (the draft reports them unknown and the target re-sends them), the stream never breaks."""
    draft = start_draft(demo_models.draft, tmp_path, "--max-batch-size", "2").wait_ready()
    target = start_target(demo_models.target, tmp_path, draft).wait_ready()
    with running(draft, target):
        ps = prompts(6, seed=9)
        # Sampled while the requests run: after they finish the gauge is 0 whatever happened.
        seen: list[float] = []
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                seen.append(draft.metric("specsplit_kv_slots_used"))
                time.sleep(0.05)

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            spec, _ = speculative_equals_plain(target.address, ps, 6)
        finally:
            done.set()
            sampler.join()
        assert sum(r.usage.drafted_tokens > 0 for r in spec) >= 2
        assert target.metric("specsplit_draft_reconnects_total") == 0
        assert target.metric("specsplit_draft_connected") == 1
        assert seen and 0 < max(seen) <= 2, seen


# 1500 one-token requests, each started on the draft and verified with sampled drafting: minutes on 2 cores.
@pytest.mark.timeout(900)
@pytest.mark.xdist_group("chi_square_service")  # its own services: runs beside the rest of this file
def test_sampled_first_token_follows_the_target_distribution(demo_models, tmp_path):
    """End to end through gRPC with sampled top-K drafting (sparse q on the wire): the first generated
    token, over 1500 seeds, is distributed as the target's own softmax at the prompt (chi-square, bins with
    expected count >= 5 merged, threshold df + 10 * sqrt(2 * df))."""
    from common.distributed import init_tp
    from common.kv_cache import KVCache
    from common.loader import load_model
    from common.models.generate import forward_rows

    prompt = prompts(1, seed=11)[0]
    model = load_model(demo_models.target, init_tp(1, 0))
    with torch.inference_mode():
        hidden = forward_rows(model, KVCache.for_model(model, 1, len(prompt) + 1), [0], [0], [prompt])
        p = torch.softmax(model.compute_logits(hidden[0, -1:])[0].double(), -1)
    draft = start_draft(demo_models.draft, tmp_path, "--draft-sampling", "sampled",
                        "--no-use-local-argmax-reduction").wait_ready()  # fmt: skip
    target = start_target(demo_models.target, tmp_path, draft).wait_ready()
    with running(draft, target):
        n = 1500
        reqs = [request(prompt, max_new_tokens=1, temperature=1.0, seed=s) for s in range(n)]
        results = generate_many(target.address, reqs, 16)
        assert sum(r.usage.drafted_tokens for r in results) > 0
    assert_first_tokens_follow([r.ids[0] for r in results], p)


def assert_first_tokens_follow(tokens: list[int], p) -> None:
    """The sampled tokens pass a chi-square test against p (bins with expected count >= 5 merged,
    threshold df + 10 * sqrt(2 * df)), and the test has power: the same samples against p with 0.15 of
    probability moved from the likeliest token to the third must fail it."""
    counts = torch.bincount(torch.tensor(tokens), minlength=p.numel()).double()
    chi2, df = chi_square(counts, p)
    assert df >= 5, "too few bins for a meaningful test"
    assert chi2 < df + 10 * math.sqrt(2 * df), (chi2, df)
    wrong = p.clone()
    top3 = torch.topk(p, 3).indices
    wrong[top3[0]] -= 0.15
    wrong[top3[2]] += 0.15
    chi2_wrong, df_wrong = chi_square(counts, wrong)
    assert chi2_wrong > df_wrong + 10 * math.sqrt(2 * df_wrong), (chi2_wrong, df_wrong)


def chi_square(counts, p) -> tuple[float, int]:
    """Pearson's statistic with the tail merged so every bin expects >= 5 samples; (chi2, df)."""
    n = counts.sum().item()
    observed, expected, bin_o, bin_e = [], [], 0.0, 0.0
    for i in torch.argsort(p, descending=True).tolist():
        bin_o += counts[i].item()
        bin_e += n * p[i].item()
        if bin_e >= 5:
            observed.append(bin_o)
            expected.append(bin_e)
            bin_o = bin_e = 0.0
    observed[-1] += bin_o
    expected[-1] += bin_e
    return sum((o - e) ** 2 / e for o, e in zip(observed, expected)), len(observed) - 1
