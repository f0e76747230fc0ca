"""The batching engine: its worker thread, token callbacks, cancellation, closing, and KV-pool admission."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from kvnet.cache.paged_cache import PagedKVCache
from kvnet.errors import InvalidTokenError
from kvnet.model.batching import SchedulerConfig, SequenceRequest
from kvnet.model.engine import (
    BatchEngine,
    EngineBusyError,
    EngineClosedError,
    KvAdmission,
    RequestTooLargeError,
    TokenCallback,
)
from kvnet.model.generate import cache_spec_for, generate
from kvnet.model.transformer import Transformer

CPU = torch.device("cpu")
BLOCK_SIZE = 16
WAIT_S = 120  # a bound for a loaded machine, never a speed expectation


@pytest.fixture
def engine(model: Transformer, root: bytes) -> Iterator[BatchEngine]:
    cache = PagedKVCache(cache_spec_for(model, BLOCK_SIZE), 64, CPU)
    engine = BatchEngine(model, cache, root=root, config=SchedulerConfig(4, 64))
    yield engine
    engine.close()


def setting(event: threading.Event) -> TokenCallback:
    """A token callback that sets ``event`` and keeps generating."""

    def callback(token_id: int) -> bool:
        event.set()
        return True

    return callback


def prompt(length: int, seed: int) -> tuple[int, ...]:
    return tuple(torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist())


def test_concurrent_submissions_stream_tokens_and_equal_generate(
    engine: BatchEngine, model: Transformer, root: bytes
) -> None:
    requests = [SequenceRequest(prompt(20 + 3 * i, seed=i), 10) for i in range(6)]  # more than run at once
    streamed: dict[int, list[int]] = {i: [] for i in range(6)}
    threads: set[str] = set()

    def on_token(index: int) -> TokenCallback:
        def callback(token_id: int) -> bool:
            threads.add(threading.current_thread().name)
            streamed[index].append(token_id)
            return True
        return callback

    handles = [engine.submit(r, on_token(i)) for i, r in enumerate(requests)]
    for i, (request, handle) in enumerate(zip(requests, handles, strict=True)):
        finished = handle.future.result(timeout=WAIT_S)
        cache = PagedKVCache(cache_spec_for(model, BLOCK_SIZE), 16, CPU)
        expected = generate(model, cache, list(request.prompt_ids), 10, root=root).token_ids
        assert finished.result.token_ids == expected == streamed[i]
    assert threads == {"kvnet-engine"}
    assert engine.cache.stats().num_sequences == 0


def test_a_callback_returning_false_ends_its_sequence_there(engine: BatchEngine) -> None:
    seen: list[int] = []

    def three(token_id: int) -> bool:
        seen.append(token_id)
        return len(seen) < 3

    finished = engine.submit(SequenceRequest(prompt(10, seed=1), 50), three).future.result(timeout=WAIT_S)
    assert finished.finish_reason == "aborted"
    assert finished.result.token_ids == seen and len(seen) == 3


def test_cancel_ends_a_running_sequence(engine: BatchEngine) -> None:
    started = threading.Event()
    handle = engine.submit(SequenceRequest(prompt(10, seed=2), 1000), setting(started))
    assert started.wait(WAIT_S)
    engine.cancel(handle.seq_id)
    finished = handle.future.result(timeout=WAIT_S)
    assert finished.finish_reason == "aborted" and len(finished.result.token_ids) < 1000


def test_bad_requests_fail_at_submit_and_close_fails_what_is_left(model: Transformer, root: bytes) -> None:
    cache = PagedKVCache(cache_spec_for(model, BLOCK_SIZE), 64, CPU)
    engine = BatchEngine(model, cache, root=root)
    with pytest.raises(InvalidTokenError):
        engine.submit(SequenceRequest((1, -1), 4))
    started = threading.Event()
    handle = engine.submit(SequenceRequest(prompt(10, seed=3), 1000), setting(started))
    assert started.wait(WAIT_S)
    engine.close()
    with pytest.raises(EngineClosedError):
        handle.future.result(timeout=WAIT_S)
    with pytest.raises(EngineClosedError):
        engine.submit(SequenceRequest((1, 2), 1))


def test_admission_reserves_worst_case_blocks_and_bounds_requests() -> None:
    admission = KvAdmission(num_blocks=10, block_size=16, max_requests=3)
    first = admission.admit(40, 24)  # 64 tokens: 4 blocks
    assert first.blocks == 4
    second = admission.admit(16, 16, sequences=2)  # 2 x 2 blocks
    with pytest.raises(EngineBusyError, match="sequences in flight") as busy:
        admission.admit(1, 1)
    assert busy.value.retry_after_s >= 1
    second.release()
    second.release()  # idempotent
    with pytest.raises(EngineBusyError, match="KV pool full"):
        admission.admit(100, 0)  # 7 blocks, 6 free
    with pytest.raises(RequestTooLargeError):
        admission.admit(150, 20)  # 11 blocks: more than the pool
    with pytest.raises(RequestTooLargeError):
        admission.admit(1, 1, sequences=4)
    with first:
        pass
    assert admission.reserved_blocks == 0 and admission.requests_in_flight == 0
    with admission.admit(100, 60):  # the whole pool once everything is released
        assert admission.reserved_blocks == 10
