"""One fetched block into the engine blocks of every load that wants it (``kvnet.integrations.engine_cache``).

Loads of the same prefix by concurrent requests register different engine blocks for the same hash; one
import must fill all of them, a load registered part way through an import must get the whole block (never
only the layers written after it came), and a load that went away must not be written into.
"""

from __future__ import annotations

import torch

from kvnet.integrations.cpu_layout import VecLayout
from kvnet.integrations.engine_cache import EngineCache
from kvnet.integrations.relay_link import ConnectorCounters

LAYERS, BLOCKS, HEADS, BLOCK, HEAD = 3, 6, 2, 16, 8
HASH = b"h" * 32


def engine_cache() -> EngineCache:
    cache = EngineCache(ConnectorCounters())
    cache.layout = VecLayout(HEADS, BLOCK, HEAD)
    cache.layers = [torch.zeros(BLOCKS, HEADS, BLOCK, 2 * HEAD) for _ in range(LAYERS)]
    return cache


def verified_layers() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    shape = (BLOCK, HEADS, HEAD)
    return [
        (torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
        for _ in range(LAYERS)
    ]


def holds_block(cache: EngineCache, block_id: int, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    assert cache.layout is not None
    read = [cache.layout.read(layer, block_id) for layer in cache.layers]
    pairs = zip(layers, read, strict=True)
    return all(torch.equal(k, rk) and torch.equal(v, rv) for (k, v), (rk, rv) in pairs)


def test_loads_registered_before_the_import_all_get_it_from_one_fetch() -> None:
    cache, layers = engine_cache(), verified_layers()
    cache.register([HASH], [1])
    cache.register([HASH], [4])
    assert cache.begin_import(HASH)
    for i, (k, v) in enumerate(layers):
        cache.import_layer(HASH, i, k, v)
    cache.finish_import(HASH)
    assert cache.holds(HASH, 1) and cache.holds(HASH, 4)
    assert holds_block(cache, 1, layers) and holds_block(cache, 4, layers)
    assert cache.counters.blocks_fetched == 1 and cache.counters.blocks_shared == 1


def test_a_load_registered_during_the_import_gets_the_whole_block_shared() -> None:
    cache, layers = engine_cache(), verified_layers()
    cache.register([HASH], [1])
    assert cache.begin_import(HASH)
    cache.import_layer(HASH, 0, *layers[0])
    cache.register([HASH], [4])  # a concurrent request's load, after layer 0 was written
    for i, (k, v) in enumerate(layers[1:], start=1):
        cache.import_layer(HASH, i, k, v)
    cache.finish_import(HASH)
    assert cache.holds(HASH, 1) and not cache.holds(HASH, 4)  # it missed layer 0: not counted as in
    cache.share(HASH)
    assert cache.holds(HASH, 4) and holds_block(cache, 4, layers)
    assert cache.counters.blocks_fetched == 1 and cache.counters.blocks_shared == 1


def test_a_load_that_ended_is_not_written_into() -> None:
    cache, layers = engine_cache(), verified_layers()
    cache.register([HASH], [1])
    cache.register([HASH], [4])
    assert cache.begin_import(HASH)
    cache.unregister([HASH], [4])  # reported to vLLM: the block may be reused
    for i, (k, v) in enumerate(layers):
        cache.import_layer(HASH, i, k, v)
    cache.finish_import(HASH)
    assert torch.count_nonzero(torch.stack([layer[4] for layer in cache.layers])) == 0
    assert not cache.holds(HASH, 4) and holds_block(cache, 1, layers)
    cache.unregister([HASH], [1])
    assert not cache.begin_import(HASH)  # nobody wants it any more
