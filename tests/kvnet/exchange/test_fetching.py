"""The fetcher (``kvnet.exchange.fetching.BlockFetcher``) against a real block server over a real MoQT
connection in memory: it loads exactly the verified prefix into the cache it was given, and every
failure (missing block, untrusted key, wrong tokens, corrupted layer, silent peer) ends the prefix there
with the cache left consistent."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator, Callable

import pytest
import torch

from kvnet.cache.paged_cache import PagedKVCache
from kvnet.exchange import fetching
from kvnet.exchange.abr import AbrConfig, KvAbr
from kvnet.exchange.blockstore import StoredBlock
from kvnet.exchange.fetching import BlockFetcher, FetchOutcome
from kvnet.exchange.publishing import BlockServer, encode_blocks
from kvnet.exchange.relay_peer import node_session_config
from kvnet.net.handles import IncomingFetch, IncomingTrackStatus
from kvnet.net.url import parse_moqt_url
from kvnet.security.signing import Signer, TrustStore
from proto.errors import RequestErrorCode
from proto.kvobject import BLOCK_GROUP_ID, MAX_MANIFEST_BYTES, BlockManifest
from proto.messages import Location
from tests.helpers.caches import TensorsOnlyCache
from tests.helpers.connections import ConnectionPair, connection_pair
from tests.helpers.processes import CertDir
from tests.helpers.waiting import async_wait_until
from tests.kvnet.exchange.conftest import (
    FINGERPRINT,
    HASHES,
    NAMESPACE_ID,
    SPEC,
    Published,
    block_server,
    fill_cache,
    serving_store,
    trusting,
)

LOSSLESS = ["lossless"] * len(HASHES)

Serve = Callable[[list[StoredBlock]], None]


@pytest.fixture
async def serve(pair: ConnectionPair) -> AsyncIterator[Serve]:
    """Start a block server on the pair's server side holding the given blocks."""
    tasks: list[asyncio.Task[None]] = []

    def start(blocks: list[StoredBlock]) -> None:
        tasks.append(asyncio.create_task(block_server(pair, serving_store(blocks)).serve()))

    yield start
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def empty_cache() -> PagedKVCache:
    return PagedKVCache(SPEC, num_blocks=16, device=torch.device("cpu"))


def fetcher(pair: ConnectionPair, cache: PagedKVCache, trust: TrustStore, **options: object) -> BlockFetcher:
    return BlockFetcher(
        pair.client, cache, trust, fingerprint=FINGERPRINT, namespace_id=NAMESPACE_ID, shape=SPEC.block_shape,
        dtype="float32", **options,  # type: ignore[arg-type]
    )


def assert_consistent(cache: PagedKVCache, loaded: int) -> None:
    """Exactly the first ``loaded`` blocks are cached, and no import holds a block."""
    assert cache.match_prefix(HASHES) == loaded
    assert not any(cache.contains_block(h) for h in HASHES[loaded:])
    stats = cache.stats()
    assert stats.pending_imports == 0 and stats.free_blocks == stats.num_blocks


def assert_same_kv(cache: PagedKVCache, source: PagedKVCache, hashes: list[bytes]) -> None:
    for block_hash in hashes:
        got, want = cache.export_block(block_hash), source.export_block(block_hash)
        assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)


async def test_locate_then_fetch_loads_the_served_prefix(
    pair: ConnectionPair, serve: Serve, published: Published
) -> None:
    serve(published.blocks[:4])
    cache = empty_cache()
    f = fetcher(pair, cache, trusting(published.signer))
    located = await f.locate(HASHES, ["lossless"])
    assert located.available == [["lossless"]] * 4
    outcome = await f.fetch(published.identities[:4], LOSSLESS[:4])
    assert (outcome.loaded, outcome.error, outcome.renditions) == (4, None, {"lossless": 4})
    assert outcome.untrusted == 0
    assert outcome.bytes == sum(b.nbytes for b in published.blocks[:4])
    assert_consistent(cache, 4)
    assert_same_kv(cache, published.cache, HASHES[:4])


async def test_fetch_stops_at_the_first_block_the_peer_lacks(
    pair: ConnectionPair, serve: Serve, published: Published
) -> None:
    serve(published.blocks[:4])
    cache = empty_cache()
    outcome = await fetcher(pair, cache, trusting(published.signer)).fetch(published.identities, LOSSLESS)
    assert outcome.loaded == 4 and not outcome.rejected
    assert outcome.error is not None and outcome.error.startswith("block 4:")
    assert_consistent(cache, 4)


async def test_untrusted_signatures_are_rejected_before_the_cache_is_touched(
    pair: ConnectionPair, serve: Serve, published: Published
) -> None:
    serve(published.blocks)
    cache = empty_cache()
    outcome = await fetcher(pair, cache, trusting(Signer.generate())).fetch(published.identities, LOSSLESS)
    assert (outcome.loaded, outcome.rejected, outcome.rejected_kind) == (0, True, "signature")
    assert outcome.error is not None and "not from a trusted key" in outcome.error
    assert_consistent(cache, 0)


async def test_trust_any_accepts_a_correctly_signed_unknown_key(
    pair: ConnectionPair, serve: Serve, published: Published
) -> None:
    serve(published.blocks[:2])
    cache = empty_cache()
    outcome = await fetcher(pair, cache, TrustStore(), trust_any=True).fetch(
        published.identities[:2], LOSSLESS[:2]
    )
    assert (outcome.loaded, outcome.error) == (2, None)
    assert outcome.untrusted == 2  # loaded, but their K/V is no trusted publisher's (kv_exact is false)
    assert_same_kv(cache, published.cache, HASHES[:2])


async def test_a_manifest_for_other_tokens_is_rejected_as_content(
    pair: ConnectionPair, serve: Serve, published: Published
) -> None:
    serve(published.blocks)
    # The subscriber's prompt differs in block 2, yet the peer's signed block claims the same hash.
    expected = list(published.identities)
    expected[2] = dataclasses.replace(expected[2], token_ids=(0,) * SPEC.block_size)
    cache = empty_cache()
    outcome = await fetcher(pair, cache, trusting(published.signer)).fetch(expected, LOSSLESS)
    assert (outcome.loaded, outcome.rejected_kind) == (2, "content")
    assert outcome.error == "block 2 rejected: token ids differ from the prompt"
    assert_consistent(cache, 2)


@pytest.mark.parametrize("verify_workers", [0, 1, 3])
async def test_a_corrupted_layer_is_rejected_and_its_reserved_block_released(
    pair: ConnectionPair, serve: Serve, published: Published, verify_workers: int
) -> None:
    good = published.blocks[1]
    layer_1 = bytearray(good.objects[2])
    layer_1[-1] ^= 0xFF
    bad = dataclasses.replace(good, objects=(*good.objects[:2], bytes(layer_1), *good.objects[3:]))
    serve([published.blocks[0], bad, *published.blocks[2:]])
    cache = empty_cache()
    f = fetcher(pair, cache, trusting(published.signer), verify_workers=verify_workers)
    outcome = await f.fetch(published.identities, LOSSLESS)
    assert (outcome.loaded, outcome.rejected_kind) == (1, "content")
    assert outcome.error == "block 1 rejected: payload digest of layer 1 differs"
    assert_consistent(cache, 1)


@pytest.mark.parametrize("verify_workers", [0, 1])
async def test_a_signed_layer_that_does_not_decode_leaves_its_slots_unused(
    pair: ConnectionPair, serve: Serve, published: Published, verify_workers: int
) -> None:
    """A layer whose digest the (trusted) manifest lists but whose bytes are malformed gets past the
    digest and fails inside the decoder, which writes into the reserved block's slots: the block must be
    given back unseen, and the blocks before it stay loaded."""
    good = published.blocks[1]
    manifest = BlockManifest.decode(good.objects[0])
    layer_1 = good.objects[2][:-7]  # truncated inside its last section
    payloads = [*good.objects[1:2], layer_1, *good.objects[3:]]
    unsigned = BlockManifest.for_payloads(
        fingerprint=manifest.fingerprint, block_hash=manifest.block_hash, parent_hash=manifest.parent_hash,
        token_ids=manifest.token_ids, block_index=manifest.block_index, codec=manifest.codec,
        dtype=manifest.dtype, shape=manifest.shape, payloads=payloads, key_id=published.signer.key_id,
    )
    signed = unsigned.with_signature(published.signer.sign_manifest(unsigned))
    bad = dataclasses.replace(good, objects=(signed.encode(), *payloads), manifest=signed)
    serve([published.blocks[0], bad, *published.blocks[2:]])
    cache = empty_cache()
    f = fetcher(pair, cache, trusting(published.signer), verify_workers=verify_workers)
    outcome = await f.fetch(published.identities, LOSSLESS)
    assert outcome.loaded == 1 and not outcome.rejected
    assert outcome.error is not None and outcome.error.startswith("block 1: payload truncated")
    assert_consistent(cache, 1)
    assert_same_kv(cache, published.cache, HASHES[:1])


class RecordingCache(PagedKVCache):
    """A paged cache that records which thread wrote which layer of which block, in call order, through
    ``import_layer`` (a decoded tensor) or ``import_layer_with`` (decoded into its slots)."""

    def __init__(self) -> None:
        super().__init__(SPEC, num_blocks=16, device=torch.device("cpu"))
        self.writes: list[tuple[bytes, int, int]] = []
        self.in_place: list[tuple[bytes, int, int]] = []

    def import_layer(self, block_hash: bytes, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.writes.append((block_hash, layer, threading.get_ident()))
        super().import_layer(block_hash, layer, k, v)

    def import_layer_with(
        self, block_hash: bytes, layer: int, write: Callable[[torch.Tensor, torch.Tensor], None]
    ) -> None:
        self.in_place.append((block_hash, layer, threading.get_ident()))
        super().import_layer_with(block_hash, layer, write)


@pytest.mark.parametrize(("verify_workers", "layers_per_task"), [(1, 1), (2, 2), (5, 16)])
async def test_layers_verified_on_workers_are_written_in_order_on_the_event_loop(
    pair: ConnectionPair, serve: Serve, published: Published, verify_workers: int, layers_per_task: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(fetching, "LAYERS_PER_TASK", layers_per_task)  # 3 layers: 3, 2 and 1 tasks a block
    serve(published.blocks)
    cache = RecordingCache()
    f = BlockFetcher(pair.client, TensorsOnlyCache(cache), trusting(published.signer),
                     fingerprint=FINGERPRINT, namespace_id=NAMESPACE_ID, shape=SPEC.block_shape,
                     dtype="float32", verify_workers=verify_workers)
    outcome = await f.fetch(published.identities, LOSSLESS)
    assert (outcome.loaded, outcome.error) == (len(HASHES), None)
    assert outcome.load_s > 0
    want = [(h, layer) for h in HASHES for layer in range(SPEC.num_layers)]
    assert [(h, layer) for h, layer, _ in cache.writes] == want and not cache.in_place
    assert {thread for _, _, thread in cache.writes} == {threading.get_ident()}
    assert_consistent(cache, len(HASHES))
    assert_same_kv(cache, published.cache, HASHES)


@pytest.mark.parametrize("rendition", ["lossless", "plain"])
@pytest.mark.parametrize("verify_workers", [0, 2])
async def test_layers_are_decoded_straight_into_the_slots_of_a_cpu_cache(
    pair: ConnectionPair, serve: Serve, published: Published, plain_published: Published,
    verify_workers: int, rendition: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the event loop or on the workers, each layer is checked and decoded into its reserved slots once
    (no decoded tensor is written); the block is published on the event loop once all its layers are in,
    and the ABR learns the rendition's verify + decode speed from these decodes."""
    monkeypatch.setattr(fetching, "LAYERS_PER_TASK", 1)  # one layer a task: layers of a block in parallel
    source = published if rendition == "lossless" else plain_published
    serve(source.blocks)
    cache = RecordingCache()
    f = fetcher(pair, cache, trusting(source.signer), verify_workers=verify_workers)
    outcome = await f.fetch(source.identities, [rendition] * len(HASHES))
    assert (outcome.loaded, outcome.error) == (len(HASHES), None)
    assert outcome.renditions == {rendition: len(HASHES)}
    assert not cache.writes
    assert sorted((h, layer) for h, layer, _ in cache.in_place) == sorted(
        (h, layer) for h in HASHES for layer in range(SPEC.num_layers))
    threads = {thread for _, _, thread in cache.in_place}
    assert (threading.get_ident() in threads) == (verify_workers == 0)
    assert_consistent(cache, len(HASHES))
    assert_same_kv(cache, source.cache, HASHES)
    assert f.abr.renditions.decode[rendition].has_samples
    assert f.abr.renditions.size_ratio(rendition) == pytest.approx(
        sum(b.nbytes for b in source.blocks) / (len(HASHES) * SPEC.bytes_per_block), rel=0.2)


async def test_verify_workers_out_of_range_is_refused(pair: ConnectionPair) -> None:
    for bad in (-1, 65):
        with pytest.raises(ValueError, match="verify_workers must be in"):
            fetcher(pair, empty_cache(), TrustStore(), verify_workers=bad)


async def test_blocks_already_cached_are_kept_not_imported_again(
    pair: ConnectionPair, serve: Serve, published: Published
) -> None:
    serve(published.blocks[:3])
    cache = empty_cache()
    fill_cache(cache, HASHES[:1], seed=99)  # block 0 is already here (other data: not overwritten)
    before = cache.export_block(HASHES[0])
    f = fetcher(pair, cache, trusting(published.signer))
    outcome = await f.fetch(published.identities[:3], LOSSLESS[:3])
    assert (outcome.loaded, outcome.error) == (3, None)
    assert torch.equal(cache.export_block(HASHES[0]).k, before.k)
    assert_same_kv(cache, published.cache, HASHES[1:3])


async def test_a_block_cached_while_its_fetch_was_under_way_is_no_abr_sample(
    pair: ConnectionPair, serve: Serve, published: Published
) -> None:
    """A cache that cannot say what it holds (no ``contains_block``) gets block 0 fetched although it has
    it; only its manifest comes (``begin_import`` says no), which is no sample of the rendition's size."""
    serve(published.blocks[:3])
    cache = RecordingCache()
    fill_cache(cache, HASHES[:1], seed=99)
    f = BlockFetcher(pair.client, TensorsOnlyCache(cache), trusting(published.signer),
                     fingerprint=FINGERPRINT, namespace_id=NAMESPACE_ID, shape=SPEC.block_shape,
                     dtype="float32")
    outcome = await f.fetch(published.identities[:3], LOSSLESS[:3])
    assert (outcome.loaded, outcome.error) == (3, None)
    full = sum(b.nbytes for b in published.blocks[1:3]) / (2 * SPEC.bytes_per_block)
    assert f.abr.renditions.size_ratio("lossless") == pytest.approx(full, rel=1e-3)


async def test_a_silent_peer_times_out_and_leaves_the_cache_alone(
    pair: ConnectionPair, published: Published
) -> None:
    # Nothing answers on the server side: every request waits in its incoming queue.
    cache = empty_cache()
    f = fetcher(pair, cache, trusting(published.signer), timeout=0.2, straggler_grace=0.1)
    with pytest.raises(TimeoutError):
        await f.locate(HASHES, ["lossless"])
    outcome: FetchOutcome = await f.fetch(published.identities[:2], LOSSLESS[:2])
    assert outcome.loaded == 0
    assert outcome.error == "timed out after 0.2s waiting for block 0"
    assert_consistent(cache, 0)


class TrackStatusRefusingServer(BlockServer):
    """Serves FETCH but answers every TRACK_STATUS DOES_NOT_EXIST, as relays that do not forward
    TRACK_STATUS (and do not hold the track whole) do."""

    def _answer_track_status(self, req: IncomingTrackStatus) -> None:
        req.reject(RequestErrorCode.DOES_NOT_EXIST, "not forwarded")


async def test_locate_falls_back_to_manifest_fetches_when_track_status_is_not_forwarded(
    pair: ConnectionPair, published: Published
) -> None:
    server = TrackStatusRefusingServer(pair.server, serving_store(published.blocks[:4]), FINGERPRINT,
                                       NAMESPACE_ID, SPEC.num_layers)
    task = asyncio.create_task(server.serve())
    try:
        cache = empty_cache()
        f = fetcher(pair, cache, trusting(published.signer))
        located = await f.locate(HASHES, ["lossless"])
        assert located.available == [["lossless"]] * 4 and f.locate_probe == "fetch"
        # The first round (TRACK_STATUS) and the manifest check share a round trip; the fallback search of
        # len(HASHES) <= fan_out blocks takes one more.
        assert located.rounds == 2
        again = await f.locate(HASHES, ["lossless"])  # the session keeps probing with FETCH
        assert again.available == located.available and again.rounds == 1
        outcome = await f.fetch(published.identities[:4], LOSSLESS[:4])
        assert outcome.loaded == 4 and outcome.error is None
        assert_consistent(cache, 4)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_locate_keeps_track_status_when_it_finds_blocks(
    pair: ConnectionPair, serve: Serve, published: Published
) -> None:
    f = fetcher(pair, empty_cache(), trusting(published.signer))
    serve(published.blocks[:2])
    assert len((await f.locate(HASHES, ["lossless"])).available) == 2
    assert f.locate_probe == "track_status"


async def test_locate_stays_undecided_when_nothing_exists(
    pair: ConnectionPair, serve: Serve, published: Published
) -> None:
    f = fetcher(pair, empty_cache(), trusting(published.signer))
    serve([])
    assert (await f.locate(HASHES, ["lossless"])).available == []
    assert f.locate_probe is None  # no evidence against TRACK_STATUS: the next locate checks again


async def test_a_cut_short_block_is_asked_again_and_never_a_throughput_sample(
    pair: ConnectionPair, serve: Serve, published: Published
) -> None:
    """A peer whose FETCH of block 0 ends after two of its objects (FIN, as a relay serving part of a block
    still being pushed did): the fetcher asks again until its timeout, loads nothing, and the throughput
    estimate is untouched by the cut-short transfer."""
    whole = published.blocks[0]
    serve([dataclasses.replace(whole, objects=whole.objects[:2]), *published.blocks[1:]])
    cache = empty_cache()
    f = fetcher(pair, cache, trusting(published.signer), timeout=0.3)
    prior = f.abr.throughput.estimate()
    outcome = await f.fetch(published.identities[:3], LOSSLESS[:3])
    assert outcome.loaded == 0 and outcome.retries >= 1
    assert outcome.error is not None and "fetch ended after 2 of 4 objects" in outcome.error
    assert f.abr.throughput.samples == 0 and f.abr.throughput.estimate() == prior
    assert_consistent(cache, 0)


async def test_clean_blocks_before_a_cut_short_one_are_the_sample(
    pair: ConnectionPair, serve: Serve, published: Published
) -> None:
    whole = published.blocks[2]
    serve([*published.blocks[:2], dataclasses.replace(whole, objects=whole.objects[:1])])
    cache = empty_cache()
    f = fetcher(pair, cache, trusting(published.signer), timeout=0.3)
    outcome = await f.fetch(published.identities[:3], LOSSLESS[:3])
    assert outcome.loaded == 2
    assert outcome.sample_bytes == published.blocks[0].nbytes + published.blocks[1].nbytes
    assert f.abr.throughput.samples == 1
    assert_consistent(cache, 2)


class StallingServer(BlockServer):
    """Sends each block's first two objects and then nothing more (a link too slow to finish a block)."""

    async def _serve_fetch(self, req: IncomingFetch) -> None:
        ev = req.event
        assert ev.track_namespace is not None and ev.track_name is not None
        objects = self._lookup(ev.track_namespace, ev.track_name)
        assert objects is not None
        req.accept_fetch(True, Location(BLOCK_GROUP_ID, len(objects)))
        for object_id in range(2):
            req.send_object(BLOCK_GROUP_ID, 0, object_id, objects[object_id])
        await req.drain()
        await asyncio.Event().wait()  # until the fetch is cancelled


async def test_a_fetch_cancelled_before_any_whole_block_is_measured_by_what_arrived(
    pair: ConnectionPair, published: Published
) -> None:
    """A head computing the prefix reached the fetch before one block came whole: the objects that had
    arrived, over the time until then, are the sample (the estimate must not stay where it was)."""
    server = StallingServer(pair.server, serving_store(published.blocks), FINGERPRINT, NAMESPACE_ID,
                            SPEC.num_layers)
    task = asyncio.create_task(server.serve())
    try:
        f = fetcher(pair, empty_cache(), trusting(published.signer))
        out = FetchOutcome()
        fetching_task = asyncio.create_task(f.fetch(published.identities[:2], LOSSLESS[:2], outcome=out))
        await async_wait_until(lambda: out.bytes > 0, "the first objects of block 0")
        fetching_task.cancel()
        await asyncio.gather(fetching_task, return_exceptions=True)
        assert out.loaded == 0
        two_objects = sum(len(o) for o in published.blocks[0].objects[:2])
        assert out.sample_bytes >= two_objects and out.sample_s > 0
        assert f.abr.throughput.samples == 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_fetch_that_failed_mid_block_is_no_sample(pair: ConnectionPair, published: Published) -> None:
    # The same stalled peer, now waited for until the object timeout: that time is the stall's, not the
    # link's, and a node whose relay died must not take it for a slow link.
    server = StallingServer(pair.server, serving_store(published.blocks), FINGERPRINT, NAMESPACE_ID,
                            SPEC.num_layers)
    task = asyncio.create_task(server.serve())
    try:
        f = fetcher(pair, empty_cache(), trusting(published.signer), timeout=0.3)
        outcome = await f.fetch(published.identities[:2], LOSSLESS[:2])
        assert outcome.loaded == 0 and outcome.error is not None and "timed out" in outcome.error
        assert outcome.sample_bytes == 0 and f.abr.throughput.samples == 0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


class LateWholeServer(BlockServer):
    """Answers each FETCH only once ``release`` is set, then whole and at once: a relay that serves a FETCH
    only when the whole upstream response is in delivers its first object late."""

    release: asyncio.Event

    async def _serve_fetch(self, req: IncomingFetch) -> None:
        await self.release.wait()
        await super()._serve_fetch(req)


async def test_a_fetch_is_one_first_byte_sample_of_its_relay(
    pair: ConnectionPair, serve: Serve, published: Published
) -> None:
    serve(published.blocks[:3])
    f = fetcher(pair, empty_cache(), trusting(published.signer), relay="moqt://relay-a:4443")
    outcome = await f.fetch(published.identities[:3], LOSSLESS[:3])
    assert outcome.loaded == 3
    assert f.first_byte is f.abr.first_byte["moqt://relay-a:4443"]
    assert f.first_byte.samples == 1  # one per fetch (its first block's wait), not one per block
    assert f.abr.first_byte_s("moqt://relay-b:4443") == 0.0  # another relay learned nothing


async def test_a_relay_that_answers_late_but_whole_is_learned_and_then_waited_for(
    pair: ConnectionPair, published: Published
) -> None:
    """The first fetch waits past its deadline for a first object that has not come: abandoned, and the
    wait is learned as the relay's first-byte delay (at least that long). The next fetch's deadline allows
    it: released just after the point where the first one gave up, it loads every block."""
    server = LateWholeServer(pair.server, serving_store(published.blocks), FINGERPRINT, NAMESPACE_ID,
                             SPEC.num_layers)
    server.release = asyncio.Event()
    task = asyncio.create_task(server.serve())
    try:
        abr = KvAbr(AbrConfig(deadline_margin_s=0.5))
        f = fetcher(pair, empty_cache(), trusting(published.signer), abr=abr)
        loop = asyncio.get_running_loop()
        deadline = abr.deadline(loop.time(), SPEC.block_size)
        first = await f.fetch(published.identities[:2], LOSSLESS[:2], deadline)
        assert first.loaded == 0 and first.abandoned is not None
        learned = abr.first_byte_s()
        assert f.first_byte.samples == 1
        # What it waited for nothing: from its FETCH, sent just after the deadline was set, to the deadline
        # (the 0.5 s margin), less the RTT; at least half of it however late the loop ran the send.
        assert learned >= 0.25
        deadline = abr.deadline(loop.time(), SPEC.block_size)
        assert deadline is not None and deadline.first_byte_s == learned
        given_up_before = deadline.started + deadline.margin_s + deadline.block_recompute_s
        second = asyncio.create_task(f.fetch(published.identities[:2], LOSSLESS[:2], deadline))
        await async_wait_until(lambda: loop.time() >= given_up_before, "the first fetch's deadline passed")
        server.release.set()
        outcome = await second
        assert (outcome.loaded, outcome.abandoned, outcome.error) == (2, None, None)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_concurrent_fetches_of_a_shared_prefix_send_one_fetch_per_block(
    pair: ConnectionPair, published: Published
) -> None:
    """Four requests of one node need the same three remote blocks at once: three FETCHes go out, not
    twelve, and every request ends with the three blocks loaded."""
    server = block_server(pair, serving_store(published.blocks[:3]))
    task = asyncio.create_task(server.serve())
    try:
        cache = empty_cache()
        f = fetcher(pair, cache, trusting(published.signer))
        outcomes = await asyncio.gather(
            *(f.fetch(published.identities[:3], LOSSLESS[:3]) for _ in range(4))
        )
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert [(o.loaded, o.error) for o in outcomes] == [(3, None)] * 4
    assert server.stats.fetches_served == 3 and f.stats.fetches == 3
    assert f.stats.coalesced == 9
    assert_consistent(cache, 3)
    assert_same_kv(cache, published.cache, HASHES[:3])


async def test_a_request_that_waited_for_another_fetch_counts_what_that_fetch_loaded(
    pair: ConnectionPair, serve: Serve, published: Published
) -> None:
    """``kv_exact`` of every request that used a shared block depends on how the block came: a request
    that joined another request's FETCH counts that fetch's rendition and signer, not the ones it asked
    for (here: it asked for int8, and the blocks came lossless from a key trusted only by --trust-any)."""
    serve(published.blocks[:3])
    cache = empty_cache()
    f = fetcher(pair, cache, TrustStore(), trust_any=True)
    first, second = await asyncio.gather(
        f.fetch(published.identities[:3], LOSSLESS[:3]), f.fetch(published.identities[:3], ["int8"] * 3)
    )
    assert f.stats.fetches == 3 and f.stats.coalesced == 3  # the second request waited for the first's
    for outcome in (first, second):
        assert (outcome.loaded, outcome.error) == (3, None)
        assert outcome.renditions == {"lossless": 3} and outcome.untrusted == 3
    assert_same_kv(cache, published.cache, HASHES[:3])


async def test_a_request_waiting_on_a_failed_shared_fetch_fetches_the_block_itself(
    pair: ConnectionPair, serve: Serve, published: Published
) -> None:
    cache = empty_cache()
    f = fetcher(pair, cache, trusting(published.signer))
    # Nothing serves yet: the first request's three FETCHes wait; the second joins them.
    first = asyncio.ensure_future(f.fetch(published.identities[:3], LOSSLESS[:3]))
    await async_wait_until(lambda: f.stats.fetches == 3, "the first request's FETCHes sent")
    second = asyncio.ensure_future(f.fetch(published.identities[:3], LOSSLESS[:3]))
    await async_wait_until(lambda: f.stats.coalesced == 3, "the second request joined them")
    first.cancel()  # its client went away: the blocks it was fetching are given up
    await asyncio.gather(first, return_exceptions=True)
    serve(published.blocks[:3])
    outcome = await second
    assert (outcome.loaded, outcome.error) == (3, None)
    assert f.stats.fetches == 6  # the second request fetched them itself
    assert_consistent(cache, 3)


async def test_a_manifest_too_large_to_be_one_is_refused_as_its_length_arrives(
    certs: CertDir, published: Published
) -> None:
    """A node's relay session bounds object 0 (the manifest) at ``MAX_MANIFEST_BYTES``: a peer that sends a
    15 MiB "manifest" gets the fetch stream stopped when its length arrives, and nothing is loaded."""
    session = node_session_config(parse_moqt_url("moqt://localhost:4443"))
    async with connection_pair(certs, client_session=session) as pair:
        huge = dataclasses.replace(
            published.blocks[0], objects=(b"\x80" * (15 << 20), *published.blocks[0].objects[1:])
        )
        server = asyncio.create_task(block_server(pair, serving_store([huge])).serve())
        try:
            cache = empty_cache()
            outcome = await fetcher(pair, cache, trusting(published.signer)).fetch(
                published.identities[:1], LOSSLESS[:1]
            )
        finally:
            server.cancel()
            await asyncio.gather(server, return_exceptions=True)
    assert outcome.loaded == 0 and outcome.error is not None, outcome
    assert f"object 0/0 of {15 << 20} bytes exceeds the limit of {MAX_MANIFEST_BYTES}" in outcome.error
    assert_consistent(cache, 0)


def test_a_throughput_sample_leaves_out_the_loops_own_decoding(published: Published) -> None:
    """The plan charges bytes over throughput plus each rendition's measured decode, so a sample must not
    hold the time the event loop spent decoding (no verify pool): that would charge it twice. With a pool
    the loop went on reading meanwhile, and the whole span is the sample."""
    samples = {}
    for inline in (True, False):
        times = iter([100.0, 110.0])  # the first object, then the block done 10 s later
        clock = fetching._SampleClock(decode_inline=inline, now=times.__next__)
        clock.object_arrived(1000)
        block = fetching._LoadingBlock(0, published.identities[0], "lossless", nbytes=1000, decode_s=4.0)
        clock.block_done(block, FetchOutcome())
        samples[inline] = clock.sample()
    assert samples == {True: (1000, 6.0), False: (1000, 10.0)}


@pytest.mark.parametrize("track_status", [True, False], ids=["track-status", "manifest-fetch"])
async def test_a_block_is_located_only_where_every_locate_fingerprint_has_it(
    pair: ConnectionPair, published: Published, track_status: bool
) -> None:
    """A tensor-parallel engine's scheduler locates every rank's slice (one fingerprint each): a block
    counts only when all of them are there, probed by TRACK_STATUS or by the manifest FETCH fallback."""
    server_class = BlockServer if track_status else TrackStatusRefusingServer
    server = server_class(pair.server, serving_store(published.blocks[:4]), FINGERPRINT, NAMESPACE_ID,
                          SPEC.num_layers)
    task = asyncio.create_task(server.serve())
    try:
        every = fetcher(pair, empty_cache(), trusting(published.signer),
                        locate_fingerprints=(FINGERPRINT, FINGERPRINT))
        assert (await every.locate(HASHES, ["lossless"])).available == [["lossless"]] * 4
        other_rank = bytes(32)  # a second rank whose slices nobody published
        partial = fetcher(pair, empty_cache(), trusting(published.signer),
                          locate_fingerprints=(FINGERPRINT, other_rank))
        if not track_status:
            partial.locate_probe = "fetch"  # as the first fetcher learned of this relay
        assert (await partial.locate(HASHES, ["lossless"])).available == []
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_blocks_a_publisher_digested_with_sha256_verify_and_load(
    pair: ConnectionPair, serve: Serve, published: Published
) -> None:
    """A publisher that must use a FIPS hash (``--payload-digest sha256``) signs SHA-256 digests; a
    subscriber verifies them as it does BLAKE3's, and a flipped byte is still caught."""
    blocks = encode_blocks(published.cache, published.identities, fingerprint=FINGERPRINT,
                           renditions=("lossless",), signer=published.signer, digest_algorithm="sha256")
    manifest = BlockManifest.decode(blocks[0].objects[0])
    assert (manifest.format_version, manifest.digest_algorithm) == (2, "sha256")
    good = blocks[2]
    layer_0 = bytearray(good.objects[1])
    layer_0[-1] ^= 0xFF
    bad = dataclasses.replace(good, objects=(good.objects[0], bytes(layer_0), *good.objects[2:]))
    serve([*blocks[:2], bad, *blocks[3:]])
    cache = empty_cache()
    f = fetcher(pair, cache, trusting(published.signer))
    outcome = await f.fetch(published.identities[:2], LOSSLESS[:2])
    assert (outcome.loaded, outcome.error) == (2, None)
    assert_same_kv(cache, published.cache, HASHES[:2])
    outcome = await f.fetch(published.identities, LOSSLESS)
    assert (outcome.loaded, outcome.rejected_kind) == (2, "content")
    assert outcome.error == "block 2 rejected: payload digest of layer 0 differs"
