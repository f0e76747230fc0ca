"""Where a vLLM worker's fetched blocks land: ``EngineCache`` writes verified layers into vLLM's paged KV
tensors, and fills the engine blocks of concurrent loads of the same block from one fetch.

Each load registers the engine blocks vLLM allocated for its block hashes while it runs. Two requests
loading the same prefix at once get different engine blocks; the connector fetches each hash once (the
worker's claims, ``kvnet.integrations.vllm``) and this cache puts the one verified block into every engine
block registered for it: the blocks registered when its import began get each layer as it is verified, and
``share`` copies the whole block into blocks registered later. ``holds`` says which engine blocks hold
their block, so a load knows what it got. On the CPU each layer is written at once; on CUDA (``staged``) a
block is assembled in a pinned host buffer and copied into the blocks registered when it is complete, on
the load stream, so no thread but the engine's writes on its stream (``share`` copies nothing there: a
load registered later fetches the block itself).
This module knows nothing about vLLM's classes or the network.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvnet.integrations.cpu_layout import CpuBlockLayout
from kvnet.integrations.device_path import StagedLoads
from kvnet.integrations.paged_layout import PagedLayerLayout
from kvnet.integrations.relay_link import ConnectorCounters


class EngineCache:
    """``CacheWriter`` (``kvnet.exchange.fetching``) into vLLM's paged KV tensors (see the module doc)."""

    def __init__(self, counters: ConnectorCounters) -> None:
        self.counters = counters
        self.layout: CpuBlockLayout | PagedLayerLayout | None = None
        self.layers: Sequence[torch.Tensor] = ()
        self.staged: StagedLoads | None = None
        self.targets: dict[bytes, list[int]] = {}
        """Engine blocks the running loads want each block hash in."""
        self.importing: dict[bytes, list[int]] = {}
        """(CPU) The engine blocks each running import writes its layers into: those registered at its start
        (a block registered later would miss the layers written before)."""
        self.holding: dict[bytes, set[int]] = {}
        """Engine blocks, among those registered, that hold their verified block."""

    def register(self, hashes: Sequence[bytes], block_ids: Sequence[int]) -> None:
        for block_hash, block_id in zip(hashes, block_ids, strict=True):
            self.targets.setdefault(block_hash, []).append(block_id)

    def unregister(self, hashes: Sequence[bytes], block_ids: Sequence[int]) -> None:
        """Forget a load's blocks: vLLM may reuse them once the load is reported, so nothing still running
        for another load may write there or copy from there."""
        for block_hash, block_id in zip(hashes, block_ids, strict=True):
            for blocks in (self.targets.get(block_hash), self.importing.get(block_hash)):
                if blocks is not None and block_id in blocks:
                    blocks.remove(block_id)
            holding = self.holding.get(block_hash)
            if holding is not None:
                holding.discard(block_id)
            if not self.targets.get(block_hash):
                self.targets.pop(block_hash, None)
                self.holding.pop(block_hash, None)

    def holds(self, block_hash: bytes, block_id: int) -> bool:
        return block_id in self.holding.get(block_hash, ())

    def share(self, block_hash: bytes) -> None:
        """Copy a verified block into the engine blocks registered for it that do not hold it yet (on the CPU;
        on CUDA those blocks' loads fetch it themselves)."""
        holding = self.holding.get(block_hash)
        if not holding or self.staged is not None:
            return
        assert self.layout is not None
        source = next(iter(holding))
        late = [block_id for block_id in self.targets.get(block_hash, ()) if block_id not in holding]
        if not late:
            return
        for layer in self.layers:
            k, v = self.layout.read(layer, source)
            for block_id in late:
                self.layout.write(layer, block_id, k, v)
        holding.update(late)
        self.counters.blocks_shared += len(late)

    # -- CacheWriter --------------------------------------------------------------------------------

    def begin_import(self, block_hash: bytes) -> bool:
        targets = self.targets.get(block_hash)
        if not targets:
            return False
        if self.staged is not None:
            self.staged.begin(block_hash)
        else:
            self.importing[block_hash] = list(targets)
        return True

    def import_layer(self, block_hash: bytes, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.staged is not None:
            self.staged.layer(block_hash, layer, k, v)
            return
        assert self.layout is not None
        for block_id in self.importing.get(block_hash, ()):
            self.layout.write(self.layers[layer], block_id, k, v)

    def finish_import(self, block_hash: bytes) -> None:
        if self.staged is not None:
            written = list(self.targets.get(block_hash, ()))
            self.staged.finish(block_hash, written)
        else:
            written = self.importing.pop(block_hash, [])
        self.counters.blocks_fetched += 1
        if written:
            self.holding.setdefault(block_hash, set()).update(written)
            self.counters.blocks_shared += len(written) - 1

    def abort_import(self, block_hash: bytes) -> None:
        # Reported as a load error: vLLM recomputes the block.
        self.importing.pop(block_hash, None)
        if self.staged is not None:
            self.staged.abort(block_hash)
