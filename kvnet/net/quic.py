"""QUIC for kvnet peers (relay, nodes): settings, TLS configuration and the three stacks behind them.

Owns: the tuned transport knobs (``TransportSettings``), TLS material (``TlsSettings``), ``moqt://`` URL
parsing, UDP socket buffer sizing, and the QUIC stack adapter: choosing aioquic (pure Python), qh3 (the
same asyncio API over a Rust core) or aiopquic (picoquic, a C core on its own thread; Python >= 3.12,
adapted in ``kvnet.net.aiopquic_stack``) by ``TransportSettings.stack``, building its client and server
configuration, and everything else that differs between them, so that ``kvnet.net.connection`` has one
code path. Knows nothing about MoQT messages; ``kvnet.net.connection`` is the protocol glue.

Why the defaults are what they are (2 cores, loopback, bulk one-way transfer, see
``benchmarks/bench_transport.py``): aioquic's defaults (1200-byte datagrams, 1 MiB windows, the kernel's
default socket buffers) reach only a few tens of MB/s because the cost is per packet, not per byte. Large
datagrams cut the packet count, large socket buffers stop the kernel dropping bursts that aioquic then has to
recover, and larger flow-control windows keep the pipe full.

Differences between the stacks handled here (aioquic 1.7 / qh3 2.x):

- Configuration: qh3 has no ``congestion_control_algorithm`` (its core picks one), and
  ``max_datagram_size`` is an upper bound that it reaches by path-MTU probing from 1280 bytes, while
  aioquic uses it from the first packet and silently stalls above 16384.
- Receive path: qh3's client transport reads batches with GRO and calls ``datagrams_received(list)``,
  never ``datagram_received``; a protocol must hook both.
- Transmits: aioquic's protocol transmits after every received datagram (a walk over all open
  streams each time); ``arm_timer`` lets ``kvnet.net.connection`` transmit every few datagrams instead.
- Send buffer: aioquic keeps every unacknowledged byte in the stream's sender buffer; qh3 reports bytes
  not yet sent once (``get_send_buffer_size``). Both work as a back-pressure measure.
- Stream limits: neither has a setting (aioquic grants 128 concurrent peer streams, qh3 100), so we raise
  them before the handshake announces them.
- TLS: qh3 and aiopquic servers cannot request a client certificate, so ``require_client_cert`` needs
  aioquic there.
- aiopquic owns its socket and sends from picoquic's thread: no datagram callbacks, no transmits, its
  own keep-alive and path-MTU probing (see ``kvnet.net.aiopquic_stack``).
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import socket
import ssl
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

from aioquic.quic.congestion import base as _cc_base
from aioquic.quic.congestion.cubic import CubicCongestionControl
from aioquic.quic.congestion.reno import RenoCongestionControl

logger = logging.getLogger(__name__)

ALPN_MOQT = "moqt-18"
DEFAULT_PORT = 4443

STACKS = ("aioquic", "qh3", "aiopquic")
# Chosen by measurement (docs/performance.md): qh3 moves bulk data 4-7x faster client -> server, but
# its servers send ~1400-byte datagrams and cannot require client certificates, and as a client it
# locates in 1-2 more round trips through an aioquic relay; so aioquic is the default and qh3 is opt-in.
DEFAULT_STACK = "aioquic"

# Datagram sizes. Every rule about the UDP payload size we send lives with these constants and
# ``TransportSettings.datagram_size``.
# RFC 9000 minimum: every QUIC path must carry 1200-byte datagrams.
MIN_DATAGRAM_SIZE = 1200
# aioquic builds packets into a fixed buffer; above this it corrupts or stalls without an error, so we refuse.
MAX_DATAGRAM_SIZE_LIMIT = 16384
# qh3 takes any UDP payload size (65507 is the IPv4 maximum) and probes the path MTU up to it.
MAX_DATAGRAM_SIZE_QH3 = 65507
# Loopback has a 64 KiB MTU; 16384 is the largest size aioquic handles correctly.
DATAGRAM_SIZE_LOOPBACK = 16384
# qh3 on loopback: the largest size measured safe and fastest (benchmarks/bench_transport.py).
DATAGRAM_SIZE_QH3_LOOPBACK = 65507
# aiopquic: picoquic probes the path MTU up to its compile-time packet size and no further, whatever the
# link, and never above the peer's max_udp_payload_size (it advertises 1440 itself). Seen on loopback
# through kvnet/tools/linkemu: 1536 to aioquic peers configured for 8952, 1472 to qh3, 1452 to aioquic at
# 1452, 1440 to aiopquic.
MAX_DATAGRAM_SIZE_AIOPQUIC = 1536
# picoquic's first packets (its initial MTU, IPv4); with probing off it stays there.
INITIAL_DATAGRAM_SIZE_AIOPQUIC = 1252
# A 1500-byte Ethernet path: 1500 - 40 (IPv6) - 8 (UDP) = 1452. Use this for anything leaving the host
# unless every hop is known to carry jumbo frames (then 8952 for a 9000-byte MTU).
DATAGRAM_SIZE_ETHERNET = 1452
DATAGRAM_SIZE_JUMBO = 8952
# Link presets (``--link``): the datagram size for the kind of path a deployment runs on. "loopback" is
# the stack's loopback size to peers on this machine and 1452 to any other (``choose_datagram_size``);
# every preset is capped by what the peer advertises.
LINK_PRESETS: dict[str, int | None] = {
    "ethernet": DATAGRAM_SIZE_ETHERNET,
    "jumbo": DATAGRAM_SIZE_JUMBO,
    "loopback": None,
}

CONGESTION_CONTROLLERS = ("reno", "cubic")
# Ceilings on what a settings object may request, so a typo cannot ask for terabytes of window.
_MAX_WINDOW = 1 << 32
_MAX_SOCKET_BUFFER = 1 << 30
_MAX_STREAMS = 1 << 20


@dataclass(frozen=True, slots=True)
class TransportSettings:
    """QUIC transport knobs shared by every kvnet endpoint. Defaults are tuned for loopback and LANs."""

    max_datagram_size: int | None = None
    """Largest UDP payload we send, and (when set) the ``max_udp_payload_size`` we advertise. None: the
    stack's loopback size (``datagram_size``) to peers on this machine, ``DATAGRAM_SIZE_ETHERNET`` (1452)
    to any other (aioquic does no path-MTU discovery). Set it only where the path is known to carry it
    (jumbo frames); either way a peer advertising less gets no more (``choose_datagram_size``). qh3
    treats it as the upper bound of its path-MTU probing."""
    stack: str = DEFAULT_STACK
    """QUIC implementation: "aioquic" (pure Python; the only one whose servers can require client
    certificates), "qh3" (Rust core) or "aiopquic" (picoquic's C core; Python >= 3.12, at most
    ``MAX_DATAGRAM_SIZE_AIOPQUIC``-byte datagrams). See the module docstring."""
    socket_receive_buffer: int = 4 << 20
    """SO_RCVBUF in bytes (4 MiB). The kernel default (~208 KiB) overflows under bursts of large datagrams."""
    socket_send_buffer: int = 4 << 20
    """SO_SNDBUF in bytes (4 MiB)."""
    max_data: int = 32 << 20
    """Connection-level flow-control window we grant (aioquic doubles it as it is consumed)."""
    max_stream_data: int = 8 << 20
    """Per-stream flow-control window we grant. A KV block per layer is far below this."""
    max_streams_bidi: int = 16384
    """Concurrent peer-opened bidirectional streams. kvnet opens one bidi stream per request (FETCH,
    TRACK_STATUS, ...), thousands at once; aioquic's built-in 128 would serialise them."""
    max_streams_uni: int = 4096
    """Concurrent peer-opened unidirectional streams (subgroup data streams)."""
    idle_timeout: float = 15.0
    """Seconds without a packet from the peer before the connection is dropped (QUIC max_idle_timeout;
    the smaller of both peers' values applies). With the keep-alive below a live peer is never idle
    this long, so this is how quickly a dead one (killed, unplugged) is noticed: 3 keep-alive
    intervals, enough to ride out one or two lost PINGs or ACKs."""
    keepalive_interval: float = 5.0
    """Send a QUIC PING after this many seconds without receiving anything (0 = never). The ACK it
    elicits keeps an idle but live session (a node's long-lived relay session) open on both sides.
    Must be below ``idle_timeout``."""
    congestion_control: str = "cubic"
    """"reno" or "cubic" (aioquic's implementations; qh3 uses its core's own, aiopquic picoquic's BBRv1)."""
    slow_start_rtt_exit: bool = False
    """aioquic: leave slow start as soon as the RTT rises (its HyStart-like monitor). Off by default: on
    loopback and LANs the RTT samples are scheduler noise, the monitor fires at ~1 MiB of window and cubic
    then grows so slowly that throughput halves. Loss still ends slow start."""
    handshake_timeout: float = 10.0
    """Seconds a client waits for the QUIC+TLS handshake before giving up."""
    udp_segmentation: bool = True
    """Send each transmit's runs of equal-sized datagrams with UDP GSO (``kvnet.net.gso``: one system
    call per up to 64 datagrams) where the kernel supports it; the datagrams on the wire are the same."""
    udp_receive_offload: bool = True
    """Client sockets (aioquic): read with UDP GRO, many datagrams per event-loop wakeup
    (``kvnet.net.gso.DatagramReceiver``) instead of asyncio's one per wakeup."""

    def __post_init__(self) -> None:
        if self.stack not in STACKS:
            raise ValueError(f"stack must be one of {STACKS}, got {self.stack!r}")
        limit = MAX_DATAGRAM_SIZE_LIMIT if self.stack == "aioquic" else MAX_DATAGRAM_SIZE_QH3
        # picoquic sends its initial packets at this size whatever is configured.
        smallest = INITIAL_DATAGRAM_SIZE_AIOPQUIC if self.stack == "aiopquic" else MIN_DATAGRAM_SIZE
        if self.max_datagram_size is not None and not smallest <= self.max_datagram_size <= limit:
            why = " (aioquic corrupts larger packets)" if self.stack == "aioquic" else ""
            raise ValueError(
                f"max_datagram_size must be in {smallest}..{limit} for stack {self.stack}{why}, "
                f"got {self.max_datagram_size}"
            )
        for name in ("socket_receive_buffer", "socket_send_buffer"):
            v = getattr(self, name)
            if not 0 <= v <= _MAX_SOCKET_BUFFER:
                raise ValueError(f"{name} must be in 0..{_MAX_SOCKET_BUFFER} (0 = kernel default), got {v}")
        for name in ("max_data", "max_stream_data"):
            v = getattr(self, name)
            if not 65536 <= v <= _MAX_WINDOW:
                raise ValueError(f"{name} must be in 65536..{_MAX_WINDOW}, got {v}")
        for name in ("max_streams_bidi", "max_streams_uni"):
            v = getattr(self, name)
            if not 1 <= v <= _MAX_STREAMS:
                raise ValueError(f"{name} must be in 1..{_MAX_STREAMS}, got {v}")
        if not 0.1 <= self.idle_timeout <= 3600:
            raise ValueError(f"idle_timeout must be in 0.1..3600 s, got {self.idle_timeout}")
        if self.keepalive_interval != 0 and not 0.05 <= self.keepalive_interval < self.idle_timeout:
            raise ValueError(
                f"keepalive_interval must be 0 (off) or in 0.05..idle_timeout ({self.idle_timeout} s), "
                f"got {self.keepalive_interval}"
            )
        if not 0.1 <= self.handshake_timeout <= 600:
            raise ValueError(f"handshake_timeout must be in 0.1..600 s, got {self.handshake_timeout}")
        if self.congestion_control not in CONGESTION_CONTROLLERS:
            raise ValueError(
                f"congestion_control must be one of {CONGESTION_CONTROLLERS}, got {self.congestion_control!r}"
            )

    @property
    def datagram_size(self) -> int:
        """The datagram size in effect: ``max_datagram_size``, or the stack's loopback size."""
        if self.stack == "aiopquic":
            return min(self.max_datagram_size or MAX_DATAGRAM_SIZE_AIOPQUIC, MAX_DATAGRAM_SIZE_AIOPQUIC)
        if self.max_datagram_size is not None:
            return self.max_datagram_size
        return DATAGRAM_SIZE_LOOPBACK if self.stack == "aioquic" else DATAGRAM_SIZE_QH3_LOOPBACK

    @classmethod
    def for_ethernet(cls, stack: str = DEFAULT_STACK) -> TransportSettings:
        """Settings for paths with a 1500-byte MTU (anything off-host without known jumbo frames)."""
        return cls.for_link("ethernet", stack)

    @classmethod
    def for_link(cls, link: str, stack: str = DEFAULT_STACK) -> TransportSettings:
        """Settings for a ``LINK_PRESETS`` path: "ethernet" (1452), "jumbo" (8952) or "loopback"."""
        if link not in LINK_PRESETS:
            raise ValueError(f"link must be one of {list(LINK_PRESETS)}, got {link!r}")
        return cls(max_datagram_size=LINK_PRESETS[link], stack=stack)


@dataclass(frozen=True, slots=True)
class TlsSettings:
    """TLS material. Verification is on unless ``insecure_skip_verify`` is set explicitly."""

    ca_file: Path | None = None
    """CA certificate(s) that peer certificates must chain to (``kvnet certs init`` writes ``ca.pem``).
    Clients must give one unless ``insecure_skip_verify``; servers need it only to verify client certs."""
    cert_file: Path | None = None
    """Our certificate chain (PEM). Required for servers; optional for clients (mTLS)."""
    key_file: Path | None = None
    """Our private key (PEM)."""
    server_name: str | None = None
    """Name checked against the server certificate (clients); defaults to the host in the URL."""
    require_client_cert: bool = False
    """Servers: ask clients for a certificate and reject those that do not chain to ``ca_file``."""
    insecure_skip_verify: bool = False
    """Clients: do not verify the server certificate. Debugging only; logged as a warning every time."""
    ca_pem: bytes | None = None
    """Clients: the CA certificate(s) as PEM held in memory, instead of ``ca_file`` (a CA whose file is
    gone once read, e.g. the hub's of ``kvnet-relay --workers``). aioquic and qh3 only."""

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file must be given together")
        if self.ca_pem is not None and self.ca_file is not None:
            raise ValueError("give ca_file or ca_pem, not both")
        for name in ("ca_file", "cert_file", "key_file"):
            p = getattr(self, name)
            if p is not None and not Path(p).is_file():
                raise ValueError(f"{name} {p} does not exist or is not a file")
        if self.require_client_cert and self.ca_file is None:
            raise ValueError("require_client_cert needs ca_file to verify client certificates against")

    @classmethod
    def from_dir(
        cls,
        directory: Path | str,
        name: str | None,
        *,
        server_name: str | None = None,
        require_client_cert: bool = False,
    ) -> TlsSettings:
        """TLS settings from a ``kvnet certs`` directory: ``ca.pem`` plus ``NAME.pem``/``NAME-key.pem``
        (no own certificate when ``name`` is None, e.g. a client without mTLS)."""
        d = Path(directory)
        return cls(
            ca_file=d / "ca.pem",
            cert_file=None if name is None else d / f"{name}.pem",
            key_file=None if name is None else d / f"{name}-key.pem",
            server_name=server_name,
            require_client_cert=require_client_cert,
        )


def apply_socket_buffers(
    transport_socket: socket.socket | None, settings: TransportSettings
) -> tuple[int, int] | None:
    """Set SO_RCVBUF/SO_SNDBUF and return the sizes in effect (getsockopt: the kernel doubles what it
    grants). Unprivileged processes are capped at net.core.{r,w}mem_max, so try the FORCE variants
    (CAP_NET_ADMIN) first and fall back to the capped ones, logging once when we got less than asked."""
    if transport_socket is None:
        return None
    pairs = (
        (settings.socket_receive_buffer, getattr(socket, "SO_RCVBUFFORCE", None), socket.SO_RCVBUF),
        (settings.socket_send_buffer, getattr(socket, "SO_SNDBUFFORCE", None), socket.SO_SNDBUF),
    )
    for size, force_opt, opt in pairs:
        if size <= 0:
            continue
        try:
            if force_opt is None:
                raise PermissionError
            transport_socket.setsockopt(socket.SOL_SOCKET, force_opt, size)
        except (PermissionError, OSError):
            try:
                transport_socket.setsockopt(socket.SOL_SOCKET, opt, size)
            except OSError as exc:
                logger.warning("could not set socket buffer %d: %s", size, exc)
            # Linux reports double the size it granted (the bookkeeping overhead).
            granted = transport_socket.getsockopt(socket.SOL_SOCKET, opt) // 2
            if granted < size:
                logger.info(
                    "socket buffer %s: asked %d bytes, got %d (raise net.core.%s_max or run with "
                    "CAP_NET_ADMIN)", "SO_RCVBUF" if opt == socket.SO_RCVBUF else "SO_SNDBUF", size, granted,
                    "rmem" if opt == socket.SO_RCVBUF else "wmem",
                )
    return (transport_socket.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF),
            transport_socket.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF))


@dataclass(frozen=True, slots=True)
class MoqtUrl:
    """A parsed ``moqt://host:port[/path]`` URL."""

    host: str
    port: int
    path: str = field(default="")


def parse_moqt_url(url: str) -> MoqtUrl:
    """Parse ``moqt://host[:port][/path]``; IPv6 hosts in brackets. Port defaults to ``DEFAULT_PORT``."""
    if len(url) > 2048:
        raise ValueError("URL too long")
    parts = urlsplit(url)
    if parts.scheme != "moqt":
        raise ValueError(f"expected a moqt:// URL, got {url!r}")
    if not parts.hostname:
        raise ValueError(f"URL {url!r} has no host")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"URL {url!r} has an invalid port") from exc
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"URL {url!r} may not have user info, a query or a fragment")
    return MoqtUrl(host=parts.hostname, port=port if port is not None else DEFAULT_PORT, path=parts.path)


# -------------------------------------------------------------------------------- the QUIC stack


class _NoRttExit:
    """Mixin: ignore the RTT-increase signal that makes aioquic's controllers leave slow start."""

    def on_rtt_measurement(self, *, now: float, rtt: float) -> None:
        return None


class _CubicNoRttExit(_NoRttExit, CubicCongestionControl):
    pass


class _RenoNoRttExit(_NoRttExit, RenoCongestionControl):
    pass


_NO_RTT_EXIT = {"cubic": ("kvnet-cubic", _CubicNoRttExit), "reno": ("kvnet-reno", _RenoNoRttExit)}


def aioquic_congestion_control(settings: TransportSettings) -> str:
    """The aioquic congestion-control name for ``settings`` (registering kvnet's variants on first use)."""
    if settings.slow_start_rtt_exit:
        return settings.congestion_control
    name, factory = _NO_RTT_EXIT[settings.congestion_control]
    _cc_base.register_congestion_control(name, factory)  # type: ignore[arg-type]
    return name


@dataclass(frozen=True, slots=True)
class QuicStack:
    """The symbols of one QUIC stack that kvnet uses (both stacks expose aioquic's names)."""

    name: str
    QuicConfiguration: type
    QuicConnection: type
    QuicConnectionProtocol: type
    events: ModuleType
    """Module with ``StreamDataReceived``, ``StreamReset``, ``HandshakeCompleted``, ... classes."""
    connect: Callable[..., Any]
    serve: Callable[..., Any]
    max_datagram_size: int
    """Largest datagram size the stack handles correctly."""
    can_request_client_certificate: bool
    transmits_after_each_datagram: bool
    """Its protocol transmits after every received datagram (aioquic); ``kvnet.net.connection`` batches those
    with ``arm_timer`` and ``window_limited``."""
    keeps_alive_itself: bool = False
    """The stack sends keep-alive PINGs itself (aiopquic: picoquic's keep-alive, configured from
    ``TransportSettings.keepalive_interval``) and has no ``send_ping`` for ``kvnet.net.connection``."""


@functools.cache
def get_stack(name: str) -> QuicStack:
    """The stack called ``name`` ("aioquic" or "qh3"), imported on first use."""
    if name == "aioquic":
        import aioquic.asyncio as aa
        import aioquic.quic.configuration as ac
        import aioquic.quic.connection as an
        import aioquic.quic.events as ae

        return QuicStack("aioquic", ac.QuicConfiguration, an.QuicConnection, aa.QuicConnectionProtocol, ae,
                         aa.connect, aa.serve, MAX_DATAGRAM_SIZE_LIMIT, True, True)
    if name == "qh3":
        import qh3.asyncio as qa
        import qh3.quic.configuration as qc
        import qh3.quic.connection as qn
        import qh3.quic.events as qv

        return QuicStack("qh3", qc.QuicConfiguration, qn.QuicConnection, qa.QuicConnectionProtocol, qv,
                         qa.connect, qa.serve, MAX_DATAGRAM_SIZE_QH3, False, False)
    if name == "aiopquic":
        if sys.version_info < (3, 12):
            raise ValueError(
                "QUIC stack aiopquic needs Python >= 3.12 (this is "
                f"{sys.version_info[0]}.{sys.version_info[1]}); scripts/setup-py312 makes such an environment"
            )
        try:
            import aiopquic.asyncio as pa
            import aiopquic.quic.configuration as pc
            import aiopquic.quic.connection as pn
            import aiopquic.quic.events as pv
        except ImportError as exc:
            raise ValueError(f"QUIC stack aiopquic is not installed ({exc}): see scripts/setup-py312") \
                from exc

        from kvnet.net.aiopquic_stack import AiopquicProtocol

        return QuicStack("aiopquic", pc.QuicConfiguration, pn.QuicConnection, AiopquicProtocol, pv,
                         pa.connect, pa.serve, MAX_DATAGRAM_SIZE_AIOPQUIC, False, False, True)
    raise ValueError(f"unknown QUIC stack {name!r}; choose from {STACKS}")


def keepalive_period(settings: TransportSettings, is_client: bool) -> float:
    """Seconds without receiving after which a side PINGs (``TransportSettings.keepalive_interval``). The
    client pings every interval; the server waits longer, so it pings only a client that does not
    (keep-alive off, or another implementation), still within the idle timeout. With equal periods
    both sides pinged every interval: a relay spent ~11% of a core per 1k idle sessions on twice the
    PINGs and ACKs."""
    interval = settings.keepalive_interval
    if is_client:
        return interval
    return min(interval * 1.5, (interval + settings.idle_timeout) / 2)


def _base_configuration(settings: TransportSettings, is_client: bool) -> Any:
    stack = get_stack(settings.stack)
    if stack.name == "aiopquic":
        return stack.QuicConfiguration(
            is_client=is_client,
            alpn_protocols=[ALPN_MOQT],
            max_data=settings.max_data,
            max_stream_data=settings.max_stream_data,
            max_streams_bidi=settings.max_streams_bidi,
            max_streams_uni=settings.max_streams_uni,
            idle_timeout=settings.idle_timeout,
            keep_alive_interval=keepalive_period(settings, is_client) or None,
            socket_buffer_size=max(settings.socket_receive_buffer, settings.socket_send_buffer) or None,
            # Path-MTU probing finds what a real path carries (an Ethernet path: <= 1472 over IPv4, 1452
            # over IPv6). Only probing off keeps datagrams under a smaller setting (at picoquic's first 1252).
            pmtud="blocked" if settings.datagram_size < DATAGRAM_SIZE_ETHERNET else "basic",
        )
    config = stack.QuicConfiguration(
        is_client=is_client,
        alpn_protocols=[ALPN_MOQT],
        max_datagram_size=settings.datagram_size,
        max_data=settings.max_data,
        max_stream_data=settings.max_stream_data,
        idle_timeout=settings.idle_timeout,
    )
    if stack.name == "aioquic":
        config.congestion_control_algorithm = aioquic_congestion_control(settings)
    return config


def apply_client_verification(config: Any, tls: TlsSettings) -> None:
    """Server-certificate verification of a client configuration (either stack): on, against
    ``tls.ca_file``, unless ``insecure_skip_verify`` is set, which is logged every time."""
    if tls.insecure_skip_verify:
        logger.warning(
            "TLS VERIFICATION DISABLED (insecure_skip_verify): the server's identity is NOT checked; "
            "use only for debugging"
        )
        config.verify_mode = ssl.CERT_NONE
        return
    config.verify_mode = ssl.CERT_REQUIRED
    if tls.ca_pem is not None:
        config.load_verify_locations(cadata=tls.ca_pem)
        return
    if tls.ca_file is None:
        raise ValueError("a client needs ca_file to verify the server (or an explicit insecure_skip_verify)")
    config.load_verify_locations(cafile=str(tls.ca_file))


def client_configuration(
    settings: TransportSettings, tls: TlsSettings, server_name: str | None = None
) -> Any:
    """Client configuration for ``settings.stack``: ALPN moqt-18, TLS 1.3, server verification on."""
    if tls.ca_pem is not None and settings.stack == "aiopquic":
        raise ValueError("QUIC stack aiopquic verifies servers only against a CA file (ca_file), not ca_pem")
    config = _base_configuration(settings, is_client=True)
    config.server_name = tls.server_name or server_name
    apply_client_verification(config, tls)
    if tls.cert_file is not None:
        config.load_cert_chain(str(tls.cert_file), None if tls.key_file is None else str(tls.key_file))
    return config


def server_configuration(settings: TransportSettings, tls: TlsSettings) -> Any:
    """Server configuration for ``settings.stack``. Raises ``ValueError`` when the stack cannot do what
    ``tls`` asks (qh3 cannot request client certificates). aioquic's server side does not verify client
    certificates itself: the connection glue checks them after the handshake
    (``request_client_certificate``, ``verify_client_certificate``)."""
    if tls.require_client_cert and not get_stack(settings.stack).can_request_client_certificate:
        raise ValueError(
            f"require_client_cert needs a stack that requests client certificates; {settings.stack} "
            "cannot, use stack='aioquic' for this server"
        )
    if tls.cert_file is None:
        raise ValueError("a server needs cert_file and key_file")
    config = _base_configuration(settings, is_client=False)
    config.load_cert_chain(str(tls.cert_file), None if tls.key_file is None else str(tls.key_file))
    if tls.ca_file is not None:
        config.load_verify_locations(cafile=str(tls.ca_file))
    return config


def client_socket(settings: TransportSettings, family: int, local_host: str | None) -> socket.socket | None:
    """The bound UDP socket a client connection sends from (on ``local_host``, else the wildcard
    address), or None for aiopquic, whose picoquic binds its own (and cannot take ``local_host``)."""
    if settings.stack == "aiopquic":
        if local_host is not None:
            raise ValueError("QUIC stack aiopquic binds its own socket: a local address cannot be chosen")
        return None
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        wildcard = "::" if family == socket.AF_INET6 else "0.0.0.0"
        sock.bind((local_host or wildcard, 0))
        apply_socket_buffers(sock, settings)
    except BaseException:
        sock.close()
        raise
    return sock


def server_sockets(host: str, port: int, count: int, settings: TransportSettings) -> list[socket.socket]:
    """``count`` UDP sockets bound to one ``host:port`` (port 0: the first chooses, the rest join it), for
    servers in separate processes (``relay.workers``). With more than one, each has ``SO_REUSEPORT``: the
    kernel hashes a datagram's 4-tuple to one socket of the group, so a QUIC connection stays with one
    process as long as the group does not change. aiopquic binds its own socket and cannot join."""
    if settings.stack == "aiopquic":
        raise ValueError("QUIC stack aiopquic binds its own socket: it cannot serve on a shared port")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(family, socket.SOCK_DGRAM)
            sockets.append(sock)
            if count > 1:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
            port = sock.getsockname()[1]
            apply_socket_buffers(sock, settings)
            sock.setblocking(False)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


async def serve_on_socket(
    settings: TransportSettings, sock: socket.socket, configuration: Any, create_protocol: Callable[..., Any]
) -> Any:
    """The stack's ``serve`` on a socket bound beforehand (``server_sockets``) instead of on host:port."""
    server_class: type
    if settings.stack == "aioquic":
        from aioquic.asyncio.server import QuicServer as server_class
    elif settings.stack == "qh3":
        from qh3.asyncio.server import QuicServer as server_class
    else:
        raise ValueError(f"QUIC stack {settings.stack} binds its own socket: it cannot serve on a given one")
    loop = asyncio.get_running_loop()
    _, server = await loop.create_datagram_endpoint(
        lambda: server_class(configuration=configuration, create_protocol=create_protocol), sock=sock
    )
    return server


async def open_client_endpoint(
    settings: TransportSettings, sock: socket.socket | None, configuration: Any,
    protocol_factory: Callable[[Any], Any],
) -> tuple[Any, Any]:
    """The stack's client transport and the protocol ``protocol_factory(quic_connection)`` made for a
    new connection with ``configuration``: a datagram transport over ``sock`` (qh3: batched receive
    with GRO), or for aiopquic its own transport (``client_socket`` gave None)."""
    loop = asyncio.get_running_loop()
    stack = get_stack(settings.stack)
    if settings.stack == "aiopquic":
        from kvnet.net.aiopquic_stack import open_client

        return open_client(configuration, protocol_factory)
    assert sock is not None

    def make_protocol() -> Any:
        return protocol_factory(stack.QuicConnection(configuration=configuration))

    if settings.stack == "qh3":
        from qh3.asyncio._transport import create_optimized_datagram_transport

        transport, protocol = await create_optimized_datagram_transport(loop, make_protocol, sock=sock)
        return transport, protocol
    transport, protocol = await loop.create_datagram_endpoint(make_protocol, sock=sock)
    return transport, protocol


def server_socket(quic_server: Any) -> socket.socket | None:
    """The listening UDP socket of a ``stack.serve`` server (None for aiopquic: picoquic's own)."""
    transport = getattr(quic_server, "_transport", None)
    return None if transport is None else transport.get_extra_info("socket")


def unsent_bytes(quic: Any, stream_ids: Iterable[int]) -> dict[int, int]:
    """Bytes still held by the stack per stream: aioquic counts unacknowledged bytes, qh3 and aiopquic
    (``kvnet.net.aiopquic_stack.StreamWriter``) unsent ones."""
    unsent = getattr(quic, "unsent", None)
    if unsent is not None:
        return {sid: unsent(sid) for sid in stream_ids}
    get = getattr(quic, "get_send_buffer_size", None)
    if get is not None:
        return {sid: int(get(sid)) for sid in stream_ids}
    streams = quic._streams
    result = {}
    for sid in stream_ids:
        stream = streams.get(sid)
        result[sid] = 0 if stream is None else len(stream.sender._buffer)
    return result


# Positions of local_max_streams_bidi / _uni among qh3's QuicConnectionCore arguments (qh3 2.x).
_QH3_CORE_MAX_STREAMS_BIDI = 21
_QH3_CORE_MAX_STREAMS_UNI = 22
_CORE = "QuicConnectionCore"
_PARAMS = "QuicTransportParameters"


def window_limited(quic: Any) -> bool:
    """aioquic: whether the congestion window has no room for another full datagram."""
    loss = quic._loss
    return bool(loss.bytes_in_flight + quic._max_datagram_size > loss.congestion_window)


def arm_timer(protocol: Any) -> None:
    """aioquic: re-arm a protocol's QUIC timer as its ``transmit()`` does, without building packets, for
    a receiver that transmits only every few datagrams (``kvnet.net.connection``): the ACK-delay and loss
    timers must still fire when a burst ends between two transmits."""
    timer_at = protocol._quic.get_timer()
    if protocol._timer is not None and protocol._timer_at != timer_at:
        protocol._timer.cancel()
        protocol._timer = None
    if protocol._timer is None and timer_at is not None:
        protocol._timer = protocol._loop.call_at(timer_at, protocol._handle_timer)
    protocol._timer_at = timer_at


def _set(module: Any, name: str, value: Any) -> None:
    setattr(module, name, value)


def path_is_loopback(host: str) -> bool:
    """Whether ``host`` (an address as the socket reports it) is this machine: the path carries 64 KiB."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def choose_datagram_size(settings: TransportSettings, peer_limit: int | None, loopback: bool) -> int:
    """The UDP payload size one connection sends (RFC 9000 section 18.2 and the path).

    Never above ``peer_limit``, the peer's ``max_udp_payload_size``. Under that: the configured
    ``max_datagram_size`` (an operator who sets it knows the path, e.g. jumbo frames), else the
    stack's loopback size when the peer is this machine, else ``DATAGRAM_SIZE_ETHERNET``, which every
    path carries; aioquic does no path-MTU discovery, so guessing larger would lose every big packet.
    """
    if settings.max_datagram_size is not None:
        size = settings.max_datagram_size
    else:
        size = settings.datagram_size if loopback else DATAGRAM_SIZE_ETHERNET
    if peer_limit is not None:
        size = min(size, peer_limit)
    return max(MIN_DATAGRAM_SIZE, size)


def limit_datagram_size(quic: Any, settings: TransportSettings) -> None:
    """Make an aioquic connection follow ``choose_datagram_size``, and advertise a configured
    ``max_datagram_size`` to the peer as our ``max_udp_payload_size``; the choice is logged once.

    aioquic sends its configured size from the first packet and ignores the peer's parameter. Until the
    peer's transport parameters arrive (handshake packets only) it sends at most
    ``DATAGRAM_SIZE_ETHERNET``; when they arrive (before a server sends its handshake flight) the size
    is fixed for the connection. qh3 applies the peer's parameter and probes the path itself.
    """
    if not hasattr(quic, "_parse_transport_parameters"):
        return  # qh3 and aiopquic probe the path themselves
    from aioquic.buffer import Buffer
    from aioquic.quic.packet import pull_quic_transport_parameters, push_quic_transport_parameters

    _set_datagram_size(quic, min(quic._max_datagram_size, DATAGRAM_SIZE_ETHERNET))
    original_parse = quic._parse_transport_parameters
    original_serialize = quic._serialize_transport_parameters

    def parse(data: bytes, from_session_ticket: bool = False) -> None:
        original_parse(data, from_session_ticket)
        if from_session_ticket:
            return
        peer_max = pull_quic_transport_parameters(Buffer(data=data)).max_udp_payload_size
        host = quic._network_paths[0].addr[0] if quic._network_paths else ""
        loopback = path_is_loopback(host)
        size = choose_datagram_size(settings, peer_max, loopback)
        _set_datagram_size(quic, size)
        logger.info(
            "QUIC datagram size",
            extra={"datagram_size": size, "configured": settings.max_datagram_size,
                   "peer_max_udp_payload_size": peer_max, "loopback": loopback},
        )

    def serialize() -> bytes:
        data: bytes = original_serialize()
        if settings.max_datagram_size is None:
            return data
        params = pull_quic_transport_parameters(Buffer(data=data))
        params.max_udp_payload_size = settings.max_datagram_size
        buf = Buffer(capacity=len(data) + 16)
        push_quic_transport_parameters(buf, params)
        return buf.data

    quic._parse_transport_parameters = parse
    quic._serialize_transport_parameters = serialize


def _set_datagram_size(quic: Any, size: int) -> None:
    # aioquic keeps the size in the connection (packet building) and copies it into loss recovery's
    # pacer and congestion controller (window arithmetic): all three follow.
    quic._max_datagram_size = size
    quic._loss._pacer._max_datagram_size = size
    quic._loss._cc._max_datagram_size = size


def raise_stream_limits(quic: Any, settings: TransportSettings) -> None:
    """Grant the peer ``settings.max_streams_*`` concurrent streams before the handshake announces them.
    Neither aioquic nor qh3 has a setting: aioquic starts from 128 per direction, qh3 from 100
    bidirectional and 103 unidirectional; kvnet opens one bidirectional stream per request, thousands at
    once. aiopquic takes them in its configuration (``_base_configuration``)."""
    if settings.stack == "aiopquic":
        return
    if hasattr(quic, "_local_max_streams_bidi"):  # aioquic: plain attributes read at handshake time
        for attr, value in (("_local_max_streams_bidi", settings.max_streams_bidi),
                            ("_local_max_streams_uni", settings.max_streams_uni)):
            limit = getattr(quic, attr)
            limit.value = limit.sent = value
        return
    # qh3 hard-codes the limits twice, as literals: where it creates its native core (which enforces
    # them) and where its TLS bridge builds the transport parameters (which announce them). Intercept
    # those two constructions for this connection only and substitute ours.
    core_module = sys.modules[type(quic).__module__]
    original_create_core = quic._create_core
    original_create_tls = quic._create_tls

    def create_core(*args: Any, **kwargs: Any) -> None:
        core_class = getattr(core_module, _CORE)

        def core(*core_args: Any) -> Any:
            values = list(core_args)
            values[_QH3_CORE_MAX_STREAMS_BIDI] = settings.max_streams_bidi
            values[_QH3_CORE_MAX_STREAMS_UNI] = settings.max_streams_uni
            return core_class(*values)

        _set(core_module, _CORE, core)
        try:
            original_create_core(*args, **kwargs)
        finally:
            _set(core_module, _CORE, core_class)

    def create_tls(*args: Any, **kwargs: Any) -> Any:
        import qh3.quic.tls_bridge as bridge_module

        params_class = getattr(bridge_module, _PARAMS)

        def params(**fields: Any) -> Any:
            fields["initial_max_streams_bidi"] = settings.max_streams_bidi
            fields["initial_max_streams_uni"] = settings.max_streams_uni
            return params_class(**fields)

        # The bridge serialises its parameters while it is built and again later (e.g. after a retry).
        _set(bridge_module, _PARAMS, params)
        try:
            bridge = original_create_tls(*args, **kwargs)
        finally:
            _set(bridge_module, _PARAMS, params_class)
        original_serialize = bridge.serialize_transport_parameters

        def serialize() -> bytes:
            _set(bridge_module, _PARAMS, params)
            try:
                data: bytes = original_serialize()
            finally:
                _set(bridge_module, _PARAMS, params_class)
            return data

        bridge.serialize_transport_parameters = serialize
        return bridge

    quic._create_core = create_core
    quic._create_tls = create_tls


_QH3_BUILD_CAPACITY = "packet builder capacity exhausted"


def send_datagrams_built_before_a_failed_build(quic: Any) -> None:
    """Make a qh3 connection send the datagrams it built before a packet it could not build.

    qh3 2.1 answering an aioquic client's first flights reports "packet builder capacity exhausted" for
    one of its packets (two to four times per handshake, at every datagram size), and its
    ``datagrams_to_send`` then raises, dropping the datagrams it had already built and counted as sent:
    the handshake waited ~1 s for their loss recovery, and each raise was an asyncio traceback in the
    log. Its builder is transactional (a failed build consumes no frame and no packet number), so what
    was built is sent and the rest waits for the next transmit: the handshake takes ~0.1 s.
    aioquic and aiopquic need nothing."""
    from qh3.quic.connection import QuicConnectionError

    def datagrams_to_send(now: float) -> list[tuple[bytes, Any]]:
        core = quic._core
        if core is None:
            return []
        datagrams: list[tuple[bytes, Any]] = []
        while True:
            try:
                transmit = quic._call_core(core.poll_transmit, now)
            except QuicConnectionError as exc:
                if exc.reason_phrase != _QH3_BUILD_CAPACITY:
                    raise
                logger.debug("qh3 could not build a packet (%s); sending the %d built before it",
                             exc.reason_phrase, len(datagrams))
                return datagrams
            if transmit is None:
                return datagrams
            quic._log_datagram("datagrams_sent", transmit[0])
            quic._log_packets("packet_sent", transmit[0])
            datagrams.append((transmit[0], transmit[1]))

    quic.datagrams_to_send = datagrams_to_send


def request_client_certificate(quic: Any) -> None:
    """Make an aioquic server connection ask for a client certificate (checked after the handshake by
    ``verify_client_certificate``). aioquic sets the flag on a TLS context that only exists once the
    first packet arrived, so the hook wraps ``_initialize``."""
    original = quic._initialize

    def initialize(peer_cid: bytes) -> None:
        original(peer_cid)
        quic.tls._request_client_certificate = True

    quic._initialize = initialize


def verify_client_certificate(quic: Any, cafile: str) -> None:
    """Check the client's certificate chain against ``cafile``; raises on any failure."""
    from aioquic.tls import verify_certificate

    tls = quic.tls
    cert = getattr(tls, "_peer_certificate", None)
    if cert is None:
        raise ValueError("no client certificate")
    chain = getattr(tls, "_peer_certificate_chain", [])
    verify_certificate(certificate=cert, chain=chain, cafile=cafile)
