"""Misbehaving peers against a real relay: the offender's session ends with the draft's code (or its
stream/request does), other sessions keep working, and the relay's memory stays bounded.

The relay runs in the test's own process (``tests.relay.inprocess``, real QUIC on loopback), except where a
test bounds its memory: that needs the relay's own process (its resident set size).

The raw peer is aioquic's ``QuicConnectionProtocol`` writing arbitrary bytes on QUIC streams: a real
network peer with no MoQT library in the way.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
from collections.abc import AsyncIterator

import pytest

from kvnet.net.errors import ConnectionClosed, RequestRejected, StreamResetError
from proto.data import SubgroupHeader, encode_subgroup_header, subgroup_object_prefix
from proto.errors import SessionErrorCode, StreamResetCode
from proto.messages import Location, Publish, Setup, TrackStatus, encode_message
from tests.helpers.processes import CertDir, RelayProcess
from tests.helpers.waiting import async_wait_until, scaled
from tests.relay.conftest import RelayFactory
from tests.relay.inprocess import InProcessRelay, relay_in_process
from tests.relay.peers import (
    NS,
    Publisher,
    RawPeer,
    connect_client,
    fetch_track,
    raw_peer,
    track_objects,
)

# Python + aioquic + the relay at rest is ~60 MB; this leaves room for the cache and buffers we allow.
RSS_LIMIT = 400 * 1024 * 1024


@pytest.fixture
async def relay(cert_dir: CertDir) -> AsyncIterator[InProcessRelay]:
    """A relay in the test's process (in place of conftest's relay process), stopped after the test."""
    async with relay_in_process(cert_dir) as running:
        yield running


async def expect_close(peer: RawPeer, code: int) -> str:
    err, reason = await asyncio.wait_for(peer.terminated, scaled(10))
    assert err == code, (err, reason)
    return reason


async def still_serves(
    rp: RelayProcess | InProcessRelay, cert_dir: CertDir, pub: Publisher, name: bytes, n: int
) -> None:
    c = await connect_client(rp.url, str(cert_dir.ca))
    try:
        assert await fetch_track(c, name, n) == pub.tracks[name]
    finally:
        await c.close_session()


async def start_pub(
    rp: RelayProcess | InProcessRelay, cert_dir: CertDir, tracks: dict[bytes, list[bytes]]
) -> Publisher:
    return await Publisher(await connect_client(rp.url, str(cert_dir.ca)), tracks).start()


async def test_random_udp_datagrams_do_not_disturb(relay: InProcessRelay, cert_dir: CertDir) -> None:
    pub = await start_pub(relay, cert_dir, {b"t": track_objects(b"t")})
    rnd = random.Random(1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _ in range(2000):
            s.sendto(rnd.randbytes(rnd.randrange(1, 1400)), ("127.0.0.1", relay.port))
    await still_serves(relay, cert_dir, pub, b"t", 4)
    await pub.stop()
    assert relay.running


async def test_random_bytes_on_streams_close_only_that_session(
    relay: InProcessRelay, cert_dir: CertDir
) -> None:
    pub = await start_pub(relay, cert_dir, {b"t": track_objects(b"t")})
    rnd = random.Random(2)
    for i in range(6):
        async with raw_peer(relay.port, cert_dir.ca) as peer:
            peer.setup()
            uni = i % 2 == 0
            # Random bytes behind a start that is invalid for the stream kind: 0x3F is a subgroup type with
            # the reserved Subgroup ID mode; 0x01 is a reserved message type (here with a 16-byte length).
            peer.send(peer.new_stream(uni=uni), (b"\x3f" if uni else b"\x01\x00\x10") + rnd.randbytes(3000))
            reason = await expect_close(peer, SessionErrorCode.PROTOCOL_VIOLATION)
            assert reason
    await still_serves(relay, cert_dir, pub, b"t", 4)
    await pub.stop()


async def test_malformed_control_message(relay: InProcessRelay, cert_dir: CertDir) -> None:
    async with raw_peer(relay.port, cert_dir.ca) as peer:
        ctrl = peer.new_stream(True)
        # SETUP, then a TRACK_STATUS whose Length says 5 bytes but whose payload is a truncated namespace.
        peer.send(ctrl, encode_message(Setup()))
        peer.send(peer.new_stream(False), b"\x0d\x00\x05\x00\x05\xff\xff\xff")
        await expect_close(peer, SessionErrorCode.PROTOCOL_VIOLATION)


async def test_invalid_and_duplicate_request_ids(relay: InProcessRelay, cert_dir: CertDir) -> None:
    for ids in ((1,), (0, 0)):
        async with raw_peer(relay.port, cert_dir.ca) as peer:
            peer.setup()
            for rid in ids:  # odd = server parity; a repeat is a duplicate
                peer.send(peer.new_stream(False), encode_message(TrackStatus(rid, NS, b"x")))
            await expect_close(peer, SessionErrorCode.INVALID_REQUEST_ID)


async def test_oversized_control_message_length(relay: InProcessRelay, cert_dir: CertDir) -> None:
    async with raw_peer(relay.port, cert_dir.ca) as peer:
        peer.setup()
        # A maximal 65535-byte TRACK_STATUS: the namespace inside claims more fields than fit.
        peer.send(peer.new_stream(False), b"\x0d\xff\xff\x00\x20" + b"\x01" * 65533)
        await expect_close(peer, SessionErrorCode.PROTOCOL_VIOLATION)


async def test_oversized_object_is_refused(cert_dir: CertDir) -> None:
    async with relay_in_process(cert_dir, "--max-object-bytes", "10000") as rp:
        await _oversized_object_is_refused(rp, cert_dir)


async def _oversized_object_is_refused(rp: InProcessRelay, cert_dir: CertDir) -> None:
    pub = await start_pub(rp, cert_dir, {b"t": track_objects(b"t")})
    async with raw_peer(rp.port, cert_dir.ca) as peer:
        peer.setup()
        peer.send(peer.new_stream(False), encode_message(Publish(0, (b"evil",), b"big", 7)))
        header = SubgroupHeader(7, 0)
        sid = peer.new_stream(True)
        peer.send(sid, encode_subgroup_header(header) + subgroup_object_prefix(header, 0, None, 1_000_000))
        for _ in range(20):
            peer.send(sid, os.urandom(50_000))
        await async_wait_until(lambda: sid in peer.stop_sending, "STOP_SENDING on the oversized object")
        assert peer.stop_sending.get(sid) == StreamResetCode.EXCESSIVE_LOAD
    await still_serves(rp, cert_dir, pub, b"t", 4)
    await pub.stop()


async def test_peer_that_never_reads(
    cert_dir: CertDir, relay_factory: RelayFactory
) -> None:
    rp = relay_factory("--slow-peer-timeout", "2", "--max-buffered-bytes", "1000000")
    big = track_objects(b"big", 8, 500_000)  # 4 MB
    pub = await start_pub(rp, cert_dir, {b"big": big, b"small": track_objects(b"small")})
    await still_serves(rp, cert_dir, pub, b"big", 8)  # now cached
    async with raw_peer(rp.port, cert_dir.ca) as peer:
        await peer.setup_done()
        # Ten fetches of 4 MB each, then we stop reading (and acknowledging) anything.
        from proto.messages import Fetch, FetchType, StandaloneFetch

        for i in range(10):
            fetch = Fetch(
                2 * i, FetchType.STANDALONE, StandaloneFetch(NS, b"big", Location(0, 0), Location(0, 8))
            )
            peer.send(peer.new_stream(False), encode_message(fetch))
        # The relay has answered a fetch on its request stream before we stop reading.
        await async_wait_until(lambda: any(sid % 4 == 0 for sid in peer.data), "the relay answering a fetch")
        peer._transport.pause_reading()  # type: ignore[union-attr]
        # Meanwhile another session is served normally.
        await still_serves(rp, cert_dir, pub, b"small", 4)
        assert await rp.wait_metric('kvnet_relay_limit_rejections_total{limit="slow_peer"}', 1) >= 1
        assert rp.rss_bytes() < RSS_LIMIT
        peer._transport.resume_reading()  # type: ignore[union-attr]
    await still_serves(rp, cert_dir, pub, b"small", 4)
    await pub.stop()


async def test_publisher_disconnects_mid_object(relay_factory: RelayFactory, cert_dir: CertDir) -> None:
    relay = relay_factory()
    full = track_objects(b"cut", 4, 2_000_000)
    bad = await start_pub(relay, cert_dir, {b"cut": full})
    bad.cut_after = 2  # sends objects 0 and 1 (2 MB each), then vanishes while they are in flight
    sub = await connect_client(relay.url, str(cert_dir.ca))
    try:
        failed: Exception | None = None
        try:
            await fetch_track(sub, b"cut", 4)
        except (RequestRejected, StreamResetError, ConnectionClosed) as exc:
            failed = exc  # a reset, REQUEST_ERROR or cut stream: never a clean end of a partial track
        assert failed is not None
        m = await relay.ametrics()
        assert m["kvnet_relay_cache_objects"] == 0  # nothing partial was stored
        good = await start_pub(relay, cert_dir, {b"cut": full})
        assert await fetch_track(sub, b"cut", 4) == full
        assert good.counts["fetch"] == 1
        await good.stop()
    finally:
        await sub.close_session()
    assert relay.rss_bytes() < RSS_LIMIT


async def test_subscriber_disconnects_mid_object(relay_factory: RelayFactory, cert_dir: CertDir) -> None:
    relay = relay_factory()
    big = track_objects(b"big", 4, 2_000_000)
    pub = await start_pub(relay, cert_dir, {b"big": big, b"small": track_objects(b"small")})
    for _ in range(3):
        quitter = await connect_client(relay.url, str(cert_dir.ca))
        h = await quitter.fetch(NS, b"big", Location(0, 0), Location(0, 4))
        async for _obj in h:
            break  # one object in, with megabytes still in flight toward us
        quitter.close()  # the transport goes away without a MoQT close
    await still_serves(relay, cert_dir, pub, b"big", 4)
    await still_serves(relay, cert_dir, pub, b"small", 4)
    await pub.stop()
    assert relay.proc.poll() is None and relay.rss_bytes() < RSS_LIMIT
