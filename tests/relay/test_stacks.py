"""The relay on each QUIC stack kvnet ships, with peers on the other stacks: a relay process on aioquic,
qh3 or aiopquic (the latter from the Python 3.12 environment of ``scripts/setup-py312``) and publisher
and subscriber sessions on aioquic and qh3, the stacks nodes run on (Python 3.11)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from kvnet.net.connection import MoqtConnection
from kvnet.net.endpoint import connect
from kvnet.net.handles import Subscription
from kvnet.net.settings import STACKS, TlsSettings, TransportSettings
from tests.helpers.processes import (
    CertDir,
    NativeQuicUnavailable,
    RelayProcess,
    free_port,
    native_quic_python,
)
from tests.relay.conftest import RelayFactory
from tests.relay.peers import NS, Publisher, fetch_track, track_objects

PEER_STACKS = ("aioquic", "qh3")
# Objects of the bulk track: 48 x 128 KiB = 6 MiB on one FETCH stream, more than aiopquic's per-stream
# send ring (4 MiB), so the relay's writes wait for picoquic to drain it.
BULK_OBJECTS = 48
BULK_OBJECT_BYTES = 128 << 10


def _relay_flags(stack: str) -> tuple[str, ...]:
    if stack == "aiopquic":
        try:
            native_quic_python()
        except NativeQuicUnavailable as exc:
            pytest.skip(str(exc))
    return ("--quic-stack", stack)


async def _client(rp: RelayProcess, cert_dir: CertDir, stack: str) -> MoqtConnection:
    return await connect(rp.url, TransportSettings(stack=stack), TlsSettings(ca_file=cert_dir.ca))


async def _payloads(handle: Subscription) -> list[bytes]:
    return [o.payload async for o in handle if o.payload]


@pytest.mark.parametrize("peer_stack", PEER_STACKS)
@pytest.mark.parametrize("relay_stack", STACKS)
async def test_relay_serves_peers_of_another_stack(
    relay_factory: RelayFactory, cert_dir: CertDir, relay_stack: str, peer_stack: str
) -> None:
    """FETCH through the relay (publisher asked once), again from its cache, a bulk track larger than a
    stream's send ring, and a live subscription fanned out to two subscribers."""
    rp = relay_factory(*_relay_flags(relay_stack), name=f"relay-{relay_stack}")
    small = track_objects(b"block-a", 5)
    bulk = track_objects(b"bulk", BULK_OBJECTS, BULK_OBJECT_BYTES)
    live = track_objects(b"live", 6)
    pub = await Publisher(await _client(rp, cert_dir, peer_stack),
                          {b"block-a": small, b"bulk": bulk, b"live": live}).start()
    subs = [await _client(rp, cert_dir, peer_stack) for _ in range(2)]
    try:
        assert await fetch_track(subs[0], b"block-a", 5) == small
        assert await fetch_track(subs[1], b"block-a", 5) == small  # from the relay's cache
        assert pub.counts["fetch"] == 1
        assert await asyncio.wait_for(fetch_track(subs[0], b"bulk", BULK_OBJECTS), 120) == bulk
        assert await asyncio.wait_for(fetch_track(subs[1], b"bulk", BULK_OBJECTS), 120) == bulk
        handles = [await s.subscribe(NS, b"live") for s in subs]
        pub.live.set()
        got = await asyncio.wait_for(asyncio.gather(*(_payloads(h) for h in handles)), 30)
        assert got == [live, live]
        m = await rp.ametrics()
        assert m['kvnet_relay_requests_total{outcome="cache_hit",type="fetch"}'] == 2
    finally:
        await pub.stop()
        for s in subs:
            await s.close_session()


def test_relay_on_a_stack_without_client_certificates_refuses_require_client_cert(
    cert_dir: CertDir, tmp_path: Path
) -> None:
    """qh3 and aiopquic servers cannot verify client certificates: asking for mTLS is a one-line usage
    error, not a relay that accepts anyone."""
    for stack in ("qh3", "aiopquic"):
        python = sys.executable
        if stack == "aiopquic":
            try:
                python = str(native_quic_python())
            except NativeQuicUnavailable as exc:
                pytest.skip(str(exc))
        done = subprocess.run(
            [python, "-m", "relay", "--listen", f"127.0.0.1:{free_port()}", "--metrics", "",
             "--cert", str(cert_dir.cert), "--key", str(cert_dir.key), "--ca", str(cert_dir.ca),
             "--require-client-cert", "--quic-stack", stack],
            capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[2],
        )
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "require_client_cert" in lines[0] and stack in lines[0], done.stderr


# Not aiopquic as the client of a qh3 origin: qh3 2.1 servers fail that handshake (see aiopquic_stack).
@pytest.mark.parametrize(("edge_stack", "origin_stack"), [("aiopquic", "aioquic"), ("qh3", "aiopquic")])
async def test_edge_and_origin_on_different_stacks(
    relay_factory: RelayFactory, cert_dir: CertDir, edge_stack: str, origin_stack: str
) -> None:
    """An edge relay's upstream session is a client of its own stack: aiopquic as the client of an aioquic
    origin, and an aiopquic origin serving a qh3 edge; a FETCH and a subscription cross both."""
    origin = relay_factory(*_relay_flags(origin_stack), name=f"origin-{origin_stack}")
    edge = relay_factory(*_relay_flags(edge_stack), "--upstream", origin.url, name=f"edge-{edge_stack}")
    objs = track_objects(b"chained", 4)
    pub = await Publisher(await _client(origin, cert_dir, "qh3"), {b"chained": objs}).start()
    sub = await _client(edge, cert_dir, "qh3")
    try:
        assert await fetch_track(sub, b"chained", 4) == objs
        assert await fetch_track(sub, b"chained", 4) == objs
        assert pub.counts["fetch"] == 1
        handle = await sub.subscribe(NS, b"chained")
        pub.live.set()
        assert await asyncio.wait_for(_payloads(handle), 20) == objs
        em = await edge.ametrics()
        assert em['kvnet_relay_upstream_requests_total{type="fetch"}'] == 1
    finally:
        await pub.stop()
        await sub.close_session()
