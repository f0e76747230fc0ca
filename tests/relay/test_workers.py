"""``kvnet-relay --workers 2``: two relay processes on one UDP port (SO_REUSEPORT) joined by the hub.

Real processes and real QUIC on loopback. Client sessions from distinct source ports land on both workers
(seen in each worker's own metrics); blocks a publisher pushed and announced through one worker are located
(TRACK_STATUS), fetched verified, subscribed to and watched (SUBSCRIBE_NAMESPACE) through the other, which
then serves them from its own cache. A miss never hides a block pushed at another worker a moment later,
while the hub still spares its upstream repeated misses; the same miss at both workers at once is answered,
not deadlocked. SIGTERM to the supervisor stops every process; a worker or the hub killed is restarted
while the port keeps serving, and one that keeps dying stops the relay with one line saying which; a
second relay on the port is refused; a supervisor killed leaves no process and no credentials behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

from kvnet.cache.paged_cache import CacheSpec, PagedKVCache
from kvnet.exchange.blockstore import BlockStore
from kvnet.exchange.fetching import BlockFetcher
from kvnet.exchange.publishing import BlockServer
from kvnet.net.config import TlsConfig, TransportConfig
from kvnet.net.connection import MoqtConnection
from kvnet.net.endpoint import connect
from kvnet.net.errors import MoqtConnectionError, RequestRejected
from proto import events as me
from proto.data import ObjectStatus
from proto.errors import RequestErrorCode
from proto.kvobject import block_track
from proto.messages import Location
from relay.cache import CacheConfig
from relay.config import RelayConfig
from relay.limits import LimitsConfig
from relay.workers import (
    HUB_HOST,
    RESTART_LIMIT,
    RESTART_WINDOW_S,
    hub_config,
    make_hub_credentials,
    worker_config,
)
from tests.helpers.connections import client_config, client_limits
from tests.helpers.processes import (
    REPO,
    START_TIMEOUT,
    CertDir,
    RelayProcess,
    free_port,
    free_port_run,
    start_relay,
)
from tests.helpers.prompts import SignedPrompt, signed_prompt
from tests.helpers.waiting import async_wait_until, scaled, wait_until

SPEC = CacheSpec(num_layers=4, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.bfloat16)
BLOCKS = 4
FINGERPRINT = bytes(range(32))
NAMESPACE_ID = "workers"
READY = "logger=relay.workers msg=listening"
MAX_SESSIONS_TRIED = 40
"""Sessions opened at most until both workers hold one (each lands on a given worker with p = 1/2)."""


def start_workers(
    cert_dir: CertDir, log_dir: Path, *extra: str, env: Mapping[str, str] | None = None
) -> RelayProcess:
    """``--workers 2`` with metrics on three consecutive ports (worker 0, worker 1, hub)."""
    return start_relay(cert_dir, log_dir, "--workers", "2", *extra, metrics_port=free_port_run(3),
                       ready_marker=READY, env=env)


def listening_field(rp: RelayProcess, name: str) -> str:
    match = re.search(rf"{READY} .*?\b{name}=(\S+)", rp.log())
    assert match, rp.log()[-2000:]
    return match.group(1)


async def sessions_per_worker(rp: RelayProcess) -> list[float]:
    return [
        (await asyncio.to_thread(rp.metrics, i)).get("kvnet_relay_sessions", 0.0) for i in range(2)
    ]


async def counted_once_more(rp: RelayProcess, before: list[float]) -> list[float]:
    """Sessions per worker once one more session than ``before`` is counted."""
    after: list[float] = []

    async def counted() -> bool:
        after[:] = await sessions_per_worker(rp)
        return sum(after) == sum(before) + 1

    await async_wait_until(counted, "the new session counted by one worker")
    return after


async def push_to_worker_0(rp: RelayProcess, publisher: MoqtConnection, prompt: SignedPrompt) -> None:
    """Push every block of ``prompt`` over ``publisher`` (a session on worker 0) and wait until worker 0
    caches them all."""
    server = BlockServer(publisher, BlockStore(4 * prompt.wire_bytes), FINGERPRINT, NAMESPACE_ID,
                         SPEC.num_layers)
    assert await server.push(prompt.blocks) == BLOCKS
    await async_wait_until(
        lambda: rp.metrics(0).get("kvnet_relay_cache_objects", 0) >= BLOCKS * (SPEC.num_layers + 1),
        "worker 0 caching the pushed blocks",
    )

async def one_session_per_worker(
    rp: RelayProcess, settings: TransportConfig, tls: TlsConfig, url: str | None = None
) -> tuple[list[MoqtConnection], list[MoqtConnection]]:
    """Open sessions (each from its own source port) to ``url`` (default the relay's QUIC one) one at a
    time until each worker holds one; returns ``(on worker 0, on worker 1)``, every session opened, by
    the worker it landed on."""
    landed: tuple[list[MoqtConnection], list[MoqtConnection]] = ([], [])
    for _ in range(MAX_SESSIONS_TRIED):
        before = await sessions_per_worker(rp)
        conn = await connect(url or rp.url, settings, tls, limits=client_limits())
        after = await counted_once_more(rp, before)
        landed[0 if after[0] > before[0] else 1].append(conn)
        if landed[0] and landed[1]:
            return landed
    raise AssertionError(f"{MAX_SESSIONS_TRIED} sessions all landed on one worker")


def make_prompt() -> SignedPrompt:
    return signed_prompt(SPEC, BLOCKS, fingerprint=FINGERPRINT, salt=b"workers", seed=5)


def make_other_prompt() -> SignedPrompt:
    return signed_prompt(SPEC, BLOCKS, fingerprint=FINGERPRINT, salt=b"nowhere", seed=6)


def fetcher_for(conn: MoqtConnection, prompt: SignedPrompt) -> tuple[BlockFetcher, PagedKVCache]:
    cache = PagedKVCache(SPEC, num_blocks=BLOCKS, device=torch.device("cpu"))
    fetcher = BlockFetcher(conn, cache, prompt.trust(), fingerprint=FINGERPRINT, namespace_id=NAMESPACE_ID,
                           shape=SPEC.block_shape, dtype="bfloat16", timeout=scaled(30.0))
    return fetcher, cache


def assert_same_kv(fetched: PagedKVCache, prompt: SignedPrompt) -> None:
    for block_hash in prompt.hashes:
        got, want = fetched.export_block(block_hash), prompt.source.export_block(block_hash)
        assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)


async def locate_and_fetch_all(conn: MoqtConnection, prompt: SignedPrompt) -> None:
    """Every block of ``prompt`` is located by TRACK_STATUS over ``conn``, fetched, verified and equal to
    the publisher's."""
    fetcher, fetched = fetcher_for(conn, prompt)
    located = await fetcher.locate(prompt.hashes, ["lossless"])
    assert len(located.available) == BLOCKS and fetcher.locate_probe == "track_status", located
    outcome = await fetcher.fetch(prompt.identities, ["lossless"] * BLOCKS)
    assert outcome.error is None and outcome.loaded == BLOCKS, outcome
    assert_same_kv(fetched, prompt)


@pytest.mark.parametrize("stack", ["aioquic", "qh3"])
async def test_blocks_pushed_through_one_worker_are_located_fetched_and_watched_through_the_other(
    cert_dir: CertDir, tmp_path: Path, stack: str
) -> None:
    """On each stack whose socket the relay binds (aiopquic's cannot be shared); the clients on aioquic,
    whose client connections on qh3 are exercised by the stack tests."""
    prompt = make_prompt()
    rp = start_workers(cert_dir, tmp_path, "--quic-stack", stack)
    settings = client_config(TransportConfig.for_link("loopback", "aioquic"))
    tls = TlsConfig(ca_file=cert_dir.ca)
    opened: list[MoqtConnection] = []
    serving: asyncio.Task[None] | None = None
    try:
        on_0, on_1 = await one_session_per_worker(rp, settings, tls)
        opened = [*on_0, *on_1]
        publisher, subscriber = on_0[0], on_1[0]
        heard: list[tuple[bytes, ...]] = []

        def on_namespace(ev: me.NamespaceReceived | me.NamespaceDoneReceived) -> None:
            if isinstance(ev, me.NamespaceReceived):
                heard.append(ev.track_namespace_suffix)

        # A watcher on worker 1 hears of the namespace announced on worker 0 (through the hub).
        await subscriber.subscribe_namespace((b"kvnet",), on_namespace=on_namespace)
        server = BlockServer(publisher, BlockStore(4 * prompt.wire_bytes), FINGERPRINT, NAMESPACE_ID,
                             SPEC.num_layers)
        server.store.put_chain(prompt.blocks)
        serving = asyncio.ensure_future(server.serve())
        await server.announce()
        assert await server.push(prompt.blocks) == BLOCKS
        objects = BLOCKS * (SPEC.num_layers + 1)
        await async_wait_until(
            lambda: rp.metrics(0).get("kvnet_relay_cache_objects", 0) >= objects,
            "worker 0 caching the pushed blocks",
        )
        await async_wait_until(lambda: heard == [server.namespace[1:]], "NAMESPACE on worker 1")

        await locate_and_fetch_all(subscriber, prompt)
        first = rp.metrics(1)
        assert first["kvnet_relay_cache_misses_total"] >= BLOCKS  # went to worker 0 through the hub
        assert first["kvnet_relay_cache_objects"] >= objects  # and kept what it fetched

        # Hot blocks are then served by worker 1 from its own cache: worker 0 sends nothing more.
        sent_by_0 = rp.metrics(0)["kvnet_relay_bytes_out_total"]
        again, fetched_again = fetcher_for(subscriber, prompt)
        outcome = await again.fetch(prompt.identities, ["lossless"] * BLOCKS)
        assert outcome.error is None and outcome.loaded == BLOCKS, outcome
        assert_same_kv(fetched_again, prompt)
        second = rp.metrics(1)
        assert second["kvnet_relay_cache_hits_total"] >= first["kvnet_relay_cache_hits_total"] + BLOCKS
        assert second["kvnet_relay_cache_misses_total"] == first["kvnet_relay_cache_misses_total"]
        assert rp.metrics(0)["kvnet_relay_bytes_out_total"] == sent_by_0

        # SUBSCRIBE of a block track announced on worker 0, from worker 1: its objects arrive.
        ns, name = block_track(FINGERPRINT, NAMESPACE_ID, prompt.hashes[0], "lossless")
        sub = await subscriber.subscribe(ns, name)
        received = [obj async for obj in sub if obj.status == ObjectStatus.NORMAL]
        assert len(received) == SPEC.num_layers + 1  # the manifest and one object per layer
    finally:
        if serving is not None:
            serving.cancel()
        for conn in opened:
            await conn.close_session()
        rp.stop()


async def test_blocks_pushed_into_one_worker_stay_reachable_from_the_other_after_the_publisher_left(
    cert_dir: CertDir, tmp_path: Path
) -> None:
    """Pushed without PUBLISH_NAMESPACE and the publisher gone: no route names worker 0, yet worker 1's
    miss reaches worker 0's cache, because the hub asks every other worker when no route answers."""
    prompt = make_prompt()
    rp = start_workers(cert_dir, tmp_path)
    settings = client_config(TransportConfig.for_link("loopback", "aioquic"))
    tls = TlsConfig(ca_file=cert_dir.ca)
    opened: list[MoqtConnection] = []
    try:
        on_0, on_1 = await one_session_per_worker(rp, settings, tls)
        opened = [*on_0, *on_1]
        publisher, subscriber = on_0[0], on_1[0]
        await push_to_worker_0(rp, publisher, prompt)
        for conn in on_0:
            await conn.close_session()
        await locate_and_fetch_all(subscriber, prompt)
        # A block nobody has is still DOES_NOT_EXIST (every worker asked, none holds it).
        missing, _ = fetcher_for(subscriber, make_other_prompt())
        nothing = await missing.locate(make_other_prompt().hashes, ["lossless"])
        assert nothing.available == [] and nothing.probe_errors == {}, nothing
    finally:
        for conn in opened:
            if not conn.is_closed:
                await conn.close_session()
        rp.stop()


async def test_a_miss_does_not_hide_a_block_pushed_at_another_worker_a_moment_later(
    cert_dir: CertDir, tmp_path: Path
) -> None:
    """Worker 1 locates a block nobody has yet (asked of the hub, which asks worker 0), the publisher then
    pushes it at worker 0, and worker 1 finds it at once: neither worker 1 nor the hub remembered that
    miss, which no process but worker 0 hears outdated. A miss of the whole relay is still remembered at
    the hub (its upstreams are spared the repeat). The long negative TTL makes the window unmissable."""
    prompt = make_prompt()
    rp = start_workers(cert_dir, tmp_path, "--negative-ttl", "600")
    settings = client_config(TransportConfig.for_link("loopback", "aioquic"))
    tls = TlsConfig(ca_file=cert_dir.ca)
    opened: list[MoqtConnection] = []
    try:
        on_0, on_1 = await one_session_per_worker(rp, settings, tls)
        opened = [*on_0, *on_1]
        publisher, subscriber = on_0[0], on_1[0]
        early, _ = fetcher_for(subscriber, prompt)
        before = await early.locate(prompt.hashes, ["lossless"])
        assert before.available == [] and before.probe_errors == {}, before

        await push_to_worker_0(rp, publisher, prompt)
        await locate_and_fetch_all(subscriber, prompt)

        other = make_other_prompt()
        for _ in range(2):
            missing, _ = fetcher_for(subscriber, other)
            nothing = await missing.locate(other.hashes, ["lossless"])
            assert nothing.available == [] and nothing.probe_errors == {}, nothing
        assert rp.metrics(2).get("kvnet_relay_track_status_negative_hits_total", 0) >= 1
    finally:
        for conn in opened:
            await conn.close_session()
        rp.stop()


async def test_a_miss_of_the_whole_relay_is_asked_of_its_upstream_once_within_the_negative_ttl(
    cert_dir: CertDir, tmp_path: Path
) -> None:
    """The hub still remembers its upstream relay's misses (the workers' it asks every time): repeated
    misses of one block reach the origin once."""
    origin = start_relay(cert_dir, tmp_path, name="origin")
    rp = start_workers(cert_dir, tmp_path, "--upstream", origin.url, "--negative-ttl", "600")
    settings = client_config(TransportConfig.for_link("loopback", "aioquic"))
    ns, name = block_track(FINGERPRINT, NAMESPACE_ID, bytes(32), "lossless")
    try:
        async with connect(rp.url, settings, TlsConfig(ca_file=cert_dir.ca),
                           limits=client_limits()) as conn:
            for _ in range(3):
                with pytest.raises(RequestRejected) as missed:
                    await conn.track_status(ns, name)
                assert missed.value.code == RequestErrorCode.DOES_NOT_EXIST
        asked = sum(v for k, v in origin.metrics().items() if "requests_total" in k and "track_status" in k)
        assert asked == 1
    finally:
        rp.stop()
        origin.stop()


async def test_the_same_miss_at_two_workers_at_once_is_answered_by_both(
    cert_dir: CertDir, tmp_path: Path
) -> None:
    """Both workers ask the hub about the same absent block at once (TRACK_STATUS, FETCH, SUBSCRIBE), and
    the hub asks each of them about it meanwhile: each answers from its own sources, not by waiting for its
    own question to the hub (which waits for that answer), so both clients hear DOES_NOT_EXIST, not
    TIMEOUT."""
    rp = start_workers(cert_dir, tmp_path, "--upstream-timeout", "5")
    settings = client_config(TransportConfig.for_link("loopback", "aioquic"))
    opened: list[MoqtConnection] = []
    try:
        on_0, on_1 = await one_session_per_worker(rp, settings, TlsConfig(ca_file=cert_dir.ca))
        opened = [*on_0, *on_1]
        for i in range(4):
            ns, name = block_track(FINGERPRINT, NAMESPACE_ID, bytes([i]) * 32, "lossless")
            located = await asyncio.gather(
                on_0[0].track_status(ns, name), on_1[0].track_status(ns, name), return_exceptions=True
            )
            fetches = [await c.fetch(ns, name, Location(0, 0), Location(1, 0)) for c in (on_0[0], on_1[0])]
            fetched = await asyncio.gather(*(f.ok() for f in fetches), return_exceptions=True)
            subscribed = await asyncio.gather(
                on_0[0].subscribe(ns, name), on_1[0].subscribe(ns, name), return_exceptions=True
            )
            for answers in (located, fetched, subscribed):
                codes = [a.code if isinstance(a, RequestRejected) else a for a in answers]
                assert codes == [RequestErrorCode.DOES_NOT_EXIST] * 2, codes
    finally:
        for conn in opened:
            await conn.close_session()
        rp.stop()


async def test_the_workers_serve_the_qmux_port_too(cert_dir: CertDir, tmp_path: Path) -> None:
    """``--listen-qmux`` with ``--workers 2``: QMux sessions land on both workers (one TCP port,
    SO_REUSEPORT), and blocks pushed through one are located and fetched, verified, through the other."""
    prompt = make_prompt()
    qmux_port = free_port()
    rp = start_workers(cert_dir, tmp_path, "--listen-qmux", f"127.0.0.1:{qmux_port}")
    assert listening_field(rp, "qmux") == f"127.0.0.1:{qmux_port}"
    opened: list[MoqtConnection] = []
    serving: asyncio.Task[None] | None = None
    try:
        on_0, on_1 = await one_session_per_worker(rp, TransportConfig(), TlsConfig(ca_file=cert_dir.ca),
                                                  f"moqt+qmux://127.0.0.1:{qmux_port}")
        opened = [*on_0, *on_1]
        publisher, subscriber = on_0[0], on_1[0]
        server = BlockServer(publisher, BlockStore(4 * prompt.wire_bytes), FINGERPRINT, NAMESPACE_ID,
                             SPEC.num_layers)
        server.store.put_chain(prompt.blocks)
        serving = asyncio.ensure_future(server.serve())
        await server.announce()
        assert await server.push(prompt.blocks) == BLOCKS
        await locate_and_fetch_all(subscriber, prompt)
        assert rp.metrics(1)["kvnet_relay_cache_misses_total"] >= BLOCKS  # went to worker 0 via the hub
    finally:
        if serving is not None:
            serving.cancel()
        for conn in opened:
            await conn.close_session()
        rp.stop()


async def test_mutual_tls_holds_on_every_worker(cert_dir: CertDir, tmp_path: Path) -> None:
    """``--require-client-cert`` applies to each worker as to one relay: sessions with a client certificate
    are served on both (their requests reach the hub), one without is refused."""
    rp = start_workers(cert_dir, tmp_path, "--require-client-cert")
    settings = client_config(TransportConfig.for_link("loopback", "aioquic"))
    with_cert = TlsConfig(ca_file=cert_dir.ca, cert_file=cert_dir.cert, key_file=cert_dir.key)
    opened: list[MoqtConnection] = []
    try:
        on_0, on_1 = await one_session_per_worker(rp, settings, with_cert)
        opened = [*on_0, *on_1]
        ns, name = block_track(FINGERPRINT, NAMESPACE_ID, bytes(32), "lossless")
        for conn in (on_0[0], on_1[0]):
            with pytest.raises(RequestRejected) as refused:
                await conn.track_status(ns, name)
            assert refused.value.code == RequestErrorCode.DOES_NOT_EXIST  # asked the hub, nobody has it
        with pytest.raises(MoqtConnectionError):
            async with connect(rp.url, settings, TlsConfig(ca_file=cert_dir.ca),
                               limits=client_limits()) as conn:
                await asyncio.wait_for(conn.track_status(ns, name), scaled(10))
    finally:
        for conn in opened:
            await conn.close_session()
        rp.stop()


def pids_gone(pids: list[int]) -> bool:
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        # A child reaped by the supervisor is gone; one still listed is alive unless it is a zombie.
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    return False
        except FileNotFoundError:
            continue
    return True


def relay_pids(rp: RelayProcess) -> list[int]:
    pids = [int(p) for p in listening_field(rp, "pids").split(",")]
    return [*pids, int(listening_field(rp, "hub_pid"))]


def test_sigterm_stops_every_worker_and_the_hub(cert_dir: CertDir, tmp_path: Path) -> None:
    rp = start_workers(cert_dir, tmp_path, "--drain-timeout", "1")
    pids = relay_pids(rp)
    assert len(pids) == 3
    try:
        rp.proc.send_signal(signal.SIGTERM)
        assert rp.proc.wait(timeout=scaled(30)) == 0, rp.log()[-3000:]
        wait_until(lambda: pids_gone(pids), "every worker and the hub gone")
        assert rp.log().count("msg=stopped") == 3
    finally:
        rp.stop()


def log_lines(rp: RelayProcess, marker: str) -> list[str]:
    return [line for line in rp.log().splitlines() if marker in line]


RESTARTING = 'msg="relay process exited: restarting"'
RESTARTED = 'msg="relay process restarted"'


async def test_a_killed_worker_is_restarted_while_the_port_keeps_serving(
    cert_dir: CertDir, tmp_path: Path
) -> None:
    """Worker 0 is killed while a client on worker 1 keeps locating and fetching blocks: that client is
    served throughout (the port's socket group never changes, so its connection stays on worker 1), the
    supervisor logs one line and restarts worker 0 on its own socket, counted in its metrics, and a new
    session on the restarted worker reaches the blocks through the hub."""
    prompt = make_prompt()
    rp = start_workers(cert_dir, tmp_path, "--drain-timeout", "1")
    pids = relay_pids(rp)
    settings = client_config(TransportConfig.for_link("loopback", "aioquic"))
    tls = TlsConfig(ca_file=cert_dir.ca)
    opened: list[MoqtConnection] = []
    fetching: asyncio.Future[None] | None = None
    try:
        on_0, on_1 = await one_session_per_worker(rp, settings, tls)
        opened = [*on_0, *on_1]
        publisher, subscriber = on_0[0], on_1[0]
        await push_to_worker_0(rp, publisher, prompt)
        served = 0

        async def keep_fetching() -> None:
            nonlocal served
            while True:
                await locate_and_fetch_all(subscriber, prompt)
                served += 1

        fetching = asyncio.ensure_future(keep_fetching())
        await async_wait_until(lambda: served >= 1 or fetching.done(), "a first fetch through worker 1")
        os.kill(pids[0], signal.SIGKILL)
        await async_wait_until(
            lambda: log_lines(rp, RESTARTED) or fetching.done() or rp.proc.poll() is not None,
            "worker 0 restarted",
        )
        after_restart = served
        await async_wait_until(
            lambda: served >= after_restart + 2 or fetching.done(),
            "fetches through worker 1 after the restart",
        )
        assert not fetching.done(), fetching
        restarting = log_lines(rp, RESTARTING)
        assert len(restarting) == 1, rp.log()[-3000:]
        assert "worker=worker-0" in restarting[0] and f"pid {pids[0]}) killed by SIGKILL" in restarting[0]
        assert rp.metrics(0)["kvnet_relay_process_restarts_total"] == 1
        assert rp.metrics(1)["kvnet_relay_process_restarts_total"] == 0

        # The restarted worker serves new sessions and reaches worker 1's cache through the hub.
        fetching.cancel()
        # Bounded: a fetch that swallowed its cancellation would otherwise loop here for ever.
        await asyncio.wait_for(asyncio.gather(fetching, return_exceptions=True), scaled(30))
        again_0, again_1 = await one_session_per_worker(rp, settings, tls)
        opened += [*again_0, *again_1]
        await locate_and_fetch_all(again_0[0], prompt)
        assert rp.proc.poll() is None
    finally:
        if fetching is not None:
            fetching.cancel()
            with contextlib.suppress(TimeoutError):  # then the sessions' close ends it
                await asyncio.wait_for(asyncio.gather(fetching, return_exceptions=True), scaled(30))
        for conn in opened:
            if not conn.is_closed:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(conn.close_session(), scaled(5))
        rp.stop()


async def test_a_killed_hub_is_restarted_and_the_workers_route_through_it_again(
    cert_dir: CertDir, tmp_path: Path
) -> None:
    """The hub is killed: the clients' sessions on both workers stay, the supervisor restarts the hub on
    its own port with the same credentials, the workers reconnect to it (once their upstream idle timeout
    says the old one is gone), and a block pushed at worker 0 is then located and fetched through
    worker 1."""
    prompt = make_prompt()
    rp = start_workers(cert_dir, tmp_path, "--drain-timeout", "1")
    hub_pid = relay_pids(rp)[-1]
    settings = client_config(TransportConfig.for_link("loopback", "aioquic"))
    opened: list[MoqtConnection] = []
    try:
        on_0, on_1 = await one_session_per_worker(rp, settings, TlsConfig(ca_file=cert_dir.ca))
        opened = [*on_0, *on_1]
        os.kill(hub_pid, signal.SIGKILL)
        await async_wait_until(
            lambda: [line for line in log_lines(rp, RESTARTED) if "worker=hub" in line] or rp.proc.poll(),
            "the hub restarted",
        )
        assert rp.metrics(2)["kvnet_relay_process_restarts_total"] == 1
        # Its socket stayed open (held by the supervisor), so no error tells the workers the old hub is
        # gone: each notices by its upstream idle timeout, then reconnects.
        await async_wait_until(
            lambda: rp.metrics(2).get("kvnet_relay_sessions", 0) == 2, "both workers connected to the new hub"
        )
        publisher, subscriber = on_0[0], on_1[0]
        await push_to_worker_0(rp, publisher, prompt)
        await locate_and_fetch_all(subscriber, prompt)
        assert not any(conn.is_closed for conn in opened)
    finally:
        for conn in opened:
            if not conn.is_closed:
                await conn.close_session()
        rp.stop()


def test_a_worker_that_keeps_dying_stops_the_relay_with_one_line(cert_dir: CertDir, tmp_path: Path) -> None:
    """Worker 1's cache directory is replaced by a file, then worker 1 is killed: every restart fails
    (exit 2 before serving), and after ``RESTART_LIMIT`` of them the supervisor stops the relay and says
    why in one line."""
    cache = tmp_path / "cache"
    rp = start_workers(cert_dir, tmp_path, "--drain-timeout", "1", "--cache-dir", str(cache))
    pids = relay_pids(rp)
    try:
        shutil.rmtree(cache / "worker-1")
        (cache / "worker-1").write_text("")
        os.kill(pids[1], signal.SIGKILL)
        assert rp.proc.wait(timeout=scaled(START_TIMEOUT * 2)) == 1, rp.log()[-3000:]
        wait_until(lambda: pids_gone(pids), "the other worker and the hub gone")
        assert len(log_lines(rp, RESTARTING)) == RESTART_LIMIT
        errors = [line for line in rp.log().splitlines() if line.startswith("kvnet-relay: error:")]
        assert len(errors) == 1 + RESTART_LIMIT, errors  # each failed start said why, then the supervisor
        gave_up = f"exit code 2, restarted {RESTART_LIMIT} times within {RESTART_WINDOW_S:.0f} s; stopping"
        assert errors[-1].startswith("kvnet-relay: error: worker-1 (pid "), errors
        assert errors[-1].endswith(f"{gave_up} the relay"), errors
    finally:
        rp.stop()


@pytest.mark.parametrize("workers", [("--workers", "2"), ()], ids=["workers", "single"])
def test_a_second_relay_on_the_occupied_port_is_refused_with_one_line(
    cert_dir: CertDir, tmp_path: Path, workers: tuple[str, ...]
) -> None:
    """With SO_REUSEPORT a second group of sockets could join the port and take half its traffic; the
    second relay is refused instead, and the first keeps serving."""
    rp = start_workers(cert_dir, tmp_path)
    port = int(rp.url.rsplit(":", 1)[1])
    log = tmp_path / "second.log"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(log, "w") as out:
        second = subprocess.Popen(
            [sys.executable, "-m", "relay", *workers, "--listen", f"127.0.0.1:{port}", "--metrics", "",
             "--cert", str(cert_dir.cert), "--key", str(cert_dir.key), "--trust-any"],
            stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env,
        )
    try:
        wait_until(
            lambda: second.poll() is not None or "msg=listening" in log.read_text(),
            "the second relay exiting or serving", START_TIMEOUT,
        )
        text = log.read_text()
        assert second.poll() == 2, text[-3000:]
        assert text.splitlines() == [
            f"kvnet-relay: error: --listen 127.0.0.1:{port}: cannot listen: Address already in use"
            " (--listen HOST:PORT moves the relay)"
        ], text
        # The first relay still serves the port.
        async def served() -> None:
            settings = client_config(TransportConfig.for_link("loopback", "aioquic"))
            async with connect(rp.url, settings, TlsConfig(ca_file=cert_dir.ca),
                               limits=client_limits()) as conn:
                ns, name = block_track(FINGERPRINT, NAMESPACE_ID, bytes(32), "lossless")
                with pytest.raises(RequestRejected) as missed:
                    await conn.track_status(ns, name)
                assert missed.value.code == RequestErrorCode.DOES_NOT_EXIST

        asyncio.run(served())
        assert rp.proc.poll() is None
    finally:
        if second.poll() is None:
            second.kill()
            second.wait()
        rp.stop()


def own_tmpdir(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A temporary directory for one relay's run alone, and the environment that makes it the relay's."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    return tmp, {**os.environ, "TMPDIR": str(tmp)}


def credentials_left(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.glob("kvnet-relay-*"))


def test_the_supervisor_killed_leaves_no_worker_and_no_secret_behind(
    cert_dir: CertDir, tmp_path: Path
) -> None:
    """SIGKILL gives the supervisor no chance to forward anything or clean up: each process sees its stdin
    end, and the hub's credentials were removed once every process served."""
    tmp, env = own_tmpdir(tmp_path)
    rp = start_workers(cert_dir, tmp_path, "--drain-timeout", "1", env=env)
    pids = relay_pids(rp)
    rp.proc.kill()
    rp.proc.wait(timeout=scaled(10))
    wait_until(lambda: pids_gone(pids), "every worker and the hub gone after the supervisor")
    assert rp.log().count("supervisor gone: stopping") == 3
    assert credentials_left(tmp) == []


def test_a_failed_start_leaves_no_secret_behind(cert_dir: CertDir, tmp_path: Path) -> None:
    """The hub cannot make its cache directory (a file is in the way): the relay exits 2 with the hub's
    one-line reason, and the credentials made for the run are gone."""
    tmp, env = own_tmpdir(tmp_path)
    in_the_way = tmp_path / "not-a-directory"
    in_the_way.write_text("")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run(
        [sys.executable, "-m", "relay", "--workers", "2", "--listen", f"127.0.0.1:{free_port()}",
         "--metrics", "", "--cert", str(cert_dir.cert), "--key", str(cert_dir.key), "--ca", str(cert_dir.ca),
         "--cache-dir", str(in_the_way), "--trust-any"],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=scaled(START_TIMEOUT),
    )
    errors = [line for line in done.stderr.splitlines() if line.startswith("kvnet-relay: error:")]
    assert done.returncode == 2 and len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    assert credentials_left(tmp) == []


def test_the_relay_wide_budgets_are_divided_among_the_workers_and_the_hub(
    cert_dir: CertDir, tmp_path: Path
) -> None:
    """N workers and the hub together hold no more cache, and the workers no more sessions, requests or
    buffered bytes, than the one relay was given; per-source quotas are rounded up per worker."""
    config = RelayConfig(
        tls=TlsConfig(ca_file=cert_dir.ca, cert_file=cert_dir.cert, key_file=cert_dir.key),
        upstreams=("moqt://origin:4443",), metrics_port=9464, workers=3,
        cache=CacheConfig(max_bytes=900, max_inflight_bytes=400, dir=str(tmp_path / "cache"), dir_bytes=800),
        limits=LimitsConfig(max_sessions=10, max_requests=100, max_buffered_bytes=1000,
                            max_sessions_per_address=5, max_requests_per_identity=0),
    )
    creds = make_hub_credentials(tmp_path / "hub")
    workers = [worker_config(config, i, "moqt://127.0.0.1:5000", creds) for i in range(3)]
    hub = hub_config(config, creds)
    everyone = [*workers, hub]
    assert sum(c.cache.max_bytes for c in everyone) <= 900
    assert sum(c.cache.max_inflight_bytes for c in everyone) <= 400
    assert sum(c.cache.dir_bytes for c in everyone) <= 800
    assert len({c.cache.dir for c in everyone}) == 4  # a directory each
    assert sum(c.limits.max_buffered_bytes for c in everyone) <= 1000
    assert sum(w.limits.max_sessions for w in workers) <= 10
    assert sum(w.limits.max_requests for w in workers) <= 100
    assert [w.limits.max_sessions_per_address for w in workers] == [2, 2, 2]
    assert [w.limits.max_requests_per_identity for w in workers] == [0, 0, 0]  # 0: no quota stays none
    assert [c.metrics_port for c in everyone] == [9464, 9465, 9466, 9467]
    for w in workers:  # the hub is every worker's only upstream, verified with its own CA and token
        assert w.upstreams == ("moqt://127.0.0.1:5000",) and w.workers == 1
        assert w.upstream_tls == TlsConfig(ca_pem=creds.ca.read_bytes()) and w.upstream_token == creds.token
        assert w.tls == config.tls
    # The hub goes to the configured upstreams with the relay's own TLS, and accepts only the workers.
    assert hub.upstreams == config.upstreams and hub.upstream_tls == config.tls
    assert hub.auth_issuer_keys == (creds.issuer_public,) and hub.tls.cert_file == creds.cert
    assert hub.host == HUB_HOST
    assert hub.hub and not any(w.hub for w in workers)  # only the hub asks every worker on a miss
    assert hub.limits.session_idle_timeout == 0 and hub.limits.pressure_idle_timeout == 0
    # Misses are remembered at the hub only, for its upstreams (the workers are asked every time there).
    assert [w.cache.negative_ttl for w in workers] == [0, 0, 0]
    assert hub.cache.negative_ttl == config.cache.negative_ttl > 0
    # A worker's hub session carries the namespaces of every publisher on it.
    assert hub.limits.max_namespaces_per_session == config.limits.max_namespaces_per_session * 3
