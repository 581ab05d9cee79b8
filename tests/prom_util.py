"""Real Prometheus on loopback for tests: start it on given scrape targets and rule files, query it."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

from specsplit.launch import free_port


@dataclass(frozen=True)
class PodTarget:
    """One scrape target as Kubernetes service discovery would describe it."""

    address: str  # 127.0.0.1:port
    service: str  # the Service whose endpoints list the pod (ServiceMonitor) / "" (PodMonitor)
    pod: str
    container: str
    port_name: str = "metrics"


def operator_scrape_config(name: str, namespace: str, targets: list[PodTarget]) -> dict:
    """The scrape job the Prometheus Operator generates for a ServiceMonitor, on static targets.

    Kubernetes SD would attach the __meta_kubernetes_* labels; here static_configs carry them, and the
    relabel_configs are the label-producing ones the Operator writes (prometheus-operator
    pkg/prometheus/promcfg.go): namespace, service, pod, container, job = Service name, endpoint =
    port name. honor_labels is false, so an application label with one of those names would be
    renamed exported_<name>: the breakage this reproduces.
    """
    static = [
        {
            "targets": [t.address],
            "labels": {
                "__meta_kubernetes_namespace": namespace,
                "__meta_kubernetes_service_name": t.service,
                "__meta_kubernetes_pod_name": t.pod,
                "__meta_kubernetes_pod_container_name": t.container,
                "__meta_kubernetes_endpoint_port_name": t.port_name,
            },
        }
        for t in targets
    ]

    def copy(source: str, target: str) -> dict:
        return {"source_labels": [source], "target_label": target}

    relabel = [
        {"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"},
        {"action": "keep", "source_labels": ["__meta_kubernetes_endpoint_port_name"], "regex": "metrics"},
        copy("__meta_kubernetes_namespace", "namespace"),
        copy("__meta_kubernetes_service_name", "service"),
        copy("__meta_kubernetes_pod_name", "pod"),
        copy("__meta_kubernetes_pod_container_name", "container"),
        {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "job", "replacement": "${1}"},
        {"target_label": "endpoint", "replacement": "metrics"},
    ]
    return {
        "job_name": f"serviceMonitor/{namespace}/{name}/0",
        "honor_labels": False,
        "honor_timestamps": True,
        "static_configs": static,
        "relabel_configs": relabel,
    }


@contextlib.contextmanager
def start_prometheus(
    targets: dict[str, list[str]] | list[dict], rule_files: list[Path] = (), interval: str = "1s"
) -> Iterator[str]:
    """Runs prometheus with rule_files loaded; yields its URL. `targets` is {job: ["127.0.0.1:port", ...]}
    (plain static jobs) or a list of whole scrape configs (e.g. operator_scrape_config)."""
    binary = shutil.which("prometheus")
    if binary is None:
        raise FileNotFoundError("prometheus binary not found (scripts/ci_deps.sh installs it)")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="specsplit-prom-") as tmp:
        if isinstance(targets, dict):
            scrape_configs = [
                {"job_name": job, "static_configs": [{"targets": addrs}]} for job, addrs in targets.items()
            ]
        else:
            scrape_configs = list(targets)
        config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": [str(Path(p).resolve()) for p in rule_files],
            "scrape_configs": scrape_configs,
        }
        config_path = Path(tmp) / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config))
        log = open(Path(tmp) / "prometheus.log", "w")
        proc = subprocess.Popen(
            [binary, f"--config.file={config_path}", f"--storage.tsdb.path={tmp}/data",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        base_url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(base_url, proc, Path(tmp) / "prometheus.log")
            yield base_url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()


def wait_ready(base_url: str, proc: subprocess.Popen, log_path: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prometheus exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(base_url + "/-/ready", timeout=1) as r:
                if r.status == 200:
                    return
        time.sleep(0.2)
    raise TimeoutError(f"prometheus not ready after {timeout}s:\n{log_path.read_text()[-3000:]}")


def query(base_url: str, expr: str, at: float | None = None) -> list[dict]:
    """Instant query (at unix time `at`, default now); returns the API's result vector
    ([{'metric': {...}, 'value': [ts, 'str']}, ...])."""
    params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
    url = f"{base_url}/api/v1/query?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise RuntimeError(f"query {expr!r} failed: {body}")
    return body["data"]["result"]


def wait_for_value(base_url: str, expr: str, timeout: float = 90.0) -> float:
    """Polls until `expr` returns one finite sample; returns its value."""
    deadline = time.monotonic() + timeout
    last: list[dict] = []
    while time.monotonic() < deadline:
        last = query(base_url, expr)
        if len(last) == 1 and last[0]["value"][1] not in ("NaN", "+Inf", "-Inf"):
            return float(last[0]["value"][1])
        time.sleep(0.5)
    raise TimeoutError(f"{expr!r} gave no single finite value in {timeout}s; last result {last}")


def values(base_url: str, expr: str, at: float | None = None) -> dict[frozenset, float]:
    """Instant query as {frozenset(label items): value}."""
    return {frozenset(r["metric"].items()): float(r["value"][1]) for r in query(base_url, expr, at)}


def wait_until_scraped(base_url: str, expected: dict[str, float], timeout: float = 30.0) -> float:
    """Polls until every `expr` in `expected` evaluates to exactly its value (a scrape taken after
    the caller's own scrape has landed); returns the evaluation time of the last poll."""
    deadline = time.monotonic() + timeout
    got: dict[str, list[dict]] = {}
    while time.monotonic() < deadline:
        got = {expr: query(base_url, expr) for expr in expected}
        if all(len(r) == 1 and float(r[0]["value"][1]) == want for (expr, want), r in
               zip(expected.items(), got.values(), strict=True)):  # fmt: skip
            return max(float(r[0]["value"][0]) for r in got.values())
        time.sleep(0.2)
    raise TimeoutError(f"prometheus never showed {expected} in {timeout}s; last {got}")
