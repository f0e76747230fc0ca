"""An event loop on its own thread (``kvnet.integrations.background``)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from kvnet.integrations.background import BackgroundLoop, BoundedBacklog
from tests.helpers.waiting import wait_until


async def where() -> str:
    await asyncio.sleep(0)
    return threading.current_thread().name


def test_submit_runs_on_the_loop_thread_without_blocking_the_caller() -> None:
    loop = BackgroundLoop("kvnet-test")
    try:
        gate = asyncio.Event()

        async def wait_for_gate() -> str:
            await gate.wait()
            return "opened"

        pending = loop.submit(wait_for_gate())
        assert not pending.done()  # submit returned while the coroutine waits
        assert loop.submit(where()).result(10) == "kvnet-test"
        loop.loop.call_soon_threadsafe(gate.set)
        assert pending.result(10) == "opened"
    finally:
        loop.stop()


def test_stop_runs_the_last_work_bounded_and_cancels_the_rest() -> None:
    loop = BackgroundLoop("kvnet-test")
    forever = loop.submit(asyncio.Event().wait())
    drained: list[str] = []

    async def drain() -> None:
        drained.append("drained")

    loop.stop(drain(), timeout=5)
    assert drained == ["drained"]
    assert forever.cancelled()
    with pytest.raises(RuntimeError, match="stopped"):
        loop.submit(where())


def test_stop_gives_up_on_last_work_after_its_timeout() -> None:
    loop = BackgroundLoop("kvnet-test")
    loop.stop(asyncio.Event().wait(), timeout=0.05)
    assert not loop.running


def test_a_full_backlog_drops_offers_without_building_them_until_work_ends() -> None:
    loop = BackgroundLoop("kvnet-test")
    backlog = BoundedBacklog(loop, max_bytes=100, what="test backlog")
    gate = threading.Event()
    built: list[str] = []

    def work(name: str) -> Callable[[], Coroutine[Any, Any, str]]:
        def make() -> Coroutine[Any, Any, str]:
            built.append(name)

            async def run() -> str:
                await asyncio.to_thread(gate.wait)
                return name

            return run()

        return make

    try:
        first = backlog.offer(60, work("first"))
        second = backlog.offer(40, work("second"))
        assert first is not None and second is not None
        assert backlog.pending_bytes == 100
        assert backlog.offer(1, work("dropped")) is None  # one byte over the bound
        assert built == ["first", "second"]  # the dropped offer's work was never built
        assert (backlog.dropped, backlog.dropped_bytes) == (1, 1)
        gate.set()
        assert first.result(10) == "first" and second.result(10) == "second"
        wait_until(lambda: backlog.pending_bytes == 0, "the finished work's bytes released")
        third = backlog.offer(100, work("third"))
        assert third is not None and third.result(10) == "third"
        wait_until(lambda: not backlog.pending(), "no work pending")
    finally:
        gate.set()
        loop.stop()


def test_failed_work_releases_its_bytes() -> None:
    loop = BackgroundLoop("kvnet-test")
    backlog = BoundedBacklog(loop, max_bytes=10, what="test backlog")

    async def fail() -> None:
        raise RuntimeError("encoding failed")

    try:
        future = backlog.offer(10, fail)
        assert future is not None
        with pytest.raises(RuntimeError, match="encoding failed"):
            future.result(10)
        wait_until(lambda: backlog.pending_bytes == 0, "the failed work's bytes released")
        assert backlog.dropped == 0
    finally:
        loop.stop()


def test_drops_log_one_warning_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    loop = BackgroundLoop("kvnet-test")
    backlog = BoundedBacklog(loop, max_bytes=5, what="test backlog", warn_interval=3600)
    made: list[Coroutine[Any, Any, None]] = []

    async def work() -> None:
        return None

    def never() -> Coroutine[Any, Any, None]:
        coro = work()
        made.append(coro)
        return coro

    try:
        with caplog.at_level(logging.WARNING, logger="kvnet.integrations.background"):
            for _ in range(50):
                assert backlog.offer(6, never) is None
        assert not made
        assert backlog.dropped == 50 and backlog.dropped_bytes == 300
        warnings = [r for r in caplog.records if "test backlog full" in r.getMessage()]
        assert len(warnings) == 1
    finally:
        loop.stop()


def test_a_backlog_needs_a_positive_bound() -> None:
    loop = BackgroundLoop("kvnet-test")
    try:
        with pytest.raises(ValueError, match="positive"):
            BoundedBacklog(loop, max_bytes=0, what="test backlog")
    finally:
        loop.stop()
