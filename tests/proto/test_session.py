"""MoqtSession end to end: two sessions wired back to back in memory (tests/helpers/sessions.SessionPair)."""

from __future__ import annotations

import random

import pytest

from proto.data import ObjectStatus
from proto.errors import PublishDoneCode, RequestErrorCode, SessionErrorCode, StreamResetCode, UsageError
from proto.events import (
    DataStreamStopped,
    FetchCompleted,
    FetchOkReceived,
    FetchRangeReceived,
    FetchReceived,
    GoawayReceived,
    NamespaceDoneReceived,
    NamespaceReceived,
    ObjectReceived,
    PublishDoneReceived,
    PublishNamespaceReceived,
    PublishOkReceived,
    PublishReceived,
    RequestCancelled,
    RequestErrorReceived,
    RequestOkReceived,
    RequestUpdateReceived,
    SessionTerminated,
    SetupCompleted,
    SubgroupClosed,
    SubscribeNamespaceReceived,
    SubscribeOkReceived,
    SubscribeReceived,
    SubscribeTracksReceived,
    TrackStatusOkReceived,
    TrackStatusReceived,
)
from proto.messages import (
    FetchType,
    KeyValuePair,
    Location,
    MessageParameters,
    SubscribeNamespace,
    encode_message,
)
from proto.session import (
    CloseConnection,
    MoqtSession,
    ResetStream,
    SendStreamData,
    SessionConfig,
    StopSending,
)
from tests.helpers.sessions import InMemoryStreams, SessionPair, make_pair

NS = (b"kvnet", b"model-1")


def of_type(events: list, cls: type) -> list:
    return [e for e in events if isinstance(e, cls)]


def test_setup_completes_with_peer_options() -> None:
    pair = SessionPair(
        SessionConfig(
            is_client=True, path="/relay?x=1", authority="relay.example:443", implementation=b"c/1"
        ),
        SessionConfig(is_client=False, implementation=b"s/2"),
    )
    pair.setup()
    (server_setup,) = of_type(pair.server_events, SetupCompleted)
    (client_setup,) = of_type(pair.client_events, SetupCompleted)
    assert server_setup.path == "/relay?x=1"
    assert server_setup.authority == "relay.example:443"
    assert server_setup.implementation == b"c/1"
    assert client_setup.implementation == b"s/2"
    assert client_setup.path is None
    assert pair.client.established and pair.server.established
    # Control streams are the first unidirectional stream of each side.
    first = pair.client_transmits[0]
    assert isinstance(first, SendStreamData) and first.stream_id == 2


def test_setup_completes_whichever_side_initiates_first() -> None:
    pair = SessionPair()
    pair.client.initiate()
    pair.run()
    assert not of_type(pair.server_events, SetupCompleted)  # server has not sent its SETUP yet
    assert not pair.server.established
    pair.server.initiate()
    pair.run()
    assert of_type(pair.server_events, SetupCompleted) and of_type(pair.client_events, SetupCompleted)


def test_subscribe_objects_on_subgroup_streams() -> None:
    pair = make_pair()
    rid = pair.client.subscribe(NS, b"block-1", MessageParameters(subscriber_priority=7))
    assert rid == 0
    pair.run()
    (sub,) = of_type(pair.server_events, SubscribeReceived)
    assert (sub.request_id, sub.track_namespace, sub.track_name) == (0, NS, b"block-1")
    assert sub.parameters.subscriber_priority == 7
    pair.server.accept_subscribe(
        rid, track_alias=42, parameters=MessageParameters(largest_object=Location(3, 4))
    )
    pair.run()
    (ok,) = of_type(pair.client_events, SubscribeOkReceived)
    assert ok.track_alias == 42 and ok.parameters.largest_object == Location(3, 4)

    sid = pair.server.open_subgroup(42, group_id=5, subgroup_id=0, publisher_priority=3, has_properties=True)
    pair.server.send_subgroup_object(sid, 0, b"layer0", properties=(KeyValuePair(0x3C, 1),))
    pair.server.send_subgroup_object(sid, 1, b"")
    pair.server.send_subgroup_object(sid, 2, b"", status=ObjectStatus.END_OF_GROUP)
    pair.server.close_subgroup(sid)
    pair.run()
    objs = of_type(pair.client_events, ObjectReceived)
    assert [(o.object_id, o.payload, o.status) for o in objs] == [(0, b"layer0", 0), (1, b"", 0), (2, b"", 3)]
    assert all(o.request_id == rid and o.track_alias == 42 and o.group_id == 5 for o in objs)
    assert objs[0].properties == (KeyValuePair(0x3C, 1),)
    assert objs[0].via == "subgroup" and objs[0].publisher_priority == 3 and objs[0].subgroup_id == 0
    (closed,) = of_type(pair.client_events, SubgroupClosed)
    assert closed.error_code is None and closed.stream_id == sid

    pair.server.publish_done(rid, PublishDoneCode.TRACK_ENDED, "bye")
    pair.run()
    (done,) = of_type(pair.client_events, PublishDoneReceived)
    assert (done.status_code, done.stream_count, done.reason) == (PublishDoneCode.TRACK_ENDED, 1, "bye")
    # Both directions of the request stream are FIN'd and forgotten.
    fins = [
        t
        for t in pair.server_transmits
        if isinstance(t, SendStreamData) and t.stream_id == 0 and t.end_stream
    ]
    assert fins
    assert pair.server._requests == {} and pair.client._requests == {}


def test_first_object_bit_marks_only_the_first_object_of_its_stream() -> None:
    pair = make_pair()
    pair.subscribe_accepted(NS, 1)
    pair.run()
    first = pair.server.open_subgroup(1, 0, 0, first_object=True)
    later = pair.server.open_subgroup(1, 1, 0)
    for sid in (first, later):
        pair.server.send_subgroup_object(sid, 0, b"a")
        pair.server.send_subgroup_object(sid, 1, b"b")
        pair.server.close_subgroup(sid)
    pair.run()
    objs = of_type(pair.client_events, ObjectReceived)
    assert [(o.group_id, o.object_id, o.first_object) for o in objs] == [
        (0, 0, True), (0, 1, False), (1, 0, False), (1, 1, False)
    ]


@pytest.mark.parametrize("seed", range(4))
def test_objects_of_various_sizes_in_random_fragments(seed: int) -> None:
    rng = random.Random(seed)
    fragment = [1000, 7000, 16384, 65536][seed]
    pair = make_pair(fragment=fragment, seed=seed)
    pair.subscribe_accepted(NS, 1)
    pair.run()
    sizes = [0, 1, 127, 128, 16384, 70000, 3 << 20 if fragment >= 7000 else 300_000]
    payloads = [rng.randbytes(n) for n in sizes]
    sid = pair.server.open_subgroup(1, 0, 9)
    for i, payload in enumerate(payloads):
        pair.server.send_subgroup_object(sid, i * 2, payload)
    pair.server.close_subgroup(sid)
    pair.run()
    objs = of_type(pair.client_events, ObjectReceived)
    assert [o.payload for o in objs] == payloads
    assert [o.object_id for o in objs] == [0, 2, 4, 6, 8, 10, 12]
    assert {o.subgroup_id for o in objs} == {9}
    assert of_type(pair.client_events, SubgroupClosed)[0].error_code is None


def test_small_objects_one_byte_at_a_time() -> None:
    pair = make_pair(fragment=1)
    rid = pair.client.fetch(NS, b"t", Location(0, 0), Location(0, 0))
    pair.run()
    pair.server.accept_fetch(rid, False, Location(1, 0))
    payloads = [bytes([i]) * (i * 37) for i in range(20)]
    for i, payload in enumerate(payloads):
        pair.server.send_fetch_object(rid, i // 5, i % 3, i, payload, properties=(KeyValuePair(2, i),))
    pair.server.finish_fetch(rid)
    pair.run()
    objs = of_type(pair.client_events, ObjectReceived)
    assert [o.payload for o in objs] == payloads
    assert [(o.group_id, o.subgroup_id, o.object_id) for o in objs] == [(i // 5, i % 3, i) for i in range(20)]
    assert [o.properties for o in objs] == [(KeyValuePair(2, i),) for i in range(20)]
    assert of_type(pair.client_events, FetchCompleted) == [FetchCompleted(rid)]


def test_subgroup_stream_before_subscribe_ok_is_buffered() -> None:
    pair = make_pair()
    pair.subscribe_accepted(NS, 9)
    sid = pair.server.open_subgroup(9, 1, 0)
    pair.server.send_subgroup_object(sid, 0, b"early", end_stream=True)
    # Deliver the data stream first, then the SUBSCRIBE_OK on the request stream.
    transmits = pair.server.transmit()
    for t in sorted(transmits, key=lambda t: 0 if getattr(t, "stream_id", 0) == sid else 1):
        assert isinstance(t, SendStreamData)
        pair.client.receive_stream_data(t.stream_id, t.data, t.end_stream)
    pair.run()
    objs = of_type(pair.client_events, ObjectReceived)
    assert [o.payload for o in objs] == [b"early"]
    ok_index = next(i for i, e in enumerate(pair.client_events) if isinstance(e, SubscribeOkReceived))
    assert pair.client_events.index(objs[0]) > ok_index


def test_a_data_streams_request_is_known_once_its_header_ties_it_to_one() -> None:
    """Before a whole object is in (here: half of one), and only once the Track Alias is known."""
    pair = make_pair()
    rid = pair.subscribe_accepted(NS, 9)
    sid = pair.server.open_subgroup(9, 1, 0)
    pair.server.send_subgroup_object(sid, 0, bytes(10_000))
    transmits = pair.server.transmit()
    data = b"".join(t.data for t in transmits if isinstance(t, SendStreamData) and t.stream_id == sid)
    pair.client.receive_stream_data(sid, data[: len(data) // 2], False)
    assert pair.client.data_stream_request(sid) is None  # SUBSCRIBE_OK (the alias) not in yet
    for t in transmits:
        if isinstance(t, SendStreamData) and t.stream_id != sid:
            pair.client.receive_stream_data(t.stream_id, t.data, t.end_stream)
    pair.run()
    assert pair.client.data_stream_request(sid) == rid
    assert not of_type(pair.client_events, ObjectReceived)
    assert pair.client.data_stream_request(sid + 4) is None
    pair.client.receive_stream_data(sid, data[len(data) // 2 :], False)
    pair.run()
    assert [o.payload for o in of_type(pair.client_events, ObjectReceived)] == [bytes(10_000)]


def test_fetch_objects_then_fin_completes() -> None:
    pair = make_pair(fragment=997)
    rid = pair.client.fetch(NS, b"blk", Location(0, 0), Location(1, 0))
    pair.run()
    (fetch,) = of_type(pair.server_events, FetchReceived)
    assert (
        fetch.fetch_type == FetchType.STANDALONE
        and fetch.start == Location(0, 0)
        and fetch.end == Location(1, 0)
    )
    pair.server.accept_fetch(rid, end_of_track=True, end_location=Location(0, 3))
    big = bytes(range(256)) * 4096
    pair.server.send_fetch_object(rid, 0, 0, 0, b"manifest")
    pair.server.send_fetch_object(rid, 0, 0, 1, big)
    pair.server.send_fetch_end_of_range(rid, 0, 1)
    pair.server.send_fetch_object(rid, 0, None, 2, b"", publisher_priority=9)
    pair.server.finish_fetch(rid)
    pair.run()
    (ok,) = of_type(pair.client_events, FetchOkReceived)
    assert ok.end_of_track and ok.end_location == Location(0, 3)
    objs = of_type(pair.client_events, ObjectReceived)
    assert [(o.object_id, o.payload, o.subgroup_id) for o in objs] == [
        (0, b"manifest", 0),
        (1, big, 0),
        (2, b"", None),
    ]
    assert all(o.via == "fetch" and o.request_id == rid and o.track_alias is None for o in objs)
    assert objs[2].publisher_priority == 9
    assert of_type(pair.client_events, FetchRangeReceived) == [FetchRangeReceived(rid, 0, 1, False)]
    assert of_type(pair.client_events, FetchCompleted) == [FetchCompleted(rid)]
    pair.run()
    assert pair.client._requests == {} and pair.server._requests == {}


def test_fetch_with_no_objects_sends_header_and_fin() -> None:
    pair = make_pair()
    rid = pair.client.fetch(NS, b"blk", Location(2, 0), Location(3, 0))
    pair.run()
    pair.server.accept_fetch(rid, False, Location(3, 0))
    pair.server.finish_fetch(rid)
    pair.run()
    assert of_type(pair.client_events, FetchCompleted) == [FetchCompleted(rid)]
    assert not of_type(pair.client_events, ObjectReceived)


def test_joining_fetch_is_reported() -> None:
    pair = make_pair()
    sub = pair.client.subscribe(NS, b"t")
    rid = pair.client.joining_fetch(sub, 2)
    pair.run()
    (fetch,) = of_type(pair.server_events, FetchReceived)
    assert fetch.request_id == rid == 2
    assert (fetch.fetch_type, fetch.joining_request_id, fetch.joining_start) == (
        FetchType.RELATIVE_JOINING,
        sub,
        2,
    )


def test_track_status_round_trip() -> None:
    pair = make_pair()
    rid = pair.client.track_status(NS, b"blk")
    pair.run()
    (ts,) = of_type(pair.server_events, TrackStatusReceived)
    assert ts.request_id == rid and ts.track_name == b"blk"
    props = (KeyValuePair(0x04, 60000),)
    pair.server.respond_track_status(rid, MessageParameters(largest_object=Location(0, 5)), props)
    pair.run()
    (ok,) = of_type(pair.client_events, TrackStatusOkReceived)
    assert ok.parameters.largest_object == Location(0, 5) and ok.track_properties == props
    assert pair.client._requests == {} and pair.server._requests == {}
    assert pair.client._bidi == {} and pair.server._bidi == {}


def test_publish_namespace_accepted_then_withdrawn() -> None:
    pair = make_pair()
    rid = pair.server.publish_namespace(NS)  # the server side publishes too: odd Request IDs
    assert rid == 1
    pair.run()
    (pns,) = of_type(pair.client_events, PublishNamespaceReceived)
    assert pns.track_namespace == NS
    pair.client.accept_request(rid)
    pair.run()
    assert of_type(pair.server_events, RequestOkReceived) == [RequestOkReceived(rid, MessageParameters())]
    pair.server.cancel_request(rid)
    pair.run()
    assert of_type(pair.client_events, RequestCancelled) == [RequestCancelled(rid, StreamResetCode.CANCELLED)]
    assert pair.client._requests == {} and pair.server._requests == {}


def test_subscribe_namespace_namespace_and_done() -> None:
    pair = make_pair()
    rid = pair.client.subscribe_namespace((b"kvnet",))
    pair.run()
    (sns,) = of_type(pair.server_events, SubscribeNamespaceReceived)
    assert sns.track_namespace_prefix == (b"kvnet",)
    with pytest.raises(UsageError):
        pair.server.namespace(rid, (b"m",))  # not accepted yet
    pair.server.accept_request(rid)
    pair.server.namespace(rid, (b"m",))
    with pytest.raises(UsageError):
        pair.server.namespace_done(rid, (b"other",))
    pair.server.namespace_done(rid, (b"m",))
    pair.run()
    assert of_type(pair.client_events, NamespaceReceived) == [NamespaceReceived(rid, (b"m",))]
    assert of_type(pair.client_events, NamespaceDoneReceived) == [NamespaceDoneReceived(rid, (b"m",))]


def test_publish_and_objects_before_publish_ok() -> None:
    pair = make_pair()
    rid = pair.server.publish(NS, b"t", track_alias=3)
    sid = pair.server.open_subgroup(3, 0, 0)
    pair.server.send_subgroup_object(sid, 0, b"x", end_stream=True)
    pair.run()
    (pub,) = of_type(pair.client_events, PublishReceived)
    assert pub.track_alias == 3 and pub.request_id == rid
    assert [o.payload for o in of_type(pair.client_events, ObjectReceived)] == [b"x"]
    pair.client.accept_request(rid, MessageParameters(forward=1))
    pair.run()
    assert of_type(pair.server_events, PublishOkReceived) == [
        PublishOkReceived(rid, MessageParameters(forward=1))
    ]


def test_request_update_and_replies() -> None:
    pair = make_pair()
    rid = pair.subscribe_accepted(NS, 1)
    upd1 = pair.client.request_update(rid, MessageParameters(subscriber_priority=1))
    upd2 = pair.client.request_update(rid, MessageParameters(forward=0))
    assert (upd1, upd2) == (2, 4)
    pair.run()
    updates = of_type(pair.server_events, RequestUpdateReceived)
    assert [(u.request_id, u.existing_request_id) for u in updates] == [(2, rid), (4, rid)]
    with pytest.raises(UsageError):
        pair.server.accept_request(upd2)  # out of order
    pair.server.accept_request(upd1)
    pair.server.reject_request(upd2, RequestErrorCode.INTERNAL_ERROR, "no")
    pair.run()
    assert of_type(pair.client_events, RequestOkReceived) == [RequestOkReceived(upd1, MessageParameters())]
    (err,) = of_type(pair.client_events, RequestErrorReceived)
    assert err.request_id == upd2 and err.reason == "no"
    assert pair.client.established and pair.server.established


def test_rejection_keeps_session_up() -> None:
    pair = make_pair()
    rid = pair.client.subscribe(NS, b"missing")
    pair.run()
    pair.server.reject_request(rid, RequestErrorCode.DOES_NOT_EXIST, "no such block", retry_interval=5)
    pair.run()
    (err,) = of_type(pair.client_events, RequestErrorReceived)
    assert (err.request_id, err.error_code, err.reason, err.retry_interval) == (
        rid,
        RequestErrorCode.DOES_NOT_EXIST,
        "no such block",
        5,
    )
    assert pair.client.closed is None and pair.server.closed is None
    assert pair.client._requests == {} and pair.server._requests == {}
    rid2 = pair.client.subscribe(NS, b"other")
    pair.run()
    assert [e.request_id for e in of_type(pair.server_events, SubscribeReceived)] == [rid, rid2]


def test_subscriber_cancel_resets_publisher_streams() -> None:
    pair = make_pair()
    rid = pair.subscribe_accepted(NS, 1)
    sid = pair.server.open_subgroup(1, 0, 0)
    pair.server.send_subgroup_object(sid, 0, b"a")
    pair.run()
    pair.client.cancel_request(rid)
    pair.run()
    assert of_type(pair.server_events, RequestCancelled) == [RequestCancelled(rid, StreamResetCode.CANCELLED)]
    assert ResetStream(sid, StreamResetCode.CANCELLED) in pair.server_transmits
    assert StopSending(sid, StreamResetCode.CANCELLED) in pair.client_transmits
    # Objects for the stopped stream are dropped quietly (the application may not know yet).
    pair.server.send_subgroup_object(sid, 1, b"b")
    assert pair.server.transmit() == []
    pair.server.close_subgroup(sid)
    with pytest.raises(UsageError):
        pair.server.send_subgroup_object(sid, 2, b"c")
    assert pair.server._requests == {} and pair.client._requests == {}


def test_peer_reset_of_request_stream_is_request_cancelled() -> None:
    pair = make_pair()
    rid = pair.client.fetch(NS, b"blk", Location(0, 0), Location(0, 5))
    pair.run()
    pair.server.receive_stream_reset(0, StreamResetCode.EXPIRED_AUTH_TOKEN)
    assert of_type(_drain(pair), RequestCancelled) == [
        RequestCancelled(rid, StreamResetCode.EXPIRED_AUTH_TOKEN)
    ]
    with pytest.raises(UsageError):
        pair.server.accept_fetch(rid, False, Location(0, 5))


def test_stop_sending_on_subgroup_drops_later_objects() -> None:
    pair = make_pair()
    rid = pair.subscribe_accepted(NS, 1)
    sid = pair.server.open_subgroup(1, 0, 0)
    pair.run()
    pair.server.receive_stop_sending(sid, StreamResetCode.CANCELLED)
    assert pair.server.transmit() == [ResetStream(sid, StreamResetCode.CANCELLED)]
    assert pair.server.next_event() == DataStreamStopped(rid, sid, StreamResetCode.CANCELLED)
    pair.server.send_subgroup_object(sid, 0, b"dropped")
    assert pair.server.transmit() == []
    pair.server.close_subgroup(sid)
    pair.server.publish_done(rid, PublishDoneCode.SUBSCRIPTION_ENDED)
    pair.run()
    assert of_type(pair.client_events, PublishDoneReceived)[0].stream_count == 1


def test_datagram_objects() -> None:
    pair = make_pair()
    rid = pair.subscribe_accepted(NS, 77)
    pair.server.send_object_datagram(77, 4, 0, b"dg", publisher_priority=2, end_of_group=True)
    pair.server.send_object_datagram(77, 4, 1, status=ObjectStatus.END_OF_TRACK)
    pair.run()
    objs = of_type(pair.client_events, ObjectReceived)
    assert [(o.group_id, o.object_id, o.payload, o.status, o.via) for o in objs] == [
        (4, 0, b"dg", 0, "datagram"),
        (4, 1, b"", ObjectStatus.END_OF_TRACK, "datagram"),
    ]
    assert objs[0].end_of_group and objs[0].request_id == rid
    pair.client.receive_datagram(b"\x00\x63\x00\x00zz")  # unknown alias: dropped quietly
    assert pair.client.closed is None


def test_goaway_flow() -> None:
    pair = make_pair()
    early = pair.client.subscribe(NS, b"a")
    pair.run()
    pair.server.goaway(b"moqt://other.example/relay", timeout=5000)
    late = pair.client.subscribe(NS, b"b")  # crosses the GOAWAY in flight
    pair.run()
    (goaway,) = of_type(pair.client_events, GoawayReceived)
    assert goaway.new_session_uri == b"moqt://other.example/relay" and goaway.timeout == 5000
    assert goaway.last_request_id == late == 2
    assert pair.client.goaway_received
    with pytest.raises(UsageError):
        pair.client.subscribe(NS, b"c")
    (err,) = of_type(pair.client_events, RequestErrorReceived)
    assert err.request_id == late and err.error_code == RequestErrorCode.GOING_AWAY
    assert [e.request_id for e in of_type(pair.server_events, SubscribeReceived)] == [early]
    # The request accepted before GOAWAY keeps working; then the client closes cleanly.
    pair.server.accept_subscribe(early, 1)
    pair.run()
    assert of_type(pair.client_events, SubscribeOkReceived)
    pair.client.close(SessionErrorCode.NO_ERROR, "migrated")
    pair.run()
    assert pair.client.closed == (SessionErrorCode.NO_ERROR, "migrated")
    term = pair.terminated(pair.server_events)
    assert term == SessionTerminated(SessionErrorCode.NO_ERROR, "migrated", by_peer=True)


def test_client_goaway_needs_empty_uri() -> None:
    pair = make_pair()
    with pytest.raises(UsageError):
        pair.client.goaway(b"moqt://x")
    pair.client.goaway()
    with pytest.raises(UsageError):
        pair.client.goaway()
    pair.run()
    assert of_type(pair.server_events, GoawayReceived)[0].last_request_id == 1


def test_request_stream_goaway_names_the_request() -> None:
    pair = make_pair()
    rid = pair.client.subscribe(NS, b"a")
    pair.run()
    pair.server.goaway(b"moqt://elsewhere", 100, request_id=rid)
    pair.run()
    assert of_type(pair.client_events, GoawayReceived) == [
        GoawayReceived(b"moqt://elsewhere", 100, None, rid)
    ]


def test_close_tears_down_both_sides() -> None:
    pair = make_pair()
    pair.client.subscribe(NS, b"a")
    pair.run()
    pair.server.close(SessionErrorCode.NO_ERROR)
    pair.run()
    assert isinstance(pair.server_transmits[-1], CloseConnection)
    assert pair.terminated(pair.server_events) == SessionTerminated(0, "", by_peer=False)
    assert pair.terminated(pair.client_events) == SessionTerminated(0, "", by_peer=True)
    with pytest.raises(UsageError):
        pair.client.subscribe(NS, b"b")
    pair.client.receive_stream_data(3, b"\xff", False)  # ignored after close
    assert pair.client.transmit() == []


def test_usage_errors() -> None:
    pair = SessionPair()
    with pytest.raises(UsageError):
        pair.client.subscribe(NS, b"t")  # before initiate()
    pair.setup()
    with pytest.raises(UsageError):
        pair.client.initiate()
    with pytest.raises(UsageError):
        pair.client.accept_subscribe(0, 1)
    with pytest.raises(UsageError):
        pair.server.open_subgroup(5, 0, 0)
    with pytest.raises(UsageError):
        pair.client.subscribe((b"",), b"t")  # empty namespace field
    rid = pair.subscribe_accepted(NS, 1)
    with pytest.raises(UsageError):
        pair.server.accept_subscribe(rid, 2)  # second reply
    sid = pair.server.open_subgroup(1, 0, 0)
    with pytest.raises(UsageError):
        pair.server.publish_done(rid, PublishDoneCode.TRACK_ENDED)  # data stream still open
    pair.server.send_subgroup_object(sid, 5, b"a")
    with pytest.raises(UsageError):
        pair.server.send_subgroup_object(sid, 5, b"b")  # object IDs must increase
    with pytest.raises(ValueError, match="max_object_size"):
        SessionConfig(is_client=True, max_object_size=0)
    with pytest.raises(ValueError, match="path"):
        SessionConfig(is_client=False, path="/x")


def test_stream_ids_follow_quic_layout_without_reuse() -> None:
    streams = InMemoryStreams(is_client=False)
    session = MoqtSession(SessionConfig(is_client=False), streams)
    session.initiate()
    # The allocator answers the same id until data is written; the session must not reuse it.
    a = session.publish_namespace(NS)
    b = session.publish_namespace((b"other",))
    sids = [t.stream_id for t in session.transmit() if isinstance(t, SendStreamData)]
    assert sids == [3, 1, 5]
    assert (a, b) == (1, 3)


def _drain(pair: SessionPair) -> list:
    pair.run()
    return pair.server_events


def test_rejecting_a_fetch_after_objects_resets_its_stream() -> None:
    pair = make_pair()
    rid = pair.client.fetch(NS, b"blk", Location(0, 0), Location(1, 0))
    pair.run()
    pair.server.send_fetch_object(rid, 0, 0, 0, b"cached")
    pair.server.reject_request(rid, RequestErrorCode.MALFORMED_TRACK, "upstream failed")
    pair.run()
    fetch_stream = 3 + 4  # the server's first data stream after its control stream
    assert ResetStream(fetch_stream, StreamResetCode.CANCELLED) in pair.server_transmits
    assert [o.payload for o in of_type(pair.client_events, ObjectReceived)] == [b"cached"]
    (err,) = of_type(pair.client_events, RequestErrorReceived)
    assert err.error_code == RequestErrorCode.MALFORMED_TRACK
    assert pair.server._requests == {}
    with pytest.raises(UsageError):
        pair.server.finish_fetch(rid)


def test_subscriber_updates_a_publish() -> None:
    pair = make_pair()
    rid = pair.server.publish(NS, b"t", track_alias=5)
    pair.run()
    pair.client.accept_request(rid)
    upd = pair.client.request_update(rid, MessageParameters(forward=0))
    assert upd == 0  # the client's first Request ID
    pair.run()
    (event,) = of_type(pair.server_events, RequestUpdateReceived)
    assert (event.request_id, event.existing_request_id, event.parameters.forward) == (upd, rid, 0)
    pair.server.accept_request(upd)
    pair.run()
    assert of_type(pair.client_events, RequestOkReceived) == [RequestOkReceived(upd, MessageParameters())]
    pair.server.publish_done(rid, PublishDoneCode.TRACK_ENDED)
    pair.run()
    assert of_type(pair.client_events, PublishDoneReceived)[0].request_id == rid
    assert pair.server._requests == {} and pair.client._requests == {}


def test_ended_pushes_are_remembered_up_to_the_limit_oldest_first() -> None:
    # A publisher pushing many tracks on one session (a node filling a relay): each ended PUBLISH keeps
    # its alias for late objects, at most max_retired_aliases of them, the oldest forgotten first.
    pair = make_pair(max_retired_aliases=4)
    for alias in range(1, 41):
        rid = pair.server.publish(NS, b"block-%d" % alias, track_alias=alias)
        pair.run()
        pair.client.accept_request(rid)
        sid = pair.server.open_subgroup(alias, 0, 0)
        pair.server.send_subgroup_object(sid, 0, b"kv", end_stream=True)
        pair.server.publish_done(rid, PublishDoneCode.TRACK_ENDED, "complete")
        pair.run()
    assert len(of_type(pair.client_events, ObjectReceived)) == 40
    assert len(of_type(pair.client_events, PublishDoneReceived)) == 40
    assert sorted(pair.client._sub_tracks) == [37, 38, 39, 40]
    assert pair.client.closed is None and pair.server.closed is None


# -- request-header deadline (SessionConfig.request_header_timeout) ------------------------------------


def _header_timeout_pair(timeout: float = 5.0, max_timeouts: int = 3, fragment: int = 0) -> SessionPair:
    server = SessionConfig(is_client=False, request_header_timeout=timeout,
                           max_request_header_timeouts=max_timeouts)
    pair = SessionPair(SessionConfig(is_client=True), server, fragment=fragment)
    pair.setup()
    pair.take_server_events()
    return pair


@pytest.mark.parametrize("fragment", [0, 1])
def test_subscribe_namespace_and_tracks_meet_the_header_deadline(fragment: int) -> None:
    pair = _header_timeout_pair(fragment=fragment)
    pair.now = 100.0
    pair.client.subscribe_namespace(NS)
    pair.client.subscribe_tracks(NS)
    pair.run()
    kinds = [type(ev) for ev in pair.take_server_events()]
    assert kinds == [SubscribeNamespaceReceived, SubscribeTracksReceived]
    assert pair.server.get_timer() is None
    pair.server.handle_timer(1000.0)
    pair.run()
    assert pair.server.request_header_timeouts == 0
    assert not any(isinstance(t, ResetStream | StopSending) for t in pair.server_transmits)


def test_a_request_buffered_before_setup_meets_the_header_deadline() -> None:
    # Before SETUP completes the session only buffers request streams; a whole first message is on time.
    server = MoqtSession(SessionConfig(is_client=False, request_header_timeout=5.0), InMemoryStreams(False))
    server.receive_stream_data(0, encode_message(SubscribeNamespace(0, NS))[:3], False, now=1.0)
    assert server.get_timer() == 6.0
    server.receive_stream_data(0, encode_message(SubscribeNamespace(0, NS))[3:], False, now=2.0)
    assert server.get_timer() is None


def test_a_late_first_message_resets_the_stream_then_closes_the_session() -> None:
    pair = _header_timeout_pair(timeout=5.0, max_timeouts=1)
    server = pair.server
    partial = encode_message(SubscribeNamespace(0, NS))[:4]
    server.receive_stream_data(0, partial, False, now=10.0)
    server.receive_stream_data(4, partial[:1], False, now=11.0)
    assert server.get_timer() == 15.0
    server.handle_timer(14.9)
    assert server.transmit() == [] and server.request_header_timeouts == 0
    server.handle_timer(15.0)
    code = StreamResetCode.DELIVERY_TIMEOUT
    assert server.transmit() == [ResetStream(0, code), StopSending(0, code)]
    assert server.request_header_timeouts == 1 and server.get_timer() == 16.0
    server.receive_stream_data(0, encode_message(SubscribeNamespace(0, NS))[4:], False, now=15.5)
    assert server.next_event() is None  # the reset stream's late bytes are ignored
    server.handle_timer(16.0)  # one more than max_request_header_timeouts
    assert server.closed is not None and server.closed[0] == SessionErrorCode.CONTROL_MESSAGE_TIMEOUT
    assert server.get_timer() is None


def test_header_deadline_ends_with_the_stream() -> None:
    pair = _header_timeout_pair()
    pair.server.receive_stream_data(0, b"\x50", False, now=1.0)
    pair.server.receive_stream_reset(0, StreamResetCode.CANCELLED)
    pair.server.handle_timer(10.0)  # the deadline of a stream that is gone does nothing
    assert pair.server.request_header_timeouts == 0 and pair.server.get_timer() is None
    pair.server.receive_stream_data(4, b"\x50", True, now=1.0)  # FIN inside the first message
    assert pair.server.closed is not None and pair.server.get_timer() is None


def test_header_timeout_needs_a_clock() -> None:
    with pytest.raises(ValueError, match="request_header_timeout"):
        SessionConfig(is_client=False, request_header_timeout=0)
    server = MoqtSession(SessionConfig(is_client=False, request_header_timeout=1.0), InMemoryStreams(False))
    with pytest.raises(UsageError, match="now"):
        server.receive_stream_data(0, b"\x50", False)
    server.receive_stream_data(0, b"\x50", False, now=0.0)  # the refused call changed nothing
    assert server.get_timer() == 1.0
