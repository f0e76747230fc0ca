"""An event loop on its own thread (``kvnet.integrations.background``)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvnet.integrations.background import BackgroundLoop


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
