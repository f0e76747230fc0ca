"""kvnet-relay's subgroup streams toward a subscriber, held to the draft-18 rules by a strict checker
(``tests/interop/subgroup_checker.py``) while a publisher's groups overlap.

A real relay process, a real publisher PUBLISHing a track whose groups overlap (the next group starts
before the last one's subgroups end, a late object of an older group arrives after a newer group began,
a new subgroup opens in an older group), and a subscriber recording the raw bytes of each stream the
relay opens toward it and whether it ended with FIN or a reset.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from kvnet.net.config import TlsConfig
from kvnet.net.connection import MoqtConnection
from kvnet.net.endpoint import connect
from proto.data import ObjectStatus
from proto.errors import StreamResetCode
from tests.helpers.processes import CertDir, RelayProcess
from tests.helpers.waiting import async_wait_until
from tests.interop.subgroup_checker import Published, StreamRecorder, check_subgroup_streams

NS = (b"interop", b"subgroups")
ALIAS = 1


def payload(group: int, subgroup: int, object_id: int) -> bytes:
    return f"g{group}s{subgroup}o{object_id}|".encode().ljust(200, b".")


@asynccontextmanager
async def recording_subscriber(url: str, ca: str) -> AsyncIterator[tuple[MoqtConnection, StreamRecorder]]:
    """A kvnet client whose every QUIC event is also recorded (the bytes as they arrived)."""
    conn: MoqtConnection = await connect(url, tls=TlsConfig(ca_file=ca))  # type: ignore[arg-type]
    recorder = StreamRecorder()
    handle_event: Callable[[Any], None] = conn.quic_event_received

    def observe(event: Any) -> None:
        recorder.record(event)
        handle_event(event)

    setattr(conn, "quic_event_received", observe)  # noqa: B010 (the stack calls the instance's)
    try:
        yield conn, recorder
    finally:
        await asyncio.wait_for(conn.close_session(), 5)


class OverlappingPublisher:
    """PUBLISHes one track and sends its objects step by step; each step waits until the subscriber has
    the previous object, so the relay sees exactly this interleaving."""

    def __init__(self, conn: MoqtConnection, request_id: int, recorder: StreamRecorder) -> None:
        self.conn = conn
        self.request_id = request_id
        self.recorder = recorder
        self.streams: dict[tuple[int, int], int] = {}
        self.published: Published = {}
        self.sent = 0

    def plan(self, group: int, subgroup: int, objects: int, end: ObjectStatus | None = None) -> None:
        """The whole subgroup as the publisher makes it (what a complete stream must carry)."""
        objs = [(i, int(ObjectStatus.NORMAL), payload(group, subgroup, i)) for i in range(objects)]
        if end is not None:
            objs.append((objects, int(end), b""))
        self.published[(group, subgroup)] = objs

    async def send(self, group: int, subgroup: int, object_id: int, fin: bool = False) -> None:
        key = (group, subgroup)
        sid = self.streams.get(key)
        if sid is None:
            sid = self.streams[key] = self.conn.run_action(
                self.conn.session.open_subgroup, ALIAS, group, subgroup, None, first_object=True
            )
        _, status, data = self.published[key][object_id]
        self.conn.send_subgroup_object(sid, object_id, data, (), ObjectStatus(status), fin)
        self.sent += 1
        sent = self.sent
        await async_wait_until(lambda: self.recorder.objects_received() >= sent, f"{key}/{object_id} arrived")

    def close(self, group: int, subgroup: int) -> None:
        self.conn.close_subgroup(self.streams[(group, subgroup)])


async def start_track(
    relay: RelayProcess, ca: str, sub: MoqtConnection, recorder: StreamRecorder, name: bytes
) -> tuple[OverlappingPublisher, Any]:
    conn: MoqtConnection = await connect(relay.url, tls=TlsConfig(ca_file=ca))  # type: ignore[arg-type]
    ok = await conn.publish(NS, name, ALIAS)
    handle = await sub.subscribe(NS, name)
    assert handle.ok is not None
    return OverlappingPublisher(conn, ok.request_id, recorder), handle


def subscription_alias(handle: Any) -> int:
    alias: int = handle.ok.track_alias
    return alias


async def test_overlapping_groups_keep_each_subgroup_on_one_stream_closed_with_fin_when_whole(
    kvnet_relay: RelayProcess, cert_dir: CertDir
) -> None:
    ca = str(cert_dir.ca)
    async with recording_subscriber(kvnet_relay.url, ca) as (sub, recorder):
        pub, handle = await start_track(kvnet_relay, ca, sub, recorder, b"overlap")
        pub.plan(0, 0, 4, ObjectStatus.END_OF_GROUP)  # ends with an End of Group object and FIN
        pub.plan(0, 1, 2)  # a second subgroup of group 0, ends with a bare FIN
        pub.plan(1, 0, 3)  # ends with a bare FIN
        pub.plan(2, 0, 2, ObjectStatus.END_OF_TRACK)
        try:
            await pub.send(0, 0, 0)
            await pub.send(0, 0, 1)
            await pub.send(1, 0, 0)  # group 1 begins while group 0 is still going
            await pub.send(0, 0, 2)  # a late object of group 0's first subgroup
            await pub.send(0, 1, 0)  # a new subgroup of the older group
            await pub.send(2, 0, 0)
            await pub.send(1, 0, 1)
            await pub.send(0, 0, 3)
            await pub.send(0, 1, 1)
            pub.close(0, 1)
            await pub.send(1, 0, 2)
            pub.close(1, 0)
            await pub.send(0, 0, 4, fin=True)  # End of Group
            await pub.send(2, 0, 1)
            await pub.send(2, 0, 2, fin=True)  # End of Track
            pub.conn.publish_done(pub.request_id, 0x2, "track ended")
            received = await asyncio.wait_for(_drain(handle), 30)
        finally:
            await asyncio.wait_for(pub.conn.close_session(), 5)
        streams = recorder.subgroup_streams()
        errors = check_subgroup_streams(
            streams, subscription_alias(handle), pub.published, publisher_sets_first_object=True
        )
        assert errors == []
        # Every object went out, each subgroup on exactly one stream that ended with FIN.
        assert received == sum(len(objs) for objs in pub.published.values())
        assert sorted(s.key for s in streams) == sorted(pub.published)
        assert all(s.rec.fin for s in streams)


async def test_a_publisher_lost_mid_group_leaves_its_streams_reset_not_finished(
    kvnet_relay: RelayProcess, cert_dir: CertDir
) -> None:
    ca = str(cert_dir.ca)
    async with recording_subscriber(kvnet_relay.url, ca) as (sub, recorder):
        pub, handle = await start_track(kvnet_relay, ca, sub, recorder, b"cut")
        pub.plan(0, 0, 4)
        pub.plan(1, 0, 4)
        await pub.send(0, 0, 0)
        await pub.send(0, 0, 1)
        await pub.send(1, 0, 0)
        pub.conn.close()  # the publisher's session goes away mid-group, no MoQT goodbye
        await asyncio.wait_for(_drain(handle, tolerate_errors=True), 30)

        def both_ended() -> bool:
            streams = recorder.subgroup_streams()
            return len(streams) == 2 and all(s.rec.ended for s in streams)

        await async_wait_until(both_ended, "both subgroup streams ended")
        streams = recorder.subgroup_streams()
        assert check_subgroup_streams(streams, subscription_alias(handle), pub.published) == []
        assert all(s.rec.reset_code == StreamResetCode.CANCELLED for s in streams)


async def _drain(handle: Any, tolerate_errors: bool = False) -> int:
    n = 0
    try:
        async for _ in handle:
            n += 1
    except Exception:
        if not tolerate_errors:
            raise
    return n
