"""MoQT draft-18 data plane: unidirectional stream types, subgroup and fetch streams, datagrams.

Owns the byte layout of section "Data Streams and Datagrams" and the stream types of
section "Unidirectional Stream Types". Encoders are pure functions (plus a small
stateful encoder for fetch streams, whose objects are delta-coded against the prior
object). ``DataStreamReader`` is fed the bytes of one unidirectional stream and yields
the header, then whole objects as they complete. It knows nothing about
subscriptions or track aliases: the session maps headers to requests.

End of Range markers on fetch streams (section "End of Range") carry the Group ID and
Object ID as absolute values: the draft says "the Group ID and Object ID fields are
present" without defining deltas for them, and delta coding with the 0x08 bit would make
a range ending in the prior object's group impossible to express.

Payloads are kept in one bytearray per stream with a read offset that is compacted
occasionally, so multi-megabyte objects arriving in small chunks cost linear time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import IntEnum
from typing import Final, TypeAlias

from .buffer import VI64_MAX, Buffer, BufferReadError, BufferWriteError, vi64_decode, vi64_encode
from .errors import LimitExceeded, ProtocolViolation, StreamTruncated, UsageError
from .messages import (
    GroupOrder,
    Properties,
    decode_key_value_pairs,
    encode_key_value_pairs,
    pull_key_value_pairs,
)

__all__ = [
    "DATAGRAM_TYPE_PADDING",
    "STREAM_TYPE_FETCH_HEADER",
    "STREAM_TYPE_PADDING",
    "STREAM_TYPE_SETUP",
    "ControlStreamHeader",
    "DataStreamItem",
    "DataStreamReader",
    "FetchEndOfRange",
    "FetchHeader",
    "FetchObject",
    "FetchObjectEncoder",
    "ObjectDatagram",
    "ObjectStatus",
    "PaddingDatagram",
    "PaddingStreamHeader",
    "StreamEnd",
    "SubgroupHeader",
    "SubgroupIdMode",
    "SubgroupObject",
    "decode_datagram",
    "encode_datagram",
    "encode_fetch_header",
    "encode_padding_datagram",
    "encode_padding_stream",
    "encode_subgroup_header",
    "encode_subgroup_object",
    "is_subgroup_header_type",
    "subgroup_object_prefix",
]

# Unidirectional stream types (section "Unidirectional Stream Types").
STREAM_TYPE_FETCH_HEADER: Final = 0x05
STREAM_TYPE_SETUP: Final = 0x2F00  # a control stream starts with the SETUP message itself
STREAM_TYPE_PADDING: Final = 0x132B3E28
DATAGRAM_TYPE_PADDING: Final = 0x132B3E29  # section "Padding Datagrams"

# SUBGROUP_HEADER type bits: 0x10..0x7F with bit 4 set (section "Subgroup Header").
SUBGROUP_PROPERTIES: Final = 0x01
SUBGROUP_ID_MODE_MASK: Final = 0x06
SUBGROUP_END_OF_GROUP: Final = 0x08
SUBGROUP_TYPE_BIT: Final = 0x10
SUBGROUP_DEFAULT_PRIORITY: Final = 0x20
SUBGROUP_FIRST_OBJECT: Final = 0x40

# OBJECT_DATAGRAM type bits: 0x00..0x0F and 0x20..0x2F (section "Object Datagram").
DATAGRAM_PROPERTIES: Final = 0x01
DATAGRAM_END_OF_GROUP: Final = 0x02
DATAGRAM_ZERO_OBJECT_ID: Final = 0x04
DATAGRAM_DEFAULT_PRIORITY: Final = 0x08
DATAGRAM_STATUS: Final = 0x20

# Fetch object Serialization Flags (section "Fetch Header", "Flags").
FETCH_SUBGROUP_MASK: Final = 0x03
FETCH_OBJECT_ID_PRESENT: Final = 0x04
FETCH_GROUP_ID_PRESENT: Final = 0x08
FETCH_PRIORITY_PRESENT: Final = 0x10
FETCH_PROPERTIES_PRESENT: Final = 0x20
FETCH_DATAGRAM: Final = 0x40
FETCH_END_OF_NON_EXISTENT_RANGE: Final = 0x8C
FETCH_END_OF_UNKNOWN_RANGE: Final = 0x10C


class ObjectStatus(IntEnum):
    """Object Status (section "Object Status")."""

    NORMAL = 0x0
    END_OF_GROUP = 0x3
    END_OF_TRACK = 0x4


class SubgroupIdMode(IntEnum):
    """SUBGROUP_ID_MODE of a SUBGROUP_HEADER type (bits 1-2)."""

    ZERO = 0b00
    """No Subgroup ID field; the Subgroup ID is 0."""
    FIRST_OBJECT_ID = 0b01
    """No Subgroup ID field; the Subgroup ID is the Object ID of the first object on the stream."""
    EXPLICIT = 0b10
    """The Subgroup ID field is present."""


_OBJECT_STATUSES: Final = frozenset(int(s) for s in ObjectStatus)


# -- stream items ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ControlStreamHeader:
    """The stream starts with SETUP (0x2F00): it is the peer's control stream.

    Hand ``DataStreamReader.take_buffered()`` (which still includes the type) to a
    ``ControlMessageReader``.
    """


@dataclass(frozen=True, slots=True)
class PaddingStreamHeader:
    """The stream is a padding stream (section "Padding Streams"); its zero bytes are discarded."""


@dataclass(frozen=True, slots=True)
class StreamEnd:
    """The stream ended with FIN at an object boundary."""


@dataclass(frozen=True, slots=True)
class SubgroupHeader:
    """SUBGROUP_HEADER (section "Subgroup Header").

    ``subgroup_id`` is 0 for mode ZERO, None for FIRST_OBJECT_ID (known after the first
    object: ``DataStreamReader.subgroup_id``) and the field value for EXPLICIT.
    ``publisher_priority`` None means the DEFAULT_PRIORITY bit: inherit from the request.
    """

    track_alias: int
    group_id: int
    subgroup_id: int | None = 0
    subgroup_id_mode: SubgroupIdMode = SubgroupIdMode.EXPLICIT
    publisher_priority: int | None = None
    has_properties: bool = False
    """PROPERTIES bit: every object carries a Properties field (possibly empty)."""
    end_of_group: bool = False
    """END_OF_GROUP bit: the last object before FIN is the last object of the group."""
    first_object: bool = False
    """FIRST_OBJECT bit: the first object here is the first the original publisher sent in the subgroup."""

    @property
    def stream_type(self) -> int:
        """The SUBGROUP_HEADER Type value for these flags."""
        return (
            SUBGROUP_TYPE_BIT
            | (SUBGROUP_PROPERTIES if self.has_properties else 0)
            | (self.subgroup_id_mode << 1)
            | (SUBGROUP_END_OF_GROUP if self.end_of_group else 0)
            | (SUBGROUP_DEFAULT_PRIORITY if self.publisher_priority is None else 0)
            | (SUBGROUP_FIRST_OBJECT if self.first_object else 0)
        )


@dataclass(frozen=True, slots=True)
class SubgroupObject:
    """One object on a subgroup stream (section "Subgroup Header", object fields).

    A non-NORMAL ``status`` has an empty payload and no properties.
    """

    object_id: int
    payload: bytes = b""
    status: ObjectStatus = ObjectStatus.NORMAL
    properties: Properties = ()


@dataclass(frozen=True, slots=True)
class FetchHeader:
    """FETCH_HEADER (section "Fetch Header")."""

    request_id: int


@dataclass(frozen=True, slots=True)
class FetchObject:
    """One object on a fetch stream; ``subgroup_id`` None means Forwarding Preference Datagram."""

    group_id: int
    object_id: int
    subgroup_id: int | None
    publisher_priority: int
    payload: bytes = b""
    properties: Properties = ()


@dataclass(frozen=True, slots=True)
class FetchEndOfRange:
    """End of Non-Existent Range (``unknown`` False, 0x8C) or End of Unknown Range (True, 0x10C):
    objects after the prior object up to this Location inclusive do not exist / are unknown."""

    group_id: int
    object_id: int
    unknown: bool = False


DataStreamItem: TypeAlias = (
    ControlStreamHeader
    | PaddingStreamHeader
    | SubgroupHeader
    | SubgroupObject
    | FetchHeader
    | FetchObject
    | FetchEndOfRange
    | StreamEnd
)


@dataclass(frozen=True, slots=True)
class ObjectDatagram:
    """OBJECT_DATAGRAM (section "Object Datagram").

    ``status`` None: a payload datagram; otherwise a status datagram (STATUS bit) with no
    payload. ``publisher_priority`` None: DEFAULT_PRIORITY bit.
    """

    track_alias: int
    group_id: int
    object_id: int
    publisher_priority: int | None = None
    payload: bytes = b""
    status: ObjectStatus | None = None
    properties: Properties = ()
    end_of_group: bool = False

    @property
    def datagram_type(self) -> int:
        """The OBJECT_DATAGRAM Type value for these fields."""
        return (
            (DATAGRAM_PROPERTIES if self.properties else 0)
            | (DATAGRAM_END_OF_GROUP if self.end_of_group else 0)
            | (DATAGRAM_ZERO_OBJECT_ID if self.object_id == 0 else 0)
            | (DATAGRAM_DEFAULT_PRIORITY if self.publisher_priority is None else 0)
            | (DATAGRAM_STATUS if self.status is not None else 0)
        )


@dataclass(frozen=True, slots=True)
class PaddingDatagram:
    """A padding datagram (section "Padding Datagrams"), to be discarded."""

    length: int


# -- helpers -----------------------------------------------------------------------------------


def is_subgroup_header_type(stream_type: int) -> bool:
    """True for types below 0x80 with bit 4 set, including the reserved SUBGROUP_ID_MODE 0b11."""
    return stream_type < 0x80 and bool(stream_type & SUBGROUP_TYPE_BIT)


def _encode_properties_field(properties: Properties) -> bytes:
    data = encode_key_value_pairs(properties)
    return vi64_encode(len(data)) + data


def _check_priority(priority: int | None) -> None:
    if priority is not None and not 0 <= priority <= 0xFF:
        raise UsageError(f"publisher priority {priority} is not a uint8")


def _check_status_object(status: ObjectStatus | None, payload: bytes, properties: Properties) -> None:
    if status is not None and status != ObjectStatus.NORMAL and (payload or properties):
        raise UsageError("an object with a non-Normal status has no payload and no properties")


# -- subgroup streams --------------------------------------------------------------------------


def encode_subgroup_header(header: SubgroupHeader) -> bytes:
    """Serialize a SUBGROUP_HEADER (stream type included)."""
    mode = header.subgroup_id_mode
    expected_none = mode == SubgroupIdMode.FIRST_OBJECT_ID
    if expected_none != (header.subgroup_id is None) or (mode == SubgroupIdMode.ZERO and header.subgroup_id):
        raise UsageError(f"subgroup_id {header.subgroup_id} does not match mode {mode.name}")
    _check_priority(header.publisher_priority)
    buf = Buffer()
    try:
        buf.push_vi64(header.stream_type)
        buf.push_vi64(header.track_alias)
        buf.push_vi64(header.group_id)
        if mode == SubgroupIdMode.EXPLICIT:
            assert header.subgroup_id is not None
            buf.push_vi64(header.subgroup_id)
        if header.publisher_priority is not None:
            buf.push_uint8(header.publisher_priority)
    except BufferWriteError as exc:
        raise UsageError(str(exc)) from None
    return buf.data


def subgroup_object_prefix(
    header: SubgroupHeader,
    object_id: int,
    prev_object_id: int | None,
    payload_length: int,
    status: ObjectStatus = ObjectStatus.NORMAL,
    properties: Properties = (),
) -> bytes:
    """The object fields before the payload, so a large payload can be sent without copying it."""
    if prev_object_id is None:
        delta = object_id
    else:
        delta = object_id - prev_object_id - 1
        if delta < 0:
            raise UsageError("object IDs on a subgroup stream must increase")
    if properties and not header.has_properties:
        raise UsageError("this subgroup header has no PROPERTIES bit")
    if payload_length and status != ObjectStatus.NORMAL:
        raise UsageError("an object with a non-Normal status has no payload")
    _check_status_object(status, b"", properties)
    try:
        out = vi64_encode(delta)
        if header.has_properties:
            out += _encode_properties_field(properties)
        out += vi64_encode(payload_length)
        if payload_length == 0:
            out += vi64_encode(status)
    except BufferWriteError as exc:
        raise UsageError(str(exc)) from None
    return out


def encode_subgroup_object(header: SubgroupHeader, obj: SubgroupObject, prev_object_id: int | None) -> bytes:
    """Serialize one subgroup object; ``prev_object_id`` is the previous object on this stream."""
    prefix = subgroup_object_prefix(
        header, obj.object_id, prev_object_id, len(obj.payload), obj.status, obj.properties
    )
    return prefix + obj.payload


# -- fetch streams -----------------------------------------------------------------------------


def encode_fetch_header(header: FetchHeader) -> bytes:
    """Serialize a FETCH_HEADER (stream type included)."""
    try:
        return vi64_encode(STREAM_TYPE_FETCH_HEADER) + vi64_encode(header.request_id)
    except BufferWriteError as exc:
        raise UsageError(str(exc)) from None


class FetchObjectEncoder:
    """Serializes the objects of one fetch stream, delta-coding each against the prior one.

    ``group_order`` is the order the groups are sent in (the FETCH's GROUP_ORDER).
    """

    def __init__(self, group_order: GroupOrder = GroupOrder.ASCENDING) -> None:
        self.group_order = group_order
        self._group: int | None = None
        self._object = 0
        self._has_prior_object = False
        self._subgroup: int | None = None
        self._priority = 0

    def encode(self, item: FetchObject | FetchEndOfRange) -> bytes:
        """Serialize one object (payload included) or End of Range marker."""
        if isinstance(item, FetchEndOfRange):
            return self.encode_prefix(item)
        return self.encode_prefix(item) + item.payload

    def encode_prefix(self, item: FetchObject | FetchEndOfRange) -> bytes:
        """Serialize everything but the payload (and advance the delta state)."""
        try:
            return self._encode_prefix(item)
        except BufferWriteError as exc:
            raise UsageError(str(exc)) from None

    def _encode_prefix(self, item: FetchObject | FetchEndOfRange) -> bytes:
        if isinstance(item, FetchEndOfRange):
            flags = FETCH_END_OF_UNKNOWN_RANGE if item.unknown else FETCH_END_OF_NON_EXISTENT_RANGE
            self._group, self._object = item.group_id, item.object_id
            # End of Range carries absolute Group and Object IDs (see the module docstring).
            return vi64_encode(flags) + vi64_encode(item.group_id) + vi64_encode(item.object_id)
        _check_priority(item.publisher_priority)
        flags = 0
        fields = bytearray()
        if self._group is None or item.group_id != self._group:
            flags |= FETCH_GROUP_ID_PRESENT
            if self._group is None:
                group_delta = item.group_id
            elif self.group_order == GroupOrder.ASCENDING:
                group_delta = item.group_id - self._group - 1
            else:
                group_delta = self._group - item.group_id - 1
            if group_delta < 0:
                raise UsageError(f"group {item.group_id} is out of {self.group_order.name} order")
            fields += vi64_encode(group_delta)
        if item.subgroup_id is None:
            flags |= FETCH_DATAGRAM
        elif item.subgroup_id == 0:
            pass
        elif self._has_prior_object and self._subgroup is not None and item.subgroup_id == self._subgroup:
            flags |= 0x01
        elif self._has_prior_object and self._subgroup is not None and item.subgroup_id == self._subgroup + 1:
            flags |= 0x02
        else:
            flags |= 0x03
            fields += vi64_encode(item.subgroup_id)
        if flags & FETCH_GROUP_ID_PRESENT:
            if item.object_id != self._object + 1 or self._group is None:
                flags |= FETCH_OBJECT_ID_PRESENT
                fields += vi64_encode(item.object_id)
        elif item.object_id != self._object + 1:
            delta = item.object_id - self._object
            if delta < 0:
                raise UsageError("object IDs within a group must increase on a fetch stream")
            flags |= FETCH_OBJECT_ID_PRESENT
            fields += vi64_encode(delta)
        if not self._has_prior_object or item.publisher_priority != self._priority:
            flags |= FETCH_PRIORITY_PRESENT
            fields.append(item.publisher_priority)
        if item.properties:
            flags |= FETCH_PROPERTIES_PRESENT
            fields += _encode_properties_field(item.properties)
        fields += vi64_encode(len(item.payload))
        self._group, self._object = item.group_id, item.object_id
        self._has_prior_object = True
        self._subgroup = item.subgroup_id
        self._priority = item.publisher_priority
        return vi64_encode(flags) + bytes(fields)


# -- datagrams ---------------------------------------------------------------------------------


def encode_datagram(dgram: ObjectDatagram) -> bytes:
    """Serialize an OBJECT_DATAGRAM."""
    _check_priority(dgram.publisher_priority)
    if dgram.status is not None:
        if dgram.payload:
            raise UsageError("a status datagram carries no payload")
        if dgram.end_of_group:
            raise UsageError("a status datagram cannot signal end of group")
        _check_status_object(dgram.status, b"", dgram.properties)
    try:
        out = bytearray(vi64_encode(dgram.datagram_type))
        out += vi64_encode(dgram.track_alias)
        out += vi64_encode(dgram.group_id)
        if dgram.object_id != 0:
            out += vi64_encode(dgram.object_id)
        if dgram.publisher_priority is not None:
            out.append(dgram.publisher_priority)
        if dgram.properties:
            out += _encode_properties_field(dgram.properties)
        if dgram.status is not None:
            out += vi64_encode(dgram.status)
        else:
            out += dgram.payload
    except BufferWriteError as exc:
        raise UsageError(str(exc)) from None
    return bytes(out)


def encode_padding_datagram(length: int) -> bytes:
    """A padding datagram with ``length`` zero bytes after its type."""
    return vi64_encode(DATAGRAM_TYPE_PADDING) + bytes(length)


def encode_padding_stream(length: int) -> bytes:
    """The start of a padding stream: its type and ``length`` zero bytes."""
    return vi64_encode(STREAM_TYPE_PADDING) + bytes(length)


def decode_datagram(data: bytes | memoryview) -> ObjectDatagram | PaddingDatagram:
    """Parse one datagram; raises ProtocolViolation for unknown types or malformed contents."""
    buf = Buffer(data)
    try:
        dtype = buf.pull_vi64()
        if dtype == DATAGRAM_TYPE_PADDING:
            rest = buf.pull_bytes(buf.remaining())
            if rest.count(0) != len(rest):
                raise ProtocolViolation("padding datagram with non-zero bytes")
            return PaddingDatagram(len(rest))
        if dtype > 0x2F or dtype & 0x10:
            raise ProtocolViolation(f"unknown datagram type {dtype:#x}")
        if dtype & DATAGRAM_STATUS and dtype & DATAGRAM_END_OF_GROUP:
            raise ProtocolViolation(f"datagram type {dtype:#x} has both STATUS and END_OF_GROUP")
        alias = buf.pull_vi64()
        group = buf.pull_vi64()
        object_id = 0 if dtype & DATAGRAM_ZERO_OBJECT_ID else buf.pull_vi64()
        priority = None if dtype & DATAGRAM_DEFAULT_PRIORITY else buf.pull_uint8()
        properties: Properties = ()
        if dtype & DATAGRAM_PROPERTIES:
            length = buf.pull_vi64()
            if length == 0:
                raise ProtocolViolation("datagram with PROPERTIES bit and empty properties")
            properties = _pull_properties(buf, length)
        status: ObjectStatus | None = None
        payload = b""
        if dtype & DATAGRAM_STATUS:
            status = _to_status(buf.pull_vi64())
            if properties and status != ObjectStatus.NORMAL:
                raise ProtocolViolation("properties on an object whose status is not Normal")
            if not buf.eof():
                raise ProtocolViolation("bytes after the object status of a datagram")
        else:
            payload = buf.pull_bytes(buf.remaining())
    except BufferReadError:
        raise ProtocolViolation("truncated datagram") from None
    return ObjectDatagram(
        alias, group, object_id, priority, payload, status, properties, bool(dtype & DATAGRAM_END_OF_GROUP)
    )


def _pull_properties(buf: Buffer, length: int) -> Properties:
    end = buf.tell() + length
    if end > buf.capacity:
        raise BufferReadError("properties run past the end")
    return pull_key_value_pairs(buf, end)


def _to_status(value: int) -> ObjectStatus:
    if value not in _OBJECT_STATUSES:
        raise ProtocolViolation(f"unknown object status {value:#x}")
    return ObjectStatus(value)


# -- incremental stream reader -----------------------------------------------------------------


class _NeedMore(Exception):
    """Internal: the buffered bytes end inside a field. Never leaves this module."""


_NEED_MORE: Final = _NeedMore()


class DataStreamReader:
    """Incremental parser for one incoming unidirectional stream.

    ``feed(data, end_stream)`` buffers; ``next_item()`` returns the next complete item
    (first a header: SubgroupHeader, FetchHeader, PaddingStreamHeader or
    ControlStreamHeader; then SubgroupObject / FetchObject / FetchEndOfRange; then
    StreamEnd once after a clean FIN) or None when more bytes are needed. A FIN in the
    middle of a header or object raises StreamTruncated (PROTOCOL_VIOLATION). Any
    exception other than ProtocolError is a bug.

    ``group_order`` must be set to the FETCH's GROUP_ORDER before fetch objects are read
    (descending fetches code group deltas downwards). Payloads larger than
    ``max_object_size`` raise LimitExceeded.

    Large payloads are not re-buffered: once an object's fields are parsed and its payload is
    incomplete, the fields are consumed and the payload's pieces are kept as fed (``bytes`` are kept
    as they are) until the last one arrives; then they are joined once. So a payload costs one copy
    however many QUIC chunks it arrives in, and the object's fields are parsed once, not per chunk.
    """

    def __init__(
        self, max_object_size: int = 64 << 20, group_order: GroupOrder = GroupOrder.ASCENDING,
        object_size_limits: Mapping[tuple[int, int], int] | None = None,
    ) -> None:
        self.max_object_size = max_object_size
        self.object_size_limits: Mapping[tuple[int, int], int] = object_size_limits or {}
        """Smaller limits for the objects at these (Group ID, Object ID) locations (e.g. a manifest)."""
        self.group_order = group_order
        self._buf = bytearray()
        self._pos = 0
        self._fin = False
        self._ended = False
        self._kind: int | None = None  # stream type once known
        self.header: SubgroupHeader | FetchHeader | None = None
        """The stream header, once read."""
        # Subgroup state.
        self._prev_object: int | None = None
        self._subgroup_id: int | None = None
        # Fetch state: prior location, and prior subgroup/priority of the last real object.
        self._f_group: int | None = None
        self._f_object = 0
        self._f_has_object = False
        self._f_subgroup: int | None = None
        self._f_priority = 0
        # A payload being gathered: the pieces so far, bytes still missing, and what builds the item.
        self._parts: list[bytes] = []
        self._need = 0
        self._have = 0
        self._finish: Callable[[bytes], DataStreamItem] | None = None

    @property
    def subgroup_id(self) -> int | None:
        """The stream's Subgroup ID once known (after the first object in FIRST_OBJECT_ID mode)."""
        return self._subgroup_id

    @property
    def buffered(self) -> int:
        """Bytes received and not yet consumed."""
        return len(self._buf) - self._pos + self._have

    def take_buffered(self) -> bytes:
        """Remove and return the unconsumed bytes (for a control stream, starting at its type)."""
        data = bytes(self._buf[self._pos :])
        self._buf.clear()
        self._pos = 0
        return data

    def feed(self, data: bytes | bytearray | memoryview, end_stream: bool = False) -> None:
        """Append stream bytes; ``end_stream`` marks the FIN."""
        if self._fin and data:
            raise UsageError("data fed after the end of the stream")
        if self._need and data:
            # Gathering a payload: the bytes go straight into its pieces.
            n = self._need
            if len(data) <= n:
                self._parts.append(data if type(data) is bytes else bytes(data))
                self._need = n - len(data)
                self._have += len(data)
                self._fin = self._fin or end_stream
                return
            view = memoryview(data)
            self._parts.append(bytes(view[:n]))
            self._have += n
            self._need = 0
            data = view[n:]
        if self._kind == STREAM_TYPE_PADDING:
            # Padding is discarded as it arrives so it never holds memory (section "Padding Streams").
            if bytes(data).count(0) != len(data):
                raise ProtocolViolation("padding stream with non-zero bytes")
        else:
            if self._pos and self._pos == len(self._buf):
                self._buf.clear()
                self._pos = 0
            elif self._pos > (1 << 16) and self._pos * 2 > len(self._buf):
                del self._buf[: self._pos]  # compact: amortized O(1) per byte
                self._pos = 0
            self._buf += data
        self._fin = self._fin or end_stream

    def next_item(self) -> DataStreamItem | None:
        """The next complete item, or None if more bytes are needed (or the stream is over)."""
        if self._ended:
            return None
        if self._finish is not None:
            if self._need:
                if self._fin:
                    raise StreamTruncated("stream ended inside an object payload")
                return None
            return self._complete_payload()
        start = self._pos
        try:
            item = self._parse()
        except _NeedMore:
            self._pos = start
            item = None
        if item is not None:
            return item
        if self._finish is not None:  # an object's payload is being gathered
            if self._fin:
                raise StreamTruncated("stream ended inside an object payload")
            return None
        if self._fin and self._kind != STREAM_TYPE_SETUP:
            if self._pos < len(self._buf) or self._kind is None:
                raise StreamTruncated("stream ended inside a header or object")
            self._ended = True
            return StreamEnd()
        return None

    # -- field access over the bytearray; no memoryview is held so the buffer can grow --

    def _vi(self) -> int:
        res = vi64_decode(self._buf, self._pos)
        if res is None:
            raise _NEED_MORE
        self._pos = res[1]
        return res[0]

    def _u8(self) -> int:
        if self._pos >= len(self._buf):
            raise _NEED_MORE
        self._pos += 1
        return self._buf[self._pos - 1]

    def _take(self, n: int) -> bytes:
        end = self._pos + n
        if end > len(self._buf):
            raise _NEED_MORE
        with memoryview(self._buf) as view:
            data = bytes(view[self._pos : end])  # one copy (slicing the bytearray would add another)
        self._pos = end
        return data

    def _payload(self, length: int, finish: Callable[[bytes], DataStreamItem]) -> DataStreamItem | None:
        """The item built by ``finish(payload)`` if the payload is buffered; otherwise consume what is
        buffered, gather the rest as it is fed (``feed``) and return None."""
        avail = len(self._buf) - self._pos
        if avail >= length:
            return finish(self._take(length))
        with memoryview(self._buf) as view:
            self._parts = [bytes(view[self._pos :])] if avail else []
        self._buf.clear()
        self._pos = 0
        self._have = avail
        self._need = length - avail
        self._finish = finish
        return None

    def _complete_payload(self) -> DataStreamItem:
        parts, finish = self._parts, self._finish
        assert finish is not None
        payload = parts[0] if len(parts) == 1 else b"".join(parts)
        self._parts = []
        self._have = 0
        self._finish = None
        return finish(payload)

    def _properties(self) -> Properties:
        length = self._vi()
        if length > self.max_object_size:
            raise LimitExceeded(f"object properties of {length} bytes exceed the limit")
        return decode_key_value_pairs(self._take(length))

    def _payload_length(self, group: int, object_id: int) -> int:
        length = self._vi()
        # Checked as the length arrives, so an oversized object is refused before any of it is buffered.
        limit = self.object_size_limits.get((group, object_id), self.max_object_size)
        if length > limit:
            raise LimitExceeded(
                f"object {group}/{object_id} of {length} bytes exceeds the limit of {limit}"
            )
        return length

    def _parse(self) -> DataStreamItem | None:
        if self._kind is None:
            return self._parse_header()
        if self._pos >= len(self._buf):
            return None
        if self._kind == STREAM_TYPE_FETCH_HEADER:
            return self._parse_fetch_object()
        if self._kind in (STREAM_TYPE_SETUP, STREAM_TYPE_PADDING):
            return None
        return self._parse_subgroup_object()

    def _parse_header(self) -> DataStreamItem:
        stream_type = self._vi()
        if stream_type == STREAM_TYPE_SETUP:
            self._kind = stream_type
            self._pos = 0  # the control message reader wants the SETUP type too
            return ControlStreamHeader()
        if stream_type == STREAM_TYPE_PADDING:
            rest = self.take_buffered()
            if rest.count(0) != len(rest):
                raise ProtocolViolation("padding stream with non-zero bytes")
            self._kind = stream_type
            return PaddingStreamHeader()
        if stream_type == STREAM_TYPE_FETCH_HEADER:
            header_f = FetchHeader(self._vi())
            self._kind = stream_type
            self.header = header_f
            return header_f
        if not is_subgroup_header_type(stream_type):
            raise ProtocolViolation(f"unknown stream type {stream_type:#x}")
        mode_bits = (stream_type & SUBGROUP_ID_MODE_MASK) >> 1
        if mode_bits == 0b11:
            raise ProtocolViolation(f"reserved SUBGROUP_ID_MODE in stream type {stream_type:#x}")
        mode = SubgroupIdMode(mode_bits)
        alias = self._vi()
        group = self._vi()
        subgroup: int | None = 0
        if mode == SubgroupIdMode.EXPLICIT:
            subgroup = self._vi()
        elif mode == SubgroupIdMode.FIRST_OBJECT_ID:
            subgroup = None
        priority = None if stream_type & SUBGROUP_DEFAULT_PRIORITY else self._u8()
        header = SubgroupHeader(
            alias,
            group,
            subgroup,
            mode,
            priority,
            bool(stream_type & SUBGROUP_PROPERTIES),
            bool(stream_type & SUBGROUP_END_OF_GROUP),
            bool(stream_type & SUBGROUP_FIRST_OBJECT),
        )
        self._kind = stream_type
        self.header = header
        self._subgroup_id = subgroup
        return header

    def _parse_subgroup_object(self) -> DataStreamItem | None:
        header = self.header
        assert isinstance(header, SubgroupHeader)
        delta = self._vi()
        object_id = delta if self._prev_object is None else self._prev_object + delta + 1
        if object_id > VI64_MAX:
            raise ProtocolViolation("object ID larger than 2^64-1")
        properties = self._properties() if header.has_properties else ()
        length = self._payload_length(header.group_id, object_id)
        status = ObjectStatus.NORMAL
        if length == 0:
            status = _to_status(self._vi())
            if properties and status != ObjectStatus.NORMAL:
                raise ProtocolViolation("properties on an object whose status is not Normal")

        def finish(payload: bytes) -> SubgroupObject:
            self._prev_object = object_id
            if self._subgroup_id is None:
                self._subgroup_id = object_id
            return SubgroupObject(object_id, payload, status, properties)

        return self._payload(length, finish)

    def _parse_fetch_object(self) -> DataStreamItem | None:
        flags = self._vi()
        if flags in (FETCH_END_OF_NON_EXISTENT_RANGE, FETCH_END_OF_UNKNOWN_RANGE):
            group = self._vi()
            obj = self._vi()
            self._f_group, self._f_object = group, obj
            return FetchEndOfRange(group, obj, flags == FETCH_END_OF_UNKNOWN_RANGE)
        if flags >= 0x80:
            raise ProtocolViolation(f"invalid fetch serialization flags {flags:#x}")
        first = self._f_group is None
        if first and not (flags & FETCH_GROUP_ID_PRESENT and flags & FETCH_OBJECT_ID_PRESENT):
            raise ProtocolViolation("first fetch object must carry Group ID and Object ID")
        group = self._f_group if self._f_group is not None else 0
        if flags & FETCH_GROUP_ID_PRESENT:
            gdelta = self._vi()
            if first:
                group = gdelta
            elif self.group_order == GroupOrder.ASCENDING:
                group = group + gdelta + 1
            else:
                group = group - gdelta - 1
            if group < 0 or group > VI64_MAX:
                raise ProtocolViolation("fetch group ID out of range")
        subgroup: int | None
        if flags & FETCH_DATAGRAM:
            subgroup = None
        else:
            mode = flags & FETCH_SUBGROUP_MASK
            if mode in (0x01, 0x02) and (not self._f_has_object or self._f_subgroup is None):
                raise ProtocolViolation("fetch object refers to a prior Subgroup ID that does not exist")
            if mode == 0x00:
                subgroup = 0
            elif mode == 0x01:
                subgroup = self._f_subgroup
            elif mode == 0x02:
                assert self._f_subgroup is not None
                subgroup = self._f_subgroup + 1
                if subgroup > VI64_MAX:
                    raise ProtocolViolation("fetch subgroup ID out of range")
            else:
                subgroup = self._vi()
        if flags & FETCH_OBJECT_ID_PRESENT:
            odelta = self._vi()
            obj = odelta if flags & FETCH_GROUP_ID_PRESENT else self._f_object + odelta
        else:
            obj = self._f_object + 1
        if obj > VI64_MAX:
            raise ProtocolViolation("fetch object ID out of range")
        if flags & FETCH_PRIORITY_PRESENT:
            priority = self._u8()
        elif not self._f_has_object:
            raise ProtocolViolation("fetch object refers to a prior priority that does not exist")
        else:
            priority = self._f_priority
        properties = self._properties() if flags & FETCH_PROPERTIES_PRESENT else ()
        length = self._payload_length(group, obj)

        def finish(payload: bytes) -> FetchObject:
            self._f_group, self._f_object = group, obj
            self._f_has_object = True
            self._f_subgroup = subgroup
            self._f_priority = priority
            return FetchObject(group, obj, subgroup, priority, payload, properties)

        return self._payload(length, finish)
