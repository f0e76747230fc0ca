"""Relay configuration: one frozen dataclass per component, built from settings.

Owns: ``RelayConfig`` and ``load_config``, which merges the config file's sections with the flag values.
Only ``relay.__main__`` reads the command line, the environment (``KVNET_RELAY_*``) or files
(``kvnet.config``); everything below receives a ``RelayConfig``.

File format (``--config relay.yaml``; the nodes' format: every flag by name, every key optional, the
command line and the environment win; a ``.toml`` file with the same keys is read too)::

    listen: 127.0.0.1:4443           # host:port (IPv6 as [::1]:4443)
    listen-qmux: 127.0.0.1:4443      # TCP host:port serving moqt+qmux:// beside it (absent: QUIC only)
    cert: certs/relay.pem            # TLS chain and key (required)
    key: certs/relay-key.pem
    ca: certs/ca.pem                 # verifies upstream relays (and client certs with require-client-cert)
    upstream: [moqt://origin:4443]   # relays to forward misses to, tried in order (moqt+qmux:// too)
    metrics: 127.0.0.1:9464          # Prometheus endpoint; "" disables (worker i: port + i)
    workers: 1                       # processes serving the port (relay.workers)
    log-format: kv                   # kv (key=value) or json
    cache-bytes: 1G                  # any flag, sizes as on the command line
    auth-issuer-key: [issuer.pub]    # trusted token issuers (PEM); when set, authorization is required
    trust: [keys/publisher.pub]      # publisher keys (files, dirs of *.pub): cache only blocks they signed

    cache:                           # relay.cache.CacheConfig fields without a flag
      max_negative_entries: 65536
    limits:                          # relay.limits.LimitsConfig fields
      max_subscribers_per_track: 4096
    transport:                       # kvnet.net.config.TransportConfig fields
      udp_segmentation: false
"""

from __future__ import annotations

import dataclasses
import errno
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvnet.logs import LOG_FORMATS, LOG_LEVELS
from kvnet.net.config import TlsConfig, TransportConfig
from kvnet.net.url import parse_moqt_url
from kvnet.security.tokens import DEFAULT_CLOCK_SKEW_S
from relay.cache import CacheConfig
from relay.limits import LimitsConfig

CONFIG_SECTIONS = ("cache", "limits", "transport")
DEFAULT_LISTEN = "127.0.0.1:4443"
DEFAULT_METRICS = "127.0.0.1:9464"
MAX_WORKERS = 64
"""Most relay worker processes: past the cores of any one host, more only add scheduling and hub load."""
_TOP_KEYS = {
    "listen",
    "listen_qmux",
    "cert",
    "key",
    "ca",
    "require_client_cert",
    "upstream",
    "metrics",
    "log_format",
    "log_level",
    "drain_timeout",
    "goaway_uri",
    "auth_issuer_keys",
    "auth_clock_skew",
    "upstream_token",
    "trust",
    "trust_any",
    "workers",
    "cache",
    "limits",
    "transport",
}


def parse_hostport(value: str, what: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port``; port 0 lets the OS choose."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{what} must be host:port, got {value!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"{what} has an invalid port in {value!r}") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"{what} port must be in 0..65535, got {port}")
    return host, port


@dataclass(frozen=True, slots=True)
class RelayConfig:
    """Everything one relay process needs."""

    tls: TlsConfig
    """Our certificate and key (required) and the CA used to verify upstream relays."""
    host: str = "127.0.0.1"
    """Address to listen on (UDP)."""
    port: int = 4443
    """UDP port; 0 picks a free one (the chosen port is logged)."""
    qmux_host: str | None = None
    """Address to serve MoQT over QMux on (TCP, ``moqt+qmux://``) beside QUIC, with the same cache,
    limits and metrics; None: QUIC only."""
    qmux_port: int = 0
    """TCP port of the QMux listener; 0 picks a free one (logged)."""
    upstreams: tuple[str, ...] = ()
    """``moqt://host:port`` (QUIC) or ``moqt+qmux://host:port`` (QMux over TLS/TCP) relays that misses are
    forwarded to when no local publisher matches."""
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = 9464
    """TCP port of the Prometheus endpoint; None disables it, 0 picks a free one."""
    log_format: str = "kv"
    """"kv" (logfmt-style key=value lines) or "json" (one object per line)."""
    log_level: str = "info"
    drain_timeout: float = 5.0
    """Seconds between GOAWAY and closing the remaining sessions at shutdown."""
    goaway_uri: str = ""
    """``moqt://host:port`` named in the shutdown GOAWAY as where clients reconnect (a standby relay
    during a rolling restart); empty: they reconnect to the URL they know."""
    auth_issuer_keys: tuple[Path, ...] = ()
    """Ed25519 public keys (PEM) of trusted token issuers. Non-empty: every request must be authorized."""
    auth_clock_skew: float = DEFAULT_CLOCK_SKEW_S
    """Seconds of clock skew tolerated between token issuer and relay: a token is refused from
    ``expires + auth_clock_skew`` on, rechecked on every request (the SETUP credential included)."""
    trust: tuple[Path, ...] = ()
    """Publisher public keys (files, or directories of ``*.pub``). Given: kvnet block tracks are cached
    only when complete and signed by one of them, and a later PUBLISH of a block someone else is
    publishing is collected instead of refused (``relay.admission``)."""
    trust_any: bool = False
    """Run without a trust set, knowingly: kvnet block tracks are cached from whoever pushes them first,
    so any session may squat a prompt's track names or push forged blocks first and deny its sharing.
    ``kvnet-relay`` refuses to start with neither ``trust`` nor this (``NO_TRUST``)."""
    upstream_token: Path | None = None
    """File with the token this relay presents to its upstream relays in SETUP."""
    upstream_tls: TlsConfig | None = None
    """TLS toward the upstream relays (CA that verifies them, certificate we present); None: ``tls``.
    Set by ``relay.workers``, whose workers verify their hub with a CA of its own."""
    workers: int = 1
    """Processes serving ``port`` (``relay.workers``: SO_REUSEPORT sockets and a hub); 1: this process."""
    hub: bool = False
    """This relay is the hub of ``relay.workers``: a request that no announced route answers is also asked
    of every other session (each a worker with its own cache) before the upstream relays."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)

    def __post_init__(self) -> None:
        if self.tls.cert_file is None:
            raise ValueError("tls: a relay needs cert and key")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if not 0 <= self.qmux_port <= 65535:
            raise ValueError(f"qmux_port must be in 0..65535, got {self.qmux_port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in 0..65535, got {self.metrics_port}")
        for url in self.upstreams:
            parse_moqt_url(url)  # raises ValueError naming the URL
        upstream_tls = self.upstream_tls or self.tls
        if self.upstreams and upstream_tls.ca_file is None and upstream_tls.ca_pem is None:
            raise ValueError("upstreams: verifying upstream relays needs ca (a CA certificate file)")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be one of {LOG_FORMATS}, got {self.log_format!r}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        if not 0 <= self.auth_clock_skew <= 300:
            raise ValueError(f"auth_clock_skew must be in 0..300 s, got {self.auth_clock_skew}")
        if not 0 <= self.drain_timeout <= 3600:
            raise ValueError(f"drain_timeout must be in 0..3600 s, got {self.drain_timeout}")
        if self.goaway_uri:
            parse_moqt_url(self.goaway_uri)  # raises ValueError naming the URL
        if self.trust and self.trust_any:
            raise ValueError("--trust-any contradicts --trust (give publisher keys or accept any, not both)")
        if not 1 <= self.workers <= MAX_WORKERS:
            raise ValueError(f"workers must be in 1..{MAX_WORKERS}, got {self.workers}")
        if self.workers > 1 and self.transport.stack == "aiopquic":
            raise ValueError(
                "workers > 1 needs a QUIC stack whose socket kvnet binds (aioquic, qh3): "
                "aiopquic binds its own (run one relay per port instead)"
            )


def _integer(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{what} must be an integer, got {value!r}") from None


def _section(cls: type[Any], values: Mapping[str, Any], name: str) -> Any:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - known
    if unknown:
        raise ValueError(f"[{name}] has unknown keys: {', '.join(sorted(unknown))}")
    try:
        return cls(**values)
    except TypeError as exc:  # a value of the wrong type, e.g. a string where a number belongs
        raise ValueError(f"[{name}]: {exc}") from None


def load_config(file_data: Mapping[str, Any], overrides: Mapping[str, Any]) -> RelayConfig:
    """Merge a parsed config document with flag overrides (None means "not given") into a ``RelayConfig``.

    ``overrides`` uses the file's top-level keys plus ``cache.<field>`` / ``limits.<field>`` /
    ``transport.<field>`` for section fields.
    """
    unknown = set(file_data) - _TOP_KEYS
    if unknown:
        raise ValueError(f"config file has unknown keys: {', '.join(sorted(unknown))}")
    top: dict[str, Any] = {k: v for k, v in file_data.items() if k not in ("cache", "limits", "transport")}
    sections: dict[str, dict[str, Any]] = {
        s: dict(file_data.get(s, {})) for s in ("cache", "limits", "transport")
    }
    for key, value in overrides.items():
        if value is None:
            continue
        sec, dot, sub = key.partition(".")
        if dot:
            sections[sec][sub] = value
        else:
            top[key] = value
    if "cert" not in top or "key" not in top:
        raise ValueError("cert and key are required (flags --cert/--key or the config file)")
    tls = TlsConfig(
        ca_file=Path(top["ca"]) if top.get("ca") else None,
        cert_file=Path(top["cert"]),
        key_file=Path(top["key"]),
        require_client_cert=bool(top.get("require_client_cert", False)),
    )
    host, port = parse_hostport(str(top.get("listen", DEFAULT_LISTEN)), "listen")
    qmux_host, qmux_port = None, 0
    if top.get("listen_qmux"):
        qmux_host, qmux_port = parse_hostport(str(top["listen_qmux"]), "listen-qmux")
    metrics = str(top.get("metrics", DEFAULT_METRICS))
    metrics_host, metrics_port = ("127.0.0.1", None) if not metrics else parse_hostport(metrics, "metrics")
    upstream = top.get("upstream", ())
    if isinstance(upstream, str):
        upstream = (upstream,)
    issuer_keys = top.get("auth_issuer_keys", ())
    if isinstance(issuer_keys, str):
        issuer_keys = (issuer_keys,)
    upstream_token = top.get("upstream_token")
    trust = top.get("trust", ())
    if isinstance(trust, str):
        trust = (trust,)
    return RelayConfig(
        tls=tls,
        host=host,
        port=port,
        qmux_host=qmux_host,
        qmux_port=qmux_port,
        upstreams=tuple(str(u) for u in upstream),
        metrics_host=metrics_host,
        metrics_port=metrics_port,
        log_format=str(top.get("log_format", "kv")),
        log_level=str(top.get("log_level", "info")),
        drain_timeout=float(top.get("drain_timeout", 5.0)),
        goaway_uri=str(top.get("goaway_uri", "")),
        auth_issuer_keys=tuple(Path(k) for k in issuer_keys),
        auth_clock_skew=float(top.get("auth_clock_skew", DEFAULT_CLOCK_SKEW_S)),
        upstream_token=Path(upstream_token) if upstream_token else None,
        trust=tuple(Path(t) for t in trust),
        trust_any=bool(top.get("trust_any", False)),
        workers=_integer(top.get("workers", 1), "workers"),
        cache=_section(CacheConfig, sections["cache"], "cache"),
        limits=_section(LimitsConfig, sections["limits"], "limits"),
        transport=_section(TransportConfig, sections["transport"], "transport"),
    )


NO_TRUST = (
    "no --trust: any session could deny sharing through this relay (PUBLISH a prompt's block tracks "
    "first, or push forged blocks first); give --trust with the publishers' public keys, or --trust-any "
    "to accept that"
)
"""Why ``kvnet-relay`` without ``trust`` and without ``trust_any`` does not start (one line)."""


def startup_reason(exc: Exception, config: RelayConfig) -> str:
    """The one-line reason a relay could not start: what ``serve`` raised while reading its files or
    binding its sockets, named by the flag it concerns."""
    if not isinstance(exc, OSError) or not exc.strerror:
        return str(exc)
    if exc.filename is not None:
        return f"{exc.filename}: {exc.strerror}"
    if exc.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
        # asyncio's TCP server (the metrics endpoint) words its bind errors so; the QUIC socket is UDP.
        if "while attempting to bind" in exc.strerror:
            return metrics_port_unusable(config.metrics_host, config.metrics_port, exc.strerror)
        return (
            f"--listen {config.host}:{config.port}: cannot listen: {exc.strerror} (--listen HOST:PORT "
            "moves the relay)"
        )
    return exc.strerror


def metrics_port_unusable(host: str, port: int | None, reason: str) -> str:
    """The one line for a metrics port that cannot be bound (9464 by default: another relay or an exporter
    may hold it), naming the flag that moves it."""
    reason = reason.rpartition(": ")[2].lower()
    return (
        f"--metrics {host}:{port}: cannot listen: {reason} (--metrics HOST:PORT moves the metrics endpoint, "
        '--metrics "" turns it off)'
    )
