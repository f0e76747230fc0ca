"""Relay-wide caps, cache shares per tenant, and the idle / slowloris / slow-reader / SETUP timeouts, each
against a relay in the test's own process (``tests.relay.inprocess``, real QUIC on loopback): the offender
is refused or cut off with the draft's code, a well-behaved peer keeps being served. The bound on what
never-ended pushes hold is measured on a relay process (its resident set size)."""

from __future__ import annotations

import asyncio
import itertools
import time

from kvnet.net.config import TlsConfig
from kvnet.net.connection import MoqtConnection
from kvnet.net.endpoint import connect
from kvnet.net.errors import ConnectionClosed, RequestRejected, StreamResetError
from proto.data import ObjectStatus
from proto.errors import PublishDoneCode, RequestErrorCode, SessionErrorCode, StreamResetCode
from proto.messages import Fetch, FetchType, Location, StandaloneFetch, TrackStatus, encode_message
from tests.helpers.connections import client_config, client_limits
from tests.helpers.processes import CertDir
from tests.helpers.waiting import DEFAULT_TIMEOUT, async_wait_until, scaled
from tests.relay.conftest import InProcessRelays, RelayFactory
from tests.relay.peers import (
    NS,
    Publisher,
    RawPeer,
    connect_client,
    fetch_track,
    raw_peer,
    track_objects,
)


async def test_global_request_cap_refuses_floods_but_serves_a_light_session(
    cert_dir: CertDir, in_process_relays: InProcessRelays
) -> None:
    rp = await in_process_relays("--max-requests", "6", "--reserved-requests-per-session", "2")
    tracks = {f"h{i}".encode(): track_objects(f"h{i}".encode()) for i in range(4)}
    tracks[b"good"] = track_objects(b"good")
    pub = await Publisher(await connect_client(rp.url, str(cert_dir.ca)), tracks).start()
    good = await connect_client(rp.url, str(cert_dir.ca))
    hogs = [await connect_client(rp.url, str(cert_dir.ca)) for _ in range(3)]
    try:
        assert await fetch_track(good, b"good", 4) == tracks[b"good"]  # now cached
        pub.fetch_gate = asyncio.Event()  # the flood's fetches hold their slots until the gate opens
        # Three sessions, each well within its own limit (8192), together far beyond the relay's 6.
        flood = [
            asyncio.ensure_future(fetch_track(h, name, 4)) for h in hogs for name in tracks if name != b"good"
        ]

        async def flood_settled() -> bool:
            # Every flood request is refused or holds a slot (the publisher's namespace holds one more).
            held = rp.value("requests_inflight") - 1
            refused = rp.value("limit_rejections_total", limit="requests_global")
            return held + refused == len(flood)

        await async_wait_until(flood_settled, "every flood request refused or holding a slot")
        # Served while the flood holds the relay's slots: held fetches cannot finish before the gate opens.
        assert await fetch_track(good, b"good", 4) == tracks[b"good"]
        pub.fetch_gate.set()
        results = await asyncio.gather(*flood, return_exceptions=True)
        refused = [r for r in results if isinstance(r, RequestRejected)]
        served = [r for r in results if isinstance(r, list)]
        assert len(refused) >= 4 and served, results
        assert all(r.code == RequestErrorCode.EXCESSIVE_LOAD and r.retry_interval > 0 for r in refused)
        assert rp.value("limit_rejections_total", limit="requests_global") == len(refused)
        assert rp.value("requests_inflight") == 1  # only the publisher's namespace is left
    finally:
        await pub.stop()
        for c in (good, *hogs):
            await c.close_session()


async def test_session_request_limit_refusals_are_counted(
    cert_dir: CertDir, in_process_relays: InProcessRelays
) -> None:
    # The per-session cap is enforced by the session itself, before the relay sees the request; the
    # refusals still show in the relay's metrics.
    rp = await in_process_relays("--max-requests-per-session", "4")
    tracks = {f"t{i}".encode(): track_objects(f"t{i}".encode()) for i in range(10)}
    pub = await Publisher(await connect_client(rp.url, str(cert_dir.ca)), tracks).start()
    client = await connect_client(rp.url, str(cert_dir.ca))
    try:
        pub.fetch_delay = 1.0  # the first fetches hold the session's slots
        fetches = (fetch_track(client, name, 4) for name in tracks)
        results = await asyncio.gather(*fetches, return_exceptions=True)
        refused = [r for r in results if isinstance(r, RequestRejected)]
        assert refused and all(r.code == RequestErrorCode.EXCESSIVE_LOAD for r in refused), results
        assert any(isinstance(r, list) for r in results), results
        limit = "session_requests_in_flight"
        assert await rp.wait_value("limit_rejections_total", len(refused), limit=limit) == len(refused)
    finally:
        await pub.stop()
        await client.close_session()


def send_fetches(peer: RawPeer, name: bytes, objects: int, count: int) -> None:
    """``count`` standalone FETCHes of objects 0..``objects``-1 of track ``name``, each on its own stream."""
    for i in range(count):
        fetch = Fetch(
            2 * i, FetchType.STANDALONE, StandaloneFetch(NS, name, Location(0, 0), Location(0, objects))
        )
        peer.send(peer.new_stream(False), encode_message(fetch))


async def test_per_address_buffered_bytes_quota_cuts_that_address_only(
    cert_dir: CertDir, in_process_relays: InProcessRelays
) -> None:
    # The global cap is far away; one address's quota is not. A peer from 127.0.0.1 that stops reading
    # is cut off for its address's quota while a reader from 127.0.0.3 keeps being served. The track is
    # smaller than the quota, so the reader cannot be over it however slowly a loaded machine lets it
    # read; the hog asks for it twice, which is over it once the relay has written both.
    rp = await in_process_relays("--max-buffered-bytes-per-address", "1000000", "--slow-peer-timeout", "60")
    big = track_objects(b"big", 8, 100_000)
    pub = Publisher(await connect_client(rp.url, str(cert_dir.ca)), {b"big": big, b"s": track_objects(b"s")})
    await pub.start()
    other = await connect(rp.url, client_config(), TlsConfig(ca_file=cert_dir.ca), local_host="127.0.0.3",
                          limits=client_limits())
    try:
        assert await fetch_track(other, b"big", 8) == big  # cached, and read by a peer that reads
        async with raw_peer(rp.port, cert_dir.ca) as hog:
            await hog.setup_done()
            hog._transport.pause_reading()  # type: ignore[union-attr]
            send_fetches(hog, b"big", 8, 2)
            # Cut off: its FETCH reset if still open, else (everything already handed to QUIC) the session
            # closed; either is counted under the per-address label.
            quota = "buffered_bytes_per_address"
            await async_wait_until(
                lambda: rp.value("limit_rejections_total", limit=quota)
                + rp.value("sessions_closed_total", reason=quota) >= 1,
                "the hog cut off for its address's quota",
            )
            assert await fetch_track(other, b"s", 4) == pub.tracks[b"s"]
            assert rp.value("limit_rejections_total", limit="buffered_bytes_global") == 0
            hog._transport.resume_reading()  # type: ignore[union-attr]
    finally:
        await pub.stop()
        await other.close_session()


async def test_global_buffered_bytes_cap_cuts_the_biggest_holder(
    cert_dir: CertDir, in_process_relays: InProcessRelays
) -> None:
    rp = await in_process_relays("--max-buffered-bytes-total", "3000000", "--slow-peer-timeout", "60")
    # 2.4 MB: a reader cannot be over the cap however slowly a loaded machine lets it read; the hog asks
    # for it twice, more than the relay may buffer for everybody.
    big = track_objects(b"big", 8, 300_000)
    pub = Publisher(await connect_client(rp.url, str(cert_dir.ca)), {b"big": big, b"s": track_objects(b"s")})
    await pub.start()
    good = await connect_client(rp.url, str(cert_dir.ca))
    try:
        assert await fetch_track(good, b"big", 8) == big  # cached, and read by a peer that reads
        async with raw_peer(rp.port, cert_dir.ca) as hog:
            await hog.setup_done()
            hog._transport.pause_reading()  # type: ignore[union-attr]
            send_fetches(hog, b"big", 8, 2)
            cut = await rp.wait_value("limit_rejections_total", 1, limit="buffered_bytes_global")
            assert cut >= 1

            async def served_again() -> bool:
                try:
                    assert await fetch_track(good, b"s", 4) == pub.tracks[b"s"]
                except RequestRejected as exc:
                    assert exc.code == RequestErrorCode.EXCESSIVE_LOAD
                    return False
                return True

            # Once the holder is cut off (and, still holding, closed), others are served again.
            await async_wait_until(served_again, "relay recovering from the buffer cap")
            hog._transport.resume_reading()  # type: ignore[union-attr]
    finally:
        await pub.stop()
        await good.close_session()


async def test_tenant_share_flood_does_not_evict_other_tenant(
    cert_dir: CertDir, in_process_relays: InProcessRelays
) -> None:
    rp = await in_process_relays("--cache-bytes", "2000000", "--cache-share-bytes", "600000")
    ns_a = (b"kvnet", b"v1", b"fp", b"tenant-a")
    ns_b = (b"kvnet", b"v1", b"fp", b"tenant-b")
    tracks_a = {f"a{i}".encode(): track_objects(f"a{i}".encode(), 4, 50_000) for i in range(30)}
    tracks_b = {f"b{i}".encode(): track_objects(f"b{i}".encode(), 4, 50_000) for i in range(2)}
    pub_a = await Publisher(await connect_client(rp.url, str(cert_dir.ca)), tracks_a, ns_a).start()
    pub_b = await Publisher(await connect_client(rp.url, str(cert_dir.ca)), tracks_b, ns_b).start()
    c = await connect_client(rp.url, str(cert_dir.ca))
    try:
        for name, objs in tracks_b.items():
            assert await fetch_track(c, name, 4, ns_b) == objs
        # Tenant A pulls 6 MB through a 2 MB cache: 10 times its 600 kB share.
        for name, objs in tracks_a.items():
            assert await fetch_track(c, name, 4, ns_a) == objs
        for name, objs in tracks_b.items():
            assert await fetch_track(c, name, 4, ns_b) == objs
        assert pub_b.counts["fetch"] == 2  # both of B's tracks were still cached
        assert pub_a.counts["fetch"] == 30
        assert rp.value("cache_share_evictions_total") >= 20
        assert rp.value("cache_share_groups") == 2
        assert rp.value("cache_bytes") <= 600_000 + 2 * 4 * 50_500
    finally:
        await pub_a.stop()
        await pub_b.stop()
        await c.close_session()


async def test_idle_session_is_closed_busy_one_is_not(
    cert_dir: CertDir, in_process_relays: InProcessRelays
) -> None:
    rp = await in_process_relays("--session-idle-timeout", "1")
    pub = await Publisher(await connect_client(rp.url, str(cert_dir.ca)), {b"t": track_objects(b"t")}).start()
    idle = await connect_client(rp.url, str(cert_dir.ca))
    started = time.monotonic()
    code, reason = await asyncio.wait_for(idle.wait_session_closed(), scaled(DEFAULT_TIMEOUT))
    assert code == SessionErrorCode.NO_ERROR and "idle" in reason
    # Not before the timeout; how much later depends on the machine's load, so no upper bound.
    assert time.monotonic() - started > 0.9
    # The publisher holds an open request (its namespace): never idle.
    assert not pub.conn.is_closed
    c = await connect_client(rp.url, str(cert_dir.ca))
    try:
        assert await fetch_track(c, b"t", 4) == pub.tracks[b"t"]
        assert rp.value("sessions_closed_total", reason="idle_timeout") == 1
    finally:
        await pub.stop()
        await c.close_session()


ASK_PACE_S = 0.2
"""Pause between an active client's requests: its activity pattern, well inside the pressure timeout."""


async def test_under_pressure_a_session_whose_requests_are_refused_is_not_reaped_as_idle(
    cert_dir: CertDir, in_process_relays: InProcessRelays
) -> None:
    """The session table at 90 % and the relay's one request slot held by the publisher's namespace: every
    request of the active client is refused at dispatch (EXCESSIVE_LOAD), so none of its requests starts or
    ends. It keeps sending them, so it is not idle: it is kept and still answered while the sessions beside
    it that send nothing (keep-alive PINGs are not activity) are reaped as idle."""
    rp = await in_process_relays(
        "--max-sessions", "10", "--max-sessions-per-address", "0", "--pressure-idle-timeout", "2",
        "--max-requests", "1", "--reserved-requests-per-session", "0",
    )
    ca = str(cert_dir.ca)
    pub = await Publisher(await connect_client(rp.url, ca), {b"t": track_objects(b"t")}).start()
    active = await connect_client(rp.url, ca)
    refused = 0

    async def keep_asking() -> None:
        nonlocal refused
        while True:
            try:
                await active.track_status(NS, b"t")
            except RequestRejected as exc:
                assert exc.code == RequestErrorCode.EXCESSIVE_LOAD, exc
                refused += 1
            await asyncio.sleep(ASK_PACE_S)

    asking = asyncio.ensure_future(keep_asking())
    idle: list[MoqtConnection] = []
    try:
        await async_wait_until(lambda: refused >= 1 or asking.done(), "the active client's first refusal")
        idle = [await connect_client(rp.url, ca) for _ in range(8)]  # 10 of 10 sessions: under pressure
        await async_wait_until(
            lambda: any(c.is_closed for c in idle) or asking.done(), "an idle session reaped under pressure"
        )
        # The active client is still answered after the reaping, however long it has gone without a request
        # of its own starting or ending.
        seen = refused
        await async_wait_until(lambda: refused >= seen + 3 or asking.done(), "the active client answered")
        assert not asking.done() and not active.is_closed, asking
        # The idle ones, not the active one nor the publisher.
        await rp.wait_value("sessions_closed_total", 1, reason="pressure_idle")
        assert not pub.conn.is_closed
    finally:
        asking.cancel()
        await asyncio.gather(asking, return_exceptions=True)
        for c in (active, *idle):
            if not c.is_closed:
                await c.close_session()
        await pub.stop()


async def test_slowloris_request_stream_reset_then_session_closed(
    cert_dir: CertDir, in_process_relays: InProcessRelays
) -> None:
    rp = await in_process_relays("--request-header-timeout", "0.5", "--max-request-header-timeouts", "2")
    pub = await Publisher(await connect_client(rp.url, str(cert_dir.ca)), {b"t": track_objects(b"t")}).start()
    async with raw_peer(rp.port, cert_dir.ca) as peer:
        peer.setup()
        msg = encode_message(TrackStatus(0, NS, b"t"))
        slow = peer.new_stream(False)
        peer.send(slow, msg[:4])  # a request that never finishes its first message
        whole = peer.new_stream(False)
        peer.send(whole, encode_message(TrackStatus(2, NS, b"t")))
        started = time.monotonic()
        await async_wait_until(lambda: slow in peer.resets, "the unfinished request stream reset")
        assert peer.resets.get(slow) == StreamResetCode.DELIVERY_TIMEOUT
        assert peer.stop_sending.get(slow) == StreamResetCode.DELIVERY_TIMEOUT
        assert time.monotonic() - started > 0.4  # not before the header timeout (no upper bound: load)
        assert whole not in peer.resets and peer.data.get(whole)  # the complete request was answered
        assert not peer.terminated.done()
        # Doing it again and again: after two timeouts the next one closes the session.
        for _ in range(2):
            peer.send(peer.new_stream(False), b"\x0d")
        err, _reason = await asyncio.wait_for(peer.terminated, scaled(5))
        assert err == SessionErrorCode.CONTROL_MESSAGE_TIMEOUT
    c = await connect_client(rp.url, str(cert_dir.ca))
    try:
        assert await fetch_track(c, b"t", 4) == pub.tracks[b"t"]
        assert rp.value("request_header_timeouts_total") == 3
        assert rp.value("sessions_closed_total", reason="request_header_timeout") == 1
    finally:
        await pub.stop()
        await c.close_session()


async def test_slow_reader_is_cut_off_other_subscriber_gets_everything(
    cert_dir: CertDir, in_process_relays: InProcessRelays
) -> None:
    rp = await in_process_relays("--slow-peer-timeout", "1")
    objs = track_objects(b"live", 16, 250_000)  # 4 MB
    pub = await Publisher(await connect_client(rp.url, str(cert_dir.ca)), {}).start()
    ok = await pub.conn.publish(NS, b"live", 42)
    good = await connect_client(rp.url, str(cert_dir.ca))
    slow = await connect_client(rp.url, str(cert_dir.ca))
    try:
        good_sub = await good.subscribe(NS, b"live")
        slow_sub = await slow.subscribe(NS, b"live")
        slow._transport.pause_reading()  # type: ignore[union-attr]
        sid = pub.conn.open_subgroup(42, 0, 0)
        for i, payload in enumerate(objs):
            pub.conn.send_subgroup_object(sid, i, payload)
            await pub.conn.wait_writable()
        got: list[bytes] = []

        async def read_good() -> None:
            async for obj in good_sub:
                got.append(obj.payload)
                if len(got) == len(objs):
                    return

        await asyncio.wait_for(read_good(), scaled(10))
        assert got == objs
        cut = await rp.wait_value("limit_rejections_total", 1, limit="slow_peer")
        assert cut == 1
        slow._transport.resume_reading()  # type: ignore[union-attr]
        # The track goes on for the good subscriber after the slow one was cut off.
        pub.conn.send_subgroup_object(sid, len(objs), b"", status=ObjectStatus.END_OF_TRACK, end_stream=True)
        pub.conn.publish_done(ok.request_id, PublishDoneCode.TRACK_ENDED, "done")
        rest = [o async for o in good_sub]
        assert [o.status for o in rest] == [ObjectStatus.END_OF_TRACK] and good_sub.done is not None
        slow_got = 0
        failure: BaseException | None = None
        try:
            async with asyncio.timeout(scaled(10)):
                async for _obj in slow_sub:
                    slow_got += 1
        except (ConnectionClosed, StreamResetError) as exc:
            failure = exc
        assert slow_got < len(objs)
        code = getattr(failure, "error_code", getattr(failure, "code", None))
        assert code == StreamResetCode.TOO_FAR_BEHIND, failure
    finally:
        await pub.stop()
        await good.close_session()
        await slow.close_session()


async def test_setup_must_complete_within_the_deadline(
    cert_dir: CertDir, in_process_relays: InProcessRelays
) -> None:
    rp = await in_process_relays("--setup-timeout", "1")
    async with raw_peer(rp.port, cert_dir.ca) as peer:
        started = time.monotonic()  # QUIC handshake done; no SETUP from us
        await asyncio.wait_for(peer.terminated, scaled(DEFAULT_TIMEOUT))
        # Closed for the missing SETUP, not before the deadline (no upper bound: it moves with the load).
        assert time.monotonic() - started > 0.9



MIB = 1 << 20


async def push_never_ended(
    conn: MoqtConnection, aliases: itertools.count[int], prefix: str, tracks: int, size: int
) -> None:
    """PUBLISH ``tracks`` tracks of four ``size``-byte objects and never end them: no END_OF_TRACK, no
    PUBLISH_DONE (the relay holds each as a live track of this session)."""
    for t in range(tracks):
        alias = next(aliases)
        await conn.publish(NS, f"{prefix}{t}".encode(), alias)
        sid = conn.open_subgroup(alias, 0, 0)
        for i in range(4):
            conn.send_subgroup_object(sid, i, bytes([65 + t % 26]) * size)
            await conn.wait_writable()


async def test_never_ended_pushes_hold_bounded_memory_released_on_close(
    cert_dir: CertDir, relay_factory: RelayFactory
) -> None:
    """A session pushing tracks it never ends made the relay hold every object (48 MiB more per round
    of 12 x 4 MiB, kept after the session closed); now at most its quota is held, the oldest tracks
    go first, and all of it is released when the session ends."""
    rp = relay_factory("--max-held-bytes-per-session", "16M", "--cache-bytes", "1M", name="held")
    rss_before = rp.rss_bytes()
    conn = await connect_client(rp.url, str(cert_dir.ca))
    aliases = itertools.count(1)
    pushed = 0
    try:
        for round_ in range(4):
            await push_never_ended(conn, aliases, f"r{round_}-", 12, MIB)
            pushed += 12 * 4 * MIB
            await rp.wait_metric("kvnet_relay_bytes_in_total", pushed)
            m = await rp.ametrics()
            assert 0 < m["kvnet_relay_held_bytes"] <= 16 * MIB
        assert m['kvnet_relay_limit_rejections_total{limit="held_bytes_per_session"}'] > 0
        assert m["kvnet_relay_fanouts"] == 48  # every track is still live: only its held objects went
        # 192 MiB pushed; what the process grew by is bounded by the quota plus its own working memory.
        assert rp.rss_bytes() - rss_before < pushed // 2
    finally:
        await conn.close_session()
    await rp.wait_metrics(
        lambda m: m.get("kvnet_relay_sessions") == 0 and m.get("kvnet_relay_held_bytes") == 0,
        "the session's held bytes released",
    )
    assert rp.rss_bytes() - rss_before < 64 * MIB  # handed back to the system, not kept in the heap


async def test_held_bytes_global_cap_drops_the_biggest_holder_first(
    cert_dir: CertDir, in_process_relays: InProcessRelays
) -> None:
    rp = await in_process_relays(
        "--max-held-bytes-per-session", "16M", "--max-held-bytes-per-address", "0",
        "--max-held-bytes", "20M", "--cache-bytes", "1M",
    )
    hog = await connect_client(rp.url, str(cert_dir.ca))
    light = await connect_client(rp.url, str(cert_dir.ca))
    try:
        await push_never_ended(hog, itertools.count(1), "hog-", 6, MIB)
        await rp.wait_value("bytes_in_total", 24 * MIB)
        await push_never_ended(light, itertools.count(1), "light-", 2, MIB)
        await rp.wait_value("bytes_in_total", 32 * MIB)
        assert rp.value("held_bytes") <= 20 * MIB
        assert rp.value("limit_rejections_total", limit="held_bytes_global") > 0
        # The light session's two tracks are held whole: the hog, holding the most, gave way.
        ok = await light.fetch(NS, b"light-1", Location(0, 0), Location(0, 4))
        assert len(await ok.read_all()) == 4
    finally:
        for conn in (hog, light):
            await conn.close_session()
    await async_wait_until(lambda: rp.value("held_bytes") == 0, "held bytes released")
