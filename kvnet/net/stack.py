"""The seam under ``MoqtConnection``: what one transport stack provides, so that the connection and the
endpoints have one code path for every stack.

Owns: ``Stack``, the description and hooks of one stack (its configuration, connection and protocol
classes and events; building its client and server configuration from ``TransportConfig`` and
``TlsConfig``; the per-connection adaptations it needs; counting unsent bytes; opening a client
endpoint and a listening one), ``UdpStack``, what the stacks that leave the UDP socket to kvnet
(aioquic, qh3) share, their base configuration among it, and ``arm_timer``, aioquic's timer re-arming
for the protocols that arm it outside aioquic's transmit (kvnet's aioquic protocol; QMux's protocol arms
its one timer, the idle deadline, itself). One module per stack implements it
(``kvnet.net.aioquic_stack``, ``kvnet.net.qh3_stack``, ``kvnet.net.aiopquic_stack``);
``kvnet.net.registry`` names them.

What a stack's connection object must offer (``MoqtConnection`` and ``proto.session.MoqtSession`` call
only these, aioquic's ``QuicConnection`` API): ``send_stream_data``, ``reset_stream``, ``stop_stream``,
``send_datagram_frame``, ``get_next_available_stream_id``, ``next_event``, ``close``, ``send_ping``
(unless ``keeps_alive_itself``), ``host_cid``; its protocol class is shaped like aioquic's
``QuicConnectionProtocol`` (``connect``, ``wait_connected``, ``transmit``, ``close``, ``wait_closed``,
``quic_event_received``), and its events module has aioquic's event classes (``StreamDataReceived``,
``StreamReset``, ``StopSendingReceived``, ``DatagramFrameReceived``, ``HandshakeCompleted``,
``ConnectionTerminated``). A byte-stream transport that presents the same API is one more module:
``kvnet.net.qmux_stack`` (QMux over TLS 1.3/TCP), whose protocol is an asyncio ``BufferedProtocol``
(``MoqtConnection.buffer_updated``) and whose peer addresses resolve for TCP (``socket_type``).

How the QUIC stacks differ (aioquic 1.7 / qh3 2.x / aiopquic 0.6), each handled in its own module:

- Configuration: qh3 has no ``congestion_control_algorithm`` (its core picks one), and
  ``max_datagram_size`` is an upper bound that it reaches by path-MTU probing from 1280 bytes, while
  aioquic uses it from the first packet and silently stalls above 16384.
- Receive path: qh3's client transport reads batches with GRO and calls ``datagrams_received(list)``,
  never ``datagram_received``; a protocol must hook both.
- Transmits: aioquic's protocol transmits after every received datagram (a walk over all open
  streams each time); kvnet's aioquic protocol transmits every few datagrams instead.
- Send buffer: aioquic keeps every unacknowledged byte in the stream's sender buffer; qh3 reports bytes
  not yet sent once (``get_send_buffer_size``). Both work as a back-pressure measure.
- Stream limits: neither has a setting (aioquic grants 128 concurrent peer streams, qh3 100), so we raise
  them before the handshake announces them.
- TLS: qh3 and aiopquic servers cannot request a client certificate, so ``require_client_cert`` needs
  aioquic there.
- aiopquic owns its socket and sends from picoquic's thread: no datagram callbacks, no transmits, its
  own keep-alive and path-MTU probing.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from kvnet.net.config import TlsConfig, TransportConfig
from kvnet.net.sockets import apply_socket_buffers, udp_client_socket, udp_server_sockets

logger = logging.getLogger(__name__)

ALPN_MOQT = "moqt-18"
"""The ALPN of MoQT draft-18 over QUIC."""

ProtocolFactory = Callable[[Any], Any]
"""Makes the protocol (a ``MoqtConnection``) for a new stack connection object."""


def arm_timer(protocol: Any) -> None:
    """Re-arm a protocol's connection timer as aioquic's ``QuicConnectionProtocol.transmit()`` does: to
    the connection's ``get_timer()``, calling ``protocol._handle_timer`` then. For protocols shaped like
    aioquic's (``_quic``, ``_loop``, ``_timer``, ``_timer_at``) that arm it outside aioquic's transmit."""
    timer_at = protocol._quic.get_timer()
    if protocol._timer is not None and protocol._timer_at != timer_at:
        protocol._timer.cancel()
        protocol._timer = None
    if protocol._timer is None and timer_at is not None:
        protocol._timer = protocol._loop.call_at(timer_at, protocol._handle_timer)
    protocol._timer_at = timer_at


@dataclass(frozen=True, eq=False)
class Stack(ABC):
    """One transport stack: its own classes (which benchmarks and tests also drive directly) and the
    hooks ``kvnet.net.connection`` and ``kvnet.net.endpoint`` call. Each stack implements the abstract
    hooks; the others have a default that fits most stacks."""

    name: str
    QuicConfiguration: type
    QuicConnection: type
    QuicConnectionProtocol: type
    """The protocol ``MoqtConnection`` is built on: the stack's, or kvnet's adaptation of it."""
    events: ModuleType
    """Module with ``StreamDataReceived``, ``StreamReset``, ``HandshakeCompleted``, ... classes."""
    connect: Callable[..., Any] | None
    """The stack's own asyncio ``connect`` and ``serve`` helpers (benchmarks drive the stack with them);
    None for a stack that has none (QMux)."""
    serve: Callable[..., Any] | None
    max_datagram_size: int
    """Largest datagram size the stack handles correctly (0: the stack sends no datagrams of its own)."""
    can_request_client_certificate: bool = False
    keeps_alive_itself: bool = False
    """The stack sends keep-alive PINGs itself (aiopquic: picoquic's keep-alive, configured from
    ``TransportConfig.keepalive_interval``) and has no ``send_ping`` for ``kvnet.net.connection``."""
    binds_own_socket: bool = False
    """The stack opens and closes its sockets itself (aiopquic): no socket can be given to it."""
    accepts_ca_pem: bool = True
    """Clients can verify servers against a CA held in memory (``TlsConfig.ca_pem``)."""
    closes_own_transport: bool = False
    """The stack's protocol closes its transport itself once a connection has ended (QMux: after the peer
    read up to our CONNECTION_CLOSE), so ``MoqtConnection`` must not close it at the end of the connection."""
    alpn: str = ALPN_MOQT
    socket_type: int = socket.SOCK_DGRAM
    """What a peer's address is resolved for: UDP for QUIC, TCP for a byte-stream transport."""

    # ---- configuration

    @abstractmethod
    def base_configuration(self, settings: TransportConfig, is_client: bool) -> Any:
        """The stack's configuration object for ``settings``, without TLS material."""

    def client_configuration(
        self, settings: TransportConfig, tls: TlsConfig, server_name: str | None = None
    ) -> Any:
        """Client configuration: ALPN ``alpn``, TLS 1.3, server verification on."""
        if tls.ca_pem is not None and not self.accepts_ca_pem:
            raise ValueError(
                f"QUIC stack {self.name} verifies servers only against a CA file (ca_file), not ca_pem"
            )
        config = self.base_configuration(settings, is_client=True)
        config.server_name = tls.server_name or server_name
        _apply_client_verification(config, tls)
        if tls.cert_file is not None:
            config.load_cert_chain(str(tls.cert_file), None if tls.key_file is None else str(tls.key_file))
        return config

    def server_configuration(self, settings: TransportConfig, tls: TlsConfig) -> Any:
        """Server configuration. Raises ``ValueError`` when the stack cannot do what ``tls`` asks
        (qh3 and aiopquic cannot request client certificates)."""
        if tls.require_client_cert and not self.can_request_client_certificate:
            raise ValueError(
                f"require_client_cert needs a stack that requests client certificates; {self.name} "
                "cannot, use stack='aioquic' for this server"
            )
        if tls.cert_file is None:
            raise ValueError("a server needs cert_file and key_file")
        config = self.base_configuration(settings, is_client=False)
        config.load_cert_chain(str(tls.cert_file), None if tls.key_file is None else str(tls.key_file))
        if tls.ca_file is not None:
            config.load_verify_locations(cafile=str(tls.ca_file))
        return config

    # ---- one connection

    def prepare_connection(  # noqa: B027 (a default that does nothing: stacks that need no adapting)
        self, protocol: Any, settings: TransportConfig, *, verify_client: bool
    ) -> None:
        """Adapt a new connection (``protocol`` and its connection object ``protocol._quic``) to
        ``settings`` before its handshake (stream limits, datagram size); ``verify_client``: a server
        that asks for client certificates (``verify_client_certificate`` checks them)."""

    def verify_client_certificate(self, quic: Any, cafile: str) -> None:
        """Check the client's certificate chain against ``cafile`` after the handshake; raises on any
        failure."""
        raise ValueError(f"QUIC stack {self.name} cannot verify client certificates")

    @abstractmethod
    def unsent_bytes(self, quic: Any, stream_ids: Iterable[int]) -> dict[int, int]:
        """Bytes still held by the stack per stream (the back-pressure measure)."""

    @abstractmethod
    def peer_address(self, quic: Any) -> tuple[str, int] | None:
        """The peer's address, or None while the stack does not know it."""

    def close_event(self, quic: Any) -> Any:
        """How the connection ended (its ``ConnectionTerminated``) once it has begun to, else None.
        aioquic and qh3 record it in ``_close_event``."""
        return quic._close_event

    def release_client_transport(self, transport: Any) -> None:  # noqa: B027 (nothing attached by default)
        """A client connection's own transport is going away: free what kvnet attached to it."""

    # ---- endpoints

    @abstractmethod
    async def open_client(
        self, settings: TransportConfig, configuration: Any, family: int, local_host: str | None,
        protocol_factory: ProtocolFactory,
    ) -> tuple[Any, Any]:
        """The client transport and the protocol ``protocol_factory(connection)`` made for a new
        connection with ``configuration``, ready for ``protocol.connect(address)``; ``local_host`` is
        the source address (None: the wildcard address)."""

    @abstractmethod
    async def listen(
        self, host: str, port: int, settings: TransportConfig, configuration: Any,
        create_protocol: Callable[..., Any], *, sock: socket.socket | None, max_connections: int,
    ) -> tuple[Any, tuple[str, int]]:
        """A listening server on ``host:port`` (or on ``sock``, bound beforehand by ``server_sockets``)
        whose connections get ``create_protocol``; returns it (it has ``close()``) and the address it
        listens on."""

    def server_sockets(
        self, host: str, port: int, count: int, settings: TransportConfig
    ) -> list[socket.socket]:
        """``count`` sockets bound to one ``host:port`` for servers in separate processes
        (``relay.workers``)."""
        raise ValueError(f"QUIC stack {self.name} binds its own socket: it cannot serve on a shared port")


def _apply_client_verification(config: Any, tls: TlsConfig) -> None:
    """Server-certificate verification of a client configuration: on, against ``tls.ca_file`` (or
    ``ca_pem``), unless ``insecure_skip_verify`` is set, which is logged every time."""
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


@dataclass(frozen=True, eq=False)
class UdpStack(Stack):
    """A stack that leaves the UDP socket to kvnet and runs on asyncio's datagram transports (aioquic,
    qh3): kvnet binds the sockets, sizes their buffers and can share one port among processes."""

    server_class: type | None = None
    """The stack's asyncio ``QuicServer``, for serving on a socket bound beforehand."""

    def base_configuration(self, settings: TransportConfig, is_client: bool) -> Any:
        # aioquic and qh3 share these configuration fields; a stack adds what only it has.
        return self.QuicConfiguration(
            is_client=is_client,
            alpn_protocols=[self.alpn],
            max_datagram_size=settings.datagram_size,
            max_data=settings.max_data,
            max_stream_data=settings.max_stream_data,
            idle_timeout=settings.idle_timeout,
        )

    def peer_address(self, quic: Any) -> tuple[str, int] | None:
        # aioquic keeps it in the network paths, qh3 as the remote address.
        paths = getattr(quic, "_network_paths", None)
        addr = paths[0].addr if paths else getattr(quic, "_remote_addr", None)
        return (addr[0], addr[1]) if addr else None

    async def open_client(
        self, settings: TransportConfig, configuration: Any, family: int, local_host: str | None,
        protocol_factory: ProtocolFactory,
    ) -> tuple[Any, Any]:
        sock = udp_client_socket(settings, family, local_host)
        try:
            return await self.open_datagram_endpoint(
                sock, lambda: protocol_factory(self.QuicConnection(configuration=configuration)), settings
            )
        except BaseException:
            sock.close()
            raise

    async def open_datagram_endpoint(
        self, sock: socket.socket, make_protocol: Callable[[], Any], settings: TransportConfig
    ) -> tuple[Any, Any]:
        """A client's datagram transport over ``sock`` and its protocol."""
        return await asyncio.get_running_loop().create_datagram_endpoint(make_protocol, sock=sock)

    async def listen(
        self, host: str, port: int, settings: TransportConfig, configuration: Any,
        create_protocol: Callable[..., Any], *, sock: socket.socket | None, max_connections: int,
    ) -> tuple[Any, tuple[str, int]]:
        if sock is not None:
            assert self.server_class is not None
            server_class = self.server_class
            _, server = await asyncio.get_running_loop().create_datagram_endpoint(
                lambda: server_class(configuration=configuration, create_protocol=create_protocol), sock=sock
            )
        else:
            assert self.serve is not None
            server = await self.serve(
                host, port, configuration=configuration, create_protocol=create_protocol
            )
            sock = server._transport.get_extra_info("socket")
            apply_socket_buffers(sock, settings)
        assert sock is not None
        name = sock.getsockname()
        return server, (name[0], name[1])

    def server_sockets(
        self, host: str, port: int, count: int, settings: TransportConfig
    ) -> list[socket.socket]:
        return udp_server_sockets(host, port, count, settings)
