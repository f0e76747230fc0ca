"""Wait for a condition with a deadline instead of sleeping a fixed time.

A fixed sleep is either too short on a loaded machine (a flaky test) or too long on an idle one; a poll
returns as soon as the condition holds and fails with a message naming what never happened. The deadlines
are generous on purpose: they only bound a test that is already failing.

Every deadline a test waits on is a base for an idle machine scaled by the load it runs under
(``scaled``): 1 plus the 1-minute load average per usable CPU, at most ``MAX_LOAD_FACTOR``. A handshake
that takes 2 s on an idle machine takes several times that with the suite running twice beside other work,
and a deadline that does not grow with it fails the test for the machine's load, not for kvnet.
``wait_until`` and ``async_wait_until`` scale their ``timeout`` themselves; other waits (``asyncio.wait_for``,
``proc.wait``, a client's ``handshake_timeout``) take ``scaled(base)``. A timeout that is the behaviour under
test (a request expected to time out) is not a deadline and is not scaled.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

T = TypeVar("T")

DEFAULT_TIMEOUT = 30.0
POLL_INTERVAL = 0.02
MAX_LOAD_FACTOR = 8.0
"""Deadlines grow with the load at most this much: a machine loaded beyond it has a problem a test
should report (a hang stays bounded)."""

__all__ = ["DEFAULT_TIMEOUT", "MAX_LOAD_FACTOR", "async_wait_until", "load_factor", "scaled", "wait_until"]


def load_factor() -> float:
    """1 plus the 1-minute load average per CPU this process may run on, bounded to [1, MAX_LOAD_FACTOR]
    (1 where the platform has no load average)."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return 1.0
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(MAX_LOAD_FACTOR, 1.0 + max(load, 0.0) / max(cpus, 1))


def scaled(seconds: float) -> float:
    """``seconds``, a deadline on an idle machine, scaled by the machine's load now (``load_factor``)."""
    return seconds * load_factor()


def _expired(what: str, timeout: float, limit: float) -> TimeoutError:
    return TimeoutError(f"{what}: not within {limit:g} s ({timeout:g} s scaled by the load)")


def wait_until(
    condition: Callable[[], T], what: str, timeout: float = DEFAULT_TIMEOUT, interval: float = POLL_INTERVAL
) -> T:
    """Call ``condition`` until it returns a true value and return that value; after ``scaled(timeout)``
    seconds raise ``TimeoutError`` saying ``what`` did not happen."""
    limit = scaled(timeout)
    deadline = time.monotonic() + limit
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise _expired(what, timeout, limit)
        time.sleep(interval)


@overload
async def async_wait_until(
    condition: Callable[[], Awaitable[T]], what: str, timeout: float = ..., interval: float = ...
) -> T: ...


@overload
async def async_wait_until(
    condition: Callable[[], T], what: str, timeout: float = ..., interval: float = ...
) -> T: ...


async def async_wait_until(
    condition: Callable[[], Any],
    what: str,
    timeout: float = DEFAULT_TIMEOUT,
    interval: float = POLL_INTERVAL,
) -> Any:
    """``wait_until`` for the event loop: ``condition`` may be a plain or an async callable; the loop keeps
    running between polls."""
    limit = scaled(timeout)
    deadline = time.monotonic() + limit
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise _expired(what, timeout, limit)
        await asyncio.sleep(interval)
