"""What a relay session is set up with: ``RelayPeerConfig`` and the host-sized defaults of its fetches.

Owns ``RelayPeerConfig`` (the relay's URL, TLS and transport settings, the authorization token file,
timeouts and the fetch knobs), which a node builds from its ``NodeConfig`` and an engine's connector from
its connector config, so the relay session needs neither; and the fetch defaults both take for their flags
and fields (window, verify threads, fetch sessions: the last two sized to this host's cores). Nothing here
imports torch, so commands parse and check their flags before they load it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvnet.net.config import TlsConfig, TransportConfig

DEFAULT_WINDOW_BYTES = 4 << 20
"""Raw block bytes a fetch keeps requested ahead of the block being loaded (``kvnet.exchange.fetching``)."""
MAX_VERIFY_WORKERS = 64
MAX_AUTO_VERIFY_WORKERS = 8
"""Most threads ``auto_verify_workers`` picks: at the per-core rate measured here (~400 MB/s of raw KV
for lossless) 8 would take in ~3 GB/s, past the 1.8 GB/s a GPU's prefill needs, if the Python between
the GIL-free calls lets them (not measured on a many-core host yet)."""


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def auto_verify_workers(cores: int | None = None) -> int:
    """Verify threads for a host with ``cores`` usable cores (None: this process's): every core but two,
    one for the event loop's network work and one for the node's model, at most
    ``MAX_AUTO_VERIFY_WORKERS``. 0 on 2 cores, where the pool measured no faster than the event loop
    (docs/performance.md, "Verify and decode off the event loop")."""
    if cores is None:
        cores = usable_cores()
    return max(0, min(cores - 2, MAX_AUTO_VERIFY_WORKERS))


DEFAULT_VERIFY_WORKERS = auto_verify_workers()
"""Threads that check digests and decode layers during a fetch (``kvnet.exchange.fetching``), sized to
this host's cores; 0 does it on the event loop."""


MAX_AUTO_KVTC_DECODE_PROCESSES = 8


def auto_kvtc_decode_processes(cores: int | None = None) -> int:
    """Processes that entropy-decode ``kvtc`` layers (kvnet.blocks.kvtc_entropy) on a host with ``cores``
    usable cores (None: this process's): one per core, at most ``MAX_AUTO_KVTC_DECODE_PROCESSES`` (each
    decodes ~38 MB/s of SmolLM2's raw KV here). They work while the fetch waits for the network, so even
    on 2 cores, beside the event loop, two measured faster than one (docs/performance.md, "kvtc's
    entropy stage in processes")."""
    if cores is None:
        cores = usable_cores()
    return max(1, min(cores, MAX_AUTO_KVTC_DECODE_PROCESSES))


DEFAULT_KVTC_DECODE_PROCESSES = auto_kvtc_decode_processes()


MAX_FETCH_CONNECTIONS = 16
"""Most relay sessions one fetch is striped over (``--fetch-connections``): each is a connection at the
relay and, with ``fetch_verify_workers``, a pool of threads here."""
MAX_AUTO_FETCH_CONNECTIONS = 4
CORES_PER_FETCH_CONNECTION = 8
"""``auto_fetch_connections``: one session per this many cores. A session's fetch is read by the node's one
event loop; what another session adds is a second relay process's work (the relay's ``--workers``) and a
second verify pool, which only pays where cores are idle: on 2 cores a second session measured no faster
(docs/performance.md, "Striping one fetch over several sessions")."""


def auto_fetch_connections(cores: int | None = None) -> int:
    """Relay sessions a fetch is striped over on a host with ``cores`` usable cores (None: this
    process's): one per ``CORES_PER_FETCH_CONNECTION`` cores, at least 1, at most
    ``MAX_AUTO_FETCH_CONNECTIONS``; 1 below 16 cores."""
    if cores is None:
        cores = usable_cores()
    return max(1, min(cores // CORES_PER_FETCH_CONNECTION, MAX_AUTO_FETCH_CONNECTIONS))


DEFAULT_FETCH_CONNECTIONS = auto_fetch_connections()
"""Relay sessions a fetch is striped over (``kvnet.exchange.striping``), sized to this host's cores."""


@dataclass(frozen=True)
class RelayPeerConfig:
    """Everything a ``RelayPeer`` needs besides the objects it serves and fills (store, cache, trust, ABR)."""

    relay_url: str
    """``moqt://HOST:PORT`` (QUIC) or ``moqt+qmux://HOST:PORT`` (QMux over TLS/TCP) of the relay."""
    tls: TlsConfig
    """The CA the relay's certificate must chain to, and our client certificate (mTLS), if any."""
    transport: TransportConfig
    """QUIC settings of the session (idle timeout and keep-alive included)."""
    token_file: Path | None = None
    """The AUTHORIZATION TOKEN sent in SETUP (``kvnet token issue``); None sends none."""
    request_timeout: float = 10.0
    """Seconds to wait for the connection, one announce, locate or fetch before giving up."""
    trust_any: bool = False
    """Accept any correctly signed manifest whatever its key (development only)."""
    fetch_window_bytes: int = DEFAULT_WINDOW_BYTES
    """Raw block bytes requested ahead during a fetch."""
    fetch_verify_workers: int = DEFAULT_VERIFY_WORKERS
    """Threads per session that check digests and decode fetched layers (0: on the event loop)."""
    fetch_connections: int = DEFAULT_FETCH_CONNECTIONS
    """Sessions a fetch is striped over: this one and ``fetch_connections - 1`` fetch-only sessions."""

    def __post_init__(self) -> None:
        if self.request_timeout <= 0:
            raise ValueError(f"request_timeout must be positive, got {self.request_timeout}")
        check_fetch_settings(self.fetch_window_bytes, self.fetch_verify_workers, self.fetch_connections)


def check_fetch_settings(window_bytes: int, verify_workers: int, connections: int) -> None:
    """``ValueError`` naming the first of a fetch's settings out of its range (the node's config and the
    relay session's check them alike)."""
    if window_bytes <= 0:
        raise ValueError(f"fetch_window_bytes must be positive, got {window_bytes}")
    if not 0 <= verify_workers <= MAX_VERIFY_WORKERS:
        raise ValueError(f"fetch_verify_workers must be in [0, {MAX_VERIFY_WORKERS}], got {verify_workers}")
    if not 1 <= connections <= MAX_FETCH_CONNECTIONS:
        raise ValueError(f"fetch_connections must be in [1, {MAX_FETCH_CONNECTIONS}], got {connections}")
