"""Bounded memory of the peer's identifiers: which Request IDs and which stream ids it has used.

Owns: ``PeerRequestIds`` (duplicate and parity checks of the peer's Request IDs, section "Request ID")
and ``HandledPeerStreams`` (stream ids already handled, so late frames do not resurrect them), both
bounded however long the session lives. Knows nothing of messages or requests."""

from __future__ import annotations

import heapq

from .errors import (
    InvalidRequestId,
)


class PeerRequestIds:
    """Duplicate and parity checks for the peer's Request IDs (section "Request ID").

    Requests arrive on separate streams, so IDs may come out of order. Every ID below ``floor`` has
    been seen; IDs seen above it are kept in a set that is bounded by forgetting the gap below its
    smallest member (a request whose stream was reset before its first byte never shows up).
    """

    def __init__(self, first: int, max_out_of_order: int) -> None:
        self.floor = first
        self._seen: set[int] = set()
        self._parity = first & 1
        self._max = max_out_of_order

    def check(self, request_id: int) -> None:
        if request_id & 1 != self._parity:
            raise InvalidRequestId(f"Request ID {request_id} has the wrong parity for the peer")
        if request_id < self.floor or request_id in self._seen:
            raise InvalidRequestId(f"duplicate Request ID {request_id}")
        self._seen.add(request_id)
        if len(self._seen) > self._max:
            self.floor = min(self._seen)
        while self.floor in self._seen:
            self._seen.discard(self.floor)
            self.floor += 2


class HandledPeerStreams:
    """Peer stream ids already handled, so that late frames do not resurrect them.

    Frames of different streams may arrive out of order, hence a set rather than a high-water mark; it is
    bounded by forgetting the smallest ids, which a heap finds in O(log n) (taking ``min`` of the set was
    O(n) per new stream: 10% of a publisher's CPU answering a locate's TRACK_STATUS probes).
    """

    __slots__ = ("_heap", "_ids", "_limit")

    def __init__(self, limit: int) -> None:
        self._ids: set[int] = set()
        self._heap: list[int] = []
        self._limit = limit

    def __contains__(self, stream_id: int) -> bool:
        return stream_id in self._ids

    def add(self, stream_id: int) -> None:
        if stream_id in self._ids:
            return
        self._ids.add(stream_id)
        heapq.heappush(self._heap, stream_id)
        if len(self._ids) > self._limit:
            self._ids.discard(heapq.heappop(self._heap))


