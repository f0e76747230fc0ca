"""Wait for a condition with a deadline instead of sleeping a fixed time.

A fixed sleep is either too short on a loaded machine (a flaky test) or too long on an idle one; a poll
returns as soon as the condition holds and fails with a message naming what never happened. The deadlines
are generous on purpose: they only bound a test that is already failing.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

T = TypeVar("T")

DEFAULT_TIMEOUT = 30.0
POLL_INTERVAL = 0.02

__all__ = ["DEFAULT_TIMEOUT", "async_wait_until", "wait_until"]


def wait_until(
    condition: Callable[[], T], what: str, timeout: float = DEFAULT_TIMEOUT, interval: float = POLL_INTERVAL
) -> T:
    """Call ``condition`` until it returns a true value and return that value; after ``timeout`` seconds
    raise ``TimeoutError`` saying ``what`` did not happen."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:g} s")
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
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:g} s")
        await asyncio.sleep(interval)
