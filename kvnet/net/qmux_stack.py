"""The QMux stack: MoqtConnection's QUIC stream and datagram operations over TLS 1.3 over TCP
(draft-ietf-quic-qmux, the sans-I/O ``proto.qmux_connection.QMuxConnection``), on the standard library's
``ssl`` and asyncio.

Owns: the TLS contexts built from ``TlsConfig`` (TLS 1.3 only, ALPN ``ALPN_MOQT_QMUX``, server
verification on, mutual TLS when the server requires client certificates), the QMux configuration from
``TransportConfig`` (flow-control windows, stream limits, idle timeout; records of up to 1 MiB),
``QMuxProtocol`` (the I/O shell shaped like aioquic's ``QuicConnectionProtocol``, so ``MoqtConnection``
has one code path), and the client and listening endpoints. URLs ``moqt+qmux://HOST:PORT`` pick it
(``kvnet.net.url.SCHEMES``).

ALPN: ``moqt-18-qmux-01`` names MoQT draft-18 carried over QMux draft-01. The QMux draft requires an
identifier of its own for an application over QMux, distinct from the one over QUIC (``moqt-18``), so
that neither side mistakes one framing for the other; a server offered any other ALPN completes no
session (``MoqtConnection`` closes it with no_application_protocol).

I/O model, chosen by measurement (``benchmarks/bench_tls_io.py``: one loopback TLS 1.3 connection, a
blocking sender; receiver CPU per MB, one run at load ~8-9 on 2 cores): asyncio streams 1.73 ms/MB,
a reader thread with ``recv_into`` handing bytes to the loop 2.49, a ``BufferedProtocol`` on asyncio's
SSL transport 1.08-1.13, a non-blocking ``SSLSocket`` under ``add_reader`` 0.98-0.99. The protocol is a
``BufferedProtocol`` reading into a buffer of its own (256 KiB, 1 MiB from its first large read):
within ~0.1 ms/MB of the cheapest, and
asyncio's SSL transport brings the handshake and its timeout, close_notify, write buffering and
``pause_writing``/``resume_writing``, which a hand-made transport would have to redo. The buffer is
reused for every read: ``receive_data`` copies what it keeps, and the stream data events that view it are
handled before the next read.

Sending: every ``transmit`` frames what the connection may send into records as large as the peer's
``max_record_size`` allows (ours: 1 MiB), up to ``_WRITE_PIECE`` per ``writelines``: the small pieces
joined, stream data handed over as the application's own buffers, which asyncio's SSL transport encrypts
at once (a relay no longer copies every MB it serves before encrypting it). Back-pressure is the
transport's: while asyncio's SSL transport holds more than ``_WRITE_HIGH_WATER`` bytes it pauses us, stream
data stays queued in the QMux connection (``unsent_bytes``, what ``MoqtConnection``'s drain logic waits on,
as with the QUIC stacks' send buffers), and ``resume_writing`` transmits again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kvnet.net.config import TlsConfig, TransportConfig
from kvnet.net.sockets import apply_socket_buffers, tcp_server_sockets
from kvnet.net.stack import ProtocolFactory, Stack
from proto import qmux_events
from proto.qmux_connection import QMuxConfiguration, QMuxConnection
from proto.qmux_events import ConnectionTerminated, HandshakeCompleted, PingAcknowledged

logger = logging.getLogger(__name__)

ALPN_MOQT_QMUX = "moqt-18-qmux-01"
"""The ALPN of MoQT draft-18 over QMux draft-01 (over TLS 1.3 over TCP)."""

# Largest record we send and accept: well above the draft's 16382-byte default, so a 1 MiB object crosses in
# about one record (per-record work is the receiver's cost), and bounded so a partial record held while
# receiving stays small.
_MAX_RECORD_SIZE = 1 << 20
# One read: asyncio's SSL layer decrypts up to this much into our buffer per call, and reads up to this much
# from the socket at once (its own default is 256 KiB). A connection starts at the small size and takes the
# large one at its first large read (``QMuxProtocol._grow_reads``): a session carrying KV reads 1 MiB per
# pass, an idle or control session keeps 512 KiB of buffers, not 2 MiB.
_RECEIVE_BUFFER_SMALL = 256 << 10
_RECEIVE_BUFFER = 1 << 20
# Stream data framed per write while the transport takes more.
_WRITE_PIECE = 1 << 20
# Bytes asyncio's SSL transport may hold (encrypted or waiting to be) before it pauses us.
_WRITE_HIGH_WATER = 4 << 20
_WRITE_LOW_WATER = 1 << 20
# Events handled per event-loop turn. One read can hold hundreds of requests (the sender's batches coalesce
# in the TCP stream); handling them all before the application runs once would fill the session's
# requests-in-flight limit with requests it could have answered in between, as it does between datagrams
# on the QUIC stacks. Reading pauses while events wait.
_EVENTS_PER_TURN = 32
CLOSE_LINGER_S = 5.0
"""After our own CONNECTION_CLOSE, how long the TLS/TCP connection stays open for the peer to read up to
it and close in turn. Closing at once sent TLS close_notify while the peer was still sending (a relay
answering pushes it had not read yet), which Python's TLS answers with an abort: the reset made the
peer's kernel drop what it had received and not read, a publisher's last pushed blocks among it."""
# Pending TCP connections the listening socket queues.
_BACKLOG = 1024


@dataclass(eq=False)
class QMuxTlsConfiguration:
    """One side's configuration: the QMux limits it grants and the TLS context it connects or serves with."""

    qmux: QMuxConfiguration
    ssl_context: ssl.SSLContext
    settings: TransportConfig
    server_name: str | None = None
    """Clients: the name the server's certificate must carry."""
    local_host: str | None = None
    """Clients: the source address (None: the system chooses)."""


class QMuxTcpConnection(QMuxConnection):
    """``QMuxConnection`` plus what ``kvnet.net.connection`` and this stack read from a connection object:
    a label for the logs (``host_cid``: QMux has no connection ids), the peer's address and certificate."""

    def __init__(self, configuration: QMuxTlsConfiguration) -> None:
        super().__init__(configuration.qmux)
        self.tls_configuration = configuration
        self.host_cid = os.urandom(8)
        self.peer_address: tuple[str, int] | None = None
        self.peer_certificate: dict[str, Any] | None = None


def _failure(exc: BaseException | None) -> str:
    """One line for why the TLS/TCP transport failed."""
    if exc is None:
        return "transport closed"
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"certificate verify failed: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError):
        return f"TLS: {exc.reason or exc}"
    if isinstance(exc, TimeoutError):
        return "TLS handshake timed out"
    if isinstance(exc, OSError) and exc.errno:
        return os.strerror(exc.errno)  # asyncio words a refused connect "Connect call failed (address)"
    return str(exc) or type(exc).__name__


def _read_socket_in_large_pieces(transport: asyncio.Transport) -> None:
    """Let asyncio's SSL protocol under ``transport`` read up to ``_RECEIVE_BUFFER`` from the socket at once.

    Every socket read is one pass of the event loop, the SSL protocol, QMux and MoQT over what it
    decrypted, and asyncio reads 256 KiB at most (``SSLProtocol.max_size``, a class attribute of
    asyncio's SSL protocol since Python 3.11, set here on this connection's instance). Reading up to 1 MiB
    when that much is queued cut a subscriber's CPU per MB of a verified fetch by 16%
    (``bench_datapath.py --kv-shape llama3-8b``: 1.55-1.60 -> 1.30-1.33 ms/MB, 630 -> 750 MB/s). Another
    asyncio keeps its own size (tests/kvnet/net/test_qmux_stack.py says when this stops taking effect)."""
    ssl_protocol: Any = getattr(transport, "_ssl_protocol", None)
    size = getattr(ssl_protocol, "max_size", None)
    if isinstance(size, int):
        ssl_protocol.max_size = max(size, _RECEIVE_BUFFER)


class QMuxProtocol(asyncio.BufferedProtocol):
    """A QMux connection on asyncio's TLS transport, with the protocol API of aioquic's
    ``QuicConnectionProtocol`` that ``MoqtConnection`` uses (``connect``, ``wait_connected``,
    ``transmit``, ``close``, ``wait_closed``, ``quic_event_received``, ``_quic``, ``_transport``,
    ``_closed``, ``_loop``)."""

    def __init__(self, quic: QMuxTcpConnection, stream_handler: Any = None) -> None:
        self._quic = quic
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._closed = asyncio.Event()
        self._connected = False
        self._connected_waiter: asyncio.Future[None] | None = None
        self._handshake_error: ConnectionError | None = None
        self._ping_waiters: dict[int, asyncio.Future[None]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._linger: asyncio.TimerHandle | None = None
        """Set once our CONNECTION_CLOSE is written: closes the transport at ``CLOSE_LINGER_S`` unless the
        peer closed it first."""
        self._timer_at: float | None = None
        self._writing_paused = False
        self._opening: asyncio.Task[None] | None = None
        self._more_events_scheduled = False
        self._reading_paused = False
        self._receive_buffer = memoryview(bytearray(_RECEIVE_BUFFER_SMALL))

    # ---- the client's side of opening

    def connect(self, addr: Any, transmit: bool = True) -> None:
        """Open the TCP connection and the TLS handshake to ``addr`` (clients; ``wait_connected`` waits
        for the peer's QMux transport parameters)."""
        self._opening = self._loop.create_task(self._open(addr[0], addr[1]))

    async def _open(self, host: str, port: int) -> None:
        config = self._quic.tls_configuration
        try:
            await self._loop.create_connection(
                lambda: self, host, port, ssl=config.ssl_context, server_hostname=config.server_name or host,
                ssl_handshake_timeout=config.settings.handshake_timeout,
                local_addr=(config.local_host, 0) if config.local_host else None,
            )
        except (OSError, TimeoutError) as exc:  # ssl.SSLError is an OSError
            self._lost(_failure(exc))

    async def wait_connected(self) -> None:
        """Wait until the peer's QX_TRANSPORT_PARAMETERS arrived; raises ``ConnectionError`` (with the
        reason) when the connection ended first."""
        if self._connected:
            return
        if self._handshake_error is not None:
            raise self._handshake_error
        if self._connected_waiter is None:
            self._connected_waiter = self._loop.create_future()
            # A caller that gave up waiting (its handshake timeout) is not told again by asyncio's log.
            self._connected_waiter.add_done_callback(lambda f: f.cancelled() or f.exception())
        await asyncio.shield(self._connected_waiter)

    async def wait_closed(self) -> None:
        await self._closed.wait()

    def close(self, error_code: int = 0, reason_phrase: str = "") -> None:
        """CONNECTION_CLOSE to the peer; the transport closes when the peer closes its side, having read
        everything before it, or ``CLOSE_LINGER_S`` later (what arrives meanwhile is discarded)."""
        self._quic.close(error_code=error_code, reason_phrase=reason_phrase)
        self.transmit()
        self._process_events()
        if self._transport is None:
            if self._opening is not None:
                self._opening.cancel()
            self._closed.set()

    async def ping(self) -> None:
        """QX_PING the peer and wait for its answer."""
        waiter: asyncio.Future[None] = self._loop.create_future()
        uid = id(waiter)
        self._ping_waiters[uid] = waiter
        self._quic.send_ping(uid)
        self.transmit()
        await asyncio.shield(waiter)

    # ---- asyncio's protocol callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # asyncio's SSL transport calls this once the TLS handshake has completed.
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        transport.set_write_buffer_limits(high=_WRITE_HIGH_WATER, low=_WRITE_LOW_WATER)
        quic = self._quic
        apply_socket_buffers(transport.get_extra_info("socket"), quic.tls_configuration.settings)
        peer = transport.get_extra_info("peername")
        quic.peer_address = (peer[0], peer[1]) if peer else None
        quic.peer_certificate = transport.get_extra_info("peercert") or None
        ssl_object = transport.get_extra_info("ssl_object")
        alpn = ssl_object.selected_alpn_protocol() if ssl_object is not None else None
        resumed = bool(ssl_object is not None and ssl_object.session_reused)
        quic.connection_made(self._loop.time(), alpn, session_resumed=resumed)
        self.transmit()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._receive_buffer

    def buffer_updated(self, nbytes: int) -> None:
        # The stream data events are views of this buffer: every event of a read is handled before the
        # next read fills it again (``_process_events`` pauses reading while any wait).
        self._quic.receive_data(self._receive_buffer[:nbytes], self._loop.time())
        if nbytes > len(self._receive_buffer) // 2 and len(self._receive_buffer) < _RECEIVE_BUFFER:
            self._grow_reads()
        self._process_events()
        self.transmit()

    def _grow_reads(self) -> None:
        """Read up to ``_RECEIVE_BUFFER`` per pass from now on: this connection carries bulk data. The
        events of this read keep the old buffer alive through their views; the next read fills the new
        one."""
        self._receive_buffer = memoryview(bytearray(_RECEIVE_BUFFER))
        if self._transport is not None:
            _read_socket_in_large_pieces(self._transport)

    def eof_received(self) -> bool | None:
        self._quic.receive_eof()
        self._process_events()
        self.transmit()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost(_failure(exc) if exc is not None else "transport closed by the peer")

    def _lost(self, reason: str) -> None:
        self._quic.connection_lost(reason)
        self._process_events()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        self._transport = None
        self._closed.set()

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        self.transmit()

    # ---- sending and the timer

    def transmit(self) -> None:
        """Write what the QMux connection has to send: control frames always, stream data while the
        transport is not paused (what does not go stays queued there, counted by ``unsent_bytes``)."""
        quic = self._quic
        transport = self._transport
        if transport is not None and not transport.is_closing():
            now = self._loop.time()
            while pieces := quic.records_to_send(now, max_bytes=0 if self._writing_paused else _WRITE_PIECE):
                transport.writelines(pieces)  # encrypted piece by piece at once: stream data is not copied
            if quic.finished:
                if not quic.closed_by_us:
                    transport.close()  # the peer closed, or the transport failed: nothing more to read
                elif self._linger is None:
                    self._linger = self._loop.call_later(CLOSE_LINGER_S, transport.close)
        self._arm_timer()

    def _arm_timer(self) -> None:
        """Keep one loop timer due at or before the connection's deadline (``get_timer``: the idle
        timeout, which every record sent or received moves later). A timer due earlier stays: when it
        fires, ``handle_timer`` finds nothing due and the new deadline is armed then. Re-arming the loop's
        timer at every move was ~3% of a relay's event loop (a cancelled handle and a new one per read
        and per write)."""
        timer_at = self._quic.get_timer()
        if timer_at is None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        elif self._timer is None or self._timer_at is None or timer_at < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self._loop.call_at(timer_at, self._handle_timer)
        else:
            return
        self._timer_at = timer_at

    def _handle_timer(self) -> None:
        self._timer = None
        self._quic.handle_timer(self._loop.time())
        self._process_events()
        self.transmit()

    # ---- events

    def _process_events(self) -> None:
        """Handle up to ``_EVENTS_PER_TURN`` events; more wait for the next turn, reading paused."""
        if self._more_events_scheduled:
            return  # the scheduled continuation handles them, after the application has run
        quic = self._quic
        budget = _EVENTS_PER_TURN
        while (event := quic.next_event()) is not None:
            self._handle_event(event)
            budget -= 1
            if budget == 0:
                self._more_events_scheduled = True
                if self._transport is not None and not self._reading_paused:
                    self._transport.pause_reading()
                    self._reading_paused = True
                self._loop.call_soon(self._process_more_events)
                return

    def _process_more_events(self) -> None:
        self._more_events_scheduled = False
        self._process_events()
        self.transmit()
        if not self._more_events_scheduled and self._reading_paused:
            self._reading_paused = False
            if self._transport is not None and not self._transport.is_closing():
                self._transport.resume_reading()

    def _handle_event(self, event: Any) -> None:
        if isinstance(event, HandshakeCompleted):
            self._connected = True
            waiter = self._connected_waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
        elif isinstance(event, ConnectionTerminated):
            if not self._connected:
                self._handshake_error = ConnectionError(event.reason_phrase or "connection closed")
                waiter = self._connected_waiter
                if waiter is not None and not waiter.done():
                    waiter.set_exception(self._handshake_error)
            for ping in self._ping_waiters.values():
                if not ping.done():
                    ping.set_exception(ConnectionError(event.reason_phrase))
            self._ping_waiters.clear()
            if self._transport is None:
                self._closed.set()
            # Else closed once the transport is (``connection_lost``): what was written before the
            # CONNECTION_CLOSE may still sit in the TLS transport's buffer, and a process that stops its
            # loop as soon as ``wait_closed`` returns would lose it (a worker's last pushed blocks did).
        elif isinstance(event, PingAcknowledged):
            answered = self._ping_waiters.pop(event.uid, None)
            if answered is not None and not answered.done():
                answered.set_result(None)
        self.quic_event_received(event)

    def quic_event_received(self, event: Any) -> None:
        """Overridden by ``MoqtConnection``."""


class ClientTransport:
    """What ``QMuxStack.open_client`` returns before the TCP connection exists: closing it closes the
    connection's TLS transport, or stops the connection from being opened."""

    def __init__(self, protocol: QMuxProtocol) -> None:
        self._protocol = protocol

    def close(self) -> None:
        protocol = self._protocol
        if protocol._transport is not None:
            protocol._transport.close()
        elif protocol._opening is not None:
            protocol._opening.cancel()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        transport = self._protocol._transport
        return default if transport is None else transport.get_extra_info(name, default)


# -------------------------------------------------------------------------------- TLS


def client_ssl_context(tls: TlsConfig, alpn: str) -> ssl.SSLContext:
    """TLS 1.3 client context: ALPN ``alpn``, the server verified against ``tls.ca_file`` (or
    ``ca_pem``) and its name checked, unless ``insecure_skip_verify``; our certificate for mutual TLS."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.set_alpn_protocols([alpn])
    if tls.insecure_skip_verify:
        logger.warning(
            "TLS VERIFICATION DISABLED (insecure_skip_verify): the server's identity is NOT checked; "
            "use only for debugging"
        )
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    elif tls.ca_pem is not None:
        ctx.load_verify_locations(cadata=tls.ca_pem.decode("ascii"))
    elif tls.ca_file is not None:
        ctx.load_verify_locations(cafile=str(tls.ca_file))
    else:
        raise ValueError("a client needs ca_file to verify the server (or an explicit insecure_skip_verify)")
    if tls.cert_file is not None:
        ctx.load_cert_chain(str(tls.cert_file), None if tls.key_file is None else str(tls.key_file))
    return ctx


def server_ssl_context(tls: TlsConfig, alpn: str) -> ssl.SSLContext:
    """TLS 1.3 server context: our certificate, ALPN ``alpn``; with ``require_client_cert`` the client's
    certificate is required and must chain to ``tls.ca_file`` (checked by OpenSSL in the handshake)."""
    if tls.cert_file is None:
        raise ValueError("a server needs cert_file and key_file")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.set_alpn_protocols([alpn])
    ctx.load_cert_chain(str(tls.cert_file), None if tls.key_file is None else str(tls.key_file))
    if tls.require_client_cert:
        assert tls.ca_file is not None  # TlsConfig requires it
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cafile=str(tls.ca_file))
    return ctx


def qmux_configuration(settings: TransportConfig, is_client: bool) -> QMuxConfiguration:
    """What one side grants its peer, from ``settings``: the QUIC stacks' windows, stream limits and idle
    timeout, and records of up to ``_MAX_RECORD_SIZE``."""
    return QMuxConfiguration(
        is_client=is_client,
        max_idle_timeout=settings.idle_timeout,
        max_data=settings.max_data,
        max_stream_data_bidi_local=settings.max_stream_data,
        max_stream_data_bidi_remote=settings.max_stream_data,
        max_stream_data_uni=settings.max_stream_data,
        max_streams_bidi=settings.max_streams_bidi,
        max_streams_uni=settings.max_streams_uni,
        max_record_size=_MAX_RECORD_SIZE,
        max_send_record_size=_MAX_RECORD_SIZE,
    )


# -------------------------------------------------------------------------------- the stack


@dataclass(frozen=True, eq=False)
class QMuxStack(Stack):
    """QMux over TLS 1.3 over TCP behind ``kvnet.net.stack.Stack``."""

    def base_configuration(self, settings: TransportConfig, is_client: bool) -> Any:
        """The QMux core's configuration; TLS is the ssl context's (``client_configuration``)."""
        return qmux_configuration(settings, is_client=is_client)

    def client_configuration(
        self, settings: TransportConfig, tls: TlsConfig, server_name: str | None = None
    ) -> Any:
        return QMuxTlsConfiguration(
            qmux=self.base_configuration(settings, is_client=True),
            ssl_context=client_ssl_context(tls, self.alpn), settings=settings,
            server_name=tls.server_name or server_name,
        )

    def server_configuration(self, settings: TransportConfig, tls: TlsConfig) -> Any:
        return QMuxTlsConfiguration(
            qmux=self.base_configuration(settings, is_client=False),
            ssl_context=server_ssl_context(tls, self.alpn), settings=settings,
        )

    def verify_client_certificate(self, quic: Any, cafile: str) -> None:
        # OpenSSL verified the chain against the CA during the handshake (CERT_REQUIRED); a connection
        # exists only if it passed. What is left to check is that there was one.
        if not quic.peer_certificate:
            raise ValueError("no client certificate")

    def unsent_bytes(self, quic: Any, stream_ids: Iterable[int]) -> dict[int, int]:
        # Stream data not yet framed: what the transport's back-pressure holds back.
        return {sid: quic.unsent(sid) for sid in stream_ids}

    def peer_address(self, quic: Any) -> tuple[str, int] | None:
        address: tuple[str, int] | None = quic.peer_address
        return address

    def close_event(self, quic: Any) -> Any:
        return quic.close_event

    async def open_client(
        self, settings: TransportConfig, configuration: Any, family: int, local_host: str | None,
        protocol_factory: ProtocolFactory,
    ) -> tuple[Any, Any]:
        configuration.local_host = local_host
        protocol = protocol_factory(QMuxTcpConnection(configuration))
        return ClientTransport(protocol), protocol

    async def listen(
        self, host: str, port: int, settings: TransportConfig, configuration: Any,
        create_protocol: Callable[..., Any], *, sock: socket.socket | None, max_connections: int,
    ) -> tuple[Any, tuple[str, int]]:
        loop = asyncio.get_running_loop()

        def accept() -> Any:
            return create_protocol(QMuxTcpConnection(configuration))

        where: dict[str, Any] = {"sock": sock} if sock is not None else {"host": host, "port": port}
        server = await loop.create_server(
            accept, ssl=configuration.ssl_context, backlog=_BACKLOG,
            ssl_handshake_timeout=settings.handshake_timeout, **where,
        )
        name = server.sockets[0].getsockname()
        return server, (name[0], name[1])

    def server_sockets(
        self, host: str, port: int, count: int, settings: TransportConfig
    ) -> list[socket.socket]:
        return tcp_server_sockets(host, port, count, settings)


STACK = QMuxStack(
    name="qmux",
    QuicConfiguration=QMuxTlsConfiguration,
    QuicConnection=QMuxTcpConnection,
    QuicConnectionProtocol=QMuxProtocol,
    events=qmux_events,
    connect=None,
    serve=None,
    max_datagram_size=0,
    can_request_client_certificate=True,
    alpn=ALPN_MOQT_QMUX,
    socket_type=socket.SOCK_STREAM,
    closes_own_transport=True,
)
