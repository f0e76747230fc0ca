"""Tests for kvnet.cache.block_pool: free queue order, allocation/eviction, hash index, events, invariants."""

from __future__ import annotations

import hashlib
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvnet.cache.block_pool import BlockPool, BlockRemoved, BlockStored, FreeBlockQueue, KVCacheBlock
from kvnet.errors import BlockStateError, CacheUsageError, PoolExhaustedError


def _hash(label: int) -> bytes:
    return hashlib.sha256(label.to_bytes(8, "big")).digest()


def _ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [block.block_id for block in blocks]


def test_free_queue_append_remove_popleft() -> None:
    blocks = [KVCacheBlock(block_id=i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert _ids(list(queue)) == [0, 1, 2, 3, 4]
    queue.remove(blocks[2])
    queue.remove(blocks[0])
    queue.remove(blocks[4])
    assert _ids(list(queue)) == [1, 3]
    queue.append(blocks[4])
    queue.appendleft(blocks[0])
    assert _ids(list(queue)) == [0, 1, 3, 4]
    assert queue.popleft() is blocks[0]
    assert len(queue) == 3
    with pytest.raises(BlockStateError):
        queue.remove(blocks[2])
    with pytest.raises(BlockStateError):
        queue.append(blocks[1])


def test_free_queue_popleft_empty_raises() -> None:
    queue = FreeBlockQueue([])
    with pytest.raises(BlockStateError):
        queue.popleft()


def test_block_hash_is_set_once() -> None:
    block = KVCacheBlock(block_id=0)
    block.block_hash = _hash(1)
    with pytest.raises(BlockStateError):
        block.block_hash = _hash(2)
    block.reset_hash()
    block.block_hash = _hash(2)
    assert block.block_hash == _hash(2)


def test_allocate_and_free_reference_counts() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.num_free_blocks == 1
    pool.touch(blocks[:1])
    assert blocks[0].ref_cnt == 2
    pool.free(blocks)
    assert [b.ref_cnt for b in blocks] == [1, 0, 0]
    assert pool.num_free_blocks == 3
    with pytest.raises(BlockStateError):
        pool.free([blocks[1]])
    with pytest.raises(BlockStateError):
        pool.free([blocks[0], blocks[0]])  # would drop two references from one
    assert blocks[0].ref_cnt == 1


def test_exhaustion_raises_with_counts_and_leaves_state_unchanged() -> None:
    pool = BlockPool(4, record_events=True)
    held = pool.allocate(2)
    cached = pool.allocate(1)[0]
    pool.cache_full_block(cached, _hash(1))
    pool.free([cached])
    pool.take_events()
    before = (_ids(pool.free_blocks()), pool.num_free_blocks, pool.lookup(_hash(1)))
    with pytest.raises(PoolExhaustedError) as info:
        pool.allocate(3)
    assert (info.value.requested, info.value.available, info.value.num_blocks) == (3, 2, 4)
    assert (_ids(pool.free_blocks()), pool.num_free_blocks, pool.lookup(_hash(1))) == before
    assert pool.take_events() == []
    assert [b.ref_cnt for b in held] == [1, 1]


def test_cached_blocks_stay_reusable_until_evicted_in_lru_order() -> None:
    pool = BlockPool(4, record_events=True)
    blocks = pool.allocate(4)
    for label, block in enumerate(blocks):
        assert pool.cache_full_block(block, _hash(label))
    assert pool.take_events() == [BlockStored(_hash(i), blocks[i].block_id) for i in range(4)]
    # Freed in order 2, 0, 3; block 1 stays referenced.
    pool.free([blocks[2]])
    pool.free([blocks[0]])
    pool.free([blocks[3]])
    assert pool.lookup(_hash(0)) is blocks[0]
    # Reviving a cached free block takes it out of the eviction queue.
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 1
    assert _ids(pool.free_blocks()) == [2, 3]
    (taken,) = pool.allocate(1)
    assert taken is blocks[2]  # least recently freed cached block is evicted first
    assert pool.lookup(_hash(2)) is None
    assert taken.block_hash is None
    assert pool.take_events() == [BlockRemoved(_hash(2), 2)]
    assert pool.lookup(_hash(1)) is blocks[1]  # referenced blocks are never evicted


def test_unhashed_free_blocks_are_reused_before_cached_ones() -> None:
    pool = BlockPool(3)
    cached, plain_a, plain_b = pool.allocate(3)
    pool.cache_full_block(cached, _hash(9))
    pool.free([cached])
    pool.free([plain_a, plain_b])
    assert _ids(pool.free_blocks())[-1] == cached.block_id
    assert set(_ids(pool.allocate(2))) == {plain_a.block_id, plain_b.block_id}
    assert pool.lookup(_hash(9)) is cached


def test_cache_full_block_rules() -> None:
    pool = BlockPool(3)
    first, second, third = pool.allocate(3)
    assert pool.cache_full_block(first, _hash(1))
    assert not pool.cache_full_block(first, _hash(1))  # same hash again: no-op
    assert not pool.cache_full_block(second, _hash(1))  # duplicate content stays unhashed
    assert second.block_hash is None
    with pytest.raises(BlockStateError):
        pool.cache_full_block(first, _hash(2))
    with pytest.raises(ValueError):
        pool.cache_full_block(third, b"short")
    pool.free([third])
    with pytest.raises(BlockStateError):
        pool.cache_full_block(third, _hash(3))
    assert pool.num_cached_blocks == 1


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError):
        BlockPool(0)
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.allocate(-1)
    assert pool.allocate(0) == []


# Random operation sequences: after every step the pool's invariants hold.
_op = st.tuples(
    st.sampled_from(["allocate", "free", "touch_cached", "cache"]), st.integers(0, 31), st.integers(0, 7)
)


def _check_invariants(pool: BlockPool, held: list[KVCacheBlock]) -> None:
    queued = pool.free_blocks()
    assert len(queued) == pool.num_free_blocks
    assert len({id(b) for b in queued}) == len(queued)
    assert all(b.ref_cnt == 0 for b in queued)
    for block in pool.blocks:
        assert block.ref_cnt == sum(1 for h in held if h is block)
        assert (block.ref_cnt == 0) == (block in queued)
        if block.block_hash is not None:
            assert pool.lookup(block.block_hash) is block
    assert pool.num_cached_blocks == sum(1 for b in pool.blocks if b.block_hash is not None)


@settings(max_examples=60, deadline=None)
@given(st.lists(_op, max_size=60))
def test_random_operations_keep_pool_invariants(ops: list[tuple[str, int, int]]) -> None:
    pool = BlockPool(8)
    held: list[KVCacheBlock] = []
    for kind, index, label in ops:
        if kind == "allocate":
            count = index % 5
            free_before = pool.num_free_blocks
            if count > free_before:
                with pytest.raises(PoolExhaustedError):
                    pool.allocate(count)
                assert pool.num_free_blocks == free_before
            else:
                held.extend(pool.allocate(count))
        elif kind == "free" and held:
            block = held.pop(index % len(held))
            pool.free([block])
        elif kind == "touch_cached":
            found = pool.lookup(_hash(label))
            if found is not None:
                pool.touch([found])
                held.append(found)
        elif kind == "cache" and held:
            block = held[index % len(held)]
            if block.block_hash is None:
                pool.cache_full_block(block, _hash(label))
        _check_invariants(pool, held)
    pool.free(held)
    assert pool.num_free_blocks == pool.num_blocks
    assert all(block.ref_cnt == 0 for block in pool.blocks)


def _store_evict_cycles(pool: BlockPool, first: int, count: int) -> None:
    """``count`` cycles of: allocate (evicting the block cached a cycle ago), cache under a new hash, free."""
    for label in range(first, first + count):
        (block,) = pool.allocate(1)
        pool.cache_full_block(block, _hash(label))
        pool.free([block])


def test_memory_stays_flat_over_store_evict_cycles_when_nobody_takes_events() -> None:
    # A long-running node caches and evicts forever; a pool whose events nobody drains must not keep
    # every evicted hash alive.
    pool = BlockPool(2)
    _store_evict_cycles(pool, 0, 1_000)  # warm up: both blocks have held hashes
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        _store_evict_cycles(pool, 1_000, 10_000)
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # 10k cycles queueing two events each would hold megabytes; a flat pool holds at most a few objects.
    assert after - before < 16 * 1024, f"pool grew by {after - before} bytes over 10k cycles"
    assert pool.num_cached_blocks == 2


def test_events_are_recorded_only_when_asked_for() -> None:
    quiet = BlockPool(2)
    _store_evict_cycles(quiet, 0, 3)
    with pytest.raises(CacheUsageError, match="record_events"):
        quiet.take_events()
    recording = BlockPool(2, record_events=True)
    _store_evict_cycles(recording, 0, 3)
    events = recording.take_events()
    assert [type(e) for e in events] == [BlockStored, BlockStored, BlockRemoved, BlockStored]
    assert [e.block_hash for e in events] == [_hash(0), _hash(1), _hash(0), _hash(2)]
    assert recording.take_events() == []
