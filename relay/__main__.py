"""``kvnet-relay``: parse flags, the environment and a config file into a ``RelayConfig``, log, serve.

Every flag also comes from ``KVNET_RELAY_<FLAG>`` and from the config file (``--config FILE``, YAML as for
the nodes: flag names as keys, plus ``cache:``, ``limits:`` and ``transport:`` mappings for the
``CacheConfig`` / ``LimitsConfig`` / ``TransportConfig`` fields that have no flag; a ``.toml`` file with
the same keys is still read). This is the only place that reads the command line, files named on it, or
the environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from kvnet.config import config_parser, format_size, parse_config, size_arg
from kvnet.logs import add_log_arguments, setup_logging_from_args
from kvnet.net.config import LINK_PRESETS, STACKS, TransportConfig
from kvnet.net.registry import get_stack, server_configuration
from kvnet.net.url import QMUX
from kvnet.security.certs import check_tls_files
from kvnet.security.tokens import DEFAULT_CLOCK_SKEW_S
from relay.cache import CacheConfig
from relay.config import (
    CONFIG_SECTIONS,
    DEFAULT_LISTEN,
    DEFAULT_METRICS,
    MAX_WORKERS,
    NO_TRUST,
    RelayConfig,
    load_config,
    startup_reason,
)
from relay.limits import LimitsConfig

_SECTION_CLASSES: dict[str, type[Any]] = {
    "cache": CacheConfig, "limits": LimitsConfig, "transport": TransportConfig,
}

# Flags that set a field of a config section: argparse default None ("not given"), so that the file's
# section value, or else the dataclass default (shown in --help), applies.
SECTION_FLAGS: dict[str, str] = {
    "cache_bytes": "cache.max_bytes",
    "cache_track_bytes": "cache.max_track_bytes",
    "cache_inflight_bytes": "cache.max_inflight_bytes",
    "negative_ttl": "cache.negative_ttl",
    "cache_dir": "cache.dir",
    "cache_dir_bytes": "cache.dir_bytes",
    "cache_share_depth": "cache.share_depth",
    "cache_share_bytes": "cache.share_bytes",
    "cache_share_fraction": "cache.share_fraction",
    "max_sessions": "limits.max_sessions",
    "max_sessions_per_address": "limits.max_sessions_per_address",
    "max_sessions_per_identity": "limits.max_sessions_per_identity",
    "max_requests_per_address": "limits.max_requests_per_address",
    "max_requests_per_identity": "limits.max_requests_per_identity",
    "max_buffered_bytes_per_address": "limits.max_buffered_bytes_per_address",
    "max_buffered_bytes_per_identity": "limits.max_buffered_bytes_per_identity",
    "pressure_idle_timeout": "limits.pressure_idle_timeout",
    "max_requests_per_session": "limits.max_requests_per_session",
    "max_requests": "limits.max_requests",
    "reserved_requests_per_session": "limits.reserved_requests_per_session",
    "max_object_bytes": "limits.max_object_bytes",
    "max_buffered_bytes": "limits.max_buffered_bytes_per_session",
    "max_buffered_bytes_total": "limits.max_buffered_bytes",
    "max_held_bytes_per_session": "limits.max_held_bytes_per_session",
    "max_held_bytes_per_address": "limits.max_held_bytes_per_address",
    "max_held_bytes_per_identity": "limits.max_held_bytes_per_identity",
    "max_held_bytes": "limits.max_held_bytes",
    "upstream_timeout": "limits.upstream_timeout",
    "upstream_idle_timeout": "limits.upstream_idle_timeout",
    "route_timeout": "limits.route_timeout",
    "setup_timeout": "limits.setup_timeout",
    "session_idle_timeout": "limits.session_idle_timeout",
    "request_header_timeout": "limits.request_header_timeout",
    "max_request_header_timeouts": "limits.max_request_header_timeouts",
    "slow_peer_timeout": "limits.slow_peer_timeout",
    "quic_stack": "transport.stack",
    "max_datagram_size": "transport.max_datagram_size",
    "max_data": "transport.max_data",
    "max_stream_data": "transport.max_stream_data",
    "congestion_control": "transport.congestion_control",
    "idle_timeout": "transport.idle_timeout",
    "keepalive_interval": "transport.keepalive_interval",
}
# Flags read as they are (argparse default = the real default), named as load_config's top-level keys.
TOP_FLAGS = (
    "listen", "listen_qmux", "cert", "key", "ca", "require_client_cert", "upstream", "metrics", "log_format",
    "log_level", "drain_timeout", "goaway_uri", "auth_issuer_keys", "auth_clock_skew", "upstream_token",
    "trust", "trust_any", "workers",
)


def _show_default(action: argparse.Action) -> None:
    """Append a section flag's default (the dataclass field's) to its help."""
    section, _, name = SECTION_FLAGS[action.dest].partition(".")
    default = next(f for f in dataclasses.fields(_SECTION_CLASSES[section]) if f.name == name).default
    shown = format_size(default) if action.type is size_arg and isinstance(default, int) else default
    if action.dest == "max_datagram_size" and default is None:
        shown = "the stack's loopback size"
    text = action.help or ""
    action.help = f"{text} (default: {shown if shown not in (None, '') else 'none'})".lstrip()


def build_parser() -> argparse.ArgumentParser:
    p = config_parser("kvnet-relay", "MoQT draft-18 caching relay (native QUIC, ALPN moqt-18)")
    p.add_argument("--listen", default=DEFAULT_LISTEN, help="UDP host:port to listen on (port 0 = any)")
    p.add_argument(
        "--listen-qmux", metavar="HOST:PORT",
        help="also serve MoQT over QMux (TLS 1.3 over TCP, moqt+qmux:// URLs, ALPN moqt-18-qmux-01) on this "
        "TCP host:port, with the same cache, limits and metrics (port 0 = any)",
    )
    p.add_argument("--cert", help="TLS certificate chain (PEM; required)")
    p.add_argument("--key", help="TLS private key (PEM; required)")
    p.add_argument("--ca", help="CA certificate(s) to verify upstream relays and client certificates")
    p.add_argument("--require-client-cert", action="store_true", help="reject clients without a cert")
    p.add_argument(
        "--upstream", action="append",
        help="moqt://host:port (QUIC) or moqt+qmux://host:port (QMux) of an upstream relay (repeatable, "
        "in order)",
    )
    p.add_argument(
        "--auth-issuer-key", dest="auth_issuer_keys", action="append", metavar="PEM",
        help="trusted token issuer public key (PEM, repeatable); given: authorization is required",
    )
    p.add_argument(
        "--auth-clock-skew", type=float, default=DEFAULT_CLOCK_SKEW_S,
        help="seconds a token stays accepted past its expiry, for issuer/relay clock skew",
    )
    p.add_argument(
        "--trust", action="append",
        help="publisher public key (PEM file or directory of *.pub, repeatable): cache only blocks it signed",
    )
    p.add_argument(
        "--trust-any", action="store_true", default=None,
        help="run without --trust, accepting that any session can deny sharing by squatting a prompt's "
        "block tracks or pushing forged blocks first (without either flag the relay does not start)",
    )
    p.add_argument("--upstream-token", help="file with the token presented to upstream relays in SETUP")
    p.add_argument(
        "--metrics", default=DEFAULT_METRICS,
        help='Prometheus endpoint host:port ("" disables; with --workers N, worker i on port + i, the hub on '
        "port + N)",
    )
    p.add_argument(
        "--workers", type=int, default=1,
        help=f"processes serving the port (SO_REUSEPORT; 1..{MAX_WORKERS}): each a relay with its share of "
        "the cache and limits, joined through a hub relay on a private loopback port",
    )
    add_log_arguments(p)
    p.add_argument(
        "--drain-timeout", type=float, default=5.0, help="seconds between GOAWAY and close on SIGTERM"
    )
    p.add_argument(
        "--goaway-uri", default="", metavar="URL",
        help="moqt://host:port the shutdown GOAWAY names as where clients reconnect (e.g. a standby relay)",
    )
    g = p.add_argument_group("cache")
    g.add_argument("--cache-bytes", type=size_arg, help="cache byte budget")
    g.add_argument("--cache-track-bytes", type=size_arg, help="largest single upstream response held")
    g.add_argument("--cache-inflight-bytes", type=size_arg, help="bytes of all upstream responses in flight")
    g.add_argument("--cache-dir", help="directory of the persistent cache tier (none: memory only)")
    g.add_argument("--cache-dir-bytes", type=size_arg, help="most bytes of files kept in --cache-dir")
    g.add_argument("--negative-ttl", type=float, help="seconds a DOES_NOT_EXIST TRACK_STATUS is reused")
    g.add_argument("--cache-share-depth", type=int, help="namespace fields naming a cache share group")
    g.add_argument(
        "--cache-share-bytes", type=size_arg, help="most bytes one share group may hold (0: the fraction)"
    )
    g.add_argument("--cache-share-fraction", type=float, help="share of the cache one group may hold")
    g = p.add_argument_group("limits")
    g.add_argument("--max-sessions", type=int, help="concurrent sessions")
    g.add_argument("--max-sessions-per-address", type=int, help="sessions from one source IP (0 = no quota)")
    g.add_argument(
        "--max-sessions-per-identity", type=int, help="sessions of one token subject (0 = no quota)"
    )
    g.add_argument(
        "--max-requests-per-address", type=int, help="open requests of one source IP (0 = no quota)"
    )
    g.add_argument(
        "--max-requests-per-identity", type=int, help="open requests of one token subject (0 = no quota)"
    )
    g.add_argument(
        "--max-buffered-bytes-per-address", type=size_arg,
        help="bytes queued toward one source IP (0 = no quota)",
    )
    g.add_argument(
        "--max-buffered-bytes-per-identity", type=size_arg,
        help="bytes queued toward one token subject's sessions (0 = no quota)",
    )
    g.add_argument(
        "--pressure-idle-timeout", type=float,
        help="idle seconds after which a session is closed when the session table is 90%% full (0 = off)",
    )
    g.add_argument("--max-requests-per-session", type=int, help="open requests of one session")
    g.add_argument("--max-requests", type=int, help="requests open on all sessions together")
    g.add_argument(
        "--reserved-requests-per-session", type=int, help="requests a session may open past --max-requests"
    )
    g.add_argument("--max-object-bytes", type=size_arg, help="largest object accepted")
    g.add_argument("--max-buffered-bytes", type=size_arg, help="per-session bytes queued toward a slow peer")
    g.add_argument(
        "--max-buffered-bytes-total", type=size_arg, help="bytes buffered for all sessions together"
    )
    g.add_argument(
        "--max-held-bytes-per-session", type=size_arg,
        help="bytes of a session's pushed, not yet cached tracks the relay holds (oldest dropped beyond)",
    )
    g.add_argument(
        "--max-held-bytes-per-address", type=size_arg,
        help="the same for all sessions of one source IP (0 = no quota)",
    )
    g.add_argument(
        "--max-held-bytes-per-identity", type=size_arg,
        help="the same for all sessions of one token subject (0 = no quota)",
    )
    g.add_argument("--max-held-bytes", type=size_arg, help="the same for all sessions together")
    g.add_argument("--upstream-timeout", type=float, help="seconds an upstream relay has to answer a request")
    g.add_argument(
        "--upstream-idle-timeout", type=float,
        help="seconds of silence before an upstream relay counts as dead",
    )
    g.add_argument(
        "--route-timeout", type=float,
        help="seconds before a silent route is passed over for the next (0 = off)",
    )
    g.add_argument("--setup-timeout", type=float, help="seconds to complete the handshake and SETUP")
    g.add_argument(
        "--session-idle-timeout", type=float, help="close sessions without requests after S seconds (0 = off)"
    )
    g.add_argument(
        "--request-header-timeout", type=float, help="seconds to complete a request's first message (0 = off)"
    )
    g.add_argument("--max-request-header-timeouts", type=int, help="late request streams before closing")
    g.add_argument("--slow-peer-timeout", type=float, help="seconds a peer may read nothing while data waits")
    g = p.add_argument_group("transport")
    g.add_argument("--quic-stack", choices=STACKS, help="QUIC implementation (aiopquic: Python >= 3.12)")
    size = g.add_mutually_exclusive_group()
    size.add_argument("--max-datagram-size", type=int, help="QUIC datagram size (1452 ethernet)")
    size.add_argument(
        "--link", choices=list(LINK_PRESETS),
        help="datagram size preset: ethernet (1452), jumbo (8952), loopback (the stack's loopback size, 1452 "
        "to peers off this host); never above what a peer advertises (default: none)",
    )
    g.add_argument(
        "--socket-buffer", type=size_arg,
        help="UDP SO_RCVBUF/SO_SNDBUF bytes "
        f"(default: {format_size(TransportConfig().socket_receive_buffer)})",
    )
    g.add_argument("--max-data", type=size_arg, help="connection flow-control window")
    g.add_argument("--max-stream-data", type=size_arg, help="per-stream flow-control window")
    g.add_argument("--congestion-control", choices=("reno", "cubic"), help="congestion controller")
    g.add_argument("--idle-timeout", type=float, help="seconds without packets before a peer counts as dead")
    g.add_argument("--keepalive-interval", type=float, help="PING after S idle seconds (0 = off)")
    for action in p._actions:  # argparse offers no public list of its actions
        if action.dest in SECTION_FLAGS:
            _show_default(action)
    return p


def config_from_args(args: argparse.Namespace) -> RelayConfig:
    overrides: dict[str, Any] = {key: getattr(args, key) for key in TOP_FLAGS}
    overrides.update({key: getattr(args, dest) for dest, key in SECTION_FLAGS.items()})
    if args.link is not None:
        overrides["transport.max_datagram_size"] = LINK_PRESETS[args.link]
    for name in ("socket_receive_buffer", "socket_send_buffer"):
        overrides[f"transport.{name}"] = args.socket_buffer
    config = load_config(getattr(args, "config_sections", {}), overrides)
    if args.link == "loopback":  # its size is None, which the overrides read as "not given"
        transport = dataclasses.replace(config.transport, max_datagram_size=None)
        config = dataclasses.replace(config, transport=transport)
    return config


def parse_args(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> argparse.Namespace:
    """The command line over ``KVNET_RELAY_*`` (``env``, default ``os.environ``) over the config file."""
    return parse_config(parser, argv, env=env, env_prefix="KVNET_RELAY_", config_sections=CONFIG_SECTIONS)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parse_args(parser, argv)
    try:
        config = config_from_args(args)
        check_tls_files(config.tls.ca_file, config.tls.cert_file, config.tls.key_file)
        # A stack that cannot load (aiopquic needs Python >= 3.12) or cannot do the TLS asked (client
        # certificates: aioquic only) is a usage error, before anything starts.
        server_configuration(config.transport, config.tls)
        if config.qmux_host is not None:
            get_stack(QMUX).server_configuration(config.transport, config.tls)
        if config.workers > 1:
            from relay.workers import check_metrics_ports

            check_metrics_ports(config)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    if not config.trust and not config.trust_any:
        print(f"kvnet-relay: error: {NO_TRUST}", file=sys.stderr)
        return 2
    setup_logging_from_args(args)
    if config.workers > 1:
        from relay.workers import run_workers

        level = "debug" if args.verbose else args.log_level
        try:
            return run_workers(config, args.log_format, level)
        except (OSError, ValueError) as exc:
            print(f"kvnet-relay: error: {startup_reason(exc, config)}", file=sys.stderr)
            return 2
    from relay.server import run, serve  # after logging, so import-time warnings are formatted too

    return run(config, serve(config))


if __name__ == "__main__":
    sys.exit(main())
