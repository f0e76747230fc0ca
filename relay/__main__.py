"""``kvnet-relay``: parse flags and an optional TOML file into a ``RelayConfig``, set up logging, serve.

This is the only place that reads the command line, files named on it, or the environment.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvnet.logs import LOG_FORMATS, LOG_LEVELS, setup_logging
from kvnet.net.quic import LINK_PRESETS
from kvnet.settings import parse_settings, settings_parser, size_arg
from relay.config import RelayConfig, load_config, read_toml


def build_parser() -> argparse.ArgumentParser:
    p = settings_parser(
        "kvnet-relay", "MoQT draft-18 caching relay (native QUIC, ALPN moqt-18)", config_file=False
    )
    p.add_argument("--config", type=Path, help="TOML config file; flags override its values")
    p.add_argument("--listen", help="UDP host:port to listen on (default 127.0.0.1:4443; port 0 = any)")
    p.add_argument("--cert", help="TLS certificate chain (PEM)")
    p.add_argument("--key", help="TLS private key (PEM)")
    p.add_argument("--ca", help="CA certificate(s) to verify upstream relays and client certificates")
    p.add_argument(
        "--require-client-cert", action="store_true", default=None, help="reject clients without a cert"
    )
    p.add_argument(
        "--upstream", action="append", help="moqt://host:port of an upstream relay (repeatable, in order)"
    )
    p.add_argument(
        "--auth-issuer-key",
        action="append",
        help="trusted token issuer public key (PEM, repeatable); given: authorization is required",
    )
    p.add_argument(
        "--auth-clock-skew",
        type=float,
        help="seconds a token stays accepted past its expiry, for issuer/relay clock skew (default 5)",
    )
    p.add_argument(
        "--trust",
        action="append",
        help="publisher public key (PEM file or directory of *.pub, repeatable): cache only blocks it signed",
    )
    p.add_argument("--upstream-token", help="file with the token presented to upstream relays in SETUP")
    p.add_argument("--metrics", help='Prometheus endpoint host:port (default 127.0.0.1:9464; "" disables)')
    p.add_argument("--log-format", choices=LOG_FORMATS)
    p.add_argument("--log-level", choices=LOG_LEVELS)
    p.add_argument("--drain-timeout", type=float, help="seconds between GOAWAY and close on SIGTERM")
    g = p.add_argument_group("cache")
    g.add_argument("--cache-bytes", type=size_arg, help="cache byte budget")
    g.add_argument("--cache-track-bytes", type=size_arg, help="largest single upstream response held")
    g.add_argument("--cache-inflight-bytes", type=size_arg, help="bytes of all upstream responses in flight")
    g.add_argument("--cache-dir", help="directory of the persistent cache tier (default: memory only)")
    g.add_argument("--cache-dir-bytes", type=size_arg, help="most bytes of files kept in --cache-dir (1 GiB)")
    g.add_argument("--negative-ttl", type=float, help="seconds a DOES_NOT_EXIST TRACK_STATUS is reused")
    g.add_argument("--cache-share-depth", type=int, help="namespace fields naming a cache share group (4)")
    g.add_argument(
        "--cache-share-bytes", type=size_arg, help="most bytes one share group may hold (0: fraction)"
    )
    g.add_argument("--cache-share-fraction", type=float, help="share of the cache one group may hold (1.0)")
    g = p.add_argument_group("limits")
    g.add_argument("--max-sessions", type=int)
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
        "--max-buffered-bytes-per-address", type=int, help="bytes queued toward one source IP (0 = no quota)"
    )
    g.add_argument(
        "--max-buffered-bytes-per-identity",
        type=int,
        help="bytes queued toward one token subject's sessions (0 = no quota)",
    )
    g.add_argument(
        "--pressure-idle-timeout",
        type=float,
        help="idle seconds after which a session is closed when the session table is 90%% full (0 = off)",
    )
    g.add_argument("--max-requests-per-session", type=int)
    g.add_argument("--max-requests", type=int, help="requests open on all sessions together")
    g.add_argument(
        "--reserved-requests-per-session", type=int, help="requests a session may open past --max-requests"
    )
    g.add_argument("--max-object-bytes", type=size_arg)
    g.add_argument("--max-buffered-bytes", type=size_arg, help="per-session bytes queued toward a slow peer")
    g.add_argument(
        "--max-buffered-bytes-total", type=size_arg, help="bytes buffered for all sessions together"
    )
    g.add_argument("--upstream-timeout", type=float)
    g.add_argument(
        "--upstream-idle-timeout",
        type=float,
        help="seconds of silence before an upstream relay counts as dead (3)",
    )
    g.add_argument(
        "--route-timeout",
        type=float,
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
    g.add_argument("--quic-stack", choices=("aioquic", "qh3"), help="QUIC implementation")
    size = g.add_mutually_exclusive_group()
    size.add_argument(
        "--max-datagram-size", type=int, help="QUIC datagram size (16384 loopback, 1452 ethernet)"
    )
    size.add_argument(
        "--link", choices=list(LINK_PRESETS),
        help="datagram size preset: ethernet (1452), jumbo (8952), loopback (the stack's loopback size, 1452 "
        "to peers off this host); never above what a peer advertises",
    )
    g.add_argument("--socket-buffer", type=size_arg, help="UDP SO_RCVBUF/SO_SNDBUF bytes")
    g.add_argument("--max-data", type=size_arg, help="connection flow-control window")
    g.add_argument("--max-stream-data", type=size_arg, help="per-stream flow-control window")
    g.add_argument("--congestion-control", choices=("reno", "cubic"))
    g.add_argument("--idle-timeout", type=float, help="seconds without packets before a peer counts as dead")
    g.add_argument("--keepalive-interval", type=float, help="PING after S idle seconds (0 = off)")
    return p


def config_from_args(args: argparse.Namespace) -> RelayConfig:
    file_data = read_toml(args.config) if args.config else {}
    overrides: dict[str, Any] = {
        "listen": args.listen,
        "cert": args.cert,
        "key": args.key,
        "ca": args.ca,
        "require_client_cert": args.require_client_cert,
        "upstream": args.upstream,
        "metrics": args.metrics,
        "log_format": args.log_format,
        "log_level": args.log_level,
        "drain_timeout": args.drain_timeout,
        "auth_issuer_keys": args.auth_issuer_key,
        "auth_clock_skew": args.auth_clock_skew,
        "upstream_token": args.upstream_token,
        "trust": args.trust,
        "cache.max_bytes": args.cache_bytes,
        "cache.max_track_bytes": args.cache_track_bytes,
        "cache.max_inflight_bytes": args.cache_inflight_bytes,
        "cache.negative_ttl": args.negative_ttl,
        "cache.dir": args.cache_dir,
        "cache.dir_bytes": args.cache_dir_bytes,
        "cache.share_depth": args.cache_share_depth,
        "cache.share_bytes": args.cache_share_bytes,
        "cache.share_fraction": args.cache_share_fraction,
        "limits.max_sessions": args.max_sessions,
        "limits.max_sessions_per_address": args.max_sessions_per_address,
        "limits.max_sessions_per_identity": args.max_sessions_per_identity,
        "limits.max_requests_per_address": args.max_requests_per_address,
        "limits.max_requests_per_identity": args.max_requests_per_identity,
        "limits.max_buffered_bytes_per_address": args.max_buffered_bytes_per_address,
        "limits.max_buffered_bytes_per_identity": args.max_buffered_bytes_per_identity,
        "limits.pressure_idle_timeout": args.pressure_idle_timeout,
        "limits.max_requests_per_session": args.max_requests_per_session,
        "limits.max_requests": args.max_requests,
        "limits.reserved_requests_per_session": args.reserved_requests_per_session,
        "limits.max_object_bytes": args.max_object_bytes,
        "limits.max_buffered_bytes_per_session": args.max_buffered_bytes,
        "limits.max_buffered_bytes": args.max_buffered_bytes_total,
        "limits.upstream_timeout": args.upstream_timeout,
        "limits.upstream_idle_timeout": args.upstream_idle_timeout,
        "limits.route_timeout": args.route_timeout,
        "limits.setup_timeout": args.setup_timeout,
        "limits.session_idle_timeout": args.session_idle_timeout,
        "limits.request_header_timeout": args.request_header_timeout,
        "limits.max_request_header_timeouts": args.max_request_header_timeouts,
        "limits.slow_peer_timeout": args.slow_peer_timeout,
        "transport.stack": args.quic_stack,
        "transport.max_datagram_size": (
            args.max_datagram_size if args.link is None else LINK_PRESETS[args.link]
        ),
        "transport.socket_receive_buffer": args.socket_buffer,
        "transport.socket_send_buffer": args.socket_buffer,
        "transport.max_data": args.max_data,
        "transport.max_stream_data": args.max_stream_data,
        "transport.congestion_control": args.congestion_control,
        "transport.idle_timeout": args.idle_timeout,
        "transport.keepalive_interval": args.keepalive_interval,
    }
    config = load_config(file_data, overrides)
    if args.link == "loopback":  # its size is None, which the overrides read as "not given"
        transport = dataclasses.replace(config.transport, max_datagram_size=None)
        config = dataclasses.replace(config, transport=transport)
    return config


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parse_settings(parser, argv, env_prefix="KVNET_RELAY_", yaml_config=False)
    try:
        config = config_from_args(args)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    setup_logging(config.log_format, config.log_level)
    from kvnet.net.endpoint import freeze_startup_objects
    from relay.relay import serve  # after logging, so import-time warnings are formatted too

    freeze_startup_objects()
    try:
        asyncio.run(serve(config))
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
