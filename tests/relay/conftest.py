"""Fixtures for relay tests: a dev CA, free ports, and real ``python -m relay`` processes.

Every relay is a subprocess on loopback, started with certificates from ``kvnet.security.certs`` and
considered ready
when its metrics endpoint answers; teardown always kills it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import pytest

from kvnet.security import certs
from relay.metrics import parse_prometheus

REPO = Path(__file__).resolve().parents[2]


@dataclass
class CertDir:
    dir: Path
    ca: Path
    cert: Path
    key: Path


def free_port(kind: int = socket.SOCK_DGRAM) -> int:
    """A port that is free for both UDP and TCP right now."""
    while True:
        with socket.socket(socket.AF_INET, kind) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        other = socket.SOCK_STREAM if kind == socket.SOCK_DGRAM else socket.SOCK_DGRAM
        with socket.socket(socket.AF_INET, other) as s2:
            try:
                s2.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port


@pytest.fixture(scope="session")
def cert_dir(tmp_path_factory: pytest.TempPathFactory) -> CertDir:
    d = tmp_path_factory.mktemp("certs")
    certs.create_ca(d)
    issued = certs.issue_cert(d, "relay", ["localhost", "127.0.0.1"])
    return CertDir(d, issued.ca, issued.cert, issued.key)


@dataclass
class RelayProcess:
    proc: subprocess.Popen[bytes]
    port: int
    metrics_port: int
    log_path: Path
    args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"moqt://127.0.0.1:{self.port}"

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return parse_prometheus(r.read().decode())

    async def ametrics(self) -> dict[str, float]:
        return await asyncio.to_thread(self.metrics)

    def metric(self, name: str) -> float:
        return self.metrics().get(name, 0.0)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


def start_relay(cert_dir: CertDir, tmp_path: Path, *extra: str, name: str = "relay") -> RelayProcess:
    port = free_port()
    mport = free_port(socket.SOCK_STREAM)
    log_path = tmp_path / f"{name}-{port}.log"
    args = [
        sys.executable,
        "-m",
        "relay",
        "--listen",
        f"127.0.0.1:{port}",
        "--metrics",
        f"127.0.0.1:{mport}",
        "--cert",
        str(cert_dir.cert),
        "--key",
        str(cert_dir.key),
        "--ca",
        str(cert_dir.ca),
        "--log-level",
        "debug",
        *extra,
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    rp = RelayProcess(proc, port, mport, log_path, args)
    deadline = time.monotonic() + 20
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"relay exited with {proc.returncode}:\n{rp.log()}")
        try:
            rp.metrics()
            if "listening" in rp.log():
                return rp
        except OSError:
            pass
        if time.monotonic() > deadline:
            rp.stop()
            raise RuntimeError(f"relay not ready after 20 s:\n{rp.log()}")
        time.sleep(0.05)


class RelayFactory(Protocol):
    """``start_relay`` with the test's certificates and directory: ``relay_factory(*flags, name=...)``."""

    def __call__(self, *extra: str, name: str = "relay") -> RelayProcess: ...


@pytest.fixture
def relay_factory(cert_dir: CertDir, tmp_path: Path) -> Iterator[RelayFactory]:
    """Starts relays for a test; every one it started is stopped at teardown."""
    started: list[RelayProcess] = []

    def start(*extra: str, name: str = "relay") -> RelayProcess:
        rp = start_relay(cert_dir, tmp_path, *extra, name=name)
        started.append(rp)
        return rp

    yield start
    for rp in started:
        rp.stop()


@pytest.fixture
def relay(relay_factory: RelayFactory) -> RelayProcess:
    return relay_factory()


def sigterm(rp: RelayProcess) -> None:
    rp.proc.send_signal(signal.SIGTERM)
