"""Deadlines that scale with the load (``tests.helpers.waiting``): the factor from the load average, its
bounds, and the polls waiting for the scaled deadline and naming it when it passes."""

from __future__ import annotations

import os
import time

import pytest

from kvnet.net.config import TransportConfig
from tests.helpers import waiting
from tests.helpers.connections import MAX_HANDSHAKE_TIMEOUT_S, client_config
from tests.helpers.waiting import MAX_LOAD_FACTOR, async_wait_until, load_factor, scaled, wait_until

CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def loaded(monkeypatch: pytest.MonkeyPatch, load: float) -> None:
    monkeypatch.setattr(waiting.os, "getloadavg", lambda: (load, load, load))


@pytest.mark.parametrize(
    ("load", "factor"), [(0.0, 1.0), (CPUS, 2.0), (2.5 * CPUS, 3.5), (1000.0 * CPUS, MAX_LOAD_FACTOR)]
)
def test_the_factor_is_one_plus_the_load_per_cpu_bounded(
    monkeypatch: pytest.MonkeyPatch, load: float, factor: float
) -> None:
    loaded(monkeypatch, load)
    assert load_factor() == pytest.approx(min(factor, MAX_LOAD_FACTOR))
    assert scaled(10.0) == pytest.approx(10.0 * min(factor, MAX_LOAD_FACTOR))


def test_no_load_average_means_no_scaling(monkeypatch: pytest.MonkeyPatch) -> None:
    def unavailable() -> tuple[float, float, float]:
        raise OSError("no load average here")

    monkeypatch.setattr(waiting.os, "getloadavg", unavailable)
    assert load_factor() == 1.0


def test_a_poll_waits_for_the_scaled_deadline_and_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    loaded(monkeypatch, 2.0 * CPUS)  # factor 3
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"never: not within 0\.15 s \(0\.05 s scaled by the load\)"):
        wait_until(lambda: False, "never", timeout=0.05, interval=0.005)
    assert time.monotonic() - started >= 0.15


async def test_the_async_poll_scales_too(monkeypatch: pytest.MonkeyPatch) -> None:
    loaded(monkeypatch, 2.0 * CPUS)
    with pytest.raises(TimeoutError, match=r"not within 0\.15 s"):
        await async_wait_until(lambda: False, "never", timeout=0.05, interval=0.005)
    assert await async_wait_until(lambda: 7, "at once", timeout=0.05) == 7


def test_client_handshake_deadline_scales_within_what_transport_settings_accepts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loaded(monkeypatch, 3.0 * CPUS)  # factor 4
    assert client_config().handshake_timeout == pytest.approx(40.0)
    loaded(monkeypatch, 1000.0 * CPUS)
    long = TransportConfig(stack="qh3", handshake_timeout=300.0)
    got = client_config(long)
    assert got.handshake_timeout == MAX_HANDSHAKE_TIMEOUT_S and got.stack == "qh3"
