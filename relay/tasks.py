"""Background tasks of the relay: each one is kept referenced until it is done, and its outcome is
always retrieved, so no failure surfaces later as asyncio's "Task exception was never retrieved".

Owns: ``spawn`` (start a task into an owner's set) and ``retrieve`` (the done-callback that reads a
task's exception and logs it once). Expected failures of network work (an upstream that timed out,
refused or went away) are logged at debug level; anything else is a bug and logged with its traceback.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

from kvnet.net.errors import ConnectionClosed, MoqtConnectionError, RequestRejected, StreamResetError
from relay.cache import RequestFailed

logger = logging.getLogger(__name__)

T = TypeVar("T")

EXPECTED: tuple[type[BaseException], ...] = (
    RequestFailed,
    RequestRejected,
    ConnectionClosed,
    MoqtConnectionError,
    StreamResetError,
    TimeoutError,
    OSError,
)
"""Failures that are part of normal operation when peers come and go."""


def retrieve(task: asyncio.Future[Any], what: str = "background task") -> None:
    """Done-callback: retrieve ``task``'s exception (so asyncio never reports it) and log it once."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is None:
        return
    if isinstance(exc, EXPECTED):
        logger.debug("%s ended: %s", what, exc)
    else:
        logger.error("%s failed", what, exc_info=exc)


def spawn(
    coro: Coroutine[Any, Any, T], owner: set[asyncio.Task[Any]] | None = None, what: str = "background task"
) -> asyncio.Task[T]:
    """Start ``coro`` as a task whose exception is always retrieved; kept in ``owner`` until done."""
    task = asyncio.get_running_loop().create_task(coro)
    task.add_done_callback(lambda t: retrieve(t, what))
    if owner is not None:
        owner.add(task)
        task.add_done_callback(owner.discard)
    return task
