"""The relay end to end: relays in the test's own process (``tests.relay.inprocess``), real QUIC peers on
loopback; the drain on SIGTERM is of a real ``python -m relay`` process (its signal, exit code and log)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from kvnet.net.errors import RequestRejected
from proto.errors import RequestErrorCode
from proto.messages import Location
from tests.helpers.processes import CertDir, sigterm
from tests.helpers.waiting import DEFAULT_TIMEOUT, scaled
from tests.relay.conftest import RelayFactory
from tests.relay.inprocess import InProcessRelay, relay_in_process
from tests.relay.peers import NS, Publisher, connect_client, fetch_track, track_objects


@pytest.fixture
async def relay(cert_dir: CertDir) -> AsyncIterator[InProcessRelay]:
    """A relay in the test's process (in place of conftest's relay process), stopped after the test."""
    async with relay_in_process(cert_dir) as running:
        yield running


async def publisher(rp: InProcessRelay, cert_dir: CertDir, tracks: dict[bytes, list[bytes]]) -> Publisher:
    conn = await connect_client(rp.url, str(cert_dir.ca))
    return await Publisher(conn, tracks).start()


async def _payloads(handle: object) -> list[bytes]:
    return [o.payload async for o in handle if o.payload]  # type: ignore[attr-defined]


async def test_publish_then_fetch_and_served_from_cache_after_publisher_left(
    relay: InProcessRelay, cert_dir: CertDir
) -> None:
    objs = track_objects(b"block-a", 5)
    pub = await publisher(relay, cert_dir, {b"block-a": objs})
    sub = await connect_client(relay.url, str(cert_dir.ca))
    try:
        assert await fetch_track(sub, b"block-a", 5) == objs
        assert pub.counts["fetch"] == 1
        await pub.stop()
        # The publisher is gone: only the cache can answer now.
        assert await fetch_track(sub, b"block-a", 5) == objs
        st = await sub.track_status(NS, b"block-a")
        assert st.parameters.largest_object == Location(0, 4)
        assert relay.value("requests_total", outcome="cache_hit", type="fetch") == 1
        assert relay.value("requests_total", outcome="cache_hit", type="track_status") == 1
        assert relay.value("cache_objects") == 5
    finally:
        await sub.close_session()


async def test_unknown_track_and_no_route_are_does_not_exist(
    relay: InProcessRelay, cert_dir: CertDir
) -> None:
    pub = await publisher(relay, cert_dir, {b"x": track_objects(b"x")})
    sub = await connect_client(relay.url, str(cert_dir.ca))
    try:
        with pytest.raises(RequestRejected) as ei:
            await sub.track_status(NS, b"not-there")
        assert ei.value.code == RequestErrorCode.DOES_NOT_EXIST
        with pytest.raises(RequestRejected) as ei:
            await fetch_track(sub, b"nope", 3, ns=(b"other", b"ns"))
        assert ei.value.code == RequestErrorCode.DOES_NOT_EXIST
        assert pub.counts["track_status"] == 1 and pub.counts["fetch"] == 0
    finally:
        await pub.stop()
        await sub.close_session()


async def test_track_status_forwarded_to_publisher(relay: InProcessRelay, cert_dir: CertDir) -> None:
    pub = await publisher(relay, cert_dir, {b"b": track_objects(b"b", 7)})
    sub = await connect_client(relay.url, str(cert_dir.ca))
    try:
        st = await sub.track_status(NS, b"b")
        assert st.parameters.largest_object == Location(0, 6)
        assert pub.counts["track_status"] == 1
    finally:
        await pub.stop()
        await sub.close_session()


async def test_publish_subscribe_fanout_publisher_sends_once(
    relay: InProcessRelay, cert_dir: CertDir
) -> None:
    objs = track_objects(b"live", 6)
    pub = await publisher(relay, cert_dir, {b"live": objs})
    subs = [await connect_client(relay.url, str(cert_dir.ca)) for _ in range(3)]
    try:
        handles = [await s.subscribe(NS, b"live") for s in subs]
        assert pub.counts["subscribe"] == 1  # one upstream subscription for three subscribers
        pub.live.set()

        results = await asyncio.wait_for(asyncio.gather(*(_payloads(h) for h in handles)), scaled(20))
        for r in results:
            assert r == objs
        assert pub.objects_sent == len(objs)
        assert relay.value("requests_total", outcome="joined", type="subscribe") == 2
        assert relay.value("upstream_requests_total", type="subscribe") == 1
    finally:
        await pub.stop()
        for s in subs:
            await s.close_session()


async def test_concurrent_fetches_coalesce(relay: InProcessRelay, cert_dir: CertDir) -> None:
    objs = track_objects(b"hot", 8, 20000)
    pub = await publisher(relay, cert_dir, {b"hot": objs})
    pub.fetch_delay = 0.3
    clients = [await connect_client(relay.url, str(cert_dir.ca)) for _ in range(4)]
    try:
        results = await asyncio.gather(*(fetch_track(c, b"hot", 8) for c in clients for _ in range(2)))
        assert all(r == objs for r in results)
        assert pub.counts["fetch"] == 1
        assert relay.value("upstream_requests_total", type="fetch") == 1
        assert relay.value("cache_coalesced_total") == 7
    finally:
        await pub.stop()
        for c in clients:
            await c.close_session()


async def test_edge_origin_chain(cert_dir: CertDir) -> None:
    async with (
        relay_in_process(cert_dir) as origin,
        relay_in_process(cert_dir, "--upstream", origin.url) as edge,
    ):
        await _edge_origin_chain(origin, edge, cert_dir)


async def _edge_origin_chain(origin: InProcessRelay, edge: InProcessRelay, cert_dir: CertDir) -> None:
    objs = track_objects(b"chained", 4)
    pub = await publisher(origin, cert_dir, {b"chained": objs})
    sub = await connect_client(edge.url, str(cert_dir.ca))
    try:
        st = await sub.track_status(NS, b"chained")
        assert st.parameters.largest_object == Location(0, 3)
        with pytest.raises(RequestRejected) as ei:
            await sub.track_status(NS, b"missing")
        assert ei.value.code == RequestErrorCode.DOES_NOT_EXIST
        assert await fetch_track(sub, b"chained", 4) == objs
        assert await fetch_track(sub, b"chained", 4) == objs
        assert pub.counts["fetch"] == 1
        assert edge.value("upstream_requests_total", type="fetch") == 1
        assert edge.value("requests_total", outcome="cache_hit", type="fetch") == 1
        assert origin.value("upstream_requests_total", type="fetch") == 1
        # TRACK_STATUS of a track the edge now holds whole is answered at the edge.
        before = pub.counts["track_status"]
        await sub.track_status(NS, b"chained")
        assert pub.counts["track_status"] == before
        # A live subscription crosses both relays too.
        handle = await sub.subscribe(NS, b"chained")
        assert pub.counts["subscribe"] == 1
        pub.live.set()
        got = await asyncio.wait_for(_payloads(handle), scaled(20))
        assert got == objs
    finally:
        await pub.stop()
        await sub.close_session()


async def test_eviction_under_small_budget(cert_dir: CertDir) -> None:
    async with relay_in_process(cert_dir, "--cache-bytes", "60000") as rp:
        await _eviction_under_small_budget(rp, cert_dir)


async def _eviction_under_small_budget(rp: InProcessRelay, cert_dir: CertDir) -> None:
    tracks = {n: track_objects(n, 4, 10000) for n in (b"e1", b"e2", b"e3")}  # ~40 KB each
    pub = await publisher(rp, cert_dir, tracks)
    sub = await connect_client(rp.url, str(cert_dir.ca))
    try:
        for n in (b"e1", b"e2", b"e3"):
            assert await fetch_track(sub, n, 4) == tracks[n]
        assert rp.value("cache_evictions_total") >= 2
        assert rp.value("cache_bytes") <= 60000
        assert await fetch_track(sub, b"e1", 4) == tracks[b"e1"]
        assert pub.counts["fetch"] == 4  # e1 was evicted, so it went upstream again
    finally:
        await pub.stop()
        await sub.close_session()


async def test_goaway_on_sigterm(
    cert_dir: CertDir, relay_factory: RelayFactory
) -> None:
    rp = relay_factory("--drain-timeout", "2")
    client = await connect_client(rp.url, str(cert_dir.ca))
    t0 = time.monotonic()
    sigterm(rp)
    await asyncio.wait_for(client.goaway_event.wait(), scaled(5))
    assert client.goaway is not None and client.goaway.timeout == 2000
    # The client does not leave; the relay closes it at the deadline and exits.
    code = await asyncio.to_thread(rp.proc.wait, scaled(DEFAULT_TIMEOUT))
    elapsed = time.monotonic() - t0
    assert code == 0
    assert elapsed > 1.9, elapsed  # it waited for the drain deadline (no upper bound: load moves it)
    assert "stopped" in rp.log()
