"""``kvnet-relay --workers N``: N relay processes serving one UDP port, joined by a hub relay.

Owns: ``run_workers`` (the supervisor: binds the port's socket group, refusing a port another relay
holds, starts the hub and the workers, restarts one that dies, forwards SIGTERM), ``worker_config`` /
``hub_config`` (each process's ``RelayConfig``, with the relay-wide budgets divided among them) and the
entry point of one of those processes (``python -m relay.workers``, which reads its ``ChildSpec`` from
its stdin).

Design (docs/performance.md "A relay on several cores"): the supervisor binds N UDP sockets to the port
with SO_REUSEPORT before any worker starts and holds them until it exits, so the group never changes
while the relay runs (not even when a worker dies and is restarted on its socket) and the kernel keeps
every QUIC connection (its 4-tuple) on one worker; with ``--listen-qmux`` it binds N listening TCP
sockets to that port the same way, and each worker accepts its share of the QMux connections (the hub
serves QUIC only: only the workers reach it). Each worker is a whole relay with its own
cache on its own core. Routing between workers is the relay-to-relay code every relay already has: each
worker's only upstream is the hub, a relay on a private loopback port whose upstreams are the configured
``--upstream`` relays. A namespace announced at a worker is announced to the hub, so a request on another
worker goes to the hub and from there to that worker (and on to its publisher). What no route answers the
hub asks of every other worker (``RelayConfig.hub``), so pushed blocks outlive their publisher's session.
The requesting worker caches what it fetched, so hot blocks are then served by every worker from its own
cache.

The hub trusts only its workers: its certificate (for 127.0.0.1) comes from a CA made for this run, and
every request must carry a token signed by a key made for this run. Both are written to a private
temporary directory that is removed as soon as every process of the relay serves (each has read what it
needs by then; a worker keeps the CA in memory to verify the hub on a reconnect). The supervisor keeps
them in memory and writes them again, to a new such directory, only while a restarted process starts.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import errno
import functools
import json
import logging
import math
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvnet.logs import setup_logging
from kvnet.net.config import TlsConfig
from kvnet.net.reconnect import Backoff
from kvnet.net.registry import get_stack, server_sockets
from kvnet.net.url import QMUX
from kvnet.security import certs
from kvnet.security.tokens import Action, IssuerKey, issue_token, make_claims
from relay.cache import CacheConfig
from relay.config import RelayConfig, metrics_port_unusable

logger = logging.getLogger(__name__)

HUB_HOST = "127.0.0.1"
STOP_GRACE_S = 10.0
"""Seconds a process may take past its drain timeout to exit after SIGTERM before it is killed."""
START_TIMEOUT_S = 120.0
"""Seconds a process of the relay may take from its start to serving (imports, keys, the cache dir)."""
_CREDENTIAL_DAYS = 825
"""Lifetime of the hub's certificate and of the workers' token (a relay running longer must restart)."""


@dataclass(frozen=True, slots=True)
class HubCredentials:
    """What the workers and the hub trust each other with, made for one run of the relay."""

    ca: Path
    """Verifies the hub's certificate (workers)."""
    cert: Path
    key: Path
    """The hub's certificate for ``HUB_HOST`` and its key."""
    issuer_public: Path
    """The key the hub accepts tokens from."""
    token: Path
    """The token every worker presents to the hub."""


@dataclass(frozen=True, slots=True)
class ChildSpec:
    """What one process of the relay runs: written by the supervisor to the child's stdin."""

    name: str
    """``worker-<i>`` or ``hub``; every log line of the process carries it as ``worker=``."""
    config: RelayConfig
    fd: int
    """The bound UDP socket it serves on (inherited)."""
    log_format: str
    log_level: str
    restarts: int = 0
    """Times the supervisor restarted this process of the relay (``kvnet_relay_process_restarts_total``)."""
    qmux_fd: int | None = None
    """The listening TCP socket it serves QMux on (inherited; ``--listen-qmux``), if any."""


def _share(total: int, parts: int) -> int:
    return max(1, total // parts)


def _quota_share(quota: int, parts: int) -> int:
    """A per-address or per-identity quota (0 = none) for one of ``parts`` workers: rounded up, since one
    source's sessions spread over the workers by source port."""
    return quota if quota == 0 else math.ceil(quota / parts)


def _cache_share(config: RelayConfig, name: str) -> CacheConfig:
    """One process's share of the relay's cache: the N workers and the hub split it evenly, each with its
    own directory ``name`` under the cache directory."""
    parts = config.workers + 1
    cache = config.cache
    return dataclasses.replace(
        cache,
        max_bytes=cache.max_bytes // parts,
        max_inflight_bytes=_share(cache.max_inflight_bytes, parts),
        dir=str(Path(cache.dir) / name) if cache.dir else "",
        dir_bytes=_share(cache.dir_bytes, parts),
    )


def worker_config(config: RelayConfig, index: int, hub_url: str, creds: HubCredentials) -> RelayConfig:
    """Worker ``index``'s configuration: ``config`` with the hub as its only upstream, its share of the
    cache (N workers and the hub share it evenly) and of the session, request and buffer limits, and its
    own metrics port (``--metrics`` port + index) and cache directory."""
    n = config.workers
    # No misses remembered: every one of a worker's misses went to the hub, and a block pushed at another
    # worker a moment later would stay hidden behind it (the hub remembers only its upstreams' misses).
    cache = dataclasses.replace(_cache_share(config, f"worker-{index}"), negative_ttl=0)
    lim = config.limits
    limits = dataclasses.replace(
        lim,
        max_sessions=_share(lim.max_sessions, n),
        max_requests=_share(lim.max_requests, n),
        max_buffered_bytes=_share(lim.max_buffered_bytes, n + 1),
        max_sessions_per_address=_quota_share(lim.max_sessions_per_address, n),
        max_sessions_per_identity=_quota_share(lim.max_sessions_per_identity, n),
        max_requests_per_address=_quota_share(lim.max_requests_per_address, n),
        max_requests_per_identity=_quota_share(lim.max_requests_per_identity, n),
        max_buffered_bytes_per_address=_quota_share(lim.max_buffered_bytes_per_address, n),
        max_buffered_bytes_per_identity=_quota_share(lim.max_buffered_bytes_per_identity, n),
    )
    return dataclasses.replace(
        config,
        upstreams=(hub_url,),
        # In memory: the directory of the credentials is gone once every process of the relay serves,
        # and a worker verifies the hub again on every reconnect.
        upstream_tls=TlsConfig(ca_pem=creds.ca.read_bytes()),
        upstream_token=creds.token,
        metrics_port=_metrics_port(config, index),
        cache=cache,
        limits=limits,
        workers=1,
    )


def hub_config(config: RelayConfig, creds: HubCredentials) -> RelayConfig:
    """The hub's configuration: the configured upstreams (reached with the relay's own TLS and token),
    its certificate for ``HUB_HOST``, only the workers' token accepted, a cache share like a worker's and
    the metrics port after the workers' (``--metrics`` port + N)."""
    n = config.workers
    cache = _cache_share(config, "hub")
    lim = config.limits
    limits = dataclasses.replace(
        lim,
        max_buffered_bytes=_share(lim.max_buffered_bytes, n + 1),
        # Its clients are the workers, all on one address and one identity, each keeping its session for
        # the relay's life however idle. A worker closed as idle would reconnect at once, but until then
        # the hub, which asks every worker on a miss, could not ask it (its cache may hold pushed blocks);
        # and N sessions cost the hub nothing worth reclaiming.
        session_idle_timeout=0,
        pressure_idle_timeout=0,
        # A worker's session carries the namespaces of all its publishers (the hub's router bounds the
        # total); in-flight requests per session stay as configured, as for any relay chain.
        max_namespaces_per_session=lim.max_namespaces_per_session * _share(lim.max_sessions, n),
        max_sessions_per_address=0,
        max_sessions_per_identity=0,
        max_requests_per_address=0,
        max_requests_per_identity=0,
        max_buffered_bytes_per_address=0,
        max_buffered_bytes_per_identity=0,
    )
    return dataclasses.replace(
        config,
        tls=TlsConfig(cert_file=creds.cert, key_file=creds.key),
        upstream_tls=config.upstream_tls or config.tls,
        host=HUB_HOST,
        port=0,
        qmux_host=None,  # the workers serve QMux; the hub is reached by them alone, over QUIC
        auth_issuer_keys=(creds.issuer_public,),
        metrics_port=_metrics_port(config, n),
        goaway_uri="",
        cache=cache,
        limits=limits,
        workers=1,
        hub=True,
    )


def _metrics_port(config: RelayConfig, offset: int) -> int | None:
    if config.metrics_port is None or config.metrics_port == 0:
        return config.metrics_port
    return config.metrics_port + offset


def check_metrics_ports(config: RelayConfig) -> None:
    """``ValueError`` when the workers' and the hub's metrics ports would run past 65535."""
    if config.metrics_port and config.metrics_port + config.workers > 65535:
        raise ValueError(
            f"--metrics port {config.metrics_port} + {config.workers} workers runs past 65535 "
            "(worker i serves its metrics on port + i, the hub on port + workers)"
        )


def check_metrics_ports_free(config: RelayConfig) -> None:
    """``ValueError`` naming the first of the workers' and the hub's metrics ports that cannot be bound
    now, so that a port taken is one line before any process starts (not a worker failing later)."""
    if not config.metrics_port:
        return
    for offset in range(config.workers + 1):
        port = config.metrics_port + offset
        try:
            with socket.socket(socket.AF_INET6 if ":" in config.metrics_host else socket.AF_INET) as s:
                s.bind((config.metrics_host, port))
        except OSError as exc:
            raise ValueError(
                metrics_port_unusable(config.metrics_host, port, exc.strerror or str(exc))
            ) from None


def make_hub_credentials(directory: Path) -> HubCredentials:
    """A CA and the hub's certificate, a token issuer and the workers' token, in ``directory``."""
    certs.create_ca(directory, common_name="kvnet relay hub CA", valid_days=_CREDENTIAL_DAYS)
    issued = certs.issue_cert(directory, "hub", [HUB_HOST], valid_days=_CREDENTIAL_DAYS)
    issuer = IssuerKey.generate()
    issuer_public = directory / "hub-issuer.pub"
    issuer.save_public(issuer_public)
    claims = make_claims(
        "relay-worker", "kvnet-relay", [Action.RELAY], [()], now=time.time(),
        lifetime_s=_CREDENTIAL_DAYS * 86400,
    )
    token = directory / "worker.token"
    token.write_bytes(issue_token(issuer, claims))
    token.chmod(0o600)
    return HubCredentials(issued.ca, issued.cert, issued.key, issuer_public, token)


# -- the supervisor --------------------------------------------------------------------------------------
class ChildFailed(Exception):
    """A process of the relay exited (or never served); the message is the one-line reason."""

    def __init__(self, reason: str, exit_code: int | None = None) -> None:
        super().__init__(reason)
        self.exit_code = exit_code
        """The process's exit code, if it exited; 2: it failed to start and printed why itself."""


class Child:
    """One process of the relay as the supervisor sees it."""

    def __init__(self, spec: ChildSpec, proc: asyncio.subprocess.Process) -> None:
        self.spec = spec
        self.proc = proc
        self.metrics_port: int | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    async def serving(self) -> None:
        """Wait for the line the child prints once it serves; ``ChildFailed`` if it exits first, prints
        something else or takes longer than ``START_TIMEOUT_S``."""
        assert self.proc.stdout is not None
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                line = await self.proc.stdout.readline()
        except TimeoutError:
            raise ChildFailed(f"{self.name} did not start serving within {START_TIMEOUT_S:.0f} s") from None
        if not line:
            code = await self.proc.wait()
            raise ChildFailed(f"{self.name} exited before serving ({_exit_text(code)})", code)
        try:
            self.metrics_port = json.loads(line)["metrics_port"]
        except (ValueError, KeyError, TypeError):
            raise ChildFailed(f"{self.name} printed {line[:80]!r} instead of its start-up line") from None

    def signal(self, sig: int) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    async def stop(self, timeout: float) -> int:
        """SIGTERM (GOAWAY and drain), then SIGKILL past ``timeout``; the exit code."""
        self.signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(timeout):
                return await self.proc.wait()
        except TimeoutError:
            logger.error("relay process did not stop in time: killed", extra={"worker": self.name})
            self.signal(signal.SIGKILL)
            return await self.proc.wait()


def _exit_text(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exit code {code}"


async def _start(spec: ChildSpec) -> Child:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "relay.workers",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        pass_fds=(spec.fd,) if spec.qmux_fd is None else (spec.fd, spec.qmux_fd),
    )
    assert proc.stdin is not None
    # The pipe stays open: the child stops when it reads end-of-file (the supervisor is gone).
    proc.stdin.write(pickle.dumps(spec))
    await proc.stdin.drain()
    return Child(spec, proc)


def bind_port_group(config: RelayConfig) -> list[socket.socket]:
    """The ``config.workers`` SO_REUSEPORT sockets of the relay's port, or ``OSError`` (EADDRINUSE) when
    anything holds the port already. SO_REUSEPORT lets any socket of the same user with the option join a
    bound group, so a second ``--workers`` relay would bind too and the kernel would split the traffic
    between the two. A plain UDP socket (neither SO_REUSEPORT nor SO_REUSEADDR) cannot bind while any
    socket holds the address, whatever its options: that probe is the check. It must be closed before the
    group binds (it would keep the group out), so two supervisors starting at once could both pass it;
    ``_port_lock`` makes the probe and the bind one step among relays on this host. The lock is released
    once the group is bound: from then on the probe alone refuses everyone else."""
    with _port_lock(config.port):
        if config.port:
            family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.bind((config.host, config.port))
        return server_sockets(config.host, config.port, config.workers, config.transport)


def bind_qmux_group(config: RelayConfig) -> list[socket.socket]:
    """The ``config.workers`` SO_REUSEPORT listening TCP sockets of ``--listen-qmux`` (none without it),
    refused like the UDP group's when anything listens on the port already: a probe with SO_REUSEADDR but
    not SO_REUSEPORT cannot bind beside a listener (yet can beside connections in TIME_WAIT). Bind errors
    are ``ValueError`` naming the flag."""
    if config.qmux_host is None:
        return []
    where = f"--listen-qmux {config.qmux_host}:{config.qmux_port}"
    try:
        if config.qmux_port:
            family = socket.AF_INET6 if ":" in config.qmux_host else socket.AF_INET
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((config.qmux_host, config.qmux_port))
        sockets: list[socket.socket] = get_stack(QMUX).server_sockets(
            config.qmux_host, config.qmux_port, config.workers, config.transport
        )
    except OSError as exc:
        raise ValueError(f"{where}: cannot listen: {exc.strerror}") from exc
    return sockets


LOCK_WAIT_S = 10.0
"""Seconds a supervisor waits for another one that is binding a port group to finish (milliseconds)."""


@contextlib.contextmanager
def _port_lock(port: int) -> Iterator[None]:
    """Held while a supervisor probes and binds ``port``: an abstract Unix socket name, which like a UDP
    port belongs to the network namespace, is exclusive, and is freed when its process dies (no stale
    lock file). Port 0 (the kernel picks a free one) needs none."""
    if not port:
        yield
        return
    lock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    deadline = time.monotonic() + LOCK_WAIT_S
    try:
        while True:
            try:
                lock.bind(f"\0kvnet-relay-udp-{port}")
                break
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield
    finally:
        lock.close()


def run_workers(config: RelayConfig, log_format: str, log_level: str) -> int:
    """Serve ``config`` with ``config.workers`` processes until SIGTERM/SIGINT; the exit code (1 when a
    process of the relay kept dying). ``OSError`` when the port cannot be bound (another relay holds it),
    ``ValueError`` when a metrics port is taken."""
    check_metrics_ports(config)
    check_metrics_ports_free(config)
    sockets = bind_port_group(config)
    qmux_sockets: list[socket.socket] = []
    try:
        qmux_sockets = bind_qmux_group(config)
        hub_socket = server_sockets(HUB_HOST, 0, 1, config.transport)[0]
    except BaseException:
        for sock in (*sockets, *qmux_sockets):
            sock.close()
        raise
    try:
        return asyncio.run(_supervise(config, sockets, hub_socket, log_format, log_level, qmux_sockets))
    except KeyboardInterrupt:
        return 130
    finally:
        # Held for the relay's whole life: a process that dies leaves its socket in the port's group, so
        # the group never changes (no live connection moves to another worker) and its replacement
        # serves on the very socket.
        for sock in (*sockets, *qmux_sockets, hub_socket):
            sock.close()


RESTART_LIMIT = 5
"""Restarts of one process of the relay within ``RESTART_WINDOW_S`` before the supervisor gives up and
stops the relay (a process that keeps dying is broken, not unlucky)."""
RESTART_WINDOW_S = 300.0
RESTART_BACKOFF = (0.5, 10.0)
"""First and largest delay before a restart (doubling, jittered; reset once a process ran stably)."""
STABLE_RUN_S = 60.0
"""A process that served this long before it died restarts after the first delay again."""


class _Secrets:
    """The hub's credentials, in memory for the relay's life (a process restarted later needs the same
    CA, certificate and token), written to a private temporary directory only while processes start."""

    _FIELDS = ("ca", "cert", "key", "issuer_public", "token")

    def __init__(self, creds: HubCredentials) -> None:
        self._material = {f: getattr(creds, f).read_bytes() for f in self._FIELDS}

    @contextlib.contextmanager
    def written(self) -> Iterator[HubCredentials]:
        with tempfile.TemporaryDirectory(prefix="kvnet-relay-") as directory:
            paths = {}
            for name, data in self._material.items():
                path = Path(directory) / name
                path.write_bytes(data)
                path.chmod(0o600)
                paths[name] = path
            yield HubCredentials(**paths)


class _Slot:
    """One process of the relay over its restarts: what it runs, the socket it serves on, its restarts."""

    def __init__(self, name: str, sock: socket.socket, make_config: Callable[[HubCredentials], RelayConfig],
                 log_format: str, log_level: str, qmux_sock: socket.socket | None = None) -> None:
        self.name = name
        self.sock = sock
        self.qmux_sock = qmux_sock
        self.make_config = make_config
        self.log_format = log_format
        self.log_level = log_level
        self.child: Child | None = None
        self.restarts = 0
        self.recent: collections.deque[float] = collections.deque()
        self.backoff = Backoff(*RESTART_BACKOFF)
        self.started_at = 0.0

    async def start(self, creds: HubCredentials) -> Child:
        spec = ChildSpec(self.name, self.make_config(creds), self.sock.fileno(), self.log_format,
                         self.log_level, self.restarts,
                         None if self.qmux_sock is None else self.qmux_sock.fileno())
        self.child = await _start(spec)
        self.started_at = time.monotonic()
        return self.child


class _GaveUp(Exception):
    """A process of the relay kept dying; the message is the one-line reason."""


async def _supervise(
    config: RelayConfig, sockets: list[socket.socket], hub_socket: socket.socket, log_format: str,
    log_level: str, qmux_sockets: list[socket.socket],
) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    host, port = sockets[0].getsockname()[:2]
    qmux_address = "{}:{}".format(*qmux_sockets[0].getsockname()[:2]) if qmux_sockets else "off"
    hub_url = f"moqt://{HUB_HOST}:{hub_socket.getsockname()[1]}"
    hub = _Slot("hub", hub_socket, lambda creds: hub_config(config, creds), log_format, log_level)
    workers = [
        _Slot(f"worker-{i}", sock, functools.partial(worker_config, config, i, hub_url), log_format,
              log_level, qmux_sockets[i] if qmux_sockets else None)
        for i, sock in enumerate(sockets)
    ]
    # The hub's key and the workers' token are files only until every process has read them (they read
    # all of it before they serve): removed then, a SIGKILL of the supervisor later leaves no secret
    # behind. A restarted process gets the same ones, written again while it starts.
    with tempfile.TemporaryDirectory(prefix="kvnet-relay-") as first:
        creds = make_hub_credentials(Path(first))
        secrets = _Secrets(creds)
        try:
            # The hub first: a worker's first request may go to it at once.
            await _serving_or_stop(await hub.start(creds), stop)
            for slot in workers:
                if stop.is_set():
                    break
                await slot.start(creds)
            for slot in workers:
                if slot.child is not None:
                    await _serving_or_stop(slot.child, stop)
        except ChildFailed as exc:
            await _stop_all(workers, hub, config)
            if exc.exit_code == 2:
                return 2  # a start-up error (a port taken, a file unreadable): the process said which
            print(f"kvnet-relay: error: {exc}", file=sys.stderr)
            return 1
    if stop.is_set():
        return await _stop_all(workers, hub, config)
    logger.info(
        "listening",
        extra={
            "quic": f"{host}:{port}",
            "qmux": qmux_address,
            "workers": len(workers),
            "pids": ",".join(str(_pid(w)) for w in workers),
            "metrics": ",".join(
                "off" if w.child is None or w.child.metrics_port is None
                else f"{config.metrics_host}:{w.child.metrics_port}"
                for w in workers
            ),
            "hub": hub_url,
            "hub_pid": _pid(hub),
            "upstreams": ",".join(config.upstreams) or "none",
            "cache_bytes": config.cache.max_bytes,
        },
    )
    keepers = [asyncio.ensure_future(_keep(slot, secrets, stop)) for slot in (hub, *workers)]
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({stopping, *keepers}, return_when=asyncio.FIRST_COMPLETED)
    stop.set()
    # _GaveUp, or what else stopped a restart (e.g. no temporary directory for the credentials).
    failures = [
        str(exc) if isinstance(exc, _GaveUp) else f"restarting a process of the relay failed: {exc!r}"
        for exc in await asyncio.gather(*keepers, return_exceptions=True) if isinstance(exc, Exception)
    ]
    stopping.cancel()
    if not failures:
        logger.info("shutting down: SIGTERM to every worker, then the hub")
        return await _stop_all(workers, hub, config)
    await _stop_all(workers, hub, config)
    print(f"kvnet-relay: error: {failures[0]}", file=sys.stderr)
    return 1


def _pid(slot: _Slot) -> int | None:
    return None if slot.child is None else slot.child.proc.pid


async def _keep(slot: _Slot, secrets: _Secrets, stop: asyncio.Event) -> None:
    """Restart ``slot``'s process whenever it dies, until ``stop``: after a backoff, at most
    ``RESTART_LIMIT`` times within ``RESTART_WINDOW_S`` (then ``_GaveUp``). The port keeps serving
    meanwhile: the other workers serve their sessions, and datagrams for this one wait in its socket (held
    by the supervisor) for its replacement. Its sessions are lost (their QUIC state died with it), and
    with them what it held only in memory; its cache directory, if any, is reopened."""
    while True:
        child = slot.child
        assert child is not None
        if not await _exited_or_stop(child, stop):
            return
        reason = f"{slot.name} (pid {child.proc.pid}) {_exit_text(child.proc.returncode or 0)}"
        now = time.monotonic()
        while slot.recent and now - slot.recent[0] > RESTART_WINDOW_S:
            slot.recent.popleft()
        if len(slot.recent) >= RESTART_LIMIT:
            logger.error("relay process exited: giving up", extra={"worker": slot.name, "reason": reason})
            raise _GaveUp(
                f"{reason}, restarted {RESTART_LIMIT} times within {RESTART_WINDOW_S:.0f} s; stopping the "
                "relay"
            )
        if now - slot.started_at >= STABLE_RUN_S:
            slot.backoff.reset()
        delay = slot.backoff.next_delay()
        slot.recent.append(now)
        slot.restarts += 1
        logger.error(
            "relay process exited: restarting",
            extra={"worker": slot.name, "reason": reason, "restart": slot.restarts,
                   "recent": f"{len(slot.recent)}/{RESTART_LIMIT}", "delay_s": round(delay, 2)},
        )
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):
                await stop.wait()
        if stop.is_set():
            return
        with secrets.written() as creds:
            replacement = await slot.start(creds)
            try:
                await _serving_or_stop(replacement, stop)
            except ChildFailed as exc:
                # Counted as the next death of this slot on the loop's next turn (its process has exited
                # or is killed here).
                logger.error(
                    "relay process failed to restart", extra={"worker": slot.name, "reason": str(exc)}
                )
                replacement.signal(signal.SIGKILL)
                continue
        if stop.is_set():
            return
        logger.info("relay process restarted", extra={"worker": slot.name, "pid": replacement.proc.pid,
                                                      "restart": slot.restarts})


async def _exited_or_stop(child: Child, stop: asyncio.Event) -> bool:
    """Wait until ``child`` exits (True) or ``stop`` is set (False)."""
    exited = asyncio.ensure_future(child.proc.wait())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({exited, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if exited.done():
        return True
    exited.cancel()
    return False


async def _serving_or_stop(child: Child, stop: asyncio.Event) -> None:
    """Wait until ``child`` serves, or return early once ``stop`` is set."""
    serving = asyncio.ensure_future(child.serving())
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    if serving.done():
        serving.result()  # ChildFailed
    else:
        serving.cancel()


async def _stop_all(workers: list[_Slot], hub: _Slot, config: RelayConfig) -> int:
    """Stop the workers (each drains its sessions), then the hub they route through; 0 if all exited 0."""
    timeout = config.drain_timeout + STOP_GRACE_S
    codes = await asyncio.gather(*(w.child.stop(timeout) for w in workers if w.child is not None))
    if hub.child is not None:
        codes.append(await hub.child.stop(timeout))
    return 0 if all(c == 0 for c in codes) else 1


# -- one process of the relay --------------------------------------------------------------------------
class _WorkerName(logging.Filter):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.worker = name

    def filter(self, record: logging.LogRecord) -> bool:
        record.__dict__.setdefault("worker", self.worker)
        return True


def child_main() -> int:
    try:
        spec = pickle.load(sys.stdin.buffer)  # written by run_workers, our own parent
    except (EOFError, pickle.UnpicklingError):
        print("kvnet-relay: error: relay.workers runs only as a process of kvnet-relay --workers",
              file=sys.stderr)
        return 2
    assert isinstance(spec, ChildSpec)
    setup_logging(spec.log_format, spec.log_level)
    for handler in logging.getLogger().handlers:
        handler.addFilter(_WorkerName(spec.name))
    from relay.metrics import Metrics
    from relay.server import run, serve

    sock = socket.socket(fileno=spec.fd)
    qmux_sock = None if spec.qmux_fd is None else socket.socket(fileno=spec.qmux_fd)
    metrics = Metrics()
    metrics.counter_fn(
        "process_restarts_total", "times the supervisor restarted this process of the relay (it died)",
        lambda: spec.restarts,
    )

    def listening(address: tuple[str, int], metrics_port: int | None) -> None:
        print(json.dumps({"quic": list(address), "metrics_port": metrics_port}), flush=True)

    async def serve_until_stopped() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        stdin = sys.stdin.fileno()

        def supervisor_input() -> None:
            if not os.read(stdin, 4096):  # end of file: the supervisor is gone
                loop.remove_reader(stdin)
                logger.warning("supervisor gone: stopping")
                stop.set()

        loop.add_reader(stdin, supervisor_input)
        await serve(spec.config, stop, sock=sock, on_listening=listening, metrics=metrics,
                    qmux_sock=qmux_sock)

    return run(spec.config, serve_until_stopped(), spec.name)

if __name__ == "__main__":
    # Run as ``relay.workers``, not ``__main__``: the spec's classes are unpickled from that module.
    from relay.workers import child_main as main

    sys.exit(main())
