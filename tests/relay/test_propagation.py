"""Namespace propagation through a relay tree: origin + two edges, a publisher behind edge A, requests via
edge B (draft "Relays": a relay forwards PUBLISH_NAMESPACE upstream so requests are routed back down). The
three relays run in the test's own process (``tests.relay.inprocess``), real QUIC on loopback."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from kvnet.net.errors import RequestRejected
from proto.errors import RequestErrorCode
from proto.messages import Location
from tests.helpers.processes import CertDir
from tests.helpers.waiting import async_wait_until
from tests.relay.inprocess import InProcessRelay, relay_in_process
from tests.relay.peers import NS, Publisher, connect_client, fetch_track, track_objects

Tree = tuple[InProcessRelay, InProcessRelay, InProcessRelay]


@contextlib.asynccontextmanager
async def relay_tree(cert_dir: CertDir) -> AsyncIterator[Tree]:
    """An origin and two edges whose upstream it is; all three stopped when the block ends."""
    async with (
        relay_in_process(cert_dir) as origin,
        relay_in_process(cert_dir, "--upstream", origin.url) as edge_a,
        relay_in_process(cert_dir, "--upstream", origin.url) as edge_b,
    ):
        yield origin, edge_a, edge_b


async def _namespaces(relay: InProcessRelay, count: int) -> None:
    """Wait until ``relay`` routes exactly ``count`` announced namespaces."""
    await async_wait_until(lambda: relay.value("namespaces") == count, f"{count} namespaces routed")


async def test_publisher_behind_edge_a_reached_via_edge_b(cert_dir: CertDir) -> None:
    async with relay_tree(cert_dir) as tree:
        await _publisher_behind_edge_a_reached_via_edge_b(tree, cert_dir)


async def _publisher_behind_edge_a_reached_via_edge_b(tree: Tree, cert_dir: CertDir) -> None:
    origin, edge_a, edge_b = tree
    objs = track_objects(b"far", 5, 5000)
    pub = await Publisher(await connect_client(edge_a.url, str(cert_dir.ca)), {b"far": objs}).start()
    pub.fetch_delay = 0.3  # lets the two requesters below pile up at edge B
    clients = [await connect_client(edge_b.url, str(cert_dir.ca)) for _ in range(2)]
    try:
        # Edge A forwarded the announcement: the origin now routes the namespace to edge A's session.
        await _namespaces(origin, 1)
        st = await clients[0].track_status(NS, b"far")
        assert st.parameters.largest_object == Location(0, 4)
        results = await asyncio.gather(*(fetch_track(c, b"far", 5) for c in clients))
        assert results == [objs, objs]
        assert pub.counts["fetch"] == 1
        # Two requesters via edge B, one request from the origin down to edge A.
        assert origin.value("upstream_requests_total", type="fetch") == 1
        assert edge_b.value("upstream_requests_total", type="fetch") == 1
        with pytest.raises(RequestRejected) as ei:
            await clients[1].track_status(NS, b"absent")
        assert ei.value.code == RequestErrorCode.DOES_NOT_EXIST
        # The publisher leaves: edge A withdraws the namespace upstream.
        await pub.stop()
        await _namespaces(origin, 0)
        with pytest.raises(RequestRejected) as ei:
            await clients[1].track_status(NS, b"other")
        assert ei.value.code == RequestErrorCode.DOES_NOT_EXIST
    finally:
        await pub.stop()
        for c in clients:
            await c.close_session()


async def test_no_loop_when_nobody_has_the_track(cert_dir: CertDir) -> None:
    async with relay_tree(cert_dir) as tree:
        await _no_loop_when_nobody_has_the_track(tree, cert_dir)


async def _no_loop_when_nobody_has_the_track(tree: Tree, cert_dir: CertDir) -> None:
    origin, edge_a, edge_b = tree
    pub = await Publisher(await connect_client(edge_a.url, str(cert_dir.ca)), {}).start()
    client = await connect_client(edge_b.url, str(cert_dir.ca))
    try:
        await _namespaces(origin, 1)
        with pytest.raises(RequestRejected) as ei:
            await fetch_track(client, b"nowhere", 3)
        assert ei.value.code == RequestErrorCode.DOES_NOT_EXIST
        # Answered, not bounced between relays: each relay on the path asked upstream exactly once, and
        # edge A asked only its publisher (a request from upstream is never sent back upstream).
        assert all(r.value("upstream_requests_total", type="fetch") == 1 for r in (edge_a, origin, edge_b))
        assert pub.counts["fetch"] == 1
    finally:
        await pub.stop()
        await client.close_session()
