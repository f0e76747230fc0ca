"""Probe planning of the bounded fan-out locate (``kvnet.exchange.locate.PrefixSearch``), over random
patterns."""

from __future__ import annotations

import asyncio
import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvnet.exchange.locate import PrefixSearch, locate_prefix, round_decided, spread_probes
from kvnet.net.errors import RequestRejected
from proto.errors import RequestErrorCode
from tests.helpers.waiting import async_wait_until


def _search(blocks: int, fan_out: int, present: set[int] | range) -> tuple[PrefixSearch, dict[int, bool]]:
    """Run a search to the end against a fixed presence pattern; also every answer it saw."""
    search = PrefixSearch(blocks, fan_out)
    seen: dict[int, bool] = {}
    while probes := search.next_probes():
        assert len(probes) <= fan_out
        assert probes == sorted(set(probes)), probes
        assert all(search.lo <= i < search.hi for i in probes)
        assert not set(probes) & seen.keys(), "a block was probed twice"
        answers = {i: i in present for i in probes}
        seen.update(answers)
        search.record(probes, answers)
        assert search.rounds <= blocks, "the search does not terminate"
    return search, seen


def _rounds_bound(blocks: int, fan_out: int) -> int:
    """Rounds a search of ``blocks`` can take: the undecided range shrinks from w to < w / (F - 1) + 1."""
    rounds, width = 0, blocks
    while width > 0:
        rounds += 1
        width = 0 if width <= fan_out else -(-(width - 1) // (fan_out - 1)) - 1
    return rounds


@settings(max_examples=400, deadline=None)
@given(st.integers(0, 5000), st.integers(2, 100), st.data())
def test_prefix_closed_patterns_give_the_exact_boundary(
    blocks: int, fan_out: int, data: st.DataObject
) -> None:
    boundary = data.draw(st.integers(0, blocks))
    search, _ = _search(blocks, fan_out, range(boundary))
    assert search.done and search.run == boundary
    assert search.rounds <= _rounds_bound(blocks, fan_out)
    assert search.probes <= search.rounds * fan_out
    if blocks <= fan_out:
        assert search.rounds == min(1, blocks)
    elif blocks <= fan_out * fan_out:
        assert search.rounds <= 2


@settings(max_examples=400, deadline=None)
@given(st.integers(1, 3000), st.integers(2, 80), st.data())
def test_any_pattern_never_goes_past_a_probed_miss(blocks: int, fan_out: int, data: st.DataObject) -> None:
    present = data.draw(st.sets(st.integers(0, blocks - 1)))
    search, seen = _search(blocks, fan_out, present)
    run = search.run
    misses = [i for i, hit in seen.items() if not hit]
    assert run <= min(misses, default=blocks)
    # The run ends at a probed miss or at the end, and every block probed inside it was a hit.
    assert run == blocks or seen.get(run) is False
    assert all(hit for i, hit in seen.items() if i < run)
    # Holes can only hide between probes; the true first miss is never after the run's end.
    true_first_miss = next((i for i in range(blocks) if i not in present), blocks)
    assert true_first_miss <= run
    assert search.rounds <= _rounds_bound(blocks, fan_out)


def test_4096_blocks_take_two_rounds_of_at_most_64_probes() -> None:
    for boundary in (0, 1, 63, 64, 65, 1000, 2047, 4095, 4096):
        search, _ = _search(4096, 64, range(boundary))
        assert search.run == boundary
        assert search.rounds <= 2 and search.probes <= 128, (boundary, search)
    # A whole prompt present (the common case) is settled by the first round: its last block is probed.
    full, _ = _search(4096, 64, range(4096))
    assert full.rounds == 1 and full.probes == 64
    # A missing first block too.
    cold, _ = _search(4096, 64, set())
    assert cold.rounds == 1 and cold.run == 0


def test_spread_probes_covers_the_range_with_bounded_gaps() -> None:
    assert spread_probes(0, 5, 64) == [0, 1, 2, 3, 4]
    assert spread_probes(3, 3, 64) == []
    for lo, hi, f in ((0, 4096, 64), (10, 1000, 7), (0, 65, 64), (5, 70, 2)):
        p = spread_probes(lo, hi, f)
        assert len(p) == f and p[0] == lo and p[-1] == hi - 1
        assert max(b - a for a, b in itertools.pairwise(p)) <= math.ceil((hi - lo - 1) / (f - 1))
    with pytest.raises(ValueError):
        spread_probes(0, 10, 1)


def test_a_round_is_decided_once_every_probe_up_to_the_first_miss_answered() -> None:
    probes = [0, 10, 20, 30]
    assert not round_decided(probes, {})
    assert not round_decided(probes, {0: True, 20: False})  # 10 may still miss
    assert round_decided(probes, {0: True, 10: False})  # 20 and 30 cannot matter
    assert round_decided(probes, {0: True, 10: True, 20: True, 30: True})
    assert not round_decided(probes, {0: True, 10: True, 20: True, 30: None})


def test_unanswered_probes_count_as_misses() -> None:
    search = PrefixSearch(100, 10)
    probes = search.next_probes()
    search.record(probes, {probes[0]: True, probes[2]: True})  # probes[1] never answered
    assert search.lo == probes[0] + 1 and search.hi == probes[1]


def test_probe_failures_other_than_a_miss_are_named() -> None:
    # An edge whose upstream is down answers INTERNAL_ERROR, not DOES_NOT_EXIST: the locate still counts
    # those blocks as missing, but says what failed, so the request's report can tell "nobody has it" from
    # "could not ask".
    async def probe(i: int, rendition: str) -> None:
        if i < 3:
            return
        if i < 10:
            raise RequestRejected(RequestErrorCode.DOES_NOT_EXIST, "no such block")
        raise RequestRejected(RequestErrorCode.INTERNAL_ERROR, "upstream relay not connected")

    def is_miss(exc: BaseException) -> bool:
        return isinstance(exc, RequestRejected) and exc.code == RequestErrorCode.DOES_NOT_EXIST

    located = asyncio.run(locate_prefix(64, ["lossless"], probe, fan_out=8, is_miss=is_miss))
    assert len(located.available) == 3
    assert located.probe_errors, located
    assert all("INTERNAL_ERROR" in text and "not connected" in text for text in located.probe_errors)
    assert located.to_json()["probe_errors"] == located.probe_errors
    # Without is_miss nothing is counted (every failure is a plain miss, as before).
    assert asyncio.run(locate_prefix(64, ["lossless"], probe, fan_out=8)).probe_errors == {}


def test_a_round_answered_in_one_wake_up_still_gives_its_rtt_sample() -> None:
    # A relay holding a whole prompt answers every probe of the first round at once (one packet): the round
    # is decided on its first wake-up, and that first answer is the RTT sample the ABR plans with. It was
    # dropped, which left the ABR on its 2 ms prior behind a 20 ms link.
    asked: list[int] = []
    answer = asyncio.Event()

    async def probe(i: int, rendition: str) -> None:
        asked.append(i)
        if len(asked) == 16:
            answer.set()  # every probe is out: all the answers come together
        await answer.wait()

    samples: list[float] = []
    located = asyncio.run(locate_prefix(16, ["lossless"], probe, fan_out=64, on_first_answer=samples.append))
    assert len(located.available) == 16 and located.rounds == 1
    assert len(samples) == 1 and samples[0] >= 0


@pytest.mark.parametrize("steps", range(8))
def test_a_locate_cancelled_as_an_answer_arrives_ends_cancelled(steps: int) -> None:
    # A node cancels a locate (its request was cancelled) at any point of an answer's arrival: the locate
    # must end then. Python 3.11's wait_for returned the answer instead when both fell in one loop
    # iteration, and the locate went on to its timeout (a test's fetch loop never stopped).
    async def run() -> asyncio.Task[object]:
        gates: dict[int, asyncio.Future[None]] = {}

        async def probe(i: int, rendition: str) -> None:
            gates[i] = asyncio.get_running_loop().create_future()
            await gates[i]

        loop = asyncio.get_running_loop()

        async def one_loop_iteration() -> None:
            ran: asyncio.Future[None] = loop.create_future()
            loop.call_soon(ran.set_result, None)
            await ran

        task: asyncio.Task[object] = asyncio.ensure_future(
            locate_prefix(64, ["lossless"], probe, fan_out=8, timeout=5.0))
        await async_wait_until(lambda: len(gates) == 8, "the first round's probes are out")
        gates[0].set_result(None)  # block 0 answers; the others keep the round open
        for _ in range(steps):  # the cancel lands this many loop iterations after the answer
            await one_loop_iteration()
        task.cancel()
        await asyncio.wait({task}, timeout=10)
        return task

    task = asyncio.run(run())
    assert task.cancelled(), task
