"""Striping (``kvnet.exchange.striping``): the split of a request's blocks over sessions and the usable prefix
they make up (pure), then ``fetch_striped`` over several real MoQT connections in memory, each with its own
block server and fetcher: the prefix comes in list order, and a stripe's failure ends it at its block."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
import torch

from kvnet.blocks.identity import BlockIdentity
from kvnet.cache.paged_cache import PagedKVCache
from kvnet.exchange.abr import FetchDeadline, KvAbr
from kvnet.exchange.blockstore import StoredBlock
from kvnet.exchange.fetching import BlockFetcher, FetchOutcome
from kvnet.exchange.striping import UsablePrefix, _StripeDeadline, fetch_striped, split_stripes
from kvnet.security.signing import TrustStore
from tests.helpers.connections import ConnectionPair, connection_pair
from tests.helpers.processes import CertDir
from tests.kvnet.exchange.conftest import (
    FINGERPRINT,
    HASHES,
    NAMESPACE_ID,
    SPEC,
    Published,
    block_server,
    serving_store,
    trusting,
)

LOSSLESS = ["lossless"] * len(HASHES)


def identities(indices: list[int]) -> list[BlockIdentity]:
    return [BlockIdentity(block_index=i, block_hash=bytes([i]) * 32, parent_hash=b"", token_ids=())
            for i in indices]


# -------------------------------------------------------------------------------- pure


def test_blocks_split_by_their_chain_index_in_list_order() -> None:
    assert split_stripes(identities([0, 1, 2, 3, 4, 5, 6]), 3) == [[0, 3, 6], [1, 4], [2, 5]]
    # A run that starts elsewhere, backwards (the tail of a fetch-and-compute): same block, same stripe.
    assert split_stripes(identities([7, 6, 5, 4]), 2) == [[1, 3], [0, 2]]
    assert split_stripes(identities([0, 1, 2]), 1) == [[0, 1, 2]]
    assert split_stripes(identities([0]), 4) == [[0], [], [], []]
    with pytest.raises(ValueError, match="stripes must be at least 1"):
        split_stripes(identities([0]), 0)


def test_the_usable_prefix_grows_in_order_whatever_order_blocks_load_in() -> None:
    prefix = UsablePrefix(5)
    assert prefix.loaded(2) == [] and prefix.loaded(1) == []
    assert prefix.loaded(0) == [0, 1, 2]
    assert prefix.loaded(4) == []
    assert prefix.end == 3
    assert prefix.loaded(3) == [3, 4] and prefix.end == 5


def test_a_failure_ends_the_usable_prefix_at_its_block() -> None:
    prefix = UsablePrefix(6)
    prefix.loaded(0)
    prefix.loaded(3)
    assert prefix.failed(2) and prefix.limit == 2
    assert prefix.loaded(1) == [1] and prefix.end == 2
    assert prefix.loaded(4) == []  # past the failure: never usable
    assert not prefix.failed(5)  # a later failure changes nothing
    assert prefix.failed(2) is False and prefix.limit == 2
    # A stripe holding positions [0, 3] that loaded one of them has nothing below the limit left.
    assert not prefix.still_needed([0, 3], 1)
    assert prefix.still_needed([1, 4], 0) and not prefix.still_needed([1, 4], 1)


def test_a_stripe_sees_the_request_deadline_of_its_own_blocks() -> None:
    deadline = FetchDeadline(started=100.0, margin_s=1.0, block_recompute_s=0.5)
    stripe = _StripeDeadline(deadline, [1, 4])
    assert stripe.due(0) == deadline.due(1) and stripe.due(1) == deadline.due(4)
    assert stripe.describe(1, 103.0) == deadline.describe(4, 103.0)


# -------------------------------------------------------------------------------- over real connections


@contextlib.asynccontextmanager
async def sessions(certs: CertDir, served: list[list[StoredBlock]]) -> AsyncIterator[list[ConnectionPair]]:
    """One connection pair per entry of ``served``, its server side serving those blocks."""
    async with contextlib.AsyncExitStack() as stack:
        pairs = [await stack.enter_async_context(connection_pair(certs)) for _ in served]
        tasks = [asyncio.create_task(block_server(p, serving_store(blocks)).serve())
                 for p, blocks in zip(pairs, served, strict=True)]
        try:
            yield pairs
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def fetchers(
    pairs: list[ConnectionPair], cache: PagedKVCache, trust: TrustStore, abr: KvAbr
) -> list[BlockFetcher]:
    first = BlockFetcher(pairs[0].client, cache, trust, fingerprint=FINGERPRINT, namespace_id=NAMESPACE_ID,
                         shape=SPEC.block_shape, dtype="float32", abr=abr)
    return [first, *(BlockFetcher(p.client, cache, trust, fingerprint=FINGERPRINT, namespace_id=NAMESPACE_ID,
                                  shape=SPEC.block_shape, dtype="float32", abr=abr, inflight=first.inflight)
                     for p in pairs[1:])]


def empty_cache() -> PagedKVCache:
    return PagedKVCache(SPEC, num_blocks=16, device=torch.device("cpu"))


@pytest.mark.parametrize("stripes", [1, 2, 3])
async def test_a_striped_fetch_loads_every_block_in_order_each_session_its_share(
    certs: CertDir, published: Published, stripes: int
) -> None:
    cache, abr = empty_cache(), KvAbr()
    async with sessions(certs, [published.blocks] * stripes) as pairs:
        fs = fetchers(pairs, cache, trusting(published.signer), abr)
        order: list[int] = []
        outcome = await fetch_striped(fs, published.identities, LOSSLESS, abr=abr, on_loaded=order.append)
    assert (outcome.loaded, outcome.error) == (6, None)
    assert order == list(range(6))
    assert outcome.renditions == {"lossless": 6}
    assert outcome.bytes == sum(b.nbytes for b in published.blocks)
    assert [f.stats.fetches for f in fs] == [6 // stripes] * stripes
    assert outcome.sample_bytes == outcome.bytes and abr.throughput.estimate() > 0
    assert cache.match_prefix(HASHES) == 6
    for block_hash in HASHES:
        got, want = cache.export_block(block_hash), published.cache.export_block(block_hash)
        assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)


async def test_a_failed_stripe_ends_the_usable_prefix_at_its_block(
    certs: CertDir, published: Published
) -> None:
    """Stripe 1 of 3 (blocks 1 and 4) lacks block 4: blocks 0-3 are the usable prefix; block 5 (stripe 2)
    is past it, so whether it was loaded before its stripe was stopped does not matter, and nothing is left
    half imported."""
    lacking = [b for b in published.blocks if b.block_hash != HASHES[4]]
    cache, abr = empty_cache(), KvAbr()
    async with sessions(certs, [published.blocks, lacking, published.blocks]) as pairs:
        fs = fetchers(pairs, cache, trusting(published.signer), abr)
        order: list[int] = []
        outcome = await fetch_striped(fs, published.identities, LOSSLESS, abr=abr, on_loaded=order.append)
    assert outcome.loaded == 4 and order == [0, 1, 2, 3]
    assert outcome.error is not None and outcome.error.startswith("block 4:"), outcome.error
    assert not outcome.rejected
    assert cache.match_prefix(HASHES) == 4
    stats = cache.stats()
    assert stats.pending_imports == 0


async def test_a_rejected_block_on_one_stripe_is_reported_as_rejected(
    certs: CertDir, published: Published
) -> None:
    cache, abr = empty_cache(), KvAbr()
    async with sessions(certs, [published.blocks, published.blocks]) as pairs:
        fs = fetchers(pairs, cache, trusting(published.signer), abr)
        fs[1].trust = TrustStore()  # stripe 1's session trusts nobody: its first block (1) is refused
        outcome = await fetch_striped(fs, published.identities, LOSSLESS, abr=abr)
    assert (outcome.loaded, outcome.rejected, outcome.rejected_kind) == (1, True, "signature")
    assert outcome.error is not None and outcome.error.startswith("block 1 rejected")
    assert cache.match_prefix(HASHES) == 1 and cache.stats().pending_imports == 0


async def test_cancelling_a_striped_fetch_keeps_what_it_loaded(certs: CertDir, published: Published) -> None:
    cache, abr = empty_cache(), KvAbr()
    async with sessions(certs, [published.blocks, published.blocks]) as pairs:
        fs = fetchers(pairs, cache, trusting(published.signer), abr)
        out = FetchOutcome()
        first_two = asyncio.Event()

        def loaded(i: int) -> None:
            if i == 1:
                first_two.set()

        task = asyncio.ensure_future(
            fetch_striped(fs, published.identities, LOSSLESS, abr=abr, outcome=out, on_loaded=loaded)
        )
        await first_two.wait()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert out.loaded >= 2 and cache.match_prefix(HASHES) >= out.loaded
    assert out.bytes > 0 and cache.stats().pending_imports == 0
