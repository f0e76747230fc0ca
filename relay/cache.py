"""Byte-bounded object cache with request coalescing (moxygen ``MoQCache`` shape).

Owns: cached tracks (objects keyed by Location, the ranges known to be complete, the final end of a track),
LRU eviction under a byte budget, one in-flight upstream request per key shared by every concurrent
requester, and a short negative cache for TRACK_STATUS misses.

Rules:
1. The cache knows nothing about sessions or QUIC. Upstream is an interface (``Upstream``) passed to each
   call; the clock is a constructor argument, so tests inject time instead of sleeping.
2. Only whole objects enter the cache, and a range is served from cache only when an upstream response
   covering it finished cleanly (FETCH_OK seen and the data stream ended with FIN). A failed or cut-off
   fill stores nothing, so a partial track is never served as complete.
3. Payloads are opaque bytes; the cache never looks inside them. The one exception is injected: a
   ``refusal`` check (``relay.admission`` with a trust set) may keep a complete fill out of the cache.
4. Shares: tracks are grouped by the first ``share_depth`` namespace fields (for kvnet namespaces
   ("kvnet", "v2", fingerprint, namespace id): one group per namespace id). A group holds at most
   ``share_limit`` bytes; storing beyond it evicts that group's own least recently used tracks first.
   When the whole cache is over budget, the victim is the least recently used track of a group above an
   equal share of the budget, so a group that floods the cache evicts itself, not the others.
5. Persistent tier (``disk``, optional): every complete, final track is also written to disk in a worker
   thread; a memory miss looks there before going upstream. What comes back passes ``refusal`` again.
6. A request that came from an upstream relay (``from_upstream``) is answered by local sources only, so
   it shares an in-flight fill or query only with other such requests, never with one of ours that may go
   upstream: that one could be waiting for this very request (two workers of ``relay.workers`` missing
   one block at once, each asked by the hub while asking it), a cycle only the upstream timeout would
   break. Its misses are not remembered either: they say nothing of what the upstream holds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from kvnet.storage.disk import DiskTier, StoredTrack
from proto.errors import RequestErrorCode
from proto.messages import Properties

Location = tuple[int, int]
"""(group id, object id); tuples compare in draft order."""
TrackKey = tuple[tuple[bytes, ...], bytes]
"""(track namespace fields, track name): the Full Track Name."""

# Per-object bookkeeping (dict slot, record, list slot) counted against the budget so that a flood of
# empty objects cannot grow memory for free.
OBJECT_OVERHEAD = 128
logger = logging.getLogger(__name__)
START: Location = (0, 0)


def properties_size(properties: Properties) -> int:
    """Bytes a property list costs in memory, roughly (values plus a fixed cost per pair)."""
    return sum(16 + (len(p.value) if isinstance(p.value, bytes) else 8) for p in properties)


def wire_end_to_exclusive(end: Location) -> Location:
    """FETCH End Location (object 0 = whole group, else last object + 1) as an exclusive bound."""
    group, obj = end
    return (group + 1, 0) if obj == 0 else (group, obj)


def exclusive_to_wire_end(end: Location) -> Location:
    """Inverse of ``wire_end_to_exclusive``."""
    group, obj = end
    return (group - 1, 0) if obj == 0 and group > 0 else (group, obj)


@dataclass(frozen=True, slots=True)
class CachedObject:
    """One complete object as received from upstream; every header field is kept (draft: Caching Relays)."""

    group: int
    subgroup: int | None
    """None for objects sent as datagrams."""
    object_id: int
    priority: int
    status: int
    """Object status (0 = normal); only meaningful when the payload is empty."""
    properties: Properties
    """Object Properties, forwarded unchanged."""
    payload: bytes

    @property
    def location(self) -> Location:
        return (self.group, self.object_id)

    @property
    def size(self) -> int:
        return len(self.payload) + properties_size(self.properties) + OBJECT_OVERHEAD


@dataclass(frozen=True, slots=True)
class FetchInfo:
    """What FETCH_OK said about a range (the parts a relay must echo downstream)."""

    end: Location
    """Exclusive end of the range actually covered."""
    end_of_track: bool
    properties: Properties = ()
    """Track Properties, echoed downstream (draft: Relay Track Handling)."""


@dataclass(frozen=True, slots=True)
class TrackStatus:
    """A successful TRACK_STATUS answer."""

    largest: Location | None
    """Largest Object, or None when nothing was published."""
    end_of_track: bool = False
    properties: Properties = ()


class RequestFailed(Exception):
    """An upstream (or the cache) answered a request with REQUEST_ERROR."""

    def __init__(self, code: int, reason: str, retry_interval: int = 0) -> None:
        super().__init__(f"request failed: code={code:#x} {reason}")
        self.code = code
        self.reason = reason
        self.retry_interval = retry_interval


class FillSink(Protocol):
    """Where an upstream writes the response of one FETCH."""

    def set_info(self, info: FetchInfo) -> None: ...

    def add(self, obj: CachedObject) -> None: ...


class Upstream(Protocol):
    """Something that can answer a cache miss: a publisher session or an upstream relay."""

    async def fetch(self, key: TrackKey, start: Location, end: Location, sink: FillSink) -> None:
        """Fetch ``[start, end)`` (exclusive end); return once the data stream ended with FIN.

        Raises ``RequestFailed`` for a REQUEST_ERROR and any other exception for a broken transfer.
        """
        ...

    async def track_status(self, key: TrackKey) -> TrackStatus:
        """Raises ``RequestFailed`` for a REQUEST_ERROR."""
        ...


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Limits of one cache."""

    max_bytes: int = 256 * 1024 * 1024
    """Total budget for cached objects (payload + properties + fixed per-object overhead)."""
    max_track_bytes: int = 64 * 1024 * 1024
    """Largest single upstream response held in memory; a bigger one fails with EXCESSIVE_LOAD."""
    max_inflight_bytes: int = 256 * 1024 * 1024
    """Bytes held by all upstream responses still in flight; the response that would exceed it fails with
    EXCESSIVE_LOAD (bounds memory however many misses arrive at once)."""
    negative_ttl: float = 0.25
    """Seconds a DOES_NOT_EXIST answer to TRACK_STATUS is reused; 0 disables negative caching."""
    max_negative_entries: int = 65536
    """Bound on remembered negative answers (oldest dropped first)."""
    share_depth: int = 4
    """Namespace fields that name a cache share group (4: ("kvnet", "v2", fingerprint, namespace id));
    0 puts every track in one group."""
    share_bytes: int = 0
    """Most bytes one group may hold; 0 means ``share_fraction`` of ``max_bytes``."""
    share_fraction: float = 1.0
    """Share of ``max_bytes`` one group may hold when ``share_bytes`` is 0 (1.0: no cap of its own; the
    equal-share rule still makes a flooding group evict its own tracks once the cache is full)."""
    dir: str = ""
    """Directory of the persistent tier (``kvnet.storage.disk``): complete tracks are also kept there and
    served after a restart. Empty: memory only."""
    dir_bytes: int = 1024 * 1024 * 1024
    """Most bytes of files the persistent tier keeps (least recently used evicted first)."""

    @property
    def share_limit(self) -> int:
        """Bytes one share group may hold."""
        return self.share_bytes if self.share_bytes > 0 else int(self.max_bytes * self.share_fraction)

    def __post_init__(self) -> None:
        if self.max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        if self.max_track_bytes <= 0:
            raise ValueError("max_track_bytes must be > 0")
        if self.max_inflight_bytes <= 0:
            raise ValueError("max_inflight_bytes must be > 0")
        if self.negative_ttl < 0:
            raise ValueError("negative_ttl must be >= 0")
        if self.max_negative_entries < 0:
            raise ValueError("max_negative_entries must be >= 0")
        if not 0 <= self.share_depth <= 32:
            raise ValueError(f"share_depth must be in 0..32, got {self.share_depth}")
        if self.share_bytes < 0:
            raise ValueError("share_bytes must be >= 0")
        if not 0 < self.share_fraction <= 1:
            raise ValueError(f"share_fraction must be in (0, 1], got {self.share_fraction}")
        if self.dir_bytes <= 0:
            raise ValueError(f"dir_bytes must be positive, got {self.dir_bytes}")


@dataclass
class CacheStats:
    """Counters exported as metrics."""

    hits: int = 0
    misses: int = 0
    coalesced: int = 0
    evictions: int = 0
    upstream_fetches: int = 0
    upstream_track_status: int = 0
    status_hits: int = 0
    negative_hits: int = 0
    share_evictions: int = 0
    """Tracks evicted because their group was over its share (included in ``evictions``)."""
    refused: int = 0
    """Complete fills not cached because the admission check refused them."""
    disk_loads: int = 0
    """Tracks loaded from the persistent tier on a memory miss."""


@dataclass
class _Entry:
    objects: dict[Location, CachedObject] = field(default_factory=dict)
    complete: list[tuple[Location, Location]] = field(default_factory=list)
    """Exclusive ranges known to be fully present (every existing object in them is in ``objects``)."""
    final_end: Location | None = None
    """Exclusive end of the track when the publisher said End Of Track."""
    properties: Properties = ()
    size: int = 0

    def covers(self, start: Location, end: Location) -> bool:
        return any(cs <= start and end <= ce for cs, ce in self.complete)

    def largest(self) -> Location | None:
        return max(self.objects) if self.objects else None


@dataclass
class _Group:
    """One cache share group: its tracks in LRU order and the bytes they hold."""

    keys: OrderedDict[TrackKey, None] = field(default_factory=OrderedDict)
    bytes: int = 0


class InflightBudget:
    """Bytes held by fills in flight, shared by all fills of one cache."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0


class Fill:
    """One upstream FETCH in flight; any number of readers stream it as it arrives."""

    def __init__(
        self,
        key: TrackKey,
        start: Location,
        end: Location,
        max_bytes: int,
        budget: InflightBudget | None = None,
        from_upstream: bool = False,
    ) -> None:
        self.key = key
        self.start = start
        self.end = end
        self.from_upstream = from_upstream
        """Filled for a request from an upstream relay, from local sources only (rule 6)."""
        self.objects: list[CachedObject] = []
        self.info: FetchInfo | None = None
        self.bytes = 0
        self._max_bytes = max_bytes
        self._budget = budget
        self._done = False
        self._error: BaseException | None = None
        self._changed: asyncio.Event = asyncio.Event()

    # FillSink -------------------------------------------------------------------------------------------
    def set_info(self, info: FetchInfo) -> None:
        self.info = info
        self._wake()

    def add(self, obj: CachedObject) -> None:
        if self._done:
            return
        if self.objects and obj.location <= self.objects[-1].location:
            # Fills are requested in ascending order; a duplicate or backwards object is dropped so
            # readers never see one twice.
            return
        if self.bytes + obj.size > self._max_bytes:
            raise RequestFailed(
                RequestErrorCode.EXCESSIVE_LOAD, f"response exceeds the relay's {self._max_bytes}-byte limit"
            )
        budget = self._budget
        if budget is not None:
            if budget.used + obj.size > budget.limit:
                raise RequestFailed(
                    RequestErrorCode.EXCESSIVE_LOAD,
                    f"relay holds its maximum of {budget.limit} bytes of responses in flight",
                    retry_interval=1001,
                )
            budget.used += obj.size
        self.bytes += obj.size
        self.objects.append(obj)
        self._wake()

    # ----------------------------------------------------------------------------------------------------
    def finish(self, error: BaseException | None) -> None:
        if self._budget is not None and not self._done:
            self._budget.used -= self.bytes
        self._done = True
        self._error = error
        self._wake()

    @property
    def done(self) -> bool:
        return self._done

    @property
    def error(self) -> BaseException | None:
        return self._error

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_info(self) -> FetchInfo:
        """FETCH_OK data; raises the fill's error if it failed first."""
        while self.info is None:
            if self._done:
                raise (
                    self._error
                    if self._error is not None
                    else RequestFailed(RequestErrorCode.INTERNAL_ERROR, "upstream gave no FETCH_OK")
                )
            await self._changed.wait()
        return self.info

    async def stream(self, start: Location, end: Location) -> AsyncIterator[CachedObject]:
        """Objects of ``[start, end)`` in arrival order; raises the fill's error after what was delivered."""
        i = 0
        while True:
            while i < len(self.objects):
                obj = self.objects[i]
                i += 1
                if start <= obj.location < end:
                    yield obj
            if self._done:
                if self._error is not None:
                    raise self._error
                return
            await self._changed.wait()


K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Coalescer(Generic[K, V]):
    """One future per key: concurrent callers of ``run`` with the same key share one call of ``factory``."""

    def __init__(self) -> None:
        self._inflight: dict[K, asyncio.Future[V]] = {}

    def __len__(self) -> int:
        return len(self._inflight)

    async def run(self, key: K, factory: Callable[[], asyncio.Future[V] | asyncio.Task[V]]) -> tuple[V, bool]:
        """Returns (result, joined) where ``joined`` says whether an in-flight call was reused."""
        fut = self._inflight.get(key)
        if fut is not None:
            return await asyncio.shield(fut), True
        task = factory()
        self._inflight[key] = task
        task.add_done_callback(lambda f: self._done(key, f))
        return await asyncio.shield(task), False

    def _done(self, key: K, fut: asyncio.Future[V]) -> None:
        if self._inflight.get(key) is fut:
            del self._inflight[key]
        # Every caller may have gone (their requests cancelled) before the shared call ended: read its
        # outcome here so a failure nobody awaits any more is not reported as never retrieved.
        if not fut.cancelled():
            fut.exception()


class ObjectCache:
    """Tracks keyed by Full Track Name, LRU-evicted under ``config.max_bytes``."""

    def __init__(
        self,
        config: CacheConfig,
        clock: Callable[[], float] = time.monotonic,
        refusal: Callable[[TrackKey, list[CachedObject]], str | None] | None = None,
        disk: DiskTier | None = None,
    ) -> None:
        self.config = config
        self.disk = disk
        """The persistent tier: complete final tracks are written there and loaded from it on a miss."""
        self.refusal = refusal
        """Checked before a fill is stored: a reason means the objects are served to the requesters that
        asked for them but never cached (``relay.admission``)."""
        self._clock = clock
        self._entries: OrderedDict[TrackKey, _Entry] = OrderedDict()
        self._bytes = 0
        self._groups: dict[tuple[bytes, ...], _Group] = {}
        self._fills: dict[TrackKey, list[Fill]] = {}
        self._inflight = InflightBudget(config.max_inflight_bytes)
        self._status = Coalescer[TrackKey, TrackStatus]()
        self._local_status = Coalescer[TrackKey, TrackStatus]()
        """TRACK_STATUS queries for requests from an upstream relay, apart from ``_status``'s (rule 6)."""
        self._first_status = Coalescer[TrackKey, TrackStatus]()
        """TRACK_STATUS queries to ``track_status``'s ``asked_first``, shared apart from ``_status``'s."""
        self._tasks: set[asyncio.Task[None]] = set()
        """Upstream fills in flight, referenced here so they outlive the requester that started them."""
        self._negative: OrderedDict[TrackKey, tuple[float, RequestFailed]] = OrderedDict()
        """Track -> (expiry, DOES_NOT_EXIST answer), oldest first."""
        self._invalidated: dict[tuple[bytes, ...], float] = {}
        """Namespace prefix -> when a publisher last announced it: negative answers made before then are
        stale. Checked on lookup, so invalidating is O(1) however many negatives are held (a scan of
        them all on every PUBLISH cost O(negatives) per pushed block)."""
        self.stats = CacheStats()

    # Introspection -------------------------------------------------------------------------------------
    @property
    def size_bytes(self) -> int:
        return self._bytes

    @property
    def objects(self) -> int:
        return sum(len(e.objects) for e in self._entries.values())

    @property
    def tracks(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def keys_lru(self) -> list[TrackKey]:
        """Least recently used first."""
        return list(self._entries)

    def inflight(self) -> int:
        return sum(len(v) for v in self._fills.values())

    def group_of(self, key: TrackKey) -> tuple[bytes, ...]:
        """The share group of a track: the first ``share_depth`` fields of its namespace."""
        return key[0][: self.config.share_depth]

    def group_bytes(self, group: tuple[bytes, ...]) -> int:
        g = self._groups.get(group)
        return 0 if g is None else g.bytes

    @property
    def share_groups(self) -> int:
        """Groups with at least one cached track."""
        return len(self._groups)

    def share_groups_full(self) -> int:
        """Groups holding at least 90% of their share."""
        limit = self.config.share_limit * 0.9
        return sum(1 for g in self._groups.values() if g.bytes >= limit)

    @property
    def inflight_bytes(self) -> int:
        return self._inflight.used

    # Lookups -------------------------------------------------------------------------------------------
    def _clip(self, entry: _Entry | None, end: Location) -> Location:
        if entry is not None and entry.final_end is not None and entry.final_end < end:
            return entry.final_end
        return end

    def _from_disk(self, key: TrackKey) -> _Entry | None:
        """The memory entry of ``key``, loaded from the persistent tier when memory has none."""
        entry = self._entries.get(key)
        if entry is not None or self.disk is None or key not in self.disk:
            return entry
        track = self.disk.read(key[0], key[1])
        if track is None:
            return None  # damaged (dropped and counted by the tier) or gone
        fill = Fill(key, START, track.end, self.config.max_track_bytes)
        fill.info = FetchInfo(track.end, True, track.properties)
        try:
            for obj in track.objects:
                fill.add(CachedObject(*obj))
        except RequestFailed:
            return None  # bigger than this run's max_track_bytes: left on disk, not served
        self.stats.disk_loads += 1
        self._store_fill(fill, persist=False)
        return self._entries.get(key)

    def lookup(
        self, key: TrackKey, start: Location, end: Location
    ) -> tuple[FetchInfo, list[CachedObject]] | None:
        """The cached objects of ``[start, end)`` if that whole range is known, else None. Counts a hit."""
        entry = self._from_disk(key)
        if entry is None:
            return None
        clipped = self._clip(entry, end)
        if clipped < end and start >= clipped:
            return None  # asks only past the end of the track: let upstream answer INVALID_RANGE
        if not entry.covers(start, clipped):
            return None
        self._touch(key)
        self.stats.hits += 1
        objs = [o for loc, o in sorted(entry.objects.items()) if start <= loc < clipped]
        eot = entry.final_end is not None and clipped == entry.final_end
        if objs and eot:
            last = objs[-1].location
            info_end = (last[0], last[1] + 1)
        else:
            info_end = clipped
        return FetchInfo(info_end, eot, entry.properties), objs

    def cached_status(self, key: TrackKey) -> TrackStatus | None:
        """A TRACK_STATUS answer when the whole track is cached and known to be final."""
        self._from_disk(key)
        entry = self._entries.get(key)
        if entry is None or entry.final_end is None or not entry.covers(START, entry.final_end):
            return None
        self._touch(key)
        return TrackStatus(entry.largest(), True, entry.properties)

    # Fetch ---------------------------------------------------------------------------------------------
    def _find_fill(self, key: TrackKey, start: Location, end: Location, from_upstream: bool) -> Fill | None:
        for fill in self._fills.get(key, ()):
            if (
                fill.start <= start
                and end <= fill.end
                and not fill.done
                and fill.from_upstream == from_upstream
            ):
                return fill
        return None

    def fetch(
        self, key: TrackKey, start: Location, end: Location, upstream: Upstream, from_upstream: bool = False
    ) -> CachedFetch:
        """Serve ``[start, end)`` from cache, an in-flight fill, or one new upstream FETCH (in that order);
        ``from_upstream``: see rule 6."""
        hit = self.lookup(key, start, end)
        if hit is not None:
            return CachedFetch(start, end, cached=hit)
        fill = self._find_fill(key, start, end, from_upstream)
        if fill is not None:
            self.stats.coalesced += 1
            return CachedFetch(start, end, fill=fill, coalesced=True)
        self.stats.misses += 1
        self.stats.upstream_fetches += 1
        fill = Fill(key, start, end, self.config.max_track_bytes, self._inflight, from_upstream)
        self._fills.setdefault(key, []).append(fill)
        handle = CachedFetch(start, end, fill=fill)
        handle.task = asyncio.get_running_loop().create_task(self._run_fill(fill, upstream))
        self._tasks.add(handle.task)
        handle.task.add_done_callback(self._tasks.discard)
        return handle

    async def _run_fill(self, fill: Fill, upstream: Upstream) -> None:
        error: BaseException | None = None
        try:
            await upstream.fetch(fill.key, fill.start, fill.end, fill)
            if fill.info is None:
                raise RequestFailed(RequestErrorCode.INTERNAL_ERROR, "upstream finished without FETCH_OK")
        except asyncio.CancelledError:
            error = RequestFailed(RequestErrorCode.INTERNAL_ERROR, "upstream fetch cancelled")
        except BaseException as exc:  # every failure reaches the readers, none escapes the task
            error = exc
        finally:
            fills = self._fills.get(fill.key, [])
            if fill in fills:
                fills.remove(fill)
            if not fills:
                self._fills.pop(fill.key, None)
        if error is None:
            self._store_fill(fill)
        fill.finish(error)

    def _store_fill(self, fill: Fill, persist: bool = True) -> None:
        info = fill.info
        assert info is not None
        if fill.bytes > min(self.config.max_bytes, self.config.share_limit):
            return  # would evict everything else (of its group) and still not fit
        if self.refusal is not None and self.refusal(fill.key, fill.objects) is not None:
            self.stats.refused += 1
            return
        entry = self._entries.get(fill.key)
        group = self.group_of(fill.key)
        if entry is None:
            entry = _Entry()
            self._entries[fill.key] = entry
            self._groups.setdefault(group, _Group()).keys[fill.key] = None
        self._touch(fill.key)
        g = self._groups[group]
        for obj in fill.objects:
            old = entry.objects.get(obj.location)
            if old is not None:
                # Draft: duplicates may be ignored; keep the first copy, which readers already saw.
                continue
            entry.objects[obj.location] = obj
            entry.size += obj.size
            g.bytes += obj.size
            self._bytes += obj.size
        covered_end = min(fill.end, info.end) if not info.end_of_track else fill.end
        entry.complete.append((fill.start, covered_end))
        if info.end_of_track:
            entry.final_end = info.end
        entry.properties = info.properties
        self._negative.pop(fill.key, None)
        if (
            persist
            and self.disk is not None
            and entry.final_end is not None
            and entry.covers(START, entry.final_end)
        ):
            self._persist(fill.key, entry)
        self._evict(keep=fill.key)

    def _persist(self, key: TrackKey, entry: _Entry) -> None:
        """Write a complete final track to the persistent tier in a worker thread (fsync is slow); the
        index is updated on the loop once the file is in place."""
        assert self.disk is not None and entry.final_end is not None
        disk = self.disk
        track = StoredTrack(
            key[0],
            key[1],
            entry.final_end,
            entry.properties,
            [
                (o.group, o.subgroup, o.object_id, o.priority, o.status, o.properties, o.payload)
                for _, o in sorted(entry.objects.items())
            ],
        )

        async def write() -> None:
            try:
                name, size = await asyncio.to_thread(disk.write_file, track)
            except OSError as exc:
                logger.warning("cannot write cache file", extra={"reason": str(exc)})
                return
            disk.record(name, size)

        task = asyncio.get_running_loop().create_task(write())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _touch(self, key: TrackKey) -> None:
        """Mark a track most recently used, in the whole cache and in its group."""
        self._entries.move_to_end(key)
        g = self._groups.get(self.group_of(key))
        if g is not None and key in g.keys:
            g.keys.move_to_end(key)

    def _remove(self, key: TrackKey) -> None:
        entry = self._entries.pop(key)
        self._bytes -= entry.size
        group = self.group_of(key)
        g = self._groups[group]
        g.bytes -= entry.size
        del g.keys[key]
        if not g.keys:
            del self._groups[group]
        self.stats.evictions += 1

    def _evict(self, keep: TrackKey | None = None) -> None:
        """Bring the group of ``keep`` under its share, then the cache under its budget (see rule 4);
        ``keep`` (the track just stored) goes last."""
        if keep is not None:
            g = self._groups.get(self.group_of(keep))
            limit = self.config.share_limit
            while g is not None and g.bytes > limit and len(g.keys) > 1:
                self._remove(next(k for k in g.keys if k != keep))
                self.stats.share_evictions += 1
        victim: TrackKey | None
        while self._bytes > self.config.max_bytes and self._entries:
            fair = self.config.max_bytes / max(1, len(self._groups))
            victim = next(
                (k for k in self._entries if k != keep and self._groups[self.group_of(k)].bytes > fair),
                None,
            )
            if victim is None:
                victim = next((k for k in self._entries if k != keep), keep)
            if victim is None:
                break
            self._remove(victim)

    def put_track(
        self, key: TrackKey, objects: list[CachedObject], info: FetchInfo, start: Location = START
    ) -> None:
        """Store a complete range obtained outside ``fetch`` (e.g. a PUBLISH-pushed track that ended)."""
        fill = Fill(key, start, info.end, self.config.max_track_bytes)
        fill.info = info
        for obj in objects:
            fill.add(obj)
        self._store_fill(fill)

    def invalidate_negative(self, namespace_prefix: tuple[bytes, ...]) -> None:
        """Forget negative answers under a prefix (a publisher just announced it)."""
        now = self._clock()
        self._invalidated[namespace_prefix] = now
        if len(self._invalidated) > self.config.max_negative_entries:
            # Marks older than the TTL cannot outdate any live negative answer.
            horizon = now - self.config.negative_ttl
            self._invalidated = {p: t for p, t in self._invalidated.items() if t >= horizon}
            if len(self._invalidated) > self.config.max_negative_entries:
                self._negative.clear()  # forgetting misses only costs upstream queries
                self._invalidated = {namespace_prefix: now}

    def _fresh_negative(self, key: TrackKey, now: float) -> RequestFailed | None:
        """The remembered DOES_NOT_EXIST for ``key`` if it has not expired and no publisher announced a
        prefix of its namespace since it was made; drops a stale one."""
        neg = self._negative.get(key)
        if neg is None:
            return None
        expires, err = neg
        made = expires - self.config.negative_ttl
        ns = key[0]
        announced = (self._invalidated.get(ns[:i]) for i in range(len(ns) + 1))
        if now < expires and all(t is None or t < made for t in announced):
            return err
        del self._negative[key]
        return None

    # TRACK_STATUS --------------------------------------------------------------------------------------
    async def track_status(
        self,
        key: TrackKey,
        upstream: Upstream,
        asked_first: Upstream | None = None,
        from_upstream: bool = False,
    ) -> TrackStatus:
        """Answer from a complete cached track, ``asked_first``, a fresh negative entry, or one coalesced
        upstream query, in that order. ``asked_first`` (the workers behind the hub of ``relay.workers``)
        is asked on every miss and its DOES_NOT_EXIST is never remembered: what it holds changes without
        this cache hearing of it, so only ``upstream``'s misses are negatively cached.
        ``from_upstream``: see rule 6."""
        cached = self.cached_status(key)
        if cached is not None:
            self.stats.status_hits += 1
            return cached
        if asked_first is not None:
            try:
                return await self._ask_status(self._first_status, key, asked_first)
            except RequestFailed as err:
                if err.code != RequestErrorCode.DOES_NOT_EXIST:
                    raise
        miss = self._fresh_negative(key, self._clock())
        if miss is not None:
            self.stats.negative_hits += 1
            raise RequestFailed(miss.code, miss.reason, miss.retry_interval)

        queries = self._local_status if from_upstream else self._status
        try:
            return await self._ask_status(queries, key, upstream)
        except RequestFailed as err:
            remember = self.config.negative_ttl > 0 and not from_upstream
            if err.code == RequestErrorCode.DOES_NOT_EXIST and remember:
                self._negative[key] = (self._clock() + self.config.negative_ttl, err)
                while len(self._negative) > self.config.max_negative_entries:
                    self._negative.popitem(last=False)
            raise

    async def _ask_status(
        self, queries: Coalescer[TrackKey, TrackStatus], key: TrackKey, upstream: Upstream
    ) -> TrackStatus:
        """``upstream``'s TRACK_STATUS answer, shared with the concurrent askers of ``key`` in ``queries``."""

        def start() -> asyncio.Task[TrackStatus]:
            self.stats.upstream_track_status += 1
            return asyncio.get_running_loop().create_task(upstream.track_status(key))

        result, joined = await queries.run(key, start)
        if joined:
            self.stats.coalesced += 1
        return result


class CachedFetch:
    """One requester's view of a fetch the cache serves (from its objects, or from a fill it joined or
    started): FETCH_OK info, then the objects. (``kvnet.net.handles.FetchHandle`` is a FETCH on a session.)"""

    def __init__(
        self,
        start: Location,
        end: Location,
        cached: tuple[FetchInfo, list[CachedObject]] | None = None,
        fill: Fill | None = None,
        coalesced: bool = False,
    ) -> None:
        self.start = start
        self.end = end
        self._cached = cached
        self._fill = fill
        self.coalesced = coalesced
        self.task: asyncio.Task[None] | None = None
        """The upstream task when this handle started one (kept referenced so it is not collected)."""

    @property
    def from_cache(self) -> bool:
        return self._cached is not None

    async def info(self) -> FetchInfo:
        if self._cached is not None:
            return self._cached[0]
        assert self._fill is not None
        info = await self._fill.wait_info()
        end = min(self.end, info.end)
        return FetchInfo(end, info.end_of_track and end == info.end, info.properties)

    async def objects(self) -> AsyncIterator[CachedObject]:
        if self._cached is not None:
            for obj in self._cached[1]:
                yield obj
            return
        assert self._fill is not None
        async for obj in self._fill.stream(self.start, self.end):
            yield obj
