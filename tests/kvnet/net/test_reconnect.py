"""``kvnet.net.reconnect.Backoff``: capped, exponential, jittered within [ceiling/2, ceiling]."""

from __future__ import annotations

import random

import pytest

from kvnet.net.reconnect import Backoff, redirect_target


def test_delays_grow_to_the_cap_with_jitter_and_reset() -> None:
    backoff = Backoff(initial_s=0.1, cap_s=1.0, rng=random.Random(1))
    ceilings = [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]
    for ceiling in ceilings:
        delay = backoff.next_delay()
        assert ceiling / 2 <= delay <= ceiling
    backoff.reset()
    assert backoff.next_delay() <= 0.1


def test_jitter_spreads_a_fleet() -> None:
    delays = {round(Backoff(rng=random.Random(seed)).next_delay(), 6) for seed in range(20)}
    assert len(delays) == 20


def test_never_overflows_after_many_failures() -> None:
    backoff = Backoff(cap_s=5.0)
    for _ in range(10_000):
        assert backoff.next_delay() <= 5.0


@pytest.mark.parametrize(("initial", "cap", "factor"), [(0.0, 1.0, 2.0), (2.0, 1.0, 2.0), (0.1, 1.0, 0.5)])
def test_bad_parameters(initial: float, cap: float, factor: float) -> None:
    with pytest.raises(ValueError, match="backoff"):
        Backoff(initial_s=initial, cap_s=cap, factor=factor)


@pytest.mark.parametrize(
    ("uri", "target"),
    [
        (b"moqt://standby.example:4443", "moqt://standby.example:4443"),
        (b"", None),  # no New Session URI: reconnect to the URL we know
        (b"https://elsewhere.example/", None),  # not a relay we could reach: ignored, not followed
        (b"\xff\xfe", None),  # not even text
    ],
)
def test_redirect_target(uri: bytes, target: str | None) -> None:
    assert redirect_target(uri) == target
