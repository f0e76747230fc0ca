"""Cache writers for fetch tests and benchmarks that take the paths a node's own paged cache does not."""

from __future__ import annotations

import torch

from kvnet.cache.paged_cache import PagedKVCache


class TensorsOnlyCache:
    """A ``CacheWriter`` over a paged cache that lends no slots (as vLLM's writer does not): the fetcher
    decodes each layer into new tensors and the cache copies them in."""

    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache

    def begin_import(self, block_hash: bytes) -> bool:
        return self.cache.begin_import(block_hash)

    def import_layer(self, block_hash: bytes, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.cache.import_layer(block_hash, layer, k, v)

    def finish_import(self, block_hash: bytes) -> object:
        return self.cache.finish_import(block_hash)

    def abort_import(self, block_hash: bytes) -> None:
        self.cache.abort_import(block_hash)
