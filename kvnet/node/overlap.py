"""Fetch and compute at once: the engine computes the head of a located prefix while its tail is fetched.

Owns ``fetch_and_compute``, which runs an ``AbrPlan`` with ``compute_blocks > 0`` (``kvnet.exchange.abr``,
"Fetch and compute at once"; Cake, ICML 2025). The two sides meet in the middle, and the meeting point
moves with what each side actually achieves rather than staying where the estimates put it:

* the head is one prompt-only sequence in the batching engine (``SequenceRequest.prefill_limit``), so it
  runs as prefill chunks beside other requests' work, sized from the measured cost of a forward
  (``KvAbr.head_chunk_tokens``) so that it stops soon after the limit comes down without paying a
  forward's fixed cost too often. It computes forward from the first missing
  block, and its limit is always the lowest block the fetch has delivered so far: if the fetch falls
  behind, the head goes on past its planned share (compute takes more), up to every block;
* the fetch loads the planned tail backwards, from the last block down to the planned split (or the end
  of the head's first forward, if that computes past it), each block
  verified on its own identity exactly as a prefix fetch does (the order of arrival does not matter to the
  checks). Each delivered block lowers the head's limit. If the fetch reaches the split before the head
  does, it re-plans what lies between the two with the current estimates (``best_split``) and fetches
  further down (fetch takes more), never into the chunk the head's forward is computing (those blocks
  are computed whatever arrives; fetching them would only take cores from the forward);
* a fetch that fails or stalls only stops lowering the limit: the head computes the rest. Once the head
  reaches the fetched run the fetch is cancelled, whatever it still had in flight.

Fetched blocks keep every check of ``kvnet.exchange.fetching``; computed ones are this node's own. Both end in
the paged cache under their chain hashes, so the request that follows (the suffix and generation) finds
the whole prefix there like any cache hit. Nothing here reads the network or the model directly: the
caller passes the engine, the fetch and the cache lookup.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from kvnet.blocks.identity import BlockIdentity
from kvnet.exchange.abr import AbrPlan, KvAbr, best_split
from kvnet.exchange.fetching import FetchOutcome
from kvnet.model.batching import SequenceFinished, SequenceRequest
from kvnet.model.engine import BatchEngine

logger = logging.getLogger(__name__)

FetchBlocks = Callable[[list[BlockIdentity], list[str], FetchOutcome, Callable[[int], None]],
                       Awaitable[FetchOutcome]]
"""``fetch(expected, renditions, outcome, on_loaded)``: ``RelayPeer.fetch`` filling ``outcome`` in place."""


@dataclass
class OverlapResult:
    """What ``fetch_and_compute`` did; block counts are of the located prefix after the local hits."""

    planned_head_blocks: int
    head_blocks: int = 0
    """Blocks the engine computed (the head), including any it reached while the fetch delivered them too."""
    fetched_blocks: int = 0
    """Blocks taken from the fetch: the run it delivered ending at the last planned block, less any the
    head reached too (computed, so counted there)."""
    head_start_tokens: int = 0
    """Prompt position the head started computing at (the tokens the cache held before it)."""
    head_end_tokens: int = 0
    """Prompt position the head computed up to (absolute, floored to a block)."""
    head_computed_tokens: int = 0
    head_compute_s: float = 0.0
    """The head's share of the engine's forwards (``SequenceFinished.prefill_compute_seconds``)."""
    fetch_extensions: int = 0
    """Times the fetch took more than its planned share (it reached the split before the head did)."""
    head_s: float = 0.0
    """Seconds until the head reached the fetched run (or failed)."""
    fetch_s: float = 0.0
    """Seconds until the fetch side ended: done, failed, or cancelled once the head reached it."""
    fetch: FetchOutcome = field(default_factory=FetchOutcome)
    head_error: str | None = None

    def to_json(self) -> dict[str, int | float | str | None]:
        return {
            "planned_head_blocks": self.planned_head_blocks,
            "head_blocks": self.head_blocks,
            "fetched_blocks": self.fetched_blocks,
            "fetch_extensions": self.fetch_extensions,
            "head_s": round(self.head_s, 6),
            "fetch_s": round(self.fetch_s, 6),
            "head_error": self.head_error,
        }


async def fetch_and_compute(
    *,
    engine: BatchEngine,
    fetch: FetchBlocks,
    cached_prefix: Callable[[Sequence[bytes]], int],
    abr: KvAbr,
    plan: AbrPlan,
    ids: Sequence[int],
    hashes: Sequence[bytes],
    start: int,
    expected: Sequence[BlockIdentity],
    block_size: int,
    block_raw_bytes: int,
) -> OverlapResult:
    """Compute blocks ``[start, start + plan.compute_blocks)`` in ``engine`` while fetching the rest of
    ``[start, start + plan.fetch_blocks)``, moving the split as both progress (see the module docstring).

    ``expected[i]`` is block ``start + i``'s identity; ``cached_prefix(hashes)`` counts the leading hashes
    the cache holds. Returns once every block of the range is in the cache (or the head could not run:
    ``head_error``); the fetch is cancelled by then. Cancelling this cancels both sides."""
    b = block_size
    hi = start + plan.fetch_blocks
    result = OverlapResult(planned_head_blocks=plan.compute_blocks)
    out = result.fetch
    frontier = hi
    """Lowest block of the contiguous run the fetch delivered, ending at ``hi``."""
    chunk = abr.head_chunk_tokens(b, plan.compute_blocks)
    head = engine.submit(  # the limit is re-read per chunk
        SequenceRequest(tuple(ids[: hi * b]), 0, commit_prompt=True, prefill_limit=hi * b,
                        prefill_chunk=chunk)
    )

    def delivered(block: int) -> None:
        nonlocal frontier
        if block == frontier - 1:
            frontier = block
            engine.set_prefill_limit(head.seq_id, frontier * b)

    def on_loaded(order: list[int]) -> Callable[[int], None]:
        return lambda j: delivered(order[j])

    async def fetch_side() -> None:
        lo, top = min(max(start + plan.compute_blocks, head_chunk_end(start, chunk, b)), hi), hi
        while lo < top:
            order = list(range(top - 1, lo - 1, -1))  # backwards: towards the head
            renditions = [_rendition(plan, i - start) for i in order]
            await fetch([expected[i - start] for i in order], renditions, out, on_loaded(order))
            if out.error is not None or frontier > lo:
                return  # the head computes what is missing
            # The fetch reached its share before the head: split what lies between them again, with the
            # estimates as they are now (the head's part costs no new prefill: it is running).
            first = min(head_chunk_end(start + cached_prefix(hashes[start:lo]), chunk, b), lo)
            if first >= lo:
                return
            renditions = [_rendition(plan, i - start) for i in range(first, lo)]
            costs = [abr.block_fetch_cost(block_raw_bytes, r, beside_compute=True) for r in renditions]
            extra = [abr.decode_beside_head(block_raw_bytes, r) for r in renditions]
            head_cost = abr.head_cost(b, chunk_tokens=chunk, context_tokens=first * b)
            k, _ = best_split(costs, abr.fetch_latency_s(), head_cost, extra)
            if first + k >= lo:
                return
            result.fetch_extensions += 1
            top, lo = lo, first + k

    started = time.perf_counter()

    async def timed_fetch_side() -> None:
        try:
            await fetch_side()
        finally:
            result.fetch_s = time.perf_counter() - started

    fetch_task = asyncio.ensure_future(timed_fetch_side())
    try:
        finished: SequenceFinished | None = None
        try:
            finished = await asyncio.shield(asyncio.wrap_future(head.future))
        except Exception as exc:  # the engine failed the head: the request's own prefill computes it
            result.head_error = str(exc) or type(exc).__name__
            logger.warning("head of the prefix failed (%s); the request computes it", result.head_error)
        result.head_s = time.perf_counter() - started
    except BaseException:
        engine.cancel(head.seq_id)
        raise
    finally:
        fetch_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await fetch_task
    if finished is not None:
        r = finished.result
        result.head_computed_tokens = r.computed_tokens
        result.head_start_tokens = r.cached_tokens
        result.head_compute_s = finished.prefill_compute_seconds
        result.head_end_tokens = min((r.cached_tokens + r.computed_tokens) // b * b, hi * b)
        result.head_blocks = max(result.head_end_tokens // b - start, 0)
    # Blocks the head reached were computed whoever else delivered them: the fetch's share is the rest.
    result.fetched_blocks = max(hi - max(frontier, result.head_end_tokens // b), 0)
    return result


def head_chunk_end(done_blocks: int, chunk_tokens: int, block_size: int) -> int:
    """The block the head's forward in flight (or next) computes up to, ``done_blocks`` blocks in: its
    chunks end at multiples of ``chunk_tokens`` (whole blocks), and it computes them whatever arrives
    meanwhile, so the fetch never starts below this (it would only take cores from the forward)."""
    return (done_blocks * block_size // chunk_tokens + 1) * chunk_tokens // block_size


def _rendition(plan: AbrPlan, index: int) -> str:
    """The rendition to fetch block ``index`` of the plan in (every block of a split plan has one)."""
    best = plan.choices[index].best
    assert best is not None, "a split plan only covers blocks with an acceptable rendition"
    return best
