"""The block server (``kvnet.exchange.publishing.BlockServer``) answering a real MoQT peer in memory:
TRACK_STATUS, FETCH and SUBSCRIBE for what its store holds, typed refusals for everything else."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from kvnet.exchange.publishing import BlockServer
from kvnet.net.errors import RequestRejected
from kvnet.net.handles import IncomingPublishNamespace
from proto.data import ObjectStatus
from proto.errors import RequestErrorCode
from proto.events import PublishNamespaceReceived
from proto.kvobject import BLOCK_GROUP_ID, MANIFEST_OBJECT_ID, BlockManifest, block_namespace, block_track
from proto.messages import Location
from tests.helpers.connections import ConnectionPair
from tests.kvnet.exchange.conftest import (
    FINGERPRINT,
    HASHES,
    NAMESPACE_ID,
    SPEC,
    Published,
    block_server,
    serving_store,
)

WHOLE_BLOCK_END = Location(BLOCK_GROUP_ID, SPEC.num_layers + 1)


@pytest.fixture
async def server(pair: ConnectionPair, published: Published) -> AsyncIterator[BlockServer]:
    """A server whose store holds the first four of the prompt's six blocks."""
    server = block_server(pair, serving_store(published.blocks[:4]))
    task = asyncio.create_task(server.serve())
    yield server
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_track_status_answers_for_stored_blocks_only(pair: ConnectionPair, server: BlockServer) -> None:
    ns, name = block_track(FINGERPRINT, NAMESPACE_ID, HASHES[0], "lossless")
    ok = await pair.client.track_status(ns, name)
    assert ok.parameters.largest_object == Location(BLOCK_GROUP_ID, SPEC.num_layers)
    for track in (
        block_track(FINGERPRINT, NAMESPACE_ID, HASHES[4], "lossless"),  # not in the store
        block_track(FINGERPRINT, NAMESPACE_ID, HASHES[0], "int8"),  # a rendition it does not hold
        block_track(FINGERPRINT, "other-ns", HASHES[0], "lossless"),  # another namespace id
        block_track(bytes(32), NAMESPACE_ID, HASHES[0], "lossless"),  # another model
        (block_namespace(FINGERPRINT, NAMESPACE_ID), b"not a block track"),
    ):
        with pytest.raises(RequestRejected) as info:
            await pair.client.track_status(*track)
        assert info.value.code == RequestErrorCode.DOES_NOT_EXIST
    assert (server.stats.track_status_ok, server.stats.track_status_missing) == (1, 5)


async def test_fetch_sends_the_stored_objects_in_order(
    pair: ConnectionPair, server: BlockServer, published: Published
) -> None:
    stored = published.blocks[2]
    ns, name = block_track(FINGERPRINT, NAMESPACE_ID, stored.block_hash, "lossless")
    handle = await pair.client.fetch(ns, name, Location(BLOCK_GROUP_ID, 0), WHOLE_BLOCK_END)
    objects = [o for o in await handle.read_all() if o.status == ObjectStatus.NORMAL]
    assert [o.object_id for o in objects] == list(range(SPEC.num_layers + 1))
    assert tuple(o.payload for o in objects) == stored.objects
    manifest = BlockManifest.decode(objects[MANIFEST_OBJECT_ID].payload)
    assert manifest.block_hash == stored.block_hash and manifest.parent_hash == HASHES[1]
    assert server.stats.fetches_served == 1
    assert server.stats.bytes_sent == sum(len(p) for p in stored.objects)


async def test_fetch_of_a_range_sends_only_that_range(
    pair: ConnectionPair, server: BlockServer, published: Published
) -> None:
    stored = published.blocks[0]
    ns, name = block_track(FINGERPRINT, NAMESPACE_ID, stored.block_hash, "lossless")
    # [1, 3): layers 0 and 1, without the manifest.
    handle = await pair.client.fetch(ns, name, Location(BLOCK_GROUP_ID, 1), Location(BLOCK_GROUP_ID, 3))
    ok = await handle.ok()
    # FETCH_OK covers exactly the range sent: not the end of the track, End Location one past object 2.
    assert (ok.end_of_track, ok.end_location) == (False, Location(BLOCK_GROUP_ID, 3))
    objects = [o for o in await handle.read_all() if o.status == ObjectStatus.NORMAL]
    assert [(o.object_id, o.payload) for o in objects] == [(1, stored.objects[1]), (2, stored.objects[2])]


async def test_fetch_ok_claims_the_end_of_track_only_when_the_response_reaches_it(
    pair: ConnectionPair, server: BlockServer, published: Published
) -> None:
    ns, name = block_track(FINGERPRINT, NAMESPACE_ID, published.blocks[1].block_hash, "lossless")
    probe = await pair.client.fetch(ns, name, Location(BLOCK_GROUP_ID, 0), Location(BLOCK_GROUP_ID, 1))
    ok = await probe.ok()  # the one-object manifest probe
    assert (ok.end_of_track, ok.end_location) == (False, Location(BLOCK_GROUP_ID, 1))
    assert len(await probe.read_all()) == 1
    for end in (WHOLE_BLOCK_END, Location(BLOCK_GROUP_ID + 1, 0), Location(BLOCK_GROUP_ID, 1000)):
        whole = await pair.client.fetch(ns, name, Location(BLOCK_GROUP_ID, 0), end)
        ok = await whole.ok()
        assert (ok.end_of_track, ok.end_location) == (True, WHOLE_BLOCK_END)
        await whole.read_all()


async def test_fetch_starting_past_the_last_object_is_an_invalid_range(
    pair: ConnectionPair, server: BlockServer, published: Published
) -> None:
    ns, name = block_track(FINGERPRINT, NAMESPACE_ID, published.blocks[1].block_hash, "lossless")
    for start in (WHOLE_BLOCK_END, Location(BLOCK_GROUP_ID + 1, 0)):
        handle = await pair.client.fetch(ns, name, start, Location(BLOCK_GROUP_ID + 2, 0))
        with pytest.raises(RequestRejected) as info:
            await handle.read_all()
        assert info.value.code == RequestErrorCode.INVALID_RANGE


async def test_fetch_of_a_missing_block_is_refused(pair: ConnectionPair, server: BlockServer) -> None:
    ns, name = block_track(FINGERPRINT, NAMESPACE_ID, HASHES[5], "lossless")
    handle = await pair.client.fetch(ns, name, Location(BLOCK_GROUP_ID, 0), WHOLE_BLOCK_END)
    with pytest.raises(RequestRejected) as info:
        await handle.read_all()
    assert info.value.code == RequestErrorCode.DOES_NOT_EXIST
    assert server.stats.fetches_served == 0


async def test_subscribe_delivers_the_block_then_ends_the_track(
    pair: ConnectionPair, server: BlockServer, published: Published
) -> None:
    stored = published.blocks[1]
    ns, name = block_track(FINGERPRINT, NAMESPACE_ID, stored.block_hash, "lossless")
    subscription = await pair.client.subscribe(ns, name)
    received = [o async for o in subscription]
    assert tuple(o.payload for o in received if o.status == ObjectStatus.NORMAL) == stored.objects
    assert received[-1].status == ObjectStatus.END_OF_TRACK
    assert subscription.done is not None
    assert server.stats.subscribes_served == 1


async def test_requests_a_block_server_does_not_serve_are_refused(
    pair: ConnectionPair, server: BlockServer
) -> None:
    with pytest.raises(RequestRejected) as info:
        await pair.client.subscribe_namespace((b"kvnet",))
    assert info.value.code == RequestErrorCode.NOT_SUPPORTED
    assert server.stats.requests_refused == 1
    # The session is still up: a block request after the refusal is answered.
    ns, name = block_track(FINGERPRINT, NAMESPACE_ID, HASHES[3], "lossless")
    await pair.client.track_status(ns, name)


async def test_announce_publishes_the_block_namespace(pair: ConnectionPair, published: Published) -> None:
    server = block_server(pair, serving_store(published.blocks))
    announce = asyncio.create_task(server.announce())
    incoming = await anext(pair.client.incoming_requests())
    assert isinstance(incoming, IncomingPublishNamespace)
    assert isinstance(incoming.event, PublishNamespaceReceived)
    assert incoming.event.track_namespace == block_namespace(FINGERPRINT, NAMESPACE_ID)
    incoming.accept()
    await announce
