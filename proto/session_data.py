"""Data the peer sends outside request streams: subgroup and fetch streams, datagrams, resets.

Owns: classifying each peer unidirectional stream (control, padding, SUBGROUP_HEADER, FETCH_HEADER), binding
it to its request by Track Alias or Request ID (holding subgroup streams until their alias is known),
reporting objects, the subscriber side's Track Alias bookkeeping, ``max_data_streams``, RESET_STREAM and
STOP_SENDING from the peer, and OBJECT_DATAGRAMs."""

from __future__ import annotations

from .data import (
    ControlStreamHeader,
    DataStreamReader,
    FetchEndOfRange,
    FetchHeader,
    FetchObject,
    ObjectDatagram,
    ObjectStatus,
    PaddingStreamHeader,
    StreamEnd,
    SubgroupHeader,
    SubgroupObject,
    decode_datagram,
)
from .errors import (
    DuplicateTrackAlias,
    LimitExceeded,
    ProtocolViolation,
    StreamResetCode,
)
from .events import (
    DataStreamStopped,
    FetchCompleted,
    FetchRangeReceived,
    FetchStreamReset,
    ObjectReceived,
    SubgroupClosed,
)
from .messages import (
    GroupOrder,
)
from .session_config import (
    ResetStream,
    StopSending,
)
from .session_state import (
    K_FETCH,
    DataStreamKind,
    IncomingStream,
    RequestStream,
    SessionState,
    SubscribedTrack,
    is_local_stream,
    is_uni_stream,
)


class DataStreams(SessionState):
    """Part of ``MoqtSession``: incoming data streams, datagrams, resets and STOP_SENDING."""

    # =============================================================================================
    # internals: unidirectional streams

    def _receive_uni(self, stream_id: int, data: bytes, end_stream: bool) -> None:
        if is_local_stream(stream_id, self.is_client):
            return  # QUIC never delivers data on our own unidirectional streams
        stream = self._incoming.get(stream_id)
        if stream is None:
            if stream_id in self._seen_uni:
                return
            self._seen_uni.add(stream_id)
            stream = IncomingStream(stream_id, DataStreamReader(
                self.config.max_object_size, object_size_limits=self.config.object_size_limits
            ))
            self._incoming[stream_id] = stream
        if stream.fin:
            return
        stream.fin = end_stream
        if stream.kind is DataStreamKind.CONTROL:
            self._on_control_bytes(data, end_stream)
            return
        if stream.discarding:
            if end_stream:
                self._drop_incoming(stream)
            return
        stream.reader.feed(data, end_stream)
        self._pump_data(stream)

    def _pump_data(self, stream: IncomingStream) -> None:
        """Parse what is buffered on a peer unidirectional stream and report complete objects."""
        try:
            self._pump_data_items(stream)
        except LimitExceeded as exc:
            # An object larger than we accept fails that stream only.
            self._log.info("abandoning stream %d: %s", stream.stream_id, exc.reason)
            self._abandon_incoming(stream, StreamResetCode.EXCESSIVE_LOAD, reason=exc.reason)

    def _pump_data_items(self, stream: IncomingStream) -> None:
        reader = stream.reader
        if stream.kind is DataStreamKind.UNKNOWN:
            item = reader.next_item()
            if item is None:
                return
            if not self._classify_stream(stream, item):
                return
        while not stream.discarding and self.closed is None:
            if not self.established or not self._stream_bound(stream):
                if reader.buffered > self.config.max_buffered_bytes_per_stream:
                    self._abandon_incoming(stream, StreamResetCode.EXCESSIVE_LOAD)
                return
            item = reader.next_item()
            if item is None:
                return
            self._on_data_item(stream, item)

    def _classify_stream(self, stream: IncomingStream, item: object) -> bool:
        """Handle the first item of a stream; False when nothing more is to be parsed here."""
        if isinstance(item, ControlStreamHeader):
            if self._peer_control is not None:
                raise ProtocolViolation("a second control stream")
            stream.kind = DataStreamKind.CONTROL
            self._peer_control = stream
            self._on_control_bytes(stream.reader.take_buffered(), stream.fin)
            return False
        if isinstance(item, PaddingStreamHeader):
            stream.kind = DataStreamKind.PADDING
            stream.discarding = True  # "The receiver MUST discard all data received on a padding stream"
            if stream.fin:
                self._drop_incoming(stream)
            return False
        if self._data_streams_open >= self.config.max_data_streams:
            self._abandon_incoming(stream, StreamResetCode.EXCESSIVE_LOAD)
            return False
        stream.counted = True
        self._data_streams_open += 1
        if isinstance(item, SubgroupHeader):
            stream.kind = DataStreamKind.SUBGROUP
            stream.header = item
            return True
        if isinstance(item, FetchHeader):
            stream.kind = DataStreamKind.FETCH
            stream.request_id = item.request_id
            return True
        raise ProtocolViolation("data stream without a header")  # the reader returns headers first

    def _stream_bound(self, stream: IncomingStream) -> bool:
        """Tie a data stream to its request; False while it has to wait (unknown Track Alias)."""
        if stream.request_id is not None and stream.kind is DataStreamKind.SUBGROUP:
            return True
        if stream.kind is DataStreamKind.FETCH:
            return self._bind_fetch_stream(stream)
        header = stream.header
        assert header is not None
        track = self._sub_tracks.get(header.track_alias)
        if track is None:
            # Reordering with the SUBSCRIBE_OK / PUBLISH that defines the alias (section "Subgroup
            # Header": "choose to buffer it for a brief period").
            waiting = self._pending_alias.setdefault(header.track_alias, [])
            if stream not in waiting:
                waiting.append(stream)
            return False
        if not track.active:
            self._abandon_incoming(stream, StreamResetCode.CANCELLED)
            return False
        stream.request_id = track.request_id
        return True

    def _bind_fetch_stream(self, stream: IncomingStream) -> bool:
        if stream.discarding:
            return False
        rid = stream.request_id
        assert rid is not None
        req = self._requests.get(rid)
        if req is not None and req.local and req.state.kind == K_FETCH:
            if req.fetch_data_stream == stream.stream_id:
                return True
            if req.fetch_data_stream is not None:
                raise ProtocolViolation(f"a second fetch stream for request {rid}")
            if req.ended or req.fetch_data_done:
                self._abandon_incoming(stream, StreamResetCode.CANCELLED)
                return False
            req.fetch_data_stream = stream.stream_id
            group_order = req.fetch.parameters.group_order if req.fetch is not None else None
            stream.reader.group_order = group_order or GroupOrder.ASCENDING
            return True
        ours = rid & 1 == (0 if self.is_client else 1) and rid < self._next_request_id
        if not ours or (req is not None and req.state.kind != K_FETCH):
            raise ProtocolViolation(f"FETCH_HEADER for Request ID {rid}, which is no FETCH of ours")
        self._abandon_incoming(stream, StreamResetCode.CANCELLED)  # a fetch we already ended
        return False

    def _on_data_item(self, stream: IncomingStream, item: object) -> None:
        rid = stream.request_id
        assert rid is not None
        if isinstance(item, SubgroupObject):
            header = stream.header
            assert header is not None
            stream.objects += 1
            self._events.append(
                ObjectReceived(
                    rid, header.track_alias, header.group_id, stream.reader.subgroup_id, item.object_id,
                    header.publisher_priority, int(item.status), item.properties, item.payload, "subgroup",
                    stream.stream_id, first_object=header.first_object and stream.objects == 1,
                )
            )  # fmt: skip
        elif isinstance(item, FetchObject):
            self._events.append(
                ObjectReceived(
                    rid, None, item.group_id, item.subgroup_id, item.object_id, item.publisher_priority,
                    int(ObjectStatus.NORMAL), item.properties, item.payload, "fetch", stream.stream_id,
                )
            )  # fmt: skip
        elif isinstance(item, FetchEndOfRange):
            self._events.append(FetchRangeReceived(rid, item.group_id, item.object_id, item.unknown))
        elif isinstance(item, StreamEnd):
            if stream.kind is DataStreamKind.FETCH:
                self._events.append(FetchCompleted(rid))
                self._fetch_stream_over(rid)
            else:
                self._subgroup_closed(stream, None)
            self._drop_incoming(stream)

    def _subgroup_closed(self, stream: IncomingStream, error_code: int | None) -> None:
        header = stream.header
        if header is None or stream.request_id is None:
            return
        self._events.append(
            SubgroupClosed(
                stream.request_id, header.track_alias, header.group_id, stream.reader.subgroup_id,
                stream.stream_id, error_code,
            )
        )  # fmt: skip

    def _fetch_stream_over(self, request_id: int) -> None:
        req = self._requests.get(request_id)
        if req is not None and req.local and req.state.kind == K_FETCH:
            req.fetch_data_done = True
            # The subscriber keeps FETCH state until the data stream ends; FETCH_OK may still come.
            self._fin_our_side(req)
            self._maybe_forget(req)

    def _fin_our_side(self, req: RequestStream) -> None:
        if not req.send_closed and self.closed is None:
            self._send(req.stream_id, b"", end_stream=True)
            req.send_closed = True

    def _abandon_incoming(
        self, stream: IncomingStream, code: int, report: bool = True, reason: str = ""
    ) -> None:
        """Stop reading a data stream (STOP_SENDING); ``report`` tells the application if it was bound."""
        if stream.discarding:
            return
        stream.discarding = True
        if not stream.fin:
            self._transmits.append(StopSending(stream.stream_id, int(code)))
        if report and stream.request_id is not None:
            if stream.kind is DataStreamKind.SUBGROUP:
                self._subgroup_closed(stream, int(code))
            elif stream.kind is DataStreamKind.FETCH:
                req = self._requests.get(stream.request_id)
                if req is not None and req.fetch_data_stream == stream.stream_id and not req.ended:
                    self._events.append(FetchStreamReset(stream.request_id, int(code), reason))
        if stream.kind is DataStreamKind.FETCH and stream.request_id is not None:
            req = self._requests.get(stream.request_id)
            if req is not None and req.fetch_data_stream == stream.stream_id:
                self._fetch_stream_over(stream.request_id)
        self._drop_incoming(stream)

    def _drop_incoming(self, stream: IncomingStream) -> None:
        """Forget a peer data stream; ``_seen_uni`` keeps late bytes from reviving it."""
        stream.discarding = True
        if stream.counted:
            stream.counted = False
            self._data_streams_open -= 1
        if stream.header is not None:
            waiting = self._pending_alias.get(stream.header.track_alias)
            if waiting and stream in waiting:
                waiting.remove(stream)
                if not waiting:
                    del self._pending_alias[stream.header.track_alias]
        self._incoming.pop(stream.stream_id, None)

    def _bind_sub_alias(self, req: RequestStream, track_alias: int) -> None:
        """Subscriber side: the peer (publisher) assigned ``track_alias`` to request ``req``."""
        assert req.full_track_name is not None
        existing = self._sub_tracks.get(track_alias)
        if (
            existing is not None
            and existing.established
            and existing.request_id != req.request_id
            and existing.full_track_name != req.full_track_name
        ):
            raise DuplicateTrackAlias(f"Track Alias {track_alias} is already used for another track")
        req.track_alias = track_alias
        self._sub_tracks[track_alias] = SubscribedTrack(req.request_id, req.full_track_name)
        self._retired_sub_aliases.pop(track_alias, None)  # bound again: live, not retired

    def _retire_sub_track(self, track_alias: int, track: SubscribedTrack) -> None:
        """A subscription ended: keep its alias a while, so its late objects are dropped quietly, and
        forget the oldest ended ones beyond ``max_retired_aliases``. O(1) per subscription: a scan of
        every alias per PUBLISH made a publisher pushing N tracks on one session cost O(N^2)."""
        track.established = False
        self._retired_sub_aliases[track_alias] = None
        while len(self._retired_sub_aliases) > self.config.max_retired_aliases:
            alias, _ = self._retired_sub_aliases.popitem(last=False)
            retired = self._sub_tracks.get(alias)
            if retired is not None and not retired.established:
                del self._sub_tracks[alias]

    def _release_pending_alias(self, track_alias: int) -> None:
        for stream in self._pending_alias.pop(track_alias, []):
            if self.closed is not None:
                return
            if not stream.discarding:
                self._pump_data(stream)

    # =============================================================================================
    # internals: resets, STOP_SENDING, datagrams

    def _on_stream_reset(self, stream_id: int, error_code: int) -> None:
        if is_uni_stream(stream_id):
            stream = self._incoming.get(stream_id)
            if stream is None or is_local_stream(stream_id, self.is_client):
                return
            if stream.kind is DataStreamKind.CONTROL:
                raise ProtocolViolation("the peer reset its control stream")
            stream.fin = True  # nothing more will arrive; no STOP_SENDING needed
            if not stream.discarding and stream.request_id is not None:
                if stream.kind is DataStreamKind.SUBGROUP:
                    self._subgroup_closed(stream, error_code)
                elif stream.kind is DataStreamKind.FETCH:
                    req = self._requests.get(stream.request_id)
                    if req is not None and req.fetch_data_stream == stream_id:
                        if not req.ended:
                            self._events.append(FetchStreamReset(stream.request_id, error_code))
                        self._fetch_stream_over(stream.request_id)
            self._drop_incoming(stream)
            return
        req = self._bidi.get(stream_id)
        if req is None or req.recv_closed:
            return
        req.fin_received = req.recv_closed = True
        self._peer_cancelled(req, error_code)

    def _on_stop_sending(self, stream_id: int, error_code: int) -> None:
        if stream_id == self._control_stream_id:
            raise ProtocolViolation("the peer sent STOP_SENDING for our control stream")
        if is_uni_stream(stream_id):
            sub = self._outgoing.get(stream_id)
            if sub is not None:
                # QUIC resets the stream itself; later objects for it are dropped quietly and the
                # subscription no longer counts it as open.
                if not sub.stopped:
                    sub.stopped = True
                    self._transmits.append(ResetStream(stream_id, error_code))
                    self._events.append(DataStreamStopped(sub.request_id, stream_id, error_code))
                    req = self._requests.get(sub.request_id)
                    if req is not None:
                        req.data_streams.discard(stream_id)
                return
            for req in list(self._requests.values()):
                if req.fetch_data_stream == stream_id and not req.local and not req.fetch_data_done:
                    req.fetch_data_done = True
                    req.data_streams.discard(stream_id)
                    self._transmits.append(ResetStream(stream_id, error_code))
                    self._events.append(DataStreamStopped(req.request_id, stream_id, error_code))
                    self._maybe_forget(req)
                    return
            return
        req = self._bidi.get(stream_id)
        if req is None or req.send_closed:
            return
        req.send_closed = True
        self._transmits.append(ResetStream(stream_id, error_code))
        self._peer_cancelled(req, error_code)

    def _on_datagram(self, data: bytes) -> None:
        dgram = decode_datagram(data)
        if not isinstance(dgram, ObjectDatagram) or not self.established:
            return
        track = self._sub_tracks.get(dgram.track_alias)
        if track is None or not track.active:
            return  # "MAY drop the datagram" for an unknown Track Alias
        status = int(dgram.status) if dgram.status is not None else int(ObjectStatus.NORMAL)
        self._events.append(
            ObjectReceived(
                track.request_id, dgram.track_alias, dgram.group_id, None, dgram.object_id,
                dgram.publisher_priority, status, dgram.properties, dgram.payload, "datagram", None,
                dgram.end_of_group,
            )
        )  # fmt: skip

