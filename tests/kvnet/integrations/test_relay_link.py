"""``RelayLink``: an engine's relay session, opened on first use, against a real relay process.

Pushes count what the relay accepted: blocks it cached, blocks it refused (a token that may not publish)
and blocks that never left (no relay) are counted apart.

A fetch is issued only for blocks the scheduler has just located, so the relay was reachable a moment
ago. A connect attempt that began earlier (while the relay was down) and then fails must not fail that
fetch: ``peer(since=...)`` makes one new attempt. The attempt that fails is made to fail by a UDP path
that drops every datagram of the first client address it sees and forwards all others to the relay.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch

from kvnet.cache.paged_cache import CacheSpec, PagedKVCache
from kvnet.exchange.locate import Located
from kvnet.integrations.config import ConnectorConfig
from kvnet.integrations.relay_link import RelayLink, RelayUnavailable, connector_abr
from kvnet.node.config import NodeConfig
from kvnet.security.signing import TrustStore
from kvnet.security.tokens import IssuerKey, issue_token, make_claims
from kvnet.tools.linkemu import EmulatorConfig, LinkEmulator, LinkParams
from tests.helpers.processes import CertDir, RelayProcess, free_port, make_certificates, start_relay
from tests.helpers.prompts import SignedPrompt, signed_prompt
from tests.helpers.waiting import async_wait_until

SPEC = CacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
ATTEMPT_TIMEOUT = 3.0
"""The link's connect deadline: the dropped attempt fails after this."""


class FirstClientDropped(asyncio.DatagramProtocol):
    """Forwards datagrams between clients and ``upstream``, except every one of the first client."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.dropped_client: tuple[str, int] | None = None
        self.transport: asyncio.DatagramTransport | None = None
        self._routes: dict[tuple[str, int], asyncio.DatagramTransport] = {}

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # asyncio's UDP transport is one

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        if self.dropped_client is None:
            self.dropped_client = addr
        if addr == self.dropped_client:
            return
        route = self._routes.get(addr)
        if route is None:
            asyncio.get_running_loop().create_task(self._open_route(addr, data))
        else:
            route.sendto(data)

    async def _open_route(self, client: tuple[str, int], first: bytes) -> None:
        outer = self

        class Back(asyncio.DatagramProtocol):
            def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
                assert outer.transport is not None
                outer.transport.sendto(data, client)

        route, _ = await asyncio.get_running_loop().create_datagram_endpoint(
            Back, remote_addr=self.upstream
        )
        self._routes[client] = route
        route.sendto(first)

    def close(self) -> None:
        for route in self._routes.values():
            route.close()
        if self.transport is not None:
            self.transport.close()


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertDir:
    return make_certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture
def relay(certs: CertDir, tmp_path: Path) -> Iterator[RelayProcess]:
    proc = start_relay(certs, tmp_path)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
async def path(relay: RelayProcess) -> AsyncIterator[tuple[FirstClientDropped, int]]:
    loop = asyncio.get_running_loop()
    transport, forwarder = await loop.create_datagram_endpoint(
        lambda: FirstClientDropped(("127.0.0.1", relay.port)), local_addr=("127.0.0.1", 0)
    )
    try:
        yield forwarder, transport.get_extra_info("sockname")[1]
    finally:
        forwarder.close()


def link_to(port: int, certs: CertDir) -> RelayLink:
    node = NodeConfig(relay_url=f"moqt://127.0.0.1:{port}", ca_file=certs.ca, request_timeout=ATTEMPT_TIMEOUT)
    return RelayLink(
        ConnectorConfig(node), fingerprint=bytes(32), namespace_id="t", block_shape=SPEC.block_shape,
        dtype="float32", trust=TrustStore(), cache=PagedKVCache(SPEC, 4, torch.device("cpu")), announce=False,
        abr=connector_abr(ConnectorConfig(node), "float32", plans=False),
    )


async def test_a_fetch_does_not_fail_on_a_connect_attempt_older_than_itself(
    path: tuple[FirstClientDropped, int], certs: CertDir
) -> None:
    forwarder, port = path
    link = link_to(port, certs)
    stale = asyncio.create_task(link.peer())  # begins while the path to the relay loses everything
    await async_wait_until(lambda: forwarder.dropped_client is not None, "the first attempt's Initial")
    peer = await link.peer(since=time.monotonic())  # joins the stale attempt, then makes its own
    try:
        assert peer.connected
        with pytest.raises(RelayUnavailable):
            await stale
    finally:
        await peer.close()


async def test_without_since_a_failed_attempt_fails_every_caller_that_joined_it(
    path: tuple[FirstClientDropped, int], certs: CertDir
) -> None:
    forwarder, port = path
    link = link_to(port, certs)
    stale = asyncio.create_task(link.peer())
    await async_wait_until(lambda: forwarder.dropped_client is not None, "the first attempt's Initial")
    with pytest.raises(RelayUnavailable):
        await link.peer()
    with pytest.raises(RelayUnavailable):
        await stale
    # Spaced by the backoff: an immediate caller is refused without a new attempt.
    with pytest.raises(RelayUnavailable, match=r"is unreachable$"):
        await link.peer()


PUSH_SPEC = CacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.bfloat16)
"""Geometry of the blocks a push test publishes."""


def pushing_link(relay_url: str, certs: CertDir, **node: object) -> RelayLink:
    config = NodeConfig(relay_url=relay_url, ca_file=certs.ca, request_timeout=ATTEMPT_TIMEOUT, **node)  # type: ignore[arg-type]
    return RelayLink(
        ConnectorConfig(config), fingerprint=bytes(32), namespace_id="t", block_shape=PUSH_SPEC.block_shape,
        dtype="bfloat16", trust=TrustStore(), cache=PagedKVCache(PUSH_SPEC, 4, torch.device("cpu")),
        announce=False, abr=connector_abr(ConnectorConfig(config), "bfloat16", plans=False),
    )


def push_prompt(n_blocks: int) -> SignedPrompt:
    return signed_prompt(PUSH_SPEC, n_blocks, fingerprint=bytes(32), salt=b"push", seed=5)


async def test_pushed_counts_the_blocks_the_relay_accepted(relay: RelayProcess, certs: CertDir) -> None:
    prompt = push_prompt(3)
    link = pushing_link(relay.url, certs)
    try:
        await link.publish(prompt.blocks, 3 * PUSH_SPEC.block_size)
        counters = link.counters
        assert counters.blocks_published == counters.blocks_pushed == 3
        assert counters.push_failures_refused == counters.push_failures_transfer == 0
        # Accepted means in the relay's cache: every object of the 3 blocks (manifest and layers).
        await relay.wait_metric("kvnet_relay_cache_objects", 3 * (PUSH_SPEC.num_layers + 1))
    finally:
        await link.close()


async def test_blocks_the_relay_refuses_are_not_counted_as_pushed(
    certs: CertDir, tmp_path: Path
) -> None:
    issuer = IssuerKey.generate()
    issuer.save_public(tmp_path / "issuer.pub")
    token = tmp_path / "subscribe-only.token"
    claims = make_claims("test", "t", ["subscribe"], [()], now=time.time(), lifetime_s=600)
    token.write_bytes(base64.urlsafe_b64encode(issue_token(issuer, claims)).rstrip(b"="))
    relay = start_relay(certs, tmp_path, "--auth-issuer-key", str(tmp_path / "issuer.pub"))
    link = pushing_link(relay.url, certs, token_file=token)
    try:
        await link.publish(push_prompt(2).blocks, 2 * PUSH_SPEC.block_size)
        counters = link.counters
        assert counters.blocks_published == 2  # kept in our store: served on request
        assert counters.blocks_pushed == 0
        assert counters.push_failures_refused == 2 and counters.push_failures_transfer == 0
    finally:
        await link.close()
        relay.stop()


async def test_blocks_pushed_while_the_relay_is_unreachable_count_as_transfer_failures(
    certs: CertDir,
) -> None:
    link = pushing_link(f"moqt://127.0.0.1:{free_port()}", certs)  # nothing listens there
    try:
        await link.publish(push_prompt(2).blocks, 2 * PUSH_SPEC.block_size)
        counters = link.counters
        assert counters.blocks_published == 2 and counters.blocks_pushed == 0
        assert counters.push_failures_transfer == 2 and counters.push_failures_refused == 0
    finally:
        await link.close()


def planning_link(**node: object) -> RelayLink:
    """A scheduler's link (plans, never connects here): 4 layers of 16-token bf16 blocks, 16 kB each."""
    config = ConnectorConfig(NodeConfig(relay_url="moqt://127.0.0.1:1", ca_file=Path("ca.pem"), **node))  # type: ignore[arg-type]
    return RelayLink(
        config, fingerprint=bytes(32), namespace_id="t", block_shape=(4, 16, 2, 32), dtype="bfloat16",
        trust=TrustStore(), cache=PagedKVCache(PUSH_SPEC, 4, torch.device("cpu")), announce=False,
        abr=connector_abr(config, "bfloat16", plans=True),
    )


def located(blocks: int) -> Located:
    return Located(available=[["lossless"]] * blocks, blocks=blocks, probes=blocks, rounds=1, fan_out=2)


def test_the_scheduler_loads_only_the_located_blocks_that_beat_computing_them() -> None:
    """At an assumed 1 kB/s a 16 kB block takes seconds to load against the 16 ms (1 ms per token, the
    estimate before any forward is timed) of computing it: every located block is declined, counted
    and logged; ``fetch`` mode loads them all whatever the estimates."""
    auto = planning_link(prior_throughput_bps=1e3)
    assert auto.plan("r1", located(4), total_tokens=4 * 16 + 5) == []
    assert (auto.counters.hits_declined, auto.counters.blocks_declined, auto.counters.probes) == (1, 4, 0)
    always = planning_link(prior_throughput_bps=1e3, abr_mode="fetch")
    assert always.plan("r1", located(4), total_tokens=4 * 16 + 5) == ["lossless"] * 4
    assert always.counters.hits_declined == 0


def test_declined_hits_are_probed_and_the_workers_samples_bring_the_hits_back() -> None:
    """A wrong, pessimistic estimate declines hits until a probe loads one block; the worker's sample of
    that load (taken by its own ABR, replayed into the scheduler's) makes the next plan load everything."""
    scheduler = planning_link(prior_throughput_bps=1e3)
    worker = connector_abr(scheduler.settings, "bfloat16", plans=False)
    plans = [scheduler.plan(f"r{i}", located(4), total_tokens=4 * 16 + 5) for i in range(4)]
    assert plans == [[], [], [], ["lossless"]]  # three declined, then the probe
    assert scheduler.counters.probes == 1 and scheduler.counters.hits_declined == 4
    worker.fetch_measured(16 << 10, 1e-4)  # the probe's block loaded at ~160 MB/s
    scheduler.abr.absorb(worker.take_samples())
    assert scheduler.estimates()["throughput_bps"] > 1e8
    assert scheduler.plan("r4", located(4), total_tokens=4 * 16 + 5) == ["lossless"] * 4


def test_a_path_measured_slower_than_computing_skips_the_locate() -> None:
    link = planning_link()
    assert not link.skip_locate("r1", 4, 4 * 16 + 5)  # nothing measured: the prior is not trusted for this
    link.abr.fetch_measured(16 << 10, 10.0)  # 1.6 kB/s
    assert link.skip_locate("r2", 4, 4 * 16 + 5)
    assert link.counters.locates_skipped == 1


async def test_a_workers_load_that_falls_behind_computing_it_is_given_up(
    relay: RelayProcess, certs: CertDir
) -> None:
    """``abr: auto``: the worker's fetch has the node's deadline. 256 blocks through a 20 kB/s link take
    about ten seconds, against about a second (1 ms a token before any forward was timed) to compute
    them: the load is given up within its margin, counted apart from failures, and the blocks it did not
    deliver are reported as not loaded (vLLM computes them). ``abr: fetch`` has no deadline."""
    prompt = push_prompt(256)
    publisher = pushing_link(relay.url, certs)
    try:
        await publisher.publish(prompt.blocks, prompt.tokens)
        assert publisher.counters.blocks_pushed == 256
    finally:
        await publisher.close()
    shaped = EmulatorConfig(listen=("127.0.0.1", 0), target=("127.0.0.1", relay.port),
                            downstream=LinkParams(rate_bps=20_000))
    async with LinkEmulator(shaped) as emu:
        config = ConnectorConfig(NodeConfig(
            relay_url=f"moqt://127.0.0.1:{emu.listen_address[1]}", ca_file=certs.ca, request_timeout=10.0,
            fetch_margin=0.3,
        ))
        worker = RelayLink(
            config, fingerprint=bytes(32), namespace_id="t", block_shape=PUSH_SPEC.block_shape,
            dtype="bfloat16", trust=prompt.trust(), cache=PagedKVCache(PUSH_SPEC, 256, torch.device("cpu")),
            announce=False, abr=connector_abr(config, "bfloat16", plans=False),
        )
        try:
            await worker.peer()  # the handshake through the slow link is not the load's
            outcome = await worker.fetch(prompt.identities, ["lossless"] * 256)
        finally:
            await worker.close()
    # Only the deadline (or its re-plan) abandons a fetch: without one, every block would have come.
    assert outcome.abandoned is not None and outcome.loaded < 256, outcome
    counters = worker.counters
    assert counters.loads_abandoned == 1 and counters.load_failures_transfer == 0
    assert counters.blocks_load_failed == 256 - outcome.loaded
    fetch_only = connector_abr(config.with_node(abr_mode="fetch"), "bfloat16", plans=False)
    assert fetch_only.deadline(0.0, PUSH_SPEC.block_size) is None
