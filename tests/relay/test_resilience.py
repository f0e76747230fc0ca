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
from tests.helpers.waiting import scaled
from tests.relay.conftest import RelayFactory
from tests.relay.peers import NS, Publisher, connect_client, track_objects

_BAD = ("request handler failed", "never retrieved", "level=error", "Traceback")


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
        await relay.wait_metrics(
            lambda m: m.get(key % "fetch") == 1 and m.get(key % "track_status") == 1,
            "the cancelled FETCH and TRACK_STATUS counted",
        )
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
    await origin.wait_namespaces(1)
    pub_b = await Publisher(await connect_client(edge_b.url, ca), {b"at-b": objs}).start()
    await origin.wait_namespaces(2)
    at_origin = await connect_client(origin.url, ca)
    at_b = await connect_client(edge_b.url, ca)
    try:
        st = await at_origin.track_status(NS, b"at-b")  # edge A says DOES_NOT_EXIST, edge B answers
        assert st.parameters.largest_object == Location(0, 2)
        edge_a.proc.send_signal(signal.SIGKILL)
        # A requester behind edge B asks for what only the dead edge could have, then leaves: edge B's
        # upstream request times out with nobody waiting for it.
        asking = asyncio.ensure_future(at_b.track_status(NS, b"only-at-a"))
        await edge_b.wait_metric('kvnet_relay_upstream_requests_total{type="track_status"}', 1)
        await at_b.close_session()
        with contextlib.suppress(Exception):
            await asking
        # The origin still routes to edge A first; after the route deadline (1.5 s) it asks edge B too.
        t0 = time.monotonic()
        st = await at_origin.track_status(NS, b"at-b")
        assert st.parameters.largest_object == Location(0, 2)
        # It waited for the dead edge first (no upper bound: it moves with the load); answering at all
        # shows it was not the 10 s upstream timeout, which ends in an error.
        assert time.monotonic() - t0 >= 1.0
        # The dead edge is noticed by the 3 s keep-alive/idle timeout and its announcement withdrawn; the
        # wait stays below the default 15 s idle timeout, so the configured one must be what fired.
        await origin.wait_namespaces(1, timeout=12)
        # Only edge B is routed now, so these go straight to it.
        with contextlib.suppress(RequestRejected):
            await at_origin.track_status(NS, b"absent")
        st = await at_origin.track_status(NS, b"at-b")
        assert st.parameters.largest_object == Location(0, 2)
        # Edge B's abandoned upstream request times out and is counted as cancelled.
        await edge_b.wait_metric('kvnet_relay_requests_total{outcome="cancelled",type="track_status"}', 1)
        _clean(edge_b)
        _clean(origin)
    finally:
        for c in (at_origin, at_b):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(c.close_session(), scaled(2))
        await pub_b.stop()
        await pub_a.stop()
