"""``relay.upstream.UpstreamRelay``: an edge relay's session to its upstream, over its whole lifecycle.

Real QUIC on loopback; the origins are relay processes (killed, restarted, sent SIGTERM), the edges whose
log is not read run in the test's own process (``tests.relay.inprocess``). An edge started before its
origin answers requests with a clear error and connects once the origin is up; after the origin is
restarted it reconnects (capped backoff) and announces again what its publishers announced, and a live
subscription through it resumes on the new session; an origin going away (SIGTERM) sends GOAWAY, the edge
leaves that session at once, and the draining origin refuses new sessions.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from kvnet.net.connection import MoqtConnection
from kvnet.net.errors import RequestRejected
from kvnet.net.handles import IncomingSubscribe
from kvnet.net.reconnect import DEFAULT_CAP_S, STABLE_SESSION_S
from proto import events as me
from proto.errors import RequestErrorCode
from tests.helpers.processes import CertDir, RelayProcess, free_port, start_relay
from tests.helpers.waiting import async_wait_until, scaled
from tests.relay.conftest import InProcessRelays, RelayFactory
from tests.relay.inprocess import InProcessRelay
from tests.relay.peers import NS, Publisher, connect_client, fetch_track, track_objects

RECONNECT_WITHIN = DEFAULT_CAP_S + 40.0
"""The backoff bound plus process start and handshake time on a loaded two-core machine."""


async def _connected(edge: RelayProcess | InProcessRelay, upstreams: int) -> None:
    what = f"edge with {upstreams} upstream session(s)"
    if isinstance(edge, InProcessRelay):
        await async_wait_until(lambda: edge.value("upstreams_connected") == upstreams, what, RECONNECT_WITHIN)
        return
    await edge.wait_metrics(lambda m: m.get("kvnet_relay_upstreams_connected", -1) == upstreams, what,
                            RECONNECT_WITHIN)


async def test_edge_before_its_origin_then_origin_restarted(
    cert_dir: CertDir, in_process_relays: InProcessRelays, tmp_path: Path
) -> None:
    origin_port = free_port()
    edge = await in_process_relays("--upstream", f"moqt://127.0.0.1:{origin_port}")
    publisher = await connect_client(edge.url, str(cert_dir.ca))
    pub = await Publisher(publisher, {b"t": track_objects(b"t")}).start()
    sub = await connect_client(edge.url, str(cert_dir.ca))
    origin: RelayProcess | None = None
    try:
        # No origin yet: a miss that only the upstream could answer says why it cannot, instead of waiting
        # for the upstream timeout (TIMEOUT) or claiming the track does not exist.
        with pytest.raises(RequestRejected) as refused:
            await fetch_track(sub, b"elsewhere", 1, ns=(b"other", b"ns"))
        assert refused.value.code == RequestErrorCode.INTERNAL_ERROR, refused.value
        assert "not connected" in refused.value.reason and str(origin_port) in refused.value.reason
        assert refused.value.retry_interval > 0

        for restart in range(2):
            origin = start_relay(cert_dir, tmp_path, port=origin_port, name=f"origin-{restart}")
            await _connected(edge, 1)
            # The publisher behind the edge is reachable from the origin: the edge (re-)announced its
            # namespace on this session.
            await origin.wait_namespaces(1, RECONNECT_WITHIN)
            at_origin = await connect_client(origin.url, str(cert_dir.ca))
            try:
                assert await fetch_track(at_origin, b"t", 4) == pub.tracks[b"t"]
            finally:
                await at_origin.close_session()
            origin.stop()  # SIGKILL: no GOAWAY, the edge notices by keep-alive loss
            await _connected(edge, 0)
        sessions = edge.value("upstream_sessions_total")
        assert sessions >= 2
    finally:
        await pub.stop()
        await sub.close_session()
        if origin is not None:
            origin.stop()


async def test_edge_leaves_a_draining_origin_on_goaway(
    cert_dir: CertDir, relay_factory: RelayFactory
) -> None:
    origin = relay_factory("--drain-timeout", "600", name="origin")
    edge = relay_factory("--upstream", origin.url, name="edge")
    await _connected(edge, 1)
    # A client that ignores the GOAWAY keeps the origin draining (it drains until its last session ends).
    holder = await connect_client(origin.url, str(cert_dir.ca))
    try:
        await origin.wait_metrics(lambda m: m.get("kvnet_relay_sessions", 0) == 2, "edge and holder")
        origin.proc.send_signal(signal.SIGTERM)
        # The edge moves off the session on GOAWAY and closes it at once, as nothing is in flight on it:
        # it does not hold the origin for the drain timeout.
        await _connected(edge, 0)
        await origin.wait_metrics(lambda m: m.get("kvnet_relay_sessions", 0) == 1,
                                  "the edge's session on the origin closed", RECONNECT_WITHIN)
        assert origin.proc.poll() is None, "the origin is still draining"
        # Its next attempts reach the draining origin, which refuses new sessions instead of accepting them.
        await origin.wait_metric('kvnet_relay_limit_rejections_total{limit="draining"}', 1, RECONNECT_WITHIN)
        assert "peer sent GOAWAY" in edge.log()
    finally:
        await holder.close_session()
    # The holder gone, the drain ends with it.
    await asyncio.to_thread(origin.proc.wait, scaled(30))


class LivePublisher:
    """Announces ``NS`` and accepts every SUBSCRIBE for track ``live``; ``send(i)`` publishes object ``i`` as
    group ``i`` on every subscription still open (a live track: a new subscriber gets what follows)."""

    def __init__(self, conn: MoqtConnection) -> None:
        self.conn = conn
        self.subscriptions: list[IncomingSubscribe] = []
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> LivePublisher:
        await self.conn.publish_namespace(NS)
        self.task = asyncio.create_task(self._run())
        return self

    async def _run(self) -> None:
        async for req in self.conn.incoming_requests():
            if isinstance(req, IncomingSubscribe) and req.event.track_name == b"live":
                req.accept_subscribe(len(self.subscriptions) + 1)
                self.subscriptions.append(req)
            else:
                req.reject(RequestErrorCode.DOES_NOT_EXIST, "live publisher: track live only")

    def open(self) -> list[IncomingSubscribe]:
        return [r for r in self.subscriptions if not r.gone]

    def send(self, i: int) -> None:
        for req in self.open():
            sid = req.open_subgroup(i, 0)
            req.send_object(sid, 0, f"live object {i}".encode(), end_stream=True)

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
        await asyncio.wait_for(self.conn.close_session(), scaled(5))


async def test_a_live_subscription_through_edges_resumes_after_the_origin_restarts(
    cert_dir: CertDir, in_process_relays: InProcessRelays, tmp_path: Path
) -> None:
    """Publisher behind edge A, subscriber behind edge B, origin between them (draft "Relays"). The origin
    is killed and restarted: both edges reconnect, A announces again, and B subscribes again upstream for
    the subscriber it kept. The subscriber's one subscription carries what was published before and after
    the restart, never ending in between; what was published while the origin was down is lost (live)."""
    origin = start_relay(cert_dir, tmp_path, name="origin-0")
    edge_a = await in_process_relays("--upstream", origin.url, "--upstream-idle-timeout", "1")
    edge_b = await in_process_relays("--upstream", origin.url, "--upstream-idle-timeout", "1")
    pub = await LivePublisher(await connect_client(edge_a.url, str(cert_dir.ca))).start()
    sub = await connect_client(edge_b.url, str(cert_dir.ca))
    got: list[bytes] = []
    try:
        await origin.wait_namespaces(1, RECONNECT_WITHIN)
        handle = await sub.subscribe(NS, b"live")

        async def collect() -> None:
            async for obj in handle:
                got.append(obj.payload)

        reader = asyncio.create_task(collect())
        await async_wait_until(lambda: len(pub.open()) == 1, "the subscription reached the publisher")
        for i in range(3):
            pub.send(i)
        await async_wait_until(lambda: len(got) == 3, "objects before the restart")

        origin.stop()  # SIGKILL: the edges notice by keep-alive loss
        await _connected(edge_b, 0)
        await async_wait_until(lambda: not pub.open(), "edge A ended the publisher's subscription")
        pub.send(99)  # nobody subscribed: lost, as on any live track
        origin = start_relay(cert_dir, tmp_path, port=origin.port, name="origin-1")
        await async_wait_until(lambda: len(pub.open()) == 1, "edge B subscribed again through the new origin",
                               timeout=RECONNECT_WITHIN)
        for i in range(3, 6):
            pub.send(i)
        await async_wait_until(lambda: len(got) == 6, "objects after the restart")
        assert got == [f"live object {i}".encode() for i in range(6)]
        assert not reader.done(), "the subscription never ended"
        assert edge_b.value("subscriptions_resumed_total") == 1
        reader.cancel()
    finally:
        await sub.close_session()
        await pub.stop()
        origin.stop()


async def test_a_namespace_subscription_at_an_edge_sees_the_tree_across_an_origin_restart(
    cert_dir: CertDir, in_process_relays: InProcessRelays, tmp_path: Path
) -> None:
    """SUBSCRIBE_NAMESPACE at edge B is forwarded upstream, so it learns of a namespace a publisher announced
    at edge A. The origin is killed: B says NAMESPACE_DONE (what the lost session told it is no longer
    known); restarted: B subscribes upstream again, A announces again, and the watcher hears NAMESPACE."""
    origin = start_relay(cert_dir, tmp_path, name="origin-0")
    edge_a = await in_process_relays("--upstream", origin.url, "--upstream-idle-timeout", "1")
    edge_b = await in_process_relays("--upstream", origin.url, "--upstream-idle-timeout", "1")
    watcher = await connect_client(edge_b.url, str(cert_dir.ca))
    heard: list[tuple[str, tuple[bytes, ...]]] = []

    def on_namespace(ev: me.NamespaceReceived | me.NamespaceDoneReceived) -> None:
        kind = "namespace" if isinstance(ev, me.NamespaceReceived) else "done"
        heard.append((kind, ev.track_namespace_suffix))

    pub: Publisher | None = None
    try:
        await _connected(edge_b, 1)
        await watcher.subscribe_namespace(NS[:2], on_namespace=on_namespace)
        publisher = await connect_client(edge_a.url, str(cert_dir.ca))
        pub = await Publisher(publisher, {b"t": track_objects(b"t")}).start()
        suffix = NS[2:]
        await async_wait_until(lambda: heard == [("namespace", suffix)],
                               "NAMESPACE from edge A via the origin", timeout=RECONNECT_WITHIN)

        origin.stop()  # SIGKILL: the edges notice by keep-alive loss
        await async_wait_until(lambda: heard[-1:] == [("done", suffix)],
                               "NAMESPACE_DONE when the origin left", timeout=RECONNECT_WITHIN)
        origin = start_relay(cert_dir, tmp_path, port=origin.port, name="origin-1")
        await async_wait_until(lambda: heard[-1:] == [("namespace", suffix)],
                               "NAMESPACE again through the restarted origin", timeout=RECONNECT_WITHIN)
        assert heard == [("namespace", suffix), ("done", suffix), ("namespace", suffix)]
    finally:
        await watcher.close_session()
        if pub is not None:
            await pub.stop()
        origin.stop()


@pytest.mark.parametrize("stack", ["aioquic", "qh3"])
async def test_an_edge_replaces_a_session_its_origin_closed_as_idle_at_once(
    cert_dir: CertDir, relay_factory: RelayFactory, stack: str
) -> None:
    """The origin closes the edge's quiet upstream session (``--session-idle-timeout``, NO_ERROR): the edge
    connects again at once, without its backoff, and the requests that come right after the close wait
    for the new session (answered by the origin) instead of being refused as "not connected"."""
    idle_timeout = STABLE_SESSION_S + 1  # a session shorter than STABLE_SESSION_S backs off as before
    origin = relay_factory("--session-idle-timeout", str(idle_timeout), "--quic-stack", stack, name="origin")
    edge = relay_factory("--upstream", origin.url, "--quic-stack", stack, name="edge")
    await _connected(edge, 1)
    client = await connect_client(edge.url, str(cert_dir.ca))
    try:
        await origin.wait_metric(
            'kvnet_relay_sessions_closed_total{reason="idle_timeout"}', 1, idle_timeout + RECONNECT_WITHIN
        )
        # Right after the close (the backoff would refuse requests for 0.125-0.25 s): every miss reaches
        # the origin, which has no such track, until the edge is on its second session and a few beyond.
        answered = 0
        while answered < 5 or (await edge.ametrics())["kvnet_relay_upstream_sessions_total"] < 2:
            with pytest.raises(RequestRejected) as refused:
                await fetch_track(client, b"missing-%d" % answered, 1, ns=(b"other", b"ns"))
            assert refused.value.code == RequestErrorCode.DOES_NOT_EXIST, refused.value
            answered += 1
        assert "upstream closed the session as idle: reconnecting" in edge.log()
        assert "upstream session ended" not in edge.log(), "the edge backed off"
    finally:
        await client.close_session()
