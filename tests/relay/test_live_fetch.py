"""A FETCH of a block whose objects are still arriving at the relay (a publisher pushing it, paused half
way) is never answered with part of the block as if it were whole.

A relay in the test's own process (``tests.relay.inprocess``: real QUIC on loopback), real publisher session
(PUBLISH, then half the objects, then nothing until the test lets it go on), real subscriber with the node's
``BlockFetcher``: the relay waits for the rest and serves the block whole; when its wait runs out it refuses
the FETCH instead, the subscriber asks again within its deadline, loads the block once it is complete and
takes no throughput sample from any of it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import torch

from kvnet.cache.paged_cache import CacheSpec, PagedKVCache
from kvnet.exchange.abr import AbrConfig, FetchDeadline, KvAbr
from kvnet.exchange.fetching import BlockFetcher, FetchOutcome
from kvnet.net.config import TlsConfig, TransportConfig
from kvnet.net.connection import MoqtConnection
from kvnet.net.endpoint import connect
from proto.data import ObjectStatus
from proto.errors import PublishDoneCode
from proto.kvobject import BLOCK_GROUP_ID, block_track
from proto.messages import Location, MessageParameters
from tests.helpers.processes import CertDir
from tests.helpers.prompts import SignedPrompt, signed_prompt
from tests.helpers.waiting import async_wait_until
from tests.relay.inprocess import InProcessRelay, relay_in_process

SPEC = CacheSpec(num_layers=8, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32)
FINGERPRINT = bytes(range(32))
NAMESPACE_ID = "live"
HELD = 4
"""Objects of the block the publisher sends before it pauses (the manifest and three layers)."""


class PausedPush:
    """One block PUBLISHed with ``HELD`` of its objects sent; ``finish`` sends the rest and ends it."""

    def __init__(self, conn: MoqtConnection, prompt: SignedPrompt) -> None:
        self.conn = conn
        self.block = prompt.blocks[0]
        self.stream_id = -1
        self.request_id = -1

    async def start(self) -> None:
        ns, name = block_track(FINGERPRINT, NAMESPACE_ID, self.block.block_hash, "lossless")
        ok = await self.conn.publish(
            ns, name, 1, MessageParameters(largest_object=Location(BLOCK_GROUP_ID, SPEC.num_layers))
        )
        self.request_id = ok.request_id
        self.stream_id = self.conn.open_subgroup(1, BLOCK_GROUP_ID, 0)
        for object_id in range(HELD):
            self.conn.send_subgroup_object(self.stream_id, object_id, self.block.objects[object_id])

    def finish(self) -> None:
        objects = self.block.objects
        for object_id in range(HELD, len(objects)):
            self.conn.send_subgroup_object(self.stream_id, object_id, objects[object_id])
        self.conn.send_subgroup_object(
            self.stream_id, len(objects), b"", (), ObjectStatus.END_OF_TRACK, end_stream=True
        )

    async def done(self) -> None:
        await self.conn.wait_stream_sent(self.stream_id)
        self.conn.publish_done(self.request_id, PublishDoneCode.TRACK_ENDED, "block complete")

    @property
    def held_bytes(self) -> int:
        return sum(len(o) for o in self.block.objects[:HELD])


@contextlib.asynccontextmanager
async def _half_pushed(
    relay: InProcessRelay, cert_dir: CertDir, prompt: SignedPrompt
) -> AsyncIterator[tuple[PausedPush, MoqtConnection]]:
    """A publisher session that has pushed half of ``prompt``'s block into ``relay`` (the relay holds it)
    and a subscriber session on the same relay; both closed on the way out."""
    settings, tls = TransportConfig.for_link("loopback", "aioquic"), TlsConfig(ca_file=cert_dir.ca)
    publisher = await connect(relay.url, settings, tls)
    subscriber = await connect(relay.url, settings, tls)
    try:
        push = PausedPush(publisher, prompt)
        await push.start()
        await relay.wait_value("bytes_in_total", push.held_bytes)
        yield push, subscriber
    finally:
        await subscriber.close_session()
        await publisher.close_session()


def _fetcher(conn: MoqtConnection, prompt: SignedPrompt, cache: PagedKVCache, abr: KvAbr) -> BlockFetcher:
    return BlockFetcher(conn, cache, prompt.trust(), fingerprint=FINGERPRINT, namespace_id=NAMESPACE_ID,
                        shape=SPEC.block_shape, dtype="float32", abr=abr, timeout=30.0)


def _assert_loaded(outcome: FetchOutcome, cache: PagedKVCache, prompt: SignedPrompt) -> None:
    assert outcome.error is None and outcome.loaded == 1, outcome
    got, want = cache.export_block(prompt.hashes[0]), prompt.source.export_block(prompt.hashes[0])
    assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)


def _waits(relay: InProcessRelay, outcome: str) -> float:
    return relay.value("live_fetch_waits_total", outcome=outcome)


async def test_fetch_of_a_half_pushed_block_waits_for_the_rest(cert_dir: CertDir) -> None:
    prompt = signed_prompt(SPEC, 1, fingerprint=FINGERPRINT, salt=b"live", seed=5)
    async with (
        relay_in_process(cert_dir) as relay,
        _half_pushed(relay, cert_dir, prompt) as (push, subscriber),
    ):
        cache = PagedKVCache(SPEC, num_blocks=2, device=torch.device("cpu"))
        fetcher = _fetcher(subscriber, prompt, cache, KvAbr(AbrConfig()))
        inflight = relay.value("requests_inflight")  # the PUBLISH
        fetch = asyncio.ensure_future(fetcher.fetch(prompt.identities, ["lossless"]))
        # The relay has the FETCH and holds only part of the block: the relay waits, the fetch is open.
        await relay.wait_value("requests_inflight", inflight + 1)
        assert not fetch.done()
        push.finish()
        outcome = await fetch
        await push.done()
        _assert_loaded(outcome, cache, prompt)
        assert outcome.retries == 0  # served whole at the first try
        assert _waits(relay, "complete") == 1 and _waits(relay, "short") == 0


async def test_block_still_short_when_the_relay_gives_up_is_asked_again_and_not_sampled(
    cert_dir: CertDir,
) -> None:
    prompt = signed_prompt(SPEC, 1, fingerprint=FINGERPRINT, salt=b"live", seed=6)
    async with (
        relay_in_process(cert_dir, "--upstream-timeout", "0.2", "--route-timeout", "0.2") as relay,
        _half_pushed(relay, cert_dir, prompt) as (push, subscriber),
    ):
        cache = PagedKVCache(SPEC, num_blocks=2, device=torch.device("cpu"))
        abr = KvAbr(AbrConfig())
        fetcher = _fetcher(subscriber, prompt, cache, abr)
        loop = asyncio.get_running_loop()
        # A deadline far enough away for any load: the block is retried within it, never abandoned.
        deadline = FetchDeadline(loop.time(), margin_s=60.0, block_recompute_s=1.0)
        fetch = asyncio.ensure_future(fetcher.fetch(prompt.identities, ["lossless"], deadline))
        # The relay's wait ran out with the block still short: it refused (no route has the block), and
        # the subscriber keeps asking.
        await async_wait_until(lambda: _waits(relay, "short") >= 2, "two FETCHes refused as still short")
        assert not fetch.done()
        push.finish()
        outcome = await fetch
        await push.done()
        _assert_loaded(outcome, cache, prompt)
        assert outcome.retries >= 2
        # The time spent waiting for the publisher is not a measure of the path: no sample at all.
        assert abr.throughput.samples == 0 and outcome.sample_bytes == 0
