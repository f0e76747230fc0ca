"""Send-side back-pressure of one connection: bytes written to the stack's streams and not yet gone, and
the writers waiting for them to drain.

Owns: ``SendBuffer``, which counts a connection's unsent bytes over the streams written to (through the
stack's ``unsent_bytes``: aioquic counts unacknowledged bytes, qh3 unsent ones) and wakes the waiters of
``MoqtConnection.wait_writable``, ``wait_send_buffer_empty`` and ``wait_stream_sent``. It holds no
connection: the connection tells it what it wrote and when bytes may have drained (``check``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

UnsentBytes = Callable[[list[int]], dict[int, int]]
"""Bytes still held by the stack for each of the given stream ids (``Stack.unsent_bytes`` of one
connection)."""


class SendBuffer:
    """Unsent bytes of one connection, with a limit above which writers wait (``wait_writable``)."""

    def __init__(self, unsent_bytes: UnsentBytes, max_send_buffer: int) -> None:
        self._unsent_bytes = unsent_bytes
        self._max = max_send_buffer
        self._written_streams: set[int] = set()
        self._writable = asyncio.Event()
        self._writable.set()
        self._empty = asyncio.Event()
        self._empty.set()
        self._stream_sent_waiters: dict[int, asyncio.Future[None]] = {}

    def wrote(self, stream_id: int) -> None:
        """Bytes were written to ``stream_id``: count it until it has none left."""
        self._written_streams.add(stream_id)

    def buffered(self) -> int:
        """Bytes written and not yet acknowledged (or, with qh3, sent), over every stream."""
        total = 0
        # An empty stream needs no more tracking.
        for sid, n in self._unsent_bytes(list(self._written_streams)).items():
            if n == 0:
                self._written_streams.discard(sid)
            total += n
        return total

    def has_waiters(self) -> bool:
        """Someone waits in ``wait_writable``, ``wait_empty`` or ``wait_stream_sent`` (only then is it
        worth counting the buffer)."""
        return not (self._writable.is_set() and self._empty.is_set()) or bool(self._stream_sent_waiters)

    def is_writable(self) -> bool:
        """Buffered bytes are below the limit: more may be written without waiting."""
        return self.buffered() < self._max

    def check(self, closed: bool) -> None:
        """Bytes may have drained (or, ``closed``, will never need to): wake whom that releases."""
        buffered = self.buffered()
        if buffered < self._max or closed:
            self._writable.set()
        if buffered == 0 or closed:
            self._empty.set()
        if self._stream_sent_waiters:
            held = self._unsent_bytes(list(self._stream_sent_waiters))
            self._wake_stream_sent_waiters(lambda sid: closed or held[sid] == 0)

    def release_all(self) -> None:
        """The session is over: wake every waiter (their next action fails on the closed session)."""
        self._writable.set()
        self._empty.set()
        self._wake_stream_sent_waiters(lambda sid: True)

    def _wake_stream_sent_waiters(self, sent: Callable[[int], bool]) -> None:
        for sid in [sid for sid in self._stream_sent_waiters if sent(sid)]:
            fut = self._stream_sent_waiters.pop(sid)
            if not fut.done():
                fut.set_result(None)

    async def wait_writable(self) -> None:
        """Wait until buffered bytes drop below the limit."""
        if self.is_writable():
            return
        self._writable.clear()
        await self._writable.wait()

    async def wait_empty(self) -> None:
        """Wait until no bytes are buffered (the caller returns at once on a closed session)."""
        if self.buffered() == 0:
            return
        self._empty.clear()
        await self._empty.wait()

    async def wait_stream_sent(self, stream_id: int) -> None:
        """Wait until ``stream_id`` has no bytes left (the caller returns at once on a closed session)."""
        if self._unsent_bytes([stream_id])[stream_id] == 0:
            return
        fut = self._stream_sent_waiters.get(stream_id)
        if fut is None:
            fut = self._stream_sent_waiters[stream_id] = asyncio.get_running_loop().create_future()
        await asyncio.shield(fut)
