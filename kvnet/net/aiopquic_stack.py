"""The aiopquic stack (picoquic, a C QUIC core, behind an asyncio API shaped like qh3's; Python >= 3.12).

Owns: aiopquic's configuration from ``TransportConfig``, its client and server endpoints, and the
adaptation of aiopquic to the protocol API ``kvnet.net.connection`` is written against (aioquic's
``QuicConnectionProtocol``), so that ``MoqtConnection`` keeps one code path for every stack.

How it differs and what is done about it (aiopquic 0.6.1):

- picoquic owns the UDP socket and runs every connection of a ``TransportContext`` on its own network
  thread (one per client connection, one per server); packets never reach Python. The two threads talk
  through rings: an event file descriptor wakes the event loop, which drains stream, datagram and
  lifecycle events (``_process_events``). So the adaptation is at the level of stream and datagram events:
  there is no ``datagram_received`` and nothing to ``transmit()``; kvnet's ``transmit()`` only moves
  writes that did not fit yet into picoquic's rings.
- Writes are all-or-nothing into a per-stream ring (4 MiB) and an event ring: a full ring raises
  ``BufferError``. ``StreamWriter`` keeps what did not fit per stream, in order, and retries when
  picoquic reports the stream's ring drained (or, for the event ring, when it drained below its low mark).
  "Unsent" (``unsent_bytes``) is bytes not yet taken into packets, as with qh3.
- No ``send_ping``: keep-alive is picoquic's own (``QuicConfiguration.keep_alive_interval``), set from
  ``TransportConfig.keepalive_interval`` with the same longer period on the server side.
- No client-certificate verification on the server side: ``Stack.server_configuration`` refuses
  ``require_client_cert`` for this stack, as for qh3.
- Datagram size: picoquic starts at ~1252 bytes and probes the path MTU up to its compile-time maximum
  (``MAX_DATAGRAM_SIZE_AIOPQUIC``, 1536) and never above the peer's ``max_udp_payload_size``; jumbo and
  loopback paths get no larger datagrams than that, and the Ethernet preset is what probing finds on
  the path (on loopback to a qh3 peer, which advertises no limit: 1472), not 1452 exactly. A configured
  ``max_datagram_size`` below 1452 turns probing off (picoquic stays at its initial size).
- The server listens on every address of the port (picoquic binds the wildcard address).
- A peer's CONNECTION_CLOSE reason phrase is not reported (error codes are).
- qh3 servers (2.1) fail the handshake of an aiopquic client ("packet builder capacity exhausted" on the
  qh3 side, at any datagram size): an aiopquic relay's upstream must not be a qh3 relay.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import aiopquic.asyncio as aiopquic_asyncio
import aiopquic.quic.events as aiopquic_events
from aiopquic.asyncio.protocol import QuicConnectionProtocol as _AiopquicProtocol
from aiopquic.quic.configuration import QuicConfiguration
from aiopquic.quic.connection import QuicConnection
from aiopquic.quic.events import ConnectionTerminated, HandshakeCompleted

from kvnet.net.config import (
    DATAGRAM_SIZE_ETHERNET,
    MAX_DATAGRAM_SIZE_AIOPQUIC,
    TransportConfig,
    keepalive_period,
)
from kvnet.net.stack import ProtocolFactory, Stack

logger = logging.getLogger(__name__)

# Events handled per event-loop turn and connection. picoquic hands over hundreds at once (a whole burst
# of requests); handling them all before the application runs once would fill the session's
# requests-in-flight limit with requests the application could have answered in between, as it does
# between datagrams on the other stacks.
_EVENTS_PER_TURN = 32
# TLS alerts (RFC 8446 section 6) a failed handshake ends with, as QUIC CRYPTO_ERROR 0x100 + alert.
_TLS_ALERTS = {
    40: "handshake_failure", 42: "bad_certificate", 43: "unsupported_certificate",
    44: "certificate_revoked", 45: "certificate_expired", 46: "certificate_unknown", 48: "unknown_ca",
    49: "access_denied", 51: "decrypt_error", 80: "internal_error", 109: "missing_extension",
    116: "certificate_required", 120: "no_application_protocol",
}
_CRYPTO_ERROR = 0x100
# Most connections one server holds (picoquic's table size).
_MAX_CONNECTIONS = 1 << 16
# Largest write handed to picoquic at once: well below its per-stream ring (4 MiB), so one object never
# exceeds the ring and a partly drained ring takes the next piece.
_WRITE_PIECE = 1 << 20


class StreamWriter:
    """aiopquic's ``QuicConnection`` with aioquic's never-failing ``send_stream_data``: writes that do not
    fit picoquic's rings wait here, per stream and in order, until ``flush``. Every other attribute is
    the wrapped connection's."""

    def __init__(self, quic: Any) -> None:
        self._quic = quic
        self._backlog: dict[int, deque[tuple[bytes, bool]]] = {}
        self._backlog_bytes: dict[int, int] = {}
        self._ring_wait: asyncio.Task[None] | None = None
        # Hot paths bound once rather than looked up through __getattr__ on every event.
        self.next_event = quic.next_event
        ids = quic.connection_ids
        self.host_cid: bytes = ids["local"] if ids else b""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._quic, name)

    def send_stream_data(self, stream_id: int, data: bytes, end_stream: bool = False) -> None:
        # picoquic's ring copies from ``bytes`` only.
        data = data if type(data) is bytes else bytes(data)
        backlog = self._backlog.get(stream_id)
        if backlog is None:
            while len(data) > _WRITE_PIECE:
                if not self._try_send(stream_id, data[:_WRITE_PIECE], False):
                    break
                data = data[_WRITE_PIECE:]
            else:
                if self._try_send(stream_id, data, end_stream):
                    return
            backlog = self._backlog[stream_id] = deque()
            self._backlog_bytes[stream_id] = 0
        backlog.append((data, end_stream))
        self._backlog_bytes[stream_id] += len(data)

    def _try_send(self, stream_id: int, data: bytes, end_stream: bool) -> bool:
        try:
            self._quic.send_stream_data(stream_id, data, end_stream)
        except BufferError:
            self._await_ring(stream_id)
            return False
        return True

    def _await_ring(self, stream_id: int) -> None:
        """After a full ring: the stream's ring full arms picoquic's per-stream drain event (delivered
        through ``_process_events``, which flushes); the connection-wide event ring full is reported only
        on the transport's own event, which a task waits for."""
        quic = self._quic
        transport = quic._transport
        if transport is None or self._ring_wait is not None or quic.tx_event_ring_fill() < 0.9:
            return
        drained = transport.tx_event_ring_drain_event
        drained.clear()
        if not transport.arm_tx_event_ring_drain_pending():
            asyncio.get_running_loop().call_soon(self.flush)
            return

        async def wait() -> None:
            try:
                await drained.wait()
            finally:
                self._ring_wait = None
            self.flush()

        self._ring_wait = asyncio.get_running_loop().create_task(wait())

    def flush(self) -> None:
        """Hand picoquic whatever of the backlog now fits."""
        if not self._backlog:
            return
        if self._quic.closed:
            self._backlog.clear()
            self._backlog_bytes.clear()
            return
        for stream_id in list(self._backlog):
            backlog = self._backlog[stream_id]
            while backlog:
                data, end_stream = backlog[0]
                piece = data[:_WRITE_PIECE]
                last = len(piece) == len(data)
                if not self._try_send(stream_id, piece, end_stream and last):
                    break
                self._backlog_bytes[stream_id] -= len(piece)
                if last:
                    backlog.popleft()
                else:
                    backlog[0] = (data[_WRITE_PIECE:], end_stream)
            if not backlog:
                del self._backlog[stream_id]
                del self._backlog_bytes[stream_id]

    def unsent(self, stream_id: int) -> int:
        """Bytes of ``stream_id`` not yet taken into packets (ours plus picoquic's ring). While any are,
        picoquic is asked to report the next drain of the stream's ring, so waiters on this count wake."""
        quic = self._quic
        in_ring = int(quic.tx_data_ring_used(stream_id))
        if in_ring:
            quic.set_tx_data_drain_pending(stream_id)
        return in_ring + self._backlog_bytes.get(stream_id, 0)

    def reset_stream(self, stream_id: int, error_code: int) -> None:
        self._forget(stream_id)
        self._quic.reset_stream(stream_id, error_code)

    def _forget(self, stream_id: int) -> None:
        self._backlog.pop(stream_id, None)
        self._backlog_bytes.pop(stream_id, None)

    def send_datagram_frame(self, data: bytes) -> None:
        # Datagrams are unreliable by nature: one that does not fit the ring or a packet is dropped.
        try:
            if not self._quic.send_datagram_frame(data):
                logger.debug("QUIC datagram ring full: datagram of %d bytes dropped", len(data))
        except (ValueError, ConnectionError) as exc:
            logger.debug("QUIC datagram of %d bytes dropped: %s", len(data), exc)

    def close(self, error_code: int = 0, frame_type: int | None = None, reason_phrase: str = "") -> None:
        self._quic.close(error_code, frame_type, reason_phrase)


class AiopquicProtocol(_AiopquicProtocol):
    """aiopquic's protocol with the parts of aioquic's protocol API that ``MoqtConnection`` calls."""

    def __init__(self, quic: Any, stream_handler: Any = None) -> None:
        super().__init__(StreamWriter(quic), stream_handler)
        self._loop = asyncio.get_running_loop()
        self._terminated = False
        self._more_events_scheduled = False
        self._events_before_yield = _EVENTS_PER_TURN

    def transmit(self) -> None:
        """picoquic builds and sends packets on its own thread; this hands it writes that waited."""
        self._quic.flush()

    def _process_events(self) -> None:
        """Handle the connection's events, yielding to the event loop after every ``_EVENTS_PER_TURN``
        (a server's engine calls this once per event it routes, many in one go)."""
        if self._more_events_scheduled:
            return  # the scheduled continuation handles them, after the application has run
        quic = self._quic
        while True:
            if self._events_before_yield == 0:
                self._more_events_scheduled = True
                self._loop.call_soon(self._process_more_events)
                break
            event = quic.next_event()
            if event is None:
                break
            self._events_before_yield -= 1
            self._track_lifecycle(event)
            try:
                self.quic_event_received(event)
            except Exception:  # as aiopquic's own protocol: one failing event must not stop the others
                logger.exception("QUIC event %s dropped by its handler", type(event).__name__)
        # Stream rings may have drained (the events that say so are among the ones just handled).
        self.transmit()
        if not self._terminated and self._closed.is_set():
            self._terminated = True
            self.connection_lost(None)

    def _process_more_events(self) -> None:
        self._more_events_scheduled = False
        self._events_before_yield = _EVENTS_PER_TURN
        self._process_events()

    def _track_lifecycle(self, event: Any) -> None:
        """What aiopquic's protocol does with an event before its handler: the handshake waiter, the
        closed flag, and a connection that ended during the handshake failing ``wait_connected``."""
        waiter = self._connected_waiter
        if isinstance(event, HandshakeCompleted):
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
        elif isinstance(event, ConnectionTerminated):
            # picoquic reports no reason phrase; name the TLS alert of a failed handshake at least.
            if not event.reason_phrase and _CRYPTO_ERROR <= event.error_code < _CRYPTO_ERROR + 256:
                alert = event.error_code - _CRYPTO_ERROR
                event.reason_phrase = f"TLS alert {_TLS_ALERTS.get(alert, alert)}"
            elif not event.reason_phrase and not self._quic._connected and event.error_code:
                event.reason_phrase = (f"closed with error {event.error_code:#x} during the handshake "
                                       "(aiopquic reports no reason)")
            elif not event.reason_phrase and not self._quic._connected:
                # A client whose own check of the server's certificate failed gets no code either.
                event.reason_phrase = ("aiopquic reports no reason; the usual ones: the server's certificate "
                                       "does not chain to the CA, names another host, or has expired")
            self._closed.set()
            if not self._quic._connected:
                code = event.error_code
                exc = ConnectionError(f"connection terminated during handshake (error_code={code})")
                self._handshake_error = exc
                if waiter is not None and not waiter.done():
                    waiter.set_exception(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        """The connection is over. A client connection owns its picoquic transport (socket and thread):
        stop it now, not only when someone awaits ``wait_closed``."""
        if self._quic._engine is None:
            self._loop.call_soon(self._stop_transport)

    def _stop_transport(self) -> None:
        self._stop()
        with contextlib.suppress(Exception):  # already stopped by wait_closed
            self._quic.stop()


class ClientTransport:
    """What ``AiopquicStack.open_client`` returns in place of a datagram transport:
    closing it stops the connection's picoquic transport (its socket and thread)."""

    def __init__(self, protocol: AiopquicProtocol) -> None:
        self._protocol = protocol

    def close(self) -> None:
        self._protocol._stop_transport()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default  # picoquic's socket is not reachable from Python


@dataclass(frozen=True, eq=False)
class AiopquicStack(Stack):
    """aiopquic behind ``kvnet.net.stack.Stack``."""

    def base_configuration(self, settings: TransportConfig, is_client: bool) -> Any:
        return QuicConfiguration(
            is_client=is_client,
            alpn_protocols=[self.alpn],
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

    def unsent_bytes(self, quic: Any, stream_ids: Iterable[int]) -> dict[int, int]:
        return {sid: quic.unsent(sid) for sid in stream_ids}

    def peer_address(self, quic: Any) -> tuple[str, int] | None:
        addr = quic.peer_address()  # picoquic is asked
        return (addr[0], addr[1]) if addr else None

    async def open_client(
        self, settings: TransportConfig, configuration: Any, family: int, local_host: str | None,
        protocol_factory: ProtocolFactory,
    ) -> tuple[Any, Any]:
        if local_host is not None:
            raise ValueError("QUIC stack aiopquic binds its own socket: a local address cannot be chosen")
        return open_client(configuration, protocol_factory)

    async def listen(
        self, host: str, port: int, settings: TransportConfig, configuration: Any,
        create_protocol: Callable[..., Any], *, sock: socket.socket | None, max_connections: int,
    ) -> tuple[Any, tuple[str, int]]:
        if sock is not None:
            raise ValueError("QUIC stack aiopquic binds its own socket: it cannot serve on a given one")
        # picoquic refuses connections past its own limit before any session exists; leave room for the
        # ones the endpoint refuses with a reason. It sizes its tables by the limit up front (a relay that
        # counts sessions itself passes 2^30, which picoquic cannot allocate).
        configuration.max_connections = min(max_connections + 64, _MAX_CONNECTIONS)
        if port == 0:
            # picoquic does not report the port it bound: choose a free one here.
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        assert self.serve is not None
        server = await self.serve(host, port, configuration=configuration, create_protocol=create_protocol)
        return server, (host, port)


def open_client(
    configuration: Any, protocol_factory: ProtocolFactory
) -> tuple[ClientTransport, AiopquicProtocol]:
    """Start a client connection's picoquic transport (its own socket on an ephemeral port of the
    wildcard address, and its thread) and its protocol, ready for ``protocol.connect(addr)``."""
    quic = QuicConnection(configuration=configuration)
    quic._start_transport(port=0)
    try:
        protocol = protocol_factory(quic)
        protocol._start(asyncio.get_running_loop())
    except BaseException:
        quic.stop()
        raise
    return ClientTransport(protocol), protocol


STACK = AiopquicStack(
    name="aiopquic",
    QuicConfiguration=QuicConfiguration,
    QuicConnection=QuicConnection,
    QuicConnectionProtocol=AiopquicProtocol,
    events=aiopquic_events,
    connect=aiopquic_asyncio.connect,
    serve=aiopquic_asyncio.serve,
    max_datagram_size=MAX_DATAGRAM_SIZE_AIOPQUIC,
    keeps_alive_itself=True,
    binds_own_socket=True,
    accepts_ca_pem=False,
)
