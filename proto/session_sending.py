"""Objects we send: subgroup streams, fetch streams and datagrams.

Owns: opening, writing and closing our subgroup streams (object ID order, status objects), the fetch
stream of a FETCH we serve (FETCH_HEADER on first use, end-of-range markers, FIN), and OBJECT_DATAGRAMs.
Everything here is an application action: misuse raises ``UsageError``."""

from __future__ import annotations

from .data import (
    FetchEndOfRange,
    FetchHeader,
    FetchObject,
    FetchObjectEncoder,
    ObjectDatagram,
    ObjectStatus,
    SubgroupHeader,
    SubgroupIdMode,
    encode_datagram,
    encode_fetch_header,
    encode_subgroup_header,
    subgroup_object_prefix,
)
from .errors import (
    StreamResetCode,
    UsageError,
)
from .messages import (
    GroupOrder,
    Properties,
)
from .session_config import (
    ResetStream,
    SendDatagram,
)
from .session_state import (
    ACCEPTED,
    DONE,
    K_FETCH,
    RESP,
    OutgoingSubgroup,
    RequestStream,
    SessionState,
)


class ObjectSending(SessionState):
    """Part of ``MoqtSession``: the objects we send."""

    # -- objects we send -------------------------------------------------------------------------

    def open_subgroup(
        self,
        track_alias: int,
        group_id: int,
        subgroup_id: int,
        publisher_priority: int | None = None,
        *,
        has_properties: bool = False,
        end_of_group: bool = False,
        first_object: bool = False,
    ) -> int:
        """Open a subgroup stream (SUBGROUP_HEADER) for a subscription we publish; returns its id.

        ``publisher_priority`` None inherits the subscription's priority (DEFAULT_PRIORITY bit).
        """
        self._check_open()
        request_id = self._pub_aliases.get(track_alias)
        if request_id is None:
            raise UsageError(f"Track Alias {track_alias} belongs to no subscription we publish")
        req = self._requests[request_id]
        mode = SubgroupIdMode.ZERO if subgroup_id == 0 else SubgroupIdMode.EXPLICIT
        header = SubgroupHeader(
            track_alias,
            group_id,
            subgroup_id,
            mode,
            publisher_priority,
            has_properties,
            end_of_group,
            first_object,
        )
        data = encode_subgroup_header(header)
        stream_id = self._allocate_stream(unidirectional=True)
        self._outgoing[stream_id] = OutgoingSubgroup(stream_id, header, request_id)
        req.data_streams.add(stream_id)
        req.streams_opened += 1
        self._send(stream_id, data)
        return stream_id

    def send_subgroup_object(
        self,
        stream_id: int,
        object_id: int,
        payload: bytes | bytearray | memoryview,
        properties: Properties = (),
        status: ObjectStatus = ObjectStatus.NORMAL,
        end_stream: bool = False,
    ) -> None:
        """Send one object on a subgroup stream; ``end_stream`` FINs the stream after it.

        Objects on a stream the peer stopped (STOP_SENDING) are dropped without error.
        """
        sub = self._outgoing_subgroup(stream_id)
        if sub.stopped:
            return
        prefix = subgroup_object_prefix(
            sub.header, object_id, sub.prev_object_id, len(payload), status, properties
        )
        sub.prev_object_id = object_id
        if payload:
            self._send(stream_id, prefix)
            # The payload goes out as its own write: no concatenation copy of a large object.
            self._send(stream_id, payload if isinstance(payload, bytes) else bytes(payload), end_stream)
        else:
            self._send(stream_id, prefix, end_stream)
        if end_stream:
            self._finish_outgoing(sub)

    def close_subgroup(self, stream_id: int) -> None:
        """FIN a subgroup stream: every object of the subgroup has been sent."""
        sub = self._outgoing_subgroup(stream_id)
        if not sub.stopped:
            self._send(stream_id, b"", end_stream=True)
        self._finish_outgoing(sub)

    def reset_subgroup(self, stream_id: int, code: StreamResetCode = StreamResetCode.CANCELLED) -> None:
        """Reset a subgroup stream before all its objects were sent (section "Closing Subgroup Streams")."""
        sub = self._outgoing_subgroup(stream_id)
        if not sub.stopped:
            self._transmits.append(ResetStream(stream_id, int(code)))
        self._finish_outgoing(sub)

    def send_fetch_object(
        self,
        request_id: int,
        group_id: int,
        subgroup_id: int | None,
        object_id: int,
        payload: bytes | bytearray | memoryview,
        publisher_priority: int = 128,
        properties: Properties = (),
    ) -> None:
        """Send one object of a FETCH response on its fetch stream (opened with FETCH_HEADER on first use).

        ``subgroup_id`` None marks an object whose Forwarding Preference is Datagram.
        """
        req = self._fetch_to_serve(request_id)
        if req.fetch_data_done:
            return  # the peer stopped the fetch stream
        encoder = self._fetch_stream(req)
        assert req.fetch_data_stream is not None
        data = payload if isinstance(payload, bytes) else bytes(payload)
        item = FetchObject(group_id, object_id, subgroup_id, publisher_priority, data, properties)
        # Prefix and payload go out as separate writes: no concatenation copy of a large object.
        self._send(req.fetch_data_stream, encoder.encode_prefix(item))
        if data:
            self._send(req.fetch_data_stream, data)

    def send_fetch_end_of_range(
        self, request_id: int, group_id: int, object_id: int, unknown: bool = False
    ) -> None:
        """Mark objects up to {group_id, object_id} as non-existent (or of unknown status, ``unknown``)."""
        req = self._fetch_to_serve(request_id)
        if req.fetch_data_done:
            return
        encoder = self._fetch_stream(req)
        assert req.fetch_data_stream is not None
        self._send(req.fetch_data_stream, encoder.encode(FetchEndOfRange(group_id, object_id, unknown)))

    def finish_fetch(self, request_id: int) -> None:
        """FIN the fetch stream (opening it first if the range holds no objects)."""
        req = self._fetch_to_serve(request_id)
        if req.fetch_data_done:
            return
        self._fetch_stream(req)
        assert req.fetch_data_stream is not None
        self._send(req.fetch_data_stream, b"", end_stream=True)
        req.fetch_data_done = True
        req.data_streams.discard(req.fetch_data_stream)
        if req.state.states[RESP] is ACCEPTED:
            # "It can destroy all FETCH state after closing the data stream with a FIN."
            self._fin_our_side(req)
        self._maybe_forget(req)

    def send_object_datagram(
        self,
        track_alias: int,
        group_id: int,
        object_id: int,
        payload: bytes = b"",
        publisher_priority: int | None = None,
        properties: Properties = (),
        status: ObjectStatus | None = None,
        end_of_group: bool = False,
    ) -> None:
        """Send one object as an OBJECT_DATAGRAM for a subscription we publish."""
        self._check_open()
        if track_alias not in self._pub_aliases:
            raise UsageError(f"Track Alias {track_alias} belongs to no subscription we publish")
        dgram = ObjectDatagram(
            track_alias, group_id, object_id, publisher_priority, payload, status, properties, end_of_group
        )
        self._transmits.append(SendDatagram(encode_datagram(dgram)))

    # =============================================================================================
    # internals: publisher data streams

    def _outgoing_subgroup(self, stream_id: int) -> OutgoingSubgroup:
        self._check_open()
        sub = self._outgoing.get(stream_id)
        if sub is None or sub.closed:
            raise UsageError(f"stream {stream_id} is not an open subgroup stream of ours")
        return sub

    def _finish_outgoing(self, sub: OutgoingSubgroup) -> None:
        sub.closed = True
        self._outgoing.pop(sub.stream_id, None)
        req = self._requests.get(sub.request_id)
        if req is not None:
            req.data_streams.discard(sub.stream_id)
            self._maybe_forget(req)

    def _fetch_to_serve(self, request_id: int) -> RequestStream:
        self._check_open()
        req = self._requests.get(request_id)
        if req is None or req.local or req.state.kind != K_FETCH:
            raise UsageError(f"{request_id} is not a FETCH we are serving")
        if req.state.states[RESP] is DONE:
            raise UsageError(f"FETCH {request_id} was rejected")
        return req

    def _fetch_stream(self, req: RequestStream) -> FetchObjectEncoder:
        if req.fetch_encoder is None:
            group_order = req.fetch.parameters.group_order if req.fetch is not None else None
            req.fetch_encoder = FetchObjectEncoder(group_order or GroupOrder.ASCENDING)
            stream_id = self._allocate_stream(unidirectional=True)
            req.fetch_data_stream = stream_id
            req.data_streams.add(stream_id)
            self._send(stream_id, encode_fetch_header(FetchHeader(req.request_id)))
        return req.fetch_encoder

