"""FETCH: one request's range served from a live pushed track or from the cache (which goes to the routes
on a miss), streamed to the requester under the relay's buffer caps and slow-peer deadline.

Owns: ``serve_fetch`` (the relay's handler of "fetch") and ``FetchHost``, what it needs of the relay
(``relay.relay.Relay`` is the one implementation; this module never imports it). A joining FETCH is
resolved against its SUBSCRIBE of the same session (``Peer.subscription``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Protocol

from kvnet.net.errors import ConnectionClosed, StreamResetError
from kvnet.net.handles import IncomingFetch, IncomingRequest
from proto import events as me
from proto.errors import RequestErrorCode, StreamResetCode
from proto.messages import FetchType, Location
from relay.cache import (
    CachedObject,
    ObjectCache,
    RequestFailed,
    TrackKey,
    exclusive_to_wire_end,
    wire_end_to_exclusive,
)
from relay.cache import Location as Position
from relay.config import RelayConfig
from relay.fanout import Fanout
from relay.metrics import Metrics
from relay.peer import Peer, code_name
from relay.pressure import Pressure
from relay.upstream import RoutedUpstream


class FetchHost(Protocol):
    """What serving a FETCH needs of the relay: its limits, metrics, cache, live fan-outs (a pushed track
    is served from its fan-out), buffer accounting, the routes of a miss and how answers are counted."""

    config: RelayConfig
    metrics: Metrics
    cache: ObjectCache
    fanouts: dict[TrackKey, Fanout]
    pressure: Pressure

    def buffers_full(self) -> bool: ...

    def count(self, kind: str, outcome: str) -> None: ...

    def reject(
        self, req: IncomingRequest, kind: str, code: int, reason: str, retry_interval: int = 0
    ) -> None: ...

    def cancelled(
        self, peer: Peer, req: IncomingRequest, kind: str, exc: BaseException | None = None
    ) -> None: ...

    def upstream_for(self, key: TrackKey, requester: Peer) -> RoutedUpstream: ...


async def serve_fetch(relay: FetchHost, peer: Peer, req: IncomingFetch) -> None:
    """Serve ``peer``'s FETCH ``req`` to its end: answered, streamed and finished, or refused, reset or
    found cancelled, each counted under ``requests_total``."""
    try:
        key, start, end = await _fetch_range(peer, req.event)
    except RequestFailed as exc:
        relay.reject(req, "fetch", exc.code, exc.reason, exc.retry_interval)
        return
    objects: AsyncIterator[CachedObject]
    fan = relay.fanouts.get(key)
    wait = relay.config.limits.upstream_timeout
    short = False
    """The range is of a pushed track whose objects did not all arrive within the wait."""
    if fan is not None and relay.cache.cached_status(key) is None and not fan.live_complete(start, end):
        # Objects of the range are still on their way from the publisher: wait for them (bounded)
        # rather than end the FETCH's stream after what we hold, which reads as the whole range. A
        # track the cache holds whole is served from it: a session that PUBLISHed the same name and
        # sends nothing (a squatter) must not hold its FETCHes.
        complete = await fan.wait_live(start, end, wait)
        outcome = "complete" if complete else "short"
        relay.metrics.inc("live_fetch_waits_total", labels={"outcome": outcome})
        if req.gone:
            relay.cancelled(peer, req, "fetch")
            return
        fan = relay.fanouts.get(key)  # ended meanwhile: a complete track is in the cache now
        short = not complete
        if fan is not None and short:
            fan = None  # still short: ask the routes (the publisher's namespace) like any other miss
    live = [] if fan is None else fan.live_objects(start, end)
    if live and relay.cache.cached_status(key) is not None:
        live = []  # the whole track is cached: the cache answers, as for any other track
    if fan is not None and live:
        # A live track that reached us by PUBLISH: nobody upstream has it, so serve what we hold.
        outcome = "live"
        served_end = (live[-1].group, live[-1].object_id + 1)
        # The answer reaches the end of the track only if the track ended and we hold nothing later.
        end_of_track = fan.track_ended and not fan.live_objects(served_end, (1 << 62, 0))
        objects = _iterate(live)
    else:
        handle = relay.cache.fetch(
            key, start, end, relay.upstream_for(key, peer), from_upstream=peer.upstream is not None
        )
        outcome = "cache_hit" if handle.from_cache else ("coalesced" if handle.coalesced else "miss")
        try:
            info = await handle.info()
        except RequestFailed as exc:
            if short and exc.code == RequestErrorCode.DOES_NOT_EXIST:
                # It does exist, in part: TIMEOUT says "not yet" (a subscriber may ask again), where
                # DOES_NOT_EXIST would read as a block nobody has.
                reason = f"track still arriving from its publisher after {wait:g}s"
                relay.reject(req, "fetch", RequestErrorCode.TIMEOUT, reason, int(wait * 1000) + 1)
                return
            relay.reject(req, "fetch", exc.code, exc.reason, exc.retry_interval)
            return
        except (ConnectionClosed, StreamResetError) as exc:
            relay.reject(req, "fetch", RequestErrorCode.INTERNAL_ERROR, f"upstream failed: {exc}")
            return
        end_of_track, served_end = info.end_of_track, info.end
        objects = handle.objects()
    if req.gone:
        relay.cancelled(peer, req, "fetch")
        return
    req.accept_fetch(end_of_track, Location(*exclusive_to_wire_end(served_end)))
    stall = relay.config.limits.slow_peer_timeout
    peer.fetch_started(req)
    try:
        async for obj in objects:
            if req.gone:
                relay.cancelled(peer, req, "fetch")
                return
            if not peer.fetch_streaming(req):
                return  # cut off by a limit (counted there)
            if relay.buffers_full() and not await relay.pressure.wait_buffer_room(stall):
                relay.metrics.inc("limit_rejections_total", labels={"limit": "buffered_bytes_global"})
                req.cancel(StreamResetCode.EXCESSIVE_LOAD)
                relay.count("fetch", "excessive_load")
                return
            if req.gone:  # cancelled while we waited for buffer room
                relay.cancelled(peer, req, "fetch")
                return
            req.send_object(
                obj.group, obj.subgroup, obj.object_id, obj.payload, obj.priority, obj.properties
            )
            peer.wrote(len(obj.payload))
            relay.pressure.wrote(len(obj.payload))
            relay.metrics.inc("bytes_out_total", len(obj.payload))
            if req.writable:
                # No back-pressure: skip the timed wait (a task per object, ~1% of relay CPU) but still
                # yield once per object, so other sessions and the packet sender interleave as before.
                await asyncio.sleep(0)
                continue
            try:
                async with asyncio.timeout(stall):
                    await req.drain()
            except TimeoutError:
                # The peer stopped reading: give the buffered bytes back instead of holding them forever.
                relay.metrics.inc("limit_rejections_total", labels={"limit": "slow_peer"})
                req.cancel(StreamResetCode.TOO_FAR_BEHIND)
                relay.count("fetch", "too_far_behind")
                return
            if not peer.fetch_streaming(req):
                return  # cut off by a limit while we waited
    except RequestFailed as exc:
        req.cancel(StreamResetCode.INTERNAL_ERROR)
        relay.count("fetch", code_name(exc.code))
        return
    except (ConnectionClosed, StreamResetError, OSError) as exc:
        peer.log.info("upstream fetch broke mid-stream", extra={"error": str(exc)})
        req.cancel(StreamResetCode.INTERNAL_ERROR)
        relay.count("fetch", "upstream_reset")
        return
    finally:
        peer.fetch_ended(req)
    if req.gone:
        # Cancelled while the last object was on its way: nothing to FIN, the request is over.
        relay.cancelled(peer, req, "fetch")
        return
    req.finish()
    relay.count("fetch", outcome)

async def _fetch_range(peer: Peer, ev: me.FetchReceived) -> tuple[TrackKey, Position, Position]:
    """Track and ``[start, end)`` of a FETCH. A joining FETCH (draft "Joining Fetches") covers the
    groups before its SUBSCRIBE of the same session: from ``Joining Start`` groups back (relative) or
    from group ``Joining Start`` (absolute), up to the Largest Location the SUBSCRIBE started after."""
    if ev.fetch_type == FetchType.STANDALONE:
        assert ev.track_namespace is not None and ev.track_name is not None
        assert ev.start is not None and ev.end is not None
        end = wire_end_to_exclusive((ev.end.group, ev.end.object))
        return (ev.track_namespace, ev.track_name), (ev.start.group, ev.start.object), end
    assert ev.joining_request_id is not None and ev.joining_start is not None
    joined = peer.subscription(ev.joining_request_id)
    if joined is None:
        raise RequestFailed(
            RequestErrorCode.INVALID_JOINING_REQUEST_ID, "no SUBSCRIBE of this session has that id"
        )
    # The SUBSCRIBE may still be on its way upstream: the FETCH joins it once it is answered.
    await asyncio.wait({joined})
    if joined.cancelled():
        raise RequestFailed(RequestErrorCode.INVALID_JOINING_REQUEST_ID, "the joined SUBSCRIBE failed")
    key, largest = joined.result()
    if largest is None:
        raise RequestFailed(RequestErrorCode.INVALID_RANGE, "the joined track had no objects yet")
    if ev.fetch_type == FetchType.RELATIVE_JOINING:
        start_group = max(0, largest.group - ev.joining_start)
    else:
        start_group = ev.joining_start
    if start_group > largest.group:
        raise RequestFailed(RequestErrorCode.INVALID_RANGE, "Joining Start is past the subscription")
    return key, (start_group, 0), (largest.group, largest.object + 1)


async def _iterate(objects: list[CachedObject]) -> AsyncIterator[CachedObject]:
    for obj in objects:
        yield obj
