"""The batching engine: one worker thread drives a `BatchScheduler`; admission is bounded by the KV pool.

Owns the thread, the hand-over of requests between the caller's thread (the node's event loop) and the
worker, and admission. A caller first `admit`s a request: a reservation of the KV blocks its prompt plus
``max_new_tokens`` can occupy at most, refused with `EngineBusyError` (retry later) when the pool's
reservations or the number of requests in flight are at their bound, and with `RequestTooLargeError` when it
could never fit. It then `submit`s the sequence and waits on a `concurrent.futures.Future` of its
`SequenceFinished`; ``on_token`` runs in the worker thread as each token is chosen (returning False ends the
sequence there, as with `generate`), and `cancel` ends a sequence whose client went away. Because every
admitted request's worst case fits in the pool together, a running sequence never finds the pool empty.

It knows nothing about asyncio, HTTP or the network; the model and cache are used only through
`BatchScheduler`.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvnet.cache.paged_cache import PagedKVCache
from kvnet.errors import KVCacheError
from kvnet.model.batching import (
    BatchScheduler,
    SchedulerConfig,
    SchedulerEvent,
    SequenceFailed,
    SequenceFinished,
    SequenceRequest,
    TokenGenerated,
    validate_request,
)
from kvnet.model.transformer import Transformer

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1
"""Seconds a refused client is told to wait: about one short generation of the running set."""

TokenCallback = Callable[[int], bool]
"""Called in the worker thread with each generated id; returning False ends the sequence there."""


class EngineBusyError(KVCacheError):
    """The engine is full right now (KV pool reservations or requests in flight); retry later."""

    def __init__(self, message: str, retry_after_s: int = RETRY_AFTER_S) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        """Whole seconds to wait before retrying."""


class RequestTooLargeError(KVCacheError, ValueError):
    """A request needs more KV blocks than the whole pool has: retrying cannot help."""


class EngineClosedError(KVCacheError):
    """The engine was closed before the sequence finished."""


@dataclass(eq=False)
class Admission:
    """A request's reservation in the KV pool, held until `release` (idempotent; also on ``with`` exit)."""

    blocks: int
    """Blocks reserved: the most the request's sequences can hold at once."""
    sequences: int
    """Sequences the reservation is for (counted against the bound on requests in flight)."""
    _owner: KvAdmission = field(repr=False)
    _released: bool = field(default=False, repr=False)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._owner._release(self)

    def __enter__(self) -> Admission:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


class KvAdmission:
    """Thread-safe bookkeeping of reservations against a pool of ``num_blocks`` and a request bound."""

    def __init__(self, num_blocks: int, block_size: int, max_requests: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_requests = max_requests
        self._lock = threading.Lock()
        self._reserved = 0
        self._requests = 0
        self.refused = 0
        """Admissions refused as busy so far (`EngineBusyError`)."""

    @property
    def reserved_blocks(self) -> int:
        return self._reserved

    @property
    def requests_in_flight(self) -> int:
        return self._requests

    def blocks_needed(self, prompt_tokens: int, max_new_tokens: int, sequences: int = 1) -> int:
        """Worst-case blocks of ``sequences`` sequences of a prompt and ``max_new_tokens`` each."""
        return sequences * -(-(prompt_tokens + max_new_tokens) // self.block_size)

    def admit(self, prompt_tokens: int, max_new_tokens: int, sequences: int = 1) -> Admission:
        """Reserve the worst case of ``sequences`` sequences, or raise `EngineBusyError` /
        `RequestTooLargeError` with nothing reserved."""
        blocks = self.blocks_needed(prompt_tokens, max_new_tokens, sequences)
        if blocks > self.num_blocks:
            raise RequestTooLargeError(
                f"{sequences} x ({prompt_tokens} prompt + {max_new_tokens} new) tokens need {blocks} KV "
                f"blocks; the pool has {self.num_blocks}"
            )
        if sequences > self.max_requests:
            raise RequestTooLargeError(
                f"{sequences} sequences in one request; at most {self.max_requests} run at once"
            )
        with self._lock:
            if self._requests + sequences > self.max_requests:
                self.refused += 1
                raise EngineBusyError(
                    f"busy: {self._requests} sequences in flight (limit {self.max_requests}); retry later"
                )
            if self._reserved + blocks > self.num_blocks:
                self.refused += 1
                raise EngineBusyError(
                    f"busy: KV pool full ({self._reserved} of {self.num_blocks} blocks reserved, "
                    f"{blocks} needed); retry later"
                )
            self._reserved += blocks
            self._requests += sequences
        return Admission(blocks, sequences, self)

    def _release(self, admission: Admission) -> None:
        with self._lock:
            self._reserved -= admission.blocks
            self._requests -= admission.sequences


@dataclass(frozen=True)
class SequenceHandle:
    """A submitted sequence: its id (for `BatchEngine.cancel`) and the future of how it ended."""

    seq_id: int
    future: Future[SequenceFinished]
    """Resolves with the `SequenceFinished` event, or fails with the `SequenceFailed` error."""


class BatchEngine:
    """A `BatchScheduler` driven by one worker thread, with `KvAdmission` in front of it."""

    def __init__(
        self,
        model: Transformer,
        cache: PagedKVCache,
        *,
        root: bytes,
        config: SchedulerConfig | None = None,
        name: str = "kvnet-engine",
    ) -> None:
        self.model = model
        self.cache = cache
        self.scheduler = BatchScheduler(model, cache, root=root, config=config)
        self.config = self.scheduler.config
        self.admission = KvAdmission(
            cache.num_blocks, cache.spec.block_size, self.config.max_running_sequences
        )
        self._cond = threading.Condition()
        self._inbox: list[tuple[int, SequenceRequest]] = []
        self._cancels: list[int] = []
        self._limits: list[tuple[int, int]] = []
        self._futures: dict[int, Future[SequenceFinished]] = {}
        self._callbacks: dict[int, TokenCallback] = {}
        self._seq_ids = itertools.count(1)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def serving(self) -> bool:
        """True while the worker thread runs and the engine takes sequences (until `close`)."""
        return not self._closed and self._thread.is_alive()

    def admit(self, prompt_tokens: int, max_new_tokens: int, sequences: int = 1) -> Admission:
        """`KvAdmission.admit` on this engine's pool."""
        return self.admission.admit(prompt_tokens, max_new_tokens, sequences)

    def submit(self, request: SequenceRequest, on_token: TokenCallback | None = None) -> SequenceHandle:
        """Queue a sequence; raises `InvalidTokenError` / `ContextLengthError` / `ValueError` at once for a
        request that cannot run, `EngineClosedError` after `close`."""
        validate_request(self.model, request)
        future: Future[SequenceFinished] = Future()
        with self._cond:
            if self._closed:
                raise EngineClosedError("the engine is closed")
            seq_id = next(self._seq_ids)
            self._futures[seq_id] = future
            if on_token is not None:
                self._callbacks[seq_id] = on_token
            self._inbox.append((seq_id, request))
            self._cond.notify()
        return SequenceHandle(seq_id, future)

    def cancel(self, seq_id: int) -> None:
        """End a sequence before its next step (its future resolves with the tokens so far)."""
        with self._cond:
            self._cancels.append(seq_id)
            self._cond.notify()

    def set_prefill_limit(self, seq_id: int, tokens: int) -> None:
        """Move the prefill limit of a sequence submitted with one (`SequenceRequest.prefill_limit`),
        before its next step; ignored once it has finished."""
        with self._cond:
            self._limits.append((seq_id, tokens))
            self._cond.notify()

    def close(self) -> None:
        """Stop the worker after its current step; unfinished sequences fail with `EngineClosedError`."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    # -- the worker thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        scheduler = self.scheduler
        while True:
            with self._cond:
                while not (self._closed or self._inbox or self._cancels or self._limits
                           or scheduler.has_work()):
                    self._cond.wait()
                if self._closed:
                    break
                inbox, self._inbox = self._inbox, []
                cancels, self._cancels = self._cancels, []
                limits, self._limits = self._limits, []
            events: list[SchedulerEvent] = []
            for seq_id, request in inbox:
                try:
                    scheduler.add(seq_id, request)
                except (KVCacheError, ValueError) as exc:
                    events.append(SequenceFailed(seq_id, exc))
            for seq_id in cancels:
                events.extend(scheduler.abort(seq_id))
            for seq_id, tokens in limits:
                scheduler.set_prefill_limit(seq_id, tokens)
            try:
                if scheduler.has_work():
                    events.extend(scheduler.step())
            except Exception as exc:  # a bug, not a bad request: fail what was running, keep serving
                logger.exception("batching step failed; failing the sequences it held")
                events.extend(SequenceFailed(event.seq_id, exc) for event in scheduler.abort_all())
            self._dispatch(events)
        self._fail_all()

    def _dispatch(self, events: list[SchedulerEvent]) -> None:
        pending = list(events)
        while pending:
            event = pending.pop(0)
            if isinstance(event, TokenGenerated):
                callback = self._callbacks.get(event.seq_id)
                if callback is None:
                    continue
                try:
                    wanted = callback(event.token_id)
                except Exception:
                    logger.exception("token callback of sequence %d failed; ending it", event.seq_id)
                    wanted = False
                if not wanted:
                    self._callbacks.pop(event.seq_id, None)
                    pending.extend(self.scheduler.abort(event.seq_id))
            elif isinstance(event, SequenceFinished):
                future = self._resolve(event.seq_id)
                if future.set_running_or_notify_cancel():  # False: its caller cancelled the future
                    future.set_result(event)
            elif isinstance(event, SequenceFailed):
                future = self._resolve(event.seq_id)
                if future.set_running_or_notify_cancel():
                    future.set_exception(event.error)

    def _resolve(self, seq_id: int) -> Future[SequenceFinished]:
        self._callbacks.pop(seq_id, None)
        with self._cond:
            return self._futures.pop(seq_id)

    def _fail_all(self) -> None:
        for seq_id, _ in self._inbox:
            self._futures.pop(seq_id).set_exception(EngineClosedError("the engine closed"))
        while self.scheduler.has_work():
            for event in self.scheduler.abort_all():
                self._futures.pop(event.seq_id).set_exception(EngineClosedError("the engine closed"))
