"""kvnet/node/overlap.py's arithmetic: where the fetch of a split may start (the process tests in
tests/nodes/test_overlap.py run whole splits over the link emulator)."""

from __future__ import annotations

from kvnet.node.overlap import head_chunk_end


def test_the_fetch_starts_past_the_chunk_the_head_is_computing() -> None:
    # 64-token blocks, 320-token chunks (5 blocks): chunks end at blocks 5, 10, 15, ... of the prompt.
    assert head_chunk_end(0, 320, 64) == 5
    assert head_chunk_end(4, 320, 64) == 5
    assert head_chunk_end(5, 320, 64) == 10  # a chunk just ended: the next one is in flight
    assert head_chunk_end(7, 320, 64) == 10  # a head that starts mid-chunk (after local hits) ends it first


def test_one_block_chunks_leave_the_fetch_everything_past_the_next_block() -> None:
    assert [head_chunk_end(done, 64, 64) for done in range(4)] == [1, 2, 3, 4]


def test_chunks_end_at_multiples_of_the_chunk_whatever_the_block_size() -> None:
    # 16-token blocks, 128-token chunks (8 blocks): the engine cuts them so (``prefill_chunk``).
    assert head_chunk_end(3, 128, 16) == 8
    assert head_chunk_end(8, 128, 16) == 16
