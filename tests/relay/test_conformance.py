"""Draft-18 relay behaviour a third-party client checks: rendezvous, SUBSCRIBE_TRACKS, joining FETCH,
PREFIX_OVERLAP and FETCH of a PUBLISH-fed track, against a relay in the test's own process
(``tests.relay.inprocess``) over real QUIC on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from kvnet.net.errors import RequestRejected
from kvnet.net.handles import IncomingPublish
from proto.data import ObjectStatus
from proto.errors import PublishDoneCode, RequestErrorCode
from proto.events import NamespaceDoneReceived, NamespaceReceived, RequestOkReceived
from proto.messages import Location, MessageParameters
from tests.helpers.processes import CertDir
from tests.helpers.waiting import async_wait_until, scaled
from tests.relay.inprocess import InProcessRelay, relay_in_process
from tests.relay.peers import NS, Publisher, connect_client, track_objects


@pytest.fixture
async def relay(cert_dir: CertDir) -> AsyncIterator[InProcessRelay]:
    """A relay in the test's process (in place of conftest's relay process), stopped after the test."""
    async with relay_in_process(cert_dir) as running:
        yield running


async def test_rendezvous_timeout_answers_timeout(cert_dir: CertDir, relay: InProcessRelay) -> None:
    sub = await connect_client(relay.url, str(cert_dir.ca))
    try:
        with pytest.raises(RequestRejected) as info:
            await sub.subscribe(NS, b"nobody", MessageParameters(rendezvous_timeout=200))
        assert info.value.code == RequestErrorCode.TIMEOUT
        # Without the parameter the answer stays DOES_NOT_EXIST at once.
        with pytest.raises(RequestRejected) as info:
            await sub.subscribe(NS, b"nobody")
        assert info.value.code == RequestErrorCode.DOES_NOT_EXIST
    finally:
        await sub.close_session()


async def test_rendezvous_routes_to_a_publisher_that_comes_later(
    cert_dir: CertDir, relay: InProcessRelay
) -> None:
    sub = await connect_client(relay.url, str(cert_dir.ca))
    pub: Publisher | None = None
    try:
        pending = asyncio.ensure_future(
            sub.subscribe(NS, b"late", MessageParameters(rendezvous_timeout=30_000))
        )
        # The SUBSCRIBE is held at the relay (an open request) before any publisher exists.
        await relay.wait_value("requests_inflight", 1)
        assert not pending.done()
        pub_conn = await connect_client(relay.url, str(cert_dir.ca))
        pub = await Publisher(pub_conn, {b"late": track_objects(b"late")}).start()
        subscription = await asyncio.wait_for(pending, scaled(10))
        pub.live.set()
        got = [ev.payload async for ev in subscription if ev.payload]
        assert got == pub.tracks[b"late"]
    finally:
        if pub is not None:
            await pub.stop()
        await sub.close_session()


async def test_subscribe_tracks_gets_publish(cert_dir: CertDir, relay: InProcessRelay) -> None:
    sub = await connect_client(relay.url, str(cert_dir.ca))
    pub = await connect_client(relay.url, str(cert_dir.ca))
    try:
        sub.run_action(sub.session.subscribe_tracks, NS[:2])
        await relay.wait_value("requests_total", 1, outcome="ok", type="subscribe_tracks")
        objs = track_objects(b"pushed", 5)
        ok = asyncio.ensure_future(pub.publish(NS, b"pushed", 7))
        # The relay offers the track to the SUBSCRIBE_TRACKS subscriber with a PUBLISH of its own.
        offered = await asyncio.wait_for(sub.next_request(), scaled(10))
        assert isinstance(offered, IncomingPublish)
        assert (offered.event.track_namespace, offered.event.track_name) == (NS, b"pushed")
        objects = offered.accept_publish(MessageParameters(forward=1))
        await relay.wait_value("requests_total", 1, outcome="ok", type="publish")
        sid = pub.open_subgroup(7, 0, 0)
        for i, payload in enumerate(objs):
            pub.send_subgroup_object(sid, i, payload)
        pub.send_subgroup_object(sid, len(objs), b"", status=ObjectStatus.END_OF_TRACK, end_stream=True)
        pub.publish_done((await ok).request_id, PublishDoneCode.TRACK_ENDED, "pushed")
        got = [ev.payload async for ev in objects if ev.payload]
        assert got == objs
    finally:
        await pub.close_session()
        await sub.close_session()


async def test_overlapping_subscribe_namespace_gets_prefix_overlap(
    cert_dir: CertDir, relay: InProcessRelay
) -> None:
    watcher = await connect_client(relay.url, str(cert_dir.ca))
    try:
        answers = []
        for prefix in (NS[:2], NS[:3], (b"other",)):
            rid = watcher.run_action(watcher.session.subscribe_namespace, prefix)
            answer = watcher.router.expect_answer(rid)  # resolved with REQUEST_OK or REQUEST_ERROR
            answers.append(answer)
        first, overlapping, disjoint = await asyncio.wait_for(
            asyncio.gather(*answers, return_exceptions=True), scaled(10)
        )
        assert isinstance(first, RequestOkReceived) and isinstance(disjoint, RequestOkReceived)
        assert isinstance(overlapping, RequestRejected)
        assert overlapping.code == RequestErrorCode.PREFIX_OVERLAP
    finally:
        await watcher.close_session()


async def test_fetch_of_a_live_published_track_is_served_by_the_relay(
    cert_dir: CertDir, relay: InProcessRelay
) -> None:
    # The publisher PUBLISHes without announcing a namespace: the relay is the only one that can answer.
    pub = await connect_client(relay.url, str(cert_dir.ca))
    fetcher = await connect_client(relay.url, str(cert_dir.ca))
    try:
        groups = [track_objects(b"live-g0", 3, 700), track_objects(b"live-g1", 3, 700)]
        ok = await pub.publish(NS, b"live", 3)
        for group, objs in enumerate(groups):
            sid = pub.open_subgroup(3, group, 0)
            for i, payload in enumerate(objs):
                pub.send_subgroup_object(sid, i, payload)
            pub.close_subgroup(sid)
        await relay.wait_value("bytes_in_total", sum(map(len, groups[0] + groups[1])))
        handle = await fetcher.fetch(NS, b"live", Location(0, 0), Location(1, 0))
        fetched = await handle.read_all()
        assert [(o.group_id, o.object_id) for o in fetched] == [(g, i) for g in range(2) for i in range(3)]
        assert [o.payload for o in fetched] == groups[0] + groups[1]
        assert not (await handle.ok()).end_of_track  # the track is still live
        sid = pub.open_subgroup(3, 2, 0)
        pub.send_subgroup_object(sid, 0, b"last")
        pub.send_subgroup_object(sid, 1, b"", status=ObjectStatus.END_OF_TRACK, end_stream=True)
        await relay.wait_value("bytes_in_total", sum(map(len, groups[0] + groups[1])) + 4)

        async def ended_answer() -> bool:
            # The END_OF_TRACK status object follows the last payload; poll until the relay has it.
            whole = await fetcher.fetch(NS, b"live", Location(0, 0), Location(3, 0))
            await whole.read_all()
            return (await whole.ok()).end_of_track

        await async_wait_until(ended_answer, "a FETCH of the ended track reporting End Of Track")
        pub.publish_done(ok.request_id, PublishDoneCode.TRACK_ENDED, "done")
    finally:
        await fetcher.close_session()
        await pub.close_session()


async def test_subscribe_namespace_hears_of_namespaces_known_only_by_publish(
    cert_dir: CertDir, relay: InProcessRelay
) -> None:
    # Draft "Subscribing to Namespaces": the relay echoes namespaces under the prefix that were published
    # to it, also those that only a PUBLISH (no PUBLISH_NAMESPACE) brought; NAMESPACE_DONE once the last
    # such track ended.
    front, back = (b"demo", b"cams", b"front"), (b"demo", b"cams", b"back")
    heard: list[tuple[str, tuple[bytes, ...]]] = []
    early_heard: list[tuple[str, tuple[bytes, ...]]] = []

    def listener(into: list[tuple[str, tuple[bytes, ...]]]) -> Callable[[object], None]:
        def on_namespace(ev: object) -> None:
            assert isinstance(ev, NamespaceReceived | NamespaceDoneReceived)
            kind = "done" if isinstance(ev, NamespaceDoneReceived) else "ns"
            into.append((kind, ev.track_namespace_suffix))

        return on_namespace

    def end_track(alias: int, request_id: int) -> None:
        sid = pub.open_subgroup(alias, 0, 0)
        pub.send_subgroup_object(sid, 0, b"", status=ObjectStatus.END_OF_TRACK, end_stream=True)
        pub.publish_done(request_id, PublishDoneCode.TRACK_ENDED, "done")

    early = await connect_client(relay.url, str(cert_dir.ca))
    late = await connect_client(relay.url, str(cert_dir.ca))
    pub = await connect_client(relay.url, str(cert_dir.ca))
    try:
        await early.subscribe_namespace((b"demo",), on_namespace=listener(early_heard))
        cam0 = await pub.publish(front, b"cam-0", 1)
        cam1 = await pub.publish(front, b"cam-1", 2)
        await async_wait_until(lambda: early_heard, "NAMESPACE to the watcher that was there first")
        await late.subscribe_namespace((b"demo", b"cams"), on_namespace=listener(heard))
        await async_wait_until(lambda: heard, "NAMESPACE to the watcher that came after the PUBLISH")
        end_track(1, cam0.request_id)  # cam-1 is still live: the namespace stays
        await async_wait_until(lambda: relay.value("fanouts") == 1, "cam-0 ended at the relay")
        cam2 = await pub.publish(back, b"cam-2", 3)
        await async_wait_until(lambda: len(heard) == 2 and len(early_heard) == 2, "NAMESPACE of the 2nd")
        end_track(2, cam1.request_id)
        end_track(3, cam2.request_id)
        await async_wait_until(lambda: len(heard) == 4 and len(early_heard) == 4, "NAMESPACE_DONE of both")
        assert sorted(early_heard[2:]) == [("done", (b"cams", b"back")), ("done", (b"cams", b"front"))]
        assert early_heard[:2] == [("ns", (b"cams", b"front")), ("ns", (b"cams", b"back"))]
        assert heard[:2] == [("ns", (b"front",)), ("ns", (b"back",))]
        assert sorted(heard[2:]) == [("done", (b"back",)), ("done", (b"front",))]
    finally:
        for conn in (pub, early, late):
            await conn.close_session()
