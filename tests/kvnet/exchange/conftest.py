"""Fixtures for the node's role code: real blocks in a real paged cache, signed and encoded as a publisher
would, and two real MoQT connections joined in memory (``tests.helpers.connections``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kvnet.blocks.identity import BlockIdentity, prompt_blocks
from kvnet.cache.hashing import block_hashes, root_hash
from kvnet.cache.paged_cache import CacheSpec, PagedKVCache
from kvnet.exchange.blockstore import BlockStore, StoredBlock
from kvnet.exchange.publishing import BlockServer, encode_blocks
from kvnet.security.signing import Signer, TrustStore
from tests.helpers.connections import ConnectionPair, connection_pair
from tests.helpers.processes import CertDir, make_certificates

SPEC = CacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
FINGERPRINT = bytes(range(32))
NAMESPACE_ID = "tenant-ns"
ROOT = root_hash(FINGERPRINT, b"salt")
TOKENS = [(7 * i + 3) % 251 for i in range(6 * SPEC.block_size + 1)]
"""A prompt of six full blocks (plus the token that is always computed)."""
HASHES = block_hashes(TOKENS, SPEC.block_size, ROOT)


@dataclass
class Published:
    """What a publisher computed and serves: its cache, the prompt's blocks and their encoded objects."""

    cache: PagedKVCache
    identities: list[BlockIdentity]
    blocks: list[StoredBlock]
    """One lossless entry per block, in chain order."""
    signer: Signer


def fill_cache(cache: PagedKVCache, hashes: list[bytes], seed: int) -> None:
    """Random K/V for ``hashes`` imported into ``cache`` (the import path a fetch uses, minus the network)."""
    gen = torch.Generator().manual_seed(seed)
    layer_shape = (SPEC.block_size, SPEC.num_kv_heads, SPEC.head_dim)
    for block_hash in hashes:
        assert cache.begin_import(block_hash)
        for layer in range(SPEC.num_layers):
            cache.import_layer(block_hash, layer, torch.randn(layer_shape, generator=gen),
                               torch.randn(layer_shape, generator=gen))
        cache.finish_import(block_hash)


@pytest.fixture(scope="module")
def published() -> Published:
    cache = PagedKVCache(SPEC, num_blocks=16, device=torch.device("cpu"))
    fill_cache(cache, HASHES, seed=1)
    identities = prompt_blocks(TOKENS, SPEC.block_size, HASHES, ROOT, 0, len(HASHES))
    signer = Signer.generate()
    blocks = encode_blocks(
        cache, identities, fingerprint=FINGERPRINT, renditions=("lossless",), signer=signer
    )
    assert [b.block_hash for b in blocks] == HASHES
    return Published(cache, identities, blocks, signer)


@pytest.fixture(scope="module")
def plain_published(published: Published) -> Published:
    """The same blocks in the ``plain`` rendition."""
    blocks = encode_blocks(
        published.cache, published.identities, fingerprint=FINGERPRINT, renditions=("plain",),
        signer=published.signer,
    )
    return Published(published.cache, published.identities, blocks, published.signer)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertDir:
    directory: Path = tmp_path_factory.mktemp("certs")
    return make_certificates(directory, "server")


@pytest.fixture
async def pair(certs: CertDir) -> AsyncIterator[ConnectionPair]:
    async with connection_pair(certs) as joined:
        yield joined


def serving_store(blocks: list[StoredBlock]) -> BlockStore:
    store = BlockStore(64 << 20)
    store.put_chain(blocks)
    return store


def block_server(pair: ConnectionPair, store: BlockStore) -> BlockServer:
    """A block server on the pair's server side (answering the client's requests directly)."""
    return BlockServer(pair.server, store, FINGERPRINT, NAMESPACE_ID, SPEC.num_layers)


def trusting(signer: Signer) -> TrustStore:
    trust = TrustStore()
    trust.add(signer.public_key)
    return trust
