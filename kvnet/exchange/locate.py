"""Locate: find the longest leading run of a prompt's blocks that peers can serve, in few round trips.

Owns ``PrefixSearch`` / ``locate_prefix``: a bounded fan-out search. Each round probes at most ``fan_out``
blocks of the still-undecided range, all in parallel, and the leading run of hits narrows the range to one
gap between probes. Presence is (nearly) prefix-closed (publishers publish whole prompts), so ``fan_out`` F
decides N <= F blocks in one round trip and N <= F*F in two, with at most F requests in flight per
rendition. It knows nothing about MoQT: a probe is any coroutine that returns when a block exists and
raises when it does not (``kvnet.exchange.fetching.BlockFetcher.locate`` sends TRACK_STATUS).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

DEFAULT_LOCATE_FAN_OUT = 64
"""Blocks (per rendition) a locate probes per round trip: 64 decides prompts of up to 4096 blocks in two."""



def spread_probes(lo: int, hi: int, fan_out: int) -> list[int]:
    """Blocks to probe in ``[lo, hi)``, ascending: all of them when there are at most ``fan_out``, else
    ``fan_out`` evenly spaced ones including ``lo`` and ``hi - 1``.

    Consecutive probes are at most ``ceil((hi - lo - 1) / (fan_out - 1))`` apart, so each gap between
    them holds fewer unprobed blocks than that.
    """
    if fan_out < 2:
        raise ValueError(f"fan_out must be at least 2, got {fan_out}")
    width = hi - lo
    if width <= fan_out:
        return list(range(lo, hi))
    # Integer spacing: distinct (the step is > 1), first lo, last hi - 1.
    return [lo + k * (width - 1) // (fan_out - 1) for k in range(fan_out)]


@dataclass
class PrefixSearch:
    """Bounded fan-out search for the first missing block of a chain of ``blocks`` (pure bookkeeping).

    Blocks ``[0, lo)`` count as present (a probe at ``lo - 1`` hit and every probe before it hit),
    block ``hi`` is a probed miss (or ``hi == blocks``), and ``[lo, hi)`` is undecided. Each round
    probes ``next_probes()`` (at most ``fan_out`` blocks of the undecided range, including both of its
    ends) and ``record``s the answers: the leading run of hits moves ``lo`` past the last hit, the first
    miss moves ``hi`` to it, and the range shrinks to the unprobed blocks between the two, at most
    ``ceil(width / (fan_out - 1))``. An unanswered probe counts as a miss.

    For a prefix-closed pattern (block i present implies every block < i present) the result is the
    exact boundary. For any pattern it is never past a probed miss; holes between probes are caught by
    FETCH, which stops at the first block it cannot get.
    """

    blocks: int
    fan_out: int = DEFAULT_LOCATE_FAN_OUT
    lo: int = 0
    hi: int = -1
    probes: int = 0
    rounds: int = 0

    def __post_init__(self) -> None:
        if self.fan_out < 2:
            raise ValueError(f"fan_out must be at least 2, got {self.fan_out}")
        if self.hi < 0:
            self.hi = self.blocks

    @property
    def done(self) -> bool:
        return self.lo >= self.hi

    @property
    def run(self) -> int:
        """Length of the leading run of present blocks (final once ``done``)."""
        return self.lo

    def next_probes(self) -> list[int]:
        """Blocks to probe this round, ascending; empty once ``done``."""
        return [] if self.done else spread_probes(self.lo, self.hi, self.fan_out)

    def record(self, probed: Sequence[int], hits: Mapping[int, bool]) -> None:
        """Take the answers to ``probed`` (this round's ``next_probes()``); missing answers are misses."""
        for i in probed:
            if hits.get(i, False):
                self.lo = i + 1
            else:
                self.hi = i
                break
        self.probes += len(probed)
        self.rounds += 1


def round_decided(probed: Sequence[int], answers: Mapping[int, bool | None]) -> bool:
    """Whether a round's answers so far decide the search: every probe up to the first miss answered
    (``None`` = not yet). Answers after the first miss do not matter."""
    for i in probed:
        hit = answers.get(i)
        if hit is None:
            return False
        if not hit:
            return True
    return True


@dataclass
class Located:
    """What a locate found and what it cost."""

    available: list[list[str]]
    """Renditions available for each block of the leading located run."""
    blocks: int
    """Blocks that were searched."""
    probes: int
    """TRACK_STATUS requests sent (all renditions)."""
    rounds: int
    """Round trips of probes (0 when nothing had to be searched)."""
    fan_out: int
    probe_errors: dict[str, int] = field(default_factory=dict)
    """Probes that failed for another reason than "no such block" (``is_miss`` said no), by error text:
    they count as misses like any other, but a request that recomputed because of them says why."""

    def to_json(self) -> dict[str, Any]:
        return {"blocks": self.blocks, "located": len(self.available), "probes": self.probes,
                "rounds": self.rounds, "fan_out": self.fan_out, "probe_errors": dict(self.probe_errors)}


Probe = Callable[[int, str], Coroutine[Any, Any, Any]]
"""Ask whether block i exists in a rendition: returns when it does, raises when it does not."""


# How long a locate round waits for probes that straggle after its first answer. Answers can be slow
# without anything being wrong: some come from a relay's cache at once while others are forwarded to a
# publisher that is busy (e.g. pushing the same blocks). Relays skip dead routes themselves after their
# route deadline, so a generous grace costs little when a publisher is gone.
DEFAULT_STRAGGLER_GRACE = 2.0


async def locate_prefix(
    blocks: int,
    renditions: Sequence[str],
    probe: Probe,
    *,
    fan_out: int = DEFAULT_LOCATE_FAN_OUT,
    timeout: float = 10.0,
    straggler_grace: float = DEFAULT_STRAGGLER_GRACE,
    on_first_answer: Callable[[float], None] | None = None,
    is_miss: Callable[[BaseException], bool] | None = None,
) -> Located:
    """Longest leading run of blocks available in any of ``renditions`` (one ``PrefixSearch`` each).

    All renditions are searched in the same rounds; a round's probes go out before any answer is
    awaited, and the round ends once its answers decide every search (all probes up to each first miss
    answered). Answers that straggle (a relay forwarding to a publisher that died without closing its
    session waits for its own timeout) are waited for at most ``max(straggler_grace, 4 x first answer)``
    after the round's first answer, then count as misses, which costs reuse, never correctness.
    ``on_first_answer`` gets each round's first-answer delay (an RTT sample). A probe's exception for
    which ``is_miss`` is false (without ``is_miss``: none) is counted in ``Located.probe_errors``. Raises
    ``TimeoutError`` when the first round gets no answer at all within ``timeout``.
    """
    probe_errors: dict[str, int] = {}
    searches = {r: PrefixSearch(blocks, fan_out) for r in dict.fromkeys(renditions)}
    deadline = time.perf_counter() + timeout
    while asks := {r: s.next_probes() for r, s in searches.items() if not s.done}:
        first_round = not any(s.rounds for s in searches.values())
        answers = await _probe_round(
            asks, probe, deadline, straggler_grace, on_first_answer, raise_if_silent=first_round,
            on_error=None if is_miss is None else _error_counter(is_miss, probe_errors),
        )
        for r, probed in asks.items():
            searches[r].record(probed, {i: hit is True for i, hit in answers[r].items()})
    # Per block, the renditions whose run covers it: one list per stretch between two runs' ends, not
    # one comprehension per block (4096 blocks made that a millisecond after the last answer).
    available: list[list[str]] = []
    for end in sorted({s.run for s in searches.values()}):
        holders = [r for r, s in searches.items() if s.run >= end]
        available.extend(holders.copy() for _ in range(end - len(available)))
    return Located(
        available=available, blocks=blocks, probes=sum(s.probes for s in searches.values()),
        rounds=max((s.rounds for s in searches.values()), default=0), fan_out=fan_out,
        probe_errors=probe_errors,
    )


def _error_counter(
    is_miss: Callable[[BaseException], bool], counts: dict[str, int]
) -> Callable[[BaseException], None]:
    def count(exc: BaseException) -> None:
        if not is_miss(exc):
            text = str(exc) or type(exc).__name__
            counts[text] = counts.get(text, 0) + 1

    return count


async def _probe_round(
    asks: Mapping[str, Sequence[int]],
    probe: Probe,
    deadline: float,
    straggler_grace: float,
    on_first_answer: Callable[[float], None] | None,
    *,
    raise_if_silent: bool,
    on_error: Callable[[BaseException], None] | None = None,
) -> dict[str, dict[int, bool | None]]:
    """Send one round of probes at once; per rendition and block: True (exists), False (does not, or
    the probe failed) or None (no answer by the time the round was decided or gave up)."""
    loop = asyncio.get_running_loop()
    answered = asyncio.Event()
    tasks: dict[str, dict[int, asyncio.Task[Any]]] = {}
    for r, probed in asks.items():
        tasks[r] = {}
        for i in probed:
            task = loop.create_task(probe(i, r))
            # One callback per task (not asyncio.wait over the pending set on every wake-up, which is
            # quadratic in the number of probes); many answers arrive per loop iteration anyway.
            task.add_done_callback(lambda _t: answered.set())
            if on_error is not None:
                task.add_done_callback(functools.partial(_report_error, on_error))
            tasks[r][i] = task

    def answers() -> dict[str, dict[int, bool | None]]:
        return {r: {i: _probe_answer(t) for i, t in ts.items()} for r, ts in tasks.items()}

    started = time.perf_counter()
    first_answer: float | None = None
    try:
        while True:
            now = time.perf_counter()
            # Before the round is checked: a round whose answers all came in one wake-up (a whole prompt
            # found in one packet) is decided at once, and its RTT sample must still be taken.
            if first_answer is None and answered.is_set():
                first_answer = now - started
                if on_first_answer is not None:
                    on_first_answer(first_answer)
                deadline = min(deadline, now + max(straggler_grace, 4 * first_answer))
            if all(round_decided(asks[r], a) for r, a in answers().items()):
                break
            if now >= deadline:
                if first_answer is None and raise_if_silent:
                    raise TimeoutError("no TRACK_STATUS answer before the locate timed out")
                break
            answered.clear()
            # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the result, swallowing a
            # cancellation of ours, when the wait ends in the same loop iteration (an answer arrived).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(deadline - now):
                    await answered.wait()
        return answers()
    finally:
        every = [t for ts in tasks.values() for t in ts.values()]
        for task in every:
            task.cancel()
        await asyncio.gather(*every, return_exceptions=True)


def _report_error(on_error: Callable[[BaseException], None], task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        on_error(exc)


def _probe_answer(task: asyncio.Task[Any]) -> bool | None:
    if not task.done():
        return None
    return not task.cancelled() and task.exception() is None
