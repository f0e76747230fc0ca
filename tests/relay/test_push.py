"""Pushed blocks (``BlockServer.push``) reach a real relay's cache whole over Ethernet-sized datagrams, and
several subscribers fetching them from the cache at once each load them verified, bit for bit.

A push queues every block's objects at once, so at 1452-byte datagrams the last bytes reach the relay many
seconds after the push began. The relay ends a pushed track ``publish_done_timeout`` after its PUBLISH_DONE;
a publisher that sent PUBLISH_DONE before its stream's bytes were delivered lost every block still queued
(the relay cached none of a 23 MB push).
"""

from __future__ import annotations

import asyncio

import torch

from kvnet.cache.paged_cache import CacheSpec, PagedKVCache
from kvnet.exchange.blockstore import BlockStore
from kvnet.exchange.fetching import BlockFetcher
from kvnet.exchange.publishing import BlockServer
from kvnet.net.config import TlsConfig, TransportConfig
from kvnet.net.connection import MoqtConnection
from kvnet.net.endpoint import connect
from kvnet.net.gso import receiver_for
from tests.helpers.connections import client_config, client_limits
from tests.helpers.processes import CertDir
from tests.helpers.prompts import SignedPrompt, signed_prompt
from tests.helpers.waiting import async_wait_until
from tests.relay.conftest import RelayFactory

LINK = "ethernet"
# 32 blocks of 16 layers of bf16 K/V (~23 MB, the data-path benchmark's prompt): crossing loopback at
# 1452-byte datagrams takes longer than the relay's wait after PUBLISH_DONE.
SPEC = CacheSpec(num_layers=16, num_kv_heads=4, head_dim=64, block_size=64, dtype=torch.bfloat16)
BLOCKS = 32
FINGERPRINT = bytes(range(32))
NAMESPACE_ID = "push"


def make_prompt(n_blocks: int) -> SignedPrompt:
    return signed_prompt(SPEC, n_blocks, fingerprint=FINGERPRINT, salt=b"push", seed=3)


async def fetch_verified(
    conn: MoqtConnection, prompt: SignedPrompt, verify_workers: int, timeout: float = 60.0
) -> PagedKVCache:
    """A verified fetch of the whole prompt into a fresh cache; asserts every block loaded."""
    fetched = PagedKVCache(SPEC, num_blocks=len(prompt.blocks), device=torch.device("cpu"))
    fetcher = BlockFetcher(conn, fetched, prompt.trust(), fingerprint=FINGERPRINT, namespace_id=NAMESPACE_ID,
                           shape=SPEC.block_shape, dtype="bfloat16", timeout=timeout,
                           verify_workers=verify_workers)
    outcome = await fetcher.fetch(prompt.identities, ["lossless"] * len(prompt.blocks))
    assert outcome.error is None and outcome.loaded == len(prompt.blocks), outcome
    return fetched


def assert_same_kv(fetched: PagedKVCache, prompt: SignedPrompt) -> None:
    for block_hash in prompt.hashes:
        got, want = fetched.export_block(block_hash), prompt.source.export_block(block_hash)
        assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)


async def test_a_push_at_ethernet_datagrams_is_cached_whole_and_served_verified(
    relay_factory: RelayFactory, cert_dir: CertDir
) -> None:
    prompt = make_prompt(BLOCKS)
    blocks, wire_bytes = prompt.blocks, prompt.wire_bytes
    cache_bytes = str(2 * wire_bytes)
    relay = relay_factory("--link", LINK, "--cache-bytes", cache_bytes, "--cache-track-bytes", cache_bytes)
    settings = client_config(TransportConfig.for_link(LINK, "aioquic"))
    tls = TlsConfig(ca_file=cert_dir.ca)

    publisher = await connect(relay.url, settings, tls, limits=client_limits())
    try:
        store = BlockStore(2 * wire_bytes)
        store.put_chain(blocks)
        server = BlockServer(publisher, store, FINGERPRINT, NAMESPACE_ID, SPEC.num_layers)
        assert await server.push(blocks) == BLOCKS
        objects = BLOCKS * (SPEC.num_layers + 1)
        await relay.wait_metric("kvnet_relay_cache_objects", objects, timeout=60)
    finally:
        await publisher.close_session()  # what follows comes from the relay's cache, not the publisher

    subscriber = await connect(relay.url, settings, tls, limits=client_limits())
    try:
        fetched = await fetch_verified(subscriber, prompt, verify_workers=2)
        # The relay's GSO sends reached the subscriber's socket whole and were cut back into datagrams.
        receiver = receiver_for(subscriber._transport)
        assert receiver is not None and receiver.coalesced_reads > 0
    finally:
        await subscriber.close_session()
    # The socket (and the receiver's duplicate of it) goes with the connection.
    await async_wait_until(lambda: receiver_for(subscriber._transport) is None, "the receiver closed")
    assert_same_kv(fetched, prompt)


async def test_concurrent_subscribers_each_load_the_cached_prompt_verified(
    relay_factory: RelayFactory, cert_dir: CertDir
) -> None:
    """Fan-out from the cache: four sessions fetch the same pushed prompt at once (two verifying on the
    event loop, two on worker threads); each loads it bit for bit and the relay never asks upstream."""
    prompt = make_prompt(8)
    cache_bytes = str(2 * prompt.wire_bytes)
    relay = relay_factory("--cache-bytes", cache_bytes, "--cache-track-bytes", cache_bytes)
    settings = client_config(TransportConfig.for_link("loopback", "aioquic"))
    tls = TlsConfig(ca_file=cert_dir.ca)
    publisher = await connect(relay.url, settings, tls, limits=client_limits())
    try:
        server = BlockServer(publisher, BlockStore(2 * prompt.wire_bytes), FINGERPRINT, NAMESPACE_ID,
                             SPEC.num_layers)
        assert await server.push(prompt.blocks) == len(prompt.blocks)
        await relay.wait_metric("kvnet_relay_cache_objects", len(prompt.blocks) * (SPEC.num_layers + 1))
    finally:
        await publisher.close_session()
    misses = (await relay.ametrics()).get("kvnet_relay_cache_misses_total", 0.0)
    subscribers = [await connect(relay.url, settings, tls, limits=client_limits()) for _ in range(4)]
    try:
        fetched = await asyncio.gather(
            *(fetch_verified(conn, prompt, verify_workers=2 * (i % 2)) for i, conn in enumerate(subscribers))
        )
    finally:
        for conn in subscribers:
            await conn.close_session()
    for cache in fetched:
        assert_same_kv(cache, prompt)
    after = await relay.ametrics()
    assert after.get("kvnet_relay_cache_misses_total", 0.0) == misses
    assert after["kvnet_relay_bytes_out_total"] >= 4 * prompt.wire_bytes
