"""deploy/ validation: generated files fresh, promtool rules, kustomize overlays, schema, lint, checkov.

CRDs: kubernetes-validate has schemas for built-in kinds only. ScaledObjects (KEDA) are validated with
the strict hand-written schema in deploy/schemas plus their HPA behavior as an autoscaling/v2
HorizontalPodAutoscaler's; PrometheusRule/ServiceMonitor content is checked by promtool and the live
Prometheus test; cert-manager objects by the TLS assertions below. Those kinds are the only ones whose
"no schema" warnings are allowed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tools import need

from common.metrics import SERVER_ERROR_CODES

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
VENV_BIN = ROOT / ".venv" / "bin"
K8S_VERSION = "1.32.0"  # the oldest version we support: native gRPC probes GA, preStop sleep on by default
OVERLAYS = ("cpu-dev", "gpu", "gpu-production", "gpu-single")
RUNBOOK_URL = "https://github.com/specsplit/specsplit/blob/main/docs/runbook.md#"
CRD_GROUPS = ("monitoring.coreos.com", "keda.sh", "cert-manager.io")
SCHEMAS = DEPLOY / "schemas"


def run(*cmd: str) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, f"{' '.join(cmd)} failed:\n{result.stdout}\n{result.stderr}"
    return result


def test_generated_files_are_fresh():
    run(sys.executable, "deploy/generate.py", "--check")


def test_promtool_checks_and_unit_tests_rules():
    promtool = need("promtool")
    rules = [str(p) for p in sorted((DEPLOY / "prometheus").glob("*.rules.yaml"))]
    assert len(rules) == 4, rules  # recording, alerts, thresholds per overlay
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
        assert url.startswith(RUNBOOK_URL) and url.split("#")[1] in anchors, (alert["alert"], url)


def test_every_alert_has_promtool_cases_firing_and_quiet():
    groups = yaml.safe_load((DEPLOY / "prometheus/alerts.rules.yaml").read_text())["groups"]
    alerts = {r["alert"] for g in groups for r in g["rules"]}
    cases = [c for t in yaml.safe_load((DEPLOY / "prometheus/rules.test.yaml").read_text())["tests"]
             for c in t.get("alert_rule_test", [])]  # fmt: skip
    firing = {c["alertname"] for c in cases if c["exp_alerts"]}
    quiet = {c["alertname"] for c in cases if not c["exp_alerts"]}
    assert alerts <= firing and alerts <= quiet, (alerts - firing, alerts - quiet)


def test_thresholds_cover_every_overlay_and_every_threshold_an_alert_reads():
    gen = generator()
    alerts_text = (DEPLOY / "prometheus/alerts.rules.yaml").read_text()
    read = set(re.findall(r'threshold="(\w+)"', alerts_text))
    assert set(gen.THRESHOLDS) == {"cpu-dev", "gpu"}  # gpu-production inherits gpu's
    for overlay, values in gen.THRESHOLDS.items():
        assert set(values) == read, overlay
    # Served TPOT (the alert fires at twice it): GPU decoding is 1-5 ms per token, the CPU demo 20-100 ms.
    assert (
        gen.THRESHOLDS["gpu"]["served_tpot_seconds"]
        <= 0.01
        < gen.THRESHOLDS["cpu-dev"]["served_tpot_seconds"]
    )


def test_error_ratio_rule_counts_exactly_the_server_error_codes():
    text = (DEPLOY / "prometheus/recording.rules.yaml").read_text()
    (codes,) = re.findall(r'code=~"([^"]+)"', text)
    assert codes.split("|") == list(SERVER_ERROR_CODES)


def generator():
    spec = importlib.util.spec_from_file_location("deploy_generate", DEPLOY / "generate.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    return gen


def render(overlay: str) -> list[dict]:
    kubectl = need("kubectl")
    text = run(kubectl, "kustomize", f"deploy/kubernetes/overlays/{overlay}").stdout
    return [d for d in yaml.safe_load_all(text) if d]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates_strict(overlay, tmp_path):
    validate = need("kubernetes-validate", VENV_BIN / "kubernetes-validate")
    import jsonschema  # a kubernetes-validate dependency (requirements-deploy.txt)

    docs = render(overlay)
    rendered = tmp_path / f"{overlay}.yaml"
    rendered.write_text(yaml.safe_dump_all(docs))
    out = run(validate, "-k", K8S_VERSION, "--strict", "--quiet", str(rendered))
    # CRDs have no built-in schema: the only warnings allowed (module docstring: how each is checked).
    for line in (out.stdout + out.stderr).splitlines():
        assert any(group in line for group in CRD_GROUPS), line
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget", "ServiceMonitor", "PrometheusRule",
            "NetworkPolicy"} <= kinds  # fmt: skip
    if overlay == "gpu-production":
        assert {"ScaledObject", "Certificate", "Issuer", "Job"} <= kinds
    # ScaledObjects: the vendored schema, and their HPA behavior as a real HorizontalPodAutoscaler's.
    schema = json.loads((SCHEMAS / "keda.sh_v1alpha1_ScaledObject.json").read_text())
    hpas = []
    for obj in (d for d in docs if d["kind"] == "ScaledObject"):
        jsonschema.validate(obj, schema)
        hpas.append({
            "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": obj["metadata"]["name"]},
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                                        "name": obj["spec"]["scaleTargetRef"]["name"]},
                     "minReplicas": max(1, obj["spec"]["minReplicaCount"]),
                     "maxReplicas": obj["spec"]["maxReplicaCount"],
                     "behavior": obj["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]},
        })  # fmt: skip
    if hpas:
        (tmp_path / "hpa.yaml").write_text(yaml.safe_dump_all(hpas))
        run(validate, "-k", K8S_VERSION, "--strict", "--quiet", str(tmp_path / "hpa.yaml"))


def replica_counts(docs: list[dict]) -> list[dict[str, int]]:
    """{deployment: replicas}: the manifests' counts, or KEDA's min and max where ScaledObjects own them."""
    scaled = {d["spec"]["scaleTargetRef"]["name"]: d["spec"] for d in docs if d["kind"] == "ScaledObject"}
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    if not scaled:
        return [{d["metadata"]["name"]: d["spec"]["replicas"] for d in deployments}]
    return [
        {name: spec[key] for name, spec in scaled.items()} for key in ("minReplicaCount", "maxReplicaCount")
    ]


def configs_of(docs: list[dict]) -> dict[str, dict]:
    """{"specsplit-target": env, ...} from the rendered ConfigMaps (generator hash suffix dropped)."""
    return {d["metadata"]["name"].rsplit("-", 1)[0]: d["data"] for d in docs if d["kind"] == "ConfigMap"}


def env_of(container: dict, name: str) -> dict:
    return next(e for e in container.get("env", []) if e["name"] == name)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_are_restricted_probed_and_drain_in_time(overlay):
    docs = render(overlay)
    configs = configs_of(docs)
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    # gpu-single runs the draft inside the target (--draft-local): no draft Deployment.
    single = overlay == "gpu-single"
    names = {"specsplit-target"} if single else {"specsplit-draft", "specsplit-target"}
    assert {d["metadata"]["name"] for d in deployments} == names
    for dep in deployments:
        name = dep["metadata"]["name"]
        pod = dep["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        config = configs[name + "-config"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        for c in [container, *pod.get("initContainers", [])]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
            assert c["imagePullPolicy"] == "IfNotPresent", c["name"]  # local tags; releases pin digests
        # Probes: the plaintext health port (works under TLS), with timeouts above the 1 s default.
        health_port = int(config["SPECSPLIT_HEALTH_PORT"])
        assert health_port != int(config["SPECSPLIT_PORT"])
        assert {"containerPort": health_port, "name": "health"} in container["ports"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == health_port, probe
            assert container[probe]["timeoutSeconds"] >= 3, probe
        startup = container["startupProbe"]
        startup_budget = startup["periodSeconds"] * startup["failureThreshold"]
        # A rollout fails only after a pod could no longer have become ready, with room for pull/schedule.
        assert dep["spec"]["progressDeadlineSeconds"] >= startup_budget + 300
        drain = int(config["SPECSPLIT_DRAIN_TIMEOUT"])
        pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + 5
        shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"]["medium"] == "Memory"
        # OpenMP threads from the CPU limit, not the host's cores.
        omp = env_of(container, "OMP_NUM_THREADS")["valueFrom"]["resourceFieldRef"]
        assert omp == {"containerName": container["name"], "resource": "limits.cpu", "divisor": "1"}
        # The recommended labels reach the pods (kubectl -l app.kubernetes.io/part-of=specsplit).
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert labels["app.kubernetes.io/part-of"] == "specsplit" and labels["app.kubernetes.io/name"] == name
        gpus = container["resources"]["limits"].get("nvidia.com/gpu")
        if overlay.startswith("gpu"):
            assert int(gpus) == int(config["SPECSPLIT_TP_SIZE"]), "one GPU per TP rank"
        else:
            assert gpus is None and config["SPECSPLIT_DEVICE"] == "cpu"
    target = next(d for d in deployments if d["metadata"]["name"] == "specsplit-target")
    target_batch = int(configs["specsplit-target-config"]["SPECSPLIT_MAX_BATCH_SIZE"])
    if single:  # each target's own draft has a slot per request it batches
        local = configs["specsplit-target-config"]["SPECSPLIT_DRAFT_LOCAL"].split()
        assert int(local[local.index("--max-batch-size") + 1]) >= target_batch
    else:
        (affinity,) = target["spec"]["template"]["spec"]["affinity"]["podAffinity"][
            "preferredDuringSchedulingIgnoredDuringExecution"
        ]
        term = affinity["podAffinityTerm"]
        assert term["labelSelector"]["matchLabels"] == {"app.kubernetes.io/name": "specsplit-draft"}
        assert term["topologyKey"] == "kubernetes.io/hostname"
        # Every request a target batches can hold a draft slot, also with every target busy at once (at
        # the fixed replica counts, or at both ends of the autoscaled range).
        draft_slots = int(configs["specsplit-draft-config"]["SPECSPLIT_MAX_BATCH_SIZE"])
        assert draft_slots >= target_batch
        for replicas in replica_counts(docs):
            assert draft_slots * replicas["specsplit-draft"] >= target_batch * replicas["specsplit-target"]
    dashboard = next(
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "specsplit-dashboard"
    )
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    services = [d for d in docs if d["kind"] == "Service"]
    assert all(s["spec"]["clusterIP"] == "None" for s in services)
    # This install's alert thresholds, recorded for its own namespace.
    namespace = target["metadata"]["namespace"]
    (thresholds,) = [d for d in docs if d["metadata"]["name"] == "specsplit-alert-thresholds"]
    rules = thresholds["spec"]["groups"][0]["rules"]
    assert rules and all(r["labels"]["namespace"] == namespace for r in rules)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rollout_scaling_and_disruption(overlay):
    """KEDA alone sets replicas where it scales; each overlay names its rollout strategy and says why; the
    target spreads over nodes; a drain keeps a target serving wherever there are two; scale-up adds
    capacity within minutes."""
    docs = render(overlay)
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    scaled = {d["spec"]["scaleTargetRef"]["name"]: d for d in docs if d["kind"] == "ScaledObject"}
    rollout = (DEPLOY / "kubernetes/overlays" / overlay / "rollout.yaml").read_text()
    assert re.search(r"^# Rollout: \S", rollout, re.M), "the strategy's reason, in a comment"
    for name, dep in deployments.items():
        assert ("replicas" in dep["spec"]) == (name not in scaled), name
        strategy = dep["spec"]["strategy"]
        assert strategy["type"] == "RollingUpdate" and set(strategy["rollingUpdate"]) == {
            "maxSurge", "maxUnavailable"
        }, name  # fmt: skip
    pod = deployments["specsplit-target"]["spec"]["template"]["spec"]
    (spread,) = pod["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname" and spread["maxSkew"] == 1
    assert spread["labelSelector"]["matchLabels"] == {"app.kubernetes.io/name": "specsplit-target"}
    assert spread["whenUnsatisfiable"] == (
        "DoNotSchedule" if overlay == "gpu-production" else "ScheduleAnyway"
    )
    pdbs = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "PodDisruptionBudget"}
    fewest = min(counts["specsplit-target"] for counts in replica_counts(docs))
    if fewest >= 2:  # a drain may only evict a target while another one serves
        assert pdbs["specsplit-target"].get("minAvailable") == 1, pdbs
        assert "maxUnavailable" not in pdbs["specsplit-target"]
    else:
        assert overlay == "cpu-dev", "only the dev install runs a single target"
    for obj in scaled.values():
        up = obj["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleUp"]
        assert up["stabilizationWindowSeconds"] <= 120
        assert any(
            p["type"] == "Pods" and p["value"] >= 2 and p["periodSeconds"] <= 300 for p in up["policies"]
        )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_guaranteed_qos_and_target_grpc_only_from_client_namespaces(overlay):
    docs = render(overlay)
    for doc in (d for d in docs if d["kind"] in ("Deployment", "Job")):
        pod = doc["spec"]["template"]["spec"]
        for c in [*pod["containers"], *pod.get("initContainers", [])]:
            res = c["resources"]
            for kind in ("cpu", "memory"):  # requests == limits in every container: Guaranteed QoS
                assert str(res["requests"][kind]) == str(res["limits"][kind]), (
                    doc["metadata"]["name"],
                    c["name"],
                )
    (policy,) = [
        d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "specsplit-target"
    ]
    client_rules = [r for r in policy["spec"]["ingress"] if {"port": "grpc"} in r.get("ports", [])]
    (rule,) = client_rules
    assert rule["ports"] == [{"port": "grpc"}, {"port": "http"}]
    assert not [
        r for r in policy["spec"]["ingress"] if {"port": "http"} in r.get("ports", []) and r is not rule
    ]
    selectors = rule["from"]
    assert {"namespaceSelector": {"matchLabels": {"specsplit.io/client": "true"}}} in selectors
    # Nothing else but this namespace's own pods (cpu-dev only); never every namespace.
    assert all(s == {"podSelector": {}} for s in selectors[1:]) and (len(selectors) == 1) == (
        overlay != "cpu-dev"
    )


def test_dashboard_legends_variables_and_schema():
    gen = generator()
    board = json.loads(gen.DASHBOARD_PATH.read_text())
    assert board["schemaVersion"] >= 41
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert {"datasource", "namespace", "model", "role", "pod"} <= set(variables)
    for name in ("model", "role", "pod"):  # each narrowed by the namespace picked
        assert "$namespace" in variables[name]["query"], name
    panels = list(board["panels"])
    for panel in list(panels):
        panels.extend(panel.get("panels", []))
    graphs = [p for p in panels if p["type"] != "row"]
    assert len(graphs) >= 27
    for panel in graphs:
        legend = panel["options"]["legend"]
        assert legend["showLegend"] is True and legend["displayMode"] == "table", panel["title"]
        assert {"lastNotNull", "mean"} <= set(legend["calcs"]), panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            for var in ("$namespace", "$pod", "$model"):
                assert target["expr"].count(var) == target["expr"].count("{"), (
                    panel["title"],
                    var,
                    target["expr"],
                )
    (tokens,) = [p for p in graphs if p["title"] == "Drafted and accepted tokens/s"]
    exprs = [t["expr"] for t in tokens["targets"]]
    assert len(exprs) == 2 and "rate(specsplit_spec_draft_tokens_total{" in exprs[0]
    assert "rate(specsplit_spec_accepted_tokens_total{" in exprs[1] and "/" not in " ".join(exprs)


def test_production_overlay_tls_probes_models_and_autoscaling():
    docs = render("gpu-production")
    configs = configs_of(docs)
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    namespace = deployments["specsplit-target"]["metadata"]["namespace"]
    # TLS: one cert-manager Secret mounted into both services; the target verifies the draft with it
    # (mTLS), the draft requires client certificates; probes stay on the plaintext health port.
    cert = next(d for d in docs if d["kind"] == "Certificate" and d["metadata"]["name"] == "specsplit-tls")
    target_cfg, draft_cfg = configs["specsplit-target-config"], configs["specsplit-draft-config"]
    assert target_cfg["SPECSPLIT_DRAFT_TLS_SERVER_NAME"] in cert["spec"]["dnsNames"]
    assert {"server auth", "client auth"} <= set(cert["spec"]["usages"])
    for name, dep in deployments.items():
        pod = dep["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        volume = next(v for v in pod["volumes"] if v["name"] == "tls")
        assert volume["secret"]["secretName"] == cert["spec"]["secretName"]
        mount = next(m for m in container["volumeMounts"] if m["name"] == "tls")
        assert "subPath" not in mount, "a subPath mount never sees a renewed certificate"
        config = configs[name + "-config"]
        tls_files = [v for k, v in config.items() if "TLS" in k and k != "SPECSPLIT_DRAFT_TLS_SERVER_NAME"]
        assert tls_files and all(f.startswith(mount["mountPath"] + "/") for f in tls_files), name
        assert config["SPECSPLIT_TLS_CERT"] and config["SPECSPLIT_TLS_KEY"]
        assert container["readinessProbe"]["grpc"]["port"] != int(config["SPECSPLIT_PORT"])
    assert draft_cfg["SPECSPLIT_TLS_CLIENT_CA"] and target_cfg["SPECSPLIT_DRAFT_TLS_CA"]
    assert target_cfg["SPECSPLIT_DRAFT_TLS_CERT"] and target_cfg["SPECSPLIT_DRAFT_TLS_KEY"]
    # Models: a Job downloads pinned revisions with an optional token from a Secret; each pod waits for
    # its checkpoint; the served names are the repos.
    source = configs["specsplit-model-source"]
    job = next(d for d in docs if d["kind"] == "Job")
    (download,) = job["spec"]["template"]["spec"]["containers"]
    # The token as a file from an optional Secret (public repos need none), not an env var.
    token_dir = os.path.dirname(env_of(download, "HF_TOKEN_PATH")["value"])
    mount = next(m for m in download["volumeMounts"] if m["mountPath"] == token_dir)
    volume = next(v for v in job["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    assert volume["secret"] == {"secretName": "specsplit-hf-token", "optional": True, "defaultMode": 0o440}
    for role in ("target", "draft"):
        assert (
            configs[f"specsplit-{role}-config"]["SPECSPLIT_SERVED_MODEL_NAME"]
            == source[f"{role.upper()}_REPO"]
        )
        (wait,) = deployments[f"specsplit-{role}"]["spec"]["template"]["spec"]["initContainers"]
        ref = env_of(wait, "REVISION")["valueFrom"]["configMapKeyRef"]
        assert ref["key"] == f"{role.upper()}_REVISION" and ref["name"].startswith("specsplit-model-source")
        assert f"/models/{role}/" in wait["command"][-1]
    pvc = next(d for d in docs if d["kind"] == "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    # Autoscaling: KEDA on this namespace's series; scale-down slower than a model load.
    scaled = {d["spec"]["scaleTargetRef"]["name"]: d for d in docs if d["kind"] == "ScaledObject"}
    assert set(scaled) == set(deployments)
    for name, obj in scaled.items():
        startup = deployments[name]["spec"]["template"]["spec"]["containers"][0]["startupProbe"]
        load = startup["periodSeconds"] * startup["failureThreshold"]
        behavior = obj["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        assert behavior["scaleDown"]["stabilizationWindowSeconds"] > load
        assert obj["spec"]["cooldownPeriod"] > load and obj["spec"]["minReplicaCount"] >= 1
        for trigger in obj["spec"]["triggers"]:
            assert f"namespace='{namespace}'" in trigger["metadata"]["query"], trigger
    target_metrics = " ".join(t["metadata"]["query"] for t in scaled["specsplit-target"]["spec"]["triggers"])
    assert "specsplit_(running|waiting)_requests" in target_metrics
    assert "time_per_output_token" in target_metrics
    (draft_trigger,) = scaled["specsplit-draft"]["spec"]["triggers"]
    assert "kv_slots_used" in draft_trigger["metadata"]["query"]


def test_single_gpu_overlay_runs_the_draft_in_the_target(monkeypatch):
    """gpu-single: the target's own env parses to a target with --draft-local and no draft address (TP 1
    on one GPU), the draft's flags to a draft on the PVC whose metrics port the pod, its Service, the
    ServiceMonitor and the NetworkPolicy all expose; none of the draft service's objects remain."""
    from common.settings import parse_config
    from target_service.config import TargetConfig
    from target_service.draft_local import local_draft_config

    docs = render("gpu-single")
    env = configs_of(docs)["specsplit-target-config"]
    for name in [n for n in os.environ if n.startswith("SPECSPLIT_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    target = parse_config(TargetConfig, [], "target_service")
    assert target.draft_address == "" and target.draft_local and target.tp_size == 1
    draft = local_draft_config(target)
    assert draft.model == "/models/draft" and draft.device == target.device and draft.dtype == target.dtype
    assert draft.max_batch_size >= target.max_batch_size
    assert not [d for d in docs if "specsplit-draft" in d["metadata"]["name"]]
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    assert {"containerPort": draft.metrics_port, "name": "draft-metrics"} in container["ports"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    (service,) = [d for d in docs if d["kind"] == "Service"]
    assert {"name": "draft-metrics", "port": draft.metrics_port, "targetPort": "draft-metrics"} in service[
        "spec"
    ]["ports"]
    (monitor,) = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert {e["port"] for e in monitor["spec"]["endpoints"]} == {"metrics", "draft-metrics"}
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert {"port": "draft-metrics"} in policy["spec"]["ingress"][0]["ports"]


def test_model_download_refuses_a_revision_that_can_move(tmp_path):
    script = DEPLOY / "kubernetes/components/model-download/download.py"
    env = {"TARGET_REPO": "Qwen/Qwen3-8B", "TARGET_REVISION": "main", "DRAFT_REPO": "Qwen/Qwen3-0.6B",
           "DRAFT_REVISION": "0" * 40, "MODELS_DIR": str(tmp_path)}  # fmt: skip
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env)
    assert result.returncode == 1 and "TARGET_REVISION: must be a 40-hex commit SHA" in result.stderr
    assert not list(tmp_path.iterdir())  # nothing downloaded, nothing marked


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
