"""Fuzzing in the spirit of h11's afl-server: whatever bytes the peer sends, the session yields events
or a SessionTerminated, never an exception. Inputs are random bytes and mutations of valid traffic,
fed whole and one byte at a time on control, request and data streams and as datagrams."""

from __future__ import annotations

import random

import pytest

from proto.data import (
    FetchHeader,
    FetchObject,
    FetchObjectEncoder,
    ObjectDatagram,
    SubgroupHeader,
    SubgroupIdMode,
    SubgroupObject,
    encode_datagram,
    encode_fetch_header,
    encode_subgroup_header,
    encode_subgroup_object,
)
from proto.events import SessionTerminated
from proto.messages import (
    Fetch,
    FetchOk,
    FetchType,
    Goaway,
    KeyValuePair,
    Location,
    MessageParameters,
    Namespace,
    PublishNamespace,
    RequestError,
    RequestOk,
    RequestUpdate,
    Setup,
    StandaloneFetch,
    Subscribe,
    SubscribeNamespace,
    SubscribeOk,
    TrackStatus,
    encode_message,
)
from proto.session import MoqtSession, SessionConfig
from tests.helpers.sessions import InMemoryStreams, make_pair

NS = (b"kvnet", b"m")


def _corpus() -> list[bytes]:
    """Valid stream and datagram prefixes to mutate."""
    fetch_enc = FetchObjectEncoder()
    header = SubgroupHeader(1, 2, 3, SubgroupIdMode.EXPLICIT, 7, has_properties=True)
    return [
        encode_message(Setup(implementation=b"x")) + encode_message(Goaway(b"", 10, 0)),
        encode_message(Subscribe(0, NS, b"t", MessageParameters(forward=1, subscriber_priority=3)))
        + encode_message(RequestUpdate(2, MessageParameters(forward=0))),
        encode_message(
            Fetch(0, FetchType.STANDALONE, StandaloneFetch(NS, b"t", Location(0, 0), Location(2, 0)))
        ),
        encode_message(TrackStatus(0, NS, b"t")),
        encode_message(PublishNamespace(0, NS)),
        encode_message(SubscribeNamespace(0, NS)) + encode_message(Namespace((b"x",))),
        encode_message(SubscribeOk(1, MessageParameters(largest_object=Location(1, 1))))
        + encode_message(RequestOk())
        + encode_message(RequestError(0x10, 5, "x")),
        encode_message(FetchOk(False, Location(1, 0))),
        encode_subgroup_header(header)
        + encode_subgroup_object(header, SubgroupObject(3, b"abc", properties=(KeyValuePair(2, 5),)), None),
        encode_fetch_header(FetchHeader(0)) + fetch_enc.encode(FetchObject(0, 0, 0, 5, b"payload")),
        encode_datagram(ObjectDatagram(1, 0, 4, 9, b"dg")),
    ]


def _mutate(rng: random.Random, data: bytes) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(4)
        pos = rng.randrange(len(buf) + 1)
        if op == 0 and buf:
            buf[min(pos, len(buf) - 1)] = rng.randrange(256)
        elif op == 1:
            buf[pos:pos] = rng.randbytes(rng.randint(1, 8))
        elif op == 2 and buf:
            del buf[pos : pos + rng.randint(1, 8)]
        else:
            buf = buf[:pos]
    return bytes(buf)


def _input(rng: random.Random, corpus: list[bytes]) -> bytes:
    roll = rng.random()
    if roll < 0.25:
        return rng.randbytes(rng.randint(0, 64))
    if roll < 0.45:
        return rng.choice(corpus)  # valid traffic moves the session into deeper states
    return _mutate(rng, rng.choice(corpus))


def _established(rng: random.Random) -> tuple[MoqtSession, bool]:
    """A session with SETUP done and, sometimes, requests of its own in flight."""
    pair = make_pair(max_object_size=4096, max_control_message_size=512)
    is_client = rng.random() < 0.5
    session = pair.client if is_client else pair.server
    if rng.random() < 0.5:
        session.subscribe(NS, b"t")
        session.fetch(NS, b"t", Location(0, 0), Location(3, 0))
        session.subscribe_namespace(NS)
        session.transmit()
    while session.next_event() is not None:
        pass
    return session, is_client


def _feed(
    session: MoqtSession, rng: random.Random, is_client: bool, data: bytes, byte_at_a_time: bool
) -> None:
    peer_bit = 1 if is_client else 0
    target = rng.randrange(6)
    if target == 0:
        session.receive_datagram(data)
        return
    if target == 1:
        stream_id = 2 | peer_bit  # the peer's control stream
    elif target == 2:
        stream_id = 4 * rng.randrange(3) | peer_bit  # a peer request stream
    elif target == 3:
        stream_id = 4 * rng.randrange(3)  # one of our request streams (clients) / peer's (servers)
    else:
        stream_id = 4 * rng.randrange(1, 4) | 2 | peer_bit  # a peer data stream
    fin = rng.random() < 0.3
    if byte_at_a_time:
        for i in range(len(data)):
            session.receive_stream_data(stream_id, data[i : i + 1], fin and i == len(data) - 1)
        if not data:
            session.receive_stream_data(stream_id, b"", fin)
    else:
        session.receive_stream_data(stream_id, data, fin)
    if rng.random() < 0.1:
        session.receive_stream_reset(stream_id, rng.randrange(20))
    if rng.random() < 0.1:
        session.receive_stop_sending(stream_id, rng.randrange(20))


def _run(seed: int, rounds: int) -> None:
    rng = random.Random(seed)
    corpus = _corpus()
    session, is_client = _established(rng)
    for _ in range(rounds):
        _feed(session, rng, is_client, _input(rng, corpus), byte_at_a_time=rng.random() < 0.3)
        session.transmit()
        terminated = False
        while (event := session.next_event()) is not None:
            terminated = terminated or isinstance(event, SessionTerminated)
        if terminated or session.closed is not None:
            assert session.closed is not None
            session, is_client = _established(rng)


@pytest.mark.parametrize("seed", range(8))
def test_fuzz_session_never_raises(seed: int) -> None:
    _run(seed, rounds=400)


def test_fuzz_before_setup_never_raises() -> None:
    rng = random.Random(99)
    corpus = _corpus()
    for _ in range(600):
        is_client = rng.random() < 0.5
        session = MoqtSession(SessionConfig(is_client=is_client), InMemoryStreams(is_client))
        initiate_first = rng.random() < 0.5
        if initiate_first:
            session.initiate()
        if rng.random() < 0.7:  # the peer's SETUP, so that buffered input gets processed
            session.receive_stream_data(3 if is_client else 2, encode_message(Setup()), False)
        for _ in range(3):
            _feed(session, rng, session.is_client, _input(rng, corpus), byte_at_a_time=False)
        if not initiate_first and session.closed is None:
            session.initiate()
        session.transmit()
        while session.next_event() is not None:
            pass


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(100, 132))
def test_fuzz_session_never_raises_long(seed: int) -> None:
    _run(seed, rounds=5000)
