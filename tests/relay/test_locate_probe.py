"""A node's locate probe through kvnet-relay (``kvnet.exchange.fetching.BlockFetcher.locate`` with FETCHes of
manifests, the fallback for relays that do not forward TRACK_STATUS): every FETCH it starts is read to its
end, never cancelled once the relay took it on. A relay that serves such a FETCH by pulling the block
upstream would otherwise be left holding a cut-short block. A relay in the test's own process
(``tests.relay.inprocess``), real QUIC on loopback, a real block server behind the relay."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import torch

from kvnet.cache.paged_cache import CacheSpec, PagedKVCache
from kvnet.exchange.blockstore import BlockStore
from kvnet.exchange.fetching import BlockFetcher
from kvnet.exchange.publishing import BlockServer
from kvnet.net.connection import MoqtConnection
from tests.helpers.processes import CertDir
from tests.helpers.prompts import SignedPrompt, signed_prompt
from tests.helpers.waiting import async_wait_until
from tests.relay.inprocess import InProcessRelay, relay_in_process
from tests.relay.peers import connect_client

SPEC = CacheSpec(num_layers=4, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.bfloat16)
BLOCKS = 8
FINGERPRINT = bytes(range(32))
NAMESPACE_ID = "probe"


def _fetches(relay: InProcessRelay, outcome: str) -> float:
    """FETCHes the relay counted as ended with ``outcome``."""
    return relay.value("requests_total", outcome=outcome, type="fetch")


async def test_manifest_probes_are_read_to_their_end_not_cancelled(cert_dir: CertDir) -> None:
    prompt = signed_prompt(SPEC, BLOCKS, fingerprint=FINGERPRINT, salt=b"probe", seed=3)
    async with relay_in_process(cert_dir) as relay:
        await _probe_then_fetch(relay, cert_dir, prompt)


async def _probe_then_fetch(relay: InProcessRelay, cert_dir: CertDir, prompt: SignedPrompt) -> None:
    pub_conn: MoqtConnection = await connect_client(relay.url, str(cert_dir.ca))
    sub_conn: MoqtConnection = await connect_client(relay.url, str(cert_dir.ca))
    store = BlockStore(4 * prompt.wire_bytes)
    store.put_chain(prompt.blocks)
    server = BlockServer(pub_conn, store, FINGERPRINT, NAMESPACE_ID, SPEC.num_layers)
    serving = asyncio.ensure_future(server.serve())
    try:
        await server.announce()
        cache = PagedKVCache(SPEC, num_blocks=BLOCKS, device=torch.device("cpu"))
        fetcher = BlockFetcher(sub_conn, cache, prompt.trust(), fingerprint=FINGERPRINT,
                               namespace_id=NAMESPACE_ID, shape=SPEC.block_shape, dtype="bfloat16",
                               timeout=30.0)
        fetcher.locate_probe = "fetch"  # as on a session whose relay does not forward TRACK_STATUS
        cancelled: list[int] = []
        cancel_request = sub_conn.cancel_request

        def recording_cancel(request_id: int, *args: Any) -> None:
            cancelled.append(request_id)
            cancel_request(request_id, *args)

        setattr(sub_conn, "cancel_request", recording_cancel)  # noqa: B010 (the handles call the instance's)
        began = time.perf_counter()
        located = await fetcher.locate(prompt.hashes, ["lossless"])
        located_at = time.perf_counter()
        assert len(located.available) == BLOCKS, located
        ended = ("miss", "coalesced", "cache_hit", "cancelled")
        await async_wait_until(
            lambda: sum(_fetches(relay, o) for o in ended) >= located.probes,
            "every probe FETCH ended at the relay",
        )
        probe_outcomes = {o: _fetches(relay, o) for o in ended}
        setattr(sub_conn, "cancel_request", cancel_request)  # noqa: B010 (the fetch below ends its own)
        outcome = await fetcher.fetch(prompt.identities, ["lossless"] * BLOCKS)
        fetched_at = time.perf_counter()
        assert outcome.error is None and outcome.loaded == BLOCKS, outcome
        # The figures the probe is measured by (pytest -s shows them).
        print(f"probe FETCHes {located.probes}: locate {located_at - began:.3f} s, then full fetch "
              f"{fetched_at - located_at:.3f} s; relay outcomes of the probes {probe_outcomes}")
        assert cancelled == []  # no probe of ours was cancelled
        assert probe_outcomes["cancelled"] == 0
    finally:
        serving.cancel()
        for conn in (pub_conn, sub_conn):
            await conn.close_session()
