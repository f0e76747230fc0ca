"""The continuous-batching scheduler: many sequences, one forward per step, each over its own block table.

Every output is compared with the single-sequence path (`generate`, itself checked against a cache-free
recompute in test_generate.py), on the tiny model.
"""

from __future__ import annotations

import pytest
import torch

from kvnet.cache.paged_cache import PagedKVCache
from kvnet.errors import ContextLengthError, InvalidTokenError, PoolExhaustedError
from kvnet.model.batching import (
    BatchScheduler,
    SchedulerConfig,
    SchedulerEvent,
    SequenceFailed,
    SequenceFinished,
    SequenceRequest,
    TokenGenerated,
)
from kvnet.model.generate import SamplingParams, cache_spec_for, generate
from kvnet.model.transformer import Transformer

CPU = torch.device("cpu")
BLOCK_SIZE = 16


def new_cache(model: Transformer, num_blocks: int = 128) -> PagedKVCache:
    return PagedKVCache(cache_spec_for(model, BLOCK_SIZE), num_blocks, CPU)


def prompt(length: int, seed: int) -> tuple[int, ...]:
    return tuple(torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist())


def alone(model: Transformer, root: bytes, request: SequenceRequest) -> list[int]:
    """What the single-sequence path generates for ``request`` in a cache of its own."""
    cache = new_cache(model)
    return generate(
        model, cache, list(request.prompt_ids), request.max_new_tokens, root=root,
        stop_token_ids=request.stop_token_ids, sampling=request.sampling,
    ).token_ids


class Run:
    """Drives a scheduler to the end, recording every step's events."""

    def __init__(self, scheduler: BatchScheduler) -> None:
        self.scheduler = scheduler
        self.steps: list[list[SchedulerEvent]] = []

    def step(self) -> list[SchedulerEvent]:
        events = self.scheduler.step()
        self.steps.append(events)
        return events

    def until_idle(self, limit: int = 1000) -> None:
        for _ in range(limit):
            if not self.scheduler.has_work():
                return
            self.step()
        raise AssertionError(f"scheduler still busy after {limit} steps")

    def events(self, seq_id: int) -> list[SchedulerEvent]:
        return [e for s in self.steps for e in s if e.seq_id == seq_id]

    def tokens(self, seq_id: int) -> list[int]:
        return [e.token_id for e in self.events(seq_id) if isinstance(e, TokenGenerated)]

    def finished(self, seq_id: int) -> SequenceFinished:
        (event,) = [e for e in self.events(seq_id) if isinstance(e, SequenceFinished)]
        return event

    def failed(self, seq_id: int) -> SequenceFailed:
        (event,) = [e for e in self.events(seq_id) if isinstance(e, SequenceFailed)]
        return event


def test_mixed_prefill_and_decode_equal_the_single_sequence_path(model: Transformer, root: bytes) -> None:
    cache = new_cache(model)
    scheduler = BatchScheduler(model, cache, root=root, config=SchedulerConfig(4, 24))
    run = Run(scheduler)
    short = [SequenceRequest(prompt(10 + i, seed=i), 12) for i in range(3)]
    for i, request in enumerate(short):
        scheduler.add(i, request)
    for _ in range(3):  # the short prompts are prefilled and decoding
        run.step()
    long_request = SequenceRequest(prompt(150, seed=9), 6)
    scheduler.add(9, long_request)
    steps_before = len(run.steps)
    run.until_idle()
    # The long prompt was prefilled in chunks of the step budget while the others kept decoding: every step
    # until its first token also produced a token for each short sequence still running.
    long_steps = run.steps[steps_before:]
    first_long = next(i for i, s in enumerate(long_steps) if any(
        isinstance(e, TokenGenerated) and e.seq_id == 9 for e in s))
    assert first_long >= 150 // 24  # it needed several steps of at most 24 tokens
    decoding_during_prefill = [
        {e.seq_id for e in s if isinstance(e, TokenGenerated)} for s in long_steps[:first_long]
    ]
    assert all(ids for ids in decoding_during_prefill[:5]), decoding_during_prefill
    for i, request in enumerate(short):
        assert run.tokens(i) == alone(model, root, request)
        assert run.finished(i).finish_reason == "length"
    assert run.tokens(9) == alone(model, root, long_request)
    long_finished = run.finished(9)
    result = long_finished.result
    assert result.computed_tokens == 150 and result.cached_tokens == 0
    # Its share of the forwards that prefilled it, never more than the wall time those steps took.
    assert 0 < long_finished.prefill_compute_seconds <= result.prefill_seconds
    assert cache.stats().num_sequences == 0


def test_a_later_sequence_reuses_committed_prompt_blocks(model: Transformer, root: bytes) -> None:
    cache = new_cache(model)
    scheduler = BatchScheduler(model, cache, root=root)
    shared = prompt(40, seed=3)
    first = SequenceRequest((*shared, 1, 2, 3), 4)
    second = SequenceRequest((*shared, 7, 8), 4)
    run = Run(scheduler)
    scheduler.add(1, first)
    run.until_idle()
    scheduler.add(2, second)
    run.until_idle()
    assert run.finished(2).result.cached_tokens == 32  # two full blocks of the shared prefix
    assert run.tokens(2) == alone(model, root, second)


def test_blocks_prefilled_so_far_are_shared_with_a_sequence_admitted_meanwhile(
    model: Transformer, root: bytes
) -> None:
    scheduler = BatchScheduler(model, new_cache(model), root=root, config=SchedulerConfig(2, 32))
    shared = prompt(100, seed=14)
    run = Run(scheduler)
    scheduler.add(1, SequenceRequest((*shared, 5), 3))
    run.step()
    run.step()  # 64 of its 101 prompt tokens written: 4 full blocks
    later = SequenceRequest((*shared, 6, 7), 3)
    scheduler.add(2, later)
    run.until_idle()
    assert run.finished(2).result.cached_tokens == 64
    assert run.tokens(2) == alone(model, root, later)


def test_stop_ids_length_and_prefill_only(model: Transformer, root: bytes) -> None:
    base = SequenceRequest(prompt(20, seed=4), 10)
    expected = alone(model, root, base)
    stop_at = expected[3]
    cut = expected.index(stop_at) + 1
    scheduler = BatchScheduler(model, new_cache(model), root=root)
    run = Run(scheduler)
    scheduler.add(1, SequenceRequest(base.prompt_ids, 10, stop_token_ids=frozenset({stop_at})))
    scheduler.add(2, base)
    scheduler.add(3, SequenceRequest(prompt(40, seed=5), 0))
    run.until_idle()
    assert run.tokens(1) == expected[:cut]
    assert run.finished(1).finish_reason == "stop"
    assert run.tokens(2) == expected and run.finished(2).finish_reason == "length"
    prefill_only = run.finished(3)
    assert prefill_only.result.token_ids == [] and prefill_only.first_token_time is None
    assert scheduler.cache.match_prefix(prefill_only.result.block_hashes) == 2  # committed


def test_seeded_sampling_repeats_inside_a_batch(model: Transformer, root: bytes) -> None:
    sampled = SequenceRequest(prompt(25, seed=6), 16, SamplingParams(temperature=0.8, top_p=0.9, seed=123))
    scheduler = BatchScheduler(model, new_cache(model), root=root)
    run = Run(scheduler)
    scheduler.add(1, sampled)
    scheduler.add(2, SequenceRequest(prompt(30, seed=7), 16))
    scheduler.add(3, SequenceRequest(sampled.prompt_ids, 16, SamplingParams(temperature=0.8, seed=124)))
    run.until_idle()
    assert run.tokens(1) == alone(model, root, sampled)
    assert run.tokens(1) != run.tokens(3)


def test_a_full_pool_fails_only_the_sequence_that_cannot_grow(model: Transformer, root: bytes) -> None:
    cache = new_cache(model, num_blocks=7)
    scheduler = BatchScheduler(model, cache, root=root)
    run = Run(scheduler)
    small = SequenceRequest(prompt(10, seed=8), 8)
    scheduler.add(1, small)
    scheduler.add(2, SequenceRequest(prompt(60, seed=9), 60))  # 4 blocks at once, 8 by its end
    run.until_idle()
    assert isinstance(run.failed(2).error, PoolExhaustedError)
    assert run.tokens(1) == alone(model, root, small)
    stats = cache.stats()
    assert stats.num_sequences == 0 and stats.used_blocks == 0


def test_abort_ends_a_sequence_between_steps(model: Transformer, root: bytes) -> None:
    cache = new_cache(model)
    scheduler = BatchScheduler(model, cache, root=root)
    run = Run(scheduler)
    other = SequenceRequest(prompt(12, seed=10), 8)
    scheduler.add(1, SequenceRequest(prompt(12, seed=11), 50))
    scheduler.add(2, other)
    scheduler.add(3, SequenceRequest(prompt(12, seed=12), 50))
    for _ in range(3):
        run.step()
    (finished,) = scheduler.abort(1)
    assert isinstance(finished, SequenceFinished) and finished.finish_reason == "aborted"
    assert finished.result.token_ids == run.tokens(1) and len(run.tokens(1)) == 3
    assert scheduler.abort(1) == []  # already gone
    (waiting,) = scheduler.abort(3)  # aborted while running too
    assert isinstance(waiting, SequenceFinished)
    run.until_idle()
    assert run.tokens(2) == alone(model, root, other)
    assert cache.stats().num_sequences == 0


def test_keep_sequence_leaves_it_to_its_owner(model: Transformer, root: bytes) -> None:
    cache = new_cache(model)
    scheduler = BatchScheduler(model, cache, root=root)
    scheduler.add(5, SequenceRequest(prompt(33, seed=13), 2, keep_sequence=True))
    Run(scheduler).until_idle()
    assert cache.has_sequence(5)
    cache.free_sequence(5)


def test_bad_requests_are_refused_before_queueing(model: Transformer, root: bytes) -> None:
    scheduler = BatchScheduler(model, new_cache(model), root=root)
    with pytest.raises(InvalidTokenError):
        scheduler.add(1, SequenceRequest((1, 999), 4))
    with pytest.raises(ContextLengthError):
        scheduler.add(1, SequenceRequest((1, 2), model.args.max_seq_len))
    scheduler.add(1, SequenceRequest((1, 2), 1))
    with pytest.raises(ValueError, match="already exists"):
        scheduler.add(1, SequenceRequest((1, 2), 1))
    with pytest.raises(ValueError, match="max_step_tokens"):
        SchedulerConfig(max_running_sequences=8, max_step_tokens=4)
    assert scheduler.num_waiting == 1 and scheduler.num_running == 0


def test_at_most_max_running_sequences_run_at_once(model: Transformer, root: bytes) -> None:
    scheduler = BatchScheduler(model, new_cache(model), root=root, config=SchedulerConfig(2, 64))
    for i in range(5):
        scheduler.add(i, SequenceRequest(prompt(8, seed=20 + i), 3))
    scheduler.step()
    assert scheduler.num_running == 2 and scheduler.num_waiting == 3
    Run(scheduler).until_idle()
    assert not scheduler.has_work()


def test_prefill_limit_moves_while_the_head_runs(model: Transformer, root: bytes) -> None:
    """A prompt-only sequence with a prefill limit stops there; raised, it goes on; lowered below what it
    has done, it finishes at once. What it committed is what a later sequence reuses."""
    cache = new_cache(model)
    scheduler = BatchScheduler(model, cache, root=root, config=SchedulerConfig(4, 16))
    head = prompt(96, seed=5)
    run = Run(scheduler)
    scheduler.add(1, SequenceRequest(head, 0, prefill_limit=32))
    run.step()
    assert scheduler.set_prefill_limit(1, 64)  # raised before it got there: it goes on
    run.until_idle()
    assert run.finished(1).result.computed_tokens == 64
    assert cache.match_prefix(run.finished(1).result.block_hashes) == 4
    scheduler.add(2, SequenceRequest(head, 0, prefill_limit=96))
    run.step()  # 16 more tokens: 80 of 96
    assert scheduler.set_prefill_limit(2, 64)  # lowered below what it did: finished before another forward
    run.step()
    finished = run.finished(2)
    assert finished.finish_reason == "length"
    assert (finished.result.cached_tokens, finished.result.computed_tokens) == (64, 16)
    assert not scheduler.set_prefill_limit(2, 96)  # gone
    full = SequenceRequest((*head, 9, 9), 5)
    scheduler.add(3, full)
    run.until_idle()
    assert run.finished(3).result.cached_tokens == 80
    assert run.tokens(3) == alone(model, root, full)
    with pytest.raises(ValueError, match="prompt-only"):
        scheduler.add(4, SequenceRequest(head, 3, prefill_limit=16))


def test_a_head_with_a_prefill_chunk_runs_in_chunks_of_that_size(model: Transformer, root: bytes) -> None:
    """Its chunks are ``prefill_chunk`` tokens however much of the step's budget is free, and they end at
    multiples of it: a chunk cut short by the budget is followed by the rest up to the next multiple."""
    cache = new_cache(model)
    scheduler = BatchScheduler(model, cache, root=root, config=SchedulerConfig(4, 40))
    run = Run(scheduler)
    first = SequenceRequest(prompt(30, seed=40), 2)  # admitted first: takes 30 of the first step's 40
    scheduler.add(1, first)
    scheduler.add(2, SequenceRequest(prompt(80, seed=41), 0, keep_sequence=True, prefill_limit=80,
                                     prefill_chunk=16))
    ends = []
    while not run.events(2):
        run.step()
        ends.append(cache.num_tokens(2))
    assert ends == [10, 16, 32, 48, 64, 80]
    assert run.finished(2).result.computed_tokens == 80
    run.until_idle()
    assert run.tokens(1) == alone(model, root, first)


def test_a_limit_lowered_mid_way_stops_the_head_at_its_next_chunk_boundary(
    model: Transformer, root: bytes
) -> None:
    """Each step re-reads the limit: lowered while the head runs, it stops at the first chunk boundary at or
    past the new limit, not a whole step budget (64 tokens here) later."""
    cache = new_cache(model)
    scheduler = BatchScheduler(model, cache, root=root, config=SchedulerConfig(4, 64))
    run = Run(scheduler)
    head = prompt(128, seed=42)
    scheduler.add(1, SequenceRequest(head, 0, prefill_limit=128, prefill_chunk=16))
    run.step()
    run.step()  # 32 of 128
    assert scheduler.set_prefill_limit(1, 48)
    run.step()  # up to the new limit, one chunk
    finished = run.finished(1)
    assert finished.result.computed_tokens == 48 and len(run.steps) == 3
    assert cache.match_prefix(finished.result.block_hashes) == 3
    # Without a chunk of its own the head takes the step's whole budget: 64 tokens before the same limit
    # (set after its first step) is read.
    scheduler.add(2, SequenceRequest(prompt(128, seed=43), 0, prefill_limit=128))
    run.step()
    assert scheduler.set_prefill_limit(2, 48)
    run.step()
    assert run.finished(2).result.computed_tokens == 64


def test_a_head_in_small_chunks_leaves_other_sequences_chunked_by_the_budget(
    model: Transformer, root: bytes
) -> None:
    """A sequence without a chunk of its own still takes whatever the step's budget leaves (here 64 less the
    head's 16), and generates what it generates alone."""
    cache = new_cache(model)
    scheduler = BatchScheduler(model, cache, root=root, config=SchedulerConfig(4, 64))
    run = Run(scheduler)
    other = SequenceRequest(prompt(100, seed=44), 3)
    scheduler.add(1, SequenceRequest(prompt(96, seed=45), 0, keep_sequence=True, prefill_limit=96,
                                     prefill_chunk=16))
    scheduler.add(2, other)
    other_ends = []
    for _ in range(3):
        run.step()
        other_ends.append(cache.num_tokens(2))
    assert other_ends == [48, 96, 100]
    run.until_idle()
    assert run.tokens(2) == alone(model, root, other)
    assert run.finished(1).result.computed_tokens == 96
    for bad in (0, -16, True, 16.0):
        with pytest.raises(ValueError, match="prefill_chunk"):
            scheduler.add(3, SequenceRequest((1, 2), 1, prefill_chunk=bad))  # type: ignore[arg-type]
