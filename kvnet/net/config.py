"""The user-facing transport settings of every kvnet endpoint: ``TransportConfig`` and ``TlsConfig``.

Owns: the tuned transport knobs and their limits (which QUIC stack, datagram sizes and the link presets,
socket buffers, flow-control windows, stream limits, timeouts, keep-alive), TLS material, and the rules
derived from the knobs alone (``choose_datagram_size``, ``keepalive_period``). Imports no transport:
the stack modules (``kvnet.net.aioquic_stack``, ``kvnet.net.qh3_stack``, ``kvnet.net.aiopquic_stack``, and
``kvnet.net.qmux_stack`` for ``moqt+qmux://``: windows, stream limits, timeouts and socket buffers apply
there too) turn these settings into their own configuration.

Why the defaults are what they are (2 cores, loopback, bulk one-way transfer, see
``benchmarks/bench_transport.py``): aioquic's defaults (1200-byte datagrams, 1 MiB windows, the kernel's
default socket buffers) reach only a few tens of MB/s because the cost is per packet, not per byte. Large
datagrams cut the packet count, large socket buffers stop the kernel dropping bursts that aioquic then has to
recover, and larger flow-control windows keep the pipe full.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

STACKS = ("aioquic", "qh3", "aiopquic")
# Chosen by measurement (docs/performance.md): qh3 moves bulk data 4-7x faster client -> server, but
# its servers send ~1400-byte datagrams and cannot require client certificates, and as a client it
# locates in 1-2 more round trips through an aioquic relay; so aioquic is the default and qh3 is opt-in.
DEFAULT_STACK = "aioquic"

# Datagram sizes. Every rule about the UDP payload size we send lives with these constants and
# ``TransportConfig.datagram_size``.
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
class TransportConfig:
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
    ``MAX_DATAGRAM_SIZE_AIOPQUIC``-byte datagrams). How they differ: ``kvnet.net.stack``."""
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
    def for_ethernet(cls, stack: str = DEFAULT_STACK) -> TransportConfig:
        """Settings for paths with a 1500-byte MTU (anything off-host without known jumbo frames)."""
        return cls.for_link("ethernet", stack)

    @classmethod
    def for_link(cls, link: str, stack: str = DEFAULT_STACK) -> TransportConfig:
        """Settings for a ``LINK_PRESETS`` path: "ethernet" (1452), "jumbo" (8952) or "loopback"."""
        if link not in LINK_PRESETS:
            raise ValueError(f"link must be one of {list(LINK_PRESETS)}, got {link!r}")
        return cls(max_datagram_size=LINK_PRESETS[link], stack=stack)


@dataclass(frozen=True, slots=True)
class TlsConfig:
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
    ) -> TlsConfig:
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


def path_is_loopback(host: str) -> bool:
    """Whether ``host`` (an address as the socket reports it) is this machine: the path carries 64 KiB."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def choose_datagram_size(settings: TransportConfig, peer_limit: int | None, loopback: bool) -> int:
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


def keepalive_period(settings: TransportConfig, is_client: bool) -> float:
    """Seconds without receiving after which a side PINGs (``TransportConfig.keepalive_interval``). The
    client pings every interval; the server waits longer, so it pings only a client that does not
    (keep-alive off, or another implementation), still within the idle timeout. With equal periods
    both sides pinged every interval: a relay spent ~11% of a core per 1k idle sessions on twice the
    PINGs and ACKs."""
    interval = settings.keepalive_interval
    if is_client:
        return interval
    return min(interval * 1.5, (interval + settings.idle_timeout) / 2)
