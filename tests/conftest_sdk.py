"""Real services on loopback for the SDK and CLI tests: a tiny checkpoint, one draft service, and target
services (plain; mTLS + bearer token + a one-request queue), plus a TCP proxy that can refuse the first
connection (a server coming up late) or sever every connection (a server dying mid-stream)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from specsplit import Client, SpecSplitError, TLSConfig

REPO = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 120.0
AUTH_TOKEN = "sdk-test-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Service:
    name: str
    process: subprocess.Popen[bytes]
    port: int
    metrics_port: int
    log: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels` (0 when absent)."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
        )

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _spawn(name: str, args: list[str], log_dir: Path, port: int, metrics_port: int) -> Service:
    log = log_dir / f"{name}.log"
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, *args], cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env
        )
    return Service(name, process, port, metrics_port, log)


def wait_serving(service: Service, tls: TLSConfig | None = None) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    with Client(service.address, tls=tls, retry=None, timeout=2.0) as client:
        while time.monotonic() < deadline:
            if service.process.poll() is not None:
                raise RuntimeError(
                    f"{service.name} exited ({service.process.returncode}):\n{service.log.read_text()}"
                )
            try:
                if client.health("") == "SERVING":
                    return
            except SpecSplitError:
                pass
            time.sleep(0.2)
    service.stop()
    raise RuntimeError(f"{service.name} not SERVING after {STARTUP_TIMEOUT_S} s:\n{service.log.read_text()}")


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@dataclass
class Certificates:
    """A self-signed CA, a server certificate for localhost/127.0.0.1 and a client certificate."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def client_tls(self, with_client_cert: bool = True) -> TLSConfig:
        if with_client_cert:
            return TLSConfig.from_files(self.ca, self.client_cert, self.client_key)
        return TLSConfig.from_files(self.ca)


def make_certificates(directory: Path) -> Certificates:
    d = directory
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=specsplit-test-ca",
        "-keyout",
        str(d / "ca.key"),
        "-out",
        str(d / "ca.pem"),
    )
    for who, san in (("server", "DNS:localhost,IP:127.0.0.1"), ("client", "DNS:sdk-test-client")):
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            f"/CN={who}",
            "-keyout",
            str(d / f"{who}.key"),
            "-out",
            str(d / f"{who}.csr"),
        )
        (d / f"{who}.ext").write_text(f"subjectAltName={san}\n")
        _openssl(
            "x509",
            "-req",
            "-in",
            str(d / f"{who}.csr"),
            "-CA",
            str(d / "ca.pem"),
            "-CAkey",
            str(d / "ca.key"),
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            str(d / f"{who}.ext"),
            "-out",
            str(d / f"{who}.pem"),
        )
    return Certificates(d / "ca.pem", d / "server.pem", d / "server.key", d / "client.pem", d / "client.key")


@dataclass
class Stack:
    model: Path
    draft: Service
    target: Service
    secure_target: Service
    certs: Certificates
    auth_token_file: Path


@pytest.fixture(scope="session")
def sdk_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Services shared by tests/test_sdk*.py and tests/test_cli*.py (multi-process)."""
    root = tmp_path_factory.mktemp("sdk-stack")
    model = root / "tiny"
    # A draft of other weights than the target's, so that drafts really get rejected.
    draft_model = root / "tiny-draft"
    for path, seed in ((model, "0"), (draft_model, "1")):
        subprocess.run([sys.executable, "-m", "common.tiny", str(path), "--seed", seed], cwd=REPO, check=True)
    certs = make_certificates(root)
    token_file = root / "token"
    token_file.write_text(AUTH_TOKEN + "\n")

    draft_port, target_port, secure_port = free_port(), free_port(), free_port()
    draft = _spawn(
        "draft",
        [
            "-m",
            "draft_service",
            "--model",
            str(draft_model),
            "--port",
            str(draft_port),
            "--metrics-port",
            "0",
            "--device",
            "cpu",
        ],
        root,
        draft_port,
        0,
    )
    target_args = [
        "-m",
        "target_service",
        "--model",
        str(model),
        "--draft-address",
        f"127.0.0.1:{draft_port}",
    ]
    target_metrics, secure_metrics = free_port(), free_port()
    target = _spawn(
        "target",
        [*target_args, "--port", str(target_port), "--metrics-port", str(target_metrics)],
        root,
        target_port,
        target_metrics,
    )
    secure = _spawn(
        "secure-target",
        [
            *target_args,
            "--port",
            str(secure_port),
            "--metrics-port",
            str(secure_metrics),
            "--tls-cert",
            str(certs.server_cert),
            "--tls-key",
            str(certs.server_key),
            "--tls-client-ca",
            str(certs.ca),
            "--auth-token-file",
            str(token_file),
            "--max-queued-requests",
            "1",
        ],
        root,
        secure_port,
        secure_metrics,
    )
    services = [draft, target, secure]
    try:
        wait_serving(draft)
        wait_serving(target)
        wait_serving(secure, certs.client_tls())
        yield Stack(model, draft, target, secure, certs, token_file)
    finally:
        for service in reversed(services):
            service.stop()


@dataclass
class TCPProxy:
    """Forwards 127.0.0.1:port to `upstream`. `refuse_first` connections are closed before any byte
    (the client sees the server as not up yet); `sever()` closes every open connection."""

    upstream: tuple[str, int]
    refuse_first: int = 0
    accepted: int = 0
    refused: int = 0
    _sockets: list[socket.socket] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        threading.Thread(target=self._accept_loop, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self.accepted += 1
                if self.refused < self.refuse_first:
                    self.refused += 1
                    conn.close()
                    continue
            try:
                upstream = socket.create_connection(self.upstream)
            except OSError:
                conn.close()
                continue
            with self._lock:
                self._sockets += [conn, upstream]
            threading.Thread(target=self._pump, args=(conn, upstream), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, conn), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def sever(self) -> None:
        with self._lock:
            for s in self._sockets:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
            self._sockets.clear()

    def close(self) -> None:
        self._listener.close()
        self.sever()


def wait_until(predicate: object, timeout_s: float = 10.0, what: str = "condition") -> None:
    assert callable(predicate)
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)
