"""End-to-end tests of kvnet.net.connection: real QUIC on loopback, project-made certificates, real sessions,
on each QUIC stack (aioquic, qh3, aiopquic) and on QMux over TLS/TCP (``moqt+qmux://``) through the same
code path. aiopquic needs Python >= 3.12:
under kvnet's 3.11 its cases run in the environment ``scripts/setup-py312`` makes, through
``test_every_connection_test_runs_on_the_native_stack``."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import pytest

from kvnet.net.config import (
    DATAGRAM_SIZE_ETHERNET,
    DEFAULT_STACK,
    INITIAL_DATAGRAM_SIZE_AIOPQUIC,
    STACKS,
    TlsConfig,
    TransportConfig,
)
from kvnet.net.connection import _ROUTES, MoqtConnection
from kvnet.net.endpoint import connect, serve
from kvnet.net.errors import MoqtConnectionError, RequestRejected
from kvnet.net.handles import (
    IncomingFetch,
    IncomingPublish,
    IncomingPublishNamespace,
    IncomingRequest,
    IncomingSubscribe,
    IncomingTrackStatus,
)
from kvnet.net.limits import ConnectionLimits
from kvnet.net.registry import get_stack
from kvnet.security import certs
from kvnet.tools.linkemu import EmulatorConfig, LinkEmulator, LinkParams
from proto.data import ObjectStatus
from proto.errors import PublishDoneCode, RequestErrorCode
from proto.events import PublishBlockedReceived, SubscribeNamespaceReceived, SubscribeTracksReceived
from proto.messages import Location, MessageParameters
from proto.session import SessionConfig
from tests.helpers.connections import client_config, client_limits
from tests.helpers.processes import REPO, NativeQuicUnavailable, native_quic_python
from tests.helpers.waiting import async_wait_until, scaled

NS = (b"kvnet", b"test")


async def _publisher(conn: MoqtConnection) -> None:
    """Serves track b"blocks" with objects 0..4 of group 0; rejects anything else."""
    async for req in conn.incoming_requests():
        ev = req.event
        if isinstance(req, IncomingPublishNamespace):
            req.accept()
        elif isinstance(req, IncomingTrackStatus):
            if req.event.track_name == b"blocks":
                req.respond()
            else:
                req.reject(RequestErrorCode.DOES_NOT_EXIST, "no such track")
        elif isinstance(req, IncomingFetch):
            req.accept_fetch(end_of_track=True, end_location=Location(0, 5))
            for i in range(5):
                req.send_object(0, 0, i, b"obj%d" % i * 1000)
                await req.drain()
            req.finish()
        elif isinstance(req, IncomingSubscribe):
            req.accept_subscribe(track_alias=7)
            sid = req.open_subgroup(0, 0)
            for i in range(3):
                req.send_object(sid, i, b"live%d" % i, end_stream=i == 2)
            req.publish_done(PublishDoneCode.TRACK_ENDED, "done")
        else:
            req.reject(RequestErrorCode.NOT_SUPPORTED, type(ev).__name__)


QMUX = "qmux"


@dataclasses.dataclass(frozen=True)
class Transport:
    """What a test runs on: a QUIC stack (``moqt://`` URLs, ``TransportConfig.stack``) or QMux
    (``moqt+qmux://`` URLs, served with ``serve(stack="qmux")``)."""

    stack: str

    @property
    def is_quic(self) -> bool:
        return self.stack != QMUX

    @property
    def scheme(self) -> str:
        return "moqt" if self.is_quic else "moqt+qmux"

    def configure(self, **fields: Any) -> TransportConfig:
        """Settings with ``fields``; the QUIC stack is ours, or the default one under QMux (unused there)."""
        # Test clients get a handshake deadline scaled to the machine's load (tests.helpers.connections).
        stack = self.stack if self.is_quic else DEFAULT_STACK
        return client_config(TransportConfig(stack=stack, **fields))

    @property
    def settings(self) -> TransportConfig:
        return self.configure()

    async def serve(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["stack"] = self.stack
        return await serve(*args, **kwargs)


@pytest.fixture(params=(*STACKS, QMUX))
def transport(request: pytest.FixtureRequest) -> Transport:
    if request.param == "aiopquic" and sys.version_info < (3, 12):
        pytest.skip("aiopquic needs Python >= 3.12: test_every_connection_test_runs_on_the_native_stack")
    return Transport(request.param)


@pytest.fixture
def settings(transport: Transport) -> TransportConfig:
    return transport.settings


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="the aiopquic cases run directly here")
def test_every_connection_test_runs_on_the_native_stack() -> None:
    """This module's aiopquic cases, run by pytest in the Python 3.12 environment (no conftest: the
    shared fixtures import torch, which that environment does not have)."""
    try:
        python = native_quic_python()
    except NativeQuicUnavailable as exc:
        pytest.skip(str(exc))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(
        [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest", "-k", "aiopquic",
         str(Path(__file__).relative_to(REPO))],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=scaled(900),
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert " passed" in done.stdout.splitlines()[-1] and "skipped" not in done.stdout.splitlines()[-1], \
        done.stdout[-2000:]


@pytest.fixture
def pki(tmp_path: Path) -> Path:
    certs.create_ca(tmp_path)
    certs.issue_cert(tmp_path, "server", ["localhost", "127.0.0.1"])
    certs.issue_cert(tmp_path, "client", ["client.local"])
    return tmp_path


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("stack", ["aioquic", "qh3", QMUX])  # aiopquic makes and stops its own socket
async def test_a_client_connection_gives_its_socket_back_once_it_ends(pki: Path, stack: str) -> None:
    """A client's UDP socket (and the duplicates GSO sending and GRO reading hold), or its TCP socket, is
    closed when its connection ends, not when the garbage collector gets to it: a node reconnecting for
    days must not run out of descriptors."""
    transport = Transport(stack)
    settings = transport.settings
    server = await transport.serve("127.0.0.1", 0, settings, TlsConfig.from_dir(pki, "server"), _publisher)
    port = server.address[1]
    try:
        client_tls = TlsConfig.from_dir(pki, None)
        async with connect(f"{transport.scheme}://localhost:{port}", settings, client_tls,
                           limits=client_limits()) as conn:
            await conn.track_status(NS, b"blocks")  # the first connection's one-time costs (threads, caches)
        before = _open_descriptors()
        held = []
        for _ in range(5):
            async with connect(f"{transport.scheme}://localhost:{port}", settings, client_tls,
                               limits=client_limits()) as conn:
                await conn.track_status(NS, b"blocks")
            held.append(conn)  # still referenced: only closing, not collection, can give the sockets back
        await async_wait_until(lambda: _open_descriptors() <= before, "the client sockets closed")
    finally:
        await server.close()


async def test_setup_and_requests_end_to_end(
    pki: Path, transport: Transport, settings: TransportConfig
) -> None:
    server = await transport.serve("127.0.0.1", 0, settings, TlsConfig.from_dir(pki, "server"), _publisher)
    port = server.address[1]
    try:
        client_tls = TlsConfig.from_dir(pki, None)
        async with connect(f"{transport.scheme}://localhost:{port}", settings, client_tls,
                           limits=client_limits()) as conn:
            assert conn.session.established
            assert await conn.publish_namespace(NS) >= 0
            ok = await conn.track_status(NS, b"blocks")
            assert ok.request_id >= 0
            with pytest.raises(RequestRejected) as info:
                await conn.track_status(NS, b"missing")
            assert info.value.code == RequestErrorCode.DOES_NOT_EXIST
            handle = await conn.fetch(NS, b"blocks", Location(0, 0), Location(0, 5))
            objs = await handle.read_all()
            assert [o.object_id for o in objs] == [0, 1, 2, 3, 4]
            assert objs[3].payload == b"obj3" * 1000
            assert (await handle.ok()).end_location == Location(0, 5)
            sub = await conn.subscribe(NS, b"blocks")
            assert sub.ok is not None and sub.ok.track_alias == 7
            live = [o.payload async for o in sub]
            assert live == [b"live0", b"live1", b"live2"]
            assert sub.done is not None and sub.done.status_code == PublishDoneCode.TRACK_ENDED
    finally:
        await server.close()


async def test_objects_taken_as_queued_and_by_iteration_come_once_in_order(
    pki: Path, transport: Transport, settings: TransportConfig
) -> None:
    server = await transport.serve("127.0.0.1", 0, settings, TlsConfig.from_dir(pki, "server"), _publisher)
    try:
        async with connect(f"{transport.scheme}://localhost:{server.address[1]}", settings,
                           TlsConfig.from_dir(pki, None), limits=client_limits()) as conn:
            handle = await conn.fetch(NS, b"blocks", Location(0, 0), Location(0, 5))
            await async_wait_until(lambda: handle.finished, "the whole fetch arrived")
            assert conn.receive_buffered == 5 * len(b"obj0" * 1000)
            first, second = handle.next_queued(), handle.next_queued()
            assert first is not None and second is not None
            rest = [o.object_id async for o in handle]
            assert [first.object_id, second.object_id, *rest] == [0, 1, 2, 3, 4]
            assert handle.next_queued() is None and conn.receive_buffered == 0
    finally:
        await server.close()


async def test_many_concurrent_requests(
    pki: Path, transport: Transport, settings: TransportConfig
) -> None:
    # More concurrent request streams than aioquic's built-in 128 and qh3's 100-stream grant.
    server = await transport.serve("127.0.0.1", 0, settings, TlsConfig.from_dir(pki, "server"), _publisher)
    try:
        async with connect(f"{transport.scheme}://127.0.0.1:{server.address[1]}", settings,
                           TlsConfig.from_dir(pki, None), limits=client_limits()) as conn:
            results = await asyncio.wait_for(
                asyncio.gather(*(conn.track_status(NS, b"blocks") for _ in range(600))), scaled(30)
            )
            assert len({r.request_id for r in results}) == 600
    finally:
        await server.close()


async def test_unknown_ca_is_a_clear_error(
    pki: Path, tmp_path: Path, transport: Transport, settings: TransportConfig
) -> None:
    other = tmp_path / "other"
    certs.create_ca(other)
    server = await transport.serve("127.0.0.1", 0, settings, TlsConfig.from_dir(pki, "server"), _publisher)
    try:
        with pytest.raises(MoqtConnectionError, match="handshake") as info:
            await connect(f"{transport.scheme}://localhost:{server.address[1]}", settings,
                          TlsConfig(ca_file=other / "ca.pem"), limits=client_limits())
        assert "certificate" in str(info.value).lower() or "issuer" in str(info.value).lower()
    finally:
        await server.close()


def _expired_server_cert(pki: Path) -> tuple[Path, Path]:
    """A server certificate signed by the project CA in ``pki`` whose validity ended yesterday."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_cert = x509.load_pem_x509_certificate((pki / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((pki / "ca-key.pem").read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "expired")]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=30))
        .not_valid_after(now - datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    cert_file, key_file = pki / "expired.pem", pki / "expired-key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_file, key_file


async def test_expired_server_certificate_is_a_clear_error(
    pki: Path, transport: Transport, settings: TransportConfig
) -> None:
    cert_file, key_file = _expired_server_cert(pki)
    tls = TlsConfig(ca_file=pki / "ca.pem", cert_file=cert_file, key_file=key_file)
    server = await transport.serve("127.0.0.1", 0, settings, tls, _publisher)
    try:
        with pytest.raises(MoqtConnectionError, match="handshake") as info:
            await connect(
                f"{transport.scheme}://localhost:{server.address[1]}", settings,
                TlsConfig.from_dir(pki, None),
                limits=client_limits()
            )
        assert "expired" in str(info.value).lower() or "certificate" in str(info.value).lower()
    finally:
        await server.close()


async def test_certificate_for_another_name_is_a_clear_error(
    pki: Path, transport: Transport, settings: TransportConfig
) -> None:
    # The server's certificate names localhost and 127.0.0.1, not the name the client dials.
    server = await transport.serve("127.0.0.1", 0, settings, TlsConfig.from_dir(pki, "server"), _publisher)
    try:
        tls = TlsConfig(ca_file=pki / "ca.pem", server_name="relay.example")
        with pytest.raises(MoqtConnectionError, match="handshake") as info:
            await connect(f"{transport.scheme}://127.0.0.1:{server.address[1]}", settings, tls,
                          limits=client_limits())
        assert "relay.example" in str(info.value) or "certificate" in str(info.value).lower()
    finally:
        await server.close()


async def test_mtls_required(
    pki: Path, tmp_path: Path, transport: Transport, settings: TransportConfig
) -> None:
    tls = TlsConfig.from_dir(pki, "server", require_client_cert=True)
    if not get_stack(transport.stack).can_request_client_certificate:
        with pytest.raises(ValueError, match="require_client_cert"):
            await transport.serve("127.0.0.1", 0, settings, tls, _publisher)
    # Servers that require client certificates run on aioquic (or QMux, whose TLS is OpenSSL's); clients of
    # every stack present one.
    server_stack = "aioquic" if transport.is_quic else QMUX
    server = await serve("127.0.0.1", 0, TransportConfig(), tls, _publisher, stack=server_stack)
    url = f"{transport.scheme}://localhost:{server.address[1]}"
    try:
        async with connect(url, settings, TlsConfig.from_dir(pki, "client"),
                           limits=client_limits()) as conn:
            assert (await conn.track_status(NS, b"blocks")).request_id >= 0
        # A client certificate from another CA is refused.
        other = tmp_path / "other"
        certs.create_ca(other)
        certs.issue_cert(other, "intruder", ["x.local"])
        bad = TlsConfig(ca_file=pki / "ca.pem", cert_file=other / "intruder.pem",
                               key_file=other / "intruder-key.pem")
        with pytest.raises(MoqtConnectionError):
            async with connect(url, settings, bad, limits=client_limits()) as conn:
                await asyncio.wait_for(conn.track_status(NS, b"blocks"), scaled(5))
    finally:
        await server.close()


async def test_bulk_fetch_with_back_pressure(
    pki: Path, transport: Transport, settings: TransportConfig
) -> None:
    # 24 MiB through one fetch: more than the send-buffer bound, so the publisher must wait in drain()
    # and be woken by the receive path (qh3 delivers batches through datagrams_received).
    payload = bytes(range(256)) * 4096  # 1 MiB
    count = 24

    async def bulk(conn: MoqtConnection) -> None:
        async for req in conn.incoming_requests():
            assert isinstance(req, IncomingFetch)
            req.accept_fetch(end_of_track=True, end_location=Location(0, count))
            for i in range(count):
                req.send_object(0, 0, i, payload)
                await req.drain()
            req.finish()

    limits = ConnectionLimits(max_send_buffer=4 << 20)
    server = await transport.serve("127.0.0.1", 0, settings, TlsConfig.from_dir(pki, "server"), bulk,
                         limits=limits)
    try:
        async with connect(f"{transport.scheme}://127.0.0.1:{server.address[1]}", settings,
                           TlsConfig.from_dir(pki, None), limits=client_limits()) as conn:
            handle = await conn.fetch(NS, b"bulk", Location(0, 0), Location(0, count))
            got = 0
            async for obj in handle:
                assert obj.payload == payload
                got += 1
            assert got == count
    finally:
        await server.close()


async def test_wait_send_buffer_empty_wakes_once_the_peer_has_everything(
    pki: Path, transport: Transport, settings: TransportConfig
) -> None:
    # 8 MiB written without waiting: QUIC still holds most of it, and only the receive/transmit path can
    # tell the waiter when it is gone (what RelayPeer.drain relies on before a publisher exits).
    payload = bytes(range(256)) * 4096  # 1 MiB
    count = 8
    buffered: dict[str, int] = {}

    async def bulk(conn: MoqtConnection) -> None:
        async for req in conn.incoming_requests():
            assert isinstance(req, IncomingFetch)
            req.accept_fetch(end_of_track=True, end_location=Location(0, count))
            for i in range(count):
                req.send_object(0, 0, i, payload)
            req.finish()
            buffered["before"] = conn.send_buffered()
            await conn.wait_send_buffer_empty()
            buffered["after"] = conn.send_buffered()

    server = await transport.serve("127.0.0.1", 0, settings, TlsConfig.from_dir(pki, "server"), bulk)
    try:
        async with connect(f"{transport.scheme}://127.0.0.1:{server.address[1]}", settings,
                           TlsConfig.from_dir(pki, None), limits=client_limits()) as conn:
            handle = await conn.fetch(NS, b"bulk", Location(0, 0), Location(0, count))
            assert len(await handle.read_all()) == count
            await async_wait_until(lambda: "after" in buffered, "the publisher's wait for an empty buffer")
        assert buffered["before"] > 0 and buffered["after"] == 0
    finally:
        await server.close()


async def test_stacks_interoperate(pki: Path) -> None:
    server = await serve("127.0.0.1", 0, TransportConfig(stack="qh3"),
                         TlsConfig.from_dir(pki, "server"), _publisher)
    try:
        aioquic = client_config(TransportConfig(stack="aioquic"))
        async with connect(f"moqt://localhost:{server.address[1]}", aioquic,
                           TlsConfig.from_dir(pki, None), limits=client_limits()) as conn:
            objs = await (await conn.fetch(NS, b"blocks", Location(0, 0), Location(0, 5))).read_all()
            assert [o.payload for o in objs] == [b"obj%d" % i * 1000 for i in range(5)]
    finally:
        await server.close()


async def test_incoming_publish_buffers_early_objects_and_honours_stream_count(
    pki: Path, transport: Transport, settings: TransportConfig
) -> None:
    """Objects that follow a PUBLISH before the application accepts it are kept, and PUBLISH_DONE sent
    right after the data does not end the subscription before its Stream Count of streams has ended."""
    got: dict[bytes, list[tuple[int, int, bytes]]] = {}
    done: dict[bytes, int] = {}
    finished = asyncio.Event()

    async def on_connection(conn: MoqtConnection) -> None:
        async for req in conn.incoming_requests():
            assert isinstance(req, IncomingPublish)
            name = req.event.track_name
            if name == b"late-accept":
                # A deliberately late accept (the behaviour under test): the objects arrive before it.
                await asyncio.sleep(0.3)
            objects = req.accept_publish(MessageParameters(forward=1))
            got[name] = [(o.object_id, o.status, o.payload) async for o in objects]
            assert objects.done is not None
            done[name] = objects.done.stream_count
            if len(got) == 2:
                finished.set()

    server = await transport.serve(
        "127.0.0.1", 0, settings, TlsConfig.from_dir(pki, "server"), on_connection
    )
    big = [bytes([i]) * 400_000 for i in range(3)]
    try:
        async with connect(f"{transport.scheme}://localhost:{server.address[1]}", settings,
                           TlsConfig.from_dir(pki, None), limits=client_limits()) as conn:
            # 1: objects sent right behind the PUBLISH, without waiting for PUBLISH_OK.
            pending = asyncio.ensure_future(conn.publish(NS, b"late-accept", 11))
            await async_wait_until(
                lambda: conn.session.established and 11 in conn.session._pub_aliases, "the PUBLISH sent"
            )
            sid = conn.open_subgroup(11, 0, 0)
            conn.send_subgroup_object(sid, 0, b"early")
            conn.send_subgroup_object(sid, 1, b"", status=ObjectStatus.END_OF_TRACK, end_stream=True)
            ok = await pending
            conn.publish_done(ok.request_id, PublishDoneCode.TRACK_ENDED, "done")
            # 2: large objects on two streams, PUBLISH_DONE at once while they are still in flight.
            ok = await conn.publish(NS, b"in-flight", 12)
            for group in range(2):
                sid = conn.open_subgroup(12, group, 0)
                for i, payload in enumerate(big):
                    conn.send_subgroup_object(sid, i, payload, end_stream=i == len(big) - 1)
            conn.publish_done(ok.request_id, PublishDoneCode.TRACK_ENDED, "done")
            await asyncio.wait_for(finished.wait(), scaled(20))
    finally:
        await server.close()
    assert got[b"late-accept"] == [(0, ObjectStatus.NORMAL, b"early"), (1, ObjectStatus.END_OF_TRACK, b"")]
    assert done == {b"late-accept": 1, b"in-flight": 2}
    # The two streams interleave; each arrived whole.
    assert sorted(p for _, _, p in got[b"in-flight"]) == sorted(big + big)


async def test_keepalive_holds_an_idle_session_and_a_dead_peer_is_noticed(
    pki: Path, transport: Transport, settings: TransportConfig
) -> None:
    # Short timers so the test is quick: 1 s idle timeout, PING after 0.25 s of silence.
    live = transport.configure(idle_timeout=1.0, keepalive_interval=0.25)
    closed_at: list[float] = []

    async def on_connection(conn: MoqtConnection) -> None:
        serving = asyncio.ensure_future(_publisher(conn))
        await conn.wait_session_closed()
        closed_at.append(asyncio.get_running_loop().time())
        serving.cancel()

    server = await transport.serve("127.0.0.1", 0, live, TlsConfig.from_dir(pki, "server"), on_connection)
    url = f"{transport.scheme}://127.0.0.1:{server.address[1]}"
    tls = TlsConfig.from_dir(pki, None)
    try:
        conn = await connect(url, live, tls, limits=client_limits())
        # Three idle timeouts without a single request: the idle time is the behaviour under test.
        await asyncio.sleep(3.0)
        assert not conn.is_closed and not closed_at
        assert (await conn.track_status(NS, b"blocks")).request_id >= 0
        # The client dies without a word (its socket just closes): the server notices within the idle
        # timeout (+ a few PTOs), not never.
        died = asyncio.get_running_loop().time()
        if transport.stack == "aiopquic":
            cast(Any, conn._quic).stop()  # picoquic's thread and socket
        else:
            assert conn._transport is not None
            conn._transport.close()
        # The deadline is generous for load yet far below "never" (or an idle timeout left at its default).
        await async_wait_until(lambda: closed_at, "the server noticing the dead client", timeout=12)
        assert closed_at[0] > died
    finally:
        await server.close()
    # Control: with keep-alive off on both sides the same idle session is dropped by the idle timeout
    # (one side's PINGs alone would keep both alive, the ACKs refreshing the other's timer).
    quiet = transport.configure(idle_timeout=1.0, keepalive_interval=0)
    server = await transport.serve("127.0.0.1", 0, quiet, TlsConfig.from_dir(pki, "server"), on_connection)
    try:
        conn = await connect(f"{transport.scheme}://127.0.0.1:{server.address[1]}", quiet, tls,
                             limits=client_limits())
        await asyncio.wait_for(conn.wait_session_closed(), scaled(5))
    finally:
        await server.close()


@pytest.mark.parametrize("stack", ["aioquic", "qh3", QMUX])  # picoquic receives on its own thread: not known
async def test_closed_by_peer_tells_the_peers_close_from_our_own_idle_timeout(pki: Path, stack: str) -> None:
    """Both end with NO_ERROR on some stacks: only ``closed_by_peer`` tells an upstream that closed the
    session on purpose from one that went silent (an edge reconnects at once after the first only)."""
    transport = Transport(stack)
    settings = transport.configure(idle_timeout=1.0, keepalive_interval=0)
    accepted: asyncio.Queue[MoqtConnection] = asyncio.Queue()

    async def on_connection(conn: MoqtConnection) -> None:
        accepted.put_nowait(conn)
        await conn.wait_session_closed()

    server = await transport.serve(
        "127.0.0.1", 0, settings, TlsConfig.from_dir(pki, "server"), on_connection
    )
    url = f"{transport.scheme}://127.0.0.1:{server.address[1]}"
    tls = TlsConfig.from_dir(pki, None)
    try:
        client = await connect(url, settings, tls, limits=client_limits())
        at_server = await asyncio.wait_for(accepted.get(), scaled(10))
        await at_server.close_session(reason="idle timeout")
        assert await asyncio.wait_for(client.wait_session_closed(), scaled(10)) == (0, "idle timeout")
        assert client.closed_by_peer and not at_server.closed_by_peer
        # Keep-alive off: the same quiet session ends by each side's QUIC idle timeout, nobody's close.
        client = await connect(url, settings, tls, limits=client_limits())
        at_server = await asyncio.wait_for(accepted.get(), scaled(10))
        await asyncio.wait_for(client.wait_session_closed(), scaled(10))
        await asyncio.wait_for(at_server.wait_session_closed(), scaled(10))
        assert not client.closed_by_peer and not at_server.closed_by_peer
    finally:
        await server.close()


async def test_keepalive_is_the_clients_job_and_the_server_covers_a_silent_client(
    pki: Path, transport: Transport, settings: TransportConfig
) -> None:
    # Counted on the wire through the link emulator (no shaping): with keep-alive on both sides an idle
    # session carries one PING and one ACK per interval, not a PING and an ACK from each side.
    live = transport.configure(idle_timeout=1.0, keepalive_interval=0.25)
    served: list[MoqtConnection] = []

    async def publisher(conn: MoqtConnection) -> None:
        served.append(conn)
        await _publisher(conn)

    server = await transport.serve("127.0.0.1", 0, live, TlsConfig.from_dir(pki, "server"), publisher)
    tls = TlsConfig.from_dir(pki, None)
    try:
        if not transport.is_quic:
            # No UDP to count on a link: QMux's own QX_PING counters tell who pings. The client pings
            # about every interval; the server, hearing from it, never does.
            async with connect(f"{transport.scheme}://127.0.0.1:{server.address[1]}", live, tls,
                               limits=client_limits()) as conn:
                # Idle for twice the idle timeout (8 keep-alive intervals): the session lives on the
                # client's PINGs alone.
                await async_wait_until(
                    lambda: cast(Any, conn._quic)._ping_sent_seq >= 8 or conn.is_closed,
                    "eight client keep-alive PINGs",
                )
                assert not conn.is_closed
                client_pings = cast(Any, conn._quic)._ping_sent_seq
                server_pings = cast(Any, served[-1]._quic)._ping_sent_seq
            assert client_pings >= 8 and server_pings == 0, (client_pings, server_pings)
        else:
            await _count_keepalive_datagrams(transport, live, server.address[1], tls)
        # A client without keep-alive (another implementation, say) is kept alive by the server's PINGs.
        quiet = transport.configure(idle_timeout=1.0, keepalive_interval=0)
        async with connect(f"{transport.scheme}://127.0.0.1:{server.address[1]}", quiet, tls,
                           limits=client_limits()) as conn:
            await asyncio.sleep(3.0)  # three idle timeouts: the idle time is the behaviour under test
            assert not conn.is_closed
            assert (await conn.track_status(NS, b"blocks")).request_id >= 0
    finally:
        await server.close()


async def _count_keepalive_datagrams(
    transport: Transport, live: TransportConfig, port: int, tls: TlsConfig
) -> None:
    """With keep-alive on both sides, an idle QUIC session carries about one PING and one ACK per
    interval, counted through the link emulator."""
    config = EmulatorConfig(listen=("127.0.0.1", 0), target=("127.0.0.1", port))
    async with (
        LinkEmulator(config) as emu,
        connect(f"{transport.scheme}://127.0.0.1:{emu.listen_address[1]}", live, tls) as conn,
    ):
        # The behaviour under test is an idle session over time: let the handshake's trailing packets
        # pass, then count what crosses the link during about 8 keep-alive intervals.
        await asyncio.sleep(0.5)
        stats = emu.stats()
        before = stats["upstream"].forwarded + stats["downstream"].forwarded
        started = asyncio.get_running_loop().time()
        await asyncio.sleep(2.0)
        intervals = (asyncio.get_running_loop().time() - started) / live.keepalive_interval
        idle_datagrams = stats["upstream"].forwarded + stats["downstream"].forwarded - before
        assert not conn.is_closed
    # ~2 per interval (PING + ACK); both sides pinging would make ~4. Per measured interval, so a loaded
    # machine (late timers, a longer pause) only lowers the rate. picoquic's keep-alive (aiopquic) runs
    # its own timer on each side, the server's on the longer period: ~3 per interval.
    most = 4 if get_stack(transport.stack).keeps_alive_itself else 3
    assert idle_datagrams >= 2 and idle_datagrams / intervals <= most, (idle_datagrams, intervals)


def test_keepalive_settings_validation() -> None:
    assert TransportConfig().keepalive_interval < TransportConfig().idle_timeout
    with pytest.raises(ValueError, match="keepalive_interval"):
        TransportConfig(idle_timeout=5.0, keepalive_interval=5.0)
    with pytest.raises(ValueError, match="keepalive_interval"):
        TransportConfig(keepalive_interval=0.01)
    assert TransportConfig(keepalive_interval=0).keepalive_interval == 0


async def test_stop_sending_on_fetch_stream_cancels_the_incoming_fetch(
    pki: Path, transport: Transport, settings: TransportConfig
) -> None:
    outcome: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

    async def on_connection(conn: MoqtConnection) -> None:
        async for req in conn.incoming_requests():
            assert isinstance(req, IncomingFetch)
            req.accept_fetch(end_of_track=True, end_location=Location(0, 100))
            req.send_object(0, 0, 0, b"first")
            try:
                await asyncio.wait_for(req.cancelled.wait(), scaled(5))
            except TimeoutError:
                outcome.set_result(False)
            else:
                outcome.set_result(req.gone)

    server = await transport.serve(
        "127.0.0.1", 0, settings, TlsConfig.from_dir(pki, "server"), on_connection
    )
    try:
        async with connect(f"{transport.scheme}://127.0.0.1:{server.address[1]}", settings,
                           TlsConfig.from_dir(pki, None), limits=client_limits()) as conn:
            handle = await conn.fetch(NS, b"blocks", Location(0, 0), Location(0, 100))
            first = await anext(aiter(handle))
            assert first.payload == b"first" and first.stream_id is not None
            # Only the data stream is stopped (the request stream stays open): a FETCH has one data
            # stream, so the requester wants nothing more.
            conn._quic.stop_stream(first.stream_id, 0x0)
            conn.transmit()
            assert await asyncio.wait_for(outcome, scaled(10))
    finally:
        await server.close()


async def test_answered_incoming_requests_are_forgotten(pki: Path) -> None:
    # A long-lived session answers requests for hours: what it tracks must follow the open requests,
    # not every request it ever answered.
    served: list[MoqtConnection] = []

    async def publisher(conn: MoqtConnection) -> None:
        served.append(conn)
        await _publisher(conn)

    settings = client_config(TransportConfig())
    server = await serve("127.0.0.1", 0, settings, TlsConfig.from_dir(pki, "server"), publisher)
    try:
        async with connect(f"moqt://127.0.0.1:{server.address[1]}", settings,
                           TlsConfig.from_dir(pki, None), limits=client_limits()) as conn:
            for _ in range(6):
                await asyncio.wait_for(
                    asyncio.gather(*(conn.track_status(NS, b"blocks") for _ in range(200))), scaled(30)
                )
            handle = await conn.fetch(NS, b"blocks", Location(0, 0), Location(0, 5))
            assert len(await handle.read_all()) == 5
            (peer,) = served
            assert 0 < peer.open_incoming_requests <= 400, peer.open_incoming_requests
    finally:
        await server.close()


async def test_requests_in_flight_counts_fetches_on_both_sides_and_not_standing_requests(pki: Path) -> None:
    # What a session that got GOAWAY waits for before closing (relay.upstream): an answered
    # PUBLISH_NAMESPACE stands for the whole session and must not hold it open; a FETCH still
    # delivering must, on the side that asked and on the side that serves.
    served: list[MoqtConnection] = []
    release = asyncio.Event()

    async def publisher(conn: MoqtConnection) -> None:
        served.append(conn)
        async for req in conn.incoming_requests():
            if isinstance(req, IncomingPublishNamespace):
                req.accept()
            elif isinstance(req, IncomingFetch):
                req.accept_fetch(end_of_track=True, end_location=Location(0, 2))
                req.send_object(0, 0, 0, b"first")
                await release.wait()
                req.send_object(0, 0, 1, b"second")
                req.finish()

    settings = client_config(TransportConfig())
    server = await serve("127.0.0.1", 0, settings, TlsConfig.from_dir(pki, "server"), publisher)
    try:
        async with connect(f"moqt://127.0.0.1:{server.address[1]}", settings,
                           TlsConfig.from_dir(pki, None), limits=client_limits()) as conn:
            await asyncio.wait_for(conn.publish_namespace(NS), scaled(10))
            assert conn.requests_in_flight == 0
            handle = await conn.fetch(NS, b"blocks", Location(0, 0), Location(0, 2))
            first = await asyncio.wait_for(anext(aiter(handle)), scaled(10))
            assert first.payload == b"first"
            (peer,) = served
            assert conn.requests_in_flight == 1 and peer.requests_in_flight == 1
            release.set()
            rest = await asyncio.wait_for(handle.read_all(), scaled(10))
            assert [o.payload for o in rest] == [b"second"]
            assert conn.requests_in_flight == 0
            await async_wait_until(lambda: peer.requests_in_flight == 0, "the served FETCH ended")
    finally:
        await server.close()


async def test_an_event_of_a_kind_no_handler_takes_is_kept_in_other_events(pki: Path) -> None:
    # PUBLISH_BLOCKED has no row in the connection's routing table: it is neither dropped nor an error,
    # but kept for the application in ``other_events``, and the session goes on.
    async def blocked(conn: MoqtConnection) -> None:
        async for req in conn.incoming_requests():
            if isinstance(req.event, SubscribeTracksReceived):
                req.accept()
                conn.run_action(conn.session.publish_blocked, req.request_id, (b"suffix",), b"track")
            else:
                req.reject(RequestErrorCode.NOT_SUPPORTED, type(req.event).__name__)

    assert PublishBlockedReceived not in _ROUTES
    settings = client_config(TransportConfig())
    server = await serve("127.0.0.1", 0, settings, TlsConfig.from_dir(pki, "server"), blocked)
    try:
        async with connect(f"moqt://127.0.0.1:{server.address[1]}", settings,
                           TlsConfig.from_dir(pki, None), limits=client_limits()) as conn:
            rid = await asyncio.wait_for(conn.subscribe_tracks(NS), scaled(10))

            def kept() -> list[PublishBlockedReceived]:
                return [ev for ev in conn.other_events if isinstance(ev, PublishBlockedReceived)]

            await async_wait_until(lambda: kept(), "PUBLISH_BLOCKED kept in other_events")
            (ev,) = kept()
            assert (ev.request_id, ev.track_namespace_suffix, ev.track_name) == (rid, (b"suffix",), b"track")
            assert not conn.is_closed
    finally:
        await server.close()


async def test_subscribe_namespace_and_tracks_streams_outlive_the_header_timeout(
    pki: Path, transport: Transport, settings: TransportConfig
) -> None:
    # SUBSCRIBE_NAMESPACE (0x50) and SUBSCRIBE_TRACKS (0x51): a one-byte vi64 type that a QUIC varint
    # reads as two bytes, whose framing then promises thousands of bytes that never come; a valid
    # request stream must not be reset as a slowloris.
    held: list[IncomingRequest] = []
    both_held = asyncio.Event()
    served: list[MoqtConnection] = []
    pending: list[asyncio.Task[int]] = []

    async def hold(conn: MoqtConnection) -> None:
        served.append(conn)
        async for req in conn.incoming_requests():
            held.append(req)
            if len(held) == 2:
                both_held.set()

    session_config = SessionConfig(is_client=False, request_header_timeout=0.3)
    server = await transport.serve("127.0.0.1", 0, settings, TlsConfig.from_dir(pki, "server"), hold,
                         session_config=session_config)
    try:
        async with connect(f"{transport.scheme}://127.0.0.1:{server.address[1]}", settings,
                           TlsConfig.from_dir(pki, None), limits=client_limits()) as conn:
            namespaces = asyncio.create_task(conn.subscribe_namespace(NS))
            tracks = asyncio.create_task(conn.subscribe_tracks(NS))
            pending.extend((namespaces, tracks))
            await asyncio.wait_for(both_held.wait(), scaled(10))
            # A third request stream, opened after both, that never completes its first message: once
            # it has been reset, the header deadlines of the two before it have passed too.
            slow = conn._quic.get_next_available_stream_id()
            conn._quic.send_stream_data(slow, b"\x0d\x00", False)
            conn.transmit()
            (peer,) = served
            await async_wait_until(lambda: peer.request_header_timeouts, "a header timeout on the server")
            assert [req.gone for req in held] == [False, False]
            assert peer.request_header_timeouts == 1
            assert {type(req.event) for req in held} == {SubscribeNamespaceReceived, SubscribeTracksReceived}
            for req in held:
                req.accept()
            assert len(set(await asyncio.wait_for(asyncio.gather(namespaces, tracks), scaled(10)))) == 2
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await server.close()


async def _push_to_a_receiver(
    pki: Path, transport: Transport, track: bytes, payloads: list[bytes], link: LinkParams | None = None
) -> list[bytes]:
    """PUBLISH ``track`` with ``payloads`` as one subgroup and PUBLISH_DONE right after writing them, to a
    server whose wait for a PUBLISH_DONE's trailing streams is 2 s (scaled by the load: on a loaded machine
    aioquic's loss recovery, backing off after drops on loopback, has left a live push silent for longer),
    over 1452-byte datagrams (through a link emulator shaping the push's direction with ``link``, if
    given); the payloads the server got."""
    received: list[bytes] = []
    finished = asyncio.Event()

    async def on_connection(conn: MoqtConnection) -> None:
        async for req in conn.incoming_requests():
            assert isinstance(req, IncomingPublish)
            objects = req.accept_publish(MessageParameters(forward=1))
            received.extend([o.payload async for o in objects if o.payload])
            finished.set()

    small = transport.configure(max_datagram_size=DATAGRAM_SIZE_ETHERNET)
    server = await transport.serve("127.0.0.1", 0, small, TlsConfig.from_dir(pki, "server"), on_connection,
                         limits=ConnectionLimits(publish_done_timeout=scaled(2.0)))
    try:
        async with contextlib.AsyncExitStack() as contexts:
            port = server.address[1]
            if link is not None:
                config = EmulatorConfig(listen=("127.0.0.1", 0), target=("127.0.0.1", port), upstream=link)
                port = (await contexts.enter_async_context(LinkEmulator(config))).listen_address[1]
            conn = await contexts.enter_async_context(
                connect(f"{transport.scheme}://127.0.0.1:{port}", small, TlsConfig.from_dir(pki, None),
                        limits=client_limits()))
            ok = await conn.publish(NS, track, 21)
            sid = conn.open_subgroup(21, 0, 0)
            for i, payload in enumerate(payloads):
                conn.send_subgroup_object(sid, i, payload, end_stream=i == len(payloads) - 1)
            conn.publish_done(ok.request_id, PublishDoneCode.TRACK_ENDED, "done")
            await asyncio.wait_for(finished.wait(), scaled(120))
    finally:
        await server.close()
    return received


async def test_publish_done_waits_as_long_as_its_trailing_data_keeps_arriving(
    pki: Path, transport: Transport, settings: TransportConfig
) -> None:
    """A push over 1452-byte datagrams trails its PUBLISH_DONE by seconds (about 4 s on aioquic, twice the
    timeout); the receiver's wait for the announced streams ends only after ``publish_done_timeout``
    without any of its bytes, so nothing is cut off. The timeout is 2 s on an idle machine, not less, and
    grows with the load: aioquic's loss recovery alone has paused a transfer for over a second, and at
    two suites' load on 2 cores for over two (the last object was cut off)."""
    payloads = [bytes([i]) * 100_000 for i in range(80)]
    assert await _push_to_a_receiver(pki, transport, b"long-push", payloads) == payloads


async def test_publish_done_waits_while_a_large_trailing_object_is_still_arriving(
    pki: Path, transport: Transport, settings: TransportConfig
) -> None:
    """Bytes of an object still arriving count as progress, not only whole objects: one 5 MB object through
    a link of 1 MB/s takes 5 s, more than twice the receiver's wait after PUBLISH_DONE, and arrives whole.
    The link's queue is short, so PUBLISH_DONE cannot wait behind most of the object in it."""
    if not transport.is_quic:
        pytest.skip("the link emulator shapes UDP only; QMux's TCP is paced by the kernel, not by kvnet")
    payload = bytes(range(256)) * (5_000_000 // 256)
    slow = LinkParams(rate_bps=1_000_000, queue_packets=64)
    received = await _push_to_a_receiver(pki, transport, b"one-large-object", [payload], slow)
    assert len(received) == 1 and received[0] == payload


@pytest.mark.parametrize("peer_stack", ["aioquic", "aiopquic"])
async def test_aiopquic_datagrams_never_exceed_what_the_peer_advertises(pki: Path, peer_stack: str) -> None:
    """picoquic probes the path MTU up to its own maximum; the largest datagram it sends a peer is the
    peer's max_udp_payload_size (aioquic at the Ethernet preset advertises 1452; aiopquic 1440), seen on
    the wire through the link emulator."""
    if sys.version_info < (3, 12):
        pytest.skip("aiopquic needs Python >= 3.12: test_every_connection_test_runs_on_the_native_stack")
    settings = client_config(TransportConfig(stack="aiopquic"))
    peer = client_config(TransportConfig.for_link("ethernet", peer_stack))
    server = await serve("127.0.0.1", 0, settings, TlsConfig.from_dir(pki, "server"), _publisher)
    try:
        config = EmulatorConfig(listen=("127.0.0.1", 0), target=("127.0.0.1", server.address[1]))
        async with LinkEmulator(config) as emu:
            tls = TlsConfig(ca_file=pki / "ca.pem", server_name="localhost")
            async with connect(f"moqt://127.0.0.1:{emu.listen_address[1]}", peer, tls,
                               limits=client_limits()) as conn:
                for _ in range(20):  # ~100 KB: enough packets for probing to reach its ceiling
                    handle = await conn.fetch(NS, b"blocks", Location(0, 0), Location(0, 5))
                    assert len(await handle.read_all()) == 5
            largest = emu.stats()["downstream"].largest
    finally:
        await server.close()
    assert largest <= (DATAGRAM_SIZE_ETHERNET if peer_stack == "aioquic" else 1440), largest
    assert largest > INITIAL_DATAGRAM_SIZE_AIOPQUIC  # it did probe above its first size


async def test_qmux_to_something_else_is_a_clear_error(pki: Path) -> None:
    """A ``moqt+qmux://`` URL naming a QUIC relay's port (UDP only: nothing listens on TCP) or a TCP server
    that does not speak TLS fails with one line naming the handshake and why."""
    settings = TransportConfig(handshake_timeout=5)
    tls = TlsConfig.from_dir(pki, None)
    quic = await serve("127.0.0.1", 0, settings, TlsConfig.from_dir(pki, "server"), _publisher)

    async def not_tls(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        await writer.drain()
        writer.close()

    http = await asyncio.start_server(not_tls, "127.0.0.1", 0)
    try:
        with pytest.raises(MoqtConnectionError, match=r"TCP/TLS handshake .* failed: Connection refused"):
            await connect(f"moqt+qmux://127.0.0.1:{quic.address[1]}", settings, tls)
        http_port = http.sockets[0].getsockname()[1]
        with pytest.raises(MoqtConnectionError, match=r"TCP/TLS handshake .* failed: TLS: "):
            await connect(f"moqt+qmux://127.0.0.1:{http_port}", settings, tls)
    finally:
        http.close()
        await quic.close()
