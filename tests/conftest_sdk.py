"""Real services on loopback for the SDK and CLI tests: a tiny checkpoint, one draft service, and target
services (plain; mTLS + bearer token + a one-request queue), plus a TCP proxy that can refuse the first
connection (a server coming up late) or sever every connection (a server dying mid-stream)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from service_util import start_draft, start_target, wait_for

from specsplit import TLSConfig
from specsplit.launch import REPO, ServiceProcess
from specsplit.launch import free_port as free_port  # re-exported for the tests that use this module

STARTUP_TIMEOUT_S = 120.0
AUTH_TOKEN = "sdk-test-token"


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

    def server_args(self, auth_token_file: Path) -> list[str]:
        """A service's flags for mTLS with these certificates plus a bearer token."""
        return [
            "--tls-cert",
            str(self.server_cert),
            "--tls-key",
            str(self.server_key),
            "--tls-client-ca",
            str(self.ca),
            "--auth-token-file",
            str(auth_token_file),
        ]


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
    draft: ServiceProcess
    target: ServiceProcess
    secure_target: ServiceProcess
    certs: Certificates
    auth_token_file: Path


@pytest.fixture(scope="session")
def sdk_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Services shared by tests/test_sdk*.py and tests/test_cli*.py (multi-process)."""
    root = tmp_path_factory.mktemp("sdk-stack")
    model = root / "tiny"
    # A draft sharing the target's embeddings, head and first layer (the target's second is damped): it
    # agrees with the target often but not always (~25% of greedy drafts), so drafts are both accepted
    # and rejected.
    draft_model = root / "tiny-draft"
    target_args = ["--seed", "0", "--late-layer-scale", "0.3", "--late-layers-from", "1"]
    draft_args = ["--seed", "1", "--num-layers", "1", "--base", str(model), "--share-layers", "1"]
    for path, args in ((model, target_args), (draft_model, draft_args)):
        subprocess.run([sys.executable, "-m", "common.tiny", str(path), *args], cwd=REPO, check=True)
    certs = make_certificates(root)
    token_file = root / "token"
    token_file.write_text(AUTH_TOKEN + "\n")

    draft = start_draft(draft_model, root, "--device", "cpu")
    # Every request speculates (fixed policy), so the tests can assert that drafts were made and accepted.
    target = start_target(model, root, draft, "--speculation-policy", "fixed")
    secure = start_target(
        model, root, draft, *certs.server_args(token_file), "--max-queued-requests", "1", name="secure-target"
    )
    services = [draft, target, secure]
    try:
        for service in services:
            service.wait_ready(STARTUP_TIMEOUT_S)
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


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition") -> None:
    wait_for(predicate, timeout_s, what)
