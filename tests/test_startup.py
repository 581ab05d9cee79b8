"""Start-up order: /metrics, the gRPC port and health answer before the model has loaded.

A sitecustomize hook in the draft's process holds its read of config.json (the first step of
loading) until the test creates a gate file: meanwhile health must say NOT_SERVING (on the TLS port and
on the plaintext health port that kubelet probes use under TLS), every RPC UNAVAILABLE, and /metrics
must serve `specsplit_ready 0` under the --served-model-name label. Opening the gate lets loading
finish: SERVING, ready 1, real answers. The hook delays; the service's own code does everything else.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from specsplit import AsyncClient, Client, DeadlineExceededError, UnavailableError
from specsplit.launch import REPO, free_port, start_service
from specsplit.v1 import draft_pb2, draft_pb2_grpc, target_pb2_grpc
from tests.conftest_sdk import make_certificates
from tests.service_util import request, wait_for

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def ready_gauge(metrics_port: int) -> dict[str, float]:
    """{model label: value} of specsplit_ready from a direct scrape."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {
        s.labels["model"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "specsplit_ready"
    }


def health(channel: grpc.Channel) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def draft_info(channel: grpc.Channel) -> draft_pb2.GetDraftInfoResponse:
    return draft_pb2_grpc.DraftServiceStub(channel).GetDraftInfo(draft_pb2.GetDraftInfoRequest(), timeout=5)


LOAD_GATE_HOOK = """
import json, os, time
_gate, _load = os.environ["SPECSPLIT_TEST_LOAD_GATE"], json.load
def _gated_load(fp, *args, **kwargs):
    if str(getattr(fp, "name", "")).endswith("config.json"):
        while not os.path.exists(_gate):
            time.sleep(0.05)
    return _load(fp, *args, **kwargs)
json.load = _gated_load
"""


def test_health_and_metrics_answer_while_the_model_loads(demo_models, tmp_path):
    hook, gate = tmp_path / "hook", tmp_path / "gate"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(LOAD_GATE_HOOK)
    path = os.pathsep.join([str(hook), str(REPO), os.environ.get("PYTHONPATH", "")])
    env = {"SPECSPLIT_TEST_LOAD_GATE": str(gate), "PYTHONPATH": path}
    (tmp_path / "certs").mkdir()
    certs = make_certificates(tmp_path / "certs")
    health_port = free_port()
    tls = ["--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key)]
    args = ["--model", str(demo_models.draft), *tls, "--health-port", str(health_port),
            "--served-model-name", "my-draft"]  # fmt: skip
    draft = start_service("draft_service", args, tmp_path / "draft.log", env=env)
    creds = grpc.ssl_channel_credentials(root_certificates=certs.ca.read_bytes())
    try:
        wait_for(lambda: "listening:" in draft.log_text(), 120, "the service to listen")
        time.sleep(0.5)  # still blocked on the pipe: nothing has been written to it
        assert "SPECSPLIT_READY" not in draft.log_text()
        with grpc.insecure_channel(f"127.0.0.1:{health_port}") as plain, \
                grpc.secure_channel(draft.address, creds) as secure:  # fmt: skip
            assert health(plain) == NOT_SERVING
            assert health(secure) == NOT_SERVING
            with pytest.raises(grpc.RpcError) as err:
                draft_pb2_grpc.DraftServiceStub(secure).GetDraftInfo(
                    draft_pb2.GetDraftInfoRequest(), timeout=5
                )
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "loading" in err.value.details()
            assert ready_gauge(draft.metrics_port) == {"my-draft": 0.0}

            gate.touch()
            draft.wait_ready()
            assert health(plain) == SERVING and health(secure) == SERVING
            info = draft_pb2_grpc.DraftServiceStub(secure).GetDraftInfo(
                draft_pb2.GetDraftInfoRequest(), timeout=5
            )
            assert info.model == "my-draft" and info.vocab_size > 0
            assert ready_gauge(draft.metrics_port) == {"my-draft": 1.0}
            # Ready means the start-up heap is out of the garbage collector's reach (gc.freeze).
            frozen = re.search(r"start-up heap frozen: (\d+) objects", draft.log_text())
            assert frozen and int(frozen.group(1)) > 10_000, draft.log_text()[-2000:]
        # The plaintext health port speaks nothing but health.
        with grpc.insecure_channel(f"127.0.0.1:{health_port}") as plain:
            with pytest.raises(grpc.RpcError) as err:
                draft_pb2_grpc.DraftServiceStub(plain).GetDraftInfo(
                    draft_pb2.GetDraftInfoRequest(), timeout=5
                )
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert draft.stop() == 0 and "leaked" not in draft.log_text(), draft.log_text()[-2000:]
    finally:
        gate.touch()
        draft.stop()


def test_target_port_health_and_metrics_answer_while_the_model_loads(demo_models, tmp_path):
    """The target: its gRPC port (health NOT_SERVING, Generate UNAVAILABLE naming the load), its plaintext
    health port and /metrics (`specsplit_ready 0`) answer during the load; then SERVING and real answers.
    The SDK's wait_ready() and `specsplit health --wait` return once it is SERVING."""
    hook, gate = tmp_path / "hook", tmp_path / "gate"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(LOAD_GATE_HOOK)
    path = os.pathsep.join([str(hook), str(REPO), os.environ.get("PYTHONPATH", "")])
    env = {"SPECSPLIT_TEST_LOAD_GATE": str(gate), "PYTHONPATH": path}
    health_port = free_port()
    args = ["--model", str(demo_models.target), "--health-port", str(health_port),
            "--served-model-name", "my-target", "--verify-backend", "torch", "--http-port", "0"]  # fmt: skip
    target = start_service("target_service", args, tmp_path / "target.log", env=env)
    try:
        wait_for(lambda: "loading target model" in target.log_text(), 120, "the load to start")
        wait_for(lambda: _answers(target.metrics_port), 30, "/metrics during the load")
        assert "SPECSPLIT_READY" not in target.log_text()
        assert ready_gauge(target.metrics_port) == {"my-target": 0.0}
        # The HTTP API is up too: 503 in OpenAI's error shape, naming the load.
        http_port = re.search(r"SPECSPLIT_HTTP port=(\d+)", target.log_text()).group(1)
        http = f"http://127.0.0.1:{http_port}"
        assert http_status(http + "/health") == (503, {"status": "NOT_SERVING"})
        body = {"model": "my-target", "prompt": "hi", "max_tokens": 2}
        status, error = http_status(http + "/v1/completions", body)
        assert status == 503 and "model is loading" in error["error"]["message"], error
        with grpc.insecure_channel(f"127.0.0.1:{health_port}") as plain, \
                grpc.insecure_channel(target.address) as main:  # fmt: skip
            assert health(plain) == NOT_SERVING
            assert health(main) == NOT_SERVING
            with pytest.raises(grpc.RpcError) as err:
                list(target_pb2_grpc.TargetServiceStub(main).Generate(request([1, 2, 3]), timeout=5))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
            assert "model is loading" in err.value.details(), err.value.details()
            with Client(target.address) as client:
                with pytest.raises(UnavailableError, match="model is loading"):
                    client.generate([1, 2, 3], max_new_tokens=2)
                with pytest.raises(DeadlineExceededError, match="NOT_SERVING"):
                    client.wait_ready(timeout=0.3)
            health_cli = [sys.executable, "-m", "specsplit.cli", "health", "--target", target.address]
            waited = subprocess.run([*health_cli, "--wait", "0.3"], capture_output=True, text=True, cwd=REPO,
                                    timeout=60)  # fmt: skip
            assert waited.returncode == 3 and "NOT_SERVING" in waited.stdout, waited
            cli = subprocess.Popen([*health_cli, "--wait", "120"], stdout=subprocess.PIPE, text=True,
                                   cwd=REPO)  # fmt: skip
            gate.touch()
            with Client(target.address) as client:
                client.wait_ready(timeout=120)
                assert client.generate([1, 2, 3], max_new_tokens=2).usage.output_tokens == 2
            asyncio.run(_async_wait_ready(target.address))
            assert cli.wait(60) == 0 and cli.stdout is not None and cli.stdout.read() == "SERVING\n"
            assert "SPECSPLIT_READY" in target.log_text()
            assert health(plain) == SERVING and health(main) == SERVING
        assert ready_gauge(target.metrics_port) == {"my-target": 1.0}
        assert http_status(http + "/health") == (200, {"status": "SERVING"})
        status, completion = http_status(http + "/v1/completions", body)
        assert status == 200 and completion["usage"]["completion_tokens"] >= 1, completion
        # The target's heap is frozen too (its front is the asyncio one, common/aio_front.py).
        frozen = re.search(r"start-up heap frozen: (\d+) objects", target.log_text())
        assert frozen and int(frozen.group(1)) > 10_000, target.log_text()[-2000:]
        # A clean shutdown: nothing reported "leaked" (frozen start-up objects are released first).
        assert target.stop() == 0 and "leaked" not in target.log_text(), target.log_text()[-2000:]
        # Loading shows its progress in the log (common/loader.py).
        log_text = target.log_text()
        assert re.search(r"load(ing|ed) \S+: (\d+/)?\d+ tensors", log_text), log_text[-2000:]
    finally:
        gate.touch()
        target.stop()


async def _async_wait_ready(address: str) -> None:
    async with AsyncClient(address) as client:
        await client.wait_ready(timeout=60)


def http_status(url: str, body: dict | None = None) -> tuple[int, dict]:
    """(HTTP status, JSON body) of a GET, or of a POST of `body`."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def _answers(metrics_port: int) -> bool:
    try:
        ready_gauge(metrics_port)
        return True
    except OSError:
        return False
