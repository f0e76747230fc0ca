"""``NetnsCluster``: a compose project running as processes in Linux network namespaces.

It creates the planned topology (``plan.py``), starts each service's compose command in its namespace in
dependency order (waiting for health checks and one-shot init services as compose does), logs each service
to ``RUN_DIR/logs/SERVICE.log``, and tears everything down by name prefix, idempotently.

Must not know: what the services are. They are argv lists read from the compose file; this package never
imports the relay or the nodes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvnet.logs import LOG_SETTINGS_ENV

from .compose import ComposeProject
from .plan import (
    DEFAULT_PREFIX,
    Interface,
    LaunchSpec,
    LinkShape,
    check_prefix,
    launch_spec,
    map_paths,
    mount_map,
    plan_cluster,
)

logger = logging.getLogger(__name__)

# Where `ip netns exec NAME` finds files it bind-mounts over /etc (iproute2 convention).
NETNS_ETC = Path("/etc/netns")
# Environment variable set on every process we start, so our processes can be recognised.
CLUSTER_ENV = "KVNET_CLUSTER"


class ClusterError(RuntimeError):
    """Building or running the namespace cluster failed."""


def _run(argv: Sequence[str], check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise ClusterError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def netns_available() -> str | None:
    """None if this process can build namespace clusters, else the reason it cannot."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 'ip' is not installed"
    probe = f"kvnprobe{os.getpid()}"
    try:
        proc = _run(["ip", "netns", "add", probe], check=False)
        if proc.returncode != 0:
            return f"'ip netns add' failed: {proc.stderr.strip()}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return None


def list_namespaces(prefix: str) -> list[str]:
    """Namespaces of the cluster with ``prefix`` (exact ``PREFIX-`` match, so kvnc never matches kvnc2)."""
    proc = _run(["ip", "netns", "list"], check=False)
    names = [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]
    return [n for n in names if n.startswith(prefix + "-")]


def _namespace_pids(namespace: str) -> list[int]:
    proc = _run(["ip", "netns", "pids", namespace], check=False)
    return [int(p) for p in proc.stdout.split() if p.isdigit()]


def teardown(prefix: str, grace_s: float = 5.0) -> list[str]:
    """Stop every process in the cluster's namespaces, delete the namespaces and their /etc files.

    Idempotent; finds leftovers by name prefix alone, so it also cleans up after a crashed run.
    Returns the namespaces that were removed.
    """
    check_prefix(prefix)
    namespaces = list_namespaces(prefix)
    # Only processes inside our own namespaces are signalled: `ip netns pids` lists exactly those.
    pids = {p for ns in namespaces for p in _namespace_pids(ns)}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 2.0)
        while pids and time.monotonic() < deadline:
            pids = {p for p in pids if Path(f"/proc/{p}").exists() and not _is_zombie(p)}
            if pids:
                time.sleep(0.05)
        if not pids:
            break
    for ns in namespaces:
        _run(["ip", "netns", "del", ns], check=False)
    if NETNS_ETC.is_dir():
        for d in NETNS_ETC.glob(f"{prefix}-*"):
            shutil.rmtree(d, ignore_errors=True)
        with contextlib.suppress(OSError):
            NETNS_ETC.rmdir()  # only succeeds when no one else keeps files there
    return namespaces


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] == "Z"


@dataclass
class _Running:
    spec: LaunchSpec
    proc: subprocess.Popen[bytes]
    log: Path


class NetnsCluster:
    """A compose project running as processes in network namespaces.

    ``up()`` builds the topology and starts every service; ``down()`` undoes everything and is safe to call
    any number of times (also from another process, via ``teardown(prefix)``).
    """

    def __init__(
        self,
        project: ComposeProject,
        run_dir: Path,
        prefix: str = DEFAULT_PREFIX,
        links: Sequence[LinkShape] = (),
        bin_dir: Path | None = None,
        health_poll_s: float = 0.25,
    ) -> None:
        self.project = project
        self.run_dir = run_dir.resolve()
        self.plan = plan_cluster(project, prefix, links)
        # Console scripts (kvnet-relay, ...) come from the environment this module runs in.
        self.bin_dir = bin_dir or Path(sys.executable).parent
        self.health_poll_s = health_poll_s
        self._running: dict[str, _Running] = {}
        self._emulators: list[subprocess.Popen[bytes]] = []

    @property
    def prefix(self) -> str:
        return self.plan.prefix

    # -- topology --------------------------------------------------------------------------------------

    def _ip(self, namespace: str, *args: str) -> None:
        _run(["ip", "-n", namespace, *args])

    def _add_interface(self, itf: Interface) -> None:
        sw = self.plan.switch_namespace
        # Both ends are created from the switch namespace, so no interface ever appears in the root one.
        peer = ("peer", "name", itf.name, "netns", itf.namespace)
        self._ip(sw, "link", "add", itf.switch_port, "type", "veth", *peer)
        self._ip(sw, "link", "set", itf.switch_port, "master", self.plan.bridges[itf.network], "up")
        self._ip(itf.namespace, "addr", "add", f"{itf.address}/24", "dev", itf.name)
        self._ip(itf.namespace, "link", "set", itf.name, "up")

    def _write_hosts(self, namespace: str, table: Mapping[str, str]) -> None:
        etc = NETNS_ETC / namespace
        etc.mkdir(parents=True, exist_ok=True)
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost"]
        lines += [f"{addr} {name}" for name, addr in table.items()]
        (etc / "hosts").write_text("\n".join(lines) + "\n")

    def build_topology(self) -> None:
        if list_namespaces(self.prefix):
            raise ClusterError(f"a cluster with prefix {self.prefix!r} exists; run 'down' first")
        for ns in self.plan.all_namespaces():
            _run(["ip", "netns", "add", ns])
            self._ip(ns, "link", "set", "lo", "up")
        for bridge in self.plan.bridges.values():
            self._ip(self.plan.switch_namespace, "link", "add", bridge, "type", "bridge")
            self._ip(self.plan.switch_namespace, "link", "set", bridge, "up")
        for itf in self.plan.interfaces:
            self._add_interface(itf)
        for emu in self.plan.emulators:
            self._add_interface(emu.interface)
        for ns, table in self.plan.hosts.items():
            self._write_hosts(ns, table)

    # -- processes ---------------------------------------------------------------------------------------

    def base_env(self) -> dict[str, str]:
        dirs = [str(self.bin_dir), "/usr/local/bin", "/usr/bin", "/bin", "/usr/sbin", "/sbin"]
        path = os.pathsep.join(dirs)
        env = {
            "PATH": path,
            "HOME": str(self.run_dir),
            "LANG": "C.UTF-8",
            "PYTHONUNBUFFERED": "1",
            CLUSTER_ENV: self.prefix,
        }
        # Services log in the runner's format (kvnet-relay and kvnet-node read the shared names).
        env.update({name: os.environ[name] for name in LOG_SETTINGS_ENV.values() if name in os.environ})
        return env

    def spec(self, service: str) -> LaunchSpec:
        return launch_spec(self.project, self.plan, self.run_dir, service)

    def _popen(self, namespace: str, argv: Sequence[str], env: Mapping[str, str], cwd: Path, log: Path) -> (
        subprocess.Popen[bytes]
    ):
        log.parent.mkdir(parents=True, exist_ok=True)
        cwd.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            out.write(f"== {time.strftime('%H:%M:%S')} start: {' '.join(argv)}\n".encode())
            out.flush()
            return subprocess.Popen(
                ["ip", "netns", "exec", namespace, *argv],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=dict(env),
                cwd=cwd,
                start_new_session=True,  # own process group: a stop signals the service, not us
            )

    def start_emulators(self) -> None:
        for emu in self.plan.emulators:
            for port in emu.udp_ports:
                argv = [
                    "kvnet", "linkemu", "--listen", f"0.0.0.0:{port}", "--target", f"{emu.target}:{port}",
                    *emu.link.linkemu_args(),
                ]
                log = self.run_dir / "logs" / f"linkemu-{emu.link.client}-{emu.link.server}-{port}.log"
                self._emulators.append(self._popen(emu.namespace, argv, self.base_env(), self.run_dir, log))

    def start_service(self, service: str) -> None:
        """Start one service (again) with its compose command; does not wait for health."""
        if service in self._running and self._running[service].proc.poll() is None:
            raise ClusterError(f"{service} is already running")
        spec = self.spec(service)
        # Each service gets its own HOME (like its own container), so per-user state never collides.
        env = {**self.base_env(), "HOME": str(spec.cwd), **spec.env}
        log = self.run_dir / "logs" / f"{service}.log"
        proc = self._popen(spec.namespace, spec.argv, env, spec.cwd, log)
        self._running[service] = _Running(spec, proc, log)
        self._save_state()

    def stop_service(self, service: str, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> int | None:
        """Signal a service's process group and wait for it; SIGKILL after ``timeout_s``."""
        run = self._running.get(service)
        if run is None or run.proc.poll() is not None:
            return None if run is None else run.proc.returncode
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.proc.pid, sig)
        try:
            return run.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(run.proc.pid, signal.SIGKILL)
            return run.proc.wait(5.0)

    def is_running(self, service: str) -> bool:
        run = self._running.get(service)
        return run is not None and run.proc.poll() is None

    def log_tail(self, service: str, lines: int = 30) -> str:
        path = self.run_dir / "logs" / f"{service}.log"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def diagnostics(self, names: Sequence[str] | None = None, lines: int = 15, width: int = 500) -> str:
        """Tails of the cluster's logs (services, link emulators, spawned processes) for failure messages;
        ``names`` selects logs by file stem (``edge-b``, ``abr-publisher``), default all."""
        parts: list[str] = []
        for path in sorted((self.run_dir / "logs").glob("*.log")):
            if names is not None and path.stem not in names:
                continue
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {path.name} (last {len(tail)} lines)\n" + "\n".join(x[:width] for x in tail))
        return "\n".join(parts)

    def _one_shot(self, service: str) -> bool:
        """An init service (others wait for it to exit 0), never restarted by ``recover``."""
        conditions = [s.depends_on.get(service) for s in self.project.services.values()]
        return "service_completed_successfully" in conditions

    def probe(self, service: str, attempts: int = 3) -> bool:
        """True if ``service`` runs and passes its compose healthcheck in one of ``attempts`` tries."""
        for i in range(attempts):
            if not self.is_running(service):
                return False
            if self._healthy(service):
                return True
            if i + 1 < attempts:
                time.sleep(2 * self.health_poll_s)
        return False

    def recover(self) -> list[str]:
        """Bring the cluster back to what ``up`` left: restart every long-running service that exited or
        fails its healthcheck, and after it every service that declared ``restart: true`` on a restarted
        one (compose semantics), in dependency order; wait until all are healthy. Returns what restarted."""
        order = [name for name in self.project.start_order() if not self._one_shot(name)]
        restart: list[str] = []
        for name in order:
            svc = self.project.services[name]
            if any(dep in restart for dep in svc.restart_with) or not self.probe(name):
                restart.append(name)
        for name in reversed(restart):
            self.stop_service(name)
        for name in restart:
            for dep, cond in self.project.services[name].depends_on.items():
                self.wait_ready(dep, cond)
            logger.info("recover: restarting %s", name)
            self.start_service(name)
        for name in restart:
            self.wait_ready(name)
        return restart

    def exec(
        self, service: str, argv: Sequence[str], timeout_s: float = 60.0, env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run a command in a service's namespace with its environment (``docker compose exec``)."""
        spec = self.spec(service)
        full_env = {**self.base_env(), "HOME": str(spec.cwd), **spec.env, **(env or {})}
        # Paths like /certs/ca.pem mean the same inside `exec` as in the service's own command.
        mapped = [map_paths(a, mount_map(self.project, self.run_dir, service)) for a in argv]
        spec.cwd.mkdir(parents=True, exist_ok=True)
        return subprocess.run(
            ["ip", "netns", "exec", spec.namespace, *mapped],
            capture_output=True,
            text=True,
            env=full_env,
            cwd=spec.cwd,
            timeout=timeout_s,
            check=False,
        )

    def _healthy(self, service: str) -> bool:
        spec = self.spec(service)
        svc = self.project.services[service]
        if spec.healthcheck is None or svc.healthcheck is None:
            return True
        try:
            proc = self.exec(service, spec.healthcheck, timeout_s=max(svc.healthcheck.timeout_s, 1.0))
        except subprocess.TimeoutExpired:
            return False
        return proc.returncode == 0

    def wait_ready(self, service: str, condition: str = "service_healthy") -> None:
        """Block until ``service`` meets a compose depends_on condition; raise with its log if it can't."""
        run = self._running[service]
        svc = self.project.services[service]
        if condition == "service_completed_successfully":
            try:
                rc = run.proc.wait(120.0)
            except subprocess.TimeoutExpired:
                raise ClusterError(f"{service} did not finish:\n{self.log_tail(service)}") from None
            if rc != 0:
                raise ClusterError(f"{service} exited with {rc}:\n{self.log_tail(service)}")
            return
        if condition == "service_started" or svc.healthcheck is None:
            return
        deadline = time.monotonic() + svc.healthcheck.deadline_s
        while True:
            if run.proc.poll() is not None:
                raise ClusterError(f"{service} exited with {run.proc.returncode}:\n{self.log_tail(service)}")
            if self._healthy(service):
                return
            if time.monotonic() > deadline:
                raise ClusterError(f"{service} not healthy in {svc.healthcheck.deadline_s:.0f}s:\n"
                                   f"{self.log_tail(service)}")
            # Compose polls every `interval`; polling faster only makes start-up quicker, never different.
            time.sleep(self.health_poll_s)

    def start_all(self) -> None:
        """Start services in dependency order, honouring each depends_on condition."""
        for name in self.project.start_order():
            for dep, cond in self.project.services[name].depends_on.items():
                self.wait_ready(dep, cond)
            self.start_service(name)
        for name in self.project.services:
            if self.project.services[name].healthcheck is not None:
                self.wait_ready(name)

    def _interface(self, service: str, network: str) -> Interface:
        ns = self.plan.namespaces[service]
        return next(i for i in self.plan.interfaces if i.namespace == ns and i.network == network)

    def limit_rate(self, service: str, network: str, rate_bit: int, burst_bytes: int = 16384) -> None:
        """Token-bucket limit (tc tbf) on the service's access link, both directions."""
        itf = self._interface(service, network)
        for ns, dev in ((self.plan.switch_namespace, itf.switch_port), (itf.namespace, itf.name)):
            _run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate_bit}bit",
                  "burst", str(burst_bytes), "latency", "200ms"])

    def clear_rate(self, service: str, network: str) -> None:
        itf = self._interface(service, network)
        for ns, dev in ((self.plan.switch_namespace, itf.switch_port), (itf.namespace, itf.name)):
            _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)

    def _save_state(self) -> None:
        state = {
            "prefix": self.prefix,
            "namespaces": self.plan.namespaces,
            "addresses": {i.namespace: i.address for i in self.plan.interfaces},
            "pids": {name: run.proc.pid for name, run in self._running.items()},
            "emulator_pids": [p.pid for p in self._emulators],
        }
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "state.json").write_text(json.dumps(state, indent=2) + "\n")

    def up(self) -> None:
        """Build the topology and start everything; on any failure (or interrupt) tear down and re-raise."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.build_topology()
            self.start_emulators()
            self.start_all()
            self._save_state()
        except BaseException:
            self.down()
            raise

    def down(self, grace_s: float = 6.0) -> None:
        """Stop everything (all at once: relays drain for up to their ``--drain-timeout``), SIGKILL what is
        left after ``grace_s``, remove the namespaces."""
        procs = [*(r.proc for r in self._running.values()), *self._emulators]
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
        teardown(self.prefix, grace_s=1.0)
        # Reap whatever teardown had to kill so no zombie outlives us.
        for proc in [*(r.proc for r in self._running.values()), *self._emulators]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(2.0)

    def __enter__(self) -> NetnsCluster:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def spawn(self, service: str, argv: Sequence[str], log_name: str) -> subprocess.Popen[bytes]:
        """Start an extra background process in a service's namespace (a second node, a one-shot publisher
        that must keep serving); the caller stops it with ``stop_process``. ``down`` kills it regardless,
        since it lives in one of our namespaces."""
        spec = self.spec(service)
        mapped = [map_paths(a, mount_map(self.project, self.run_dir, service)) for a in argv]
        env = {**self.base_env(), "HOME": str(spec.cwd), **spec.env}
        return self._popen(spec.namespace, mapped, env, spec.cwd, self.run_dir / "logs" / f"{log_name}.log")

    def http_json(
        self,
        service: str,
        port: int,
        path: str,
        body: Mapping[str, Any] | None = None,
        timeout_s: float = 60.0,
    ) -> Any:
        """GET (or POST ``body`` as JSON) ``http://127.0.0.1:PORT/PATH`` inside a service's namespace."""
        script = (
            "import json, sys, urllib.request\n"
            "url, body, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])\n"
            "data = body.encode() if body else None\n"
            "req = urllib.request.Request(url, data=data, headers={'Content-Type': 'application/json'})\n"
            "sys.stdout.write(urllib.request.urlopen(req, timeout=timeout).read().decode())\n"
        )
        url = f"http://127.0.0.1:{port}{path}"
        payload = json.dumps(body) if body is not None else ""
        argv = ["python", "-c", script, url, payload, str(timeout_s)]
        proc = self.exec(service, argv, timeout_s=timeout_s + 10)
        if proc.returncode != 0:
            raise ClusterError(f"{service}: HTTP {path} failed: {proc.stderr.strip()[-2000:]}")
        text = proc.stdout
        return text if path.endswith("/metrics") else json.loads(text)


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> int:
    """SIGTERM a process group we started, SIGKILL after ``timeout_s``; returns the exit status."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    return proc.wait(5.0)
