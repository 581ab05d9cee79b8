"""ServiceMetrics over real HTTP: names, labels, values, promtool lint, dashboard coverage, and the
recording rules evaluated by a real Prometheus scraping it."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from common.metrics import RESERVED_LABELS, ServiceMetrics, start_metrics_server
from tests.tools import need

ROOT = Path(__file__).resolve().parents[1]


def load_generator():
    spec = importlib.util.spec_from_file_location("deploy_generate", ROOT / "deploy" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


COMM = {("all_gather", "local_argmax"): (12, 12 * 2 * 2 * 8), ("all_reduce", "mlp"): (3, 3 * 4096)}


def exercised(service: str = "target") -> tuple[CollectorRegistry, ServiceMetrics, int]:
    """A registry whose every series has at least one sample, served over HTTP."""
    registry = CollectorRegistry()
    m = ServiceMetrics(service, "tiny", registry, comm_stats=lambda: COMM)
    for h in (m.tpot, m.inter_token_latency, m.ttft, m.e2e_latency, m.queue_time, m.draft_step,
              m.draft_ahead_step, m.draft_handle, m.verify_step, m.round_trip):  # fmt: skip
        h.observe(0.0123)
    m.drafts.inc(10)
    m.draft_tokens.inc(40)
    m.accepted_tokens.inc(25)
    for pos, n in enumerate((9, 7, 5, 4)):
        m.accepted_at_position(pos).inc(n)
    for c in (
        m.draft_ahead_hits,
        m.draft_ahead_misses,
        m.fallback_steps,
        m.draft_reconnects,
        m.pipelined_steps,
    ):
        c.inc()
    m.generated_tokens.inc(35)
    m.prompt_tokens.inc(16)
    m.finished("stop").inc()
    m.request_error("INVALID_ARGUMENT").inc()
    m.count_grpc_message("sent", "DraftRequest", 120)
    m.count_grpc_message("received", "DraftResponse", 80)
    gauges = (m.running, m.waiting, m.batch_size, m.kv_slots_used, m.kv_slots_total, m.draft_connected)
    for gauge, v in zip(gauges, (2, 1, 2, 3, 8, 1), strict=True):
        gauge.set(v)
    m.set_info(tp_size=2, device="cpu", dtype="float32")
    m.set_tls_expiry("--draft-tls-cert", 1_900_000_000.0)
    return registry, m, start_metrics_server(0, "127.0.0.1", registry)


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_scrape_has_exact_values_and_labels():
    _, _, port = exercised()
    got = samples(scrape(port))
    base = {("role", "target"), ("model", "tiny")}

    def value(name, **labels):
        return got[(name, frozenset(base | set(labels.items())))]

    assert value("specsplit_spec_draft_tokens_total") == 40
    assert value("specsplit_spec_accepted_tokens_total") == 25
    per_position = [
        value("specsplit_spec_accepted_tokens_per_position_total", position=str(p)) for p in range(4)
    ]
    assert per_position == [9, 7, 5, 4]
    assert value("specsplit_tp_comm_bytes_total", op="all_gather", site="local_argmax") == 12 * 2 * 2 * 8
    assert value("specsplit_tp_comm_calls_total", op="all_reduce", site="mlp") == 3
    assert value("specsplit_grpc_payload_bytes_total", direction="sent", kind="DraftRequest") == 120
    assert value("specsplit_grpc_messages_total", direction="received", kind="DraftResponse") == 1
    assert value("specsplit_kv_slots_capacity") == 8
    assert value("specsplit_time_per_output_token_seconds_bucket", le="0.02") == 1
    assert value("specsplit_time_per_output_token_seconds_bucket", le="0.01") == 0
    assert value("specsplit_service_info", tp_size="2", device="cpu", dtype="float32") == 1
    expiry = "specsplit_tls_certificate_expiry_timestamp_seconds"
    assert value(expiry, certificate="draft_tls_cert") == 1_900_000_000.0
    names = {name for name, _ in got}
    # No `_created` series beside counters and histograms (disable_created_metrics).
    assert not [n for n in names if n.endswith("_created")]
    assert all(n.startswith("specsplit_") and ":" not in n for n in names)
    # A scrape target label (service, pod, ...) in the exposition would become exported_<name>.
    exported_labels = {label for _, labels in got for label, _ in labels}
    assert not exported_labels & set(RESERVED_LABELS), exported_labels & set(RESERVED_LABELS)


def test_comm_stats_are_read_at_scrape_time():
    registry = CollectorRegistry()
    stats = {("all_reduce", "attn"): (1, 100)}
    ServiceMetrics("draft", "tiny", registry, comm_stats=lambda: dict(stats))
    port = start_metrics_server(0, "127.0.0.1", registry)
    labels = {("role", "draft"), ("model", "tiny"), ("op", "all_reduce"), ("site", "attn")}
    key = ("specsplit_tp_comm_bytes_total", frozenset(labels))
    assert samples(scrape(port))[key] == 100
    stats[("all_reduce", "attn")] = (2, 300)
    assert samples(scrape(port))[key] == 300


def test_two_services_in_one_process_and_bad_input():
    r1, r2 = CollectorRegistry(), CollectorRegistry()
    ServiceMetrics("target", "m", r1)
    ServiceMetrics("draft", "m", r2)
    with pytest.raises(ValueError, match="Duplicated"):
        ServiceMetrics("target", "m", r1)
    m = ServiceMetrics("target", "m", CollectorRegistry())
    with pytest.raises(ValueError, match="direction"):
        m.grpc_bytes("up", "DraftRequest")
    with pytest.raises(ValueError, match="position"):
        m.accepted_at_position(-1)
    with pytest.raises(ValueError, match="'reason'"):
        m.finished("")
    with pytest.raises(ValueError, match="role"):
        ServiceMetrics("", "m", CollectorRegistry())


def test_tpot_skips_single_token_requests():
    registry = CollectorRegistry()
    m = ServiceMetrics("target", "m", registry)
    m.observe_tpot(0.5, 1)
    m.observe_tpot(0.5, 11)
    labels = {"role": "target", "model": "m"}
    assert registry.get_sample_value("specsplit_time_per_output_token_seconds_count", labels) == 1
    assert registry.get_sample_value("specsplit_time_per_output_token_seconds_sum", labels) == pytest.approx(
        0.05
    )


def test_promtool_check_metrics_is_clean():
    promtool = need("promtool")
    _, _, port = exercised()
    result = subprocess.run(
        [promtool, "check", "metrics"], input=scrape(port), capture_output=True, text=True
    )
    assert result.returncode == 0 and not result.stdout.strip() and not result.stderr.strip(), (
        result.stdout + result.stderr
    )


def test_every_dashboard_query_names_exported_metrics():
    gen = load_generator()
    dashboard = json.loads(gen.DASHBOARD_PATH.read_text())
    _, _, target_port = exercised("target")
    _, _, draft_port = exercised("draft")
    exported = {name for port in (target_port, draft_port) for name, _ in samples(scrape(port))}
    queries = gen.panel_queries(dashboard)
    assert len(queries) >= 25
    for title, expr in queries:
        names = gen.metric_names(expr)
        assert names, f"panel {title!r} reads no specsplit metric: {expr}"
        assert names <= exported, f"panel {title!r} reads unexported {names - exported}"


@pytest.mark.slow
def test_recording_rules_on_real_prometheus(tmp_path):
    """Real Prometheus scrapes a draft and a target registry; rules give the counters' exact ratios."""
    need("prometheus")
    from tests.prom_util import start_prometheus, wait_for_value

    stats = {("all_gather", "local_argmax"): (0, 0)}
    target_reg, draft_reg = CollectorRegistry(), CollectorRegistry()
    target = ServiceMetrics("target", "tiny", target_reg)
    ServiceMetrics("draft", "tiny", draft_reg, comm_stats=lambda: dict(stats))
    for position in range(4):  # children exist from the start, so rate() sees their first increase
        target.accepted_at_position(position)
    ports = [start_metrics_server(0, "127.0.0.1", r) for r in (target_reg, draft_reg)]
    # The committed rules evaluate every 30s; a copy without the group interval follows the test's 1s.
    groups = yaml.safe_load((ROOT / "deploy/prometheus/recording.rules.yaml").read_text())
    for group in groups["groups"]:
        group.pop("interval", None)
    rules = [tmp_path / "recording.rules.yaml"]
    rules[0].write_text(yaml.safe_dump(groups))
    with start_prometheus({"specsplit-target": [f"127.0.0.1:{ports[0]}"],
                           "specsplit-draft": [f"127.0.0.1:{ports[1]}"]}, rules) as url:  # fmt: skip
        # A zero sample of BOTH services first, so rate() sees the whole increase in every series: a sum
        # over whichever registry was scraped first would let the target's first sample already be 40.
        wait_for_value(url, "count(specsplit_spec_draft_tokens_total == 0) == 2")
        target.drafts.inc(10)
        target.draft_tokens.inc(40)
        target.accepted_tokens.inc(30)
        target.accepted_at_position(0).inc(10)
        target.accepted_at_position(3).inc(5)
        stats[("all_gather", "local_argmax")] = (40, 40 * 2 * 2 * 8)  # 2 values x tp 2 x 8 bytes per token
        acceptance = wait_for_value(
            url, "namespace_model:specsplit_spec_acceptance:ratio_rate5m", timeout=120
        )
        assert acceptance == pytest.approx(0.75, rel=1e-9)
        assert wait_for_value(
            url, "namespace_model:specsplit_spec_accepted_length:mean_rate5m"
        ) == pytest.approx(3.0)
        by_position = "namespace_model_position:specsplit_spec_acceptance:ratio_rate5m"
        by_pos = {p: wait_for_value(url, f'{by_position}{{position="{p}"}}') for p in "0123"}
        assert by_pos == pytest.approx({"0": 1.0, "1": 0.0, "2": 0.0, "3": 0.5})
