"""Requesters and routes that vanish: cancelled requests end quietly, background failures are always
retrieved, and a killed relay is routed around at once and withdrawn once QUIC notices it is dead."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time

from kvnet.net.errors import RequestRejected
from proto.messages import Location
from tests.helpers.processes import CertDir, RelayProcess
from tests.relay.conftest import RelayFactory
from tests.relay.peers import NS, Publisher, connect_client, track_objects

_BAD = ("request handler failed", "never retrieved", "level=error", "Traceback")


async def _until(pred: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(pred):  # type: ignore[arg-type]
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.05)


def _clean(rp: RelayProcess) -> None:
    log = rp.log()
    found = [b for b in _BAD if b in log]
    assert not found, f"{found} in the log of {rp.url}:\n{log[-4000:]}"


async def test_cancelled_requests_end_quietly(relay: RelayProcess, cert_dir: CertDir) -> None:
    objs = track_objects(b"slow-fin", 4)
    pub = await Publisher(
        await connect_client(relay.url, str(cert_dir.ca)), {b"slow-fin": objs, b"slow-status": objs}
    ).start()
    pub.finish_delay = 0.5  # every object is out, the FIN comes later
    pub.status_delay = 0.5
    client = await connect_client(relay.url, str(cert_dir.ca))
    try:
        # FETCH: the requester has every object it wanted and cancels before the FIN; the relay then
        # sees the upstream FIN and has nothing left to finish.
        h = await client.fetch(NS, b"slow-fin", Location(0, 0), Location(0, 4))
        it = aiter(h)
        got = [(await anext(it)).payload for _ in range(4)]
        assert got == objs
        h.cancel()
        # TRACK_STATUS: the requester gives up while the relay waits for the publisher's answer.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(client.track_status(NS, b"slow-status"), 0.1)
        key = 'kvnet_relay_requests_total{outcome="cancelled",type="%s"}'
        await _until(lambda: relay.metric(key % "fetch") == 1 and relay.metric(key % "track_status") == 1)
        # The session is fine and the track was cached whole by the fill the cancelled request started.
        m = await relay.ametrics()
        assert m["kvnet_relay_cache_tracks"] == 1
        assert (await client.track_status(NS, b"slow-fin")).parameters.largest_object == Location(0, 3)
        _clean(relay)
    finally:
        await pub.stop()
        await client.close_session()


async def test_killed_edge_is_routed_around_then_withdrawn(
    cert_dir: CertDir, relay_factory: RelayFactory
) -> None:
    # Origin: PING every 0.5 s, a peer silent for 3 s is dead (defaults 5 s / 15 s; short to keep the
    # test fast). Edge B gives up on the origin after 2 s.
    origin = relay_factory("--idle-timeout", "3", "--keepalive-interval", "0.5", name="origin")
    edge_a = relay_factory("--upstream", origin.url, name="edge-a")
    edge_b = relay_factory("--upstream", origin.url, "--upstream-timeout", "2", name="edge-b")
    ca = str(cert_dir.ca)
    objs = track_objects(b"at-b", 3)
    # Edge A announces first, so the origin routes the namespace to edge A before edge B.
    pub_a = await Publisher(await connect_client(edge_a.url, ca), {}).start()
    await _until(lambda: origin.metric("kvnet_relay_namespaces") == 1)
    pub_b = await Publisher(await connect_client(edge_b.url, ca), {b"at-b": objs}).start()
    await _until(lambda: origin.metric("kvnet_relay_namespaces") == 2)
    at_origin = await connect_client(origin.url, ca)
    at_b = await connect_client(edge_b.url, ca)
    try:
        st = await at_origin.track_status(NS, b"at-b")  # edge A says DOES_NOT_EXIST, edge B answers
        assert st.parameters.largest_object == Location(0, 2)
        edge_a.proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        # A requester behind edge B asks for what only the dead edge could have, then leaves: edge B's
        # upstream request times out with nobody waiting for it.
        asking = asyncio.ensure_future(at_b.track_status(NS, b"only-at-a"))
        await asyncio.sleep(0.3)
        await at_b.close_session()
        with contextlib.suppress(Exception):
            await asking
        # The origin still routes to edge A first; after the route deadline (1.5 s) it asks edge B too.
        t0 = time.monotonic()
        st = await at_origin.track_status(NS, b"at-b")
        assert st.parameters.largest_object == Location(0, 2)
        took = time.monotonic() - t0
        assert 1.0 <= took < 4.0, took  # not the 10 s upstream timeout, nor an error
        # The dead edge is noticed by the keep-alive/idle timeout and its announcement withdrawn.
        await _until(lambda: origin.metric("kvnet_relay_namespaces") == 1, timeout=10)
        assert time.monotonic() - killed < 8
        t0 = time.monotonic()
        with contextlib.suppress(RequestRejected):
            await at_origin.track_status(NS, b"absent")
        st = await at_origin.track_status(NS, b"at-b")
        assert time.monotonic() - t0 < 1.0  # straight to edge B now
        await asyncio.sleep(2.5)  # edge B's abandoned upstream request has timed out by now
        m = await edge_b.ametrics()
        assert m.get('kvnet_relay_requests_total{outcome="cancelled",type="track_status"}', 0) >= 1
        _clean(edge_b)
        _clean(origin)
    finally:
        for c in (at_origin, at_b):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(c.close_session(), 2)
        await pub_b.stop()
        await pub_a.stop()
