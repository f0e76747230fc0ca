"""Peer misbehaviour: each case ends in the draft's error code, or stays request-local."""

from __future__ import annotations

import pytest

from proto.buffer import vi64_encode
from proto.data import (
    FetchHeader,
    SubgroupHeader,
    SubgroupIdMode,
    encode_fetch_header,
    encode_subgroup_header,
)
from proto.errors import RequestErrorCode, SessionErrorCode, StreamResetCode
from proto.events import (
    RequestErrorReceived,
    SessionTerminated,
    SubgroupClosed,
    SubscribeReceived,
)
from proto.messages import (
    FetchOk,
    Goaway,
    KeyValuePair,
    Location,
    Namespace,
    NamespaceDone,
    PublishNamespace,
    RequestError,
    RequestOk,
    Setup,
    Subscribe,
    SubscribeOk,
    encode_message,
)
from proto.session import CloseConnection, MoqtSession, SessionConfig, StopSending
from tests.helpers.sessions import InMemoryStreams, SessionPair, make_pair

NS = (b"kvnet",)
PV = SessionErrorCode.PROTOCOL_VIOLATION


def assert_closed(session: MoqtSession, code: SessionErrorCode) -> None:
    assert session.closed is not None, "session should be closed"
    assert session.closed[0] == code, session.closed
    transmits = session.transmit()
    assert isinstance(transmits[-1], CloseConnection) and transmits[-1].error_code == code
    events = []
    while (e := session.next_event()) is not None:
        events.append(e)
    term = [e for e in events if isinstance(e, SessionTerminated)]
    assert len(term) == 1 and term[0].error_code == code and not term[0].by_peer


def subscribe_bytes(request_id: int) -> bytes:
    return encode_message(Subscribe(request_id, NS, b"t"))


# -- control stream and setup --------------------------------------------------------------------


def test_unknown_message_type_on_control_stream() -> None:
    pair = make_pair()
    pair.server.receive_stream_data(2, b"\x3f\x00\x00", False)
    assert_closed(pair.server, PV)


def test_second_setup_on_control_stream() -> None:
    # A control stream is recognised by SETUP as its first bytes, so "something else before SETUP"
    # is an unknown or data stream type; what remains to check is a repeated SETUP.
    session = MoqtSession(SessionConfig(is_client=False), InMemoryStreams(False))
    session.initiate()
    framed = encode_message(Setup())
    session.receive_stream_data(2, framed + framed, False)
    assert_closed(session, PV)


def test_non_control_message_on_control_stream() -> None:
    pair = make_pair()
    pair.server.receive_stream_data(2, subscribe_bytes(0), False)
    assert_closed(pair.server, PV)


def test_control_stream_closed_or_reset() -> None:
    pair = make_pair()
    pair.server.receive_stream_data(2, b"", True)
    assert_closed(pair.server, PV)
    pair = make_pair()
    pair.client.receive_stream_reset(3, 0)
    assert_closed(pair.client, PV)
    pair = make_pair()
    pair.client.receive_stop_sending(2, 0)
    assert_closed(pair.client, PV)


def test_second_control_stream() -> None:
    pair = make_pair()
    pair.server.receive_stream_data(6, encode_message(Setup()), False)
    assert_closed(pair.server, PV)


def test_server_sending_path_is_invalid_path() -> None:
    client = MoqtSession(SessionConfig(is_client=True), InMemoryStreams(True))
    client.initiate()
    client.receive_stream_data(3, encode_message(Setup(path="/x")), False)
    assert_closed(client, SessionErrorCode.INVALID_PATH)


def test_oversized_control_message_hits_the_limit() -> None:
    pair = make_pair(max_control_message_size=64)
    pair.server.receive_stream_data(0, encode_message(Subscribe(0, NS, b"x" * 100)), False)
    assert_closed(pair.server, SessionErrorCode.INTERNAL_ERROR)


def test_unknown_uni_stream_type() -> None:
    pair = make_pair()
    pair.server.receive_stream_data(6, vi64_encode(0x0F), False)
    assert_closed(pair.server, PV)


def test_unknown_datagram_type() -> None:
    pair = make_pair()
    pair.server.receive_datagram(b"\x10\x00\x00")
    assert_closed(pair.server, PV)


# -- request IDs and request streams ----------------------------------------------------------


def test_request_id_with_wrong_parity() -> None:
    pair = make_pair()
    pair.server.receive_stream_data(0, subscribe_bytes(1), False)  # clients use even IDs
    assert_closed(pair.server, SessionErrorCode.INVALID_REQUEST_ID)


def test_duplicate_request_id() -> None:
    pair = make_pair()
    pair.server.receive_stream_data(0, subscribe_bytes(0), False)
    pair.server.receive_stream_data(4, subscribe_bytes(0), False)
    assert_closed(pair.server, SessionErrorCode.INVALID_REQUEST_ID)


def test_out_of_order_request_ids_are_fine() -> None:
    pair = make_pair()
    pair.server.receive_stream_data(4, subscribe_bytes(2), False)
    pair.server.receive_stream_data(0, subscribe_bytes(0), False)
    pair.run()
    assert pair.server.closed is None
    assert [e.request_id for e in pair.server_events if isinstance(e, SubscribeReceived)] == [2, 0]


def test_request_stream_starting_with_a_response() -> None:
    pair = make_pair()
    pair.server.receive_stream_data(0, encode_message(SubscribeOk(1)), False)
    assert_closed(pair.server, PV)


def test_goaway_first_on_request_stream() -> None:
    pair = make_pair()
    pair.server.receive_stream_data(0, encode_message(Goaway()), False)
    assert_closed(pair.server, PV)


def test_second_reply_is_a_protocol_violation() -> None:
    pair = make_pair()
    pair.subscribe_accepted(NS, 1)
    pair.run()
    pair.client.receive_stream_data(0, encode_message(SubscribeOk(2)), False)
    assert_closed(pair.client, PV)


def test_reply_from_the_wrong_kind() -> None:
    pair = make_pair()
    pair.client.track_status(NS, b"t")
    pair.run()
    pair.client.receive_stream_data(0, encode_message(SubscribeOk(2)), False)
    assert_closed(pair.client, PV)


def test_request_ok_with_track_properties_outside_track_status() -> None:
    pair = make_pair()
    pair.client.publish_namespace(NS)
    pair.run()
    pair.client.receive_stream_data(
        0, encode_message(RequestOk(track_properties=(KeyValuePair(2, 1),))), False
    )
    assert_closed(pair.client, PV)


def test_unsolicited_update_reply() -> None:
    pair = make_pair()
    rid = pair.client.publish_namespace(NS)
    pair.run()
    pair.server.accept_request(rid)
    pair.run()
    pair.client.receive_stream_data(0, encode_message(RequestOk()), False)
    assert_closed(pair.client, PV)


def test_namespace_done_before_namespace() -> None:
    pair = make_pair()
    rid = pair.client.subscribe_namespace(NS)
    pair.run()
    pair.server.accept_request(rid)
    pair.run()
    pair.client.receive_stream_data(0, encode_message(Namespace((b"a",))), False)
    assert pair.client.closed is None
    pair.client.receive_stream_data(0, encode_message(NamespaceDone((b"b",))), False)
    assert_closed(pair.client, PV)


def test_fin_without_reply() -> None:
    pair = make_pair()
    pair.client.subscribe(NS, b"t")
    pair.run()
    pair.client.receive_stream_data(0, b"", True)
    assert_closed(pair.client, PV)


def test_fin_inside_a_message() -> None:
    pair = make_pair()
    pair.server.receive_stream_data(0, subscribe_bytes(0)[:-1], True)
    assert_closed(pair.server, PV)


def test_second_goaway() -> None:
    pair = make_pair()
    pair.client.receive_stream_data(3, encode_message(Goaway(b"", 0, 0)), False)
    assert pair.client.closed is None
    pair.client.receive_stream_data(3, encode_message(Goaway(b"", 0, 0)), False)
    assert_closed(pair.client, PV)


def test_goaway_request_id_with_wrong_parity() -> None:
    pair = make_pair()
    pair.client.receive_stream_data(3, encode_message(Goaway(b"", 0, 1)), False)
    assert_closed(pair.client, SessionErrorCode.INVALID_REQUEST_ID)


def test_client_goaway_with_uri() -> None:
    pair = make_pair()
    pair.server.receive_stream_data(2, encode_message(Goaway(b"moqt://x", 0, 1)), False)
    assert_closed(pair.server, PV)


def test_fetch_ok_end_before_start() -> None:
    pair = make_pair()
    pair.client.fetch(NS, b"t", Location(5, 3), Location(6, 0))
    pair.run()
    pair.client.receive_stream_data(0, encode_message(FetchOk(False, Location(5, 2))), False)
    assert_closed(pair.client, PV)


# -- request-level failures keep the session ----------------------------------------------------


def test_too_many_requests_rejected_with_excessive_load() -> None:
    pair = make_pair(max_requests_in_flight=2)
    ids = [pair.client.subscribe(NS, bytes([i])) for i in range(3)]
    pair.run()
    assert [e.request_id for e in pair.server_events if isinstance(e, SubscribeReceived)] == ids[:2]
    (err,) = [e for e in pair.client_events if isinstance(e, RequestErrorReceived)]
    assert (
        err.request_id == ids[2] and err.error_code == RequestErrorCode.EXCESSIVE_LOAD and err.retry_interval
    )
    assert pair.server.closed is None and pair.client.closed is None
    pair.server.reject_request(ids[0], RequestErrorCode.DOES_NOT_EXIST)
    pair.run()
    later = pair.client.subscribe(NS, b"later")
    pair.run()
    assert [e.request_id for e in pair.server_events if isinstance(e, SubscribeReceived)][-1] == later


def test_object_over_size_limit_stops_only_that_stream() -> None:
    pair = make_pair(max_object_size=1000)
    pair.subscribe_accepted(NS, 1)
    sid = pair.server.open_subgroup(1, 0, 0)
    pair.server.send_subgroup_object(sid, 0, b"x" * 5000)
    pair.run()
    assert pair.client.closed is None
    assert StopSending(sid, StreamResetCode.EXCESSIVE_LOAD) in pair.client_transmits
    (closed,) = [e for e in pair.client_events if isinstance(e, SubgroupClosed)]
    assert closed.error_code == StreamResetCode.EXCESSIVE_LOAD


def test_data_stream_fin_inside_object() -> None:
    pair = make_pair()
    pair.subscribe_accepted(NS, 1)
    pair.run()
    header = encode_subgroup_header(SubgroupHeader(1, 0, 0, SubgroupIdMode.ZERO))
    pair.client.receive_stream_data(3 + 4 * 5, header + b"\x00\x05ab", True)
    assert_closed(pair.client, PV)


def test_duplicate_track_alias() -> None:
    pair = make_pair()
    a = pair.client.subscribe(NS, b"a")
    pair.client.subscribe(NS, b"b")
    pair.run()
    pair.server.accept_subscribe(a, 1)
    pair.run()
    pair.client.receive_stream_data(4, encode_message(SubscribeOk(1)), False)
    assert_closed(pair.client, SessionErrorCode.DUPLICATE_TRACK_ALIAS)


def test_fetch_header_for_unknown_request() -> None:
    pair = make_pair()
    pair.client.receive_stream_data(7, encode_fetch_header(FetchHeader(40)), False)
    assert_closed(pair.client, PV)


def test_fetch_header_for_a_cancelled_fetch_is_stopped() -> None:
    pair = make_pair()
    rid = pair.client.fetch(NS, b"t", Location(0, 0), Location(1, 0))
    pair.run()
    pair.client.cancel_request(rid)
    pair.client.transmit()
    pair.client.receive_stream_data(7, encode_fetch_header(FetchHeader(rid)) + b"\x0c", False)
    assert pair.client.closed is None
    assert StopSending(7, StreamResetCode.CANCELLED) in pair.client.transmit()


def test_requests_before_setup_are_buffered_then_handled() -> None:
    pair = SessionPair()
    pair.server.initiate()
    pair.server.transmit()
    pair.server.receive_stream_data(0, subscribe_bytes(0), False)
    assert pair.server.next_event() is None
    pair.server.receive_stream_data(2, encode_message(Setup()), False)
    events = []
    while (e := pair.server.next_event()) is not None:
        events.append(e)
    assert [type(e).__name__ for e in events] == ["SetupCompleted", "SubscribeReceived"]


def test_unbounded_buffering_before_setup_is_refused() -> None:
    pair = SessionPair(server_config=SessionConfig(is_client=False, max_buffered_bytes_per_stream=100))
    pair.server.initiate()
    pair.server.transmit()
    pair.server.receive_stream_data(0, subscribe_bytes(0) * 20, False)
    assert pair.server.closed is None
    assert StopSending(0, StreamResetCode.EXCESSIVE_LOAD) in pair.server.transmit()


def test_unknown_request_error_code_is_passed_through() -> None:
    pair = make_pair()
    rid = pair.client.publish_namespace(NS)
    pair.run()
    pair.client.receive_stream_data(0, encode_message(RequestError(0x9D, 0, "grease")), False)
    pair.run()
    (err,) = [e for e in pair.client_events if isinstance(e, RequestErrorReceived)]
    assert (err.request_id, err.error_code) == (rid, 0x9D)
    assert pair.client.closed is None


@pytest.mark.parametrize("first", [encode_message(PublishNamespace(0, NS)), subscribe_bytes(0)])
def test_peer_reset_before_reply_cancels_cleanly(first: bytes) -> None:
    pair = make_pair()
    pair.server.receive_stream_data(0, first, False)
    pair.server.receive_stream_reset(0, StreamResetCode.CANCELLED)
    pair.server.receive_stream_data(0, b"late", False)  # ignored: the request is gone
    assert pair.server.closed is None
    assert pair.server._requests == {} and pair.server._bidi == {}


def test_bad_request_buffered_before_initiate_closes_at_initiate() -> None:
    server = MoqtSession(SessionConfig(is_client=False), InMemoryStreams(False))
    server.receive_stream_data(2, encode_message(Setup()), False)
    server.receive_stream_data(0, encode_message(SubscribeOk(1)), False)
    assert server.closed is None  # buffered: our SETUP is not out yet
    server.initiate()
    assert_closed(server, PV)
