"""Pushed blocks (``BlockServer.push``) reach a real relay's cache whole over Ethernet-sized datagrams.

A push queues every block's objects at once, so at 1452-byte datagrams the last bytes reach the relay many
seconds after the push began. The relay ends a pushed track ``publish_done_timeout`` after its PUBLISH_DONE;
a publisher that sent PUBLISH_DONE before its stream's bytes were delivered lost every block still queued
(the relay cached none of a 23 MB push).
"""

from __future__ import annotations

import torch

from kvnet.blocks.identity import prompt_blocks
from kvnet.blocks.signing import Signer, TrustStore
from kvnet.cache.hashing import block_hashes, root_hash
from kvnet.cache.paged_cache import CacheSpec, PagedKVCache
from kvnet.net.endpoint import connect
from kvnet.net.quic import TlsSettings, TransportSettings
from kvnet.node.blockstore import BlockStore
from kvnet.node.fetching import BlockFetcher
from kvnet.node.publishing import BlockServer, encode_blocks
from tests.helpers.processes import CertDir
from tests.relay.conftest import RelayFactory

LINK = "ethernet"
# 32 blocks of 16 layers of bf16 K/V (~23 MB, the data-path benchmark's prompt): crossing loopback at
# 1452-byte datagrams takes longer than the relay's wait after PUBLISH_DONE.
SPEC = CacheSpec(num_layers=16, num_kv_heads=4, head_dim=64, block_size=64, dtype=torch.bfloat16)
BLOCKS = 32
FINGERPRINT = bytes(range(32))
NAMESPACE_ID = "push"


async def test_a_push_at_ethernet_datagrams_is_cached_whole_and_served_verified(
    relay_factory: RelayFactory, cert_dir: CertDir
) -> None:
    tokens = [(7 * i + 3) % 32000 for i in range(BLOCKS * SPEC.block_size + 1)]
    root = root_hash(FINGERPRINT, b"push")
    hashes = block_hashes(tokens, SPEC.block_size, root)
    source = PagedKVCache(SPEC, num_blocks=BLOCKS, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(3)
    layer_shape = (SPEC.block_size, SPEC.num_kv_heads, SPEC.head_dim)
    for block_hash in hashes:
        assert source.begin_import(block_hash)
        for layer in range(SPEC.num_layers):
            k, v = (torch.randn(layer_shape, generator=gen).to(SPEC.dtype) for _ in range(2))
            source.import_layer(block_hash, layer, k, v)
        source.finish_import(block_hash)
    identities = prompt_blocks(tokens, SPEC.block_size, hashes, root, 0, len(hashes))
    signer = Signer.generate()
    blocks = encode_blocks(
        source, identities, fingerprint=FINGERPRINT, renditions=("lossless",), signer=signer
    )
    wire_bytes = sum(b.nbytes for b in blocks)
    cache_bytes = str(2 * wire_bytes)
    relay = relay_factory("--link", LINK, "--cache-bytes", cache_bytes, "--cache-track-bytes", cache_bytes)
    settings = TransportSettings.for_link(LINK, "aioquic")
    tls = TlsSettings(ca_file=cert_dir.ca)

    publisher = await connect(relay.url, settings, tls)
    try:
        store = BlockStore(2 * wire_bytes)
        store.put_chain(blocks)
        server = BlockServer(publisher, store, FINGERPRINT, NAMESPACE_ID, SPEC.num_layers)
        assert await server.push(blocks) == BLOCKS
        objects = BLOCKS * (SPEC.num_layers + 1)
        await relay.wait_metric("kvnet_relay_cache_objects", objects, timeout=60)
    finally:
        await publisher.close_session()  # what follows comes from the relay's cache, not the publisher

    trust = TrustStore()
    trust.add(signer.public_key)
    fetched = PagedKVCache(SPEC, num_blocks=BLOCKS, device=torch.device("cpu"))
    subscriber = await connect(relay.url, settings, tls)
    try:
        fetcher = BlockFetcher(subscriber, fetched, trust, fingerprint=FINGERPRINT, namespace_id=NAMESPACE_ID,
                               shape=SPEC.block_shape, dtype="bfloat16", timeout=60.0)
        outcome = await fetcher.fetch(identities, ["lossless"] * BLOCKS)
    finally:
        await subscriber.close_session()
    assert outcome.error is None and outcome.loaded == BLOCKS, outcome
    for block_hash in hashes:
        got, want = fetched.export_block(block_hash), source.export_block(block_hash)
        assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)
