"""Paged KV cache: the K/V tensors of all layers, per-sequence block tables, and block transfer.

Owns the preallocated K/V storage (``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]`` per
K and V, on any ``torch.device``), a ``BlockPool`` for the block metadata, and the block table of every
live sequence. The model reaches it through one narrow seam (gpt-fast style):

* ``write(layer, slot_mapping, k, v)`` stores the new tokens' K/V at physical slots
  (``slot = block_id * block_size + offset``), and
* ``gather(layer, block_table, num_tokens)`` returns a sequence's K/V as contiguous ``[T, H_kv, D]``.

It knows nothing about attention math, tokens' meaning, codecs or the network: hashes arrive from the
caller (``kvnet.cache.hashing``) and blocks leave/arrive as ``BlockKV`` tensors through the transfer API.

Typical prefill of one sequence::

    hashes = block_hashes(prompt, spec.block_size, root)
    cached = cache.add_sequence(seq_id, prompt, hashes)     # shares the cached prefix blocks
    slots = cache.append_slots(seq_id, len(prompt) - cached)  # positions cached .. len(prompt)-1
    for layer ...: cache.write(layer, slots, k, v); k_all, v_all = cache.gather(
        layer, cache.block_table(seq_id), cache.num_tokens(seq_id))
    cache.commit_full_blocks(seq_id, hashes)                # publish the new full blocks
    ...
    cache.free_sequence(seq_id)                             # blocks stay cached until evicted

Incremental import protocol (a subscriber loads layer 0 before layer N has arrived):

1. ``begin_import(block_hash)`` reserves a block (held by the import, invisible to ``add_sequence``);
   returns False when the hash is already cached or being imported, in which case nothing is reserved.
2. ``import_layer(block_hash, layer, k, v)`` once per layer, in any order, ``k, v: [block_size, H_kv, D]``;
   or ``import_layer_with(block_hash, layer, write)``, where ``write`` fills the layer's slots in place
   (a decoder writing straight into the cache).
3. ``finish_import(block_hash)`` publishes the block under its hash once every layer was written; it is
   then cached and unreferenced, so a later ``add_sequence`` finds it. ``abort_import(block_hash)``
   releases the reservation instead (e.g. the payload failed verification).

``import_block(block_hash, kv)`` does all three at once. Every public method either completes or raises
a ``KVCacheError`` with the cache unchanged (except ``write``, whose validation happens before any copy).

Threads: the cache is locked per operation, not per request. Every sequence, transfer and introspection
method holds one re-entrant lock while it runs, so a batching worker thread and the event loop (loading
fetched blocks) can share the cache. The model seam (``write``, ``gather``, ``layer_buffers``) takes no lock:
it touches only the tensors of blocks its caller's sequences hold (referenced blocks are never reallocated,
and an import writes only into the block it reserved), which keeps the per-layer hot path free of locking.
For the same reason ``import_layer_with`` runs its ``write`` (a whole layer's decode) outside the lock: the
slots belong to the pending import until ``finish_import`` or ``abort_import``, which the importer calls
from the same thread after its writes, so the batching thread never waits on a decode.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Concatenate, ParamSpec, TypeVar

import torch

from kvnet.cache.block_pool import BLOCK_HASH_SIZE, BlockEvent, BlockPool, KVCacheBlock
from kvnet.errors import (
    BlockImportError,
    CacheUsageError,
    SequenceError,
    UnknownBlockError,
)

_P = ParamSpec("_P")
_R = TypeVar("_R")


_CacheMethod = Callable[Concatenate["PagedKVCache", _P], _R]


def _locked(method: _CacheMethod[_P, _R]) -> _CacheMethod[_P, _R]:
    """Run ``method`` holding the cache's lock (one operation at a time; see the module docstring)."""

    @functools.wraps(method)
    def wrapper(self: PagedKVCache, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@dataclass(frozen=True, slots=True)
class CacheSpec:
    """Shape and dtype of the KV cache; validated on construction."""

    num_layers: int
    """Transformer layers, each with its own K and V."""
    num_kv_heads: int
    """Key/value heads per layer (H_kv; fewer than query heads under GQA)."""
    head_dim: int
    """Channels per head (D)."""
    block_size: int
    """Tokens per block; also the hashing granularity."""
    dtype: torch.dtype = torch.float32
    """Element type of the stored K/V (a floating-point dtype)."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not _is_positive_int(value):
                raise ValueError(f"CacheSpec.{name} must be a positive int, got {value!r}")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"CacheSpec.dtype must be a floating-point torch.dtype, got {self.dtype!r}")

    @property
    def block_shape(self) -> tuple[int, int, int, int]:
        """Shape of one block's K (or V) over all layers: ``(num_layers, block_size, H_kv, D)``."""
        return (self.num_layers, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block occupies, K and V of all layers."""
        elements = self.num_layers * self.block_size * self.num_kv_heads * self.head_dim
        return 2 * elements * torch.empty((), dtype=self.dtype).element_size()


@dataclass(slots=True)
class BlockKV:
    """K/V of one block over all layers, the unit of export and import."""

    k: torch.Tensor
    """Keys, ``[num_layers, block_size, H_kv, D]``."""
    v: torch.Tensor
    """Values, ``[num_layers, block_size, H_kv, D]``."""


@dataclass(frozen=True, slots=True)
class CacheStats:
    """Occupancy snapshot of a ``PagedKVCache``."""

    num_blocks: int
    """Total physical blocks."""
    used_blocks: int
    """Blocks referenced by a sequence or a pending import."""
    free_blocks: int
    """Blocks with no reference (includes the cached ones below)."""
    cached_blocks: int
    """Blocks findable by hash, referenced or not."""
    cached_free_blocks: int
    """Cached blocks with no reference: reusable prefixes, evicted LRU-first when space is needed."""
    num_sequences: int
    """Live sequences."""
    pending_imports: int
    """Incremental imports begun but not finished or aborted."""
    unused_slots: int
    """Token slots allocated to live sequences but not yet used (summed over sequences)."""


@dataclass(slots=True)
class _Sequence:
    blocks: list[KVCacheBlock]
    num_tokens: int
    table: torch.Tensor | None = None  # device copy of the block ids, rebuilt when blocks change


@dataclass(slots=True)
class _PendingImport:
    block: KVCacheBlock
    layers_done: list[bool] = field(default_factory=list)


class PagedKVCache:
    """Block-paged K/V storage for all layers plus the sequence and transfer bookkeeping.

    ``num_blocks`` blocks of ``spec.block_size`` tokens are preallocated on ``device``; nothing is
    allocated per token afterwards.
    """

    def __init__(
        self, spec: CacheSpec, num_blocks: int, device: torch.device, *, record_events: bool = False
    ) -> None:
        if not isinstance(spec, CacheSpec):
            raise TypeError(f"spec must be a CacheSpec, got {type(spec).__name__}")
        if not _is_positive_int(num_blocks):
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.spec = spec
        """Shape and dtype of the cache."""
        self.device = torch.device(device)
        """Where the K/V tensors live."""
        self.num_blocks = num_blocks
        """Physical blocks in the cache."""
        self.pool = BlockPool(num_blocks, record_events=record_events)
        """Block metadata (reference counts, free queue, hash index); events only with ``record_events``."""
        shape = (spec.num_layers, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        # One tensor per K and V, so a block's data over all layers is one strided slice (export,
        # import and copy-on-write are single tensor ops); layer views stay contiguous.
        self._k = torch.zeros(shape, dtype=spec.dtype, device=self.device)
        self._v = torch.zeros(shape, dtype=spec.dtype, device=self.device)
        # Per-layer views, so that the layer-by-layer import (the fetch path, one call per layer) indexes
        # once per call instead of twice: half of its per-call cost was tensor indexing.
        self._k_layers = self._k.unbind(0)
        self._layer_shape = spec.block_shape[1:]
        self._v_layers = self._v.unbind(0)
        self._sequences: dict[int, _Sequence] = {}
        self._pending: dict[bytes, _PendingImport] = {}
        self._lock = threading.RLock()
        self._staging: tuple[torch.Tensor, torch.Tensor] | None = None
        self._staging_copied: torch.cuda.Event | None = None

    # ----------------------------------------------------------------------------------------------
    # Model seam

    def layer_buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of one layer's K and V storage, ``[num_blocks, block_size, H_kv, D]`` each.

        For kernels that attend over the paged layout directly; writes through them bypass all checks.
        """
        self._check_layer(layer)
        return self._k[layer], self._v[layer]

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V of ``T`` tokens of ``layer`` at physical slots.

        ``slot_mapping``: ``[T]`` int64 (``block_id * block_size + offset``, as returned by
        ``append_slots``); ``k, v``: ``[T, H_kv, D]``, cast to ``spec.dtype`` if needed. Raises
        ``CacheUsageError`` on bad shapes, dtype or slots, before anything is written.
        """
        self._check_layer(layer)
        spec = self.spec
        if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dim() != 1:
            raise CacheUsageError("slot_mapping must be a 1-D tensor")
        if slot_mapping.dtype != torch.int64:
            raise CacheUsageError(f"slot_mapping must be int64, got {slot_mapping.dtype}")
        num_tokens = slot_mapping.shape[0]
        expected = (num_tokens, spec.num_kv_heads, spec.head_dim)
        for name, tensor in (("k", k), ("v", v)):
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != expected:
                shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise CacheUsageError(f"{name} must have shape {expected}, got {shape}")
            if not tensor.dtype.is_floating_point:
                raise CacheUsageError(f"{name} must be floating point, got {tensor.dtype}")
        if num_tokens == 0:
            return
        slots = slot_mapping.to(self.device)
        capacity = self.num_blocks * spec.block_size
        if int(slots.min()) < 0 or int(slots.max()) >= capacity:
            raise CacheUsageError(f"slot_mapping values must lie in [0, {capacity})")
        flat_shape = (capacity, spec.num_kv_heads, spec.head_dim)
        self._k[layer].view(flat_shape).index_copy_(0, slots, k.to(self.device, spec.dtype))
        self._v[layer].view(flat_shape).index_copy_(0, slots, v.to(self.device, spec.dtype))

    def gather(
        self, layer: int, block_table: torch.Tensor, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the first ``num_tokens`` positions of a sequence, contiguous ``[num_tokens, H_kv, D]``.

        ``block_table``: ``[n_blocks]`` int64 physical block ids in sequence order (``block_table()``).
        Raises ``CacheUsageError`` when the table is malformed or shorter than ``num_tokens`` needs.
        """
        self._check_layer(layer)
        spec = self.spec
        if not isinstance(block_table, torch.Tensor) or block_table.dim() != 1:
            raise CacheUsageError("block_table must be a 1-D tensor")
        if block_table.dtype != torch.int64:
            raise CacheUsageError(f"block_table must be int64, got {block_table.dtype}")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise CacheUsageError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
        if num_tokens > block_table.shape[0] * spec.block_size:
            raise CacheUsageError(
                f"num_tokens {num_tokens} exceeds the {block_table.shape[0]} block(s) of the table"
            )
        blocks_needed = -(-num_tokens // spec.block_size)
        table = block_table[:blocks_needed].to(self.device)
        if blocks_needed and (int(table.min()) < 0 or int(table.max()) >= self.num_blocks):
            raise CacheUsageError(f"block_table ids must lie in [0, {self.num_blocks})")
        flat_shape = (blocks_needed * spec.block_size, spec.num_kv_heads, spec.head_dim)
        keys = self._k[layer].index_select(0, table).view(flat_shape)[:num_tokens]
        values = self._v[layer].index_select(0, table).view(flat_shape)[:num_tokens]
        return keys, values

    # ----------------------------------------------------------------------------------------------
    # Sequence API

    @_locked
    def add_sequence(
        self,
        seq_id: int,
        token_ids: Sequence[int] | torch.Tensor,
        block_hashes: Sequence[bytes],
    ) -> int:
        """Start sequence ``seq_id`` for a prompt, sharing the longest cached prefix of its blocks.

        ``block_hashes`` are the chained hashes of the prompt's full blocks (``hashing.block_hashes``);
        only ``len(token_ids)`` is read from ``token_ids``. Returns the number of cached tokens: the
        longest run of leading hashes found in the index, times ``block_size``, capped so that at least
        one prompt token remains to be computed (its logits are needed); a prompt made entirely of
        cached blocks therefore recomputes its last block. The shared blocks gain a reference; the
        sequence's ``num_tokens`` starts at the returned count. Raises ``SequenceError`` for a duplicate
        id and ``CacheUsageError`` when there are more hashes than full blocks in the prompt.
        """
        self._check_seq_id(seq_id)
        if seq_id in self._sequences:
            raise SequenceError(f"sequence {seq_id} already exists")
        num_prompt_tokens = len(token_ids)
        block_size = self.spec.block_size
        if len(block_hashes) > num_prompt_tokens // block_size:
            raise CacheUsageError(
                f"{len(block_hashes)} block hashes for a prompt of {num_prompt_tokens} tokens "
                f"({num_prompt_tokens // block_size} full blocks)"
            )
        max_cached_blocks = max(num_prompt_tokens - 1, 0) // block_size
        hits: list[KVCacheBlock] = []
        for block_hash in block_hashes[:max_cached_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        self.pool.touch(hits)
        self._sequences[seq_id] = _Sequence(blocks=hits, num_tokens=len(hits) * block_size)
        return len(hits) * block_size

    @_locked
    def fork_sequence(self, parent_seq_id: int, child_seq_id: int) -> None:
        """Start ``child_seq_id`` as a copy of ``parent_seq_id`` sharing all of its blocks.

        The next write of either sequence into a shared partial block copies it first (copy-on-write).
        """
        parent = self._get_sequence(parent_seq_id)
        self._check_seq_id(child_seq_id)
        if child_seq_id in self._sequences:
            raise SequenceError(f"sequence {child_seq_id} already exists")
        self.pool.touch(parent.blocks)
        self._sequences[child_seq_id] = _Sequence(blocks=list(parent.blocks), num_tokens=parent.num_tokens)

    @_locked
    def append_slots(self, seq_id: int, num_new_tokens: int) -> torch.Tensor:
        """Reserve the next ``num_new_tokens`` positions of ``seq_id``; returns their slots, ``[n]`` int64.

        Allocates blocks on demand. If the first position falls inside a block that is shared
        (``ref_cnt > 1``) or cached under a hash, that block's K/V (all layers) is first copied into a
        fresh private block, so other sequences and the cache never see this sequence's writes. Raises
        ``PoolExhaustedError`` (cache unchanged) when the pool cannot supply the blocks.
        """
        seq = self._get_sequence(seq_id)
        if isinstance(num_new_tokens, bool) or not isinstance(num_new_tokens, int) or num_new_tokens < 0:
            raise CacheUsageError(f"num_new_tokens must be a non-negative int, got {num_new_tokens!r}")
        block_size = self.spec.block_size
        start = seq.num_tokens
        end = start + num_new_tokens
        blocks_needed = max(-(-end // block_size) - len(seq.blocks), 0)
        partial = start % block_size != 0 and num_new_tokens > 0
        last = seq.blocks[-1] if partial else None
        copy_on_write = last is not None and (last.ref_cnt > 1 or last.block_hash is not None)
        new_blocks = self.pool.allocate(blocks_needed + int(copy_on_write))
        if copy_on_write:
            assert last is not None
            private = new_blocks.pop()
            self._k[:, private.block_id] = self._k[:, last.block_id]
            self._v[:, private.block_id] = self._v[:, last.block_id]
            seq.blocks[-1] = private
            self.pool.free([last])
        seq.blocks.extend(new_blocks)
        seq.num_tokens = end
        if new_blocks or copy_on_write:
            seq.table = None
        positions = torch.arange(start, end, dtype=torch.int64, device=self.device)
        table = self.block_table(seq_id)
        return table[positions // block_size] * block_size + positions % block_size

    @_locked
    def num_tokens(self, seq_id: int) -> int:
        """Positions of ``seq_id`` that have slots (cached prefix plus everything appended)."""
        return self._get_sequence(seq_id).num_tokens

    @_locked
    def block_table(self, seq_id: int) -> torch.Tensor:
        """Physical block ids of ``seq_id`` in order, ``[n_blocks]`` int64 on the cache's device.

        The returned tensor is shared until the sequence's blocks change; do not modify it.
        """
        seq = self._get_sequence(seq_id)
        if seq.table is None:
            ids = [block.block_id for block in seq.blocks]
            seq.table = torch.tensor(ids, dtype=torch.int64, device=self.device)
        return seq.table

    @_locked
    def has_sequence(self, seq_id: int) -> bool:
        """Whether ``seq_id`` is live."""
        return seq_id in self._sequences

    @_locked
    def commit_full_blocks(self, seq_id: int, block_hashes: Sequence[bytes]) -> int:
        """Publish the sequence's full blocks in the index; returns how many became newly cached.

        ``block_hashes[i]`` names the sequence's block ``i``; at most ``num_tokens // block_size``
        hashes may be given (only full blocks are cacheable). Blocks already cached under the same hash
        are skipped; a hash already held by another block leaves this block uncached. Call it after the
        K/V of those blocks has been written. Raises ``CacheUsageError`` (nothing changed) on too many
        hashes, malformed hashes, or a block already cached under a different hash.
        """
        seq = self._get_sequence(seq_id)
        num_full = seq.num_tokens // self.spec.block_size
        if len(block_hashes) > num_full:
            raise CacheUsageError(
                f"{len(block_hashes)} hashes given but sequence {seq_id} has {num_full} full block(s)"
            )
        for index, block_hash in enumerate(block_hashes):
            self._check_hash(block_hash)
            current = seq.blocks[index].block_hash
            if current is not None and current != block_hash:
                raise CacheUsageError(f"block {index} of sequence {seq_id} is cached under another hash")
        return sum(
            self.pool.cache_full_block(block, block_hash)
            for block, block_hash in zip(seq.blocks, block_hashes, strict=False)
        )

    @_locked
    def free_sequence(self, seq_id: int) -> None:
        """End ``seq_id`` and release its block references; cached blocks stay findable until evicted."""
        seq = self._get_sequence(seq_id)
        # Reverse order: the sequence's tail blocks are evicted before the prefix they extend.
        self.pool.free(reversed(seq.blocks))
        del self._sequences[seq_id]

    # ----------------------------------------------------------------------------------------------
    # Transfer API

    @_locked
    def contains_block(self, block_hash: bytes) -> bool:
        """Whether a block is cached (and exportable) under ``block_hash``."""
        return self.pool.lookup(block_hash) is not None

    @_locked
    def match_prefix(self, block_hashes: Sequence[bytes]) -> int:
        """Number of leading ``block_hashes`` that are cached; no references are taken."""
        for count, block_hash in enumerate(block_hashes):
            if self.pool.lookup(block_hash) is None:
                return count
        return len(block_hashes)

    @_locked
    def export_block(self, block_hash: bytes) -> BlockKV:
        """A copy of the cached block's K/V over all layers, ``[num_layers, block_size, H_kv, D]`` each.

        Raises ``UnknownBlockError`` when nothing is cached under ``block_hash``.
        """
        block = self.pool.lookup(block_hash)
        if block is None:
            raise UnknownBlockError(f"no cached block for hash {block_hash.hex()}")
        return BlockKV(k=self._k[:, block.block_id].clone(), v=self._v[:, block.block_id].clone())

    @_locked
    def import_block(self, block_hash: bytes, kv: BlockKV) -> KVCacheBlock:
        """Copy a fetched block into the cache and publish it under ``block_hash``.

        ``kv.k``/``kv.v`` must be ``[num_layers, block_size, H_kv, D]`` of exactly ``spec.dtype`` (any
        real device; data is copied). The block is left cached and unreferenced, so ``add_sequence``
        finds it (until evicted). Importing a hash that is already cached returns that block unchanged.
        Raises ``BlockImportError`` on a mismatch and ``PoolExhaustedError`` when no block is free,
        in both cases with the cache unchanged.
        """
        self._check_hash(block_hash)
        existing = self.pool.lookup(block_hash)
        if existing is not None:
            return existing
        if block_hash in self._pending:
            raise BlockImportError(f"block {block_hash.hex()} is being imported incrementally")
        if not isinstance(kv, BlockKV):
            raise BlockImportError(f"kv must be a BlockKV, got {type(kv).__name__}")
        self._check_import_tensor("k", kv.k, self.spec.block_shape)
        self._check_import_tensor("v", kv.v, self.spec.block_shape)
        (block,) = self.pool.allocate(1)
        self._k[:, block.block_id].copy_(kv.k)
        self._v[:, block.block_id].copy_(kv.v)
        self.pool.cache_full_block(block, block_hash)
        self.pool.free([block])
        return block

    @_locked
    def begin_import(self, block_hash: bytes) -> bool:
        """Reserve a block to be filled layer by layer; False (nothing reserved) if already cached/pending.

        Raises ``PoolExhaustedError`` (cache unchanged) when no block is free.
        """
        self._check_hash(block_hash)
        if self.pool.lookup(block_hash) is not None or block_hash in self._pending:
            return False
        (block,) = self.pool.allocate(1)
        self._pending[block_hash] = _PendingImport(block=block, layers_done=[False] * self.spec.num_layers)
        return True

    @_locked
    def import_layer(self, block_hash: bytes, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write one layer of a block reserved by ``begin_import``; ``k, v: [block_size, H_kv, D]``.

        Raises ``UnknownBlockError`` when no import of ``block_hash`` is pending, and
        ``BlockImportError`` on a bad layer, shape, dtype or device (nothing written).
        """
        pending = self._pending.get(block_hash)
        if pending is None:
            raise UnknownBlockError(f"no pending import for hash {block_hash.hex()}")
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.spec.num_layers:
            raise BlockImportError(f"layer must be in [0, {self.spec.num_layers}), got {layer!r}")
        self._check_import_tensor("k", k, self._layer_shape)
        self._check_import_tensor("v", v, self._layer_shape)
        block_id = pending.block.block_id
        # Item assignment copies without making a Python view object first (~0.4 us less per copy).
        self._k_layers[layer][block_id] = k
        self._v_layers[layer][block_id] = v
        pending.layers_done[layer] = True

    def import_layer_with(
        self, block_hash: bytes, layer: int, write: Callable[[torch.Tensor, torch.Tensor], None]
    ) -> None:
        """Fill one layer of a block reserved by ``begin_import`` in place: ``write(k, v)`` writes it.

        On a CPU cache ``k`` and ``v`` are the reserved block's own slots of ``layer``
        (``[block_size, H_kv, D]``, contiguous), so a decoder writes the fetched layer straight into the
        cache: no intermediate tensor, no copy. On an accelerator they are host staging tensors (pinned
        where CUDA is available) copied into the slots after ``write`` returns, ``non_blocking`` on CUDA
        (the next layer waits for that copy before reusing the staging). The layer counts as written only
        if ``write`` returns; whatever it raises propagates, and the slots may then hold part of a layer
        of a block that is still pending, so invisible to ``add_sequence``, until ``abort_import`` frees
        it. Raises ``UnknownBlockError`` when no import of ``block_hash`` is pending and
        ``BlockImportError`` on a bad layer (nothing written).

        ``write`` runs without the cache's lock (see the module docstring): call ``finish_import`` /
        ``abort_import`` for this block from the thread that writes it, after its writes.
        """
        with self._lock:
            pending = self._pending.get(block_hash)
            if pending is None:
                raise UnknownBlockError(f"no pending import for hash {block_hash.hex()}")
            if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.spec.num_layers:
                raise BlockImportError(f"layer must be in [0, {self.spec.num_layers}), got {layer!r}")
            block_id = pending.block.block_id
        if self.device.type == "cpu":
            write(self._k_layers[layer][block_id], self._v_layers[layer][block_id])
        else:
            k, v = self._staging_for_write()
            write(k, v)
            non_blocking = self.device.type == "cuda"
            self._k_layers[layer][block_id].copy_(k, non_blocking=non_blocking)
            self._v_layers[layer][block_id].copy_(v, non_blocking=non_blocking)
            if non_blocking:
                self._staging_copied = torch.cuda.Event()
                self._staging_copied.record()
        with self._lock:
            pending.layers_done[layer] = True

    def _staging_for_write(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The host pair ``import_layer_with`` stages one layer in on an accelerator, once its previous
        copy to the device is done."""
        if self._staging is None:
            pin = self.device.type == "cuda" and torch.cuda.is_available()
            k, v = (torch.empty(self._layer_shape, dtype=self.spec.dtype, pin_memory=pin) for _ in range(2))
            self._staging = (k, v)
        if self._staging_copied is not None:
            self._staging_copied.synchronize()
            self._staging_copied = None
        return self._staging

    @_locked
    def finish_import(self, block_hash: bytes) -> KVCacheBlock:
        """Publish a block whose layers were all written; it becomes cached and unreferenced.

        Raises ``UnknownBlockError`` if no import is pending and ``BlockImportError`` (import still
        pending) when some layer is missing.
        """
        pending = self._pending.get(block_hash)
        if pending is None:
            raise UnknownBlockError(f"no pending import for hash {block_hash.hex()}")
        missing = [layer for layer, done in enumerate(pending.layers_done) if not done]
        if missing:
            raise BlockImportError(f"block {block_hash.hex()} is missing layers {missing}")
        del self._pending[block_hash]
        self.pool.cache_full_block(pending.block, block_hash)
        self.pool.free([pending.block])
        return pending.block

    @_locked
    def abort_import(self, block_hash: bytes) -> None:
        """Drop a pending import and return its block to the pool; unknown hashes are ignored."""
        pending = self._pending.pop(block_hash, None)
        if pending is not None:
            self.pool.free([pending.block])

    # ----------------------------------------------------------------------------------------------
    # Introspection

    @_locked
    def stats(self) -> CacheStats:
        """Block occupancy and allocated-but-unused token slots."""
        blocks = self.pool.blocks
        block_size = self.spec.block_size
        return CacheStats(
            num_blocks=self.num_blocks,
            used_blocks=self.num_blocks - self.pool.num_free_blocks,
            free_blocks=self.pool.num_free_blocks,
            cached_blocks=self.pool.num_cached_blocks,
            cached_free_blocks=sum(1 for b in blocks if b.ref_cnt == 0 and b.block_hash is not None),
            num_sequences=len(self._sequences),
            pending_imports=len(self._pending),
            unused_slots=sum(len(s.blocks) * block_size - s.num_tokens for s in self._sequences.values()),
        )

    @_locked
    def take_events(self) -> list[BlockEvent]:
        """Stored/removed events since the last call (``BlockPool.take_events``; needs ``record_events``)."""
        return self.pool.take_events()

    # ----------------------------------------------------------------------------------------------
    # Validation helpers

    def _check_layer(self, layer: int) -> None:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.spec.num_layers:
            raise CacheUsageError(f"layer must be in [0, {self.spec.num_layers}), got {layer!r}")

    @staticmethod
    def _check_seq_id(seq_id: int) -> None:
        if isinstance(seq_id, bool) or not isinstance(seq_id, int):
            raise SequenceError(f"sequence id must be an int, got {seq_id!r}")

    def _get_sequence(self, seq_id: int) -> _Sequence:
        self._check_seq_id(seq_id)
        seq = self._sequences.get(seq_id)
        if seq is None:
            raise SequenceError(f"unknown sequence {seq_id}")
        return seq

    @staticmethod
    def _check_hash(block_hash: bytes) -> None:
        if not isinstance(block_hash, bytes) or len(block_hash) != BLOCK_HASH_SIZE:
            raise CacheUsageError(f"block hash must be {BLOCK_HASH_SIZE} bytes, got {block_hash!r}")

    def _check_import_tensor(self, name: str, tensor: object, shape: tuple[int, ...]) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise BlockImportError(f"{name} must be a tensor, got {type(tensor).__name__}")
        if tensor.shape != shape:  # torch.Size compares equal to a tuple of the same sizes
            raise BlockImportError(f"{name} must have shape {shape}, got {tuple(tensor.shape)}")
        if tensor.dtype != self.spec.dtype:
            raise BlockImportError(f"{name} must have dtype {self.spec.dtype}, got {tensor.dtype}")
        if tensor.is_meta:
            raise BlockImportError(f"{name} is on the meta device and holds no data")
