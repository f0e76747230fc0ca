"""An asyncio event loop on its own thread, for engines whose own code is synchronous.

Owns ``BackgroundLoop``: a daemon thread running one event loop, ``submit`` to hand it a coroutine from
any thread (a ``concurrent.futures.Future`` comes back, never blocking the caller), and ``stop`` to run a
last coroutine (e.g. draining pushes) bounded by a timeout, cancel what is left and join the thread.
The loop owns every network object created on it; callers only look at futures.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


class BackgroundLoop:
    """One event loop on a daemon thread (daemon: a crashed engine never hangs on it at exit)."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._started.wait()
        self._stopped = False

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._started.set)
        self.loop.run_forever()

    @property
    def running(self) -> bool:
        return not self._stopped

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the loop; the caller polls or waits on the returned future."""
        if self._stopped:
            coro.close()
            raise RuntimeError("the background loop has stopped")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self, last: Coroutine[Any, Any, Any] | None = None, timeout: float = 10.0) -> None:
        """Run ``last`` (bounded by ``timeout``), cancel every other task, stop the loop and join it."""
        if self._stopped:
            if last is not None:
                last.close()
            return
        self._stopped = True
        if last is not None:
            future = asyncio.run_coroutine_threadsafe(asyncio.wait_for(last, timeout), self.loop)
            try:
                future.result(timeout + 1.0)
            except (TimeoutError, concurrent.futures.TimeoutError):
                logger.warning("shutdown work did not finish within %.1f s", timeout)
            except Exception as exc:
                logger.warning("shutdown work failed: %r", exc)
        asyncio.run_coroutine_threadsafe(self._cancel_all(), self.loop).result(5.0)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5.0)

    @staticmethod
    async def _cancel_all() -> None:
        current = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
