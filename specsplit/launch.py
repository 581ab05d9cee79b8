"""Starting the services as local subprocesses (the demo, tests and benchmarks use this)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServiceProcess:
    module: str  # "draft_service" or "target_service"
    popen: subprocess.Popen[bytes]
    port: int
    metrics_port: int
    log: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout: float = 180.0) -> ServiceProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.module} exited with {self.popen.returncode}:\n{self.log_text()}")
            if "SPECSPLIT_READY" in self.log_text():
                return self
            time.sleep(0.1)
        raise RuntimeError(f"{self.module} not ready after {timeout:.0f}s:\n{self.log_text()}")

    def scrape_families(self) -> list[Metric]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            return list(text_string_to_metric_families(r.read().decode()))

    def scrape(self) -> Samples:
        return _samples(self.scrape_families())

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the series `name` with these labels. Raises KeyError when the service exports no
        such metric family at all, so a check like `== 0` cannot pass on a renamed metric."""
        families = self.scrape_families()
        known = {fam.name for fam in families} | {s.name for fam in families for s in fam.samples}
        if name not in known and name.removesuffix("_total") not in known:
            raise KeyError(f"{self.module} exports no metric {name!r}")
        return metric_sum(_samples(families), name, **labels)

    def signal(self, sig: int) -> None:
        self.popen.send_signal(sig)

    def stop(self, timeout: float = 20.0) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode


def _samples(families: list[Metric]) -> Samples:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in families for s in fam.samples}


def metric_sum(samples: Samples, name: str, **labels: str) -> float:
    return sum(
        v for (n, lab), v in samples.items() if n == name and all((k, x) in lab for k, x in labels.items())
    )


def start_service(
    module: str, args: list[str], log: Path, port: int | None = None, env: dict[str, str] | None = None
) -> ServiceProcess:
    """`python -m module args --port P --metrics-port M` with output to `log`; call wait_ready() next."""
    port = port or free_port()
    metrics_port = free_port()
    cmd = [
        sys.executable,
        "-m",
        module,
        *args,
        "--port",
        str(port),
        "--metrics-port",
        str(metrics_port),
        "--host",
        "127.0.0.1",
    ]
    full_env = os.environ | {"PYTHONUNBUFFERED": "1"} | (env or {})
    with open(log, "ab") as out:
        popen = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=full_env)
    return ServiceProcess(module, popen, port, metrics_port, log)
