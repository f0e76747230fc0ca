"""Relay operations against the real daemon: limits, PUBLISH into the cache, namespace discovery, logs."""

from __future__ import annotations

import asyncio
import json
import socket
import urllib.error
import urllib.request

import pytest

from kvnet.net.errors import MoqtConnectionError, RequestRejected
from proto.data import ObjectStatus
from proto.errors import PublishDoneCode, RequestErrorCode, SessionErrorCode
from proto.events import NamespaceReceived
from proto.messages import Location, TrackStatus, encode_message
from tests.helpers.processes import CertDir, RelayProcess
from tests.helpers.waiting import async_wait_until, scaled
from tests.relay.conftest import RelayFactory
from tests.relay.peers import (
    NS,
    Publisher,
    connect_client,
    fetch_track,
    raw_peer,
    track_objects,
)


async def test_session_limit(cert_dir: CertDir, relay_factory: RelayFactory) -> None:
    rp = relay_factory("--max-sessions", "2", "--pressure-idle-timeout", "0")
    pub = await Publisher(await connect_client(rp.url, str(cert_dir.ca)), {b"t": track_objects(b"t")}).start()
    sub = await connect_client(rp.url, str(cert_dir.ca))
    try:
        # The relay accepts SETUP, then closes the session over its limit with a reason saying so.
        extra = None
        try:
            extra = await connect_client(rp.url, str(cert_dir.ca))
            code, reason = await asyncio.wait_for(extra.wait_session_closed(), scaled(5))
        except MoqtConnectionError as exc:
            code, reason = SessionErrorCode.INTERNAL_ERROR, str(exc)
        assert code == SessionErrorCode.INTERNAL_ERROR and "sessions" in reason
        assert await fetch_track(sub, b"t", 4) == pub.tracks[b"t"]
        m = await rp.ametrics()
        assert m['kvnet_relay_limit_rejections_total{limit="sessions"}'] == 1
        assert m["kvnet_relay_sessions"] == 2
    finally:
        await pub.stop()
        await sub.close_session()


async def test_requests_per_session_limit(
    cert_dir: CertDir, relay_factory: RelayFactory
) -> None:
    rp = relay_factory("--max-requests-per-session", "3")
    tracks = {f"s{i}".encode(): track_objects(f"s{i}".encode()) for i in range(6)}
    pub = await Publisher(await connect_client(rp.url, str(cert_dir.ca)), tracks).start()
    pub.fetch_delay = 1.0
    sub = await connect_client(rp.url, str(cert_dir.ca))
    try:
        results = await asyncio.gather(
            *(fetch_track(sub, name, 4) for name in tracks), return_exceptions=True
        )
        refused = [r for r in results if isinstance(r, RequestRejected)]
        served = [r for r in results if isinstance(r, list)]
        assert len(served) == 3 and len(refused) == 3, results
        assert all(r.code == RequestErrorCode.EXCESSIVE_LOAD and r.retry_interval > 0 for r in refused)
        # The limit is on concurrent requests: once those finished, new ones are served.
        assert await fetch_track(sub, b"s5", 4) == tracks[b"s5"]
    finally:
        await pub.stop()
        await sub.close_session()


async def test_publish_pushes_track_into_cache(relay: RelayProcess, cert_dir: CertDir) -> None:
    objs = track_objects(b"pushed", 5)
    pub = await Publisher(await connect_client(relay.url, str(cert_dir.ca)), {}).start()
    c = pub.conn
    ok = asyncio.ensure_future(c.publish(NS, b"pushed", 42))
    await asyncio.sleep(0)  # the PUBLISH is out; its objects follow at once, before PUBLISH_OK
    sid = c.open_subgroup(42, 0, 0)
    for i, payload in enumerate(objs):
        c.send_subgroup_object(sid, i, payload)
    c.send_subgroup_object(sid, len(objs), b"", status=ObjectStatus.END_OF_TRACK, end_stream=True)
    c.publish_done((await ok).request_id, PublishDoneCode.TRACK_ENDED, "pushed")
    sub = await connect_client(relay.url, str(cert_dir.ca))
    try:
        await relay.wait_metric("kvnet_relay_cache_objects", len(objs))
        st = await sub.track_status(NS, b"pushed")
        assert st.parameters.largest_object == Location(0, 4)
        assert await fetch_track(sub, b"pushed", 5) == objs
        # Neither request reached the publisher: both came from the pushed copy.
        assert pub.counts["fetch"] == 0 and pub.counts["track_status"] == 0
    finally:
        await pub.stop()
        await sub.close_session()


async def test_subscribe_namespace_lists_and_follows_announcements(
    relay: RelayProcess, cert_dir: CertDir
) -> None:
    first = await Publisher(await connect_client(relay.url, str(cert_dir.ca)), {}).start()
    watcher = await connect_client(relay.url, str(cert_dir.ca))
    try:
        rid = watcher.run_action(watcher.session.subscribe_namespace, (b"kvnet", b"v1"))
        other_ns = (b"kvnet", b"v1", b"fp-other", b"tenant")
        second = Publisher(await connect_client(relay.url, str(cert_dir.ca)), {}, namespace=other_ns)
        await second.start()

        def seen() -> set[tuple[bytes, ...]]:
            return {
                ev.track_namespace_suffix
                for ev in watcher.other_events
                if isinstance(ev, NamespaceReceived) and ev.request_id == rid
            }

        await async_wait_until(lambda: len(seen()) == 2, "both namespaces announced to the watcher")
        assert seen() == {NS[2:], other_ns[2:]}
        await second.stop()
    finally:
        await first.stop()
        await watcher.close_session()


async def test_going_away_requests_refused_after_sigterm(
    cert_dir: CertDir, relay_factory: RelayFactory
) -> None:
    rp = relay_factory("--drain-timeout", "3")
    client = await connect_client(rp.url, str(cert_dir.ca))
    # A raw peer ignores the GOAWAY and keeps sending requests, which the relay must refuse.
    async with raw_peer(rp.port, cert_dir.ca) as raw:
        await raw.setup_done()
        rp.proc.send_signal(15)
        await asyncio.wait_for(client.goaway_event.wait(), scaled(5))
        sid = raw.new_stream(False)
        raw.send(sid, encode_message(TrackStatus(0, NS, b"anything")))
        await async_wait_until(lambda: raw.data.get(sid), "the relay's answer to a request after GOAWAY")
        # REQUEST_ERROR (0x05), 16-bit length, then Error Code GOING_AWAY (0x06).
        answer = raw.data.get(sid, b"")
        assert answer[:1] == b"\x05" and answer[3:4] == bytes([RequestErrorCode.GOING_AWAY]), answer
    await client.close_session()
    assert await asyncio.to_thread(rp.proc.wait, 10) == 0


def test_json_logs_and_metrics_endpoint(
    relay_factory: RelayFactory
) -> None:
    rp = relay_factory("--log-format", "json")
    lines = [json.loads(line) for line in rp.log().splitlines() if line.startswith("{")]
    listening = [e for e in lines if e["msg"] == "listening"]
    assert listening and listening[0]["quic"] == f"127.0.0.1:{rp.port}"
    metrics_url = f"http://127.0.0.1:{rp.metrics_port}/metrics"
    text = urllib.request.urlopen(metrics_url, timeout=scaled(5)).read().decode()
    assert "# TYPE kvnet_relay_cache_bytes gauge" in text
    assert "# TYPE kvnet_relay_requests_total counter" in text
    with pytest.raises(urllib.error.HTTPError) as ei:
        urllib.request.urlopen(f"http://127.0.0.1:{rp.metrics_port}/other", timeout=scaled(5))
    assert ei.value.code == 404
    # HEAD answers the headers only; other methods and garbage get a status, never a hang or a crash.
    head = urllib.request.urlopen(
        urllib.request.Request(metrics_url, method="HEAD"), timeout=scaled(5)
    )
    assert head.status == 200 and int(head.headers["Content-Length"]) > 0 and head.read() == b""
    with pytest.raises(urllib.error.HTTPError) as ei:
        urllib.request.urlopen(
            urllib.request.Request(f"http://127.0.0.1:{rp.metrics_port}/metrics", data=b"x", method="POST"),
            timeout=scaled(5),
        )
    assert ei.value.code == 405
    with socket.create_connection(("127.0.0.1", rp.metrics_port), timeout=scaled(5)) as raw:
        raw.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        assert raw.recv(100).startswith(b"HTTP/1.1 400"), "a malformed request gets 400"
    assert "# TYPE kvnet_relay_cache_bytes gauge" in urllib.request.urlopen(
        f"http://127.0.0.1:{rp.metrics_port}/metrics", timeout=scaled(5)
    ).read().decode()
