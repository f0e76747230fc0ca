"""Block pool: metadata of the paged KV cache's physical blocks (vLLM v1 shape).

Owns which physical block ids exist, their reference counts, the hash each full block is cached under,
the free queue in eviction order and the hash -> block index. It holds no tensors and knows nothing about
layers, devices, sequences or the network; the paged cache (``kvnet.cache.paged_cache``) owns those.

Life cycle of a block::

    free (no hash) --allocate--> referenced --cache_full_block--> referenced + hashed
         ^                           |                                  |
         +------ free (ref 0) -------+            free (ref 0) ---------+--> free + hashed (reusable)
                                                                              |
                             allocate evicts it (BlockRemoved) <--------------+
                             touch revives it (ref 1, hash kept) <------------+

The free queue orders evictions: blocks freed without a hash go to the head (they are worth nothing and
are reused first), hashed blocks go to the tail, so the least recently freed cached block is evicted
first. Every method either completes or raises with the pool unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from kvnet.errors import BlockStateError, CacheUsageError, PoolExhaustedError

BLOCK_HASH_SIZE = 32
"""Length in bytes of a block hash (SHA-256)."""


@dataclass(eq=False, slots=True)
class KVCacheBlock:
    """Metadata of one physical KV block. Identity matters: two blocks are never equal unless the same."""

    block_id: int
    """Index of the block in the paged cache's tensors, 0 <= block_id < num_blocks."""
    ref_cnt: int = 0
    """Number of sequences (or pending imports) using the block; 0 means it sits in the free queue."""
    _block_hash: bytes | None = None
    prev_free_block: KVCacheBlock | None = field(default=None, repr=False)
    """Previous block in the free queue (intrusive list pointer), None when not queued or at the head."""
    next_free_block: KVCacheBlock | None = field(default=None, repr=False)
    """Next block in the free queue (intrusive list pointer), None when not queued or at the tail."""

    @property
    def block_hash(self) -> bytes | None:
        """Hash the block is cached under, or None while it is not a cached full block."""
        return self._block_hash

    @block_hash.setter
    def block_hash(self, value: bytes) -> None:
        # Hash-once: a cached block's content is immutable, so its name must be too.
        if self._block_hash is not None:
            raise BlockStateError(f"block {self.block_id} already has a hash; reset it before rehashing")
        self._block_hash = value

    def reset_hash(self) -> None:
        """Forget the hash (the block is being evicted and reused)."""
        self._block_hash = None


class FreeBlockQueue:
    """Intrusive doubly-linked list of free blocks in eviction order (head is evicted first).

    Uses sentinel head/tail nodes, so ``remove`` of any queued block is O(1) without searching.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(block_id=-1)
        self._tail = KVCacheBlock(block_id=-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        """Number of queued blocks."""
        for block in blocks:
            self.append(block)

    def _is_queued(self, block: KVCacheBlock) -> bool:
        return block.prev_free_block is not None and block.next_free_block is not None

    def _link_after(self, anchor: KVCacheBlock, block: KVCacheBlock) -> None:
        if self._is_queued(block):
            raise BlockStateError(f"block {block.block_id} is already in the free queue")
        following = anchor.next_free_block
        assert following is not None  # sentinels keep every queued node linked on both sides
        block.prev_free_block = anchor
        block.next_free_block = following
        anchor.next_free_block = block
        following.prev_free_block = block
        self.num_free_blocks += 1

    def append(self, block: KVCacheBlock) -> None:
        """Queue ``block`` at the tail (evicted last)."""
        tail_prev = self._tail.prev_free_block
        assert tail_prev is not None
        self._link_after(tail_prev, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Queue ``block`` at the head (reused first)."""
        self._link_after(self._head, block)

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from anywhere in the queue in O(1)."""
        prev_block, next_block = block.prev_free_block, block.next_free_block
        if prev_block is None or next_block is None:
            raise BlockStateError(f"block {block.block_id} is not in the free queue")
        prev_block.next_free_block = next_block
        next_block.prev_free_block = prev_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def popleft(self) -> KVCacheBlock:
        """Unlink and return the head block."""
        first = self._head.next_free_block
        if first is None or first is self._tail:
            raise BlockStateError("free queue is empty")
        self.remove(first)
        return first

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Queued blocks from head (next evicted) to tail."""
        node = self._head.next_free_block
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free_block

    def __len__(self) -> int:
        return self.num_free_blocks


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A full block became cached (findable by ``lookup``) under ``block_hash``."""

    block_hash: bytes
    """The hash the block is now indexed under."""
    block_id: int
    """Physical block id holding the data."""


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """A cached block was evicted: its hash no longer resolves in this pool."""

    block_hash: bytes
    """The hash that was removed from the index."""
    block_id: int
    """Physical block id that is being reused."""


BlockEvent = BlockStored | BlockRemoved


class BlockPool:
    """All physical blocks of one paged KV cache, their free queue and the hash index.

    ``allocate`` hands out blocks with ``ref_cnt == 1``; ``touch`` adds a reference (reviving a cached
    free block); ``free`` drops one, queueing the block when it reaches zero. A full block is published
    to the index with ``cache_full_block`` and stays findable by ``lookup`` until ``allocate`` evicts it.

    ``BlockStored`` / ``BlockRemoved`` events are queued only with ``record_events=True``, for a consumer
    that drains them with ``take_events``: a queue nobody drains grows with every store and eviction and
    keeps every evicted hash alive for the life of the process.
    """

    def __init__(self, num_blocks: int, *, record_events: bool = False) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        """Total number of physical blocks."""
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        """All blocks, indexed by block id."""
        self._free_queue = FreeBlockQueue(self.blocks)
        self._hash_to_block: dict[bytes, KVCacheBlock] = {}
        self.record_events = record_events
        """Whether stores and evictions queue events for ``take_events``."""
        self._events: list[BlockEvent] = []

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ``ref_cnt == 0`` (free or cached-but-unreferenced): what ``allocate`` can hand out."""
        return self._free_queue.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently findable by hash (referenced or not)."""
        return len(self._hash_to_block)

    def free_blocks(self) -> list[KVCacheBlock]:
        """Free-queue contents in eviction order (head first); for inspection and tests."""
        return list(self._free_queue)

    def allocate(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the head of the free queue, each returned with ``ref_cnt == 1``.

        Cached blocks taken this way are evicted: their hash leaves the index (and a ``BlockRemoved``
        event is queued when events are recorded). Raises ``PoolExhaustedError`` (pool unchanged) when
        too few blocks are free.
        """
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be a non-negative int, got {num_blocks!r}")
        if num_blocks > self.num_free_blocks:
            raise PoolExhaustedError(num_blocks, self.num_free_blocks, self.num_blocks)
        taken: list[KVCacheBlock] = []
        for _ in range(num_blocks):
            block = self._free_queue.popleft()
            self._evict_hash(block)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def _evict_hash(self, block: KVCacheBlock) -> None:
        block_hash = block.block_hash
        if block_hash is None:
            return
        if self._hash_to_block.get(block_hash) is block:
            del self._hash_to_block[block_hash]
        block.reset_hash()
        if self.record_events:
            self._events.append(BlockRemoved(block_hash=block_hash, block_id=block.block_id))

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add one reference to each block, taking it out of the free queue if it was there."""
        for block in blocks:
            if block.ref_cnt == 0:
                self._free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero are queued for reuse.

        Pass a sequence's blocks in reverse order so its tail blocks are evicted before its head (a
        prefix is only useful from the start). Hashed blocks go to the queue tail and stay findable until
        evicted; unhashed ones go to the head. Raises ``BlockStateError`` (nothing changed) on a
        block that is already unreferenced.
        """
        ordered = list(blocks)
        drops: dict[int, int] = {}
        for block in ordered:
            drops[block.block_id] = drops.get(block.block_id, 0) + 1
            if drops[block.block_id] > block.ref_cnt:
                raise BlockStateError(f"block {block.block_id} freed more often than referenced")
        for block in ordered:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self._free_queue.appendleft(block)
                else:
                    self._free_queue.append(block)

    def cache_full_block(self, block: KVCacheBlock, block_hash: bytes) -> bool:
        """Publish a full, referenced block in the index under ``block_hash``.

        Returns True when the block became cached (queueing a ``BlockStored`` event when events are
        recorded), False when the
        hash is already indexed to another block (the duplicate stays unhashed and is reused first once
        freed). Raises ``BlockStateError`` if the block is unreferenced or already has a different hash.
        """
        if not isinstance(block_hash, bytes) or len(block_hash) != BLOCK_HASH_SIZE:
            raise ValueError(f"block_hash must be {BLOCK_HASH_SIZE} bytes, got {block_hash!r}")
        if block.ref_cnt <= 0:
            raise BlockStateError(f"block {block.block_id} must be referenced to be cached")
        if block.block_hash is not None:
            if block.block_hash == block_hash:
                return False
            raise BlockStateError(f"block {block.block_id} already cached under another hash")
        if block_hash in self._hash_to_block:
            return False
        block.block_hash = block_hash
        self._hash_to_block[block_hash] = block
        if self.record_events:
            self._events.append(BlockStored(block_hash=block_hash, block_id=block.block_id))
        return True

    def lookup(self, block_hash: bytes) -> KVCacheBlock | None:
        """The block cached under ``block_hash``, or None. Does not add a reference."""
        return self._hash_to_block.get(block_hash)

    def take_events(self) -> list[BlockEvent]:
        """Return and clear the events queued since the last call, oldest first.

        Raises ``CacheUsageError`` on a pool built without ``record_events``: an empty answer there would
        read as "nothing happened".
        """
        if not self.record_events:
            raise CacheUsageError("this pool does not record events: build it with record_events=True")
        events, self._events = self._events, []
        return events
