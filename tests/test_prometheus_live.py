"""A real Prometheus scraping the real services: a draft (TP=2 over gloo) and a target, both on CPU.

Prometheus scrapes them through the relabelling a Prometheus Operator ServiceMonitor generates
(tests/prom_util.operator_scrape_config: target labels namespace, service, pod, container, job,
endpoint), and loads the committed recording rules, alerts and the cpu-dev overlay's thresholds; every
recording rule, alert and dashboard query is then evaluated against that scrape and must find data.

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
import re
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from common.metrics import RESERVED_LABELS
from specsplit.launch import Samples, ServiceProcess, metric_sum
from tests.prom_util import (
    PodTarget,
    operator_scrape_config,
    query,
    start_prometheus,
    values,
    wait_until_scraped,
)
from tests.service_util import generate_many, prompts, request, start_draft, start_target
from tests.tools import need

ROOT = Path(__file__).resolve().parents[1]
K = 4  # the target's default num_speculative_tokens
DRAFT_TP = 2
REQUESTS, NEW_TOKENS, CONCURRENCY = 16, 24, 4

pytestmark = pytest.mark.slow

BYTES, TOKENS = "specsplit_tp_comm_bytes_total", "specsplit_spec_draft_tokens_total"
TPOT = "specsplit_time_per_output_token_seconds"
RULE_TP = "namespace_model_role:specsplit_tp_comm_bytes_per_draft_token:ratio_rate5m"
NAMESPACE = "specsplit-dev"  # the cpu-dev overlay's: its alert thresholds are recorded for it
RULE_FILES = ("recording.rules.yaml", "alerts.rules.yaml", "thresholds.cpu-dev.rules.yaml")


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
    sel = f'{{role="{service}"}}'
    # The target's TPOT count too: a scrape can land between a request's last token and its TPOT.
    names = (
        [BYTES, TOKENS]
        if service == "draft"
        else [TOKENS, "specsplit_generation_tokens_total", f"{TPOT}_count"]
    )
    return {f"sum({n}{sel})": metric_sum(samples, n) for n in names}


@pytest.fixture(scope="module")
def live(demo_models, tmp_path_factory) -> Live:
    need("prometheus")
    logs = tmp_path_factory.mktemp("live-logs")
    from tests.conftest_sdk import make_certificates

    # mTLS between target and draft, as gpu-production runs it: both export their certificates' expiry.
    certs = make_certificates(logs)
    draft_tls = ["--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key),
                 "--tls-client-ca", str(certs.ca)]  # fmt: skip
    link_tls = ["--draft-tls-ca", str(certs.ca), "--draft-tls-cert", str(certs.client_cert),
                "--draft-tls-key", str(certs.client_key)]  # fmt: skip
    draft = start_draft(demo_models.draft, logs, "--tp-size", str(DRAFT_TP), *draft_tls)
    target = None
    try:
        target = start_target(demo_models.target, logs, draft, "--num-speculative-tokens", str(K), *link_tls)
        draft.wait_ready()
        target.wait_ready()
        # Warm-up: every (op, site) comm series is created by its first collective; make them all exist,
        # with a good share of their final values, before Prometheus's first scrape.
        generate_many(target.address, [request(p, max_new_tokens=NEW_TOKENS) for p in prompts(4, seed=1)], 4)
        # The committed rules evaluate every 30s or 1m; copies without a group interval follow the 1s scrape.
        rules = []
        for name in RULE_FILES:
            groups = yaml.safe_load((ROOT / "deploy/prometheus" / name).read_text())
            for group in groups["groups"]:
                group.pop("interval", None)
            rules.append(logs / name)
            rules[-1].write_text(yaml.safe_dump(groups))
        pods = [
            PodTarget(f"127.0.0.1:{svc.metrics_port}", f"specsplit-{role}", f"specsplit-{role}-0", role)
            for role, svc in (("target", target), ("draft", draft))
        ]
        scrape = [operator_scrape_config("specsplit", NAMESPACE, pods)]
        with start_prometheus(scrape, rules, interval="1s") as url:
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
            while not query(url, f"timestamp({RULE_TP}{{role='draft'}}) > {t_after:.3f}"):
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
    tpot = live.increase(f'{TPOT}_count{{role="target"}}')
    assert list(tpot.values()) == [REQUESTS]  # one TPOT observation per request (all have 24 tokens)
    for name in ("specsplit_spec_accepted_tokens_total", TOKENS, "specsplit_generation_tokens_total"):
        got = live.increase(f'{name}{{role="target"}}')
        assert list(got.values()) == [live.delta("target", name)] and live.delta("target", name) > 0, name
    assert list(live.increase(f'{TOKENS}{{role="draft"}}').values()) == [live.delta("draft", TOKENS)]
    by_op_site = {
        (dict(k)["op"], dict(k)["site"]): v
        for k, v in live.increase(f'{BYTES}{{role="draft"}}', by="op, site").items()
    }
    expected_sites = {("all_gather", "lm_head_argmax"), ("all_reduce", "attn_out"), ("all_reduce", "mlp_out"),
                      ("all_reduce", "embed"), ("broadcast", "step_broadcast")}  # fmt: skip
    assert expected_sites <= set(by_op_site)
    for (op, site), v in by_op_site.items():
        assert v == live.delta("draft", BYTES, op=op, site=site) > 0, (op, site)
    calls = live.increase('specsplit_tp_comm_calls_total{role="draft"}')
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
    raw = live.increase(f'{BYTES}{{role="draft"}}')
    tok = live.increase(f'{TOKENS}{{role="draft"}}')
    assert only(raw) / only(tok) == pytest.approx(demo, rel=1e-12)
    # The recording rule (rates over 5m, everything since Prometheus started). Both counters come from
    # one scrape target, so they share sample times and rate()'s extrapolation factor; the factor can
    # differ between series only where Prometheus stops the start-extrapolation at the counter's zero
    # crossing (first / increase * sampled span < half a scrape interval), which the warm-up's share
    # (first sample >= ~15% of the increase, over a >= 8 s span) rules out. So the rule is exact up to
    # float rounding; 1e-9 leaves room for that only.
    rule = values(live.url, f'{RULE_TP}{{role="draft"}}')
    assert only(rule) == pytest.approx(demo, rel=1e-9)


def test_recording_rules_are_in_range(live):
    def one(expr: str) -> float:
        value = only(values(live.url, expr))
        assert math.isfinite(value), (expr, value)
        return value

    acceptance = one("namespace_model:specsplit_spec_acceptance:ratio_rate5m")
    assert 0 < acceptance <= 1
    direct = live.delta("target", "specsplit_spec_accepted_tokens_total") / live.delta("target", TOKENS)
    assert acceptance == pytest.approx(direct, rel=0.05)  # rate() extrapolation, see the TP test
    assert 0 <= one("namespace_model:specsplit_spec_accepted_length:mean_rate5m") <= K
    per_position = values(live.url, "namespace_model_position:specsplit_spec_acceptance:ratio_rate5m")
    assert per_position and all(0 <= v <= 1 for v in per_position.values())
    for q in ("0.5", "0.9", "0.99"):
        assert (
            one(
                f'namespace_model:specsplit_time_per_output_token_seconds:histogram_quantile_rate5m{{quantile="{q}"}}'
            )
            > 0
        )
    assert one(f'{RULE_TP}{{role="draft"}}') > 0
    grpc = "namespace_model_role:specsplit_grpc_payload_bytes_per_generated_token:ratio_rate5m"
    assert one(f'{grpc}{{role="target"}}') > 0
    assert one("namespace_model:specsplit_generation_tokens:rate5m") > 0
    assert 0 <= one("namespace_model:specsplit_draft_ahead_hit:ratio_rate5m") <= 1


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


def test_series_carry_the_operator_target_labels_and_no_exported_ones(live):
    series = query(live.url, '{__name__=~"specsplit_.+"}', at=live.t_after)
    assert len(series) > 50
    for s in series:
        labels = s["metric"]
        assert not [k for k in labels if k.startswith("exported_")], labels
        assert labels["namespace"] == NAMESPACE and labels["endpoint"] == "metrics", labels
        role = labels["role"]
        assert labels["service"] == labels["job"] == f"specsplit-{role}", labels
        assert labels["pod"] == f"specsplit-{role}-0" and labels["container"] == role, labels
    exported = {k for samples in live.after.values() for _, labels in samples for k, _ in labels}
    assert not exported & set(RESERVED_LABELS)


_COMPARISON = re.compile(r"(==|!=|>=|<=|>|<)(?!\s*bool)")


def _outside_braces(expr: str, fn) -> str:
    """Applies `fn` to the parts of `expr` outside label matchers ({...}) and strings."""
    parts = re.split(r'(\{[^}]*\}|"[^"]*")', expr)
    return "".join(p if i % 2 else fn(p) for i, p in enumerate(parts))


def alert_signals(expr: str) -> tuple[list[str], str | None]:
    """(queries that must return data, query that must return nothing) for one alert expression.

    Comparisons become `bool` comparisons, so a healthy service still yields one 0/1 sample per
    series: the query is empty only if a selector, a label or a join does not match the scrape. The
    10m:1m subqueries run at 1s resolution: this Prometheus has lived for well under ten minutes.
    """
    expr = " ".join(expr.split()).replace(":1m]", ":1s]")
    if " unless " in expr:
        left, right = expr.split(" unless on (namespace) ")
        return [left, right], expr
    return [_outside_braces(expr, lambda p: _COMPARISON.sub(r"\1 bool", p))], None


def test_every_rule_and_alert_finds_data_in_the_operator_scrape(live):
    alerts = 0
    for name in RULE_FILES:
        for group in yaml.safe_load((ROOT / "deploy/prometheus" / name).read_text())["groups"]:
            for rule in group["rules"]:
                if "record" in rule:
                    selector = rule["record"] + "".join(
                        f'{{{k}="{v}"}}' for k, v in rule.get("labels", {}).items()
                    ).replace("}{", ", ")
                    assert query(live.url, selector, at=live.t_after), f"{rule['record']} recorded nothing"
                    continue
                alerts += 1
                must_have, must_be_empty = alert_signals(rule["expr"])
                for q in must_have:
                    assert query(live.url, q, at=live.t_after), f"{rule['alert']}: no data for {q}"
                if must_be_empty:
                    assert not query(live.url, must_be_empty, at=live.t_after), rule["alert"]
    assert alerts >= 10


def test_every_dashboard_query_finds_data_and_its_legend_labels(live):
    spec = importlib.util.spec_from_file_location("deploy_generate", ROOT / "deploy" / "generate.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    dashboard = json.loads(gen.DASHBOARD_PATH.read_text())
    panels = list(dashboard["panels"])
    for panel in list(panels):
        panels.extend(panel.get("panels", []))
    variables = {
        "$namespace": NAMESPACE,
        "$pod": ".*",
        "$model": ".*",
        "$role": ".*",
        "$__rate_interval": "1m",
    }
    checked = 0
    for panel in panels:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for var, value in variables.items():
                expr = expr.replace(var, value)
            result = query(live.url, expr, at=live.t_after)
            assert result, f"panel {panel['title']!r}: no data for {expr}"
            for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")):
                assert all(label in r["metric"] for r in result), (panel["title"], label, result[:2])
            checked += 1
    assert checked >= 25


def test_every_autoscaling_query_finds_data(live):
    """The KEDA ScaledObjects' Prometheus queries (components/autoscaling), for this namespace."""
    path = ROOT / "deploy/kubernetes/components/autoscaling/scaledobjects.yaml"
    triggers = [t for doc in yaml.safe_load_all(path.read_text()) for t in doc["spec"]["triggers"]]
    assert len(triggers) >= 3
    for trigger in triggers:
        expr = trigger["metadata"]["query"].replace("'NAMESPACE'", f"'{NAMESPACE}'")
        result = query(live.url, expr, at=live.t_after)
        assert len(result) == 1 and float(result[0]["value"][1]) >= 0, (trigger["name"], result)
