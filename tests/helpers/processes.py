"""Real processes on loopback: free ports, development certificates and the relay launcher.

Every relay a test or benchmark starts is ``python -m relay`` with certificates made by
``kvnet.security.certs``; ``start_relay`` returns once the relay logs ``listening`` and its metrics
endpoint answers, and raises with the relay's log if it exits or never gets there. A relay on the
``aiopquic`` QUIC stack runs in the Python 3.12 environment ``scripts/setup-py312`` makes
(``native_quic_python``).
"""

from __future__ import annotations

import asyncio
import functools
import os
import random
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvnet.security import certs
from relay.metrics import parse_prometheus
from tests.helpers.waiting import DEFAULT_TIMEOUT, async_wait_until, scaled, wait_until

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT = 60.0
NATIVE_QUIC_SETUP_TIMEOUT = 1200.0
"""Seconds the first (uncached) ``scripts/setup-py312`` may take to install its packages."""

__all__ = [
    "REPO",
    "START_TIMEOUT",
    "CertDir",
    "NativeQuicUnavailable",
    "RelayProcess",
    "free_port",
    "free_port_run",
    "make_certificates",
    "native_quic_python",
    "sigterm",
    "start_relay",
    "vllm_cpu_env",
    "wait_for_output",
]


# Ports handed to tests come from below Linux's default ephemeral range (32768-60999): a port the kernel
# gives to some client socket (of this suite, or of another run on the machine) could otherwise be taken
# between a relay's stop and its restart on the same port.
_TEST_PORTS = range(20000, 32768)
_port_choice = random.Random()  # its own generator: nothing that seeds ``random`` makes two runs agree


def free_port() -> int:
    """A loopback port that is free for both UDP and TCP right now, outside the ephemeral range."""
    for _ in range(1000):
        port = _port_choice.choice(_TEST_PORTS)
        try:
            for each in (socket.SOCK_DGRAM, socket.SOCK_STREAM):
                with socket.socket(socket.AF_INET, each) as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no free loopback port in {_TEST_PORTS.start}-{_TEST_PORTS.stop - 1}")


def vllm_cpu_env(tensor_parallel: int) -> dict[str, str]:
    """The CPU settings a vLLM engine with ``tensor_parallel`` ranks needs on this host (ENGINES.md)."""
    if tensor_parallel == 1:
        # vLLM reserves a core for a connector; on 2 cores that leaves none.
        return {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    # vLLM binds each CPU rank to a NUMA node of its own unless told which cores: one core a rank.
    cores = sorted(os.sched_getaffinity(0))[:tensor_parallel]
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(c) for c in cores)}


def free_port_run(count: int) -> int:
    """The first of ``count`` consecutive loopback TCP ports that are free right now (a relay with
    ``--workers N`` serves worker i's metrics on port + i and the hub's on port + N)."""
    for _ in range(100):
        base = free_port()
        if base + count > 65536:
            continue
        try:
            for offset in range(1, count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", base + offset))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {count} consecutive free ports on loopback")


class NativeQuicUnavailable(RuntimeError):
    """No Python 3.12 environment with aiopquic can be made here (no Python 3.12, or no package index)."""


@functools.cache
def native_quic_python() -> Path:
    """The interpreter of the cached Python 3.12 environment with aiopquic (``scripts/setup-py312``, made
    on first use). Raises ``NativeQuicUnavailable`` with the script's reason where it cannot be made."""
    if sys.version_info >= (3, 12):
        return Path(sys.executable)
    try:
        done = subprocess.run([str(REPO / "scripts" / "setup-py312")], capture_output=True, text=True,
                              timeout=scaled(NATIVE_QUIC_SETUP_TIMEOUT))
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"scripts/setup-py312 took more than {NATIVE_QUIC_SETUP_TIMEOUT:g} s") from exc
    reason = (done.stderr.strip().splitlines() or [""])[-1]
    if done.returncode in (3, 4):  # no Python 3.12; the packages could not be installed
        raise NativeQuicUnavailable(f"no Python 3.12 environment for aiopquic: {reason}")
    if done.returncode != 0:
        raise RuntimeError(f"scripts/setup-py312 failed ({done.returncode}): {done.stderr[-2000:]}")
    return Path(done.stdout.strip().splitlines()[-1]) / "bin" / "python"


def relay_python(args: tuple[str, ...]) -> Path:
    """The interpreter a relay with these arguments runs in: the Python 3.12 one for ``--quic-stack
    aiopquic``, this one otherwise."""
    stacks = [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == "--quic-stack"]
    return native_quic_python() if stacks and stacks[-1] == "aiopquic" else Path(sys.executable)


@dataclass
class CertDir:
    """A development CA and one server certificate for localhost / 127.0.0.1."""

    dir: Path
    ca: Path
    cert: Path
    key: Path


def make_certificates(directory: Path, name: str = "relay") -> CertDir:
    """Create a CA in ``directory`` and issue ``<name>.pem`` / ``<name>-key.pem`` for loopback."""
    certs.create_ca(directory)
    issued = certs.issue_cert(directory, name, ["localhost", "127.0.0.1"])
    return CertDir(directory, issued.ca, issued.cert, issued.key)


def wait_for_output(
    proc: subprocess.Popen[bytes], read_log: Callable[[], str], marker: str, name: str,
    timeout: float = START_TIMEOUT,
) -> None:
    """Return once ``marker`` appears in the process's log; raise with the log's tail if the process
    exits first or ``timeout`` passes."""

    def appeared() -> bool:
        if marker in read_log():
            return True
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{read_log()[-3000:]}")
        return False

    try:
        wait_until(appeared, f"{name} printing {marker!r}", timeout=timeout)
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}\n{read_log()[-3000:]}") from None


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

    def metrics(self, worker: int = 0) -> dict[str, float]:
        """The metrics endpoint's values (of worker ``worker`` of a relay with ``--workers``: port + i)."""
        url = f"http://127.0.0.1:{self.metrics_port + worker}/metrics"
        with urllib.request.urlopen(url, timeout=scaled(5)) as r:
            return parse_prometheus(r.read().decode())

    async def ametrics(self) -> dict[str, float]:
        return await asyncio.to_thread(self.metrics)

    def metric(self, name: str) -> float:
        return self.metrics().get(name, 0.0)

    async def wait_metrics(
        self, condition: Callable[[dict[str, float]], bool], what: str, timeout: float = DEFAULT_TIMEOUT
    ) -> dict[str, float]:
        """Poll the metrics until ``condition`` holds for them; those metrics (TimeoutError if never)."""

        async def holds() -> dict[str, float] | None:
            metrics = await self.ametrics()
            return metrics if condition(metrics) else None

        metrics = await async_wait_until(holds, what, timeout)
        assert metrics is not None  # the wait returns only a true value
        return metrics

    async def wait_metric(self, name: str, at_least: float, timeout: float = DEFAULT_TIMEOUT) -> float:
        """Poll the metrics until ``name`` reaches ``at_least``; its value then."""
        metrics = await self.wait_metrics(
            lambda m: m.get(name, 0.0) >= at_least, f"relay metric {name} reaching {at_least:g}", timeout
        )
        return metrics.get(name, 0.0)

    async def wait_namespaces(self, count: int, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Poll until the relay routes exactly ``count`` announced namespaces."""
        await self.wait_metrics(
            lambda m: m.get("kvnet_relay_namespaces", 0) == count, f"{count} namespaces routed", timeout
        )

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
        self.proc.wait(timeout=scaled(10))


def start_relay(
    cert_dir: CertDir,
    log_dir: Path,
    *extra: str,
    name: str = "relay",
    port: int = 0,
    metrics_port: int = 0,
    log_level: str | None = "debug",
    env: Mapping[str, str] | None = None,
    ready_marker: str | None = "listening",
    timeout: float = START_TIMEOUT,
) -> RelayProcess:
    """Start ``python -m relay`` on loopback (free ports unless given) with ``cert_dir``'s certificate;
    the log goes to ``log_dir/<name>-<port>.log``. Returns once the metrics endpoint answers (the relay
    starts it after its QUIC socket) and, unless ``ready_marker`` is None (a log level that hides it),
    once the relay has logged ``ready_marker`` (after its signal handlers are in place)."""
    port = port or free_port()
    metrics_port = metrics_port or free_port()
    log_path = log_dir / f"{name}-{port}.log"
    args = [
        str(relay_python(extra)), "-m", "relay",
        "--listen", f"127.0.0.1:{port}",
        "--metrics", f"127.0.0.1:{metrics_port}",
        "--cert", str(cert_dir.cert), "--key", str(cert_dir.key), "--ca", str(cert_dir.ca),
        *(["--log-level", log_level] if log_level else []),
        # A relay starts only with publisher keys or an explicit --trust-any (relay.config.NO_TRUST).
        *([] if {"--trust", "--trust-any"} & set(extra) else ["--trust-any"]),
        *extra,
    ]
    env = dict(env if env is not None else os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    rp = RelayProcess(proc, port, metrics_port, log_path, args)

    def serving() -> bool:
        try:
            rp.metrics()
        except OSError:
            return False
        return True

    def exited_or_serving() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{rp.log()[-3000:]}")
        return serving()

    try:
        wait_until(exited_or_serving, f"{name} metrics endpoint answering", timeout=timeout)
        if ready_marker is not None:
            wait_for_output(proc, rp.log, ready_marker, name, timeout=timeout)
    except BaseException:
        rp.stop()
        raise
    return rp


def sigterm(rp: RelayProcess) -> None:
    rp.proc.send_signal(signal.SIGTERM)
