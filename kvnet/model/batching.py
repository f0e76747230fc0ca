"""Continuous batching over the paged KV cache: a sans-I/O scheduler whose `step` runs one forward.

This module owns which sequences run together. `BatchScheduler.step` takes the running set, builds ONE
batch out of it (a decode token of every sequence that has one, then prefill chunks of sequences still
reading their prompt, within a per-step token budget so a long prompt never stalls everyone's decode), runs
`Transformer.forward_batch` over their own block tables, samples each sequence's next token exactly as
`kvnet.model.generate.generate` does (`TokenSampler`, stop ids, ``max_new_tokens``) and returns what happened
as events. It owns no thread, no queue and no clock of its own (the clock is injected); the driver that runs
it (`kvnet.model.engine`) decides when to step. It knows nothing about HTTP, the relay or codecs.

Greedy outputs equal `generate` on the same prompt up to the rounding of batched matrix products: in
float32 torch's CPU GEMM takes other kernels for 1-3 rows than for more, so a decode row in a batch can
differ from the unbatched one in the last bits; bfloat16 products measured bit-identical.
Attention is computed per sequence (`BatchedPagedAttention`), identical to the unbatched path.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kvnet.cache.hashing import block_hashes
from kvnet.cache.paged_cache import PagedKVCache
from kvnet.errors import KVCacheError
from kvnet.model.attention import BatchSegment
from kvnet.model.defaults import DEFAULT_MAX_RUNNING_SEQUENCES, DEFAULT_PREFILL_CHUNK
from kvnet.model.generate import (
    GREEDY,
    GenerationResult,
    SamplingParams,
    TokenSampler,
    check_cache_matches,
    check_context_length,
    commit_prompt_blocks,
    validate_token_ids,
)
from kvnet.model.transformer import Transformer


@dataclass(frozen=True)
class SchedulerConfig:
    """Bounds of one `BatchScheduler`."""

    max_running_sequences: int = DEFAULT_MAX_RUNNING_SEQUENCES
    """Sequences in the running set at once; more wait (FIFO) until one finishes."""
    max_step_tokens: int = DEFAULT_PREFILL_CHUNK
    """Tokens of one forward (decode tokens first, then prefill chunks): bounds a step's latency and the
    [T, S] attention masks. At least ``max_running_sequences``, so every running decode fits."""

    def __post_init__(self) -> None:
        for name in ("max_running_sequences", "max_step_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"SchedulerConfig.{name} must be a positive int, got {value!r}")
        if self.max_step_tokens < self.max_running_sequences:
            raise ValueError(
                f"SchedulerConfig.max_step_tokens ({self.max_step_tokens}) must be >= max_running_sequences "
                f"({self.max_running_sequences}): every running sequence decodes in each step"
            )


@dataclass(frozen=True)
class SequenceRequest:
    """One prompt to run: what `generate` takes, as data."""

    prompt_ids: tuple[int, ...]
    """The prompt's token ids."""
    max_new_tokens: int
    """Most tokens to generate (0: prefill and commit only, as a publisher does)."""
    sampling: SamplingParams = GREEDY
    """How each next token is chosen."""
    stop_token_ids: frozenset[int] = frozenset()
    """Generation ends after producing one of these."""
    commit_prompt: bool = True
    """Register the prompt's full blocks in the cache once prefilled (shareable, exportable)."""
    keep_sequence: bool = False
    """Leave the sequence in the cache when it finishes (its owner frees it, e.g. after exporting blocks)."""
    prefill_limit: int | None = None
    """Prefill only the first this many prompt tokens (None: all), for a prompt-only request
    (``max_new_tokens == 0``): the head of a prefix computed while its tail is fetched. Moved up or down
    while the sequence runs (`BatchScheduler.set_prefill_limit`); it finishes once it has prefilled up to
    the limit (or past it, when the limit was lowered below what it had done)."""
    prefill_chunk: int | None = None
    """Most prompt tokens this sequence prefills in one step, its chunks ending at multiples of it (None:
    as many as the step's budget leaves, as for every other sequence). Each step re-reads the prefill limit,
    so a head whose limit is lowered while it runs stops within one such chunk of the new limit instead of
    one step budget; the price is a forward per chunk."""


# -- events --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SchedulerEvent:
    """Something that happened to one sequence during a step."""

    seq_id: int
    """The sequence it concerns."""


@dataclass(frozen=True, slots=True)
class TokenGenerated(SchedulerEvent):
    """A token was chosen for the sequence (streamed to its client at once)."""

    token_id: int
    """The generated id."""


@dataclass(frozen=True, slots=True)
class SequenceFinished(SchedulerEvent):
    """The sequence ended; its blocks were released unless it asked to be kept."""

    result: GenerationResult
    """Tokens, cache reuse and timings, as `generate` reports them."""
    finish_reason: str
    """``stop`` (a stop id), ``length`` (``max_new_tokens``) or ``aborted`` (`BatchScheduler.abort`)."""
    first_token_time: float | None
    """Clock value when the first token was chosen (None when there was none)."""
    prefill_compute_seconds: float
    """This sequence's share of the forwards that prefilled it (each step's time split by tokens): what its
    prefill cost the model, without the time other sequences' work took (``result.prefill_seconds``)."""


@dataclass(frozen=True, slots=True)
class SequenceFailed(SchedulerEvent):
    """The sequence could not run (the pool ran out, the forward failed); its blocks were released."""

    error: Exception
    """What went wrong."""


# -- the scheduler -------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Sequence:
    seq_id: int
    request: SequenceRequest
    ids: Tensor  # [P] int64 on the model's device
    hashes: tuple[bytes, ...]
    sampler: TokenSampler
    submitted_at: float
    cached_tokens: int = 0
    prefilled: int = 0  # prompt positions whose K/V is in the cache
    next_token: int | None = None  # chosen, its K/V not computed yet
    generated: list[int] = field(default_factory=list)
    started_at: float | None = None
    prefill_compute_s: float = 0.0
    first_token_at: float | None = None
    prefill_limit: int | None = None

    @property
    def prompt_tokens(self) -> int:
        return int(self.ids.shape[0])

    @property
    def prefill_target(self) -> int:
        """Prompt tokens this sequence prefills: all of them, or up to its limit."""
        if self.prefill_limit is None:
            return self.prompt_tokens
        return min(self.prefill_limit, self.prompt_tokens)

    @property
    def in_prefill(self) -> bool:
        return self.prefilled < self.prefill_target


@dataclass(frozen=True, slots=True)
class _Chunk:
    """One sequence's part of a step: ``length`` tokens from position ``start``, at ``slots``."""

    seq: _Sequence
    start: int
    length: int
    slots: Tensor  # [length] flat cache slots


def validate_request(model: Transformer, request: SequenceRequest) -> Tensor:
    """The prompt as a tensor; `InvalidTokenError` / `ContextLengthError` / `ValueError` if it cannot run."""
    ids = validate_token_ids(model, list(request.prompt_ids))
    check_context_length(model, int(ids.shape[0]), request.max_new_tokens)
    if request.prefill_limit is not None:
        if request.max_new_tokens != 0:
            raise ValueError("prefill_limit is for prompt-only requests (max_new_tokens == 0)")
        if request.prefill_limit < 0:
            raise ValueError(f"prefill_limit must be >= 0, got {request.prefill_limit}")
    chunk = request.prefill_chunk
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0):
        raise ValueError(f"prefill_chunk must be a positive int, got {chunk!r}")
    return ids


class BatchScheduler:
    """Runs many sequences over one paged cache, one batched forward per `step`.

    ``add`` queues a sequence; ``step`` admits waiting sequences into the running set (up to
    ``max_running_sequences``), runs one forward and returns the events; ``abort`` ends a sequence between
    steps. Not thread-safe: one thread drives it (the cache it uses is).
    """

    def __init__(
        self,
        model: Transformer,
        cache: PagedKVCache,
        *,
        root: bytes,
        config: SchedulerConfig | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        check_cache_matches(model, cache)
        self.model = model
        self.cache = cache
        self.root = root
        self.config = config or SchedulerConfig()
        self._clock = clock
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []  # in admission order: prefill chunks go first come, first served
        self._ids: set[int] = set()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def add(self, seq_id: int, request: SequenceRequest) -> None:
        """Queue a sequence. Raises `InvalidTokenError`, `ContextLengthError` or `ValueError` (bad request or
        a duplicate ``seq_id``) before anything is queued."""
        if seq_id in self._ids or self.cache.has_sequence(seq_id):
            raise ValueError(f"sequence {seq_id} already exists")
        ids = validate_request(self.model, request)
        hashes = tuple(block_hashes(ids.cpu().numpy(), self.cache.spec.block_size, self.root))
        self._waiting.append(
            _Sequence(seq_id, request, ids, hashes, TokenSampler(request.sampling), self._clock(),
                      prefill_limit=request.prefill_limit)
        )
        self._ids.add(seq_id)

    def set_prefill_limit(self, seq_id: int, tokens: int) -> bool:
        """Move the prefill limit of a waiting or running sequence that has one (`SequenceRequest.
        prefill_limit`); it takes effect at the next step. False when there is no such sequence."""
        if tokens < 0:
            raise ValueError(f"prefill limit must be >= 0, got {tokens}")
        for seq in (*self._waiting, *self._running):
            if seq.seq_id == seq_id and seq.prefill_limit is not None:
                seq.prefill_limit = tokens
                return True
        return False

    def abort(self, seq_id: int) -> list[SchedulerEvent]:
        """End ``seq_id`` now, keeping the tokens it produced; [] if it is not waiting or running."""
        for queue in (self._waiting, self._running):
            for seq in queue:
                if seq.seq_id == seq_id:
                    queue.remove(seq)
                    return [self._finish(seq, "aborted")]
        return []

    def abort_all(self) -> list[SchedulerEvent]:
        """`abort` every waiting and running sequence."""
        seq_ids = [seq.seq_id for seq in (*self._waiting, *self._running)]
        return [event for seq_id in seq_ids for event in self.abort(seq_id)]

    def step(self) -> list[SchedulerEvent]:
        """Admit waiting sequences, run one batched forward, and return what happened."""
        events: list[SchedulerEvent] = []
        self._admit(events)
        for seq in list(self._running):
            if seq.prefill_limit is not None and not seq.in_prefill:
                # Its limit was reached (or lowered below what it had done) between steps.
                self._running.remove(seq)
                events.append(self._finish(seq, "length"))
        batch = self._plan(events)
        if not batch:
            return events
        started = self._clock()
        try:
            logits = self._forward(batch)  # [len(batch), vocab]
        except Exception as exc:  # a failed forward fails its sequences, not the driver
            for chunk in batch:
                self._running.remove(chunk.seq)
                events.append(self._fail(chunk.seq, exc))
            return events
        seconds_per_token = (self._clock() - started) / sum(chunk.length for chunk in batch)
        for row, chunk in enumerate(batch):
            seq = chunk.seq
            if seq.in_prefill:
                seq.prefilled = chunk.start + chunk.length
                seq.prefill_compute_s += seconds_per_token * chunk.length
                if seq.request.commit_prompt:
                    # Written full blocks are final: registered now, prompts admitted later share them.
                    commit_prompt_blocks(self.cache, seq.seq_id, seq.hashes)
                if seq.in_prefill:
                    continue  # more prompt chunks to go before a token can be chosen
                if seq.request.max_new_tokens == 0:
                    self._running.remove(seq)
                    events.append(self._finish(seq, "length"))
                    continue
            self._choose(seq, logits[row], events)
        return events

    # -- internals ---------------------------------------------------------------------------------------

    def _admit(self, events: list[SchedulerEvent]) -> None:
        while self._waiting and len(self._running) < self.config.max_running_sequences:
            seq = self._waiting.popleft()
            try:
                seq.cached_tokens = self.cache.add_sequence(seq.seq_id, seq.ids, seq.hashes)
            except KVCacheError as exc:
                self._ids.discard(seq.seq_id)
                events.append(SequenceFailed(seq.seq_id, exc))
                continue
            seq.prefilled = seq.cached_tokens
            seq.started_at = self._clock()
            self._running.append(seq)

    def _plan(self, events: list[SchedulerEvent]) -> list[_Chunk]:
        """This step's chunks with their slots reserved: a decode token of each sequence, then prefills."""
        budget = self.config.max_step_tokens
        wanted: list[tuple[_Sequence, int, int]] = []
        for seq in self._running:
            if not seq.in_prefill:
                wanted.append((seq, self.cache.num_tokens(seq.seq_id), 1))
                budget -= 1
        for seq in self._running:
            if seq.in_prefill and budget > 0:
                length = min(seq.prefill_target - seq.prefilled, budget)
                chunk = seq.request.prefill_chunk
                if chunk is not None:  # up to the next multiple of its chunk, even after a cut-short one
                    length = min(length, chunk - seq.prefilled % chunk)
                wanted.append((seq, seq.prefilled, length))
                budget -= length
        batch: list[_Chunk] = []
        for seq, start, length in wanted:
            try:
                slots = self.cache.append_slots(seq.seq_id, length)
            except KVCacheError as exc:  # the pool ran dry: this sequence fails, the others go on
                self._running.remove(seq)
                events.append(self._fail(seq, exc))
                continue
            batch.append(_Chunk(seq, start, length, slots))
        return batch

    @torch.no_grad()
    def _forward(self, batch: list[_Chunk]) -> Tensor:
        device = self.model.device
        tokens: list[Tensor] = []
        segments: list[BatchSegment] = []
        offset = 0
        for chunk in batch:
            seq, start, length = chunk.seq, chunk.start, chunk.length
            if seq.in_prefill:
                tokens.append(seq.ids[start : start + length])
            else:
                assert seq.next_token is not None
                tokens.append(torch.tensor([seq.next_token], dtype=torch.int64, device=device))
            segments.append(BatchSegment(offset, length, self.cache.block_table(seq.seq_id), start + length))
            offset += length
        positions = torch.cat([torch.arange(c.start, c.start + c.length, device=device) for c in batch])
        slot_mapping = torch.cat([c.slots for c in batch])
        return self.model.forward_batch(torch.cat(tokens), positions, self.cache, slot_mapping, segments)

    def _choose(self, seq: _Sequence, logits: Tensor, events: list[SchedulerEvent]) -> None:
        token = seq.sampler(logits)
        if seq.first_token_at is None:
            seq.first_token_at = self._clock()
        seq.generated.append(token)
        events.append(TokenGenerated(seq.seq_id, token))
        if token in seq.request.stop_token_ids:
            self._running.remove(seq)
            events.append(self._finish(seq, "stop"))
        elif len(seq.generated) >= seq.request.max_new_tokens:
            self._running.remove(seq)
            events.append(self._finish(seq, "length"))  # the last token's K/V is never needed
        else:
            seq.next_token = token

    def _release(self, seq: _Sequence, keep: bool) -> None:
        self._ids.discard(seq.seq_id)
        if not keep and self.cache.has_sequence(seq.seq_id):
            self.cache.free_sequence(seq.seq_id)

    def _finish(self, seq: _Sequence, reason: str) -> SequenceFinished:
        self._release(seq, seq.request.keep_sequence)
        now = self._clock()
        started = seq.started_at if seq.started_at is not None else now
        prefill_done = seq.first_token_at if seq.first_token_at is not None else now
        result = GenerationResult(
            token_ids=list(seq.generated),
            prompt_tokens=seq.prompt_tokens,
            cached_tokens=seq.cached_tokens,
            computed_tokens=max(seq.prefilled - seq.cached_tokens, 0),
            block_hashes=seq.hashes,
            prefill_seconds=prefill_done - started,
            decode_seconds=now - prefill_done,
        )
        return SequenceFinished(seq.seq_id, result, reason, seq.first_token_at, seq.prefill_compute_s)

    def _fail(self, seq: _Sequence, error: Exception) -> SequenceFailed:
        self._release(seq, keep=False)
        return SequenceFailed(seq.seq_id, error)

