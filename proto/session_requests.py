"""Request streams: opening ours, accepting the peer's, and ending both.

Owns: the life of each bidirectional request stream (``RequestStream`` with its
``proto.request_state.RequestStateMachine``): Request ID and GOAWAY rules on the peer's requests,
``max_requests_in_flight``, reading messages off a request stream and handing each to its handler,
FIN/reset/cancel handling, and Track Alias bookkeeping on the publisher side. The handlers themselves
live in ``proto.session_control``."""

from __future__ import annotations

from collections.abc import Callable

from .errors import (
    ProtocolViolation,
    RequestErrorCode,
    StreamResetCode,
    UsageError,
)
from .events import (
    GoawayReceived,
    RequestCancelled,
    RequestRefused,
)
from .messages import (
    ControlMessage,
    Fetch,
    Goaway,
    RequestError,
    RequestOk,
    encode_message,
)
from .request_state import (
    KIND_NAMES,
    REQUEST_CLASSES,
    RequestTransitionError,
)
from .session_config import (
    ResetStream,
    StopSending,
)
from .session_state import (
    DONE,
    IDLE,
    K_FETCH,
    K_PUB,
    K_SUB,
    REQ,
    RESP,
    DataStreamKind,
    MessageContext,
    RequestStream,
    SessionState,
    control_reader,
    is_local_stream,
)


class RequestStreams(SessionState):
    """Part of ``MoqtSession``: the request streams."""

    # =============================================================================================
    # internals: request streams

    def _open_request(self, build: Callable[[int], ControlMessage]) -> RequestStream:
        self._check_initiated()
        if self._goaway_received:
            raise UsageError("the peer sent GOAWAY: no new requests on this session")
        request_id = self._next_request_id
        msg = build(request_id)
        data = encode_message(msg)  # UsageError for unencodable values, before any state changes
        stream_id = self._allocate_stream(unidirectional=False)
        req = RequestStream(stream_id, local=True, framer=control_reader(self.config))
        req.state.open(msg.TYPE)
        req.request_id = request_id
        if isinstance(msg, Fetch):
            req.fetch = msg
        self._next_request_id += 2
        self._requests[request_id] = req
        self._bidi[stream_id] = req
        req.send_closed = not req.state.can_send_more(REQ)
        self._send(stream_id, data, end_stream=req.send_closed)
        return req

    def _request(self, request_id: int) -> RequestStream:
        self._check_open()
        req = self._requests.get(request_id)
        if req is None or req.ended:
            raise UsageError(f"no live request with Request ID {request_id}")
        return req

    def _peer_request(self, request_id: int, kind: int) -> RequestStream:
        req = self._request(request_id)
        if req.local or req.state.kind != kind:
            raise UsageError(f"request {request_id} is not a {KIND_NAMES[kind]} from the peer")
        return req

    def _send_on_request(self, req: RequestStream, msg: ControlMessage) -> tuple[int, ...]:
        """Send ``msg`` on the request's stream as our side, following the transition table (a
        ``RequestTransitionError``, which is a ``UsageError``, if it does not allow it). Returns the
        Request IDs of the peer's REQUEST_UPDATEs it answered."""
        transition = req.state.check(req.our_side, msg.TYPE)
        if req.send_closed:
            raise UsageError(f"the {req.name} stream is closed")
        data = encode_message(msg)
        answered = req.state.apply(transition)
        self._send(req.stream_id, data, end_stream=transition.fin)
        if transition.fin:
            req.send_closed = True
            self._maybe_forget(req)
        return answered

    def _answer_update(self, req: RequestStream, update_id: int, msg: RequestOk | RequestError) -> None:
        pending = req.state.pending_updates[req.peer_side]
        if not pending or pending[0] != update_id:
            raise UsageError("answer REQUEST_UPDATEs in the order they arrived")
        for rid in self._send_on_request(req, msg):
            self._updates.pop(rid, None)

    def _receive_bidi(self, stream_id: int, data: bytes, end_stream: bool, now: float | None) -> None:
        req = self._bidi.get(stream_id)
        if req is None:
            if is_local_stream(stream_id, self.is_client) or stream_id in self._seen_bidi:
                return  # a request stream we already finished with; late bytes are harmless
            timeout = self.config.request_header_timeout
            if timeout is not None:
                if now is None:
                    raise UsageError("request_header_timeout is set: receive_stream_data needs now")
                self._header_deadlines[stream_id] = now + timeout
            self._seen_bidi.add(stream_id)
            req = RequestStream(stream_id, local=False, framer=control_reader(self.config))
            self._bidi[stream_id] = req
        if req.fin_received:
            return
        req.framer.feed(data)
        req.fin_received = end_stream
        self._pump_request(req)
        if stream_id in self._header_deadlines and (
            req.state.kind is not None or req.framer.has_message() or self._bidi.get(stream_id) is not req
        ):
            del self._header_deadlines[stream_id]

    def _pump_request(self, req: RequestStream) -> None:
        """Process what is buffered on a request stream, unless SETUP has not completed yet."""
        if not self.established:
            if req.framer.buffered > self.config.max_buffered_bytes_per_stream:
                self._refuse_stream(req, StreamResetCode.EXCESSIVE_LOAD)
            return
        while self.closed is None and self._bidi.get(req.stream_id) is req and not req.recv_closed:
            msg = req.framer.next_message()
            if msg is None:
                if req.fin_received:
                    self._on_request_fin(req)
                return
            self._on_request_message(req, msg)

    def _refuse_stream(self, req: RequestStream, code: int) -> None:
        """Drop a request stream we will not process: reset and stop whatever is still open."""
        if not req.send_closed:
            self._transmits.append(ResetStream(req.stream_id, int(code)))
        if not (req.fin_received or req.recv_closed):
            self._transmits.append(StopSending(req.stream_id, int(code)))
        req.send_closed = req.recv_closed = True
        self._bidi.pop(req.stream_id, None)

    def _on_request_message(self, req: RequestStream, msg: ControlMessage) -> None:
        if req.state.kind is None:
            self._open_peer_request(req, msg)
            return
        if isinstance(msg, Goaway):
            self._on_request_goaway(req, msg)
            return
        try:
            transition = req.state.check(req.peer_side, msg.TYPE)
        except RequestTransitionError as exc:
            raise ProtocolViolation(str(exc)) from None  # the same table, broken by the peer
        answered = req.state.apply(transition)
        answers = answered[0] if answered else None
        self._handlers[msg.TYPE](MessageContext(req, transition.first_reply, answers), msg)
        if transition.new_state is DONE and not req.send_closed and self.closed is None:
            # The peer's side is finished (REQUEST_ERROR, PUBLISH_DONE, TRACK_STATUS reply): FIN ours.
            self._send(req.stream_id, b"", end_stream=True)
            req.send_closed = True
        self._maybe_forget(req)

    def _open_peer_request(self, req: RequestStream, msg: ControlMessage) -> None:
        if not isinstance(msg, REQUEST_CLASSES):
            raise ProtocolViolation(f"request stream begins with {type(msg).__name__}, not a request")
        self._peer_ids.check(msg.request_id)
        req.state.open(msg.TYPE)
        req.request_id = msg.request_id
        if isinstance(msg, Fetch):
            req.fetch = msg
        self._requests[msg.request_id] = req
        if self._goaway_floor is not None:
            # Section "GOAWAY": requests at or above the advertised ID, and any arriving after the
            # GOAWAY, "MUST be rejected with REQUEST_ERROR using error code GOING_AWAY".
            self._auto_reject(req, RequestErrorCode.GOING_AWAY, "going away", 0)
            return
        if self._peer_requests_open >= self.config.max_requests_in_flight:
            retry = self.config.excessive_load_retry_interval
            self._auto_reject(req, RequestErrorCode.EXCESSIVE_LOAD, "too many requests", retry)
            return
        req.counted = True
        self._peer_requests_open += 1
        self._handlers[msg.TYPE](MessageContext(req), msg)
        self._maybe_forget(req)

    def _auto_reject(self, req: RequestStream, code: RequestErrorCode, reason: str, retry: int) -> None:
        self._send_on_request(req, RequestError(int(code), retry, reason))
        self._end_request(req)
        self._events.append(RequestRefused(req.request_id, int(code), reason))

    def _on_request_goaway(self, req: RequestStream, msg: Goaway) -> None:
        if req.peer_goaway:
            raise ProtocolViolation("second GOAWAY on one request stream")
        if msg.request_id is not None:
            raise ProtocolViolation("GOAWAY on a request stream carries a Request ID")
        if msg.new_session_uri and not self.is_client:
            raise ProtocolViolation("GOAWAY from a client with a New Session URI")
        req.peer_goaway = True
        if not req.ended:
            self._events.append(GoawayReceived(msg.new_session_uri, msg.timeout, None, req.request_id))

    def _on_request_fin(self, req: RequestStream) -> None:
        """The peer FIN'd its side and every message before the FIN has been handled."""
        if req.framer.buffered:
            raise ProtocolViolation(f"{req.name} stream ended inside a control message")
        req.recv_closed = True
        if req.state.kind is None:
            self._refuse_stream(req, StreamResetCode.CANCELLED)  # FIN before any message
            return
        side = req.peer_side
        if req.state.states[side] is not DONE and not req.ended:
            if side is RESP and req.state.states[side] is IDLE:
                raise ProtocolViolation(f"{req.name} stream closed without a reply")
            if req.state.fin_ends_request(side):
                self._events.append(RequestCancelled(req.request_id, None))
                self._stop_data_of(req, StreamResetCode.CANCELLED)
                if not req.send_closed:
                    self._send(req.stream_id, b"", end_stream=True)
                    req.send_closed = True
                self._end_request(req)
        self._maybe_forget(req)

    def _maybe_forget(self, req: RequestStream) -> None:
        """Drop the bookkeeping of a request once nothing can refer to it any more."""
        closed = req.send_closed and req.recv_closed
        if closed:
            self._bidi.pop(req.stream_id, None)
        if not (closed or req.ended) or req.data_streams:
            return  # a publisher keeps the request while its data streams are open
        if req.local and req.state.kind == K_FETCH and not req.ended and not req.fetch_data_done:
            return  # the FETCH response stream may still come
        self._end_request(req)
        if self._requests.get(req.request_id) is req:
            del self._requests[req.request_id]

    def _end_request(self, req: RequestStream) -> None:
        """The request is over for the application: no events for it, no actions on it."""
        if req.ended:
            return
        req.ended = True
        if req.counted:
            req.counted = False
            self._peer_requests_open -= 1
        for rid in req.state.pending_updates[req.peer_side]:
            self._updates.pop(rid, None)
        req.state.pending_updates[req.peer_side].clear()
        if req.track_alias is not None:
            track = self._sub_tracks.get(req.track_alias)
            if track is not None and track.request_id == req.request_id:
                self._retire_sub_track(req.track_alias, track)
        self._maybe_forget(req)

    def _abort_request(self, req: RequestStream, code: int) -> None:
        """Cancel a request locally: reset and stop its stream and its data streams."""
        self._stop_data_of(req, code)
        self._refuse_stream(req, code)
        self._end_request(req)

    def _peer_cancelled(self, req: RequestStream, error_code: int) -> None:
        """The peer reset or stopped a request stream: the request is cancelled."""
        if req.state.kind is not None and not req.ended:
            self._events.append(RequestCancelled(req.request_id, error_code))
        self._stop_data_of(req, StreamResetCode.CANCELLED)
        self._refuse_stream(req, StreamResetCode.CANCELLED)
        self._end_request(req)

    def _stop_data_of(self, req: RequestStream, code: int) -> None:
        """Reset our data streams of a request and stop the peer's ones delivering to it."""
        # Publisher: "MUST reset any open streams associated with the SUBSCRIBE" / the fetch stream.
        for stream_id in sorted(req.data_streams):
            sub = self._outgoing.pop(stream_id, None)
            if (sub is not None and not sub.stopped) or stream_id == req.fetch_data_stream:
                self._transmits.append(ResetStream(stream_id, code))
        req.data_streams.clear()
        if not req.local and req.fetch_data_stream is not None:
            req.fetch_data_done = True
        self._release_pub_alias(req)
        # Subscriber: stop the streams that deliver to it and drop its late objects.
        if req.state.kind in (K_SUB, K_FETCH, K_PUB) and req.request_id >= 0:
            for stream in list(self._incoming.values()):
                if stream.request_id == req.request_id and stream.kind in (
                    DataStreamKind.SUBGROUP,
                    DataStreamKind.FETCH,
                ):
                    self._abandon_incoming(stream, code, report=False)
            if req.track_alias is not None:
                track = self._sub_tracks.get(req.track_alias)
                if track is not None and track.request_id == req.request_id:
                    track.active = False
                    self._retire_sub_track(req.track_alias, track)
        if req.local and req.state.kind == K_FETCH:
            req.fetch_data_done = True

    def _release_pub_alias(self, req: RequestStream) -> None:
        alias = req.track_alias
        if alias is not None and self._pub_aliases.get(alias) == req.request_id and self._publishes(req):
            del self._pub_aliases[alias]

    @staticmethod
    def _publishes(req: RequestStream) -> bool:
        """We are the publisher of this subscription (we accepted its SUBSCRIBE, or sent its PUBLISH)."""
        return (req.state.kind == K_SUB and not req.local) or (req.state.kind == K_PUB and req.local)

    def _check_alias_free(self, track_alias: int) -> None:
        if not 0 <= track_alias < 1 << 64:
            raise UsageError("Track Alias must be a 64-bit unsigned integer")
        if track_alias in self._pub_aliases:
            raise UsageError(
                f"Track Alias {track_alias} is in use by request {self._pub_aliases[track_alias]}"
            )

