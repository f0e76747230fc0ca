"""Resource exhaustion against a real relay process: many sessions, a request flood on one session,
slowloris streams and sessions, oversized objects. In every case the relay stays within a memory bound
(VmRSS from /proc), keeps serving a well-behaved client promptly, and its metrics show the load it held.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import pytest

from kvnet.net.config import TlsConfig
from kvnet.net.connection import MoqtConnection
from kvnet.net.endpoint import connect
from kvnet.net.errors import MoqtConnectionError, RequestRejected
from kvnet.net.limits import ConnectionLimits
from proto.data import SubgroupHeader, encode_subgroup_header, subgroup_object_prefix
from proto.errors import RequestErrorCode, SessionErrorCode, StreamResetCode
from proto.messages import Location, Publish, TrackStatus, encode_message
from tests.helpers.connections import client_config, client_limits
from tests.helpers.processes import CertDir, RelayProcess
from tests.helpers.waiting import DEFAULT_TIMEOUT, async_wait_until, scaled
from tests.nodes.cluster import SHARED_PREFIX, Cluster
from tests.relay.conftest import RelayFactory
from tests.relay.peers import (
    NS,
    Publisher,
    RawPeer,
    connect_client,
    fetch_track,
    raw_peer,
    track_objects,
)

PROMPT = SHARED_PREFIX + "Question: is anyone still there?"
RSS_LIMIT = 400 * 1024 * 1024
"""Python + aioquic + the relay at rest is ~45 MB; this bounds what any of the loads below may add."""
SERVED_WITHIN = 30.0
"""Bound on a well-behaved FETCH of a cached track while the relay is under attack: only a starved client
reaches it (a test asserts no speed; how long it takes moves with the machine's load)."""
SESSIONS_WITHIN = 120.0
"""Deadline for a batch of sessions to be opened and counted, or for all of them to be gone (a bound on a
stuck step, not a speed: a loaded two-core machine takes seconds per batch)."""


def metric_sum(rp: RelayProcess, prefix: str) -> float:
    return sum(v for k, v in rp.metrics().items() if k.startswith(prefix))


async def start_good(rp: RelayProcess, ca: Path) -> tuple[Publisher, MoqtConnection]:
    """A publisher of track ``good`` and a client that has fetched it once (so the relay caches it)."""
    pub = await Publisher(await connect_client(rp.url, str(ca)), {b"good": track_objects(b"good")}).start()
    client = await connect_client(rp.url, str(ca))
    assert await fetch_track(client, b"good", 4) == pub.tracks[b"good"]
    return pub, client


async def still_served(client: MoqtConnection, pub: Publisher) -> None:
    """The well-behaved client gets the cached track and its status (not starved by the attack)."""
    got = await asyncio.wait_for(fetch_track(client, b"good", 4), scaled(SERVED_WITHIN))
    st = await asyncio.wait_for(client.track_status(NS, b"good"), scaled(SERVED_WITHIN))
    assert got == pub.tracks[b"good"]
    assert st.parameters.largest_object == Location(0, 3)


async def stop_good(pub: Publisher, client: MoqtConnection) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(client.close_session(), scaled(5))
    await pub.stop()


@pytest.mark.slow
async def test_thousand_concurrent_sessions(cert_dir: CertDir, relay_factory: RelayFactory) -> None:
    # One address holds them all: the per-address quota and pressure reaping are off for this load test.
    # The SETUP deadline (handshake included) is what this test must not trip: on a loaded machine the 50
    # handshakes of a batch share a starved client process and may take longer than the relay's 5 s.
    rp = relay_factory(
        "--max-sessions",
        "1100",
        "--max-sessions-per-address",
        "0",
        "--pressure-idle-timeout",
        "0",
        "--setup-timeout",
        str(scaled(SESSIONS_WITHIN)),
        "--log-level",
        "info",
    )
    pub, client = await start_good(rp, cert_dir.ca)
    base_rss = rp.rss_bytes()
    n = 1000
    async with contextlib.AsyncExitStack() as stack:
        peers: list[RawPeer] = []

        async def open_one() -> None:
            peer = await stack.enter_async_context(raw_peer(rp.port, cert_dir.ca))
            peer.setup()
            peers.append(peer)

        for batch in range(1, n // 50 + 1):  # bounded: 20 batches of 50 handshakes
            await asyncio.wait_for(asyncio.gather(*(open_one() for _ in range(50))), scaled(SESSIONS_WITHIN))
            # The relay holds this batch's sessions before the next starts: handshakes never pile up.
            await rp.wait_metric("kvnet_relay_sessions", batch * 50 + 2, timeout=SESSIONS_WITHIN)
        m = await rp.ametrics()
        held_rss = rp.rss_bytes()
        # Metrics report the load: every raw session plus the publisher and the client.
        assert m["kvnet_relay_sessions"] == n + 2, m.get("kvnet_relay_sessions")
        assert not any(p.terminated.done() for p in peers)
        await still_served(client, pub)
        assert held_rss < RSS_LIMIT, (base_rss, held_rss)
        print(
            f"1000 sessions: RSS {base_rss >> 20} -> {held_rss >> 20} MiB "
            f"({(held_rss - base_rss) / n / 1024:.0f} KiB per session)"
        )
        for p in peers:  # close all at once (leaving the stack closes them one by one)
            p.close()
        await asyncio.wait_for(asyncio.gather(*(p.wait_closed() for p in peers)), scaled(SESSIONS_WITHIN))
    with contextlib.suppress(TimeoutError):  # the assertion below says what is left
        await rp.wait_metrics(
            lambda m: m.get("kvnet_relay_sessions", 0) <= 2, "raw sessions gone", SESSIONS_WITHIN
        )
    state = (pub.conn.session.closed, client.session.closed)
    assert (await rp.ametrics())["kvnet_relay_sessions"] == 2, state
    await still_served(client, pub)
    await stop_good(pub, client)
    assert rp.proc.poll() is None


async def test_session_limit_refuses_extra_sessions(cert_dir: CertDir, relay_factory: RelayFactory) -> None:
    rp = relay_factory("--max-sessions", "12", "--pressure-idle-timeout", "0", "--log-level", "info")
    pub, client = await start_good(rp, cert_dir.ca)
    async with contextlib.AsyncExitStack() as stack:
        peers = []
        for _ in range(20):
            peer = await stack.enter_async_context(raw_peer(rp.port, cert_dir.ca))
            peer.setup()
            peers.append(peer)
        await async_wait_until(lambda: sum(p.terminated.done() for p in peers) >= 10, "10 sessions refused")
        refused = [p for p in peers if p.terminated.done()]
        assert len(refused) == 10  # 12 = publisher + client + 10 raw sessions
        for p in refused:
            code, reason = p.terminated.result()
            assert code == SessionErrorCode.INTERNAL_ERROR and "limit reached: sessions" in reason
        assert metric_sum(rp, 'kvnet_relay_limit_rejections_total{limit="sessions"') == 10
        await still_served(client, pub)
    await stop_good(pub, client)


async def test_request_floods_per_session_and_global(cert_dir: CertDir, relay_factory: RelayFactory) -> None:
    """Two sessions flood 2,000 FETCHes each: the per-session cap (100) and the relay-wide cap (150)."""
    # The relay waits for the held requests as long as the test holds them (its upstream timeout would
    # otherwise free their slots early on a loaded machine), and for the flooders to read its answers: one
    # event loop runs both flooders' 4,000 tasks, and on a loaded machine it once left the first flooder's
    # answers unread past the 10 s slow-peer rule, which closed that session and freed its held slots.
    rp = relay_factory(
        "--max-requests-per-session", "100", "--max-requests", "150", "--upstream-timeout", "600",
        "--slow-peer-timeout", "600", "--log-level", "info",
    )
    pub, client = await start_good(rp, cert_dir.ca)
    pub.fetch_gate = asyncio.Event()  # every flooded FETCH holds a request slot until the gate opens
    tls = TlsConfig(ca_file=cert_dir.ca)
    limits = ConnectionLimits(max_outstanding_requests=4000)
    flooders = [await connect(rp.url, client_config(), tls, limits=client_limits(limits)) for _ in range(2)]
    codes: list[dict[int, int]] = [{}, {}]

    async def one(f: int, i: int) -> None:
        try:
            h = await flooders[f].fetch(NS, b"flood-%d-%d" % (f, i), Location(0, 0), Location(0, 4))
            await asyncio.wait_for(h.read_all(), scaled(30))
        except RequestRejected as exc:
            codes[f][exc.code] = codes[f].get(exc.code, 0) + 1

    def refused_load(f: int) -> int:
        # Only EXCESSIVE_LOAD: a held request the relay gives up on (TIMEOUT) is already counted as held.
        return codes[f].get(RequestErrorCode.EXCESSIVE_LOAD, 0)

    flood: list[asyncio.Task[None]] = []
    try:
        before = pub.counts["fetch"]
        flood += [asyncio.create_task(one(0, i)) for i in range(2000)]
        await async_wait_until(
            lambda: pub.counts["fetch"] - before == 100 and refused_load(0) == 2000 - 100,
            "the first flooder holding its 100 requests, the rest refused",
        )
        flood += [asyncio.create_task(one(1, i)) for i in range(2000)]

        async def second_flood_settled() -> bool:
            # Refused, or holding a relay slot (the relay may hold it before the publisher has credit to
            # take it): in flight are the publisher's namespace, the first flooder's 100 and these.
            held = (await rp.ametrics())["kvnet_relay_requests_inflight"] - 1 - 100
            return sum(t.done() for t in flood[2000:]) + held == 2000

        await async_wait_until(second_flood_settled, "every request of the second flooder refused or held")
        await still_served(client, pub)  # during the flood: the client's requests are reserved ones
        pub.fetch_gate.set()
        await asyncio.wait_for(asyncio.gather(*flood), scaled(60))
        excessive = [c.get(RequestErrorCode.EXCESSIVE_LOAD, 0) for c in codes]
        global_refused = metric_sum(rp, 'kvnet_relay_limit_rejections_total{limit="requests_global"')
        # First flooder: exactly the requests over its session's cap (100) are refused. Second flooder:
        # only what fits in the relay-wide pool (150, of which the first flooder holds 100 and the
        # publisher's namespace one) is admitted; every refusal of it is counted in the relay's metrics.
        assert excessive[0] == 2000 - 100, codes
        admitted = 2000 - excessive[1]
        assert 40 <= admitted <= 50, codes
        assert global_refused == excessive[1], (codes, global_refused)
        # The admitted ones end upstream (the publisher answers DOES_NOT_EXIST once the gate opens, or the
        # relay gives up with TIMEOUT).
        for c in codes:
            assert set(c) <= {
                RequestErrorCode.EXCESSIVE_LOAD,
                RequestErrorCode.DOES_NOT_EXIST,
                RequestErrorCode.TIMEOUT,
            }, codes
        held = metric_sum(rp, 'kvnet_relay_requests_total{outcome="does_not_exist",type="fetch"')
        held += metric_sum(rp, 'kvnet_relay_requests_total{outcome="timeout",type="fetch"')
        assert held == 100 + admitted, held
        assert pub.counts["fetch"] <= 100 + admitted + 1
        assert rp.rss_bytes() < RSS_LIMIT
        await still_served(client, pub)  # after
    finally:
        # Ended and their failures retrieved whatever happened: a task left with an unread exception is
        # logged when the garbage collector finds it, which can be in the middle of a later test.
        for task in flood:
            task.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
        for flooder in flooders:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(flooder.close_session(), scaled(5))
        await stop_good(pub, client)


async def test_slowloris_streams_and_sessions(cert_dir: CertDir, relay_factory: RelayFactory) -> None:
    rp = relay_factory(
        "--request-header-timeout",
        "1",
        "--max-request-header-timeouts",
        "3",
        "--setup-timeout",
        "2",
        "--log-level",
        "info",
    )
    pub, client = await start_good(rp, cert_dir.ca)
    base_rss = rp.rss_bytes()
    n_dribblers, n_streams, n_silent = 20, 50, 10
    async with contextlib.AsyncExitStack() as stack:

        async def open_raw() -> RawPeer:
            peer = await stack.enter_async_context(raw_peer(rp.port, cert_dir.ca))
            return peer

        dribblers: list[tuple[RawPeer, list[tuple[int, bytes]]]] = []
        for s in range(n_dribblers):
            peer = await open_raw()
            peer.setup()
            # Request streams each carrying a valid TRACK_STATUS that is never completed. (A stream id
            # is taken only once data is sent on it: open each stream before asking for the next id.)
            msgs = []
            for i in range(n_streams):
                sid, msg = (
                    peer.new_stream(False),
                    encode_message(TrackStatus(2 * i, NS, b"slow-%d-%d" % (s, i))),
                )
                peer.send(sid, msg[:1])
                msgs.append((sid, msg))
            assert len({sid for sid, _ in msgs}) == n_streams
            dribblers.append((peer, msgs))
        silent = [await open_raw() for _ in range(n_silent)]  # complete QUIC, never send SETUP
        started = time.monotonic()
        # Dribble one more byte per stream every 100 ms, never completing a message, until the relay has
        # closed every dribbling session (bounded, for a relay that never does). The pause between bytes
        # is the attack under test, not a wait for a condition.
        step = 0
        while not all(p.terminated.done() for p, _ in dribblers) and time.monotonic() - started < 60:
            step += 1
            for peer, msgs in dribblers:
                if peer.terminated.done():
                    continue
                for sid, msg in msgs:
                    if step < len(msg) - 1 and sid not in peer.stop_sending and sid not in peer.resets:
                        with contextlib.suppress(ValueError, AssertionError):  # closed meanwhile
                            peer.send(sid, msg[step : step + 1])
            if step % 10 == 0:
                await still_served(client, pub)  # during the attack
            await asyncio.sleep(0.1)  # the dribbling pace (the attack), not a wait
        # Each dribbling session got its late request streams reset (DELIVERY_TIMEOUT) and, past three
        # of them, was closed with CONTROL_MESSAGE_TIMEOUT, about one header timeout after it started.
        closed = [p.terminated.result()[0] for p, _ in dribblers if p.terminated.done()]
        assert closed == [SessionErrorCode.CONTROL_MESSAGE_TIMEOUT] * n_dribblers, closed
        # A session without SETUP is closed after the setup timeout (2 s here).
        await asyncio.wait_for(asyncio.gather(*(p.terminated for p in silent)), scaled(DEFAULT_TIMEOUT))
        assert rp.rss_bytes() < base_rss + 64 * 1024 * 1024
        m = await rp.ametrics()
        assert m['kvnet_relay_sessions_closed_total{reason="request_header_timeout"}'] == n_dribblers, m
        assert m["kvnet_relay_request_header_timeouts_total"] >= 3 * n_dribblers, m
        with contextlib.suppress(TimeoutError):  # the assertion below says what is left
            await rp.wait_metrics(lambda m: m["kvnet_relay_sessions"] <= 2, "attacking sessions gone")
        assert (await rp.ametrics())["kvnet_relay_sessions"] == 2  # only the publisher and the client left
        await still_served(client, pub)
    await stop_good(pub, client)


async def test_oversized_object_declared_huge(cert_dir: CertDir, relay_factory: RelayFactory) -> None:
    rp = relay_factory("--max-object-bytes", "1048576", "--log-level", "info")
    pub, client = await start_good(rp, cert_dir.ca)
    base = rp.rss_bytes()
    async with raw_peer(rp.port, cert_dir.ca) as peer:
        peer.setup()
        for i, size in enumerate((1_048_577, 1 << 31, (1 << 62) - 1)):
            alias = 9 + i
            peer.send(
                peer.new_stream(False), encode_message(Publish(2 * i, (b"evil",), b"huge-%d" % i, alias))
            )
            header = SubgroupHeader(alias, 0)
            sid = peer.new_stream(True)
            peer.send(sid, encode_subgroup_header(header) + subgroup_object_prefix(header, 0, None, size))
            for _ in range(40):  # up to 4 MB of it
                with contextlib.suppress(ValueError):  # aioquic: the stream was stopped meanwhile
                    peer.send(sid, b"\xab" * 100_000)
            def stopped(stream_id: int = sid) -> bool:
                return stream_id in peer.stop_sending

            with contextlib.suppress(TimeoutError):  # the assertion below says what the relay did
                await async_wait_until(stopped, "STOP_SENDING on the object")
            # The relay refuses the object by stopping its stream; the session stays up.
            assert peer.stop_sending.get(sid) == StreamResetCode.EXCESSIVE_LOAD, (size, peer.stop_sending)
            assert not peer.terminated.done(), peer.terminated
    await still_served(client, pub)
    assert rp.rss_bytes() < base + 64 * 1024 * 1024
    await stop_good(pub, client)


def test_idle_publisher_outlives_the_quic_idle_timeout(kv_cluster: Cluster) -> None:
    """Keep-alive PINGs hold an idle publisher's relay session open past the QUIC idle timeout, so a
    request arriving much later still reaches it (with ``--no-push`` only the publisher holds the blocks)."""
    c = kv_cluster
    c.start_relay("--idle-timeout", "2", "--keepalive-interval", "0.5")
    pub = c.start_publisher([PROMPT], "--no-push")
    # More than twice the idle timeout without a single request: the idle time is the behaviour under test.
    time.sleep(5)
    (report,) = c.subscribe([PROMPT], "--verify", "--timeout", "5")
    assert report["verified"] is True
    assert report["remote_hit_tokens"] > 0, report
    assert pub.poll() is None
    log = c.log_of(pub).lower()
    assert "lost" not in log and "closed" not in log, log[-2000:]


async def connect_from(rp: RelayProcess, ca: Path, host: str) -> MoqtConnection:
    """A session from source address ``host`` (any 127.0.0.x is a distinct local address on loopback)."""
    return await connect(rp.url, client_config(), TlsConfig(ca_file=ca), local_host=host,
                         limits=client_limits())


def refusal_reason(conn: MoqtConnection | str) -> str | None:
    """Why the relay closed a session (it refuses over-quota sessions right after SETUP), or None while
    it is open; a string is the reason a connect attempt already failed with."""
    if isinstance(conn, str):
        return conn
    closed = conn.session.closed
    return None if closed is None else closed[1]


async def attempt(rp: RelayProcess, ca: Path, host: str) -> MoqtConnection | str:
    """``connect_from``, or the error text when the relay closed the session before SETUP finished here."""
    try:
        return await connect_from(rp, ca, host)
    except MoqtConnectionError as exc:
        return str(exc)


async def close_all(conns: list[MoqtConnection | str]) -> None:
    for conn in conns:
        if not isinstance(conn, str):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.close_session(), scaled(5))


async def test_one_address_over_its_session_quota_cannot_lock_out_others(
    cert_dir: CertDir, relay_factory: RelayFactory
) -> None:
    """One source address opens 10 sessions against a quota of 4: 6 are refused, and a client from
    another address is served at once. Then the session table is filled with idle sessions from other
    addresses: under pressure they are reaped after 2 idle seconds, the announcing publisher is kept,
    and a newcomer is admitted and served."""
    rp = relay_factory(
        "--max-sessions",
        "10",
        "--max-sessions-per-address",
        "4",
        "--pressure-idle-timeout",
        "2",
        "--log-level",
        "info",
    )
    pub, client = await start_good(rp, cert_dir.ca)  # both from 127.0.0.1; pub announced a namespace
    await asyncio.wait_for(client.close_session(), scaled(5))
    conns: list[MoqtConnection | str] = []
    try:
        conns += [await attempt(rp, cert_dir.ca, "127.0.0.2") for _ in range(10)]

        def refused() -> list[str]:
            return [r for r in map(refusal_reason, conns) if r is not None]

        await async_wait_until(lambda: len(refused()) >= 6, "6 of 10 sessions refused")
        reasons = refused()
        assert len(reasons) == 6 and all("limit reached: sessions per address" in r for r in reasons), reasons
        assert metric_sum(rp, 'kvnet_relay_limit_rejections_total{limit="sessions_per_address"') == 6
        honest = await connect_from(rp, cert_dir.ca, "127.0.0.3")
        await still_served(honest, pub)
        await asyncio.wait_for(honest.close_session(), scaled(5))

        # 1 publisher + 4 sessions of 127.0.0.2 + 5 more from two other addresses: the table is full.
        conns += [await attempt(rp, cert_dir.ca, f"127.0.0.{4 + i // 4}") for i in range(5)]
        await async_wait_until(
            lambda: metric_sum(rp, 'kvnet_relay_sessions_closed_total{reason="pressure_idle"') >= 1,
            "idle sessions reaped under pressure",
        )
        newcomer = await connect_from(rp, cert_dir.ca, "127.0.0.9")
        await still_served(newcomer, pub)
        await asyncio.wait_for(newcomer.close_session(), scaled(5))
        assert not pub.conn.is_closed  # an idle publisher with an announced namespace is never reaped
        assert metric_sum(rp, 'kvnet_relay_limit_rejections_total{limit="sessions"') == 0
    finally:
        await close_all(conns)
        await pub.stop()
