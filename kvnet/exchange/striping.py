"""One request's blocks fetched over several relay sessions at once: the subscriber's striping.

Owns ``fetch_striped``: block ``i`` of a request goes to session ``block_index % N`` (``stripe_of``: by the
block's place in its chain, so concurrent requests send a block to the same session, and a contiguous run
splits evenly), and each session's ``BlockFetcher`` fetches, verifies and imports its share with its own
window, its own verify pool and its own checks. The request's blocks still become usable as a leading
prefix in the order asked (``UsablePrefix``): ``on_loaded(i)`` is called in list order as soon as every
block up to ``i`` is in, whichever session loaded it. A failure on one stripe ends the usable prefix at its
block, like any fetch failure; the other stripes are stopped once nothing they still fetch is below that
block (what they loaded past it stays in the cache, verified, for a later request).

One session is the ``N = 1`` case of the same code: one stripe holding every block. Why stripe at all: one
session is one TCP (or QUIC) connection read by one event loop and served by one relay process; several
spread the relay's work over its ``--workers`` and the verification over as many pools, which a host with
cores to spare turns into throughput (docs/performance.md, "Striping one fetch over several sessions").
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence

from kvnet.blocks.identity import BlockIdentity
from kvnet.exchange.abr import KvAbr
from kvnet.exchange.fetching import BlockFetcher, Deadline, FetchOutcome


def stripe_of(identity: BlockIdentity, stripes: int) -> int:
    """The session (0-based, of ``stripes``) that fetches a block: by its index in the chain."""
    return identity.block_index % stripes


def split_stripes(expected: Sequence[BlockIdentity], stripes: int) -> list[list[int]]:
    """Positions in ``expected`` of each stripe's blocks, in list order (stripes without blocks are empty)."""
    if stripes < 1:
        raise ValueError(f"stripes must be at least 1, got {stripes}")
    positions: list[list[int]] = [[] for _ in range(stripes)]
    for i, identity in enumerate(expected):
        positions[stripe_of(identity, stripes)].append(i)
    return positions


class UsablePrefix:
    """Which leading positions of a request are usable, from the loads and failures of its stripes (in any
    order): ``end`` is the first position not loaded, ``limit`` the lowest that failed (``total`` if none);
    nothing at or past ``limit`` is ever usable."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.end = 0
        self.limit = total
        self._loaded: set[int] = set()

    def loaded(self, position: int) -> list[int]:
        """Record ``position`` as loaded; returns the positions that became usable by it, in order."""
        if position >= self.limit:
            return []
        self._loaded.add(position)
        start = self.end
        while self.end < self.limit and self.end in self._loaded:
            self._loaded.discard(self.end)
            self.end += 1
        return list(range(start, self.end))

    def failed(self, position: int) -> bool:
        """Record that ``position`` will not load; True if that lowered ``limit``."""
        if position >= self.limit:
            return False
        self.limit = max(position, self.end)
        self._loaded = {p for p in self._loaded if p < self.limit}
        return True

    def still_needed(self, positions: Sequence[int], done: int) -> bool:
        """Whether a stripe whose blocks are ``positions`` and which loaded the first ``done`` of them
        still has one below ``limit`` to load."""
        return done < len(positions) and positions[done] < self.limit


class _StripeDeadline:
    """A request's deadline seen from one stripe: its ``k``-th block is the request's ``positions[k]``."""

    def __init__(self, deadline: Deadline, positions: Sequence[int]) -> None:
        self._deadline = deadline
        self._positions = positions

    def due(self, loaded_blocks: int) -> float:
        return self._deadline.due(self._positions[loaded_blocks])

    def describe(self, loaded_blocks: int, now: float) -> str:
        return self._deadline.describe(self._positions[loaded_blocks], now)

    def overtaken(
        self, now: float, last_block: int, remaining_blocks: int, remaining_bytes: float, rate_bps: float
    ) -> str | None:
        return self._deadline.overtaken(now, self._positions[last_block], remaining_blocks, remaining_bytes,
                                        rate_bps)


async def fetch_striped(
    fetchers: Sequence[BlockFetcher],
    expected: Sequence[BlockIdentity],
    renditions: Sequence[str],
    deadline: Deadline | None = None,
    *,
    abr: KvAbr,
    outcome: FetchOutcome | None = None,
    on_loaded: Callable[[int], None] | None = None,
    beside_compute: bool = False,
) -> FetchOutcome:
    """Fetch, verify and import ``expected`` over ``fetchers`` (one per session, at least one), each
    stripe with ``BlockFetcher.fetch``; returns (and fills ``outcome`` in place, also when cancelled) the
    request's outcome: ``loaded`` is the usable prefix, ``bytes``/``retries``/``load_s`` and the
    renditions of the blocks loaded are summed over the stripes (blocks loaded past a failure included),
    and ``error`` is that of the failure lowest in the list. ``on_loaded(i)`` is called in list order.

    The throughput sample given to ``abr`` is the request's: the stripes' clean bytes over the longest of
    their sample times (they run at once), so N sessions are measured as the one path they make up;
    ``beside_compute``: the fetch is a split's tail, measured apart (``KvAbr.tail_throughput``)."""
    if not fetchers:
        raise ValueError("fetch_striped needs at least one fetcher")
    out = outcome if outcome is not None else FetchOutcome()
    positions = split_stripes(expected, len(fetchers))
    stripes = [(f, p) for f, p in zip(fetchers, positions, strict=True) if p]
    prefix = UsablePrefix(len(expected))
    results = [FetchOutcome() for _ in stripes]
    done = [0] * len(stripes)
    tasks: list[asyncio.Task[FetchOutcome]] = []
    base_loaded = out.loaded

    def stop_unneeded() -> None:
        """Cancel the stripes with nothing left below the usable limit: their blocks are of no use here."""
        for s, task in enumerate(tasks):
            if not task.done() and not prefix.still_needed(stripes[s][1], done[s]):
                task.cancel()

    def loaded_by(s: int) -> Callable[[int], None]:
        def loaded(k: int) -> None:
            done[s] = k + 1
            for position in prefix.loaded(stripes[s][1][k]):
                out.loaded = position + 1
                if on_loaded is not None:
                    on_loaded(position)
            if prefix.limit < prefix.total:
                stop_unneeded()
        return loaded

    def ended(s: int, task: asyncio.Task[FetchOutcome]) -> None:
        """A stripe ended: a block it did not load (failure, or cancelled) ends the usable prefix there."""
        unfinished = done[s] < len(stripes[s][1]) and (task.cancelled() or results[s].error is not None)
        if unfinished and prefix.failed(stripes[s][1][done[s]]):
            stop_unneeded()

    for s, (fetcher, stripe_positions) in enumerate(stripes):
        stripe_deadline = None if deadline is None else _StripeDeadline(deadline, stripe_positions)
        task = asyncio.ensure_future(fetcher.fetch(
            [expected[i] for i in stripe_positions], [renditions[i] for i in stripe_positions],
            stripe_deadline, outcome=results[s], on_loaded=loaded_by(s), measure=False,
        ))
        task.add_done_callback(lambda t, s=s: ended(s, t))  # type: ignore[misc]
        tasks.append(task)
    try:
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)
        _merge(out, results, [p[done[s]] if done[s] < len(p) else None for s, (_, p) in enumerate(stripes)],
               prefix, base_loaded)
        if out.sample_bytes:
            abr.fetch_measured(out.sample_bytes, out.sample_s, beside_compute)
    for task in tasks:  # a bug in a stripe (anything but a fetch failure) is not hidden
        bug = None if task.cancelled() else task.exception()
        if bug is not None:
            raise bug
    return out


def _merge(
    out: FetchOutcome, results: Sequence[FetchOutcome], stopped_at: Sequence[int | None],
    prefix: UsablePrefix, base_loaded: int,
) -> None:
    """Add the stripes' outcomes into ``out`` (which earlier fetches of a caller may have filled);
    ``stopped_at[s]`` is the request position of the first block stripe ``s`` did not load (None: it
    loaded all its blocks)."""
    out.loaded = prefix.end if prefix.end else base_loaded
    sample_s = 0.0
    out.sample_bytes = 0
    for r in results:
        out.bytes += r.bytes
        out.load_s += r.load_s
        out.retries += r.retries
        out.untrusted += r.untrusted
        for rendition, count in r.renditions.items():
            out.renditions[rendition] = out.renditions.get(rendition, 0) + count
        out.sample_bytes += r.sample_bytes
        sample_s = max(sample_s, r.sample_s)
    out.sample_s = sample_s if out.sample_bytes else 0.0
    # The failure that ended the usable prefix: the one lowest in the request (stripes stopped because
    # of it carry no error of their own).
    failures = [(at, r) for at, r in zip(stopped_at, results, strict=True) if at is not None and r.error]
    if failures:
        _, first = min(failures, key=lambda f: f[0])
        out.error, out.rejected, out.rejected_kind = first.error, first.rejected, first.rejected_kind
        out.abandoned = first.abandoned
