"""Tests for proto/data.py: subgroup and fetch streams, datagrams, padding, the stream reader."""

from __future__ import annotations

import contextlib
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proto.buffer import VI64_MAX, vi64_encode
from proto.data import (
    ControlStreamHeader,
    DataStreamItem,
    DataStreamReader,
    FetchEndOfRange,
    FetchHeader,
    FetchObject,
    FetchObjectEncoder,
    ObjectDatagram,
    ObjectStatus,
    PaddingDatagram,
    PaddingStreamHeader,
    StreamEnd,
    SubgroupHeader,
    SubgroupIdMode,
    SubgroupObject,
    decode_datagram,
    encode_datagram,
    encode_fetch_header,
    encode_padding_datagram,
    encode_padding_stream,
    encode_subgroup_header,
    encode_subgroup_object,
    is_subgroup_header_type,
)
from proto.errors import LimitExceeded, ProtocolError, ProtocolViolation, StreamTruncated, UsageError
from proto.messages import GroupOrder, KeyValuePair, Setup, encode_message

vi = st.integers(0, VI64_MAX)
u8 = st.integers(0, 255)


@st.composite
def props(draw: st.DrawFn, min_size: int = 0) -> tuple[KeyValuePair, ...]:
    types = sorted(draw(st.lists(st.integers(0, 300), min_size=min_size, max_size=3)))
    return tuple(
        KeyValuePair(t, draw(vi) if t % 2 == 0 else draw(st.binary(max_size=8))) for t in types
    )


def read_all(data: bytes, one_byte: bool = False, **kw: object) -> list[DataStreamItem]:
    reader = DataStreamReader(**kw)  # type: ignore[arg-type]
    items: list[DataStreamItem] = []
    chunks = [data[i : i + 1] for i in range(len(data))] if one_byte else [data]
    for i, chunk in enumerate(chunks):
        reader.feed(chunk, end_stream=i == len(chunks) - 1)
        while (item := reader.next_item()) is not None:
            items.append(item)
    if not chunks:
        reader.feed(b"", end_stream=True)
        while (item := reader.next_item()) is not None:
            items.append(item)
    return items


# -- subgroup streams --------------------------------------------------------------------------


@st.composite
def subgroup_streams(draw: st.DrawFn) -> tuple[SubgroupHeader, list[SubgroupObject]]:
    mode = draw(st.sampled_from(SubgroupIdMode))
    sub_id = {SubgroupIdMode.ZERO: 0, SubgroupIdMode.FIRST_OBJECT_ID: None}.get(mode, draw(vi))
    has_props = draw(st.booleans())
    priority = draw(st.none() | u8)
    header = SubgroupHeader(
        draw(vi), draw(vi), sub_id, mode, priority, has_props, draw(st.booleans()), draw(st.booleans())
    )
    ids = sorted(set(draw(st.lists(st.integers(0, 1 << 40), max_size=5))))
    objects = []
    for oid in ids:
        status = draw(st.sampled_from(ObjectStatus))
        if status == ObjectStatus.NORMAL:
            payload = draw(st.binary(max_size=30))
            properties = draw(props()) if has_props else ()
        else:
            payload, properties = b"", ()
        objects.append(SubgroupObject(oid, payload, status, properties))
    return header, objects


def encode_subgroup_stream(header: SubgroupHeader, objects: list[SubgroupObject]) -> bytes:
    out = encode_subgroup_header(header)
    prev = None
    for obj in objects:
        out += encode_subgroup_object(header, obj, prev)
        prev = obj.object_id
    return out


@settings(max_examples=200)
@given(subgroup_streams(), st.booleans())
def test_subgroup_round_trip(stream: tuple[SubgroupHeader, list[SubgroupObject]], one_byte: bool) -> None:
    header, objects = stream
    items = read_all(encode_subgroup_stream(header, objects), one_byte)
    assert items == [header, *objects, StreamEnd()]


def test_subgroup_first_object_mode_resolves_id() -> None:
    header = SubgroupHeader(1, 2, None, SubgroupIdMode.FIRST_OBJECT_ID, 0)
    data = encode_subgroup_stream(header, [SubgroupObject(5, b"a"), SubgroupObject(6, b"b")])
    reader = DataStreamReader()
    reader.feed(data)
    assert reader.next_item() == header
    assert reader.subgroup_id is None
    assert reader.next_item() == SubgroupObject(5, b"a")
    assert reader.subgroup_id == 5


def test_subgroup_header_types() -> None:
    valid = [t for t in range(0x100) if is_subgroup_header_type(t) and (t & 0x06) != 0x06]
    assert len(valid) == 48  # 8 ranges of 6 valid values (section "Subgroup Header")
    for t in range(0x80):
        reader = DataStreamReader()
        reader.feed(vi64_encode(t) + b"\x01\x02\x03\x04")
        if t in valid:
            assert isinstance(reader.next_item(), SubgroupHeader)
        elif t != 0x05:
            with pytest.raises(ProtocolViolation):
                reader.next_item()
    for header in (
        SubgroupHeader(1, 2, 0, SubgroupIdMode.ZERO, None, True, True, True),
        SubgroupHeader(1, 2, 9, SubgroupIdMode.EXPLICIT, 7),
    ):
        assert header.stream_type in valid


def test_subgroup_object_errors() -> None:
    header = SubgroupHeader(1, 0, 0, SubgroupIdMode.ZERO, None, has_properties=True)
    head = encode_subgroup_header(header)
    with pytest.raises(ProtocolViolation):  # status 5 is unknown
        read_all(head + b"\x00\x00\x00\x05")
    with pytest.raises(ProtocolViolation):  # END_OF_GROUP with properties
        read_all(head + b"\x00\x02\x04\x01\x00\x03")
    with pytest.raises(ProtocolViolation):  # object ID overflow
        read_all(head + b"\x00\x00\x01a" + vi64_encode(VI64_MAX) + b"\x00\x01b")
    with pytest.raises(StreamTruncated):  # FIN inside the payload
        read_all(head + b"\x00\x00\x05abc")
    with pytest.raises(StreamTruncated):  # FIN inside the header
        read_all(head[:-1])
    with pytest.raises(StreamTruncated):
        read_all(b"")
    with pytest.raises(LimitExceeded):
        read_all(head + b"\x00\x00" + vi64_encode(1 << 30), max_object_size=1 << 20)
    with pytest.raises(UsageError):
        encode_subgroup_object(header, SubgroupObject(0, b"x", ObjectStatus.END_OF_GROUP), None)
    with pytest.raises(UsageError):
        encode_subgroup_object(header, SubgroupObject(1), 1)  # IDs must increase
    with pytest.raises(UsageError):
        encode_subgroup_header(SubgroupHeader(1, 0, 3, SubgroupIdMode.ZERO))


def test_a_location_limit_refuses_its_object_as_the_length_arrives() -> None:
    """``object_size_limits`` bounds the objects at given locations below ``max_object_size``, on subgroup
    and fetch streams alike, before any payload byte is buffered; other objects keep the stream's limit."""
    limits = {(2, 0): 100}
    header = SubgroupHeader(7, 2, 0, SubgroupIdMode.ZERO, 0)  # track alias 7, group 2
    head = encode_subgroup_header(header)
    small = encode_subgroup_stream(header, [SubgroupObject(0, b"m" * 100), SubgroupObject(1, b"x" * 5000)])
    assert read_all(small, object_size_limits=limits)[1:3] == [
        SubgroupObject(0, b"m" * 100), SubgroupObject(1, b"x" * 5000)
    ]
    reader = DataStreamReader(object_size_limits=limits)
    reader.feed(head + b"\x00" + vi64_encode(15 << 20), end_stream=False)  # only the length, no payload yet
    assert reader.next_item() == header
    with pytest.raises(LimitExceeded, match="object 2/0 of 15728640 bytes exceeds the limit of 100"):
        reader.next_item()
    enc = FetchObjectEncoder(GroupOrder.ASCENDING)
    fetch = encode_fetch_header(FetchHeader(1)) + enc.encode(FetchObject(2, 0, 0, 0, b"m" * 101))
    with pytest.raises(LimitExceeded):
        read_all(fetch, object_size_limits=limits)
    other = encode_fetch_header(FetchHeader(1)) + FetchObjectEncoder(GroupOrder.ASCENDING).encode(
        FetchObject(3, 0, 0, 0, b"m" * 101)
    )
    assert read_all(other, object_size_limits=limits)[1].payload == b"m" * 101  # type: ignore[union-attr]


def test_large_payload_small_chunks_is_linear() -> None:
    header = SubgroupHeader(1, 0, 0, SubgroupIdMode.ZERO, 0)
    payload = bytes(range(256)) * (8 << 12)  # 8 MiB
    data = encode_subgroup_stream(header, [SubgroupObject(0, payload), SubgroupObject(1, b"tail")])
    reader = DataStreamReader()
    got: list[DataStreamItem] = []
    start = time.perf_counter()
    for i in range(0, len(data), 1200):
        reader.feed(data[i : i + 1200], end_stream=i + 1200 >= len(data))
        while (item := reader.next_item()) is not None:
            got.append(item)
    elapsed = time.perf_counter() - start
    assert got == [header, SubgroupObject(0, payload), SubgroupObject(1, b"tail"), StreamEnd()]
    assert elapsed < 10.0  # quadratic buffering would take minutes here


# -- fetch streams -----------------------------------------------------------------------------


@st.composite
def fetch_streams(draw: st.DrawFn) -> tuple[GroupOrder, list[FetchObject | FetchEndOfRange]]:
    order = draw(st.sampled_from(GroupOrder))
    groups = sorted(set(draw(st.lists(st.integers(0, 1 << 30), min_size=1, max_size=4))))
    if order == GroupOrder.DESCENDING:
        groups.reverse()
    items: list[FetchObject | FetchEndOfRange] = []
    for group in groups:
        oid = draw(st.integers(0, 5))
        for _ in range(draw(st.integers(1, 4))):
            if items and draw(st.integers(0, 5)) == 0:
                items.append(FetchEndOfRange(group, oid, draw(st.booleans())))
            else:
                subgroup = draw(st.none() | st.integers(0, 4))
                payload = draw(st.binary(max_size=10))
                items.append(FetchObject(group, oid, subgroup, draw(u8), payload, draw(props())))
            oid += draw(st.integers(1, 3))
    return order, items


@settings(max_examples=200)
@given(fetch_streams(), st.integers(0, VI64_MAX), st.booleans())
def test_fetch_round_trip(
    stream: tuple[GroupOrder, list[FetchObject | FetchEndOfRange]], request_id: int, one_byte: bool
) -> None:
    order, items = stream
    enc = FetchObjectEncoder(order)
    data = encode_fetch_header(FetchHeader(request_id)) + b"".join(enc.encode(i) for i in items)
    got = read_all(data, one_byte, group_order=order)
    assert got == [FetchHeader(request_id), *items, StreamEnd()]


@pytest.mark.parametrize(
    ("objects", "why"),
    [
        (b"\x00\x00", "first object without Group ID / Object ID"),
        (b"\x0d\x01\x02\x00", "first object referring to prior subgroup"),
        (b"\x0c\x01\x02\x00", "first object without priority"),
        (b"\x80", "flags >= 128 other than the End of Range values"),
        (b"\x8c\x01\x01\x01\x00", "after End of Range there is no prior subgroup"),
        (b"\x1c\x01\x02\x07\x00\x08\x01\x00", "descending group below zero"),
    ],
)
def test_fetch_object_errors(objects: bytes, why: str) -> None:
    order = GroupOrder.DESCENDING if "descending" in why else GroupOrder.ASCENDING
    with pytest.raises(ProtocolViolation):
        read_all(encode_fetch_header(FetchHeader(1)) + objects, group_order=order)


# -- datagrams ---------------------------------------------------------------------------------


@st.composite
def datagrams(draw: st.DrawFn) -> ObjectDatagram:
    status = draw(st.none() | st.sampled_from(ObjectStatus))
    properties = draw(props()) if status in (None, ObjectStatus.NORMAL) else ()
    payload = draw(st.binary(max_size=40)) if status is None else b""
    eog = draw(st.booleans()) if status is None else False
    object_id = draw(vi | st.just(0))
    priority = draw(st.none() | u8)
    return ObjectDatagram(draw(vi), draw(vi), object_id, priority, payload, status, properties, eog)


@settings(max_examples=300)
@given(datagrams())
def test_datagram_round_trip(dgram: ObjectDatagram) -> None:
    assert decode_datagram(encode_datagram(dgram)) == dgram


def test_datagram_types() -> None:
    for t in range(0x40):
        body = vi64_encode(t) + b"\x01\x02\x03\x04\x00"
        valid = t <= 0x2F and not t & 0x10 and not (t & 0x20 and t & 0x02)
        if valid:
            try:
                decode_datagram(body)
            except ProtocolViolation as exc:  # a valid type may still have an invalid body
                assert "type" not in exc.reason
        else:
            with pytest.raises(ProtocolViolation):
                decode_datagram(body)
    with pytest.raises(ProtocolViolation):  # PROPERTIES bit with empty properties
        decode_datagram(b"\x01\x01\x02\x03\x04\x00")
    with pytest.raises(ProtocolViolation):  # status END_OF_TRACK with properties
        decode_datagram(b"\x21\x01\x02\x03\x04\x02\x02\x01\x04")
    assert decode_datagram(encode_padding_datagram(5)) == PaddingDatagram(5)
    with pytest.raises(ProtocolViolation):
        decode_datagram(encode_padding_datagram(2) + b"\x01")


# -- other stream types ------------------------------------------------------------------------


def test_padding_and_control_streams() -> None:
    assert read_all(encode_padding_stream(100), one_byte=True) == [PaddingStreamHeader(), StreamEnd()]
    with pytest.raises(ProtocolViolation):
        read_all(encode_padding_stream(3) + b"\x07")
    setup = encode_message(Setup(path="/"))
    reader = DataStreamReader()
    reader.feed(setup)
    assert reader.next_item() == ControlStreamHeader()
    assert reader.take_buffered() == setup
    with pytest.raises(ProtocolViolation):
        read_all(vi64_encode(0x06) + b"\x00")  # unknown stream type


@settings(max_examples=300)
@given(st.binary(max_size=120), st.sampled_from(GroupOrder))
def test_arbitrary_stream_bytes_only_protocol_errors(data: bytes, order: GroupOrder) -> None:
    for one_byte in (False, True):
        with contextlib.suppress(ProtocolError):
            read_all(data, one_byte, group_order=order, max_object_size=1 << 16)
    with contextlib.suppress(ProtocolError):
        decode_datagram(data)
