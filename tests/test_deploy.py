"""deploy/ validation: generated files fresh, promtool rules, kustomize overlays, schema, lint, checkov."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from tools import need

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
VENV_BIN = ROOT / ".venv" / "bin"
K8S_VERSION = "1.32.0"  # the oldest version we support: native gRPC probes GA, preStop sleep on by default
OVERLAYS = ("cpu-dev", "gpu")


def run(*cmd: str) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, f"{' '.join(cmd)} failed:\n{result.stdout}\n{result.stderr}"
    return result


def test_generated_files_are_fresh():
    run(str(VENV_BIN / "python"), "deploy/generate.py", "--check")


def test_promtool_checks_and_unit_tests_rules():
    promtool = need("promtool")
    rules = [str(DEPLOY / "prometheus" / f) for f in ("recording.rules.yaml", "alerts.rules.yaml")]
    run(promtool, "check", "rules", *rules)
    out = run(promtool, "test", "rules", str(DEPLOY / "prometheus" / "rules.test.yaml")).stdout
    assert "SUCCESS" in out


def test_every_alert_has_severity_and_a_runbook_section():
    runbook = (ROOT / "docs" / "runbook.md").read_text()
    anchors = {
        re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-")
        for h in re.findall(r"^#+ (.+)$", runbook, re.M)
    }
    alerts = [r for g in yaml.safe_load((DEPLOY / "prometheus/alerts.rules.yaml").read_text())["groups"]
              for r in g["rules"]]  # fmt: skip
    assert len(alerts) >= 6
    for alert in alerts:
        assert alert["labels"]["severity"] in ("critical", "warning"), alert["alert"]
        url = alert["annotations"]["runbook_url"]
        assert url.startswith("docs/runbook.md#") and url.split("#")[1] in anchors, (alert["alert"], url)


def render(overlay: str) -> list[dict]:
    kubectl = need("kubectl")
    text = run(kubectl, "kustomize", f"deploy/kubernetes/overlays/{overlay}").stdout
    return [d for d in yaml.safe_load_all(text) if d]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates_strict(overlay, tmp_path):
    validate = need("kubernetes-validate", VENV_BIN / "kubernetes-validate")
    docs = render(overlay)
    rendered = tmp_path / f"{overlay}.yaml"
    rendered.write_text(yaml.safe_dump_all(docs))
    out = run(validate, "-k", K8S_VERSION, "--strict", "--quiet", str(rendered))
    # CRDs (ServiceMonitor, PrometheusRule) have no built-in schema: the only warnings allowed.
    for line in (out.stdout + out.stderr).splitlines():
        assert "monitoring.coreos.com" in line, line
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget", "ServiceMonitor", "PrometheusRule",
            "NetworkPolicy"} <= kinds  # fmt: skip


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_are_restricted_probed_and_drain_in_time(overlay):
    docs = render(overlay)
    configs = {d["metadata"]["name"].rsplit("-", 1)[0]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    assert {d["metadata"]["name"] for d in deployments} == {"specsplit-draft", "specsplit-target"}
    for dep in deployments:
        pod = dep["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        sc = container["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == container["ports"][0]["containerPort"]
        config = configs[dep["metadata"]["name"] + "-config"]
        drain = int(config["SPECSPLIT_DRAIN_TIMEOUT"])
        pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + 5
        shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"]["medium"] == "Memory"
        gpus = container["resources"]["limits"].get("nvidia.com/gpu")
        if overlay == "gpu":
            assert int(gpus) == int(config["SPECSPLIT_TP_SIZE"]), "one GPU per TP rank"
        else:
            assert gpus is None and config["SPECSPLIT_DEVICE"] == "cpu"
    dashboard = next(
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "specsplit-dashboard"
    )
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    services = [d for d in docs if d["kind"] == "Service"]
    assert all(s["spec"]["clusterIP"] == "None" for s in services)


def test_yamllint_clean():
    yamllint = need("yamllint", VENV_BIN / "yamllint")
    run(yamllint, "--strict", "-c", "deploy/.yamllint", "deploy/")


def test_checkov_passes_on_rendered_overlays_and_dockerfiles(tmp_path):
    checkov = need("checkov", ROOT / ".venv" / "checkov" / "bin" / "checkov")
    files = []
    for overlay in OVERLAYS:
        path = tmp_path / f"{overlay}.yaml"
        path.write_text(yaml.safe_dump_all(render(overlay)))
        files += ["-f", str(path)]
    env = dict(os.environ, BC_SKIP_MAPPING="TRUE")  # offline: no guideline download
    for args in (["--framework", "kubernetes", *files], ["--framework", "dockerfile", "-d", "deploy/docker"]):
        result = subprocess.run([checkov, "--config-file", "deploy/.checkov.yaml", *args],
                                capture_output=True, text=True, cwd=ROOT, env=env)  # fmt: skip
        assert result.returncode == 0, result.stdout[-4000:]
        assert "Failed checks: 0" in result.stdout and "Passed checks:" in result.stdout, result.stdout[
            -2000:
        ]
