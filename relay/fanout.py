"""Fan-out: one upstream subscription (a SUBSCRIBE the relay sent, or a PUBLISH it accepted) forwarded to
every downstream subscriber, with the per-subscriber buffer limits; PUBLISH-fed tracks are collected so a
complete track lands in the cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Protocol

from kvnet.net.errors import ConnectionClosed, LimitError, RequestRejected, StreamResetError
from kvnet.net.handles import (
    Subscription,
)
from kvnet.net.reconnect import DEFAULT_CAP_S, Backoff
from proto.data import ObjectStatus
from proto.errors import PublishDoneCode, StreamResetCode
from proto.events import SubgroupClosed
from proto.messages import Location, Properties
from relay.cache import CachedObject, FetchInfo, ObjectCache, RequestFailed, TrackKey
from relay.config import RelayConfig
from relay.metrics import Metrics
from relay.peer import Peer
from relay.tasks import spawn
from relay.upstream import RoutedUpstream, cached_object

logger = logging.getLogger(__name__)


RECENT_STREAMS = 64
"""Closed subgroup streams per subscriber that PUBLISH_DONE waits for. Older groups left the per-session
send buffer (``max_buffered_bytes_per_session``) long before the track ends, or the subscriber was cut."""

OPEN_SUBGROUPS = 64
"""Subgroup streams one subscription may hold open toward its subscriber. Groups overlap (a publisher
opens the next group before the last one's FIN), so older groups' streams stay open until their upstream
stream ends; past this many the oldest is reset (EXCESSIVE_LOAD) and the rest of its subgroup is not
forwarded (it can be FETCHed)."""

RETIRED_SUBGROUPS = 1024
"""Ended subgroups remembered per subscriber, so that a late object of one never reopens it on a new
stream; objects of groups older than every forgotten one are not forwarded either."""


@dataclass
class SubgroupStream:
    """One subgroup stream toward a subscriber and where its objects come from."""

    stream_id: int
    upstream_stream: int | None
    """The upstream stream its objects arrived on (None: datagrams)."""
    last_object: int
    """Object ID of the last object sent on it."""

    def takes(self, object_id: int, upstream_stream: int | None) -> bool:
        """Whether an object of this subgroup is the next one on this stream (draft "Closing Subgroup
        Streams": one greater than the previous, or from the same upstream stream with nothing between)."""
        same_upstream = upstream_stream is not None and upstream_stream == self.upstream_stream
        return object_id > self.last_object and (same_upstream or object_id == self.last_object + 1)


SubgroupKey = tuple[int, int | None]
"""(Group ID, Subgroup ID) of a subgroup (Subgroup ID None: objects that came as datagrams)."""


@dataclass
class DownstreamSubscriber:
    """One downstream subscriber of a fan-out: a SUBSCRIBE it sent us, or a PUBLISH we sent it (after its
    SUBSCRIBE_TRACKS); either way ``request_id`` is the request the objects belong to.

    Draft "Subgroups" and "Closing Subgroup Streams": the objects of one subgroup go on one stream, which
    ends with FIN only once the whole subgroup is on it (its upstream stream ended with FIN, or an
    END_OF_GROUP / END_OF_TRACK object); a stream closed before that is reset, and that subgroup is not
    reopened on another stream."""

    peer: Peer
    request_id: int
    alias: int
    streams: dict[SubgroupKey, SubgroupStream] = field(default_factory=dict)
    """Open subgroup streams toward this subscriber."""
    retired: OrderedDict[SubgroupKey, None] = field(default_factory=OrderedDict)
    """Subgroups whose stream ended (FIN, or reset by a limit): their late objects are not forwarded."""
    retired_floor: int = -1
    """Objects of groups up to this one that have no open stream are not forwarded (``RETIRED_SUBGROUPS``
    forgot which of their subgroups ended)."""
    closed_streams: deque[int] = field(default_factory=lambda: deque(maxlen=RECENT_STREAMS))
    """Streams we FINed, whose bytes may still be queued (the latest few)."""
    dropped: bool = False
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the relay ended this subscription (upstream done, or the subscriber was cut off)."""

    def cancel(self, code: StreamResetCode) -> None:
        """Reset the subscription's request and data streams with ``code``."""
        self.peer.conn.cancel_request(self.request_id, code)

    def retire(self, key: SubgroupKey) -> None:
        self.retired[key] = None
        if len(self.retired) > RETIRED_SUBGROUPS:
            forgotten, _ = self.retired.popitem(last=False)
            self.retired_floor = max(self.retired_floor, forgotten[0])

    def is_retired(self, key: SubgroupKey) -> bool:
        return key in self.retired or (key[0] <= self.retired_floor and key not in self.streams)

    def fin(self, key: SubgroupKey) -> None:
        """The whole subgroup is on its stream: close it normally."""
        st = self.streams.pop(key)
        self.peer.conn.close_subgroup(st.stream_id)
        self.closed_streams.append(st.stream_id)
        self.retire(key)

    def reset(self, key: SubgroupKey, code: StreamResetCode, retire: bool) -> None:
        """Close a stream whose subgroup was not sent whole; ``retire``: send no more of that subgroup."""
        st = self.streams.pop(key)
        self.peer.conn.reset_subgroup(st.stream_id, code)
        if retire:
            self.retire(key)


class Holding(Protocol):
    """Objects of one pushed track held for the session that pushed it (a PUBLISH-fed ``Fanout``, a
    contending copy): what ``FanoutHost.hold`` charges and may drop."""

    @property
    def holder(self) -> Peer: ...

    @property
    def held_bytes(self) -> int: ...

    def drop_held(self) -> None:
        """Let go of every held object (releasing them with ``FanoutHost.release_held``) and hold no more."""


class FanoutHost(Protocol):
    """What a fan-out needs of the relay that runs it: its limits, cache, buffer accounting, the held-bytes
    bounds, the routes upstream, and the table of live fan-outs it removes itself from
    (``relay.relay.Relay`` is the one implementation; this module never imports it)."""

    config: RelayConfig
    metrics: Metrics
    cache: ObjectCache
    fanouts: dict[TrackKey, Fanout]

    def clock(self) -> float: ...

    def buffers_full(self) -> bool: ...

    def buffer_fair_share(self) -> int: ...

    def wrote(self, nbytes: int) -> None:
        """``nbytes`` of object payload were written toward a session (counted as buffered)."""

    def hold(self, holding: Holding, n: int) -> bool: ...

    def unhold(self, holding: Holding, n: int) -> None: ...

    def release_held(self, holding: Holding) -> None: ...

    def upstream_for(self, key: TrackKey, requester: Peer) -> RoutedUpstream: ...


class Fanout:
    """One upstream subscription (SUBSCRIBE we sent, or a PUBLISH we accepted) fanned out to N subscribers."""

    def __init__(self, relay: FanoutHost, key: TrackKey) -> None:
        self.relay = relay
        self.key = key
        self.subs: dict[tuple[int, int], DownstreamSubscriber] = {}
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.largest: Location | None = None
        self.properties: Properties = ()
        self.upstream: Subscription | None = None
        self.source_peer: Peer | None = None
        self.publish_objects: deque[CachedObject] | None = None
        """PUBLISH-fed tracks: the latest objects, at most ``cache.max_track_bytes`` of them. They serve
        FETCHes of the live track (nobody else has them) and are stored in the cache once the track is
        complete."""
        self.publish_bytes = 0
        self.held_dropped = False
        """A limit on held bytes (``Relay.hold``) dropped this track's objects: none are held any more."""
        self.requester: Peer | None = None
        """The session whose SUBSCRIBE started the upstream subscription (routes never lead back to it)."""
        self.resumed = 0
        """Times the upstream subscription was re-established after its session was lost."""
        self.task: asyncio.Task[None] | None = None
        self.ended = False
        self.track_ended = False
        """An END_OF_TRACK object arrived from the source."""
        self._changed = asyncio.Event()
        """Set (and replaced) whenever a PUBLISH-fed object is collected or the fan-out ends: what
        ``wait_live`` waits on."""

    @property
    def holder(self) -> Peer:
        """The session whose PUBLISH feeds this track (``Holding``)."""
        assert self.source_peer is not None
        return self.source_peer

    @property
    def held_bytes(self) -> int:
        return self.publish_bytes

    def drop_held(self) -> None:
        """Let go of the held objects of this PUBLISH-fed track for good: live subscribers still get
        what follows, the track is no longer served from here or cached whole."""
        self.held_dropped = True
        self._release_held()

    def _release_held(self) -> None:
        if self.publish_objects is not None and self.source_peer is not None:
            self.relay.release_held(self)
            self.publish_objects.clear()
            self.publish_bytes = 0

    def add(self, sub: DownstreamSubscriber) -> None:
        self.subs[(sub.peer.id, sub.request_id)] = sub

    def remove(self, peer: Peer, request_id: int) -> None:
        self.subs.pop((peer.id, request_id), None)
        if not self.subs and self.publish_objects is None and self.upstream is not None:
            # Last subscriber left a relay-initiated subscription: stop pulling it from upstream.
            self.upstream.cancel()
            if self.relay.fanouts.get(self.key) is self:  # not a newer fan-out of the same track
                del self.relay.fanouts[self.key]

    def forward(
        self, obj: CachedObject, upstream_stream: int | None = None, first_object: bool = False
    ) -> None:
        """Send one object to every subscriber, on the stream of its subgroup (``upstream_stream``: the
        stream it arrived on, None for a datagram; ``first_object``: the first object the original
        publisher sent in its subgroup, so a stream that starts with it says so)."""
        loc = Location(obj.group, obj.object_id)
        if self.largest is None or (loc.group, loc.object) > (self.largest.group, self.largest.object):
            self.largest = loc
        relay = self.relay
        limit = relay.config.limits.max_buffered_bytes_per_session
        key: SubgroupKey = (obj.group, obj.subgroup)
        for sub in list(self.subs.values()):
            if sub.dropped or sub.peer.conn.is_closed:
                continue
            conn = sub.peer.conn
            buffered = conn.send_buffered()
            if buffered > limit:
                self.drop(sub, StreamResetCode.TOO_FAR_BEHIND, "buffered_bytes")
                continue
            if relay.buffers_full() and buffered > relay.buffer_fair_share():
                # Over the relay-wide cap: the subscribers holding more than an equal share go first.
                self.drop(sub, StreamResetCode.EXCESSIVE_LOAD, "buffered_bytes_global")
                continue
            try:
                st = sub.streams.get(key)
                if st is not None and not st.takes(obj.object_id, upstream_stream):
                    # Not known to be the next object of the stream: reset it and open a new one.
                    sub.reset(key, StreamResetCode.INTERNAL_ERROR, retire=False)
                    st = None
                if st is None:
                    if sub.is_retired(key):
                        continue  # that subgroup's stream ended; the object is served by FETCH
                    if len(sub.streams) >= OPEN_SUBGROUPS:
                        sub.reset(min(sub.streams, key=_oldest), StreamResetCode.EXCESSIVE_LOAD, retire=True)
                    sid = conn.open_subgroup(
                        sub.alias,
                        obj.group,
                        obj.subgroup or 0,
                        obj.priority,
                        has_properties=bool(obj.properties),
                        first_object=first_object,
                    )
                    st = sub.streams[key] = SubgroupStream(sid, upstream_stream, obj.object_id)
                end = obj.status in (ObjectStatus.END_OF_GROUP, ObjectStatus.END_OF_TRACK)
                conn.send_subgroup_object(
                    st.stream_id, obj.object_id, obj.payload, obj.properties, ObjectStatus(obj.status), end
                )
                st.last_object = obj.object_id
                if end:
                    sub.streams.pop(key)
                    sub.closed_streams.append(st.stream_id)
                    sub.retire(key)
                sub.peer.wrote(len(obj.payload))
                relay.wrote(len(obj.payload))
                relay.metrics.inc("bytes_out_total", len(obj.payload))
            except Exception as exc:  # a broken subscriber session must not stop the others
                self._broken(sub, exc)

    def stream_ended(self, ev: SubgroupClosed) -> None:
        """An upstream subgroup stream ended: FIN (every object of it is in) closes the subscribers'
        stream of that subgroup normally; a reset resets theirs (with the upstream's code), and a new
        upstream stream of the subgroup may open a new one."""
        key: SubgroupKey = (ev.group_id, ev.subgroup_id)
        for sub in list(self.subs.values()):
            st = sub.streams.get(key)
            if sub.dropped or sub.peer.conn.is_closed or st is None or st.upstream_stream != ev.stream_id:
                continue
            try:
                if ev.error_code is None:
                    sub.fin(key)
                else:
                    sub.reset(key, _reset_code(ev.error_code), retire=False)
            except Exception as exc:
                self._broken(sub, exc)

    @staticmethod
    def _broken(sub: DownstreamSubscriber, exc: Exception) -> None:
        sub.peer.log.info("dropping subscriber", extra={"error": repr(exc)})
        sub.dropped = True
        sub.ended.set()

    def drop(self, sub: DownstreamSubscriber, code: StreamResetCode, limit: str) -> None:
        """Cut one subscriber off (its request and subgroup streams reset with ``code``), counted under
        ``limit_rejections_total{limit}``; the others keep receiving."""
        sub.dropped = True
        sub.ended.set()
        self.relay.metrics.inc("limit_rejections_total", labels={"limit": limit})
        sub.peer.log.warning("subscriber over a limit; ending subscription", extra={"limit": limit})
        with contextlib.suppress(Exception):
            sub.cancel(code)

    def finish(self, status: int, reason: str) -> None:
        """Upstream ended: reset every subscriber's streams still open (their upstream streams never
        ended, so their subgroups are not known to be whole), and send each PUBLISH_DONE with the same
        status once its FINed streams' bytes are delivered.

        Not at once: a subscriber waits for the streams PUBLISH_DONE's Stream Count announces only
        ``publish_done_timeout`` without any of the track's bytes, and over a slow link the objects
        queued here trail the control stream by longer than that (the track would be cut short). A
        subscriber that stops reading is cut off by the slow-peer rule, which ends the wait too.
        """
        self.ended = True
        self._wake()
        if self.relay.fanouts.get(self.key) is self:
            del self.relay.fanouts[self.key]
        self._release_held()
        for sub in list(self.subs.values()):
            if sub.dropped or sub.peer.conn.is_closed:
                sub.ended.set()
                continue
            with contextlib.suppress(Exception):
                for key in list(sub.streams):
                    sub.reset(key, StreamResetCode.CANCELLED, retire=True)
            sub.streams.clear()
            spawn(self._publish_done(sub, status, reason), sub.peer.tasks, "PUBLISH_DONE to a subscriber")
        self.subs.clear()

    @staticmethod
    async def _publish_done(sub: DownstreamSubscriber, status: int, reason: str) -> None:
        conn = sub.peer.conn
        try:
            await asyncio.gather(*(conn.wait_stream_sent(sid) for sid in sub.closed_streams))
            if not conn.is_closed and not sub.dropped:
                with contextlib.suppress(Exception):  # the subscriber may have cancelled meanwhile
                    conn.publish_done(sub.request_id, status, reason)
        finally:
            sub.ended.set()

    async def pump(self, source: Subscription) -> None:
        status, reason = 0x2, "track ended"  # TRACK_ENDED
        forwarded_before: tuple[int, int] | None = None
        """After a resume: objects up to here were forwarded on the lost subscription."""
        try:
            while True:
                try:
                    async for ev in source.events():
                        if isinstance(ev, SubgroupClosed):
                            self.stream_ended(ev)
                            continue
                        obj = cached_object(ev)
                        if forwarded_before is not None and obj.location <= forwarded_before:
                            continue
                        self.track_ended = self.track_ended or obj.status == ObjectStatus.END_OF_TRACK
                        self.relay.metrics.inc("bytes_in_total", len(ev.payload))
                        if self.publish_objects is not None:
                            self._collect(obj)
                            self._wake()
                        self.forward(obj, ev.stream_id, ev.first_object)
                    if source.done is not None:
                        status, reason = source.done.status_code, source.done.reason
                    return
                except (ConnectionClosed, RequestRejected, StreamResetError, LimitError) as exc:
                    if self.track_ended:
                        # The source went away after END_OF_TRACK (e.g. a one-shot publisher exiting before
                        # its PUBLISH_DONE): every object arrived, so the track did end.
                        status, reason = PublishDoneCode.TRACK_ENDED, "track ended"
                        return
                    if source is self.upstream and source.session_closed:
                        resumed = await self._resubscribe(str(exc))
                        if resumed is not None:
                            source = resumed
                            largest = self.largest
                            forwarded_before = None if largest is None else (largest.group, largest.object)
                            continue
                    status, reason = PublishDoneCode.INTERNAL_ERROR, f"upstream ended: {exc}"
                    return
        finally:
            self.finish(status, reason)

    async def _resubscribe(self, why: str) -> Subscription | None:
        """The session carrying our upstream SUBSCRIBE was lost (an upstream relay or publisher restarted
        or went away): subscribe again on whatever route comes up, retrying on the reconnect backoff for
        at most its cap plus ``upstream_timeout``, while subscribers remain. Objects published meanwhile
        are not recovered (a live subscription; the subscribers may FETCH them)."""
        relay, requester = self.relay, self.requester
        if requester is None:
            return None
        window = DEFAULT_CAP_S + relay.config.limits.upstream_timeout
        deadline = relay.clock() + window
        backoff = Backoff()
        logger.info("upstream subscription lost; subscribing again", extra={"error": why, "within": window})
        while self.subs and relay.clock() < deadline:
            try:
                sub = await relay.upstream_for(self.key, requester).subscribe(self.key)
            except RequestFailed as exc:
                why = exc.reason
                await asyncio.sleep(min(backoff.next_delay(), max(0.0, deadline - relay.clock())))
                continue
            if not self.subs:
                sub.cancel()  # the last subscriber left while we subscribed
                return None
            self.upstream = sub
            self.resumed += 1
            relay.metrics.inc("subscriptions_resumed_total")
            logger.info("upstream subscription resumed", extra={"attempts": backoff.attempt + 1})
            return sub
        logger.info("upstream subscription not resumed", extra={"error": why})
        return None

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _collect(self, obj: CachedObject) -> None:
        objs = self.publish_objects
        assert objs is not None
        if self.held_dropped:
            return
        relay = self.relay
        budget = relay.config.cache.max_track_bytes
        if obj.status == ObjectStatus.END_OF_TRACK:
            # A PUBLISH-pushed track that starts at {0,0} and has no gaps is complete: cache it so FETCH and
            # TRACK_STATUS are served without asking the publisher.
            contiguous = all(o.location == (0, i) for i, o in enumerate(objs))
            if objs and contiguous and obj.location == (0, len(objs)):
                relay.cache.put_track(self.key, list(objs), FetchInfo((0, len(objs)), True, self.properties))
                if relay.cache.cached_status(self.key) is not None:
                    self._release_held()  # the cache serves it now (and counts its bytes)
            return
        # Over the budget the oldest objects go; a track that lost its start is never cached whole.
        while objs and self.publish_bytes + obj.size > budget:
            size = objs.popleft().size
            self.publish_bytes -= size
            relay.unhold(self, size)
        if obj.size > budget or not relay.hold(self, obj.size):
            return
        objs.append(obj)
        self.publish_bytes += obj.size

    def live_complete(self, start: tuple[int, int], end: tuple[int, int]) -> bool:
        """Whether a PUBLISH-fed track holds every object of ``[start, end)`` its publisher has published:
        the track ended, or an object at or past the last location the range can have arrived. That
        location is the range's end or the track's Largest Location (the PUBLISH's, or the largest
        object seen since), whichever is smaller: objects the publisher announced and that are still on
        their way are waited for, a live track is not waited on past its newest object. Objects arrive
        in order on one subgroup stream (a kvnet block track has exactly one), so the last one's arrival
        means the earlier ones are in."""
        if self.publish_objects is None or self.track_ended:
            return True
        largest = self.largest
        last = (end[0], end[1] - 1) if end[1] > 0 else end
        if largest is not None:
            last = min(last, (largest.group, largest.object))
        if last < start:
            return True
        return any(o.location >= last for o in reversed(self.publish_objects))

    async def wait_live(self, start: tuple[int, int], end: tuple[int, int], timeout: float) -> bool:
        """Wait until ``live_complete(start, end)``, the fan-out ends or ``timeout`` seconds pass; returns
        ``live_complete`` then (False: the publisher's objects did not all arrive, and the range must not
        be served as if they had)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self.live_complete(start, end) and not self.ended:
            changed = self._changed
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await changed.wait()
        return self.live_complete(start, end)

    def live_objects(self, start: tuple[int, int], end: tuple[int, int]) -> list[CachedObject]:
        """Objects of a PUBLISH-fed track the relay still holds in ``[start, end)``, in Location order
        (subgroups of one group may arrive interleaved)."""
        if self.publish_objects is None:
            return []
        held = [o for o in self.publish_objects if start <= o.location < end]
        return sorted(held, key=lambda o: o.location)


def _oldest(key: SubgroupKey) -> tuple[int, int]:
    return key[0], -1 if key[1] is None else key[1]


def _reset_code(code: int) -> StreamResetCode:
    """The upstream's reset code passed on, where it is one the draft defines."""
    try:
        return StreamResetCode(code)
    except ValueError:
        return StreamResetCode.INTERNAL_ERROR
