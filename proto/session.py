"""The sans-I/O MoQT draft-18 session: bytes in, events out, transmissions out.

``MoqtSession`` sees QUIC only as stream ids, bytes, resets and datagrams. The glue feeds what QUIC
delivered (``receive_stream_data``, ``receive_stream_reset``, ``receive_stop_sending``,
``receive_datagram``, ``connection_lost``), pulls events (``next_event``), writes what
``transmit`` returns and keeps one timer at ``get_timer()`` that calls ``handle_timer(now)`` (time is
always a parameter; the session has no clock). Application actions are method calls that validate the
local state and raise ``UsageError`` on misuse; they never touch the wire directly.

Contract (h11's): peer bytes make no exception escape this class. A ``ProtocolError`` raised anywhere
below a ``receive_*`` method is caught once there and turned into ``close(code, reason)`` plus a
``SessionTerminated`` event; any other exception is a bug. Failures that belong to one request become
REQUEST_ERROR or a stream reset and the session stays up.

This module owns the session object and its public surface: the QUIC entry points, the timer (the
deadline for a request stream's first message), close and GOAWAY, the requests we send and our replies
to the peer's. ``MoqtSession`` is one class composed of parts over one shared state
(``proto.session_state``), each in its own module: request streams (``proto.session_requests``, with
``proto.request_state``'s table of what each side of each request kind may send), control messages
received (``proto.session_control``), the peer's data streams and datagrams (``proto.session_data``) and
the objects we send (``proto.session_sending``); configuration and the QUIC seam are in
``proto.session_config``, bounded id memories in ``proto.session_limits``.
The role (client/server, publisher/subscriber) is a parameter, never a separate code path.
"""

from __future__ import annotations

from .errors import (
    ProtocolError,
    PublishDoneCode,
    RequestErrorCode,
    SessionErrorCode,
    StreamResetCode,
    UsageError,
)
from .events import (
    MoqtEvent,
    SessionTerminated,
)
from .messages import (
    NO_PARAMETERS,
    Fetch,
    FetchOk,
    FetchType,
    Goaway,
    JoiningFetch,
    Location,
    MessageParameters,
    Namespace,
    NamespaceDone,
    Properties,
    Publish,
    PublishBlocked,
    PublishDone,
    PublishNamespace,
    PublishOk,
    Redirect,
    RequestError,
    RequestOk,
    RequestUpdate,
    Setup,
    StandaloneFetch,
    Subscribe,
    SubscribeNamespace,
    SubscribeOk,
    SubscribeTracks,
    TrackNamespace,
    TrackStatus,
    encode_message,
)
from .session_config import (
    CloseConnection,
    ResetStream,
    SendDatagram,
    SendStreamData,
    SessionConfig,
    StopSending,
    StreamIdAllocator,
    Transmit,
)
from .session_control import ControlMessages
from .session_data import DataStreams
from .session_requests import RequestStreams
from .session_sending import ObjectSending
from .session_state import (
    K_FETCH,
    K_SNS,
    K_STR,
    K_SUB,
    K_TS,
    MessageHandler,
    is_uni_stream,
    range_end_before,
)

__all__ = [
    "CloseConnection",
    "MoqtSession",
    "ResetStream",
    "SendDatagram",
    "SendStreamData",
    "SessionConfig",
    "StopSending",
    "StreamIdAllocator",
    "Transmit",
]


class MoqtSession(ControlMessages, RequestStreams, DataStreams, ObjectSending):
    """One MoQT session over one QUIC connection, without I/O.

    Call ``initiate()`` once QUIC is connected (both endpoints do: each opens its own control
    stream with SETUP). Feed everything QUIC delivers to the ``receive_*`` methods, then drain
    ``next_event()`` and write ``transmit()``. If any method here raises something other than
    ``UsageError`` (local misuse), that is a bug.
    """

    def __init__(self, config: SessionConfig, streams: StreamIdAllocator) -> None:
        super().__init__(config, streams)
        self._handlers: dict[int, MessageHandler] = {
            Setup.TYPE: self._handle_setup,
            Goaway.TYPE: self._handle_goaway,
            Subscribe.TYPE: self._handle_subscribe,
            SubscribeOk.TYPE: self._handle_subscribe_ok,
            Publish.TYPE: self._handle_publish,
            PublishOk.TYPE: self._handle_publish_ok,
            PublishDone.TYPE: self._handle_publish_done,
            Fetch.TYPE: self._handle_fetch,
            FetchOk.TYPE: self._handle_fetch_ok,
            TrackStatus.TYPE: self._handle_track_status,
            PublishNamespace.TYPE: self._handle_publish_namespace,
            SubscribeNamespace.TYPE: self._handle_subscribe_namespace,
            SubscribeTracks.TYPE: self._handle_subscribe_tracks,
            Namespace.TYPE: self._handle_namespace,
            NamespaceDone.TYPE: self._handle_namespace_done,
            PublishBlocked.TYPE: self._handle_publish_blocked,
            RequestUpdate.TYPE: self._handle_request_update,
            RequestOk.TYPE: self._handle_request_ok,
            RequestError.TYPE: self._handle_request_error,
        }

    # -- properties ------------------------------------------------------------------------------

    @property
    def peer_setup(self) -> Setup | None:
        """The peer's SETUP message, once received."""
        return self._peer_setup

    @property
    def goaway_received(self) -> bool:
        """The peer sent GOAWAY on the control stream: no new requests may be initiated."""
        return self._goaway_received

    def request_is_open(self, request_id: int) -> bool:
        """The request exists and is not over yet: events and actions for it are still possible."""
        req = self._requests.get(request_id)
        return req is not None and not req.ended

    def data_stream_request(self, stream_id: int) -> int | None:
        """The request a peer's data stream (subgroup or fetch) carries objects of, once its header has
        tied it to one; None otherwise. Lets an application count bytes still arriving for a request as
        progress before a whole object is in."""
        stream = self._incoming.get(stream_id)
        return None if stream is None else stream.request_id

    # -- output ----------------------------------------------------------------------------------

    def next_event(self) -> MoqtEvent | None:
        """The next event, or None when there is none."""
        return self._events.popleft() if self._events else None

    def transmit(self) -> list[Transmit]:
        """Everything to hand to QUIC, in order; empties the queue."""
        out, self._transmits = self._transmits, []
        return out

    # -- QUIC in ---------------------------------------------------------------------------------

    def initiate(self) -> None:
        """Open our control stream and queue SETUP (call once, when QUIC is connected)."""
        self._check_open()
        if self._initiated:
            raise UsageError("initiate() was already called")
        cfg = self.config
        setup = Setup(
            path=cfg.path,
            authority=cfg.authority,
            max_auth_token_cache_size=cfg.max_auth_token_cache_size,
            authorization_tokens=cfg.authorization_tokens,
            implementation=cfg.implementation,
        )
        data = encode_message(setup)
        self._control_stream_id = self._allocate_stream(unidirectional=True)
        self._initiated = True
        self._send(self._control_stream_id, data)
        try:
            # The peer's SETUP and requests may already be buffered; handling them is peer input.
            self._after_setup_progress()
        except ProtocolError as exc:
            self._close_on_error(exc)

    def receive_stream_data(
        self, stream_id: int, data: bytes, end_stream: bool, now: float | None = None
    ) -> None:
        """Bytes QUIC delivered on ``stream_id``, in order; ``end_stream`` is the FIN. ``now`` (the
        clock ``handle_timer`` is given) is needed when ``request_header_timeout`` is set."""
        if self.closed is not None:
            return
        try:
            if is_uni_stream(stream_id):
                self._receive_uni(stream_id, data, end_stream)
            else:
                self._receive_bidi(stream_id, data, end_stream, now)
        except ProtocolError as exc:
            self._close_on_error(exc)

    def receive_stream_reset(self, stream_id: int, error_code: int) -> None:
        """The peer reset its sending side of ``stream_id`` (RESET_STREAM)."""
        if self.closed is not None:
            return
        try:
            self._on_stream_reset(stream_id, error_code)
        except ProtocolError as exc:
            self._close_on_error(exc)

    def receive_stop_sending(self, stream_id: int, error_code: int) -> None:
        """The peer asked us to stop sending on ``stream_id`` (STOP_SENDING); QUIC resets it."""
        if self.closed is not None:
            return
        try:
            self._on_stop_sending(stream_id, error_code)
        except ProtocolError as exc:
            self._close_on_error(exc)

    def receive_datagram(self, data: bytes) -> None:
        """One QUIC DATAGRAM from the peer."""
        if self.closed is not None:
            return
        try:
            self._on_datagram(data)
        except ProtocolError as exc:
            self._close_on_error(exc)

    def connection_lost(self, error_code: int = SessionErrorCode.NO_ERROR, reason: str = "") -> None:
        """The QUIC connection is gone (peer CONNECTION_CLOSE, idle timeout, ...)."""
        if self.closed is not None:
            return
        self.closed = (error_code, reason)
        self._events.append(SessionTerminated(error_code, reason, by_peer=True))
        self._forget_everything()

    # -- time ------------------------------------------------------------------------------------

    def get_timer(self) -> float | None:
        """When ``handle_timer`` must next be called (the clock of ``now``), or None for never."""
        if self.closed is not None or not self._header_deadlines:
            return None
        return next(iter(self._header_deadlines.values()))

    def handle_timer(self, now: float) -> None:
        """Run what is due at ``now``: request streams whose first control message is late are reset
        and stopped with DELIVERY_TIMEOUT; one more than ``max_request_header_timeouts`` closes the
        session with CONTROL_MESSAGE_TIMEOUT."""
        deadlines = self._header_deadlines
        while self.closed is None and deadlines:
            stream_id, deadline = next(iter(deadlines.items()))
            if deadline > now:
                return
            del deadlines[stream_id]
            req = self._bidi.get(stream_id)
            if req is None or req.state.kind is not None or req.framer.has_message():
                continue  # the stream ended or its first message is complete
            self.request_header_timeouts += 1
            if self.request_header_timeouts > self.config.max_request_header_timeouts:
                self._log.warning("closing session: %d request streams without a timely message",
                                  self.request_header_timeouts)
                self.close(
                    SessionErrorCode.CONTROL_MESSAGE_TIMEOUT,
                    "request streams without a complete control message in time",
                )
                return
            self._log.info("request stream %d: no complete control message in time; resetting", stream_id)
            self._refuse_stream(req, StreamResetCode.DELIVERY_TIMEOUT)

    # -- session actions ---------------------------------------------------------------------------

    def close(self, code: SessionErrorCode = SessionErrorCode.NO_ERROR, reason: str = "") -> None:
        """Close the session (CONNECTION_CLOSE with ``code``); a no-op once closed."""
        if self.closed is not None:
            return
        self._log.debug("closing session: %s %s", getattr(code, "name", code), reason)
        self.closed = (code, reason)
        self._transmits.append(CloseConnection(int(code), reason))
        self._events.append(SessionTerminated(int(code), reason, by_peer=False))
        self._forget_everything()

    def goaway(self, new_session_uri: bytes = b"", timeout: int = 0, request_id: int | None = None) -> None:
        """Send GOAWAY (section "GOAWAY"): on the control stream, or on one request's stream.

        After a control-stream GOAWAY, peer requests that were not processed yet (and any new
        one) are refused with REQUEST_ERROR GOING_AWAY, as the draft requires.
        """
        self._check_initiated()
        if new_session_uri and self.is_client:
            raise UsageError("a client sends GOAWAY with an empty New Session URI")
        if request_id is not None:
            req = self._request(request_id)
            if req.send_closed:
                raise UsageError(f"request {request_id} stream is closed")
            self._send(req.stream_id, encode_message(Goaway(new_session_uri, timeout)))
            return
        if self._goaway_sent:
            raise UsageError("GOAWAY was already sent on the control stream")
        floor = self._peer_ids.floor
        assert self._control_stream_id is not None
        self._send(self._control_stream_id, encode_message(Goaway(new_session_uri, timeout, floor)))
        self._goaway_sent = True
        self._goaway_floor = floor

    # -- requests we send --------------------------------------------------------------------------

    def subscribe(
        self,
        track_namespace: TrackNamespace,
        track_name: bytes,
        parameters: MessageParameters = NO_PARAMETERS,
    ) -> int:
        """Send SUBSCRIBE on a new request stream; returns its Request ID."""

        def build(rid: int) -> Subscribe:
            return Subscribe(rid, track_namespace, track_name, parameters)

        req = self._open_request(build)
        req.full_track_name = (track_namespace, track_name)
        return req.request_id

    def fetch(
        self,
        track_namespace: TrackNamespace,
        track_name: bytes,
        start: Location,
        end: Location,
        parameters: MessageParameters = NO_PARAMETERS,
    ) -> int:
        """Send a standalone FETCH for [start, end) (``end`` is the last Object plus 1, or {G, 0})."""
        if range_end_before(end, start):
            raise UsageError("FETCH End Location is before its Start Location")
        standalone = StandaloneFetch(track_namespace, track_name, start, end)

        def build(rid: int) -> Fetch:
            return Fetch(rid, FetchType.STANDALONE, standalone, None, parameters)

        req = self._open_request(build)
        req.full_track_name = (track_namespace, track_name)
        return req.request_id

    def joining_fetch(
        self,
        joining_request_id: int,
        joining_start: int,
        relative: bool = True,
        parameters: MessageParameters = NO_PARAMETERS,
    ) -> int:
        """Send a relative (or absolute) Joining FETCH for our subscription ``joining_request_id``."""
        sub = self._requests.get(joining_request_id)
        if sub is None or not sub.local or sub.state.kind != K_SUB:
            raise UsageError(f"{joining_request_id} is not one of our subscriptions")
        fetch_type = FetchType.RELATIVE_JOINING if relative else FetchType.ABSOLUTE_JOINING
        joining = JoiningFetch(joining_request_id, joining_start)

        def build(rid: int) -> Fetch:
            return Fetch(rid, fetch_type, None, joining, parameters)

        req = self._open_request(build)
        req.full_track_name = sub.full_track_name
        return req.request_id

    def track_status(
        self,
        track_namespace: TrackNamespace,
        track_name: bytes,
        parameters: MessageParameters = NO_PARAMETERS,
    ) -> int:
        """Send TRACK_STATUS; answered by TrackStatusOkReceived or RequestErrorReceived."""

        def build(rid: int) -> TrackStatus:
            return TrackStatus(rid, track_namespace, track_name, parameters)

        req = self._open_request(build)
        req.full_track_name = (track_namespace, track_name)
        return req.request_id

    def publish_namespace(
        self, track_namespace: TrackNamespace, parameters: MessageParameters = NO_PARAMETERS
    ) -> int:
        """Send PUBLISH_NAMESPACE; withdraw it later with cancel_request."""
        return self._open_request(lambda rid: PublishNamespace(rid, track_namespace, parameters)).request_id

    def subscribe_namespace(
        self, track_namespace_prefix: TrackNamespace, parameters: MessageParameters = NO_PARAMETERS
    ) -> int:
        """Send SUBSCRIBE_NAMESPACE; NAMESPACE / NAMESPACE_DONE follow on its stream."""

        def build(rid: int) -> SubscribeNamespace:
            return SubscribeNamespace(rid, track_namespace_prefix, parameters)

        return self._open_request(build).request_id

    def subscribe_tracks(
        self, track_namespace_prefix: TrackNamespace, parameters: MessageParameters = NO_PARAMETERS
    ) -> int:
        """Send SUBSCRIBE_TRACKS; the peer answers with PUBLISH requests of its own."""

        def build(rid: int) -> SubscribeTracks:
            return SubscribeTracks(rid, track_namespace_prefix, parameters)

        return self._open_request(build).request_id

    def publish(
        self,
        track_namespace: TrackNamespace,
        track_name: bytes,
        track_alias: int,
        parameters: MessageParameters = NO_PARAMETERS,
        track_properties: Properties = (),
    ) -> int:
        """Send PUBLISH for a track we publish under ``track_alias``; objects may follow at once."""
        self._check_alias_free(track_alias)

        def build(rid: int) -> Publish:
            return Publish(rid, track_namespace, track_name, track_alias, parameters, track_properties)

        req = self._open_request(build)
        req.full_track_name = (track_namespace, track_name)
        req.track_alias = track_alias
        self._pub_aliases[track_alias] = req.request_id
        return req.request_id

    def request_update(self, request_id: int, parameters: MessageParameters = NO_PARAMETERS) -> int:
        """Send REQUEST_UPDATE for an existing request; returns the update's own Request ID."""
        req = self._request(request_id)
        update_id = self._next_request_id
        self._send_on_request(req, RequestUpdate(update_id, parameters))
        self._next_request_id += 2
        req.state.pending_updates[req.our_side].append(update_id)
        return update_id

    # -- replies -----------------------------------------------------------------------------------

    def accept_subscribe(
        self,
        request_id: int,
        track_alias: int,
        parameters: MessageParameters = NO_PARAMETERS,
        track_properties: Properties = (),
    ) -> None:
        """Answer a SUBSCRIBE with SUBSCRIBE_OK; objects then go out under ``track_alias``."""
        req = self._peer_request(request_id, K_SUB)
        self._check_alias_free(track_alias)
        self._send_on_request(req, SubscribeOk(track_alias, parameters, track_properties))
        req.track_alias = track_alias
        self._pub_aliases[track_alias] = request_id

    def accept_fetch(
        self,
        request_id: int,
        end_of_track: bool,
        end_location: Location,
        parameters: MessageParameters = NO_PARAMETERS,
        track_properties: Properties = (),
    ) -> None:
        """Answer a FETCH with FETCH_OK; send the objects with send_fetch_object, then finish_fetch."""
        req = self._peer_request(request_id, K_FETCH)
        self._send_on_request(req, FetchOk(end_of_track, end_location, parameters, track_properties))
        if req.fetch_data_done:
            self._fin_our_side(req)  # the response is complete: nothing more goes on the request stream

    def respond_track_status(
        self,
        request_id: int,
        parameters: MessageParameters = NO_PARAMETERS,
        track_properties: Properties = (),
    ) -> None:
        """Answer a TRACK_STATUS with REQUEST_OK (TRACK_STATUS_OK) and close its stream."""
        req = self._peer_request(request_id, K_TS)
        self._send_on_request(req, RequestOk(parameters, track_properties))

    def accept_request(self, request_id: int, parameters: MessageParameters = NO_PARAMETERS) -> None:
        """REQUEST_OK for a PUBLISH (PUBLISH_OK), PUBLISH_NAMESPACE, SUBSCRIBE_NAMESPACE,
        SUBSCRIBE_TRACKS, or for a REQUEST_UPDATE (pass the update's Request ID)."""
        update_of = self._updates.get(request_id)
        if update_of is not None:
            self._answer_update(update_of, request_id, RequestOk(parameters))
            return
        req = self._request(request_id)
        if req.local:
            raise UsageError(f"request {request_id} is ours; the peer answers it")
        if req.state.kind in (K_SUB, K_FETCH, K_TS):
            raise UsageError(f"{req.name} is answered with its own reply method, not accept_request")
        self._send_on_request(req, RequestOk(parameters))

    def reject_request(
        self,
        request_id: int,
        code: RequestErrorCode,
        reason: str = "",
        retry_interval: int = 0,
        redirect: Redirect | None = None,
    ) -> None:
        """Answer a peer request (or REQUEST_UPDATE) with REQUEST_ERROR; the request stream is closed."""
        msg = RequestError(int(code), retry_interval, reason, redirect)
        update_of = self._updates.get(request_id)
        if update_of is not None:
            self._answer_update(update_of, request_id, msg)
            return
        req = self._request(request_id)
        if req.local:
            raise UsageError(f"request {request_id} is ours; cancel it with cancel_request")
        self._send_on_request(req, msg)
        # "Objects MUST NOT be sent for requests that end with an error": a fetch stream already
        # opened is reset rather than left for the application to close.
        self._stop_data_of(req, StreamResetCode.CANCELLED)
        self._end_request(req)

    def publish_done(self, request_id: int, status_code: PublishDoneCode, reason: str = "") -> None:
        """End a subscription we publish (SUBSCRIBE we accepted, or our PUBLISH) with PUBLISH_DONE.

        The draft forbids PUBLISH_DONE while data streams of the subscription are open.
        """
        req = self._request(request_id)
        if not self._publishes(req):
            raise UsageError(f"request {request_id} is not a subscription we publish")
        if req.data_streams:
            raise UsageError("close or reset the subscription's data streams before PUBLISH_DONE")
        self._send_on_request(req, PublishDone(int(status_code), req.streams_opened, reason))
        self._release_pub_alias(req)
        self._end_request(req)

    def namespace(self, request_id: int, track_namespace_suffix: TrackNamespace) -> None:
        """Send NAMESPACE on an accepted SUBSCRIBE_NAMESPACE."""
        req = self._peer_request(request_id, K_SNS)
        self._send_on_request(req, Namespace(track_namespace_suffix))
        req.namespaces.add(track_namespace_suffix)

    def namespace_done(self, request_id: int, track_namespace_suffix: TrackNamespace) -> None:
        """Send NAMESPACE_DONE for a suffix previously sent with NAMESPACE."""
        req = self._peer_request(request_id, K_SNS)
        if track_namespace_suffix not in req.namespaces:
            raise UsageError("NAMESPACE_DONE for a namespace that was not announced with NAMESPACE")
        self._send_on_request(req, NamespaceDone(track_namespace_suffix))
        req.namespaces.discard(track_namespace_suffix)

    def publish_blocked(
        self, request_id: int, track_namespace_suffix: TrackNamespace, track_name: bytes
    ) -> None:
        """Send PUBLISH_BLOCKED on an accepted SUBSCRIBE_TRACKS."""
        req = self._peer_request(request_id, K_STR)
        self._send_on_request(req, PublishBlocked(track_namespace_suffix, track_name))

    def cancel_request(self, request_id: int, code: StreamResetCode = StreamResetCode.CANCELLED) -> None:
        """Abandon a request either side started (section "Request Cancellation and Rejection").

        Resets our side of the request stream, sends STOP_SENDING for the peer's, and resets or
        stops the data streams tied to it (a publisher "MUST reset any open streams").
        """
        req = self._request(request_id)
        self._abort_request(req, int(code))

