"""The asyncio glue between a transport stack (aioquic, qh3, aiopquic or QMux, see ``kvnet.net.stack``) and
the sans-I/O ``proto.session.MoqtSession``.

Owns: one ``MoqtConnection`` (on the stack's ``QuicConnectionProtocol``) per connection, holding one
``MoqtSession``; the async request helpers (``track_status``, ``fetch``, ``subscribe``,
``publish_namespace``), the one table from session event kind to handler (``_ROUTES``: the session's own
events handled here, each request's delivered by ``kvnet.net.routing.RequestRouter``), the peer's
requests queued for the application, the session's timer and keep-alive. Its limits are
``kvnet.net.limits.ConnectionLimits``; send-side back-pressure is ``kvnet.net.sendbuffer.SendBuffer``.
No MoQT parsing happens here: bytes go into the session, events and transmissions come out. What differs
between stacks is behind ``kvnet.net.stack.Stack`` (``self.stack``); opening connections is
``kvnet.net.endpoint``.

Rules: QUIC callbacks never await. They feed the session, apply its transmissions to QUIC, and route its
events to futures and queues; the role code awaits those from its own task (one per connection).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from kvnet.net.config import TransportConfig, keepalive_period
from kvnet.net.errors import ConnectionClosed
from kvnet.net.handles import (
    INCOMING_REQUEST_TYPES,
    FetchHandle,
    IncomingRequest,
    Subscription,
    _ObjectStream,
)
from kvnet.net.limits import ConnectionLimits
from kvnet.net.registry import get_stack
from kvnet.net.routing import NamespaceListener, RequestRouter
from kvnet.net.sendbuffer import SendBuffer
from kvnet.net.stack import Stack
from proto import events as me
from proto.data import ObjectStatus
from proto.errors import RequestErrorCode, SessionErrorCode, StreamResetCode
from proto.messages import NO_PARAMETERS, Location, MessageParameters, Properties, TrackNamespace
from proto.session import (
    CloseConnection,
    MoqtSession,
    ResetStream,
    SendDatagram,
    SendStreamData,
    SessionConfig,
    StopSending,
)

logger = logging.getLogger(__name__)

# Application calls (requests, replies, objects) whose packets may wait for one deferred transmit.
_TRANSMIT_BATCH = 32
# TLS alert bad_certificate (42) as a QUIC CRYPTO_ERROR (0x100 + alert), RFC 9001 section 4.8.
_CRYPTO_BAD_CERTIFICATE = 0x100 + 42


# -------------------------------------------------------------------------------- the protocol

if TYPE_CHECKING:
    # Both stacks expose aioquic's protocol API; type-check against aioquic's.
    from aioquic.asyncio import QuicConnectionProtocol as _ProtocolBase
else:
    _ProtocolBase = object


class MoqtConnection(_ProtocolBase):
    """One connection carrying one MoQT session. Instances are of a subclass that adds the stack's
    ``QuicConnectionProtocol`` and sets ``stack`` (``protocol_class(name)``), so this one code path
    serves all; what differs between stacks is behind ``kvnet.net.stack.Stack``."""

    stack: Stack
    """The transport stack this connection runs on (set by ``protocol_class``)."""

    def __init__(
        self,
        quic: Any,
        stream_handler: Any = None,
        *,
        session_config: SessionConfig,
        settings: TransportConfig,
        limits: ConnectionLimits | None = None,
        client_ca_file: str | None = None,
    ) -> None:
        super().__init__(quic, stream_handler)
        self.session = MoqtSession(session_config, quic)
        self.settings = settings
        self.limits = limits or ConnectionLimits()
        self._events = self.stack.events
        self._client_ca_file = client_ca_file
        self.stack.prepare_connection(self, settings, verify_client=client_ca_file is not None)
        loop = asyncio.get_running_loop()
        self._setup: asyncio.Future[me.SetupCompleted] = loop.create_future()
        # A failed handshake ends the session before anyone awaits SETUP; the caller gets that error from
        # connect(), so mark this one retrieved rather than have asyncio report it as lost.
        self._setup.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._closed_future: asyncio.Future[tuple[int, str]] = loop.create_future()
        self._incoming: asyncio.Queue[IncomingRequest | None] = asyncio.Queue()
        self._slots = asyncio.Semaphore(self.limits.max_outstanding_requests)
        self._slot_held: set[int] = set()
        self._transmit_scheduled = False
        self._untransmitted = 0
        self.owns_transport = False
        """A client connection's transport is its own (``kvnet.net.endpoint.connect`` sets this): closed once
        the connection has ended. A server's connections share the server's socket."""
        self._send_buffer = SendBuffer(
            lambda stream_ids: self.stack.unsent_bytes(self._quic, stream_ids), self.limits.max_send_buffer
        )
        self.goaway: me.GoawayReceived | None = None
        """The peer's control-stream GOAWAY, once received."""
        self.closed_by_peer = False
        """The connection ended because of what the peer sent (its CONNECTION_CLOSE, or a violation our
        stack found in its packets), not by us, our QUIC idle timeout or a lost socket: the error code
        alone cannot tell (a stack may end on its own idle timeout with NO_ERROR). Set, and the session
        closed, as the peer's close is received (aioquic reports it only after its draining period).
        Not known for aiopquic (picoquic receives on its own thread): stays False."""
        self.goaway_event = asyncio.Event()
        self.other_events: deque[me.MoqtEvent] = deque(maxlen=1024)
        """Events no helper consumes (NAMESPACE, PUBLISH_BLOCKED, ...), newest kept."""
        self.refused_requests: Counter[str] = Counter()
        """Peer requests refused for a limit before the application saw them, by limit:
        ``requests_in_flight`` (the session's ``max_requests_in_flight``) and ``incoming_queue``
        (``ConnectionLimits.max_incoming_queue``)."""
        self._log = logging.LoggerAdapter(logger, {"cid": self._quic.host_cid.hex()[:8]})
        self.router = RequestRouter(
            self.session, self.limits, loop, self._log, self.other_events, self._cancel
        )
        """Our requests and the peer's, by Request ID, with their events' handlers."""
        self._last_receive = loop.time()
        self.stream_bytes_received = 0
        """Bytes the peer sent on MoQT streams (not keep-alive PINGs): a session's own activity, seen by
        its application even before it handles them (e.g. the relay's idle reaping)."""
        self._keepalive: asyncio.TimerHandle | None = None
        self._session_timer: asyncio.TimerHandle | None = None
        self._session_timer_at: float | None = None

    # ---- QUIC callbacks (never await)

    def quic_event_received(self, event: Any) -> None:
        s = self.session
        qe = self._events
        if isinstance(event, qe.StreamDataReceived):
            now = self._loop.time()
            self.stream_bytes_received += len(event.data)
            s.receive_stream_data(event.stream_id, event.data, event.end_stream, now)
            self.router.data_arrived(event.stream_id, now)
        elif isinstance(event, qe.StreamReset):
            s.receive_stream_reset(event.stream_id, event.error_code)
        elif isinstance(event, qe.StopSendingReceived):
            s.receive_stop_sending(event.stream_id, event.error_code)
        elif isinstance(event, qe.DatagramFrameReceived):
            s.receive_datagram(event.data)
        elif isinstance(event, qe.HandshakeCompleted):
            if event.alpn_protocol != self.stack.alpn:
                # 0x178: CRYPTO_ERROR no_application_protocol (RFC 9001 section 8.1).
                self._quic.close(error_code=0x178, reason_phrase=f"ALPN {self.stack.alpn} required")
                return
            if self._client_ca_file is not None and not self._verify_client_certificate():
                return
            s.initiate()
            self._arm_keepalive()
        elif isinstance(event, qe.ConnectionTerminated):
            s.connection_lost(event.error_code, event.reason_phrase)
            if self.owns_transport and self._transport is not None and not self.stack.closes_own_transport:
                # After the stack's closing period nothing more is sent or read on the socket.
                self._loop.call_soon(self._transport.close)
        self._pump()

    @property
    def session_established(self) -> bool:
        """The SETUP exchange is over (aioquic's protocol then lets received datagrams share transmits)."""
        return self._setup.done()

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        self._last_receive = self._loop.time()
        closing = self.stack.close_event(self._quic) is not None
        super().datagram_received(data, addr)
        self._after_receive(closing)

    def datagrams_received(self, data: list[bytes], addr: Any) -> None:
        """Batched receive (qh3's client transport calls only this, never ``datagram_received``)."""
        self._last_receive = self._loop.time()
        closing = self.stack.close_event(self._quic) is not None
        super().datagrams_received(data, addr)  # type: ignore[misc]
        self._after_receive(closing)

    def buffer_updated(self, nbytes: int) -> None:
        """Bytes of a byte-stream transport arrived (QMux: ``kvnet.net.qmux_stack.QMuxProtocol``)."""
        self._last_receive = self._loop.time()
        closing = self.stack.close_event(self._quic) is not None
        super().buffer_updated(nbytes)  # type: ignore[misc]
        self._after_receive(closing)

    def _after_receive(self, closing: bool) -> None:
        if not closing and (ended := self.stack.close_event(self._quic)) is not None:
            self._closed_by_peer(ended)
        self._check_writable()

    def transmit(self) -> None:
        super().transmit()
        # qh3 counts unsent bytes, which only a transmit drains (aioquic's unacknowledged ones drain on
        # ACKs); aiopquic's protocol transmits whenever picoquic reports a stream's ring drained.
        self._check_writable()

    def _closed_by_peer(self, ended: Any) -> None:
        """What the peer sent just ended the connection (aioquic, qh3 and QMux record the close they
        begin, a ``ConnectionTerminated``, in ``Stack.close_event``; one that began while receiving came
        from the peer's packets or records)."""
        self.closed_by_peer = True
        if self.session.closed is None:
            self.session.connection_lost(ended.error_code, ended.reason_phrase)
            self._pump()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._keepalive is not None:
            self._keepalive.cancel()
            self._keepalive = None
        self._cancel_session_timer()
        if self.owns_transport and self._transport is not None:
            # A server's socket stays: its other connections share it.
            self.stack.release_client_transport(self._transport)
        super().connection_lost(exc)
        if self.session.closed is None:
            self.session.connection_lost(SessionErrorCode.NO_ERROR, "transport lost")
            self._pump()

    # ---- keep-alive

    def _arm_keepalive(self) -> None:
        interval = self.settings.keepalive_interval
        if interval > 0 and self._keepalive is None and not self.stack.keeps_alive_itself:
            self._keepalive = self._loop.call_later(interval, self._keepalive_tick)

    def _keepalive_tick(self) -> None:
        """``TransportConfig.keepalive_interval``: PING when nothing arrived for an interval. The
        peer's ACK keeps both idle timers fresh; a dead peer sends none, so QUIC's idle timeout
        (``TransportConfig.idle_timeout``) ends the connection a few intervals later."""
        self._keepalive = None
        if self.session.closed is not None or self._closed.is_set():
            return
        period = self._keepalive_period()
        idle = self._loop.time() - self._last_receive
        if idle >= period * 0.9:
            self._quic.send_ping(0)  # uid 0: no waiter; the ACK alone is what we want
            self.transmit()
            idle = 0.0
        self._keepalive = self._loop.call_later(max(0.01, period - idle), self._keepalive_tick)

    def _keepalive_period(self) -> float:
        return keepalive_period(self.settings, self.session.is_client)

    # ---- session plumbing

    def _pump(self) -> None:
        """Apply the session's transmissions to QUIC and route its events."""
        q = self._quic
        for t in self.session.transmit():
            if isinstance(t, SendStreamData):
                q.send_stream_data(t.stream_id, t.data, t.end_stream)
                self._send_buffer.wrote(t.stream_id)
            elif isinstance(t, ResetStream):
                with contextlib.suppress(ValueError, AssertionError):  # stream already finished
                    q.reset_stream(t.stream_id, t.error_code)
            elif isinstance(t, StopSending):
                with contextlib.suppress(ValueError, AssertionError):
                    q.stop_stream(t.stream_id, t.error_code)
            elif isinstance(t, SendDatagram):
                q.send_datagram_frame(t.data)
            elif isinstance(t, CloseConnection):
                q.close(error_code=t.error_code, reason_phrase=t.reason)
        while (ev := self.session.next_event()) is not None:
            self._route(ev)
        if self.session.get_timer() != self._session_timer_at:
            self._arm_session_timer()

    # ---- the session's timer (one, re-armed whenever the session's next deadline moves)

    def _arm_session_timer(self) -> None:
        self._cancel_session_timer()
        at = self.session.get_timer()
        if at is not None:
            self._session_timer = self._loop.call_at(at, self._session_timer_fired)
            self._session_timer_at = at

    def _cancel_session_timer(self) -> None:
        if self._session_timer is not None:
            self._session_timer.cancel()
            self._session_timer = None
        self._session_timer_at = None

    def _session_timer_fired(self) -> None:
        self._session_timer = None
        self._session_timer_at = None
        self.session.handle_timer(self._loop.time())
        self._pump()
        self.transmit()

    def run_action(self, action: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run a session action (a ``self.session`` method) from application code, then send what it
        produced."""
        result = action(*args, **kwargs)
        self._pump()
        self._transmit_soon()
        return result

    def _transmit_soon(self) -> None:
        """Packetize and send once the current batch of application calls is done, or now if the batch
        has reached ``_TRANSMIT_BATCH`` calls.

        Writes reach QUIC's stream buffers at once (``_pump``); only building and sending packets is
        deferred to one ``call_soon``. Every transmit walks all of QUIC's open streams, so transmitting
        after each of N requests issued together (a locate's TRACK_STATUS fan-out) cost O(N^2). The
        batch bound keeps each burst of requests small enough for the peer to answer between datagrams
        rather than refusing them once its requests-in-flight limit is reached."""
        self._untransmitted += 1
        if self._untransmitted >= _TRANSMIT_BATCH:
            self._untransmitted = 0
            self.transmit()
        elif not self._transmit_scheduled:
            self._transmit_scheduled = True
            asyncio.get_running_loop().call_soon(self._deferred_transmit)

    def _deferred_transmit(self) -> None:
        self._transmit_scheduled = False
        self._untransmitted = 0
        self.transmit()

    def _route(self, ev: me.MoqtEvent) -> None:
        """Hand one session event to its handler (``_ROUTES``); an event of a kind no handler is listed
        for is kept in ``other_events``."""
        handler = _ROUTES.get(type(ev))
        if handler is None:
            self.other_events.append(ev)
        else:
            handler(self, ev)

    # ---- the handlers of the session's own events (``_ROUTES``; a request's are ``RequestRouter``'s)

    def _on_incoming_request(self, ev: me.MoqtEvent) -> None:
        req = INCOMING_REQUEST_TYPES[type(ev)](self, ev)
        if self._incoming.qsize() >= self.limits.max_incoming_queue:
            if (buffered := self.router.stop_delivering(req.request_id)) is not None:
                buffered._finish(None)
            self.session.reject_request(req.request_id, RequestErrorCode.EXCESSIVE_LOAD, "queue full")
            self.refused_requests["incoming_queue"] += 1
            self._pump()
            return
        self.router.remember_incoming(req)
        self._incoming.put_nowait(req)

    def _on_request_refused(self, ev: me.RequestRefused) -> None:
        if ev.error_code == RequestErrorCode.EXCESSIVE_LOAD:
            self.refused_requests["requests_in_flight"] += 1

    def _on_setup(self, ev: me.SetupCompleted) -> None:
        if not self._setup.done():
            self._setup.set_result(ev)

    def _on_goaway(self, ev: me.GoawayReceived) -> None:
        if ev.request_id is None:
            self.goaway = ev
            self.goaway_event.set()
        else:
            self.other_events.append(ev)

    def _on_terminated(self, ev: me.SessionTerminated) -> None:
        err = ConnectionClosed(ev.error_code, ev.reason)
        if not self._setup.done():
            self._setup.set_exception(err)
        self.router.fail_all(err)
        self._incoming.put_nowait(None)
        self._send_buffer.release_all()  # wake writers; their next action fails on the closed session
        self._cancel_session_timer()
        if not self._closed_future.done():
            self._closed_future.set_result((ev.error_code, ev.reason))

    def _verify_client_certificate(self) -> bool:
        assert self._client_ca_file is not None
        try:
            self.stack.verify_client_certificate(self._quic, self._client_ca_file)
        except Exception as exc:  # any failure of the check means the client is not authenticated
            self._log.warning("rejecting client certificate: %s", exc)
            self._quic.close(error_code=_CRYPTO_BAD_CERTIFICATE, reason_phrase=f"client certificate: {exc}")
            return False
        return True

    # ---- what the request handles (kvnet.net.handles) use, besides ``run_action`` and ``cancel_request``

    def deliver_objects(self, request_id: int, objects: _ObjectStream) -> None:
        """Route the objects and the end of request ``request_id`` to ``objects``."""
        self.router.deliver_objects(request_id, objects)

    def stop_delivering(self, request_id: int) -> None:
        """Route nothing more to the handle of ``request_id`` (its objects are dropped from now on)."""
        self.router.stop_delivering(request_id)

    def objects_queued(self, nbytes: int) -> None:
        """A handle queued ``nbytes`` of object payload for the application (``receive_buffered``)."""
        self.router.received_bytes += nbytes

    def objects_consumed(self, nbytes: int) -> None:
        """The application took (or a handle dropped) ``nbytes`` of queued object payload."""
        self.router.received_bytes -= nbytes

    # ---- back-pressure

    @property
    def receive_buffered(self) -> int:
        """Object bytes received and not yet consumed by the application, over all requests."""
        return self.router.received_bytes

    @property
    def requests_in_flight(self) -> int:
        """Requests a session that got GOAWAY lets finish before closing (``RequestRouter``'s count)."""
        return self.router.requests_in_flight

    @property
    def open_incoming_requests(self) -> int:
        """Incoming requests this side still tracks (open ones, plus answered ones until the next sweep)."""
        return self.router.open_incoming

    @property
    def request_header_timeouts(self) -> int:
        """Request streams of this session reset because their first message came too slowly."""
        return self.session.request_header_timeouts

    def send_buffered(self) -> int:
        """Bytes written to QUIC streams and not yet acknowledged (qh3: not yet sent)."""
        return self._send_buffer.buffered()

    def _check_writable(self) -> None:
        """Wake the writers the bytes drained since the last check release (all, once the session is over)."""
        if self._send_buffer.has_waiters():
            self._send_buffer.check(self.session.closed is not None)

    def is_writable(self) -> bool:
        """Unacknowledged bytes are below ``limits.max_send_buffer``: more may be written without waiting."""
        return self._send_buffer.is_writable()

    async def wait_writable(self) -> None:
        """Wait until unacknowledged bytes drop below ``limits.max_send_buffer``."""
        await self._send_buffer.wait_writable()

    async def wait_send_buffer_empty(self) -> None:
        """Wait until every byte written to QUIC streams is acknowledged (or, with qh3, sent), or the
        session is over."""
        if self.session.closed is None:
            await self._send_buffer.wait_empty()

    async def wait_stream_sent(self, stream_id: int) -> None:
        """Wait until every byte written to ``stream_id`` is acknowledged (or, with qh3, sent), or the
        session is over. A publisher ends a track with PUBLISH_DONE only then: the receiver waits for the
        track's streams just ``publish_done_timeout`` after PUBLISH_DONE, which must not have to cover
        bytes still queued behind a slow link."""
        if self.session.closed is None:
            await self._send_buffer.wait_stream_sent(stream_id)

    # ---- requests we send

    async def wait_setup(self) -> me.SetupCompleted:
        async with asyncio.timeout(self.limits.setup_timeout):
            return await asyncio.shield(self._setup)

    async def _acquire(self) -> None:
        if self.session.closed is not None:
            raise ConnectionClosed(*self.session.closed)
        await self._slots.acquire()

    def _register_slot(self, request_id: int) -> None:
        self._slot_held.add(request_id)

    def release_request_slot(self, request_id: int) -> None:
        """Give back the ``max_outstanding_requests`` slot a request of ours held (once it has ended)."""
        if request_id in self._slot_held:
            self._slot_held.discard(request_id)
            self._slots.release()

    def _cancel(self, request_id: int, code: StreamResetCode = StreamResetCode.CANCELLED) -> None:
        self.router.stop_delivering(request_id)
        if self.session.closed is None:
            with contextlib.suppress(Exception):  # the request may have ended meanwhile
                self.run_action(self.session.cancel_request, request_id, code)

    async def _request(self, action: Callable[..., int], *args: Any) -> Any:
        await self._acquire()
        try:
            rid: int = self.run_action(action, *args)
        except BaseException:
            self._slots.release()
            raise
        self._register_slot(rid)
        fut = self.router.expect_answer(rid)
        try:
            return await fut
        except asyncio.CancelledError:
            self._abandon(rid)
            raise
        finally:
            self.release_request_slot(rid)

    def _abandon(self, request_id: int) -> None:
        """The caller stopped waiting for an answer: cancel the request so the peer stops working on it
        and its late answer (or objects) is not buffered for nobody."""
        self.router.forget_answer(request_id)
        self._cancel(request_id)

    async def track_status(
        self, namespace: TrackNamespace, name: bytes, parameters: MessageParameters = NO_PARAMETERS
    ) -> me.TrackStatusOkReceived:
        """TRACK_STATUS; raises ``RequestRejected`` on REQUEST_ERROR."""
        result: me.TrackStatusOkReceived = await self._request(self.session.track_status, namespace, name,
                                                              parameters)
        return result

    async def publish_namespace(
        self, namespace: TrackNamespace, parameters: MessageParameters = NO_PARAMETERS
    ) -> int:
        """PUBLISH_NAMESPACE; returns its Request ID once the peer answered REQUEST_OK."""
        return await self._standing_request(self.session.publish_namespace, namespace, parameters)

    async def subscribe_namespace(
        self,
        prefix: TrackNamespace,
        parameters: MessageParameters = NO_PARAMETERS,
        on_namespace: NamespaceListener | None = None,
    ) -> int:
        """SUBSCRIBE_NAMESPACE; returns its Request ID once the peer answered REQUEST_OK. The NAMESPACE
        and NAMESPACE_DONE that follow go to ``on_namespace`` as they arrive (none is missed: it is in
        place before the answer), or without it to ``other_events``."""
        return await self._standing_request(
            self.session.subscribe_namespace, prefix, parameters, listener=on_namespace
        )

    async def subscribe_tracks(
        self, prefix: TrackNamespace, parameters: MessageParameters = NO_PARAMETERS
    ) -> int:
        """SUBSCRIBE_TRACKS; returns its Request ID once the peer answered REQUEST_OK. The peer's
        PUBLISH requests for matching tracks arrive as ``IncomingPublish``."""
        return await self._standing_request(self.session.subscribe_tracks, prefix, parameters)

    async def _standing_request(
        self,
        action: Callable[..., int],
        *args: Any,
        listener: NamespaceListener | None = None,
    ) -> int:
        """A request that stays open after REQUEST_OK until cancelled; returns its Request ID then."""
        await self._acquire()
        try:
            rid: int = self.run_action(action, *args)
            if listener is not None:
                self.router.listen_namespaces(rid, listener)
            fut = self.router.expect_answer(rid)
            try:
                await fut
            except BaseException:
                self.router.stop_listening(rid)
                raise
        finally:
            # The request stays open, but it does not hold a request slot.
            self._slots.release()
        return rid

    async def fetch(
        self, namespace: TrackNamespace, name: bytes, start: Location, end: Location,
        parameters: MessageParameters = NO_PARAMETERS,
    ) -> FetchHandle:
        """Send a standalone FETCH for [start, end); returns at once with a handle to read it."""
        await self._acquire()
        try:
            rid: int = self.session.fetch(namespace, name, start, end, parameters)
        except BaseException:
            self._slots.release()
            raise
        self._register_slot(rid)
        handle = FetchHandle(self, rid)
        self.deliver_objects(rid, handle)
        self._pump()
        self._transmit_soon()
        return handle

    async def subscribe(
        self, namespace: TrackNamespace, name: bytes, parameters: MessageParameters = NO_PARAMETERS
    ) -> Subscription:
        """SUBSCRIBE; returns once SUBSCRIBE_OK arrived (raises ``RequestRejected`` otherwise)."""
        await self._acquire()
        try:
            rid: int = self.session.subscribe(namespace, name, parameters)
        except BaseException:
            self._slots.release()
            raise
        self._register_slot(rid)
        sub = Subscription(self, rid)
        self.deliver_objects(rid, sub)
        fut = self.router.expect_answer(rid)
        self._pump()
        self._transmit_soon()
        try:
            await fut
        except asyncio.CancelledError:
            self._abandon(rid)
            self.release_request_slot(rid)
            raise
        return sub

    async def publish(
        self, namespace: TrackNamespace, name: bytes, track_alias: int,
        parameters: MessageParameters = NO_PARAMETERS, track_properties: Properties = (),
    ) -> me.PublishOkReceived:
        """PUBLISH a track under ``track_alias``; returns PUBLISH_OK (raises ``RequestRejected``). Then send
        its objects with ``open_subgroup`` / ``send_subgroup_object`` and end it with ``publish_done``."""
        result: me.PublishOkReceived = await self._request(
            self.session.publish, namespace, name, track_alias, parameters, track_properties
        )
        return result

    def cancel_request(self, request_id: int, code: StreamResetCode = StreamResetCode.CANCELLED) -> None:
        """Abandon a request either side started (resets its streams); a no-op once it has ended."""
        self.router.stop_listening(request_id)
        st = self.router.objects(request_id)
        self._cancel(request_id, code)
        if st is not None:
            st._finish(None)
            st._discard()

    # ---- objects of subscriptions we publish (an accepted SUBSCRIBE or our PUBLISH)

    def open_subgroup(
        self, track_alias: int, group_id: int, subgroup_id: int, publisher_priority: int | None = None,
        *, has_properties: bool = False, first_object: bool = False,
    ) -> int:
        """Open a subgroup stream; returns its stream id. ``first_object``: its first object will be the
        first the original publisher sent in the subgroup (the draft's FIRST_OBJECT bit, a MUST then)."""
        sid: int = self.run_action(self.session.open_subgroup, track_alias, group_id, subgroup_id,
                                   publisher_priority, has_properties=has_properties,
                                   first_object=first_object)
        return sid

    def send_subgroup_object(
        self, stream_id: int, object_id: int, payload: bytes, properties: Properties = (),
        status: ObjectStatus = ObjectStatus.NORMAL, end_stream: bool = False,
    ) -> None:
        """One object (or a status object such as END_OF_TRACK) on a subgroup stream; ``end_stream`` FINs."""
        self.run_action(self.session.send_subgroup_object, stream_id, object_id, payload, properties, status,
                        end_stream)

    def close_subgroup(self, stream_id: int) -> None:
        """FIN a subgroup stream: every object of its subgroup has been sent on it."""
        self.run_action(self.session.close_subgroup, stream_id)

    def reset_subgroup(self, stream_id: int, code: StreamResetCode = StreamResetCode.CANCELLED) -> None:
        """Reset a subgroup stream whose subgroup was not sent whole (draft "Closing Subgroup Streams")."""
        self.run_action(self.session.reset_subgroup, stream_id, code)

    def publish_done(self, request_id: int, status_code: int, reason: str = "") -> None:
        """PUBLISH_DONE for a subscription we publish (its subgroup streams must be closed first)."""
        self.run_action(self.session.publish_done, request_id, status_code, reason)

    def namespace(self, request_id: int, suffix: TrackNamespace) -> None:
        """NAMESPACE on an accepted SUBSCRIBE_NAMESPACE."""
        self.run_action(self.session.namespace, request_id, suffix)

    def namespace_done(self, request_id: int, suffix: TrackNamespace) -> None:
        """NAMESPACE_DONE for a suffix sent earlier with ``namespace``."""
        self.run_action(self.session.namespace_done, request_id, suffix)

    # ---- incoming

    async def next_request(self) -> IncomingRequest | None:
        """The next request from the peer, or None once the session is over."""
        req = await self._incoming.get()
        if req is None:
            self._incoming.put_nowait(None)  # keep reporting the end to later callers
            return None
        return req

    async def incoming_requests(self) -> AsyncIterator[IncomingRequest]:
        """Requests from the peer until the session ends."""
        while (req := await self.next_request()) is not None:
            yield req

    # ---- lifecycle

    @property
    def is_closed(self) -> bool:
        return self.session.closed is not None

    @property
    def peer_setup(self) -> me.SetupCompleted | None:
        """The peer's SETUP options (authorization tokens, path, ...), once the exchange completed."""
        fut = self._setup
        return fut.result() if fut.done() and fut.exception() is None else None

    @property
    def peer_address(self) -> str:
        """``host:port`` of the peer, or "?" when the stack does not know it (yet)."""
        addr = self.stack.peer_address(self._quic)
        return "?" if addr is None else f"{addr[0]}:{addr[1]}"

    async def goaway_peer(self, new_session_uri: str = "", timeout_ms: int = 0) -> None:
        """Send GOAWAY on the control stream (servers may name a new session URI)."""
        self.run_action(self.session.goaway, new_session_uri.encode(), timeout_ms)

    async def close_session(
        self, code: SessionErrorCode = SessionErrorCode.NO_ERROR, reason: str = ""
    ) -> None:
        """Close the MoQT session and the QUIC connection, and wait until it is gone."""
        if self.session.closed is None:
            self.run_action(self.session.close, code, reason)
        self.close()
        await self.wait_closed()

    async def wait_session_closed(self) -> tuple[int, str]:
        """Wait for the session to end; returns (error code, reason)."""
        return await asyncio.shield(self._closed_future)

    async def wait_leaving(self) -> str:
        """Wait until a client should move off this session: it closed (peer gone, keep-alive lost) or the
        peer sent GOAWAY; returns which, for the log."""
        closed = asyncio.ensure_future(self.wait_session_closed())
        goaway = asyncio.ensure_future(self.goaway_event.wait())
        try:
            await asyncio.wait({closed, goaway}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            goaway.cancel()
        if not closed.done():
            closed.cancel()
            return "peer sent GOAWAY"
        code, reason = closed.result()
        return f"session closed (code {code:#x}): {reason or 'no reason given'}"


def _request_event(handler: Callable[[RequestRouter, Any], None]) -> Callable[[MoqtConnection, Any], None]:
    """A ``RequestRouter`` handler as a row of ``_ROUTES``: run on the connection's router."""

    def route(conn: MoqtConnection, ev: Any) -> None:
        handler(conn.router, ev)

    return route


_ROUTES: dict[type[me.MoqtEvent], Callable[[MoqtConnection, Any], None]] = {
    **{kind: _request_event(handler) for kind, handler in RequestRouter.ROUTES.items()},
    **{kind: MoqtConnection._on_incoming_request for kind in INCOMING_REQUEST_TYPES},
    me.SetupCompleted: MoqtConnection._on_setup,
    me.SessionTerminated: MoqtConnection._on_terminated,
    me.RequestRefused: MoqtConnection._on_request_refused,
    me.GoawayReceived: MoqtConnection._on_goaway,
}
"""Session event kind -> its handler: the session's own events here, each request's in ``RequestRouter``;
an event of any other kind goes to ``other_events``."""


@functools.cache
def protocol_class(name: str) -> type[MoqtConnection]:
    """``MoqtConnection`` on top of the protocol of the stack called ``name`` (``kvnet.net.registry``)."""
    stack = get_stack(name)
    return type(f"MoqtConnection_{name}", (MoqtConnection, stack.QuicConnectionProtocol),
                {"__module__": __name__, "stack": stack})
