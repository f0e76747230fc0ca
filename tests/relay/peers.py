"""Real MoQT peers for relay tests: a scripted publisher that counts what it is asked for, and clients.

They speak to the relay process over QUIC on loopback through ``kvnet.net.connection``, exactly as the nodes
do.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from aioquic.asyncio import QuicConnectionProtocol
from aioquic.asyncio import connect as quic_connect
from aioquic.quic import events as qe
from aioquic.quic.configuration import QuicConfiguration

from kvnet.net.config import TlsConfig
from kvnet.net.connection import MoqtConnection
from kvnet.net.endpoint import connect
from kvnet.net.handles import IncomingFetch, IncomingRequest, IncomingSubscribe, IncomingTrackStatus
from proto.data import ObjectStatus
from proto.errors import RequestErrorCode
from proto.messages import Location, MessageParameters, Setup, encode_message
from tests.helpers.connections import client_config, client_limits
from tests.helpers.waiting import async_wait_until, scaled

NS = (b"kvnet", b"v1", b"fp-test", b"tenant")


def track_objects(name: bytes, n: int = 4, size: int = 1000) -> list[bytes]:
    """Deterministic payloads of a test track: object i is distinct per track and index."""
    return [(name + b":" + str(i).encode() + b":").ljust(size, bytes([65 + i % 26])) for i in range(n)]


async def connect_client(url: str, ca: str) -> MoqtConnection:
    return await connect(url, client_config(), TlsConfig(ca_file=ca), limits=client_limits())  # type: ignore[arg-type]


@dataclass
class Publisher:
    """Announces ``namespace``; serves FETCH / TRACK_STATUS / SUBSCRIBE for ``tracks`` (name -> payloads)."""

    conn: MoqtConnection
    tracks: dict[bytes, list[bytes]]
    namespace: tuple[bytes, ...] = NS
    counts: Counter[str] = field(default_factory=Counter)
    objects_sent: int = 0
    fetch_delay: float = 0.0
    """Seconds to wait before answering a FETCH (lets concurrent requests pile up at the relay)."""
    fetch_gate: asyncio.Event | None = None
    """When set to an event, FETCHes are held until the test sets it (they keep the relay's slots)."""
    live: asyncio.Event = field(default_factory=asyncio.Event)
    """Set to make accepted SUBSCRIBEs send their track."""
    status_delay: float = 0.0
    """Seconds to wait before answering a TRACK_STATUS."""
    finish_delay: float = 0.0
    """Seconds between a FETCH's last object and the FIN of its stream."""
    cut_after: int | None = None
    """Drop the connection after sending this many fetch objects (a publisher dying mid-track)."""
    task: asyncio.Task[None] | None = None

    async def start(self) -> Publisher:
        await self.conn.publish_namespace(self.namespace)
        self.task = asyncio.create_task(self._run())
        return self

    async def _run(self) -> None:
        tasks = set()
        async for req in self.conn.incoming_requests():
            t = asyncio.create_task(self._handle(req))
            tasks.add(t)
            t.add_done_callback(tasks.discard)

    async def _handle(self, req: IncomingRequest) -> None:
        ev = req.event
        name = getattr(ev, "track_name", None)
        if isinstance(req, IncomingTrackStatus):
            self.counts["track_status"] += 1
            objs = self.tracks.get(ev.track_name)  # type: ignore[attr-defined]
            if self.status_delay:  # a deliberately slow publisher: the delay is the behaviour under test
                await asyncio.sleep(self.status_delay)
            if objs is None:
                req.reject(RequestErrorCode.DOES_NOT_EXIST, "unknown track")
            else:
                req.respond(MessageParameters(largest_object=Location(0, len(objs) - 1)))
        elif isinstance(req, IncomingFetch):
            self.counts["fetch"] += 1
            objs = self.tracks.get(name) if name is not None else None
            if self.fetch_delay:  # a deliberately slow publisher: the delay is the behaviour under test
                await asyncio.sleep(self.fetch_delay)
            if self.fetch_gate is not None:
                await self.fetch_gate.wait()
            if objs is None:
                req.reject(RequestErrorCode.DOES_NOT_EXIST, "unknown track")
                return
            req.accept_fetch(True, Location(0, len(objs)))
            for i, payload in enumerate(objs):
                if self.cut_after is not None and i == self.cut_after:
                    self.conn.close()  # abrupt: no MoQT close, the transport just goes away
                    return
                req.send_object(0, 0, i, payload)
                self.objects_sent += 1
                await req.drain()
            if self.finish_delay:  # a deliberately slow publisher: the delay is the behaviour under test
                await asyncio.sleep(self.finish_delay)
            req.finish()
        elif isinstance(req, IncomingSubscribe):
            self.counts["subscribe"] += 1
            objs = self.tracks.get(ev.track_name)  # type: ignore[attr-defined]
            if objs is None:
                req.reject(RequestErrorCode.DOES_NOT_EXIST, "unknown track")
                return
            req.accept_subscribe(1)
            await self.live.wait()
            sid = req.open_subgroup(0, 0)
            for i, payload in enumerate(objs):
                req.send_object(sid, i, payload)
                self.objects_sent += 1
            req.send_object(sid, len(objs), b"", end_stream=True, status=ObjectStatus.END_OF_TRACK)
            # At once: PUBLISH_DONE's Stream Count keeps the subscription open until the data has arrived.
            with contextlib.suppress(Exception):
                req.publish_done(0x2, "track ended")
        else:
            req.reject(RequestErrorCode.NOT_SUPPORTED, "test publisher")

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.conn.close_session(), scaled(2))


async def fetch_track(conn: MoqtConnection, name: bytes, n: int, ns: tuple[bytes, ...] = NS) -> list[bytes]:
    """Whole-group FETCH of objects 0..n-1 via ``conn``; payloads in order."""
    h = await conn.fetch(ns, name, Location(0, 0), Location(0, n))
    ok = await h.ok()
    assert ok.end_of_track
    objs = await h.read_all()
    assert [o.object_id for o in objs] == list(range(len(objs)))
    return [o.payload for o in objs]


class RawPeer(QuicConnectionProtocol):
    """Records what the relay does to us; sends whatever bytes the test writes."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.terminated: asyncio.Future[tuple[int, str]] = asyncio.get_running_loop().create_future()
        self.stop_sending: dict[int, int] = {}
        self.resets: dict[int, int] = {}
        self.received = 0
        self.data: dict[int, bytes] = {}

    def quic_event_received(self, event: qe.QuicEvent) -> None:
        if isinstance(event, qe.ConnectionTerminated) and not self.terminated.done():
            self.terminated.set_result((event.error_code, event.reason_phrase))
        elif isinstance(event, qe.StopSendingReceived):
            self.stop_sending[event.stream_id] = event.error_code
        elif isinstance(event, qe.StreamReset):
            self.resets[event.stream_id] = event.error_code
        elif isinstance(event, qe.StreamDataReceived):
            self.received += len(event.data)
            if len(self.data.get(event.stream_id, b"")) < 4096:
                self.data[event.stream_id] = self.data.get(event.stream_id, b"") + event.data

    def send(self, stream_id: int, data: bytes, fin: bool = False) -> None:
        self._quic.send_stream_data(stream_id, data, fin)
        self.transmit()

    def new_stream(self, uni: bool) -> int:
        return self._quic.get_next_available_stream_id(is_unidirectional=uni)

    def setup(self) -> None:
        self.send(self.new_stream(True), encode_message(Setup()))

    async def setup_done(self) -> None:
        """Send SETUP and return once the relay's own SETUP has arrived (on a server-opened uni stream)."""
        self.setup()
        await async_wait_until(lambda: any(sid % 4 == 3 for sid in self.data), "the relay's SETUP")


def raw_config(ca: Path) -> QuicConfiguration:
    cfg = QuicConfiguration(is_client=True, alpn_protocols=["moqt-18"], server_name="localhost")
    cfg.verify_mode = ssl.CERT_REQUIRED
    cfg.load_verify_locations(cafile=str(ca))
    return cfg


@contextlib.asynccontextmanager
async def raw_peer(port: int, ca: Path) -> AsyncIterator[RawPeer]:
    """A raw QUIC connection to the relay on loopback ``port``, for hand-made or malformed MoQT bytes."""
    config = raw_config(ca)
    async with quic_connect("127.0.0.1", port, configuration=config, create_protocol=RawPeer) as peer:
        assert isinstance(peer, RawPeer)
        yield peer
