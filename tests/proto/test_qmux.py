"""QMux (proto.qmux_connection and its parts) against the draft's MUSTs, and two endpoints in memory."""

from __future__ import annotations

import random

import pytest

from proto import qmux_frames as qf
from proto.qmux_connection import QMuxConfiguration, QMuxConnection, _tls_aligned
from proto.qmux_events import (
    ConnectionTerminated,
    DatagramFrameReceived,
    HandshakeCompleted,
    PingAcknowledged,
    QMuxEvent,
    StopSendingReceived,
    StreamDataReceived,
    StreamReset,
)
from proto.qmux_frames import (
    QMuxErrorCode,
    QMuxUsageError,
    TransportParameters,
    decode_transport_parameters,
    decode_varint,
    encode_frame,
    encode_transport_parameters,
    encode_varint,
)

NOW = 100.0
PV = QMuxErrorCode.PROTOCOL_VIOLATION
FEE = QMuxErrorCode.FRAME_ENCODING_ERROR


# ---------------------------------------------------------------- helpers


def record(*frames: bytes) -> bytes:
    body = b"".join(frames)
    return encode_varint(len(body)) + body


def tp_frame(params: TransportParameters | None = None, raw: bytes | None = None) -> bytes:
    payload = raw if raw is not None else encode_transport_parameters(params or TransportParameters(
        initial_max_data=1 << 20, initial_max_stream_data_bidi_local=1 << 16,
        initial_max_stream_data_bidi_remote=1 << 16, initial_max_stream_data_uni=1 << 16,
        initial_max_streams_bidi=10, initial_max_streams_uni=10,
    ))
    return encode_varint(qf.QX_TRANSPORT_PARAMETERS) + encode_varint(len(payload)) + payload


def stream_frame(stream_id: int, data: bytes, offset: int = 0, fin: bool = False) -> bytes:
    return qf.stream_frame_header(stream_id, offset, len(data), fin) + data


def server(**config: object) -> QMuxConnection:
    """A server that has received a client's parameters (client streams 0, 4, ... and 2, 6, ...)."""
    defaults: dict[str, object] = dict(max_data=1000, max_stream_data_bidi_remote=500,
                                       max_stream_data_uni=500, max_streams_bidi=2, max_streams_uni=2)
    defaults.update(config)
    conn = QMuxConnection(QMuxConfiguration(is_client=False, **defaults))  # type: ignore[arg-type]
    conn.connection_made(NOW, "test")
    conn.receive_data(record(tp_frame()), NOW)
    assert conn.close_event is None
    return conn


def events(conn: QMuxConnection) -> list[QMuxEvent]:
    return list(iter(conn.next_event, None))


def closed_with(conn: QMuxConnection) -> tuple[int, int | None]:
    ev = conn.close_event
    assert ev is not None, "connection still open"
    return ev.error_code, ev.frame_type


def parse_records(data: bytes) -> list[bytes]:
    out, pos = [], 0
    while pos < len(data):
        size, pos = decode_varint(data, pos, len(data))
        out.append(data[pos : pos + size])
        pos += size
    assert pos == len(data)
    return out


def pair(client_config: dict[str, object] | None = None, server_config: dict[str, object] | None = None
         ) -> tuple[QMuxConnection, QMuxConnection]:
    c = QMuxConnection(QMuxConfiguration(is_client=True, **(client_config or {})))  # type: ignore[arg-type]
    s = QMuxConnection(QMuxConfiguration(is_client=False, **(server_config or {})))  # type: ignore[arg-type]
    c.connection_made(NOW, "moqt")
    s.connection_made(NOW, "moqt")
    return c, s


def exchange(a: QMuxConnection, b: QMuxConnection, rng: random.Random | None = None, rounds: int = 10_000,
             chunk: int | None = None) -> None:
    """Move bytes both ways until neither side has any, optionally in random splits, ``chunk`` per send."""
    for _ in range(rounds):
        moved = False
        for src, dst in ((a, b), (b, a)):
            data = src.data_to_send(NOW, chunk)
            if not data:
                continue
            moved = True
            if rng is None:
                dst.receive_data(data, NOW)
            else:
                pos = 0
                while pos < len(data):
                    n = rng.choice((1, 2, 3, 7, 100, 5000, 70000))
                    dst.receive_data(memoryview(data)[pos : pos + n], NOW)
                    pos += n
        if not moved:
            return
    raise AssertionError("exchange did not settle")


def stream_bytes(evs: list[QMuxEvent]) -> dict[int, tuple[bytes, bool]]:
    got: dict[int, tuple[bytes, bool]] = {}
    for ev in evs:
        if isinstance(ev, StreamDataReceived):
            data, fin = got.get(ev.stream_id, (b"", False))
            assert not fin, "data after FIN"
            got[ev.stream_id] = (data + ev.data, ev.end_stream)
    return got


# ---------------------------------------------------------------- varint and transport parameters


@pytest.mark.parametrize("value", [0, 63, 64, 16383, 16384, (1 << 30) - 1, 1 << 30, qf.VARINT_MAX])
def test_varint_roundtrip(value: int) -> None:
    data = encode_varint(value)
    assert len(data) == qf.varint_size(value)
    assert decode_varint(data, 0, len(data)) == (value, len(data))


def test_varint_rfc_example_and_range() -> None:
    assert decode_varint(bytes.fromhex("c2197c5eff14e88c"), 0, 8)[0] == 151288809941952652
    assert decode_varint(bytes.fromhex("7bbd"), 0, 2)[0] == 15293
    with pytest.raises(QMuxUsageError):
        encode_varint(qf.VARINT_MAX + 1)
    with pytest.raises(qf.ShortRead):
        decode_varint(bytes.fromhex("7b"), 0, 1)


def test_qx_transport_parameters_type_is_the_magic() -> None:
    assert encode_varint(qf.QX_TRANSPORT_PARAMETERS) == b"\xffQS0\r\n\r\n"


def test_transport_parameters_roundtrip_and_defaults() -> None:
    params = QMuxConfiguration(is_client=True, max_datagram_frame_size=2000).transport_parameters()
    assert decode_transport_parameters(encode_transport_parameters(params)) == params
    assert decode_transport_parameters(b"") == TransportParameters()
    assert TransportParameters().max_record_size == 16382


@pytest.mark.parametrize("param_id", sorted(qf.FORBIDDEN_TRANSPORT_PARAMETERS))
def test_forbidden_transport_parameter_closes_with_transport_parameter_error(param_id: int) -> None:
    conn = QMuxConnection(QMuxConfiguration(is_client=False))
    conn.receive_data(record(tp_frame(raw=encode_varint(param_id) + b"\x01\x00")), NOW)
    assert closed_with(conn) == (QMuxErrorCode.TRANSPORT_PARAMETER_ERROR, qf.QX_TRANSPORT_PARAMETERS)
    assert qf.FORBIDDEN_TRANSPORT_PARAMETERS[param_id] in conn.close_event.reason_phrase  # type: ignore[union-attr]


@pytest.mark.parametrize("raw", [
    encode_varint(qf.TP_MAX_RECORD_SIZE) + b"\x02" + encode_varint(16381),  # below the default
    b"\x04\x01\x05\x04\x01\x06",  # initial_max_data twice
    b"\x04\x02\x05",  # value shorter than its length
    b"\x04\x02\x05\x00",  # value and length disagree
    b"\x08\x08" + encode_varint((1 << 60) + 1),  # initial_max_streams_bidi above 2^60
])
def test_invalid_transport_parameters(raw: bytes) -> None:
    with pytest.raises(qf.QMuxTransportParameterError):
        decode_transport_parameters(raw)


def test_unknown_and_reserved_transport_parameters_are_ignored() -> None:
    reserved = 31 * 7 + 27  # RFC 9000 section 18.1
    raw = encode_varint(reserved) + b"\x02ab" + encode_varint(0x17F7586D2CB571) + b"\x01\x00"
    assert decode_transport_parameters(raw) == TransportParameters()


def test_only_permitted_parameters_are_sent() -> None:
    raw = encode_transport_parameters(QMuxConfiguration(is_client=True).transport_parameters())
    ids, pos = set(), 0
    while pos < len(raw):
        pid, pos = decode_varint(raw, pos, len(raw))
        length, pos = decode_varint(raw, pos, len(raw))
        pos += length
        ids.add(pid)
    assert ids <= {0x01, 0x04, 0x05, 0x06, 0x07, 0x08, 0x09, qf.TP_MAX_RECORD_SIZE}


# ---------------------------------------------------------------- frame order and records


def test_first_frame_must_be_transport_parameters() -> None:
    conn = QMuxConnection(QMuxConfiguration(is_client=False))
    conn.receive_data(record(encode_frame(qf.MAX_DATA, 5)), NOW)
    assert closed_with(conn) == (PV, qf.MAX_DATA)


def test_padding_before_transport_parameters_is_a_violation() -> None:
    conn = QMuxConnection(QMuxConfiguration(is_client=False))
    conn.receive_data(record(b"\x00", tp_frame()), NOW)
    assert closed_with(conn)[0] == PV


def test_second_transport_parameters_is_a_violation() -> None:
    conn = server()
    conn.receive_data(record(tp_frame()), NOW)
    assert closed_with(conn) == (PV, qf.QX_TRANSPORT_PARAMETERS)


@pytest.mark.parametrize("frame", [
    encode_frame(qf.PING), encode_frame(qf.ACK, 0, 0, 0, 0), encode_frame(qf.ACK_ECN, 0, 0, 0, 0, 0, 0, 0),
    encode_frame(qf.CRYPTO, 0, 0), encode_frame(qf.NEW_TOKEN, 1) + b"t",
    encode_frame(qf.NEW_CONNECTION_ID, 1, 0, 1) + b"c" + bytes(16), encode_frame(qf.RETIRE_CONNECTION_ID, 0),
    encode_frame(qf.PATH_CHALLENGE) + bytes(8), encode_frame(qf.PATH_RESPONSE) + bytes(8),
    encode_frame(qf.HANDSHAKE_DONE),
])
def test_prohibited_frames_close_with_frame_encoding_error(frame: bytes) -> None:
    conn = server()
    conn.receive_data(record(frame), NOW)
    frame_type = decode_varint(frame, 0, len(frame))[0]
    assert closed_with(conn) == (FEE, frame_type)
    assert "prohibited" in conn.close_event.reason_phrase  # type: ignore[union-attr]


def test_unknown_frame_type_is_a_frame_encoding_error() -> None:
    conn = server()
    conn.receive_data(record(encode_frame(0x21), b"\x00"), NOW)
    assert closed_with(conn) == (FEE, 0x21)


def test_record_over_max_record_size_is_refused_before_it_arrives() -> None:
    conn = server(max_record_size=20000)
    conn.receive_data(encode_varint(20001) + b"\x00" * 10, NOW)
    assert closed_with(conn)[0] == FEE
    ok = server(max_record_size=20000)
    ok.receive_data(record(encode_frame(qf.MAX_DATA, 1), bytes(19998)), NOW)
    assert ok.close_event is None


def test_truncated_last_frame_of_a_record_is_a_frame_encoding_error() -> None:
    conn = server()
    conn.receive_data(record(encode_frame(qf.MAX_STREAM_DATA, 0)), NOW)  # the limit field is missing
    assert closed_with(conn) == (FEE, qf.MAX_STREAM_DATA)


def test_stream_frame_longer_than_its_record() -> None:
    conn = server()
    conn.receive_data(record(qf.stream_frame_header(0, 0, 10, False) + b"abc"), NOW)
    assert closed_with(conn) == (FEE, qf.STREAM | qf.STREAM_LEN)


def test_empty_record_is_a_violation() -> None:
    conn = server()
    conn.receive_data(b"\x00", NOW)
    assert closed_with(conn)[0] == PV


def test_stream_frame_without_length_runs_to_the_end_of_its_record() -> None:
    conn = server()
    no_length = bytes((qf.STREAM | qf.STREAM_FIN, 0)) + b"hello"
    conn.receive_data(record(encode_frame(qf.MAX_DATA, 9), no_length), NOW)
    assert stream_bytes(events(conn)) == {0: (b"hello", True)}


def test_a_record_split_anywhere_gives_the_same_stream_bytes() -> None:
    data = record(stream_frame(0, b"abcdef"), encode_frame(qf.MAX_DATA, 70000),
                  stream_frame(4, b"xyz", fin=True), b"\x00\x00")
    data += record(stream_frame(0, b"gh", offset=6, fin=True))
    for cut in range(len(data) + 1):
        conn = server()
        conn.receive_data(data[:cut], NOW)
        conn.receive_data(data[cut:], NOW)
        assert conn.close_event is None
        assert stream_bytes(events(conn)) == {0: (b"abcdefgh", True), 4: (b"xyz", True)}


# ---------------------------------------------------------------- streams and flow control


def test_out_of_order_stream_offset_is_a_protocol_violation() -> None:
    for offset in (3, 1):  # a gap, then an overlap
        conn = server()
        conn.receive_data(record(stream_frame(0, b"ab"), stream_frame(0, b"cd", offset=offset)), NOW)
        assert closed_with(conn) == (PV, qf.STREAM | qf.STREAM_LEN | qf.STREAM_OFF)


def test_stream_flow_control_violation() -> None:
    conn = server()  # 500 bytes per stream
    conn.receive_data(record(stream_frame(0, bytes(501))), NOW)
    assert closed_with(conn)[0] == QMuxErrorCode.FLOW_CONTROL_ERROR


def test_connection_flow_control_violation() -> None:
    conn = server(max_data=800)
    conn.receive_data(record(stream_frame(0, bytes(400)), stream_frame(4, bytes(401))), NOW)
    assert closed_with(conn)[0] == QMuxErrorCode.FLOW_CONTROL_ERROR


def test_stream_count_limit() -> None:
    conn = server()  # two bidirectional streams
    conn.receive_data(record(stream_frame(8, b"x")), NOW)
    assert closed_with(conn)[0] == QMuxErrorCode.STREAM_LIMIT_ERROR


def test_frames_on_the_wrong_half_are_stream_state_errors() -> None:
    cases = [
        stream_frame(3, b"x"),  # our (server) unidirectional stream: send-only for us
        encode_frame(qf.STOP_SENDING, 2, 0),  # the client's unidirectional stream: receive-only for us
        encode_frame(qf.MAX_STREAM_DATA, 2, 10),
        stream_frame(1, b"x"),  # our bidirectional stream 1, never opened
    ]
    for frame in cases:
        conn = server()
        conn.receive_data(record(frame), NOW)
        assert closed_with(conn)[0] == QMuxErrorCode.STREAM_STATE_ERROR, frame


def test_final_size_errors() -> None:
    conn = server()
    conn.receive_data(record(stream_frame(0, b"abc", fin=True), stream_frame(0, b"d", offset=3)), NOW)
    assert closed_with(conn)[0] == QMuxErrorCode.FINAL_SIZE_ERROR
    conn = server()
    conn.receive_data(record(stream_frame(4, b"abc"), encode_frame(qf.RESET_STREAM, 4, 7, 2)), NOW)
    assert closed_with(conn) == (QMuxErrorCode.FINAL_SIZE_ERROR, qf.RESET_STREAM)
    conn = server()
    conn.receive_data(record(stream_frame(4, b"ab"), encode_frame(qf.RESET_STREAM, 4, 7, 501)), NOW)
    assert closed_with(conn)[0] == QMuxErrorCode.FLOW_CONTROL_ERROR


def test_max_streams_above_2_to_the_60() -> None:
    for frame_type in (qf.MAX_STREAMS_BIDI, qf.STREAMS_BLOCKED_UNI):
        conn = server()
        conn.receive_data(record(encode_frame(frame_type, (1 << 60) + 1)), NOW)
        assert closed_with(conn) == (FEE, frame_type)


def test_reset_stream_is_reported_with_its_code() -> None:
    conn = server()
    conn.receive_data(record(stream_frame(0, b"ab"), encode_frame(qf.RESET_STREAM, 0, 9, 2)), NOW)
    evs = events(conn)
    assert StreamReset(9, 0) in evs and conn.close_event is None


def test_nothing_but_transport_parameters_before_the_peers_arrive() -> None:
    client = QMuxConnection(QMuxConfiguration(is_client=True))
    client.connection_made(NOW)
    sid = client.get_next_available_stream_id()
    client.send_stream_data(sid, b"early", True)
    client.send_ping(1)
    records = parse_records(client.data_to_send(NOW))
    assert len(records) == 1 and records[0].startswith(encode_varint(qf.QX_TRANSPORT_PARAMETERS))
    assert client.unsent(sid) == 5


def test_two_endpoints_move_streams_both_ways_with_flow_control_updates() -> None:
    window = 16 * 1024
    small: dict[str, object] = dict(max_data=4 * window, max_stream_data_bidi_local=window,
                                    max_stream_data_bidi_remote=window, max_stream_data_uni=window,
                                    max_streams_bidi=2, max_streams_uni=2)
    c, s = pair(small, small)
    rng = random.Random(5)
    payloads = {}
    for i in range(6):  # more streams than either side's stream limit: MAX_STREAMS must be renewed
        sid = c.get_next_available_stream_id(is_unidirectional=i % 2 == 1)
        payloads[sid] = rng.randbytes(rng.randint(0, 200_000))
        c.send_stream_data(sid, payloads[sid], end_stream=True)
    exchange(c, s, rng)
    got = stream_bytes(events(s))
    # Stream 8 waits: the server's halves of 0 and 4 are still open, so its two bidirectional streams
    # are in use (the unidirectional 2, 6, 10 were renewed as each ended).
    assert got == {sid: (data, True) for sid, data in payloads.items() if sid != 8}
    assert c.unsent(8) == len(payloads[8])
    replies = {}
    for sid in (0, 4, 1, 3, 8, 5):
        if sid in (1, 5, 3):
            assert sid == s.get_next_available_stream_id(is_unidirectional=sid == 3)
        replies[sid] = rng.randbytes(70_000)
        s.send_stream_data(sid, replies[sid], end_stream=True)
        if sid == 3:  # the server's answers on 0 and 4 gave the client its streams back
            exchange(s, c, rng)
            assert stream_bytes(events(s)) == {8: (payloads[8], True)}
    exchange(s, c, rng)
    evs = events(c)
    assert any(isinstance(e, HandshakeCompleted) and e.alpn_protocol == "moqt" for e in evs)
    assert stream_bytes(evs) == {sid: (data, True) for sid, data in replies.items()}
    assert c.close_event is None and s.close_event is None
    for sid in (1, 5):  # the client ends its halves of the server's streams
        c.send_stream_data(sid, b"", end_stream=True)
    exchange(c, s)
    assert not c._streams and not s._streams  # every stream over on both halves is forgotten


def test_records_are_as_large_as_the_peer_allows() -> None:
    for peer_max in (16382, 100_000):
        c, s = pair(server_config=dict(max_record_size=peer_max))
        exchange(c, s)
        c.send_stream_data(0, bytes(1_000_000), True)
        records = parse_records(c.data_to_send(NOW))
        assert max(map(len, records)) <= peer_max
        assert sum(len(r) >= peer_max - 64 for r in records) >= len(records) - 1
        s.receive_data(b"".join(encode_varint(len(r)) + r for r in records), NOW)
        assert s.close_event is None


def test_records_to_send_leaves_large_stream_data_as_the_applications_views() -> None:
    c, s = pair(server_config=dict(max_record_size=100_000, max_data=1 << 22,
                                   max_stream_data_bidi_remote=1 << 22))
    exchange(c, s)
    header, payload = b"object header", bytes(range(256)) * 1000  # 256,000 bytes, queued as two pieces
    c.send_stream_data(0, header)
    c.send_stream_data(0, payload, True)
    pieces = c.records_to_send(NOW)
    # Record lengths, frame headers and the ends of the payload's parts joined, every piece but the last
    # whole TLS records (16 KiB), and most of the payload left in views of the caller's own bytes object.
    assert all(len(p) % 16384 == 0 for p in pieces[:-1])
    views = [p for p in pieces if isinstance(p, memoryview)]
    assert len(views) == 3 and all(v.obj is payload for v in views)
    assert sum(map(len, views)) >= len(payload) - 3 * 2 * 16384
    s.receive_data(b"".join(pieces), NOW)
    received = b"".join(e.data for e in events(s) if isinstance(e, StreamDataReceived))
    assert received == header + payload and s.close_event is None
    assert c.records_to_send(NOW) == [] and c.data_to_send(NOW) == b""


def test_blocked_sender_says_so_once_and_resumes_on_credit() -> None:
    c, s = pair(server_config=dict(max_data=1 << 20, max_stream_data_bidi_remote=20_000))
    exchange(c, s)
    c.send_stream_data(0, bytes(50_000))
    first = c.data_to_send(NOW)
    assert encode_frame(qf.STREAM_DATA_BLOCKED, 0, 20_000) in first
    assert c.unsent(0) == 30_000
    assert c.data_to_send(NOW) == b""  # no credit, nothing repeated
    s.receive_data(first, NOW)
    c.receive_data(s.data_to_send(NOW), NOW)  # MAX_STREAM_DATA
    exchange(c, s)
    assert c.unsent(0) == 0


def test_stop_sending_resets_the_stream_and_both_sides_hear_of_it() -> None:
    c, s = pair()
    exchange(c, s)
    c.send_stream_data(0, b"request")
    exchange(c, s)
    s.stop_stream(0, 5)
    exchange(c, s)
    assert StopSendingReceived(5, 0) in events(c)
    assert StreamReset(5, 0) in events(s)  # the client's answer, with the code copied
    c.send_stream_data(0, b"dropped after STOP_SENDING")
    exchange(c, s)
    assert not any(isinstance(e, StreamDataReceived) and e.data for e in events(s))
    s.reset_stream(0, 6)
    exchange(c, s)
    assert StreamReset(6, 0) in events(c)


def test_send_after_fin_is_a_usage_error() -> None:
    c, _ = pair()
    c.send_stream_data(0, b"x", True)
    with pytest.raises(QMuxUsageError):
        c.send_stream_data(0, b"y")
    with pytest.raises(QMuxUsageError):
        c.send_stream_data(8, b"skips stream 4")


# ---------------------------------------------------------------- ping, datagrams, idle, close


def test_ping_is_answered() -> None:
    c, s = pair()
    exchange(c, s)
    c.send_ping(42)
    exchange(c, s)
    assert PingAcknowledged(42) in events(c)


def test_ping_sequence_rules() -> None:
    conn = server()
    conn.receive_data(record(encode_frame(qf.QX_PING_RESPONSE, 1)), NOW)  # we never pinged
    assert closed_with(conn) == (PV, qf.QX_PING_RESPONSE)
    conn = server()
    conn.receive_data(record(encode_frame(qf.QX_PING_REQUEST, 3), encode_frame(qf.QX_PING_REQUEST, 3)), NOW)
    assert closed_with(conn) == (PV, qf.QX_PING_REQUEST)


def test_datagrams_when_negotiated() -> None:
    c, s = pair(dict(max_datagram_frame_size=1200), dict(max_datagram_frame_size=1200))
    exchange(c, s)
    c.send_datagram_frame(b"d" * 100)
    c.send_datagram_frame(b"d" * 1500)  # larger than the peer accepts: dropped
    exchange(c, s)
    datagrams = [e for e in events(s) if isinstance(e, DatagramFrameReceived)]
    assert datagrams == [DatagramFrameReceived(b"d" * 100)]
    assert c.datagrams_dropped == 1


def test_datagram_not_negotiated_or_too_large_is_a_violation() -> None:
    conn = server()
    conn.receive_data(record(encode_frame(qf.DATAGRAM_LEN, 1) + b"x"), NOW)
    assert closed_with(conn) == (PV, qf.DATAGRAM_LEN)
    conn = server(max_datagram_frame_size=10)
    conn.receive_data(record(bytes((qf.DATAGRAM,)) + b"x" * 10), NOW)
    assert closed_with(conn) == (PV, qf.DATAGRAM)
    conn = server(max_datagram_frame_size=11)
    conn.receive_data(record(bytes((qf.DATAGRAM,)) + b"x" * 10), NOW)
    assert DatagramFrameReceived(b"x" * 10) in events(conn)


def test_idle_timeout_ends_the_connection_without_a_frame() -> None:
    c, s = pair(dict(max_idle_timeout=30.0), dict(max_idle_timeout=10.0))
    exchange(c, s)
    assert c.get_timer() == NOW + 10.0  # the smaller of the two
    c.handle_timer(NOW + 9.0)
    assert c.close_event is None
    c.receive_data(record(encode_frame(qf.MAX_DATA, 1 << 40)), NOW + 5)  # a record resets the timer
    assert c.get_timer() == NOW + 15.0
    c.handle_timer(NOW + 15.0)
    assert closed_with(c) == (QMuxErrorCode.NO_ERROR, None)
    assert c.finished and c.data_to_send(NOW + 16) == b"" and c.get_timer() is None


def test_connection_close_reaches_the_peer_and_later_bytes_are_discarded() -> None:
    c, s = pair()
    exchange(c, s)
    c.close(0x10, None, "bye")
    data = c.data_to_send(NOW)
    assert c.finished
    s.receive_data(data + record(stream_frame(0, b"after")), NOW)
    assert ConnectionTerminated(0x10, None, "bye") in events(s)
    assert s.finished and s.data_to_send(NOW) == b""  # answered by shutting down, no frame
    c.receive_data(b"\xff garbage", NOW)
    assert closed_with(c) == (0x10, None)


def test_peer_error_is_sent_back_as_transport_close() -> None:
    c, s = pair()
    exchange(c, s)
    s.receive_data(record(encode_frame(qf.PING)), NOW)
    c.receive_data(s.data_to_send(NOW), NOW)
    assert closed_with(c) == (FEE, qf.PING)


def test_eof_inside_a_record() -> None:
    conn = server()
    conn.receive_data(b"\x05\x10", NOW)
    conn.receive_eof()
    assert closed_with(conn)[0] == PV
    conn = server()
    conn.receive_eof()
    assert closed_with(conn) == (QMuxErrorCode.NO_ERROR, None) and conn.finished


def test_tls_aligned_pieces_keep_every_byte_in_order() -> None:
    rng = random.Random(7)
    for _ in range(300):
        out: list[bytes | memoryview] = [
            rng.randbytes(rng.choice((0, 1, 9, 100, 16383, 16384, 16385, 40_000, 70_000)))
            for _ in range(rng.randrange(1, 8))
        ]
        pieces = _tls_aligned(out)
        assert b"".join(pieces) == b"".join(out)
        assert all(len(p) % 16384 == 0 and len(p) for p in pieces[:-1]) and all(len(p) for p in pieces)
