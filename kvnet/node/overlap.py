"""Fetch and compute at once: the engine computes the head of a located prefix while its tail is fetched.

Owns ``fetch_and_compute``, which runs an ``AbrPlan`` with ``compute_blocks > 0`` (``kvnet.exchange.abr``,
"Fetch and compute at once"; Cake, ICML 2025). The two sides meet in the middle, and the meeting point
moves with what each side actually achieves rather than staying where the estimates put it:

* the head is one prompt-only sequence in the batching engine (``SequenceRequest.prefill_limit``), so it
  runs as prefill chunks beside other requests' work, sized from the measured cost of a forward
  (``KvAbr.head_chunk_tokens``) so that it stops soon after the limit comes down without paying a
  forward's fixed cost too often. It computes forward from the first missing block;
* the fetch loads every block past the head's first forward backwards, from the last block down, each
  block verified on its own identity exactly as a prefix fetch does (the order of arrival does not
  matter to the checks);
* each delivered block re-plans where the head stops (``best_split`` over the blocks between the end of
  the forward the head is computing and the lowest block delivered), with the rate the fetch has
  achieved so far and the head's measured cost: a head that would start a forward the fetch gets through
  sooner stops instead (on a CPU node a forward, once started, runs to its end: one started just before
  the fetch arrived cost up to a forward's time, a 4-block chunk 0.3 s over a 0.5 s fetch); a fetch that
  falls behind lets the head go on past its planned share, up to every block;
* the head stopped, the request waits for the fetch to reach it, at most what recomputing every block
  from there to the top would take (the blocks fetched above a gap are of no use without it), then
  cancels it and the request's prefill computes what is missing. A fetch that reaches the forward the
  head is computing goes on until that forward ends (the head may stop short of the forward's chunk end
  when its limit came down before the forward started: whether it did is known only once it ended); a
  fetch that fails gives the head back every block it had not delivered; one that stalls is re-planned
  at its measured pace, so the head goes on.

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

MIN_REPLAN_S = 0.01
"""Shortest wait between two re-plans of a split without a delivery (``watch_stall``)."""

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
    head_s: float = 0.0
    """Seconds until the head ended: it reached the fetched run, or stopped where the fetch was to meet
    it, or failed."""
    fetch_s: float = 0.0
    """Seconds until the fetch side ended: done, failed, or cancelled once the two sides met."""
    wait_s: float = 0.0
    """Seconds the request waited, the head stopped, for the fetch to reach it."""
    fetch_given_up: bool = False
    """The fetch did not reach the stopped head within what recomputing the blocks between takes."""
    fetch: FetchOutcome = field(default_factory=FetchOutcome)
    head_error: str | None = None

    def to_json(self) -> dict[str, int | float | str | None]:
        return {
            "planned_head_blocks": self.planned_head_blocks,
            "head_blocks": self.head_blocks,
            "fetched_blocks": self.fetched_blocks,
            "head_s": round(self.head_s, 6),
            "fetch_s": round(self.fetch_s, 6),
            "wait_s": round(self.wait_s, 6),
            "fetch_given_up": self.fetch_given_up,
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
    """Compute blocks from ``start`` in ``engine`` while fetching ``[start, start + plan.fetch_blocks)``
    from the top down, the two meeting where both get soonest (see the module docstring).

    ``expected[i]`` is block ``start + i``'s identity; ``cached_prefix(hashes)`` counts the leading hashes
    the cache holds. Returns once every block of the range is in the cache, or the head could not run
    (``head_error``), or the fetch failed or was given up below a stopped head (the request's prefill
    computes what is missing); the fetch is cancelled by then. Cancelling this cancels both sides."""
    b = block_size
    hi = start + plan.fetch_blocks
    result = OverlapResult(planned_head_blocks=plan.compute_blocks)
    out = result.fetch
    frontier = hi
    """Lowest block of the contiguous run the fetch delivered, ending at ``hi``."""
    chunk = abr.head_chunk_tokens(b, plan.compute_blocks)
    lo = min(head_chunk_end(start, chunk, b), hi)
    """The fetch's lowest block: everything past the head's first forward, which computes whatever arrives."""
    limit = hi
    """The head's limit as last set (blocks)."""
    head = engine.submit(  # the limit is re-read per forward
        SequenceRequest(tuple(ids[: hi * b]), 0, commit_prompt=True, prefill_limit=hi * b,
                        prefill_chunk=chunk)
    )
    renditions = [_rendition(plan, i - start) for i in range(start, hi)]
    started = time.perf_counter()
    last_delivery = started
    deliveries = 0
    stopped_at: int | None = None
    """Where the head ended, once it has (blocks)."""
    met = asyncio.Event()
    """Set once the fetch has delivered down to where the stopped head ended."""

    def block_fetch_s(now: float) -> float:
        """Seconds per block the fetch is delivering at: its time so far over the blocks it delivered (the
        estimate before the first), and at least how long the block now arriving has taken so far (a
        stalling fetch is seen as slow before its next block comes). Timed from the fetch's start, not
        between deliveries: blocks in flight together arrive in bursts (a window of FETCHes shares the
        link), and two blocks landing 10 ms apart on a 10 MB/s link once stopped a head that had 2 s of
        fetch still to wait for."""
        if deliveries:
            return max((last_delivery - started) / deliveries, now - last_delivery)
        rendition = renditions[frontier - 1 - start]
        estimate = abr.block_fetch_cost(block_raw_bytes, rendition, beside_compute=True)
        return max(estimate, now - started - abr.fetch_latency_s())

    def computed() -> int:
        """The block the head has computed up to (the cache's run from ``start``)."""
        return start + cached_prefix(hashes[start:frontier])

    def replan(now: float, done: int) -> None:
        """Move the head's limit to where it should stop, ``done`` blocks computed: the end of the forward
        it is computing, plus the blocks it computes before the fetch, at the rate measured so far, could
        deliver them."""
        nonlocal limit
        if stopped_at is not None:
            return
        end = head_chunk_end(done, chunk, b)
        extra = [abr.decode_beside_head(block_raw_bytes, renditions[i - start]) for i in range(end, frontier)]
        stop = head_stop(end, frontier, block_fetch_s(now), abr.head_cost(b, context_tokens=end * b), extra)
        if stop != limit:
            limit = stop
            engine.set_prefill_limit(head.seq_id, limit * b)

    def delivered(block: int) -> None:
        nonlocal frontier, last_delivery, deliveries
        if block != frontier - 1:
            return
        frontier = block
        now = last_delivery = time.perf_counter()
        deliveries += 1
        if stopped_at is not None:
            if frontier <= stopped_at:
                met.set()
            return
        done = computed()
        if frontier <= done:
            fetch_task.cancel()  # the head has computed the rest: nothing below is of use
        else:
            replan(now, done)

    async def fetch_side() -> None:
        if lo >= hi:
            return
        order = list(range(hi - 1, lo - 1, -1))  # backwards: towards the head
        await fetch([expected[i - start] for i in order], [renditions[i - start] for i in order], out,
                    lambda j: delivered(order[j]))

    async def timed_fetch_side() -> None:
        try:
            await fetch_side()
        finally:
            result.fetch_s = time.perf_counter() - started
            met.set()  # ended: nothing more will arrive
            if stopped_at is None and limit < frontier:  # failed: the head computes what it left
                engine.set_prefill_limit(head.seq_id, frontier * b)

    async def watch_stall() -> None:
        """Re-plan between deliveries too, a block's time apart (the fetch's or the head's, the shorter): a
        fetch that stalls raises the head's limit before the head reaches it (a head that reached its
        limit has ended)."""
        head_block_s = abr.head_cost(b)(1)
        while stopped_at is None:
            await asyncio.sleep(max(min(block_fetch_s(time.perf_counter()), head_block_s), MIN_REPLAN_S))
            replan(time.perf_counter(), computed())

    fetch_task = asyncio.ensure_future(timed_fetch_side())
    watch_task = asyncio.ensure_future(watch_stall())
    try:
        finished: SequenceFinished | None = None
        try:
            finished = await asyncio.shield(asyncio.wrap_future(head.future))
        except Exception as exc:  # the engine failed the head: the request's own prefill computes it
            result.head_error = str(exc) or type(exc).__name__
            logger.warning("head of the prefix failed (%s); the request computes it", result.head_error)
        result.head_s = time.perf_counter() - started
        if finished is not None:
            r = finished.result
            result.head_computed_tokens = r.computed_tokens
            result.head_start_tokens = r.cached_tokens
            result.head_compute_s = finished.prefill_compute_seconds
            result.head_end_tokens = min((r.cached_tokens + r.computed_tokens) // b * b, hi * b)
            result.head_blocks = max(result.head_end_tokens // b - start, 0)
            stopped_at = result.head_end_tokens // b
            if frontier > stopped_at and not fetch_task.done():
                await _wait_for_fetch(result, met, abr, b, stopped_at, frontier, hi)
    except BaseException:
        engine.cancel(head.seq_id)
        raise
    finally:
        watch_task.cancel()
        fetch_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch_task
        with contextlib.suppress(asyncio.CancelledError):
            await fetch_task
    # Blocks the head reached were computed whoever else delivered them: the fetch's share is the rest.
    result.fetched_blocks = max(hi - max(frontier, result.head_end_tokens // b), 0)
    return result


async def _wait_for_fetch(
    result: OverlapResult, met: asyncio.Event, abr: KvAbr, block_size: int, stopped_at: int, frontier: int,
    hi: int,
) -> None:
    """The head stopped below the fetched run, where the fetch was to meet it: wait for the fetch to get
    there, at most what recomputing every block from the head's end to ``hi`` would take. Past that,
    waiting costs more than the request's prefill computing them: the blocks fetched above the gap are
    of no use without the ones below (a prefix is reused, not a run past a hole)."""
    bound = abr.prefill.estimate((hi - stopped_at) * block_size, stopped_at * block_size)
    waited = time.perf_counter()
    try:
        async with asyncio.timeout(bound):
            await met.wait()
    except TimeoutError:
        result.fetch_given_up = True
        logger.info("the tail did not reach the head within %.3f s (what recomputing its last %d blocks "
                    "takes, %d of them fetched); the request computes them", bound, hi - stopped_at,
                    hi - frontier)
    result.wait_s = time.perf_counter() - waited


def head_stop(
    end: int, frontier: int, fetch_block_s: float, head_cost: Callable[[int], float],
    head_extra: Sequence[float] | None = None,
) -> int:
    """The block a split's head should stop at: it computes up to ``end`` (the forward in flight) whatever
    happens, and the fetch, delivering a block every ``fetch_block_s``, has reached ``frontier`` coming
    down. The head takes the ``k`` blocks past ``end`` for which ``max(head_cost(k), fetch of the rest)``
    is least (``best_split``; ``head_extra`` as there), so it stops at ``end`` where the fetch gets
    through the blocks between sooner than a forward more would."""
    if frontier <= end:
        return frontier
    k, _ = best_split([fetch_block_s] * (frontier - end), 0.0, head_cost, head_extra)
    return end + k


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
