"""Tests for proto/messages.py: control message codec, parameters and the incremental reader."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proto.buffer import VI64_MAX, vi64_encode
from proto.errors import (
    KeyValueFormattingError,
    LimitExceeded,
    MalformedPath,
    ProtocolError,
    ProtocolViolation,
    RequestErrorCode,
    SessionErrorCode,
    UsageError,
)
from proto.messages import (
    MESSAGE_TYPES,
    AliasType,
    AuthToken,
    ControlMessage,
    ControlMessageReader,
    Fetch,
    FetchOk,
    FetchType,
    FilterType,
    Goaway,
    GroupOrder,
    JoiningFetch,
    KeyValuePair,
    Location,
    MessageParameters,
    Namespace,
    NamespaceDone,
    ParameterType,
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
    SubscriptionFilter,
    TrackStatus,
    decode_key_value_pairs,
    decode_message_payload,
    encode_key_value_pairs,
    encode_message,
)

# -- strategies --------------------------------------------------------------------------------

vi = st.integers(0, VI64_MAX)
small = st.integers(0, 1 << 20)
u8 = st.integers(0, 255)
namespaces = st.lists(st.binary(min_size=1, max_size=12), max_size=5).map(tuple)
names = st.binary(max_size=24)
locations = st.builds(Location, vi, vi)
reasons = st.text(max_size=40)


@st.composite
def key_value_pairs(draw: st.DrawFn) -> tuple[KeyValuePair, ...]:
    types = sorted(draw(st.lists(st.integers(0, 1 << 20), max_size=5)))
    pairs = []
    for t in types:
        value: int | bytes = draw(vi) if t % 2 == 0 else draw(st.binary(max_size=20))
        pairs.append(KeyValuePair(t, value))
    return tuple(pairs)


tokens = st.one_of(
    st.builds(AuthToken, st.just(AliasType.DELETE), vi),
    st.builds(AuthToken, st.just(AliasType.USE_ALIAS), vi),
    st.builds(AuthToken, st.just(AliasType.REGISTER), vi, vi, st.binary(max_size=20)),
    st.builds(AuthToken, st.just(AliasType.USE_VALUE), st.none(), vi, st.binary(max_size=20)),
)
filters = st.one_of(
    st.builds(SubscriptionFilter, st.sampled_from([FilterType.NEXT_GROUP_START, FilterType.LARGEST_OBJECT])),
    st.builds(SubscriptionFilter, st.just(FilterType.ABSOLUTE_START), locations),
    st.builds(
        SubscriptionFilter,
        st.just(FilterType.ABSOLUTE_RANGE),
        st.builds(Location, small, vi),
        small,
    ),
)

_PARAM_VALUES: dict[ParameterType, st.SearchStrategy[object]] = {
    ParameterType.OBJECT_DELIVERY_TIMEOUT: vi,
    ParameterType.AUTHORIZATION_TOKEN: st.lists(tokens, min_size=1, max_size=3).map(tuple),
    ParameterType.RENDEZVOUS_TIMEOUT: vi,
    ParameterType.SUBGROUP_DELIVERY_TIMEOUT: vi,
    ParameterType.EXPIRES: vi,
    ParameterType.LARGEST_OBJECT: locations,
    ParameterType.FILL_TIMEOUT: vi,
    ParameterType.FORWARD: st.integers(0, 1),
    ParameterType.SUBSCRIBER_PRIORITY: u8,
    ParameterType.SUBSCRIPTION_FILTER: filters,
    ParameterType.GROUP_ORDER: st.sampled_from(GroupOrder),
    ParameterType.NEW_GROUP_REQUEST: vi,
    ParameterType.TRACK_NAMESPACE_PREFIX: namespaces,
}
_FIELD = {
    ParameterType.OBJECT_DELIVERY_TIMEOUT: "object_delivery_timeout",
    ParameterType.AUTHORIZATION_TOKEN: "authorization_tokens",
    ParameterType.RENDEZVOUS_TIMEOUT: "rendezvous_timeout",
    ParameterType.SUBGROUP_DELIVERY_TIMEOUT: "subgroup_delivery_timeout",
    ParameterType.EXPIRES: "expires",
    ParameterType.LARGEST_OBJECT: "largest_object",
    ParameterType.FILL_TIMEOUT: "fill_timeout",
    ParameterType.FORWARD: "forward",
    ParameterType.SUBSCRIBER_PRIORITY: "subscriber_priority",
    ParameterType.SUBSCRIPTION_FILTER: "subscription_filter",
    ParameterType.GROUP_ORDER: "group_order",
    ParameterType.NEW_GROUP_REQUEST: "new_group_request",
    ParameterType.TRACK_NAMESPACE_PREFIX: "track_namespace_prefix",
}


def params_for(cls: type[ControlMessage]) -> st.SearchStrategy[MessageParameters]:
    allowed = sorted(cls.ALLOWED_PARAMETERS)
    if not allowed:
        return st.just(MessageParameters())
    return st.fixed_dictionaries(
        {}, optional={_FIELD[p]: _PARAM_VALUES[p] for p in allowed}
    ).map(lambda kw: MessageParameters(**kw))  # type: ignore[arg-type]


setup_msgs = st.builds(
    Setup,
    st.none() | st.text(alphabet="abc/?=", max_size=10),
    st.none() | st.text(alphabet="abc.:1", max_size=10),
    st.none() | vi,
    st.lists(tokens, max_size=2).map(tuple),
    st.none() | st.binary(max_size=10),
    key_value_pairs().map(lambda kvs: tuple(kv for kv in kvs if kv.type not in (1, 3, 4, 5, 7))),
)
fetches = st.one_of(
    st.builds(
        Fetch, vi, st.just(FetchType.STANDALONE),
        st.builds(StandaloneFetch, namespaces, names, locations, locations), st.none(), params_for(Fetch),
    ),
    st.builds(
        Fetch, vi, st.sampled_from([FetchType.RELATIVE_JOINING, FetchType.ABSOLUTE_JOINING]),
        st.none(), st.builds(JoiningFetch, vi, vi), params_for(Fetch),
    ),
)  # fmt: skip
request_errors = st.one_of(
    st.builds(RequestError, vi.filter(lambda c: c != RequestErrorCode.REDIRECT), vi, reasons),
    st.builds(
        RequestError, st.just(int(RequestErrorCode.REDIRECT)), vi, reasons,
        st.builds(Redirect, st.binary(max_size=20), namespaces, names),
    ),
)  # fmt: skip

messages: st.SearchStrategy[ControlMessage] = st.one_of(
    setup_msgs,
    st.builds(Goaway, st.binary(max_size=30), vi, st.none() | vi),
    st.builds(Subscribe, vi, namespaces, names, params_for(Subscribe)),
    st.builds(SubscribeOk, vi, params_for(SubscribeOk), key_value_pairs()),
    st.builds(Publish, vi, namespaces, names, vi, params_for(Publish), key_value_pairs()),
    st.builds(PublishOk, params_for(PublishOk)),
    st.builds(PublishDone, vi, vi, reasons),
    fetches,
    st.builds(FetchOk, st.booleans(), locations, st.just(MessageParameters()), key_value_pairs()),
    st.builds(TrackStatus, vi, namespaces, names, params_for(TrackStatus)),
    st.builds(PublishNamespace, vi, namespaces, params_for(PublishNamespace)),
    st.builds(SubscribeNamespace, vi, namespaces, params_for(SubscribeNamespace)),
    st.builds(SubscribeTracks, vi, namespaces, params_for(SubscribeTracks)),
    st.builds(Namespace, namespaces),
    st.builds(NamespaceDone, namespaces),
    st.builds(PublishBlocked, namespaces, names),
    st.builds(RequestUpdate, vi, params_for(RequestUpdate)),
    st.builds(RequestOk, params_for(RequestOk), key_value_pairs()),
    request_errors,
)


def frame(msg_type: int, payload: bytes) -> bytes:
    return vi64_encode(msg_type) + len(payload).to_bytes(2, "big") + payload


def decode_one(data: bytes) -> ControlMessage:
    reader = ControlMessageReader()
    reader.feed(data)
    msg = reader.next_message()
    assert msg is not None
    assert reader.at_boundary()
    return msg


# -- round trips -------------------------------------------------------------------------------


def test_every_message_type_is_covered() -> None:
    assert set(MESSAGE_TYPES) == {
        0x2F00, 0x10, 0x3, 0x4, 0x1D, 0x1E, 0xB, 0x16, 0x18, 0xD,
        0x6, 0x50, 0x51, 0x8, 0xE, 0xF, 0x2, 0x7, 0x5,
    }  # fmt: skip


@settings(max_examples=400)
@given(messages)
def test_round_trip(msg: ControlMessage) -> None:
    data = encode_message(msg)
    assert decode_one(data) == msg


@settings(max_examples=100)
@given(st.lists(messages, min_size=1, max_size=4), st.data())
def test_reader_arbitrary_fragmentation(msgs: list[ControlMessage], data: st.DataObject) -> None:
    stream = b"".join(encode_message(m) for m in msgs)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    reader = ControlMessageReader()
    got: list[ControlMessage] = []
    prev = 0
    for cut in [*cuts, len(stream)]:
        reader.feed(stream[prev:cut])
        prev = cut
        while (m := reader.next_message()) is not None:
            got.append(m)
    assert got == msgs
    assert reader.at_boundary()


def test_reader_one_byte_at_a_time() -> None:
    msg = Subscribe(4, (b"kvnet", b"fp"), b"block", MessageParameters(forward=1, subscriber_priority=3))
    data = encode_message(msg) * 2
    reader = ControlMessageReader()
    got = []
    for i in range(len(data)):
        reader.feed(data[i : i + 1])
        m = reader.next_message()
        if m is not None:
            got.append(m)
    assert got == [msg, msg]


def test_has_message_reads_vi64_framing() -> None:
    # SUBSCRIBE_NAMESPACE (0x50) and SUBSCRIBE_TRACKS (0x51): a one-byte vi64 type that a QUIC varint
    # would read as two bytes (and so take the Length from the wrong place).
    for msg in (SubscribeNamespace(2, (b"kvnet",)), SubscribeTracks(4, (b"kvnet",))):
        data = encode_message(msg)
        assert data[0] >= 0x40 and len(data) < 64
        reader = ControlMessageReader()
        for i in range(len(data)):
            assert not reader.has_message()
            reader.feed(data[i : i + 1])
        assert reader.has_message()
        assert reader.buffered == len(data)  # nothing consumed
        assert reader.next_message() == msg and not reader.has_message()


# -- framing errors ----------------------------------------------------------------------------


def test_unknown_type_is_protocol_violation_before_payload() -> None:
    reader = ControlMessageReader()
    reader.feed(vi64_encode(0x20))  # reserved CLIENT_SETUP of older drafts
    with pytest.raises(ProtocolViolation) as info:
        reader.next_message()
    assert info.value.error_code == SessionErrorCode.PROTOCOL_VIOLATION


def test_length_mismatch() -> None:
    payload = encode_message(PublishDone(2, 0, "bye"))[3:]
    with pytest.raises(ProtocolViolation):
        decode_message_payload(0xB, payload[:-1])  # shorter than its fields
    with pytest.raises(ProtocolViolation):
        decode_message_payload(0xB, payload + b"\x00")  # trailing bytes


def test_reader_buffer_limit() -> None:
    reader = ControlMessageReader(max_buffer=70_000)
    reader.feed(b"\x03\xff\xff" + bytes(60_000))
    with pytest.raises(LimitExceeded):
        reader.feed(bytes(20_000))


def test_encode_too_large_is_usage_error() -> None:
    big = tuple(KeyValuePair(1, bytes(60_000)) for _ in range(2))
    with pytest.raises(UsageError):
        encode_message(SubscribeOk(1, track_properties=big))


# -- parameters --------------------------------------------------------------------------------


def _subscribe_payload(params: bytes) -> bytes:
    # Request ID 0, namespace ("a"), name "b", then the given parameter block.
    return b"\x00" + b"\x01\x01a" + b"\x01b" + params


def test_parameter_wire_format() -> None:
    params = MessageParameters(
        authorization_tokens=(AuthToken(AliasType.USE_VALUE, None, 0, b"t"),),
        forward=0,
        subscriber_priority=9,
        group_order=GroupOrder.ASCENDING,
    )
    payload = encode_message(Subscribe(0, (b"a",), b"b", params))[3:]
    assert payload == _subscribe_payload(
        bytes.fromhex("04")  # 4 parameters
        + bytes.fromhex("03 03 03 00 74")  # delta 3: AUTHORIZATION_TOKEN, len 3, USE_VALUE, type 0, "t"
        + bytes.fromhex("0d 00")  # delta 13: FORWARD (0x10) uint8 0
        + bytes.fromhex("10 09")  # delta 16: SUBSCRIBER_PRIORITY (0x20) uint8 9
        + bytes.fromhex("02 01")  # delta 2: GROUP_ORDER (0x22) uint8 1
    )


@pytest.mark.parametrize(
    ("params", "error"),
    [
        (bytes.fromhex("01 7f 00"), ProtocolViolation),  # unknown parameter 0x7f
        (bytes.fromhex("02 20 01 00 02"), ProtocolViolation),  # SUBSCRIBER_PRIORITY twice
        (bytes.fromhex("01 08 05"), ProtocolViolation),  # EXPIRES is not allowed in SUBSCRIBE
        (bytes.fromhex("01 10 02"), ProtocolViolation),  # FORWARD 2
        (bytes.fromhex("01 22 03"), ProtocolViolation),  # GROUP_ORDER 3
        (bytes.fromhex("01 21 01 09"), ProtocolViolation),  # unknown filter type
        (bytes.fromhex("01 21 02 03 00"), ProtocolViolation),  # truncated AbsoluteStart filter
        (bytes.fromhex("01 03 01 07"), KeyValueFormattingError),  # token alias type 7
        (bytes.fromhex("01 03 01 01"), KeyValueFormattingError),  # REGISTER without alias/type
        (bytes.fromhex("01 03 03 00 05 ff"), KeyValueFormattingError),  # DELETE with trailing bytes
        (bytes.fromhex("05 20 01"), ProtocolViolation),  # count larger than what remains
    ],
)
def test_bad_parameters(params: bytes, error: type[ProtocolError]) -> None:
    with pytest.raises(error):
        decode_message_payload(Subscribe.TYPE, _subscribe_payload(params))


def test_repeated_authorization_tokens_allowed() -> None:
    toks = (AuthToken(AliasType.REGISTER, 1, 0, b"x"), AuthToken(AliasType.USE_ALIAS, 1))
    msg = TrackStatus(2, (b"a",), b"b", MessageParameters(authorization_tokens=toks))
    assert decode_one(encode_message(msg)) == msg


def test_disallowed_parameter_on_encode() -> None:
    with pytest.raises(UsageError):
        encode_message(Subscribe(0, (), b"", MessageParameters(expires=5)))
    with pytest.raises(UsageError):
        encode_message(FetchOk(False, Location(1, 1), MessageParameters(expires=5)))
    with pytest.raises(UsageError):
        encode_message(Subscribe(0, (), b"", MessageParameters(forward=3)))


def test_filter_end_group_overflow() -> None:
    # AbsoluteRange start group 2^64-1 plus End Group Delta 1 overflows (section "Subscription Filters").
    flt = bytes.fromhex("04") + vi64_encode(VI64_MAX) + b"\x00\x01"
    params = b"\x01\x21" + vi64_encode(len(flt)) + flt
    with pytest.raises(ProtocolViolation):
        decode_message_payload(Subscribe.TYPE, _subscribe_payload(params))


# -- track names and other structures ----------------------------------------------------------


def test_namespace_limits() -> None:
    ok = tuple(bytes([i + 1]) for i in range(32))
    assert decode_one(encode_message(Namespace(ok))) == Namespace(ok)
    with pytest.raises(UsageError):
        encode_message(Namespace((*ok, b"x")))
    with pytest.raises(ProtocolViolation):
        decode_message_payload(Namespace.TYPE, b"\x21" + b"\x01x" * 33)
    with pytest.raises(ProtocolViolation):
        decode_message_payload(Namespace.TYPE, b"\x01\x00")  # empty field
    with pytest.raises(UsageError):
        encode_message(Namespace((b"",)))
    # Full Track Name over 4096 bytes: namespace 4000 + name 100.
    with pytest.raises(UsageError):
        encode_message(PublishBlocked((bytes(4000),), bytes(100)))
    payload = b"\x01" + vi64_encode(4000) + bytes(4000) + vi64_encode(100) + bytes(100)
    with pytest.raises(ProtocolViolation):
        decode_message_payload(PublishBlocked.TYPE, payload)
    blocked = decode_one(encode_message(PublishBlocked((bytes(4000),), bytes(96))))
    assert isinstance(blocked, PublishBlocked)
    assert blocked.track_name == bytes(96)


def test_reason_phrase_limit() -> None:
    assert decode_one(encode_message(PublishDone(0, 0, "x" * 1024))) == PublishDone(0, 0, "x" * 1024)
    with pytest.raises(UsageError):
        encode_message(PublishDone(0, 0, "x" * 1025))
    with pytest.raises(ProtocolViolation):
        decode_message_payload(PublishDone.TYPE, b"\x00\x00" + vi64_encode(1025) + bytes(1025))
    with pytest.raises(ProtocolViolation):
        decode_message_payload(PublishDone.TYPE, b"\x00\x00\x02\xff\xfe")  # not UTF-8


def test_key_value_pairs() -> None:
    kvs = (KeyValuePair(4, 2186796243), KeyValuePair(77, b"traceID:123456"), KeyValuePair(77, b"again"))
    data = encode_key_value_pairs(kvs)
    assert decode_key_value_pairs(data) == kvs
    with pytest.raises(UsageError):
        encode_key_value_pairs((KeyValuePair(5, 1),))  # odd type needs bytes
    with pytest.raises(UsageError):
        encode_key_value_pairs((KeyValuePair(4, b"x"),))  # even type needs an int
    with pytest.raises(UsageError):
        encode_key_value_pairs((KeyValuePair(6, 1), KeyValuePair(4, 1)))  # descending
    with pytest.raises(ProtocolViolation):
        decode_key_value_pairs(b"\x01" + vi64_encode(0x10000) + bytes(0x10000))  # length > 2^16-1
    with pytest.raises(ProtocolViolation):
        decode_key_value_pairs(b"\x01\x05ab")  # truncated value
    with pytest.raises(ProtocolViolation):
        decode_key_value_pairs(vi64_encode(VI64_MAX) + b"\x00" + b"\x02\x00")  # type overflow


def test_setup_options() -> None:
    msg = Setup(
        path="/kv?x=1",
        authority="relay.example:443",
        max_auth_token_cache_size=4096,
        authorization_tokens=(AuthToken(AliasType.USE_VALUE, None, 0, b"secret"),),
        implementation=b"kvnet/0.1",
        unknown_options=(KeyValuePair(0x9D, b"grease"), KeyValuePair(0x9D + 0x7F * 2 - 1, 5)),
    )
    assert decode_one(encode_message(msg)) == msg
    # Unknown options may repeat; known ones (other than the token) may not.
    dup_unknown = b"\x3b\x01a\x00\x01b"  # type 0x3b twice
    assert decode_message_payload(Setup.TYPE, dup_unknown) == Setup(
        unknown_options=(KeyValuePair(0x3B, b"a"), KeyValuePair(0x3B, b"b"))
    )
    with pytest.raises(ProtocolViolation):
        decode_message_payload(Setup.TYPE, b"\x01\x01a\x00\x01b")  # PATH twice
    with pytest.raises(MalformedPath):
        decode_message_payload(Setup.TYPE, b"\x01\x01\xff")
    with pytest.raises(KeyValueFormattingError):
        decode_message_payload(Setup.TYPE, b"\x03\x01\x09")  # bad token structure
    with pytest.raises(UsageError):
        encode_message(Setup(unknown_options=(KeyValuePair(1, b"/"),)))  # PATH belongs in its field


def test_goaway_request_id_optional() -> None:
    on_request_stream = Goaway(b"", 100)
    on_control_stream = Goaway(b"moqt://other", 0, 7)
    assert encode_message(on_request_stream)[3:] == b"\x00\x64"
    assert decode_one(encode_message(on_control_stream)) == on_control_stream
    with pytest.raises(ProtocolViolation):
        decode_message_payload(Goaway.TYPE, vi64_encode(8193) + bytes(8193) + b"\x00")
    with pytest.raises(UsageError):
        encode_message(Goaway(bytes(8193)))


def test_fetch_type_and_ok_values() -> None:
    with pytest.raises(ProtocolViolation):
        decode_message_payload(Fetch.TYPE, b"\x00\x04\x00\x00\x00")  # fetch type 4
    with pytest.raises(ProtocolViolation):
        decode_message_payload(FetchOk.TYPE, b"\x02\x00\x00\x00")  # End Of Track 2
    with pytest.raises(UsageError):
        encode_message(Fetch(0, FetchType.STANDALONE, joining=JoiningFetch(1, 1)))


def test_publish_ok_rejects_properties_and_request_error_redirect() -> None:
    with pytest.raises(ProtocolViolation):
        decode_message_payload(PublishOk.TYPE, b"\x00\x02\x01")
    with pytest.raises(UsageError):
        encode_message(RequestError(RequestErrorCode.REDIRECT, 0, "x"))
    with pytest.raises(UsageError):
        encode_message(RequestError(RequestErrorCode.DOES_NOT_EXIST, 0, "x", Redirect()))
    redirect = RequestError(RequestErrorCode.REDIRECT, 1000, "moved", Redirect(b"moqt://b", (b"ns",), b"t"))
    assert decode_one(encode_message(redirect)) == redirect


# -- arbitrary input ---------------------------------------------------------------------------


@settings(max_examples=300)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_only_protocol_errors(data: bytes) -> None:
    for chunks in ([data], [data[i : i + 1] for i in range(len(data))]):
        reader = ControlMessageReader()
        try:
            for chunk in chunks:
                reader.feed(chunk)
                while reader.next_message() is not None:
                    pass
        except ProtocolError:
            pass


@settings(max_examples=300)
@given(st.sampled_from(sorted(MESSAGE_TYPES)), st.binary(max_size=120))
def test_arbitrary_payloads_only_protocol_errors(msg_type: int, payload: bytes) -> None:
    try:
        msg = decode_message_payload(msg_type, payload)
    except ProtocolError:
        return
    assert isinstance(msg, MESSAGE_TYPES[msg_type])
