"""`specsplit bench-serve` against live services: the report's numbers are the requests' own."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys

import numpy as np
import pytest
from service_util import running, start_draft, start_target

from specsplit import bench_serve
from specsplit.launch import REPO


def test_percentile_matches_numpy():
    rng = random.Random(0)
    for n in (1, 2, 7, 100):
        xs = [rng.random() for _ in range(n)]
        for q in (0, 50, 90, 99, 100):
            assert bench_serve.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert math.isnan(bench_serve.percentile([], 50))


def test_poisson_gaps_have_the_asked_rate():
    gaps = bench_serve.arrival_gaps(20_000, 50.0, random.Random(1))
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 50.0, rel=0.03)
    assert bench_serve.arrival_gaps(3, math.inf, random.Random(1)) == [0.0, 0.0, 0.0]


@pytest.mark.slow
def test_bench_serve_against_live_services(demo_models, tmp_path):
    draft = start_draft(demo_models.markov_draft, tmp_path).wait_ready()
    target = start_target(
        demo_models.target, tmp_path, draft, "--max-context-length", "128", "--verify-backend", "torch"
    ).wait_ready()
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text(
        "\n".join(
            json.dumps({"prompt_ids": [i + 1, i + 2, i + 3], "max_new_tokens": 6 + i}) for i in range(4)
        )
    )
    with running(draft, target):

        def bench(*args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
            out = tmp_path / "r.json"
            cmd = [
                sys.executable,
                "-m",
                "specsplit.cli",
                "bench-serve",
                "--target",
                target.address,
                "--result-json",
                str(out),
                "--no-progress",
                *args,
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
            assert proc.returncode == 0, proc
            return proc, json.loads(out.read_text())

        proc, r = bench(
            "--num-prompts",
            "16",
            "--max-concurrency",
            "8",
            "--input-len",
            "8",
            "--output-len",
            "12",
            "--range-ratio",
            "0.5",
            "--check-greedy",
        )
        assert r["completed"] == 16 and r["failed"] == 0 and r["errors"] == {}
        assert r["greedy_check"] == {
            "checked": 16,
            "mismatches": 0,
            "mismatched_requests": [],
            "probed": 0,
            "near_ties": 0,
            "divergences": [],
        }
        assert r["drafted_tokens"] > 0 and r["accepted_tokens"] > 0, "speculation ran"
        assert 0 < r["acceptance_rate"] <= 1
        assert r["finish_reasons"] == {"length": 16}
        assert 16 * 6 <= r["output_tokens"] <= 16 * 18  # lengths in 12 * (1 +- 0.5)
        for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            s = r[name]
            assert 0 < s["p50"] <= s["p90"] <= s["p99"], (name, s)
        assert r["ttft_ms"]["p99"] <= r["e2e_ms"]["p99"]
        assert r["output_throughput"] == pytest.approx(r["output_tokens"] / r["duration_s"])
        assert "Output token throughput" in proc.stdout and "Greedy == plain (k=0):" in proc.stdout

        # Poisson arrivals from a JSONL file: its lengths are used (6..9 tokens, cycled).
        _, r = bench("--num-prompts", "8", "--request-rate", "20", "--dataset", str(dataset))
        assert r["completed"] == 8 and r["output_tokens"] == 2 * (6 + 7 + 8 + 9)

        # A bad request is counted by status, not hidden: k above the server's limit.
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "specsplit.cli",
                "bench-serve",
                "--target",
                target.address,
                "--num-prompts",
                "2",
                "--num-speculative-tokens",
                "99",
                "--no-progress",
                "--output-len",
                "4",
            ],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=120,
        )
        assert proc.returncode == 1 and "INVALID_ARGUMENT" in proc.stdout, proc


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["forced", "alone"])
def test_divergence_probe_reports_the_top2_gap_where_outputs_part(kind, demo_models, tmp_path):
    """bench-serve's probe of a greedy mismatch, on a live target: an output that takes the target's
    second candidate at position j is found at j, with the top-2 gap the target's own logprobs give;
    one that takes any other token there is not a near-tie. A prompt of token ids is probed
    teacher-forced (one token after the prompt and the common prefix), a text prompt decoded alone."""
    import asyncio

    from specsplit.aio import AsyncClient

    target = start_target(demo_models.target, tmp_path, None, "--max-context-length", "128").wait_ready()
    prompt = bench_serve.Prompt([5, 6, 7, 8] if kind == "forced" else "one two three", 12)
    options = {"temperature": 0.0, "num_speculative_tokens": 0}

    async def probe() -> tuple[list, list, dict, dict]:
        async with AsyncClient(target.address) as client:
            ids, lps = [], []
            async with client.stream(prompt.prompt, max_new_tokens=12, logprobs=2, **options) as stream:
                async for delta in stream:
                    ids.extend(delta.token_ids)
                    lps.extend(delta.logprobs)
            j = 5
            second = lps[j].top[1][0]
            swapped = [*ids[:j], second, *ids[j + 1 :]]
            other = next(t for t in range(100) if t not in (ids[j], second))
            wrong = [*ids[:j], other]
            a = await bench_serve.divergence(client, prompt, swapped, ids, options)
            b = await bench_serve.divergence(client, prompt, wrong, ids, options)
            return ids, lps, a, b

    with running(target):
        ids, lps, swapped, wrong = asyncio.run(probe())
    gap = lps[5].top[0][1] - lps[5].top[1][1]
    assert swapped["probe"] == wrong["probe"] == kind
    assert swapped["position"] == 5 and swapped["plain"] == [ids[5]]
    assert swapped["top2"] == [ids[5], lps[5].top[1][0]]
    assert swapped["gap_nats"] == pytest.approx(gap, abs=1e-4)
    assert swapped["near_tie"] == (gap <= bench_serve.NEAR_TIE_NATS)
    assert wrong["position"] == 5 and wrong["near_tie"] is False
