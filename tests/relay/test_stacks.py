"""The relay on each QUIC stack kvnet ships, with peers on the other stacks: a relay process on aioquic,
qh3 or aiopquic (the latter from the Python 3.12 environment of ``scripts/setup-py312``) and publisher
and subscriber sessions on aioquic and qh3, the stacks nodes run on (Python 3.11); and QMux over TLS/TCP
(``--listen-qmux``, ``moqt+qmux://``) beside QUIC, in relay chains either way and with tokens."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvnet.net.config import STACKS, TlsConfig, TransportConfig
from kvnet.net.connection import MoqtConnection
from kvnet.net.endpoint import connect
from kvnet.net.errors import RequestRejected
from kvnet.net.handles import Subscription
from kvnet.security.tokens import IssuerKey, issue_token, make_claims
from proto.errors import RequestErrorCode
from proto.messages import AliasType, AuthToken
from proto.session import SessionConfig
from tests.helpers.connections import client_config, client_limits
from tests.helpers.processes import (
    CertDir,
    NativeQuicUnavailable,
    RelayProcess,
    free_port,
    native_quic_python,
)
from tests.helpers.waiting import scaled
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
    settings = client_config(TransportConfig(stack=stack))
    return await connect(rp.url, settings, TlsConfig(ca_file=cert_dir.ca), limits=client_limits())


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
        assert await asyncio.wait_for(fetch_track(subs[0], b"bulk", BULK_OBJECTS), scaled(120)) == bulk
        assert await asyncio.wait_for(fetch_track(subs[1], b"bulk", BULK_OBJECTS), scaled(120)) == bulk
        handles = [await s.subscribe(NS, b"live") for s in subs]
        pub.live.set()
        got = await asyncio.wait_for(asyncio.gather(*(_payloads(h) for h in handles)), scaled(30))
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
            capture_output=True, text=True, timeout=scaled(60), cwd=Path(__file__).resolve().parents[2],
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
        assert await asyncio.wait_for(_payloads(handle), scaled(20)) == objs
        em = await edge.ametrics()
        assert em['kvnet_relay_upstream_requests_total{type="fetch"}'] == 1
    finally:
        await pub.stop()
        await sub.close_session()


# -------------------------------------------------------------------------------- QMux beside QUIC


def _qmux_flags() -> tuple[str, str]:
    return ("--listen-qmux", f"127.0.0.1:{free_port()}")


def _qmux_url(rp: RelayProcess) -> str:
    """The ``moqt+qmux://`` URL of a relay started with ``_qmux_flags``."""
    port = rp.args[rp.args.index("--listen-qmux") + 1].rpartition(":")[2]
    return f"moqt+qmux://127.0.0.1:{port}"


async def _qmux_client(
    rp: RelayProcess, cert_dir: CertDir, session_config: SessionConfig | None = None
) -> MoqtConnection:
    return await connect(_qmux_url(rp), TransportConfig(), TlsConfig(ca_file=cert_dir.ca),
                         session_config=session_config)


async def test_one_relay_serves_quic_and_qmux_from_one_cache(
    relay_factory: RelayFactory, cert_dir: CertDir
) -> None:
    """--listen-qmux serves beside --listen: a publisher over QUIC, subscribers over QMux and QUIC share
    one cache (the publisher is asked once) and one set of metrics; a bulk track crosses QMux whole."""
    rp = relay_factory(*_qmux_flags(), name="relay-both")
    small = track_objects(b"block-q", 5)
    bulk = track_objects(b"bulk-q", BULK_OBJECTS, BULK_OBJECT_BYTES)
    live = track_objects(b"live-q", 4)
    pub = await Publisher(await _client(rp, cert_dir, "aioquic"),
                          {b"block-q": small, b"bulk-q": bulk, b"live-q": live}).start()
    over_qmux = await _qmux_client(rp, cert_dir)
    over_quic = await _client(rp, cert_dir, "aioquic")
    try:
        assert await fetch_track(over_qmux, b"block-q", 5) == small
        assert await fetch_track(over_quic, b"block-q", 5) == small  # from the cache the QMux miss filled
        assert await fetch_track(over_qmux, b"block-q", 5) == small
        assert pub.counts["fetch"] == 1
        assert await asyncio.wait_for(fetch_track(over_qmux, b"bulk-q", BULK_OBJECTS), 120) == bulk
        handles = [await s.subscribe(NS, b"live-q") for s in (over_qmux, over_quic)]
        pub.live.set()
        assert await asyncio.wait_for(asyncio.gather(*(_payloads(h) for h in handles)), 30) == [live, live]
        m = await rp.ametrics()
        assert m['kvnet_relay_requests_total{outcome="cache_hit",type="fetch"}'] == 2
    finally:
        await pub.stop()
        for s in (over_qmux, over_quic):
            await s.close_session()


@pytest.mark.parametrize("upstream_transport", ["qmux", "quic"])
async def test_relays_chain_over_qmux_and_quic_in_either_direction(
    relay_factory: RelayFactory, cert_dir: CertDir, upstream_transport: str
) -> None:
    """An edge reaches its origin over QMux (and is reached over QUIC), or over QUIC (and is reached over
    QMux): a FETCH crosses the chain once and is served from the edge's cache after."""
    origin = relay_factory(*_qmux_flags(), name="origin")
    upstream = _qmux_url(origin) if upstream_transport == "qmux" else origin.url
    edge = relay_factory(*_qmux_flags(), "--upstream", upstream, name=f"edge-via-{upstream_transport}")
    objs = track_objects(b"chain", 4, 64 << 10)
    pub = await Publisher(await _client(origin, cert_dir, "aioquic"), {b"chain": objs}).start()
    sub = await (_client(edge, cert_dir, "aioquic") if upstream_transport == "qmux"
                 else _qmux_client(edge, cert_dir))
    try:
        assert await fetch_track(sub, b"chain", 4) == objs
        assert await fetch_track(sub, b"chain", 4) == objs
        assert pub.counts["fetch"] == 1
        em = await edge.ametrics()
        assert em['kvnet_relay_upstream_requests_total{type="fetch"}'] == 1
    finally:
        await pub.stop()
        await sub.close_session()


async def test_tokens_over_qmux(relay_factory: RelayFactory, cert_dir: CertDir, tmp_path: Path) -> None:
    """Authorization tokens in SETUP work over QMux as over QUIC: in scope served, out of scope refused
    with UNAUTHORIZED."""
    key = IssuerKey.generate()
    key.save_public(tmp_path / "issuer.pub")
    rp = relay_factory(*_qmux_flags(), "--auth-issuer-key", str(tmp_path / "issuer.pub"), name="relay-auth")
    ns = (b"kvnet", b"v1", b"fp", b"tenant-q")

    def session(actions: list[str], prefixes: list[tuple[bytes, ...]]) -> SessionConfig:
        token = issue_token(key, make_claims("test", "t", actions, prefixes, now=time.time(), lifetime_s=600))
        tokens = (AuthToken(AliasType.USE_VALUE, token_type=0, value=token),)
        return SessionConfig(is_client=True, authorization_tokens=tokens)

    objs = track_objects(b"tok", 3)
    pub = await Publisher(await _qmux_client(rp, cert_dir, session(["publish"], [ns])), {b"tok": objs},
                          namespace=ns).start()
    allowed = await _qmux_client(rp, cert_dir, session(["subscribe"], [ns]))
    other = await _qmux_client(rp, cert_dir, session(["subscribe"], [(b"kvnet", b"v1", b"fp", b"other")]))
    try:
        assert await fetch_track(allowed, b"tok", 3, ns=ns) == objs
        with pytest.raises(RequestRejected) as refused:
            await other.track_status(ns, b"tok")
        assert refused.value.code == RequestErrorCode.UNAUTHORIZED
    finally:
        await pub.stop()
        for c in (allowed, other):
            await c.close_session()


class _PushOnly:
    """The pushing session's cache: it fetches nothing."""

    def begin_import(self, block_hash: bytes) -> bool:
        raise AssertionError("the publisher does not fetch")

    def import_layer(self, block_hash: bytes, layer: int, k: object, v: object) -> None:
        raise AssertionError("the publisher does not fetch")

    def finish_import(self, block_hash: bytes) -> None:
        pass

    def abort_import(self, block_hash: bytes) -> None:
        pass


def test_a_publisher_that_stops_right_after_pushing_over_qmux_loses_no_block(
    relay_factory: RelayFactory, cert_dir: CertDir
) -> None:
    """A vLLM worker at shutdown pushes its last blocks, closes its relay session and stops its event loop
    at once. Over QMux the close used to send TLS close_notify while the relay, still reading the burst,
    answered the pushes: Python's TLS aborted on that data, and the reset made the relay's kernel drop
    what it had received and not read (21 of these 48 blocks). The session now stays open until the relay
    has read up to the CONNECTION_CLOSE and closes in turn, so every pushed block is cached."""
    import torch

    from kvnet.blocks.identity import prompt_blocks
    from kvnet.cache.hashing import block_hashes, root_hash
    from kvnet.exchange.abr import AbrConfig, KvAbr
    from kvnet.exchange.blockstore import BlockStore
    from kvnet.exchange.publishing import encode_block
    from kvnet.exchange.relay_peer import RelayPeer
    from kvnet.integrations.background import BackgroundLoop
    from kvnet.node.config import NodeConfig
    from kvnet.security.signing import Signer, TrustStore

    rp = relay_factory(*_qmux_flags(), name="relay-push")
    config = NodeConfig(relay_url=_qmux_url(rp), ca_file=cert_dir.ca).relay_peer_config()
    fingerprint, shape, blocks = bytes(range(32)), (8, 128, 2, 64), 48
    prompt = list(range(3, 3 + blocks * shape[1] + 1))
    root = root_hash(fingerprint)
    hashes = block_hashes(prompt, shape[1], root)
    signer = Signer.generate()
    generator = torch.Generator().manual_seed(0)
    stored = []
    for ident in prompt_blocks(prompt, shape[1], hashes, root, 0, blocks):
        k, v = (torch.randn(shape, generator=generator).bfloat16() for _ in range(2))
        stored += encode_block(k, v, ident, fingerprint=fingerprint, renditions=("plain",), signer=signer)

    async def session() -> RelayPeer:
        return await RelayPeer.connect(
            config, BlockStore(1 << 30), _PushOnly(), TrustStore(), KvAbr(AbrConfig()),
            fingerprint=fingerprint, namespace_id="t", block_shape=shape, dtype="bfloat16",
            device=torch.device("cpu"), announce=False,
        )

    background = BackgroundLoop("pusher")
    peer = background.submit(session()).result(60)
    results = background.submit(peer.server.push_each(stored)).result(120)
    background.stop(peer.close(), timeout=30)  # as the connector's shutdown: close, then stop the loop
    assert [r.name for r in results] == ["ACCEPTED"] * blocks

    async def locate() -> int:
        reader = await session()
        try:
            return len((await reader.locate(hashes[:blocks], ["plain"])).available)
        finally:
            await reader.close()

    assert asyncio.run(locate()) == blocks
