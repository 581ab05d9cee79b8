"""Generates the committed deploy artefacts that have a single source elsewhere.

- kubernetes/base/specsplit-dashboard.json: the Grafana dashboard, built with grafana-foundation-sdk.
- kubernetes/base/prometheusrule.yaml: the PrometheusRule CR wrapping prometheus/*.rules.yaml, so
  promtool checks and tests exactly the rules the cluster runs.
- prometheus/thresholds.<overlay>.rules.yaml and kubernetes/overlays/<overlay>/alert-thresholds.yaml:
  each overlay's alert thresholds (THRESHOLDS below) as recorded constants the alerts compare with
  `on (namespace)`, as a plain rule file for promtool and as the PrometheusRule the overlay installs.

    python deploy/generate.py          # rewrite both files
    python deploy/generate.py --check  # exit 1 if a committed file differs from the generator
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import yaml
from grafana_foundation_sdk.builders import common as gc
from grafana_foundation_sdk.builders import dashboard as gd
from grafana_foundation_sdk.builders import prometheus as gp
from grafana_foundation_sdk.builders import timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import LegendDisplayMode, LegendPlacement, TooltipDisplayMode
from grafana_foundation_sdk.models.dashboard import DashboardCursorSync, DataSourceRef, VariableRefresh

DEPLOY = Path(__file__).resolve().parent
DASHBOARD_PATH = DEPLOY / "kubernetes" / "base" / "specsplit-dashboard.json"
PROMETHEUS_RULE_PATH = DEPLOY / "kubernetes" / "base" / "prometheusrule.yaml"
RULE_FILES = (DEPLOY / "prometheus" / "recording.rules.yaml", DEPLOY / "prometheus" / "alerts.rules.yaml")
OVERLAYS = DEPLOY / "kubernetes" / "overlays"
THRESHOLD_SERIES = "namespace:specsplit_alert_threshold:constant"

# Alert thresholds per overlay (docs/runbook.md explains each). TPOT: the TPOT the overlay's hardware and
# model pair serve at its usual load (p90); SpecsplitTPOTHigh fires at twice that. A GPU pair decodes at
# 1-5 ms per token, the CPU demo at 20-100 ms, so one number would either never fire on GPUs or always
# on CPUs.
THRESHOLDS: dict[str, dict[str, float]] = {
    "cpu-dev": {
        "served_tpot_seconds": 0.1,
        "ttft_p90_seconds": 10.0,
        "queue_depth_per_target": 16,
        "acceptance_ratio_min": 0.2,
        "fallback_step_ratio": 0.25,
        "request_error_ratio": 0.05,
        "draft_slot_utilization": 0.9,
    },
    "gpu": {
        # The 8B-class target at TP=4 with its draft: about 5 ms per token (7.6B at TP=1, plain: 4.2-4.6 ms,
        # docs/benchmarks.md).
        "served_tpot_seconds": 0.005,
        "ttft_p90_seconds": 2.0,
        "queue_depth_per_target": 32,
        "acceptance_ratio_min": 0.3,
        "fallback_step_ratio": 0.1,
        "request_error_ratio": 0.01,
        "draft_slot_utilization": 0.9,
    },
}

DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
# Every query is narrowed by the dashboard's variables: one Prometheus may watch several installs
# (namespaces), and a pod variable picks one replica out of a Deployment.
SCOPE = 'namespace=~"$namespace", pod=~"$pod"'
SEL = f'{SCOPE}, model=~"$model", role=~"$role"'
TARGET = f'{SCOPE}, model=~"$model", role="target"'
# Grafana 12.0's dashboard schema; Grafana 11 loads it as it is (no migration step applies).
SCHEMA_VERSION = 41
# Legends as tables with these columns: the last value and the mean over the time range per series.
LEGEND_CALCS = ["lastNotNull", "mean"]


def rate(metric: str, selector: str) -> str:
    return f"rate({metric}{{{selector}}}[$__rate_interval])"


def quantiles(metric: str, selector: str, qs: tuple[float, ...] = (0.5, 0.99)) -> list[tuple[str, str]]:
    by = "sum by (model, role, le)"
    return [
        (
            f"histogram_quantile({q}, {by} ({rate(metric + '_bucket', selector)}))",
            f"p{round(q * 100)} {{{{role}}}}",
        )
        for q in qs
    ]


def per(num: str, num_sel: str, den: str, den_sel: str, by: str = "model") -> str:
    """Ratio of two counters' rates; `by` may carry labels only the numerator has (matched on model)."""
    match = "" if by == "model" else " / on (model) group_left"
    div = match or " /"
    return f"sum by ({by}) ({rate(num, num_sel)}){div} sum by (model) ({rate(den, den_sel)})"


def panel(title: str, unit: str, queries: list[tuple[str, str]], description: str = "") -> dict:
    return {"title": title, "unit": unit, "queries": queries, "description": description}


ACCEPTED, DRAFT_TOKENS, DRAFTS = (
    "specsplit_spec_accepted_tokens_total",
    "specsplit_spec_draft_tokens_total",
    "specsplit_spec_drafts_total",
)
FALLBACKS, RECONNECTS = "specsplit_spec_fallback_steps_total", "specsplit_draft_reconnects_total"
HITS, MISSES = "specsplit_draft_ahead_hits_total", "specsplit_draft_ahead_misses_total"
MODEL = f'{SCOPE}, model=~"$model", role="draft"'  # draft-ahead is counted by the draft only

# Rows of panels. Units are Grafana unit ids. Queries read exported series only (no recording rules), so
# the dashboard works before the PrometheusRule is installed and the scrape test can check every name.
ROWS: list[tuple[str, list[dict]]] = [
    ("Latency", [
        panel("TPOT p50 / p90 / p99", "s", quantiles("specsplit_time_per_output_token_seconds", TARGET,
                                                     (0.5, 0.9, 0.99)),
              "Per request: decode time / (output tokens - 1)."),
        panel("Time to first token", "s", quantiles("specsplit_time_to_first_token_seconds", TARGET)),
        panel("Inter-token latency", "s", quantiles("specsplit_inter_token_latency_seconds", TARGET),
              "Between streamed chunks; a chunk carries every token accepted in a round."),
        panel("End-to-end and queue time p99", "s",
              quantiles("specsplit_e2e_request_latency_seconds", TARGET, (0.99,))
              + quantiles("specsplit_queue_time_seconds", TARGET, (0.99,))),
    ]),
    ("Speculation", [
        panel("Output tokens/s", "short",
              [(f"sum by (model) ({rate('specsplit_generation_tokens_total', TARGET)})", "{{model}}")]),
        panel("Drafted and accepted tokens/s", "short", [
            (f"sum by (model) ({rate(DRAFT_TOKENS, TARGET)})", "drafted {{model}}"),
            (f"sum by (model) ({rate(ACCEPTED, TARGET)})", "accepted {{model}}"),
        ], "Draft tokens the target verified, and those it accepted, per second."),
        panel("Acceptance rate", "percentunit", [(per(ACCEPTED, TARGET, DRAFT_TOKENS, TARGET), "{{model}}")],
              "Accepted draft tokens / proposed draft tokens."),
        panel("Acceptance by draft position", "percentunit",
              [(per("specsplit_spec_accepted_tokens_per_position_total", TARGET, DRAFTS, TARGET,
                    by="model, position"), "pos {{position}} {{model}}")],
              "Accepted at position i / rounds. Position 0 is the first drafted token."),
        panel("Mean accepted length", "short", [(per(ACCEPTED, TARGET, DRAFTS, TARGET), "{{model}}")],
              "Accepted draft tokens per round; tokens emitted per round are one more."),
        panel("Steps not waiting for the draft's answer", "percentunit",
              [(per("specsplit_spec_pipelined_steps_total", TARGET, "specsplit_verify_step_seconds_count",
                    TARGET), "{{model}}")],
              "Steps that verified the draft's branch for the verdict, or (the draft inside the target) the "
              "round chained to the last verify, without waiting for the draft's answer."),
        panel("Draft-ahead (branch) hit rate", "percentunit",
              [(f"sum by (model) ({rate(HITS, MODEL)}) / (sum by (model) ({rate(HITS, MODEL)})"
                f" + sum by (model) ({rate(MISSES, MODEL)}))", "{{model}}")]),
        panel("Fallbacks to plain decoding and reconnects", "short", [
            (f"sum by (model) ({rate(FALLBACKS, TARGET)})", "fallbacks/s {{model}}"),
            (f"sum by (model) ({rate(RECONNECTS, TARGET)})", "reconnects/s {{model}}"),
        ]),
    ]),
    ("Communication", [
        panel("TP collective bytes/s by op and site", "Bps",
              [(f"sum by (role, op, site) ({rate('specsplit_tp_comm_bytes_total', SEL)})",
                "{{role}} {{op}} {{site}}")],
              "Bytes sent in TP collectives, summed over the ranks that report them."),
        panel("TP bytes per draft token", "bytes",
              [(f"sum by (model, role) ({rate('specsplit_tp_comm_bytes_total', SEL)})"
                f" / sum by (model, role) ({rate(DRAFT_TOKENS, SEL)})", "{{role}} {{model}}")],
              "Each service's TP bytes over the draft tokens it counted (the draft: proposed)."),
        panel("gRPC payload bytes/s", "Bps",
              [(f"sum by (role, direction, kind) ({rate('specsplit_grpc_payload_bytes_total', SEL)})",
                "{{role}} {{direction}} {{kind}}")]),
        panel("gRPC bytes per generated token", "bytes",
              [(per("specsplit_grpc_payload_bytes_total", SEL, "specsplit_generation_tokens_total", TARGET,
                    by="model, role"), "{{role}} {{model}}")]),
    ]),
    ("Steps", [
        panel("Draft vs verify step time", "s",
              quantiles("specsplit_draft_step_seconds", SEL)
              + quantiles("specsplit_verify_step_seconds", SEL)),
        panel("Target-draft round trip", "s", quantiles("specsplit_draft_round_trip_seconds", TARGET),
              "Draft request sent to proposal received, seen from the target."),
        panel("Target step: GPU, host, GPU queue, GPU gap (mean)", "s",
              [(per(f"specsplit_step_{part}_seconds_sum", TARGET, f"specsplit_step_{part}_seconds_count",
                    TARGET), f"{part} {{{{model}}}}") for part in ("gpu", "host", "gpu_queue", "gpu_gap")],
              "Per verify step on a GPU: the replay's GPU time; host work (the step's wall time minus its "
              "waits for the draft and the GPU); the wait beyond its own GPU time, its kernels queued "
              "behind others on the GPU (a draft on the same GPU); and the GPU's idle time between two "
              "steps (with the draft in the target and its rounds chained: wall time minus GPU busy)."),
        panel("Draft tokens asked per request (policy k)", "short", [
            (per("specsplit_spec_step_tokens_sum", TARGET, "specsplit_spec_step_tokens_count", TARGET),
             "mean k {{model}}"),
            (per("specsplit_spec_step_tokens_bucket", f'{TARGET}, le="0.0"',
                 "specsplit_spec_step_tokens_count", TARGET), "plain step share {{model}}"),
        ], "The speculation policy's k per step (--speculation-policy adaptive lowers it to 0 where "
           "drafting does not pay), and the share of steps with k = 0."),
        panel("Draft rounds chained to the verify", "percentunit",
              [(per("specsplit_draft_chained_rows_total", MODEL, DRAFTS, MODEL), "chained {{model}}")],
              "With the draft inside the target (--draft-local): the share of the draft's proposals whose "
              "round ran from the target's verify output on the GPU (--draft-chain), before the verdict "
              "reached the draft. Near 1 for greedy traffic; 0 with --no-draft-chain or a draft service."),
    ]),
    ("Load", [
        panel("Running and waiting requests", "short", [
            (f"sum by (role) (specsplit_running_requests{{{SEL}}})", "running {{role}}"),
            (f"sum by (role) (specsplit_waiting_requests{{{SEL}}})", "waiting {{role}}"),
        ]),
        panel("Batch size", "short", [(f"avg by (role) (specsplit_batch_size{{{SEL}}})", "{{role}}")]),
        panel("KV slot usage", "percentunit",
              [(f"sum by (role) (specsplit_kv_slots_used{{{SEL}}})"
                f" / sum by (role) (specsplit_kv_slots_capacity{{{SEL}}})", "{{role}}")]),
        panel("Draft replicas per target", "short", [
            (f"min by (pod) (specsplit_draft_replicas_connected{{{TARGET}}})", "connected {{pod}}"),
            (f"max by (pod) (specsplit_draft_replicas{{{TARGET}}})", "resolved {{pod}}"),
        ], "Draft pods each target resolved from --draft-address and holds a stream to."),
        panel("Ready pods", "short", [(f"sum by (role) (specsplit_ready{{{SEL}}})", "{{role}}")],
              "Pods with their model loaded and serving; a loading pod scrapes as 0."),
        panel("Request errors/s by gRPC code", "short",
              [(f"sum by (code) ({rate('specsplit_request_errors_total', TARGET)})", "{{code}}")]),
    ]),
]  # fmt: skip


def build_dashboard() -> dict:
    board = (
        gd.Dashboard("specsplit")
        .uid("specsplit")
        .description("Speculative decoding split across draft and target services.")
        .tags(["specsplit", "llm-serving"])
        .refresh("30s")
        .time("now-1h", "now")
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .with_variable(gd.DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(label_variable("namespace", "label_values(specsplit_service_info, namespace)"))
        .with_variable(
            label_variable("model", 'label_values(specsplit_service_info{namespace=~"$namespace"}, model)')
        )
        .with_variable(label_variable(
            "role", 'label_values(specsplit_service_info{namespace=~"$namespace", model=~"$model"}, role)'
        ))
        .with_variable(label_variable(
            "pod", 'label_values(specsplit_service_info{namespace=~"$namespace", model=~"$model", '
            'role=~"$role"}, pod)'
        ))
    )  # fmt: skip
    panel_id = 0
    for row_title, panels in ROWS:
        panel_id += 1
        board = board.with_row(gd.Row(row_title).id(panel_id))
        for spec in panels:
            panel_id += 1
            built = (
                timeseries.Panel()
                .id(panel_id)
                .title(spec["title"])
                .unit(spec["unit"])
                .datasource(DATASOURCE)
                .height(10)  # room for the legend table below the graph
                .span(8)
                .legend(
                    gc.VizLegendOptions()
                    .show_legend(True)
                    .display_mode(LegendDisplayMode.TABLE)
                    .placement(LegendPlacement.BOTTOM)
                    .calcs(LEGEND_CALCS)
                )
                .tooltip(gc.VizTooltipOptions().mode(TooltipDisplayMode.MULTI))
            )
            if spec["description"]:
                built = built.description(spec["description"])
            for ref, (expr, legend) in zip("ABCDEFGH", spec["queries"], strict=False):
                built = built.with_target(gp.Dataquery().expr(expr).legend_format(legend).ref_id(ref))
            board = board.with_panel(built)
    built_board = json.loads(json.dumps(board.build(), cls=JSONEncoder))
    built_board["schemaVersion"] = SCHEMA_VERSION
    return built_board


def label_variable(name: str, query: str) -> gd.QueryVariable:
    return (
        gd.QueryVariable(name)
        .label(name)
        .query(query)
        .datasource(DATASOURCE)
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .multi(True)
        .include_all(True)
        .all_value(".*")
    )


def dashboard_json() -> str:
    return json.dumps(build_dashboard(), indent=2, sort_keys=True) + "\n"


def panel_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, expr) for every query of every panel, rows included."""
    panels = list(dashboard.get("panels", []))
    for panel in list(panels):
        panels.extend(panel.get("panels", []))
    return [(p["title"], t["expr"]) for p in panels for t in p.get("targets", []) if "expr" in t]


_METRIC_NAME = re.compile(r"\b(specsplit_[a-zA-Z0-9_]+)\b")


def metric_names(expr: str) -> set[str]:
    """Exported series names a PromQL expression reads (specsplit_ prefix; recorded series have colons)."""
    return set(_METRIC_NAME.findall(expr))


class _LiteralBlockDumper(yaml.SafeDumper):
    pass


def _str_presenter(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_LiteralBlockDumper.add_representer(str, _str_presenter)


def _dump(header: str, doc: dict) -> str:
    return header + yaml.dump(
        doc, Dumper=_LiteralBlockDumper, sort_keys=False, explicit_start=True, width=1000
    )


def _prometheus_rule(name: str, groups: list[dict]) -> dict:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "specsplit"}},
        "spec": {"groups": groups},
    }


def prometheus_rule_yaml() -> str:
    groups = [group for path in RULE_FILES for group in yaml.safe_load(path.read_text())["groups"]]
    header = "# Generated by deploy/generate.py from deploy/prometheus/*.rules.yaml; do not edit.\n"
    return _dump(header, _prometheus_rule("specsplit", groups))


def overlay_namespace(overlay: str) -> str:
    kustomization = yaml.safe_load((OVERLAYS / overlay / "kustomization.yaml").read_text())
    return kustomization["namespace"]


def threshold_groups(overlay: str) -> list[dict]:
    """One recorded constant per threshold, labelled with the overlay's namespace (the alerts join on it)."""
    namespace = overlay_namespace(overlay)
    rules = [
        {"record": THRESHOLD_SERIES, "expr": f"vector({value})",
         "labels": {"namespace": namespace, "threshold": name}}
        for name, value in THRESHOLDS[overlay].items()
    ]  # fmt: skip
    return [{"name": "specsplit.thresholds", "interval": "1m", "rules": rules}]


def thresholds_rules_path(overlay: str) -> Path:
    return DEPLOY / "prometheus" / f"thresholds.{overlay}.rules.yaml"


def outputs() -> dict[Path, str]:
    files = {DASHBOARD_PATH: dashboard_json(), PROMETHEUS_RULE_PATH: prometheus_rule_yaml()}
    header = "# Generated by deploy/generate.py (THRESHOLDS); do not edit.\n"
    for overlay in THRESHOLDS:
        groups = threshold_groups(overlay)
        files[thresholds_rules_path(overlay)] = _dump(header, {"groups": groups})
        files[OVERLAYS / overlay / "alert-thresholds.yaml"] = _dump(
            header, _prometheus_rule("specsplit-alert-thresholds", groups)
        )
    return files


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="fail if a committed file is stale")
    args = parser.parse_args()
    stale = []
    for path, text in outputs().items():
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    for path in stale:
        print(f"stale: {path.relative_to(DEPLOY.parent)} (run python deploy/generate.py)", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
