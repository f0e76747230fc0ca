"""Namespace propagation through a relay tree: origin + two edges, a publisher behind edge A, requests via
edge B (draft "Relays": a relay forwards PUBLISH_NAMESPACE upstream so requests are routed back down)."""

from __future__ import annotations

import asyncio

import pytest

from kvnet.net.errors import RequestRejected
from proto.errors import RequestErrorCode
from proto.messages import Location
from tests.helpers.processes import CertDir, RelayProcess
from tests.relay.conftest import RelayFactory
from tests.relay.peers import NS, Publisher, connect_client, fetch_track, track_objects


@pytest.fixture
def tree(
    relay_factory: RelayFactory
) -> tuple[RelayProcess, RelayProcess, RelayProcess]:
    origin = relay_factory(name="origin")
    edges = []
    for name in ("edge-a", "edge-b"):
        edge = relay_factory("--upstream", origin.url, name=name)
        edges.append(edge)
    return origin, edges[0], edges[1]


async def test_publisher_behind_edge_a_reached_via_edge_b(
    tree: tuple[RelayProcess, RelayProcess, RelayProcess], cert_dir: CertDir
) -> None:
    origin, edge_a, edge_b = tree
    objs = track_objects(b"far", 5, 5000)
    pub = await Publisher(await connect_client(edge_a.url, str(cert_dir.ca)), {b"far": objs}).start()
    pub.fetch_delay = 0.3  # lets the two requesters below pile up at edge B
    clients = [await connect_client(edge_b.url, str(cert_dir.ca)) for _ in range(2)]
    try:
        # Edge A forwarded the announcement: the origin now routes the namespace to edge A's session.
        await origin.wait_namespaces(1)
        st = await clients[0].track_status(NS, b"far")
        assert st.parameters.largest_object == Location(0, 4)
        results = await asyncio.gather(*(fetch_track(c, b"far", 5) for c in clients))
        assert results == [objs, objs]
        assert pub.counts["fetch"] == 1
        om, bm = await origin.ametrics(), await edge_b.ametrics()
        # Two requesters via edge B, one request from the origin down to edge A.
        assert om['kvnet_relay_upstream_requests_total{type="fetch"}'] == 1
        assert bm['kvnet_relay_upstream_requests_total{type="fetch"}'] == 1
        with pytest.raises(RequestRejected) as ei:
            await clients[1].track_status(NS, b"absent")
        assert ei.value.code == RequestErrorCode.DOES_NOT_EXIST
        # The publisher leaves: edge A withdraws the namespace upstream.
        await pub.stop()
        await origin.wait_namespaces(0)
        with pytest.raises(RequestRejected) as ei:
            await clients[1].track_status(NS, b"other")
        assert ei.value.code == RequestErrorCode.DOES_NOT_EXIST
    finally:
        await pub.stop()
        for c in clients:
            await c.close_session()


async def test_no_loop_when_nobody_has_the_track(
    tree: tuple[RelayProcess, RelayProcess, RelayProcess], cert_dir: CertDir
) -> None:
    origin, edge_a, edge_b = tree
    pub = await Publisher(await connect_client(edge_a.url, str(cert_dir.ca)), {}).start()
    client = await connect_client(edge_b.url, str(cert_dir.ca))
    try:
        await origin.wait_namespaces(1)
        with pytest.raises(RequestRejected) as ei:
            await fetch_track(client, b"nowhere", 3)
        assert ei.value.code == RequestErrorCode.DOES_NOT_EXIST
        # Answered, not bounced between relays: each relay on the path asked upstream exactly once, and
        # edge A asked only its publisher (a request from upstream is never sent back upstream).
        key = 'kvnet_relay_upstream_requests_total{type="fetch"}'
        am, om, bm = await edge_a.ametrics(), await origin.ametrics(), await edge_b.ametrics()
        assert am.get(key, 0) == 1 and om.get(key, 0) == 1 and bm.get(key, 0) == 1
        assert pub.counts["fetch"] == 1
    finally:
        await pub.stop()
        await client.close_session()
