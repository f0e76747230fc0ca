"""kvtc's decoder tables over MoQT (``kvnet.exchange.tables.TablesSource``): a fetcher that meets a ``kvtc``
block fetches the tables it names once from the publisher's tables track, verifies them and decodes with
them; tables that fail verification are refused in one line and the cache is left as it was."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from kvnet.blocks.codecs import CodecError
from kvnet.blocks.kvtc_entropy import EntropyProcesses
from kvnet.blocks.transform_codec import TransformCodec
from kvnet.blocks.transform_tables import TransformTables, calibrate, sign_tables
from kvnet.cache.paged_cache import PagedKVCache
from kvnet.exchange import fetching
from kvnet.exchange.blockstore import StoredBlock
from kvnet.exchange.fetching import BlockFetcher
from kvnet.exchange.publishing import BlockServer, encode_block, encode_blocks
from kvnet.exchange.tables import MAX_FETCHES_IN_FLIGHT, TablesSource
from kvnet.net.handles import IncomingFetch
from kvnet.security.signing import Signer
from proto.kvobject import BLOCK_GROUP_ID, TABLES_CHUNK_BYTES, tables_chunks
from proto.messages import Location
from tests.helpers.connections import ConnectionPair
from tests.helpers.waiting import async_wait_until
from tests.kvnet.exchange.conftest import (
    FINGERPRINT,
    HASHES,
    NAMESPACE_ID,
    SPEC,
    Published,
    serving_store,
    trusting,
)

OTHER_MODEL = bytes(range(1, 33))


def calibrated(fingerprint: bytes = FINGERPRINT) -> TransformTables:
    """Tables for the test cache's shape from K/V like the blocks' (random), on other draws: enough
    tokens that layers 1 and 2 are predicted from the layer before."""
    g = torch.Generator().manual_seed(7)
    shape = (SPEC.num_layers, 512, SPEC.num_kv_heads, SPEC.head_dim)
    return calibrate(torch.randn(shape, generator=g), torch.randn(shape, generator=g), fingerprint, 0.02)


def kvtc_blocks(published: Published, tables: TransformTables) -> list[StoredBlock]:
    return encode_blocks(published.cache, published.identities, fingerprint=FINGERPRINT, renditions=("kvtc",),
                         signer=published.signer, tables=tables)


class Served:
    """A block server on the pair's server side holding kvtc blocks and the tables objects given."""

    def __init__(self, pair: ConnectionPair) -> None:
        self.pair = pair
        self.server: BlockServer | None = None
        self.task: asyncio.Task[None] | None = None

    def start(self, blocks: list[StoredBlock], tables: dict[bytes, tuple[bytes, ...]]) -> BlockServer:
        self.server = BlockServer(self.pair.server, serving_store(blocks), FINGERPRINT, NAMESPACE_ID,
                                  SPEC.num_layers, tables=tables)
        self.task = asyncio.create_task(self.server.serve())
        return self.server


@pytest.fixture
async def served(pair: ConnectionPair) -> AsyncIterator[Served]:
    s = Served(pair)
    yield s
    if s.task is not None:
        s.task.cancel()
        await asyncio.gather(s.task, return_exceptions=True)


def fetcher(pair: ConnectionPair, published: Published, cache: PagedKVCache,
            tables: TablesSource | None = None, verify_workers: int = 0) -> BlockFetcher:
    return BlockFetcher(pair.client, cache, trusting(published.signer), fingerprint=FINGERPRINT,
                        namespace_id=NAMESPACE_ID, shape=SPEC.block_shape, dtype="float32", tables=tables,
                        verify_workers=verify_workers)


def empty_cache() -> PagedKVCache:
    return PagedKVCache(SPEC, num_blocks=16, device=torch.device("cpu"))


@pytest.mark.parametrize(("verify_workers", "layers_per_task", "processes"),
                         [(0, 16, 0), (1, 1, 0), (3, 1, 0), (2, 2, 0), (0, 16, 2), (0, 1, 2), (1, 2, 1)])
async def test_kvtc_blocks_fetch_their_tables_once_and_load_what_the_publisher_coded(
    pair: ConnectionPair, served: Served, published: Published, verify_workers: int, layers_per_task: int,
    processes: int, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Layers predicted from the layer before decode in order wherever they are decoded: on the event
    loop, or on worker threads where a block's layers are split across tasks (each waits for the last
    layer of the task before it, and entropy-decodes its own meanwhile), their entropy decoding in the
    calling thread or on entropy processes (a fetcher that decodes on its event loop otherwise then
    hands kvtc layers to a thread per process)."""
    monkeypatch.setattr(fetching, "LAYERS_PER_TASK", layers_per_task)
    entropy = EntropyProcesses(processes) if processes else None
    try:
        await _fetch_kvtc_twice(pair, served, published, entropy, verify_workers)
        assert entropy is None or entropy.tasks_decoded >= len(HASHES)  # every block's task, in the workers
    finally:
        if entropy is not None:
            entropy.close()


async def _fetch_kvtc_twice(pair: ConnectionPair, served: Served, published: Published,
                            entropy: EntropyProcesses | None, verify_workers: int) -> None:
    tables = calibrated()
    assert tables.predicted_layers == (False, True, True)
    signed = sign_tables(tables, published.signer)
    blocks = kvtc_blocks(published, tables)
    server = served.start(blocks, {tables.digest: tables_chunks(signed)})
    source = TablesSource(trusting(published.signer), FINGERPRINT, NAMESPACE_ID, entropy=entropy)
    cache = empty_cache()
    f = fetcher(pair, published, cache, source, verify_workers)
    outcome = await f.fetch(published.identities, ["kvtc"] * len(HASHES))
    assert (outcome.loaded, outcome.error, outcome.renditions) == (len(HASHES), None, {"kvtc": len(HASHES)})
    assert (source.stats.fetched, source.stats.fetched_bytes, source.stats.refused) == (1, len(signed), 0)
    # What the cache holds is exactly the publisher's payloads decoded (same function, same shapes), and
    # near the publisher's K/V (the rendition is lossy).
    reference = TransformCodec(FINGERPRINT)
    reference.install(tables)
    for block in blocks:
        got = cache.export_block(block.block_hash)
        want = published.cache.export_block(block.block_hash)
        decoded = reference.decode_block(block.objects[1:], SPEC.block_shape[1:], torch.float32)
        for layer, (k, v) in enumerate(decoded):
            assert torch.equal(got.k[layer], k) and torch.equal(got.v[layer], v)
        assert float((got.k - want.k).abs().max()) < 0.5 * float(want.k.abs().max())
    # A second request needs no second tables fetch.
    fetched_before = server.stats.fetches_served
    f = fetcher(pair, published, empty_cache(), source)
    again = await f.fetch(published.identities[:2], ["kvtc"] * 2)
    assert (again.loaded, source.stats.fetched) == (2, 1)
    assert server.stats.fetches_served == fetched_before + 2  # the two blocks only


async def test_concurrent_requests_for_one_digest_share_one_fetch_of_every_piece(
    pair: ConnectionPair, served: Served, published: Published
) -> None:
    """Four requests, one FETCH; the tables arrive in many objects (pieces of 1,000 bytes here, of
    ``TABLES_CHUNK_BYTES`` from a node) and are joined in order."""
    tables = calibrated()
    signed = sign_tables(tables, published.signer)
    pieces = tuple(signed[i:i + 1000] for i in range(0, len(signed), 1000))
    assert len(pieces) > 3 and len(tables_chunks(signed)) == -(-len(signed) // TABLES_CHUNK_BYTES)
    server = served.start([], {tables.digest: pieces})
    source = TablesSource(trusting(published.signer), FINGERPRINT, NAMESPACE_ID)
    got = await asyncio.gather(*(source.resolve(pair.client, tables.digest) for _ in range(4)))
    assert all(t.digest == tables.digest for t in got)
    assert (source.stats.fetched, server.stats.fetches_served) == (1, 1)


async def test_tables_fetched_once_are_kept_in_the_directory_for_the_next_process(
    pair: ConnectionPair, served: Served, published: Published, tmp_path: Path
) -> None:
    """A restarted node reads its tables from the directory (on a thread) instead of fetching them; a
    stored copy altered on disk no longer verifies, so it is fetched again and replaced."""
    tables = calibrated()
    server = served.start([], {tables.digest: tables_chunks(sign_tables(tables, published.signer))})
    trust = trusting(published.signer)
    first = TablesSource(trust, FINGERPRINT, NAMESPACE_ID, directory=tmp_path)
    await first.resolve(pair.client, tables.digest)
    restarted = TablesSource(trust, FINGERPRINT, NAMESPACE_ID, directory=tmp_path)
    assert (await restarted.resolve(pair.client, tables.digest)).digest == tables.digest
    assert (first.stats.fetched, restarted.stats.fetched, server.stats.fetches_served) == (1, 0, 1)
    (stored,) = tmp_path.iterdir()
    data = bytearray(stored.read_bytes())
    data[len(data) // 2] ^= 1
    stored.write_bytes(bytes(data))
    altered = TablesSource(trust, FINGERPRINT, NAMESPACE_ID, directory=tmp_path)
    assert (await altered.resolve(pair.client, tables.digest)).digest == tables.digest
    assert (altered.stats.fetched, server.stats.fetches_served) == (1, 2)
    again = TablesSource(trust, FINGERPRINT, NAMESPACE_ID, directory=tmp_path)
    assert (await again.resolve(pair.client, tables.digest)).digest == tables.digest
    assert again.stats.fetched == 0


async def test_tables_keep_arriving_after_the_request_that_asked_gave_up(
    pair: ConnectionPair, served: Served, published: Published
) -> None:
    """A request whose deadline passes stops waiting; the tables fetch goes on, so on a link too slow to
    bring them within one request's deadline the next request still finds them."""
    tables = calibrated()
    signed = sign_tables(tables, published.signer)
    server = HeldTablesServer(pair.server, serving_store([]), FINGERPRINT, NAMESPACE_ID, SPEC.num_layers,
                              tables={tables.digest: tables_chunks(signed)})
    serving = asyncio.create_task(server.serve())
    source = TablesSource(trusting(published.signer), FINGERPRINT, NAMESPACE_ID)
    request = asyncio.create_task(source.resolve(pair.client, tables.digest))
    try:
        await async_wait_until(lambda: server.held, "the tables FETCH to reach the publisher")
        request.cancel()  # the request gives up while its tables are still on the way
        await asyncio.gather(request, return_exceptions=True)
        server.release.set()
        await async_wait_until(lambda: source.installed(tables.digest), "the tables to arrive anyway")
        assert source.stats.fetched == 1 and request.cancelled()
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)


class HeldTablesServer(BlockServer):
    """Answers each FETCH only once ``release`` is set (a slow link, made deterministic)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.release = asyncio.Event()
        self.held = 0

    async def _serve_fetch(self, req: IncomingFetch) -> None:
        self.held += 1
        await self.release.wait()
        await super()._serve_fetch(req)


async def test_a_tables_track_longer_than_its_header_allows_is_refused_as_it_arrives(
    pair: ConnectionPair, served: Served, published: Published
) -> None:
    tables = calibrated()
    pieces = tables_chunks(sign_tables(tables, published.signer))
    served.start([], {tables.digest: (*pieces, bytes(4096), bytes(4096))})
    source = TablesSource(trusting(published.signer), FINGERPRINT, NAMESPACE_ID)
    with pytest.raises(CodecError, match="bytes its header allows"):
        await source.resolve(pair.client, tables.digest)
    assert (source.stats.fetched, source.stats.refused) == (0, 1)


class SilentTablesServer(BlockServer):
    """Accepts every tables FETCH and sends nothing (a peer that holds fetches open)."""

    held = 0

    async def _serve_fetch(self, req: IncomingFetch) -> None:
        self.held += 1
        req.accept_fetch(True, Location(BLOCK_GROUP_ID, 1))
        await asyncio.Event().wait()  # until the fetch is cancelled


async def test_tables_fetches_in_flight_are_bounded(pair: ConnectionPair, published: Published) -> None:
    """A publisher that names a new digest in every block cannot make a node fetch many tables at once."""
    server = SilentTablesServer(pair.server, serving_store([]), FINGERPRINT, NAMESPACE_ID, SPEC.num_layers)
    task = asyncio.create_task(server.serve())
    source = TablesSource(trusting(published.signer), FINGERPRINT, NAMESPACE_ID, timeout=60)
    waiting = [asyncio.create_task(source.resolve(pair.client, bytes([i]) * 32))
               for i in range(MAX_FETCHES_IN_FLIGHT)]
    try:
        await async_wait_until(lambda: server.held == MAX_FETCHES_IN_FLIGHT, "every allowed fetch to start")
        with pytest.raises(CodecError, match="other tables are being fetched"):
            await source.resolve(pair.client, bytes([99]) * 32)
    finally:
        for t in (*waiting, task):
            t.cancel()
        await asyncio.gather(*waiting, task, return_exceptions=True)


@pytest.mark.parametrize("fault", ["untrusted key", "another model", "not served"])
async def test_tables_that_cannot_be_verified_end_the_prefix_in_one_line(
    pair: ConnectionPair, served: Served, published: Published, fault: str
) -> None:
    """The blocks are signed by a trusted key, but their tables are signed by a stranger, calibrated for
    another model (served under this model's name), or not served at all: nothing is loaded, the cache is
    left as it was, and a refused digest is not fetched again."""
    tables = calibrated(OTHER_MODEL if fault == "another model" else FINGERPRINT)
    signer = Signer.generate() if fault == "untrusted key" else published.signer
    signed = tables_chunks(sign_tables(tables, signer))
    served_tables = {} if fault == "not served" else {tables.digest: signed}
    # A trusted publisher's blocks that name those tables (the encoder codes with whatever it is given).
    blocks = kvtc_blocks(published, tables)
    server = served.start(blocks, served_tables)
    source = TablesSource(trusting(published.signer), FINGERPRINT, NAMESPACE_ID)
    cache = empty_cache()
    outcome = await fetcher(pair, published, cache, source).fetch(published.identities[:3], ["kvtc"] * 3)
    assert outcome.loaded == 0 and outcome.error is not None
    assert "kvtc tables" in outcome.error and "\n" not in outcome.error
    expected = {"untrusted key": "signature", "another model": "bound to model", "not served": "fetch failed"}
    assert expected[fault] in outcome.error
    stats = cache.stats()
    assert stats.pending_imports == 0 and stats.free_blocks == stats.num_blocks
    assert source.stats.fetched == 0 and source.stats.refused == (0 if fault == "not served" else 1)
    if fault != "not served":
        served_before = server.stats.fetches_served
        with pytest.raises(CodecError, match="refused"):
            await source.resolve(pair.client, tables.digest)
        assert server.stats.fetches_served == served_before


def test_a_block_kvtc_cannot_code_goes_out_in_its_other_renditions(
    published: Published, caplog: pytest.LogCaptureFixture
) -> None:
    """A block whose values lie far outside what the tables were calibrated on (here a million times) is
    not published as kvtc, rather than as clamped, wrong KV; its lossless rendition still is."""
    tables = calibrated()
    kv = published.cache.export_block(published.identities[1].block_hash)
    src = published.identities[1]
    out = encode_block(kv.k * 1e6, kv.v, src, fingerprint=FINGERPRINT, renditions=("lossless", "kvtc"),
                       signer=published.signer, tables=tables)
    assert [b.rendition for b in out] == ["lossless"]
    (record,) = [r for r in caplog.records if "not published as kvtc" in r.getMessage()]
    assert "beyond the coder's" in record.getMessage() and "\n" not in record.getMessage()


async def test_a_publisher_without_tables_cannot_publish_kvtc(published: Published) -> None:
    with pytest.raises(CodecError, match="needs the model's tables"):
        encode_blocks(published.cache, published.identities[:1], fingerprint=FINGERPRINT,
                      renditions=("kvtc",), signer=published.signer)


def test_importance_sets_each_tokens_steps_in_the_published_kvtc_blocks(published: Published) -> None:
    """``encode_blocks`` with the attention each token of the sequence gets codes the tokens that get the
    most finer and those that get the least coarser, each block its own slice of the sequence."""
    tables = calibrated()
    b, layers = SPEC.block_size, SPEC.num_layers
    importance = torch.ones(layers, len(published.identities) * b)
    favoured, neglected = 1, 2  # two tokens of the second block
    importance[:, b + favoured], importance[:, b + neglected] = 2.0**8, 2.0**-8
    uniform = kvtc_blocks(published, tables)
    weighted = encode_blocks(published.cache, published.identities, fingerprint=FINGERPRINT,
                             renditions=("kvtc",), signer=published.signer, tables=tables,
                             importance=importance)
    assert weighted[0].objects[1:] == uniform[0].objects[1:]  # no token of the first block moved
    assert weighted[1].objects[1:] != uniform[1].objects[1:]
    codec = TransformCodec(FINGERPRINT)
    codec.install(tables)
    shape = (b, SPEC.num_kv_heads, SPEC.head_dim)
    exact = published.cache.export_block(published.identities[1].block_hash)
    errors = {}
    for name, stored in (("uniform", uniform[1]), ("weighted", weighted[1])):
        decoded = codec.decode_block(list(stored.objects[1:]), shape, SPEC.dtype)
        err = torch.stack([(k.float() - exact.k[layer].float()).reshape(b, -1).norm(dim=1)
                           for layer, (k, _) in enumerate(decoded)])  # [L, b]
        bound = tables.step[:, 0].norm(dim=1)[:, None] / 2 * 1.001
        scale = torch.ones(b)
        if name == "weighted":  # two halvings finer and coarser: the default span
            scale[favoured], scale[neglected] = 0.25, 4.0
        assert bool((err <= bound * scale).all()), name
        errors[name] = err.sum(0)
    assert float(errors["weighted"][favoured]) < float(errors["uniform"][favoured])
    assert float(errors["weighted"][neglected]) > float(errors["uniform"][neglected])
