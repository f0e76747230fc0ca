"""Tests for kvnet.cache.paged_cache: the model seam, prefix sharing, copy-on-write, eviction, transfer."""

from __future__ import annotations

import contextlib
import random
import threading

import pytest
import torch

from kvnet.cache.hashing import block_hashes, canonical_fingerprint, root_hash
from kvnet.cache.paged_cache import BlockKV, CacheSpec, PagedKVCache
from kvnet.errors import (
    BlockImportError,
    CacheUsageError,
    PoolExhaustedError,
    SequenceError,
    UnknownBlockError,
)

CPU = torch.device("cpu")
ROOT = root_hash(canonical_fingerprint({"model": "test"}))
SPEC = CacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4)


def _kv_for(tokens: list[int], spec: CacheSpec = SPEC) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic K/V that depend on token id and position, like a real model's: [T, H, D]."""
    ids = torch.tensor(tokens, dtype=torch.float32).view(-1, 1, 1)
    pos = torch.arange(len(tokens), dtype=torch.float32).view(-1, 1, 1)
    channel = torch.arange(spec.num_kv_heads * spec.head_dim, dtype=torch.float32)
    channel = channel.view(1, spec.num_kv_heads, spec.head_dim)
    k = ids * 1000 + pos + channel / 100
    return k.to(spec.dtype), (-k).to(spec.dtype)


def _prefill(cache: PagedKVCache, seq_id: int, tokens: list[int]) -> int:
    """What the model's prefill does through the seam; returns the cached token count."""
    hashes = block_hashes(tokens, cache.spec.block_size, ROOT)
    cached = cache.add_sequence(seq_id, tokens, hashes)
    slots = cache.append_slots(seq_id, len(tokens) - cached)
    k, v = _kv_for(tokens, cache.spec)
    for layer in range(cache.spec.num_layers):
        cache.write(layer, slots, k[cached:] + layer, v[cached:] + layer)
    cache.commit_full_blocks(seq_id, hashes)
    return cached


def _assert_sequence_holds(cache: PagedKVCache, seq_id: int, tokens: list[int]) -> None:
    k, v = _kv_for(tokens, cache.spec)
    table = cache.block_table(seq_id)
    for layer in range(cache.spec.num_layers):
        got_k, got_v = cache.gather(layer, table, len(tokens))
        assert torch.equal(got_k, k + layer)
        assert torch.equal(got_v, v + layer)


def _snapshot(cache: PagedKVCache) -> tuple[object, ...]:
    pool = cache.pool
    return (
        cache.stats(),
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        [b.block_id for b in pool.free_blocks()],
    )


def test_cache_spec_validation() -> None:
    with pytest.raises(ValueError, match="num_layers"):
        CacheSpec(num_layers=0, num_kv_heads=1, head_dim=1, block_size=1)
    with pytest.raises(ValueError, match="block_size"):
        CacheSpec(num_layers=1, num_kv_heads=1, head_dim=1, block_size=True)
    with pytest.raises(ValueError, match="dtype"):
        CacheSpec(num_layers=1, num_kv_heads=1, head_dim=1, block_size=1, dtype=torch.int64)
    assert SPEC.block_shape == (2, 4, 2, 4)
    assert SPEC.bytes_per_block == 2 * 2 * 4 * 2 * 4 * 4


def test_write_then_gather_round_trip_across_blocks() -> None:
    cache = PagedKVCache(SPEC, num_blocks=8, device=CPU)
    tokens = list(range(10, 21))  # 11 tokens: 2 full blocks + 3
    assert _prefill(cache, 1, tokens) == 0
    assert cache.num_tokens(1) == 11
    assert cache.block_table(1).dtype == torch.int64
    assert cache.block_table(1).shape == (3,)
    _assert_sequence_holds(cache, 1, tokens)
    k, _ = cache.gather(0, cache.block_table(1), 5)
    assert k.shape == (5, 2, 4) and k.is_contiguous()
    # Decode: one token at a time continues the same table.
    slot = cache.append_slots(1, 1)
    assert slot.shape == (1,)
    assert int(slot[0]) == int(cache.block_table(1)[2]) * SPEC.block_size + 3


def test_seam_rejects_bad_arguments() -> None:
    cache = PagedKVCache(SPEC, num_blocks=2, device=CPU)
    k = torch.zeros(2, 2, 4)
    slots = torch.tensor([0, 1])
    with pytest.raises(CacheUsageError, match="layer"):
        cache.write(2, slots, k, k)
    with pytest.raises(CacheUsageError, match="shape"):
        cache.write(0, slots, torch.zeros(2, 2, 5), k)
    with pytest.raises(CacheUsageError, match="int64"):
        cache.write(0, slots.int(), k, k)
    with pytest.raises(CacheUsageError, match="slot_mapping values"):
        cache.write(0, torch.tensor([0, 8]), k, k)
    with pytest.raises(CacheUsageError, match="exceeds"):
        cache.gather(0, torch.tensor([0]), 5)
    with pytest.raises(CacheUsageError, match="block_table ids"):
        cache.gather(0, torch.tensor([5]), 1)
    assert torch.count_nonzero(cache.layer_buffers(0)[0]) == 0


def test_prefix_sharing_uses_physical_blocks_once() -> None:
    cache = PagedKVCache(SPEC, num_blocks=32, device=CPU)
    prefix = list(range(100, 112))  # 3 full blocks
    prompts = {seq_id: [*prefix, 500 + seq_id, 600 + seq_id] for seq_id in range(5)}
    assert _prefill(cache, 0, prompts[0]) == 0
    for seq_id in range(1, 5):
        assert _prefill(cache, seq_id, prompts[seq_id]) == len(prefix)
    first_table = cache.block_table(0)
    for seq_id in range(1, 5):
        assert torch.equal(cache.block_table(seq_id)[:3], first_table[:3])
        _assert_sequence_holds(cache, seq_id, prompts[seq_id])
    assert [cache.pool.blocks[int(i)].ref_cnt for i in first_table[:3]] == [5, 5, 5]
    # 3 shared prefix blocks + one private tail block per sequence.
    assert cache.stats().used_blocks == 3 + 5


def test_fully_cached_prompt_recomputes_last_block() -> None:
    cache = PagedKVCache(SPEC, num_blocks=8, device=CPU)
    tokens = list(range(8))
    _prefill(cache, 1, tokens)
    # At least one token must remain to compute logits from.
    assert _prefill(cache, 2, tokens) == 4
    _assert_sequence_holds(cache, 2, tokens)
    assert cache.add_sequence(3, [1], []) == 0


def test_copy_on_write_keeps_other_sequence_unchanged() -> None:
    cache = PagedKVCache(SPEC, num_blocks=8, device=CPU)
    tokens = [1, 2, 3, 4, 5, 6]  # partial second block
    _prefill(cache, 1, tokens)
    cache.fork_sequence(1, 2)
    shared_tail = int(cache.block_table(1)[1])
    assert cache.pool.blocks[shared_tail].ref_cnt == 2
    # Child writes token 7 into the shared partial block: it must get a private copy first.
    slot = cache.append_slots(2, 1)
    child_tail = int(cache.block_table(2)[1])
    assert child_tail != shared_tail
    assert int(slot[0]) == child_tail * SPEC.block_size + 2
    child_tokens = [*tokens, 99]
    k, v = _kv_for(child_tokens)
    for layer in range(SPEC.num_layers):
        cache.write(layer, slot, k[6:] + layer, v[6:] + layer)
    _assert_sequence_holds(cache, 2, child_tokens)  # copied positions 4, 5 came along
    _assert_sequence_holds(cache, 1, tokens)
    parent_k, _ = cache.gather(0, cache.block_table(1), 7)
    assert not torch.equal(parent_k[6], k[6])  # parent slot 6 was never written by the child
    assert cache.pool.blocks[shared_tail].ref_cnt == 1
    # The full first block is still shared and untouched.
    assert int(cache.block_table(1)[0]) == int(cache.block_table(2)[0])


def test_free_all_sequences_leaks_nothing() -> None:
    cache = PagedKVCache(SPEC, num_blocks=16, device=CPU)
    for seq_id in range(4):
        _prefill(cache, seq_id, [7, 7, 7, 7, 8, 8, 8, 8, seq_id, seq_id])
    cache.fork_sequence(0, 10)
    cache.append_slots(10, 3)
    for seq_id in [*range(4), 10]:
        cache.free_sequence(seq_id)
    assert all(block.ref_cnt == 0 for block in cache.pool.blocks)
    stats = cache.stats()
    assert stats.free_blocks == 16 and stats.used_blocks == 0 and stats.num_sequences == 0
    assert stats.cached_blocks == stats.cached_free_blocks == 2
    with pytest.raises(SequenceError):
        cache.free_sequence(0)


def test_sequence_errors() -> None:
    cache = PagedKVCache(SPEC, num_blocks=4, device=CPU)
    cache.add_sequence(1, [1, 2], [])
    with pytest.raises(SequenceError, match="already exists"):
        cache.add_sequence(1, [1, 2], [])
    with pytest.raises(SequenceError, match="unknown"):
        cache.append_slots(2, 1)
    with pytest.raises(SequenceError):
        cache.num_tokens(2)
    with pytest.raises(SequenceError, match="already exists"):
        cache.fork_sequence(1, 1)
    with pytest.raises(CacheUsageError, match="block hashes"):
        cache.add_sequence(3, [1, 2, 3], [bytes(32)])
    with pytest.raises(CacheUsageError, match="full block"):
        cache.commit_full_blocks(1, [bytes(32)])
    assert not cache.has_sequence(3)


def test_fragmentation_stays_below_one_block_per_sequence() -> None:
    rng = random.Random(1234)
    spec = CacheSpec(num_layers=1, num_kv_heads=1, head_dim=2, block_size=8)
    cache = PagedKVCache(spec, num_blocks=256, device=CPU)
    live: dict[int, int] = {}  # seq_id -> target length
    next_id = 0
    for _ in range(400):
        action = rng.random()
        if action < 0.3 or not live:
            prompt = [rng.randrange(50) for _ in range(rng.randrange(1, 40))]
            try:
                _prefill(cache, next_id, prompt)
            except PoolExhaustedError:
                cache.free_sequence(next_id)
            else:
                live[next_id] = len(prompt) + rng.randrange(0, 60)
            next_id += 1
        elif action < 0.85:
            seq_id = rng.choice(list(live))
            if cache.num_tokens(seq_id) < live[seq_id]:
                with contextlib.suppress(PoolExhaustedError):
                    cache.append_slots(seq_id, rng.randrange(1, 4))
            else:
                cache.free_sequence(seq_id)
                del live[seq_id]
        else:
            seq_id = rng.choice(list(live))
            cache.free_sequence(seq_id)
            del live[seq_id]
        stats = cache.stats()
        assert stats.unused_slots < spec.block_size * max(len(live), 1)
        for seq_id in live:
            assert 0 <= len(cache.block_table(seq_id)) * spec.block_size - cache.num_tokens(seq_id) < 8


def test_eviction_under_small_pool_never_takes_referenced_blocks() -> None:
    cache = PagedKVCache(SPEC, num_blocks=6, device=CPU, record_events=True)
    pinned = list(range(900, 908))  # 2 full blocks held for the whole test
    _prefill(cache, 0, pinned)
    for seq_id in range(1, 30):
        tokens = [seq_id * 10 + i for i in range(8)]
        _prefill(cache, seq_id, tokens)
        _assert_sequence_holds(cache, seq_id, tokens)
        cache.free_sequence(seq_id)
        _assert_sequence_holds(cache, 0, pinned)
    assert [cache.pool.blocks[int(i)].ref_cnt for i in cache.block_table(0)] == [1, 1]
    hashes = block_hashes(pinned, SPEC.block_size, ROOT)
    assert cache.match_prefix(hashes) == 2
    # The most recent freed prompt is still cached; old ones were evicted.
    assert cache.match_prefix(block_hashes([29 * 10 + i for i in range(8)], 4, ROOT)) == 2
    assert cache.match_prefix(block_hashes([10 + i for i in range(8)], 4, ROOT)) == 0
    removed = [e for e in cache.take_events() if type(e).__name__ == "BlockRemoved"]
    assert removed and all(e.block_hash not in hashes for e in removed)


def test_exhausted_pool_raises_and_leaves_state_unchanged() -> None:
    cache = PagedKVCache(SPEC, num_blocks=3, device=CPU)
    _prefill(cache, 1, list(range(6)))
    cache.fork_sequence(1, 2)
    cache.add_sequence(3, [1], [])
    cache.append_slots(3, 4)
    before = _snapshot(cache)
    tables = {s: cache.block_table(s).clone() for s in (1, 2, 3)}
    with pytest.raises(PoolExhaustedError) as info:
        cache.append_slots(3, 5)  # needs 2 blocks, 0 free
    assert info.value.requested == 2 and info.value.available == 0
    with pytest.raises(PoolExhaustedError):
        cache.append_slots(2, 1)  # copy-on-write needs one block
    with pytest.raises(PoolExhaustedError):
        cache.import_block(bytes(32), BlockKV(*[torch.zeros(SPEC.block_shape)] * 2))
    assert _snapshot(cache) == before
    assert {s: cache.num_tokens(s) for s in (1, 2, 3)} == {1: 6, 2: 6, 3: 4}
    for seq_id, table in tables.items():
        assert torch.equal(cache.block_table(seq_id), table)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_export_import_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    spec = CacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=dtype)
    source = PagedKVCache(spec, num_blocks=4, device=CPU)
    generator = torch.Generator().manual_seed(0)
    tokens = [5, 6, 7, 8, 9]
    hashes = block_hashes(tokens, 4, ROOT)
    source.add_sequence(1, tokens, hashes)
    slots = source.append_slots(1, 5)
    for layer in range(3):
        k = torch.randn(5, 2, 8, generator=generator).to(dtype)
        source.write(layer, slots, k, k * 3)
    source.commit_full_blocks(1, hashes)
    exported = source.export_block(hashes[0])
    assert exported.k.shape == spec.block_shape and exported.k.dtype == dtype

    target = PagedKVCache(spec, num_blocks=4, device=CPU)
    block = target.import_block(hashes[0], exported)
    assert block.ref_cnt == 0 and target.contains_block(hashes[0])
    again = target.export_block(hashes[0])
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32  # compare raw bit patterns
    assert torch.equal(again.k.view(bits), exported.k.view(bits))
    assert torch.equal(again.v, exported.v)
    # The export is a copy: mutating it does not touch the cache.
    exported.k.zero_()
    assert not torch.equal(target.export_block(hashes[0]).k, exported.k)
    # Re-import of a present hash is a no-op returning the same block.
    assert target.import_block(hashes[0], exported) is block
    # A sequence for the same prompt now starts from the imported block and matches the source.
    assert target.add_sequence(7, tokens, hashes) == 4
    for layer in range(3):
        src_k, src_v = source.gather(layer, source.block_table(1), 4)
        dst_k, dst_v = target.gather(layer, target.block_table(7), 4)
        assert torch.equal(src_k, dst_k) and torch.equal(src_v, dst_v)


def test_import_rejects_mismatches_and_leaves_state_unchanged() -> None:
    cache = PagedKVCache(SPEC, num_blocks=2, device=CPU)
    good = torch.zeros(SPEC.block_shape)
    before = _snapshot(cache)
    bad_inputs = [
        BlockKV(torch.zeros(3, 4, 2, 4), good),
        BlockKV(good, torch.zeros(2, 4, 2, 5)),
        BlockKV(good.to(torch.float16), good),
        BlockKV(good, torch.zeros(SPEC.block_shape, device="meta")),
        BlockKV(good, "not a tensor"),  # type: ignore[arg-type]
    ]
    for kv in bad_inputs:
        with pytest.raises(BlockImportError):
            cache.import_block(bytes(32), kv)
    with pytest.raises(CacheUsageError):
        cache.import_block(b"short", BlockKV(good, good))
    with pytest.raises(UnknownBlockError):
        cache.export_block(bytes(32))
    assert _snapshot(cache) == before


def test_incremental_import_protocol() -> None:
    cache = PagedKVCache(SPEC, num_blocks=2, device=CPU)
    tokens = [1, 2, 3, 4, 5]
    block_hash = block_hashes(tokens, 4, ROOT)[0]
    k, v = _kv_for(tokens[:4])
    assert cache.begin_import(block_hash)
    assert not cache.begin_import(block_hash)  # already pending
    cache.import_layer(block_hash, 1, k + 1, v + 1)
    # Not visible before it is finished; finishing early fails and keeps it pending.
    assert not cache.contains_block(block_hash)
    with pytest.raises(BlockImportError, match="missing layers"):
        cache.finish_import(block_hash)
    with pytest.raises(BlockImportError):
        cache.import_layer(block_hash, 0, k.to(torch.float16), v)
    with pytest.raises(BlockImportError, match="layer"):
        cache.import_layer(block_hash, 5, k, v)
    with pytest.raises(UnknownBlockError):
        cache.import_layer(bytes(32), 0, k, v)
    assert cache.stats().pending_imports == 1 and cache.stats().used_blocks == 1
    cache.import_layer(block_hash, 0, k, v)
    block = cache.finish_import(block_hash)
    assert block.ref_cnt == 0 and cache.contains_block(block_hash)
    assert not cache.begin_import(block_hash)  # already cached
    assert cache.add_sequence(1, tokens, [block_hash]) == 4
    for layer in range(2):
        got_k, got_v = cache.gather(layer, cache.block_table(1), 4)
        assert torch.equal(got_k, k + layer) and torch.equal(got_v, v + layer)


def test_import_layer_with_fills_the_reserved_slots_in_place() -> None:
    cache = PagedKVCache(SPEC, num_blocks=2, device=CPU)
    tokens = [1, 2, 3, 4, 5]
    block_hash = block_hashes(tokens, 4, ROOT)[0]
    k, v = _kv_for(tokens[:4])
    assert cache.begin_import(block_hash)
    slots: list[torch.Tensor] = []

    def write(k_slot: torch.Tensor, v_slot: torch.Tensor) -> None:
        slots.extend((k_slot, v_slot))
        k_slot.copy_(k)
        v_slot.copy_(v)

    for layer in range(SPEC.num_layers):
        cache.import_layer_with(block_hash, layer, write)
    # The writer was handed the cache's own storage, not a staging copy.
    k_store, v_store = cache.layer_buffers(0)
    assert slots[0].data_ptr() in {k_store[b].data_ptr() for b in range(2)}
    assert slots[1].data_ptr() in {v_store[b].data_ptr() for b in range(2)}
    cache.finish_import(block_hash)
    assert cache.add_sequence(1, tokens, [block_hash]) == 4
    for layer in range(SPEC.num_layers):
        got_k, got_v = cache.gather(layer, cache.block_table(1), 4)
        assert torch.equal(got_k, k) and torch.equal(got_v, v)


def test_import_layer_with_a_failing_writer_leaves_the_layer_missing() -> None:
    cache = PagedKVCache(SPEC, num_blocks=1, device=CPU)
    block_hash = bytes(32)
    assert cache.begin_import(block_hash)

    def half_written(k_slot: torch.Tensor, v_slot: torch.Tensor) -> None:
        k_slot.fill_(1.0)
        raise ValueError("corrupt payload")

    with pytest.raises(ValueError, match="corrupt payload"):
        cache.import_layer_with(block_hash, 0, half_written)
    cache.import_layer_with(block_hash, 1, lambda k_slot, v_slot: None)
    with pytest.raises(BlockImportError, match=r"missing layers \[0\]"):
        cache.finish_import(block_hash)
    with pytest.raises(BlockImportError, match="layer"):
        cache.import_layer_with(block_hash, 2, lambda k_slot, v_slot: None)
    with pytest.raises(UnknownBlockError):
        cache.import_layer_with(bytes([1]) * 32, 0, lambda k_slot, v_slot: None)
    cache.abort_import(block_hash)
    assert not cache.contains_block(block_hash)
    assert cache.stats().free_blocks == 1 and cache.stats().pending_imports == 0


def test_import_layer_with_decodes_without_holding_the_cache_lock() -> None:
    """A layer's decode runs outside the lock: another thread (the batching worker) completes a locked
    operation while ``write`` is still running."""
    cache = PagedKVCache(SPEC, num_blocks=2, device=CPU)
    block_hash = bytes(32)
    assert cache.begin_import(block_hash)
    seen: list[int] = []

    def write(k_slot: torch.Tensor, v_slot: torch.Tensor) -> None:
        other = threading.Thread(target=lambda: seen.append(cache.stats().pending_imports))
        other.start()
        other.join(timeout=30)
        assert not other.is_alive(), "the cache lock was held during write"

    for layer in range(SPEC.num_layers):
        cache.import_layer_with(block_hash, layer, write)
    assert seen == [1] * SPEC.num_layers
    cache.finish_import(block_hash)
    assert cache.contains_block(block_hash)


def test_import_layer_with_on_another_device_stages_through_host_tensors() -> None:
    """A cache off the CPU (here the meta device, which holds no data: the copy itself is not checked)
    hands the writer one reused pair of host tensors and copies them into the slots."""
    cache = PagedKVCache(SPEC, num_blocks=1, device=torch.device("meta"))
    block_hash = bytes(32)
    assert cache.begin_import(block_hash)
    handed: list[torch.Tensor] = []
    for layer in range(SPEC.num_layers):
        cache.import_layer_with(block_hash, layer, lambda k_slot, v_slot: handed.extend((k_slot, v_slot)))
    assert all(t.device.type == "cpu" and t.shape == (4, 2, 4) and t.dtype == SPEC.dtype for t in handed)
    assert handed[0] is handed[2] and handed[1] is handed[3] and handed[0] is not handed[1]
    cache.finish_import(block_hash)
    assert cache.contains_block(block_hash)


def test_abort_import_returns_block() -> None:
    cache = PagedKVCache(SPEC, num_blocks=1, device=CPU)
    assert cache.begin_import(bytes(32))
    with pytest.raises(PoolExhaustedError):
        cache.begin_import(bytes([1]) * 32)
    cache.abort_import(bytes(32))
    cache.abort_import(bytes(32))  # idempotent
    assert cache.stats().free_blocks == 1 and cache.stats().pending_imports == 0
    assert not cache.contains_block(bytes(32))


def test_events_report_stored_blocks() -> None:
    cache = PagedKVCache(SPEC, num_blocks=4, device=CPU, record_events=True)
    tokens = list(range(9))
    _prefill(cache, 1, tokens)
    stored = [e.block_hash for e in cache.take_events()]
    assert stored == block_hashes(tokens, 4, ROOT)
    assert cache.take_events() == []
