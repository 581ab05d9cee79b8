"""Starting the services as local subprocesses (the demo, tests and benchmarks use this)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # prometheus_client is a server dependency: imported where a scrape is parsed
    from prometheus_client.metrics_core import Metric

REPO = Path(__file__).resolve().parents[1]

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def reserve_port() -> socket.socket:
    """A socket bound to a free port with SO_REUSEPORT and kept open: until it is closed no other bind of
    port 0 and no outgoing connection on this host takes that port, while a gRPC server (which sets
    SO_REUSEPORT) can still bind it. free_port()'s port was free only when it returned: in the test suite
    a service's port was sometimes taken by another process's connection before the service, seconds
    later once its model had loaded, bound it."""
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    holder.bind(("127.0.0.1", 0))
    return holder


@dataclass
class ServiceProcess:
    module: str  # "draft_service" or "target_service"
    popen: subprocess.Popen[bytes]
    port: int
    known_metrics_port: int  # 0: the service picks it and logs it (SPECSPLIT_METRICS, read on first use)
    log: Path
    log_start: int = 0  # this process's output starts at this byte of `log` (opened for appending)
    holder: socket.socket | None = None  # keeps `port` reserved until the service has bound it

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_port(self) -> int:
        if not self.known_metrics_port:
            self.known_metrics_port = int(self._wait_for(r"SPECSPLIT_METRICS port=(-?\d+)", 180.0).group(1))
        return self.known_metrics_port

    def log_text(self) -> str:
        with open(self.log, "rb") as f:
            f.seek(self.log_start)
            return f.read().decode(errors="replace")

    def _release_port(self) -> None:
        if self.holder is not None:
            self.holder.close()
            self.holder = None

    def _wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(pattern, self.log_text())
            if found:
                return found
            if self.popen.poll() is not None:
                self._release_port()
                raise RuntimeError(f"{self.module} exited with {self.popen.returncode}:\n{self.log_text()}")
            time.sleep(0.1)
        raise RuntimeError(f"{self.module}: no {pattern!r} after {timeout:.0f}s:\n{self.log_text()}")

    def wait_ready(self, timeout: float = 180.0) -> ServiceProcess:
        self._wait_for("SPECSPLIT_READY", timeout)
        self._release_port()  # bound by the service now
        return self

    def scrape_families(self) -> list[Metric]:
        from prometheus_client.parser import text_string_to_metric_families

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
        self._release_port()
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
    """`python -m module args --port P --metrics-port 0` with output to `log`; call wait_ready() next. P is
    reserved until the service is ready (reserve_port); the service picks its metrics port and logs it."""
    holder = None
    if not port:
        holder = reserve_port()
        port = int(holder.getsockname()[1])
    cmd = [
        sys.executable,
        "-m",
        module,
        *args,
        "--port",
        str(port),
        "--metrics-port",
        "0",
        "--host",
        "127.0.0.1",
    ]
    full_env = os.environ | {"PYTHONUNBUFFERED": "1"} | (env or {})
    with open(log, "ab") as out:
        start = out.tell()
        popen = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=full_env)
    return ServiceProcess(module, popen, port, 0, log, start, holder)
