"""An asyncio event loop on its own thread, for engines whose own code is synchronous.

Owns ``BackgroundLoop``: a daemon thread running one event loop, ``submit`` to hand it a coroutine from
any thread (a ``concurrent.futures.Future`` comes back, never blocking the caller), and ``stop`` to run a
last coroutine (e.g. draining pushes) bounded by a timeout, cancel what is left and join the thread.
The loop owns every network object created on it; callers only look at futures.

Also owns ``BoundedBacklog``: work handed to such a loop with a bound on the bytes it holds until done.
A caller that must never wait (an engine's forward pass) offers work with its size; when the bound would
be passed the work is dropped before it is even built, counted, and logged at most once per interval.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Coroutine
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
            future = asyncio.run_coroutine_threadsafe(_bounded(last, timeout), self.loop)
            try:
                future.result(timeout + 1.0)
            except (TimeoutError, concurrent.futures.TimeoutError):
                logger.warning("shutdown work did not finish within %.1f s", timeout)
            except Exception as exc:
                logger.warning("shutdown work failed: %r", exc)
        asyncio.run_coroutine_threadsafe(self._cancel_all(), self.loop).result(5.0)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5.0)
        if not self._thread.is_alive():
            self.loop.close()

    @staticmethod
    async def _cancel_all() -> None:
        current = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class BoundedBacklog:
    """Work on a ``BackgroundLoop`` holding at most ``max_bytes`` until it ends; what does not fit is dropped.

    ``offer`` may be called from any thread; the bytes of a piece of work are released when its future
    ends (done, failed or cancelled). A dropped offer never builds its work: ``make`` is called only once
    the bytes are reserved, so the copy a caller would make for it is never made either.
    """

    def __init__(
        self, loop: BackgroundLoop, max_bytes: int, what: str, *, warn_interval: float = 60.0
    ) -> None:
        if max_bytes <= 0:
            raise ValueError(f"a backlog bound must be positive, got {max_bytes}")
        self.loop = loop
        self.max_bytes = max_bytes
        self.what = what
        """Names the work in the drop warning ("publish backlog")."""
        self.warn_interval = warn_interval
        self.pending_bytes = 0
        self.futures: set[concurrent.futures.Future[Any]] = set()
        self.dropped = 0
        self.dropped_bytes = 0
        self._lock = threading.Lock()  # offers come from the engine's thread, releases from the loop's
        self._warned_at: float | None = None
        self._dropped_since_warning = 0

    def offer(
        self, nbytes: int, make: Callable[[], Coroutine[Any, Any, T]]
    ) -> concurrent.futures.Future[T] | None:
        """Run ``make()`` on the loop if ``nbytes`` more fit under the bound; None (counted) if not."""
        with self._lock:
            if self.pending_bytes + nbytes > self.max_bytes:
                self.dropped += 1
                self.dropped_bytes += nbytes
                self._dropped_since_warning += 1
                self._maybe_warn()
                return None
            self.pending_bytes += nbytes
        try:
            future = self.loop.submit(make())
        except BaseException:
            self._release(nbytes)
            raise
        with self._lock:
            self.futures.add(future)
        future.add_done_callback(lambda f: self._done(f, nbytes))
        return future

    def _done(self, future: concurrent.futures.Future[Any], nbytes: int) -> None:
        with self._lock:
            self.futures.discard(future)
        self._release(nbytes)

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self.pending_bytes -= nbytes

    def pending(self) -> list[concurrent.futures.Future[Any]]:
        with self._lock:
            return list(self.futures)

    def _maybe_warn(self) -> None:
        # One line per interval, not one per dropped piece: a full backlog drops on every step.
        now = time.monotonic()
        if self._warned_at is not None and now - self._warned_at < self.warn_interval:
            return
        self._warned_at = now
        logger.warning(
            "kvnet: %s full (%d of %d bytes held): dropped %d piece(s) of work since the last warning, "
            "%d in all", self.what, self.pending_bytes, self.max_bytes, self._dropped_since_warning,
            self.dropped,
        )
        self._dropped_since_warning = 0


async def _bounded(work: Coroutine[Any, Any, Any], timeout: float) -> Any:
    async with asyncio.timeout(timeout):
        return await work
