"""kvnet/node/overlap.py's arithmetic: where the fetch of a split may start and where its head stops (the
process tests in tests/nodes/test_overlap.py run whole splits over the link emulator)."""

from __future__ import annotations

from collections.abc import Callable

from kvnet.node.overlap import head_chunk_end, head_stop


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


def _head(per_block_s: float, forward_s: float = 0.0) -> Callable[[int], float]:
    """A head's cost: a forward's fixed cost and a price per block (``KvAbr.head_cost``'s shape)."""
    return lambda n: 0.0 if n <= 0 else forward_s + n * per_block_s


def test_a_head_stops_at_its_forward_where_the_fetch_gets_through_the_rest_sooner() -> None:
    # The bench preset at 100 MB/s: a block computed in ~0.19 s, fetched in ~0.035. Four blocks lie between
    # the forward in flight (ending at block 2) and the fetch's run (from block 6): 0.14 s of fetch against
    # a forward more of 0.19 s or longer.
    assert head_stop(2, 6, 0.035, _head(0.17, 0.02)) == 2


def test_a_head_goes_on_while_the_fetch_is_slower_than_computing() -> None:
    # 10 MB/s: a block takes 0.35 s to come and 0.19 s to compute; of 9 blocks between, the head takes
    # the share that ends both sides together (6 computed in 1.04 s, 3 fetched in 1.05 s).
    assert head_stop(2, 11, 0.35, _head(0.17, 0.02)) == 8
    # A fetch that has stalled (nothing for far longer than computing everything): the head takes all.
    assert head_stop(2, 11, 30.0, _head(0.17, 0.02)) == 11


def test_a_fetch_that_reached_the_forward_in_flight_ends_the_head_there() -> None:
    assert head_stop(4, 4, 0.01, _head(0.2)) == 4
    assert head_stop(4, 3, 0.01, _head(0.2)) == 3  # delivered inside the forward: computed anyway


def test_decoding_beside_the_head_counts_against_it() -> None:
    # Equal speeds: without decoding the head takes half of the 4 blocks between; with each fetched
    # block's decode taking the head's cores for longer than computing a block, computing all is soonest.
    assert head_stop(0, 4, 0.1, _head(0.1)) == 2
    assert head_stop(0, 4, 0.1, _head(0.1), [0.15] * 4) == 4
