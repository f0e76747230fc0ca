"""kvnet.net.sendbuffer: ``SendBuffer`` against a stand-in for the stack's count of unsent bytes."""

from __future__ import annotations

import asyncio

from kvnet.net.sendbuffer import SendBuffer
from tests.helpers.waiting import async_wait_until


class Unsent:
    """Unsent bytes per stream, as ``Stack.unsent_bytes`` reports them; the test drains them by hand."""

    def __init__(self) -> None:
        self.held: dict[int, int] = {}
        self.asked: list[list[int]] = []

    def __call__(self, stream_ids: list[int]) -> dict[int, int]:
        self.asked.append(sorted(stream_ids))
        return {sid: self.held.get(sid, 0) for sid in stream_ids}


async def test_buffered_counts_written_streams_and_forgets_drained_ones() -> None:
    unsent = Unsent()
    buf = SendBuffer(unsent, max_send_buffer=100)
    unsent.held = {0: 30, 4: 50, 8: 7}
    buf.wrote(0)
    buf.wrote(4)
    assert buf.buffered() == 80  # stream 8 was never written through this buffer
    unsent.held[0] = 0
    assert buf.buffered() == 50
    assert buf.buffered() == 50 and unsent.asked[-1] == [4]  # the drained stream is no longer asked about


async def test_writers_wait_above_the_limit_until_a_check_finds_it_drained() -> None:
    unsent = Unsent()
    buf = SendBuffer(unsent, max_send_buffer=100)
    unsent.held = {0: 150}
    buf.wrote(0)
    assert not buf.is_writable() and not buf.has_waiters()
    writer = asyncio.create_task(buf.wait_writable())
    await async_wait_until(buf.has_waiters, "the writer waiting")
    assert not writer.done()
    buf.check(closed=False)
    assert buf.has_waiters() and not writer.done()  # still 150 unsent: the writer is not released
    unsent.held[0] = 99
    buf.check(closed=False)
    await asyncio.wait_for(writer, 1)


async def test_stream_sent_waiters_wake_per_stream_and_all_at_the_end() -> None:
    unsent = Unsent()
    buf = SendBuffer(unsent, max_send_buffer=100)
    unsent.held = {0: 10, 4: 10}
    buf.wrote(0)
    buf.wrote(4)
    first = asyncio.create_task(buf.wait_stream_sent(0))
    second = asyncio.create_task(buf.wait_stream_sent(4))
    empty = asyncio.create_task(buf.wait_empty())
    await async_wait_until(
        lambda: len(buf._stream_sent_waiters) == 2 and not buf._empty.is_set(), "all three waiting"
    )
    unsent.held[0] = 0
    buf.check(closed=False)
    await asyncio.wait_for(first, 1)
    assert not second.done() and not empty.done()
    buf.release_all()
    await asyncio.wait_for(asyncio.gather(second, empty), 1)
    assert not buf.has_waiters()


async def test_nothing_unsent_returns_at_once() -> None:
    buf = SendBuffer(Unsent(), max_send_buffer=100)
    buf.wrote(0)
    await asyncio.wait_for(asyncio.gather(buf.wait_writable(), buf.wait_empty(), buf.wait_stream_sent(0)), 1)
    assert not buf.has_waiters()
