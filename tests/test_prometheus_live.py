"""A real Prometheus scraping the real services: a draft (TP=2 over gloo) and a target, both on CPU.

One module fixture starts the services, warms them up (so every TP comm series exists before
Prometheus first scrapes: rate() never sees a series' first increase), starts Prometheus with the
recording rules, and brackets the traffic with direct scrapes that Prometheus is then made to catch
up with. The tests read everything back through Prometheus's HTTP query API.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from specsplit.launch import Samples, ServiceProcess, metric_sum
from tests.prom_util import query, start_prometheus, values, wait_until_scraped
from tests.service_util import generate_many, prompts, request, start_draft, start_target
from tests.tools import need

ROOT = Path(__file__).resolve().parents[1]
K = 4  # the target's default num_speculative_tokens
DRAFT_TP = 2
REQUESTS, NEW_TOKENS, CONCURRENCY = 16, 24, 4

pytestmark = pytest.mark.slow

BYTES, TOKENS = "specsplit_tp_comm_bytes_total", "specsplit_spec_draft_tokens_total"
TPOT = "specsplit_time_per_output_token_seconds"
RULE_TP = "model_service:specsplit_tp_comm_bytes_per_draft_token:ratio_rate5m"


@dataclass
class Live:
    url: str
    draft: ServiceProcess
    target: ServiceProcess
    before: dict[str, Samples]  # direct scrapes, quiescent, just before the traffic
    after: dict[str, Samples]  # and just after it
    t_before: float  # Prometheus evaluation times at which it holds exactly those values
    t_after: float
    texts: dict[str, str]  # raw exposition text of both services after the traffic

    def delta(self, service: str, name: str, **labels: str) -> float:
        return metric_sum(self.after[service], name, **labels) - metric_sum(
            self.before[service], name, **labels
        )

    def increase(self, selector: str, by: str = "") -> dict[frozenset, float]:
        """Raw increase of sum `by` of `selector` between t_before and t_after (no extrapolation)."""
        offset = f"{round((self.t_after - self.t_before) * 1000)}ms"
        agg = f"sum by ({by})" if by else "sum"
        return values(self.url, f"{agg} ({selector}) - {agg} ({selector} offset {offset})", at=self.t_after)


def only(result: dict[frozenset, float]) -> float:
    assert len(result) == 1, result
    return next(iter(result.values()))


def raw_scrape(service: ServiceProcess) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{service.metrics_port}/metrics", timeout=10) as r:
        return r.read().decode()


def settled(draft: ServiceProcess, target: ServiceProcess, timeout: float = 20.0) -> dict[str, Samples]:
    """Direct scrapes once the counters stop moving: after the last response the target still tells
    the draft to release the finished requests, a step with its own TP broadcast."""
    last = None
    deadline = time.monotonic() + timeout
    while True:
        now = {"draft": draft.scrape(), "target": target.scrape()}
        key = {s: sums(s, now[s]) for s in now}
        if key == last:
            return now
        assert time.monotonic() < deadline, "the services' counters kept moving with no traffic"
        last = key
        time.sleep(0.5)


def sums(service: str, samples: Samples) -> dict[str, float]:
    """PromQL sums Prometheus must show once it has scraped `samples` (counters only: they are exact)."""
    sel = f'{{service="{service}"}}'
    names = [BYTES, TOKENS] if service == "draft" else [TOKENS, "specsplit_generation_tokens_total"]
    return {f"sum({n}{sel})": metric_sum(samples, n) for n in names}


@pytest.fixture(scope="module")
def live(demo_models, tmp_path_factory) -> Live:
    need("prometheus")
    logs = tmp_path_factory.mktemp("live-logs")
    draft = start_draft(demo_models.draft, logs, "--tp-size", str(DRAFT_TP))
    target = None
    try:
        target = start_target(demo_models.target, logs, draft, "--num-speculative-tokens", str(K))
        draft.wait_ready()
        target.wait_ready()
        # Warm-up: every (op, site) comm series is created by its first collective; make them all exist,
        # with a good share of their final values, before Prometheus's first scrape.
        generate_many(target.address, [request(p, max_new_tokens=NEW_TOKENS) for p in prompts(4, seed=1)], 4)
        # The committed rules evaluate every 30s; a copy without the group interval follows the 1s scrape.
        groups = yaml.safe_load((ROOT / "deploy/prometheus/recording.rules.yaml").read_text())
        for group in groups["groups"]:
            group.pop("interval", None)
        rules = logs / "recording.rules.yaml"
        rules.write_text(yaml.safe_dump(groups))
        jobs = {"specsplit-target": [f"127.0.0.1:{target.metrics_port}"],
                "specsplit-draft": [f"127.0.0.1:{draft.metrics_port}"]}  # fmt: skip
        with start_prometheus(jobs, [rules], interval="1s") as url:
            before = settled(draft, target)
            t_before = wait_until_scraped(
                url, sums("draft", before["draft"]) | sums("target", before["target"])
            )
            reqs = [request(p, max_new_tokens=NEW_TOKENS) for p in prompts(REQUESTS, seed=2)]
            results = generate_many(target.address, reqs, CONCURRENCY)
            assert all(len(r.ids) == NEW_TOKENS for r in results)
            after = settled(draft, target)
            t_after = wait_until_scraped(url, sums("draft", after["draft"]) | sums("target", after["target"]))
            # Let the rules evaluate over the last scrape too.
            deadline = time.monotonic() + 15
            while not query(url, f"timestamp({RULE_TP}{{service='draft'}}) > {t_after:.3f}"):
                assert time.monotonic() < deadline, "recording rules did not evaluate after the traffic"
                time.sleep(0.2)
            texts = {"draft": raw_scrape(draft), "target": raw_scrape(target)}
            if dump := os.environ.get("SPECSPLIT_LIVE_SCRAPE_DIR"):  # docs/operations.md's excerpt
                for service, text in texts.items():
                    (Path(dump) / f"{service}.prom").write_text(text)
            yield Live(url, draft, target, before, after, t_before, t_after, texts)
    finally:
        for proc in (target, draft):
            if proc is not None:
                proc.stop()


def test_counters_and_histograms_grew_in_prometheus(live):
    tpot = live.increase(f'{TPOT}_count{{service="target"}}')
    assert list(tpot.values()) == [REQUESTS]  # one TPOT observation per request (all have 24 tokens)
    for name in ("specsplit_spec_accepted_tokens_total", TOKENS, "specsplit_generation_tokens_total"):
        got = live.increase(f'{name}{{service="target"}}')
        assert list(got.values()) == [live.delta("target", name)] and live.delta("target", name) > 0, name
    assert list(live.increase(f'{TOKENS}{{service="draft"}}').values()) == [live.delta("draft", TOKENS)]
    by_op_site = {
        (dict(k)["op"], dict(k)["site"]): v
        for k, v in live.increase(f'{BYTES}{{service="draft"}}', by="op, site").items()
    }
    expected_sites = {("all_gather", "lm_head_argmax"), ("all_reduce", "attn_out"), ("all_reduce", "mlp_out"),
                      ("all_reduce", "embed"), ("broadcast", "step_broadcast")}  # fmt: skip
    assert expected_sites <= set(by_op_site)
    for (op, site), v in by_op_site.items():
        assert v == live.delta("draft", BYTES, op=op, site=site) > 0, (op, site)
    calls = live.increase('specsplit_tp_comm_calls_total{service="draft"}')
    assert only(calls) > 0
    # Local argmax: one fp32 (value, index) pair per row from each rank, i.e. 2 * 4 * tp bytes per row
    # and draft position (the gathered output is counted). Every proposed token was drafted at one
    # position; draft-ahead and padded rows only add to that.
    argmax = by_op_site[("all_gather", "lm_head_argmax")]
    assert argmax >= 2 * 4 * DRAFT_TP * live.delta("draft", TOKENS)


def test_tp_bytes_per_draft_token_matches_the_demo(live):
    # The demo's figure: delta(draft TP bytes) / delta(draft's own draft tokens), two direct scrapes.
    demo = live.delta("draft", BYTES) / live.delta("draft", TOKENS)
    assert demo > 2 * DRAFT_TP * 8
    # The same counters through Prometheus at the two instants: exact (the counters were quiescent
    # when Prometheus took those samples, and it stores float64 as scraped).
    raw = live.increase(f'{BYTES}{{service="draft"}}')
    tok = live.increase(f'{TOKENS}{{service="draft"}}')
    assert only(raw) / only(tok) == pytest.approx(demo, rel=1e-12)
    # The recording rule (rates over 5m, everything since Prometheus started). Both counters come from
    # one scrape target, so they share sample times and rate()'s extrapolation factor; the factor can
    # differ between series only where Prometheus stops the start-extrapolation at the counter's zero
    # crossing (first / increase * sampled span < half a scrape interval), which the warm-up's share
    # (first sample >= ~15% of the increase, over a >= 8 s span) rules out. So the rule is exact up to
    # float rounding; 1e-9 leaves room for that only.
    rule = values(live.url, f'{RULE_TP}{{service="draft"}}')
    assert only(rule) == pytest.approx(demo, rel=1e-9)


def test_recording_rules_are_in_range(live):
    def one(expr: str) -> float:
        value = only(values(live.url, expr))
        assert math.isfinite(value), (expr, value)
        return value

    acceptance = one("model:specsplit_spec_acceptance:ratio_rate5m")
    assert 0 < acceptance <= 1
    direct = live.delta("target", "specsplit_spec_accepted_tokens_total") / live.delta("target", TOKENS)
    assert acceptance == pytest.approx(direct, rel=0.05)  # rate() extrapolation, see the TP test
    assert 0 <= one("model:specsplit_spec_accepted_length:mean_rate5m") <= K
    per_position = values(live.url, "model_position:specsplit_spec_acceptance:ratio_rate5m")
    assert per_position and all(0 <= v <= 1 for v in per_position.values())
    for q in ("0.5", "0.9", "0.99"):
        assert (
            one(f'model:specsplit_time_per_output_token_seconds:histogram_quantile_rate5m{{quantile="{q}"}}')
            > 0
        )
    assert one(f'{RULE_TP}{{service="draft"}}') > 0
    grpc = "model_service:specsplit_grpc_payload_bytes_per_generated_token:ratio_rate5m"
    assert one(f'{grpc}{{service="target"}}') > 0
    assert one("model:specsplit_generation_tokens:rate5m") > 0
    assert 0 <= one("model:specsplit_draft_ahead_hit:ratio_rate5m") <= 1


def test_promtool_check_metrics_on_both_live_scrapes(live):
    promtool = need("promtool")
    for service, text in live.texts.items():
        result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
        report = (result.stdout + result.stderr).strip()
        assert result.returncode == 0 and not report, f"{service}: {report}"


def test_every_dashboard_metric_is_in_the_live_scrapes(live):
    spec = importlib.util.spec_from_file_location("deploy_generate", ROOT / "deploy" / "generate.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    exported = {name for samples in live.after.values() for name, _ in samples}
    queries = gen.panel_queries(json.loads(gen.DASHBOARD_PATH.read_text()))
    for title, expr in queries:
        names = gen.metric_names(expr)
        assert names and names <= exported, (
            f"panel {title!r} reads {names - exported} not in the live scrapes"
        )
