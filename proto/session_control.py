"""Control messages received: one ``_handle_<message>`` per control message type.

Owns: what each message does to the session or to its request (SETUP, GOAWAY, SUBSCRIBE ... REQUEST_ERROR),
dispatched through ``MoqtSession``'s one table keyed by message type, the setup handshake's completion and
the peer's control stream. Which side may send what and when is ``proto.request_state``'s table."""

from __future__ import annotations

from .errors import (
    InvalidAuthority,
    InvalidPath,
    InvalidRequestId,
    LimitExceeded,
    ProtocolViolation,
)
from .events import (
    FetchOkReceived,
    FetchReceived,
    GoawayReceived,
    MoqtEvent,
    NamespaceDoneReceived,
    NamespaceReceived,
    PublishBlockedReceived,
    PublishDoneReceived,
    PublishNamespaceReceived,
    PublishOkReceived,
    PublishReceived,
    RequestErrorReceived,
    RequestOkReceived,
    RequestUpdateReceived,
    SetupCompleted,
    SubscribeNamespaceReceived,
    SubscribeOkReceived,
    SubscribeReceived,
    SubscribeTracksReceived,
    TrackStatusOkReceived,
    TrackStatusReceived,
)
from .messages import (
    ControlMessage,
    Fetch,
    FetchOk,
    Goaway,
    Namespace,
    NamespaceDone,
    Publish,
    PublishBlocked,
    PublishDone,
    PublishNamespace,
    PublishOk,
    RequestError,
    RequestOk,
    RequestUpdate,
    Setup,
    Subscribe,
    SubscribeNamespace,
    SubscribeOk,
    SubscribeTracks,
    TrackStatus,
)
from .session_state import (
    K_FETCH,
    K_PNS,
    K_PUB,
    K_SNS,
    K_TS,
    DataStreamKind,
    MessageContext,
    SessionState,
    range_end_before,
)


class ControlMessages(SessionState):
    """Part of ``MoqtSession``: the control-message handlers."""

    # =============================================================================================
    # internals: message handlers (one per control message type)

    def _handle_setup(self, ctx: MessageContext, msg: ControlMessage) -> None:
        assert isinstance(msg, Setup)
        if ctx.request is not None or self._peer_setup is not None:
            raise ProtocolViolation("SETUP is only the first message of the control stream")
        if self.is_client:
            # PATH and AUTHORITY "MUST NOT be used by the server" (section "Setup Options").
            if msg.path is not None:
                raise InvalidPath("PATH option from the server")
            if msg.authority is not None:
                raise InvalidAuthority("AUTHORITY option from the server")
        self._peer_setup = msg
        self._after_setup_progress()

    def _handle_goaway(self, ctx: MessageContext, msg: ControlMessage) -> None:
        assert isinstance(msg, Goaway)
        if self._goaway_received:
            raise ProtocolViolation("second GOAWAY on the control stream")
        if msg.new_session_uri and not self.is_client:
            raise ProtocolViolation("GOAWAY from a client with a New Session URI")
        if msg.request_id is None:
            raise ProtocolViolation("GOAWAY on the control stream without a Request ID")
        if msg.request_id & 1 != (0 if self.is_client else 1):
            raise InvalidRequestId(f"GOAWAY Request ID {msg.request_id} has the wrong parity")
        self._goaway_received = True
        self._events.append(GoawayReceived(msg.new_session_uri, msg.timeout, msg.request_id))

    def _handle_subscribe(self, ctx: MessageContext, msg: ControlMessage) -> None:
        assert isinstance(msg, Subscribe) and ctx.request is not None
        ctx.request.full_track_name = (msg.track_namespace, msg.track_name)
        self._events.append(
            SubscribeReceived(msg.request_id, msg.track_namespace, msg.track_name, msg.parameters)
        )

    def _handle_subscribe_ok(self, ctx: MessageContext, msg: ControlMessage) -> None:
        assert isinstance(msg, SubscribeOk) and ctx.request is not None
        req = ctx.request
        self._bind_sub_alias(req, msg.track_alias)
        if not req.ended:
            self._events.append(
                SubscribeOkReceived(req.request_id, msg.track_alias, msg.parameters, msg.track_properties)
            )
        self._release_pending_alias(msg.track_alias)

    def _handle_publish(self, ctx: MessageContext, msg: ControlMessage) -> None:
        assert isinstance(msg, Publish) and ctx.request is not None
        req = ctx.request
        req.full_track_name = (msg.track_namespace, msg.track_name)
        self._bind_sub_alias(req, msg.track_alias)
        self._events.append(
            PublishReceived(
                msg.request_id, msg.track_namespace, msg.track_name, msg.track_alias, msg.parameters,
                msg.track_properties,
            )
        )  # fmt: skip
        self._release_pending_alias(msg.track_alias)

    def _handle_publish_ok(self, ctx: MessageContext, msg: ControlMessage) -> None:
        assert isinstance(msg, PublishOk) and ctx.request is not None
        if not ctx.request.ended:
            self._events.append(PublishOkReceived(ctx.request.request_id, msg.parameters))

    def _handle_publish_done(self, ctx: MessageContext, msg: ControlMessage) -> None:
        assert isinstance(msg, PublishDone) and ctx.request is not None
        req = ctx.request
        if not req.ended:
            self._events.append(
                PublishDoneReceived(req.request_id, msg.status_code, msg.stream_count, msg.reason)
            )
        # Late objects may still arrive; the alias stays known (inactive only when we cancel).
        self._end_request(req)

    def _handle_fetch(self, ctx: MessageContext, msg: ControlMessage) -> None:
        assert isinstance(msg, Fetch) and ctx.request is not None
        s, j = msg.standalone, msg.joining
        self._events.append(
            FetchReceived(
                msg.request_id,
                msg.fetch_type,
                s.track_namespace if s else None,
                s.track_name if s else None,
                s.start if s else None,
                s.end if s else None,
                j.joining_request_id if j else None,
                j.joining_start if j else None,
                msg.parameters,
            )
        )

    def _handle_fetch_ok(self, ctx: MessageContext, msg: ControlMessage) -> None:
        assert isinstance(msg, FetchOk) and ctx.request is not None
        req = ctx.request
        standalone = req.fetch.standalone if req.fetch is not None else None
        if standalone is not None and range_end_before(msg.end_location, standalone.start):
            raise ProtocolViolation("FETCH_OK End Location is smaller than the FETCH Start Location")
        if not req.ended:
            self._events.append(
                FetchOkReceived(
                    req.request_id, msg.end_of_track, msg.end_location, msg.parameters, msg.track_properties
                )
            )

    def _handle_track_status(self, ctx: MessageContext, msg: ControlMessage) -> None:
        assert isinstance(msg, TrackStatus) and ctx.request is not None
        self._events.append(
            TrackStatusReceived(msg.request_id, msg.track_namespace, msg.track_name, msg.parameters)
        )

    def _handle_publish_namespace(self, ctx: MessageContext, msg: ControlMessage) -> None:
        assert isinstance(msg, PublishNamespace)
        self._events.append(PublishNamespaceReceived(msg.request_id, msg.track_namespace, msg.parameters))

    def _handle_subscribe_namespace(self, ctx: MessageContext, msg: ControlMessage) -> None:
        assert isinstance(msg, SubscribeNamespace)
        self._events.append(
            SubscribeNamespaceReceived(msg.request_id, msg.track_namespace_prefix, msg.parameters)
        )

    def _handle_subscribe_tracks(self, ctx: MessageContext, msg: ControlMessage) -> None:
        assert isinstance(msg, SubscribeTracks)
        self._events.append(
            SubscribeTracksReceived(msg.request_id, msg.track_namespace_prefix, msg.parameters)
        )

    def _handle_namespace(self, ctx: MessageContext, msg: ControlMessage) -> None:
        assert isinstance(msg, Namespace) and ctx.request is not None
        req = ctx.request
        req.namespaces.add(msg.track_namespace_suffix)
        if not req.ended:
            self._events.append(NamespaceReceived(req.request_id, msg.track_namespace_suffix))

    def _handle_namespace_done(self, ctx: MessageContext, msg: ControlMessage) -> None:
        assert isinstance(msg, NamespaceDone) and ctx.request is not None
        req = ctx.request
        if msg.track_namespace_suffix not in req.namespaces:
            raise ProtocolViolation("NAMESPACE_DONE before the corresponding NAMESPACE")
        req.namespaces.discard(msg.track_namespace_suffix)
        if not req.ended:
            self._events.append(NamespaceDoneReceived(req.request_id, msg.track_namespace_suffix))

    def _handle_publish_blocked(self, ctx: MessageContext, msg: ControlMessage) -> None:
        assert isinstance(msg, PublishBlocked) and ctx.request is not None
        if not ctx.request.ended:
            self._events.append(
                PublishBlockedReceived(ctx.request.request_id, msg.track_namespace_suffix, msg.track_name)
            )

    def _handle_request_update(self, ctx: MessageContext, msg: ControlMessage) -> None:
        assert isinstance(msg, RequestUpdate) and ctx.request is not None
        req = ctx.request
        self._peer_ids.check(msg.request_id)
        if req.ended or req.send_closed:
            return  # we already ended the request (rejected or cancelled): nothing can answer it
        req.state.pending_updates[req.peer_side].append(msg.request_id)
        self._updates[msg.request_id] = req
        self._events.append(RequestUpdateReceived(msg.request_id, req.request_id, msg.parameters))

    def _handle_request_ok(self, ctx: MessageContext, msg: ControlMessage) -> None:
        assert isinstance(msg, RequestOk) and ctx.request is not None
        req = ctx.request
        if msg.track_properties and not (ctx.initial_reply and req.state.kind == K_TS):
            # Section "REQUEST_OK": Track Properties only in TRACK_STATUS_OK.
            raise ProtocolViolation("REQUEST_OK with Track Properties outside TRACK_STATUS_OK")
        if req.ended:
            return
        event: MoqtEvent
        if ctx.answers is not None:
            event = RequestOkReceived(ctx.answers, msg.parameters)
        elif req.state.kind == K_TS:
            event = TrackStatusOkReceived(req.request_id, msg.parameters, msg.track_properties)
        elif req.state.kind == K_PUB:
            event = PublishOkReceived(req.request_id, msg.parameters)
        else:
            event = RequestOkReceived(req.request_id, msg.parameters)
        self._events.append(event)
        if req.state.kind == K_TS:
            self._end_request(req)

    def _handle_request_error(self, ctx: MessageContext, msg: ControlMessage) -> None:
        assert isinstance(msg, RequestError) and ctx.request is not None
        req = ctx.request
        if msg.redirect is not None:
            if msg.redirect.connect_uri and not self.is_client:
                raise ProtocolViolation("Redirect with a Connect URI sent to a server")
            if req.state.kind in (K_SNS, K_PNS) and msg.redirect.track_name:
                raise ProtocolViolation("Redirect with a Track Name for a namespace request")
        if req.ended:
            return
        rid = ctx.answers if ctx.answers is not None else req.request_id
        self._events.append(
            RequestErrorReceived(rid, msg.error_code, msg.reason, msg.retry_interval, msg.redirect)
        )
        if ctx.answers is None:
            # "A REQUEST_ERROR indicates no objects will be delivered": the request is over.
            self._end_request(req)
            if req.state.kind == K_FETCH:
                req.fetch_data_done = True

    # =============================================================================================
    # internals: setup and the control stream

    def _after_setup_progress(self) -> None:
        if not self.established or self._setup_reported:
            return
        self._setup_reported = True
        peer = self._peer_setup
        assert peer is not None
        self._events.append(
            SetupCompleted(
                peer.path, peer.authority, peer.authorization_tokens, peer.max_auth_token_cache_size or 0,
                peer.implementation, peer.unknown_options,
            )
        )  # fmt: skip
        # Streams that arrived before SETUP completed were buffered; process them now.
        for req in list(self._bidi.values()):
            if not req.local:
                self._pump_request(req)
                if self.closed is not None:
                    return
        for stream in list(self._incoming.values()):
            if stream.kind is not DataStreamKind.CONTROL:
                self._pump_data(stream)
                if self.closed is not None:
                    return

    def _on_control_bytes(self, data: bytes | bytearray | memoryview, end_stream: bool) -> None:
        framer = self._peer_control_framer
        framer.feed(data)
        while self.closed is None:
            msg = framer.next_message()
            if msg is None:
                break
            if self._peer_setup is None and not isinstance(msg, Setup):
                raise ProtocolViolation(f"{type(msg).__name__} before SETUP on the control stream")
            if not isinstance(msg, Setup | Goaway):
                raise ProtocolViolation(f"{type(msg).__name__} is not allowed on the control stream")
            self._handlers[msg.TYPE](MessageContext(None), msg)
        if framer.buffered > self.config.max_control_message_size + 16:
            raise LimitExceeded("control stream holds more than one control message")
        if end_stream and self.closed is None:
            # "A control stream MUST NOT be closed at the underlying transport layer" (section
            # "Session initialization").
            raise ProtocolViolation("the peer closed its control stream")

