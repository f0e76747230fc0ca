"""ObjectCache without a network: coalescing, byte budget, LRU order, partial fills, negative TRACK_STATUS."""

from __future__ import annotations

import asyncio

import pytest

from proto.errors import RequestErrorCode
from relay.cache import (
    OBJECT_OVERHEAD,
    CacheConfig,
    CachedObject,
    FetchInfo,
    FillSink,
    Location,
    ObjectCache,
    RequestFailed,
    TrackKey,
    TrackStatus,
    exclusive_to_wire_end,
    wire_end_to_exclusive,
)
from tests.helpers.waiting import async_wait_until

NS = (b"kvnet", b"v1")
END: Location = (1, 0)  # whole group 0


def key(name: bytes) -> TrackKey:
    return (NS, name)


def obj(o: int, payload: bytes = b"x" * 100, g: int = 0) -> CachedObject:
    return CachedObject(g, 0, o, 128, 0, (), payload)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class ScriptedUpstream:
    """An in-memory upstream: serves ``tracks`` and counts calls; ``gate`` holds fetches mid-stream."""

    def __init__(self, tracks: dict[TrackKey, list[CachedObject]]) -> None:
        self.tracks = tracks
        self.fetches = 0
        self.statuses = 0
        self.gate: asyncio.Event | None = None
        self.fail_after: int | None = None

    async def fetch(self, key: TrackKey, start: Location, end: Location, sink: FillSink) -> None:
        self.fetches += 1
        objs = self.tracks.get(key)
        if objs is None:
            raise RequestFailed(RequestErrorCode.DOES_NOT_EXIST, "no such track")
        last = objs[-1].location
        sink.set_info(FetchInfo((last[0], last[1] + 1), True))
        for i, o in enumerate(objs):
            if self.fail_after is not None and i == self.fail_after:
                raise ConnectionError("publisher went away mid-track")
            if self.gate is not None:
                await self.gate.wait()
            sink.add(o)
            await asyncio.sleep(0)

    async def track_status(self, key: TrackKey) -> TrackStatus:
        self.statuses += 1
        await asyncio.sleep(0)
        objs = self.tracks.get(key)
        if objs is None:
            raise RequestFailed(RequestErrorCode.DOES_NOT_EXIST, "no such track")
        return TrackStatus(objs[-1].location, True)


async def collect(
    cache: ObjectCache, k: TrackKey, up: ScriptedUpstream
) -> tuple[FetchInfo, list[CachedObject]]:
    h = cache.fetch(k, (0, 0), END, up)
    info = await h.info()
    return info, [o async for o in h.objects()]


def test_wire_end_roundtrip() -> None:
    assert wire_end_to_exclusive((3, 0)) == (4, 0)
    assert wire_end_to_exclusive((3, 5)) == (3, 5)
    for e in [(0, 1), (3, 0), (7, 9)]:
        assert exclusive_to_wire_end(wire_end_to_exclusive(e)) == e


async def test_miss_then_hit() -> None:
    up = ScriptedUpstream({key(b"a"): [obj(0), obj(1), obj(2)]})
    cache = ObjectCache(CacheConfig(max_bytes=1 << 20))
    info, objs = await collect(cache, key(b"a"), up)
    assert [o.object_id for o in objs] == [0, 1, 2]
    assert info.end_of_track and info.end == (0, 3)
    await asyncio.sleep(0)
    info2, objs2 = await collect(cache, key(b"a"), up)
    assert up.fetches == 1
    assert objs2 == objs and info2.end == (0, 3) and info2.end_of_track
    assert cache.stats.hits == 1 and cache.stats.misses == 1
    assert cache.objects == 3 and cache.size_bytes == 3 * (100 + OBJECT_OVERHEAD)


async def test_concurrent_fetches_coalesce_into_one_upstream_request() -> None:
    up = ScriptedUpstream({key(b"a"): [obj(i) for i in range(5)]})
    up.gate = asyncio.Event()
    cache = ObjectCache(CacheConfig())
    tasks = [asyncio.create_task(collect(cache, key(b"a"), up)) for _ in range(8)]
    stats = cache.stats
    await async_wait_until(lambda: stats.hits + stats.misses + stats.coalesced == 8, "8 fetches at the cache")
    up.gate.set()
    results = await asyncio.gather(*tasks)
    assert up.fetches == 1
    assert cache.stats.coalesced == 7
    for _, objs in results:
        assert [o.object_id for o in objs] == list(range(5))


async def test_late_joiner_gets_objects_from_the_start() -> None:
    up = ScriptedUpstream({key(b"a"): [obj(i) for i in range(4)]})
    up.gate = asyncio.Event()
    cache = ObjectCache(CacheConfig())
    first = cache.fetch(key(b"a"), (0, 0), END, up)
    up.gate.set()
    got = []
    async for o in first.objects():
        got.append(o.object_id)
        if len(got) == 2:
            # Joins while the upstream fetch is half done.
            second = cache.fetch(key(b"a"), (0, 0), END, up)
            assert second.coalesced
    assert got == [0, 1, 2, 3]
    assert [o.object_id async for o in second.objects()] == [0, 1, 2, 3]
    assert up.fetches == 1


async def test_failed_fill_is_not_cached_and_error_reaches_readers() -> None:
    up = ScriptedUpstream({key(b"a"): [obj(i) for i in range(4)]})
    up.fail_after = 2
    cache = ObjectCache(CacheConfig())
    h = cache.fetch(key(b"a"), (0, 0), END, up)
    got = []
    with pytest.raises(ConnectionError):
        async for o in h.objects():
            got.append(o.object_id)
    assert got == [0, 1]  # what arrived was streamed, but nothing was stored as complete
    assert key(b"a") not in cache
    up.fail_after = None
    _, objs = await collect(cache, key(b"a"), up)
    assert len(objs) == 4 and up.fetches == 2


async def test_upstream_request_error_propagates_code() -> None:
    cache = ObjectCache(CacheConfig())
    h = cache.fetch(key(b"missing"), (0, 0), END, ScriptedUpstream({}))
    with pytest.raises(RequestFailed) as ei:
        await h.info()
    assert ei.value.code == RequestErrorCode.DOES_NOT_EXIST


async def test_partial_range_is_not_served_as_complete() -> None:
    up = ScriptedUpstream({key(b"a"): [obj(i) for i in range(6)]})
    cache = ObjectCache(CacheConfig())
    h = cache.fetch(key(b"a"), (0, 0), (0, 3), up)  # objects 0..2 only
    assert [o.object_id async for o in h.objects()] == [0, 1, 2]
    await asyncio.sleep(0)
    assert cache.lookup(key(b"a"), (0, 0), (0, 3)) is not None
    assert cache.lookup(key(b"a"), (0, 0), END) is None  # the rest of the group is unknown
    assert cache.cached_status(key(b"a")) is None


async def test_lru_eviction_under_byte_budget() -> None:
    per_track = 2 * (100 + OBJECT_OVERHEAD)
    tracks = {key(n): [obj(0), obj(1)] for n in (b"a", b"b", b"c")}
    up = ScriptedUpstream(tracks)
    cache = ObjectCache(CacheConfig(max_bytes=2 * per_track))
    await collect(cache, key(b"a"), up)
    await collect(cache, key(b"b"), up)
    await collect(cache, key(b"a"), up)  # touch a: b is now least recently used
    assert up.fetches == 2
    await collect(cache, key(b"c"), up)
    assert cache.keys_lru() == [key(b"a"), key(b"c")]
    assert cache.stats.evictions == 1
    assert cache.size_bytes <= 2 * per_track
    await collect(cache, key(b"b"), up)  # evicted: goes upstream again
    assert up.fetches == 4


async def test_track_larger_than_budget_is_streamed_but_not_cached() -> None:
    up = ScriptedUpstream({key(b"big"): [obj(i, b"y" * 1000) for i in range(4)]})
    cache = ObjectCache(CacheConfig(max_bytes=2000))
    _, objs = await collect(cache, key(b"big"), up)
    assert len(objs) == 4
    assert cache.size_bytes == 0 and key(b"big") not in cache


async def test_fill_over_track_limit_fails_with_excessive_load() -> None:
    up = ScriptedUpstream({key(b"big"): [obj(i, b"y" * 1000) for i in range(4)]})
    cache = ObjectCache(CacheConfig(max_track_bytes=2500))
    h = cache.fetch(key(b"big"), (0, 0), END, up)
    with pytest.raises(RequestFailed) as ei:
        async for _ in h.objects():
            pass
    assert ei.value.code == RequestErrorCode.EXCESSIVE_LOAD


async def test_track_status_from_complete_cached_track() -> None:
    up = ScriptedUpstream({key(b"a"): [obj(0), obj(1)]})
    cache = ObjectCache(CacheConfig())
    await collect(cache, key(b"a"), up)
    st = await cache.track_status(key(b"a"), up)
    assert st.largest == (0, 1) and st.end_of_track
    assert up.statuses == 0 and cache.stats.status_hits == 1


async def test_track_status_coalesces_and_caches_negatives_briefly() -> None:
    clock = FakeClock()
    up = ScriptedUpstream({key(b"a"): [obj(0)]})
    cache = ObjectCache(CacheConfig(negative_ttl=0.5), clock=clock)
    results = await asyncio.gather(*(cache.track_status(key(b"a"), up) for _ in range(5)))
    assert up.statuses == 1 and all(r.largest == (0, 0) for r in results)
    for _ in range(3):
        with pytest.raises(RequestFailed):
            await cache.track_status(key(b"nope"), up)
    assert up.statuses == 2 and cache.stats.negative_hits == 2
    clock.now += 0.6
    with pytest.raises(RequestFailed):
        await cache.track_status(key(b"nope"), up)
    assert up.statuses == 3
    cache.invalidate_negative(NS)
    with pytest.raises(RequestFailed):
        await cache.track_status(key(b"nope"), up)
    assert up.statuses == 4


async def test_announcing_a_prefix_outdates_only_earlier_misses_under_it() -> None:
    clock = FakeClock()
    up = ScriptedUpstream({})
    cache = ObjectCache(CacheConfig(negative_ttl=10.0), clock=clock)
    other = ((b"other", b"ns"), b"nope")

    async def miss(k: TrackKey) -> None:
        with pytest.raises(RequestFailed):
            await cache.track_status(k, up)

    await miss(key(b"nope"))
    await miss(other)
    assert up.statuses == 2
    clock.now += 1
    cache.invalidate_negative((b"kvnet",))  # a shorter prefix of NS
    clock.now += 1
    await miss(key(b"nope"))  # made before the announcement: asked again
    await miss(other)  # not under the prefix: still answered from the negative cache
    assert up.statuses == 3 and cache.stats.negative_hits == 1
    clock.now += 1
    await miss(key(b"nope"))  # the new miss, made after the announcement, is fresh
    assert up.statuses == 3 and cache.stats.negative_hits == 2


async def test_misses_of_what_is_asked_first_are_never_remembered() -> None:
    """The hub of ``relay.workers``: its workers (asked first) are asked on every miss, and only the
    upstream's misses are negatively cached; a track that appears at a worker is found at once."""
    clock = FakeClock()
    workers = ScriptedUpstream({})
    up = ScriptedUpstream({})
    cache = ObjectCache(CacheConfig(negative_ttl=10.0), clock=clock)
    for _ in range(3):
        with pytest.raises(RequestFailed) as missed:
            await cache.track_status(key(b"a"), up, asked_first=workers)
        assert missed.value.code == RequestErrorCode.DOES_NOT_EXIST
    assert workers.statuses == 3 and up.statuses == 1 and cache.stats.negative_hits == 2
    workers.tracks[key(b"a")] = [obj(0), obj(1)]  # pushed at a worker, nothing announced
    st = await cache.track_status(key(b"a"), up, asked_first=workers)
    assert st.largest == (0, 1) and workers.statuses == 4 and up.statuses == 1
    # Concurrent askers share one query to the workers.
    await asyncio.gather(*(cache.track_status(key(b"a"), up, asked_first=workers) for _ in range(4)))
    assert workers.statuses == 5


async def test_an_error_other_than_a_miss_from_what_is_asked_first_is_the_answer() -> None:
    class Overloaded(ScriptedUpstream):
        async def track_status(self, key: TrackKey) -> TrackStatus:
            self.statuses += 1
            raise RequestFailed(RequestErrorCode.EXCESSIVE_LOAD, "busy")

    workers, up = Overloaded({}), ScriptedUpstream({key(b"a"): [obj(0)]})
    cache = ObjectCache(CacheConfig())
    with pytest.raises(RequestFailed) as failed:
        await cache.track_status(key(b"a"), up, asked_first=workers)
    assert failed.value.code == RequestErrorCode.EXCESSIVE_LOAD and up.statuses == 0


async def test_a_request_from_upstream_never_shares_a_query_that_may_go_upstream() -> None:
    """Rule 6: an upstream relay's request, answered by local sources, neither joins nor is joined by one
    of ours going upstream (which may be waiting for it), and its misses are not remembered."""
    local = ScriptedUpstream({key(b"a"): [obj(0)]})
    up = ScriptedUpstream({key(b"a"): [obj(0)]})
    up.gate = asyncio.Event()  # our own fill waits upstream...
    cache = ObjectCache(CacheConfig(negative_ttl=10.0), clock=FakeClock())
    ours = cache.fetch(key(b"a"), (0, 0), END, up)
    theirs = cache.fetch(key(b"a"), (0, 0), END, local, from_upstream=True)
    assert not theirs.coalesced  # ...and the upstream relay's request is answered meanwhile
    assert [o.object_id async for o in theirs.objects()] == [0] and local.fetches == 1
    assert cache.fetch(key(b"a"), (0, 0), END, local, from_upstream=True).from_cache  # stored, as any fill
    up.gate.set()
    assert [o.object_id async for o in ours.objects()] == [0] and up.fetches == 1

    nowhere = ScriptedUpstream({})
    for _ in range(2):
        with pytest.raises(RequestFailed):
            await cache.track_status(key(b"nope"), nowhere, from_upstream=True)
    assert nowhere.statuses == 2 and cache.stats.negative_hits == 0  # not remembered
    answers = await asyncio.gather(
        cache.track_status(key(b"b"), nowhere, from_upstream=True),
        cache.track_status(key(b"b"), nowhere),
        return_exceptions=True,
    )
    assert all(isinstance(a, RequestFailed) for a in answers) and nowhere.statuses == 4  # not shared


async def test_negative_caching_disabled_with_zero_ttl() -> None:
    up = ScriptedUpstream({})
    cache = ObjectCache(CacheConfig(negative_ttl=0))
    for _ in range(3):
        with pytest.raises(RequestFailed):
            await cache.track_status(key(b"nope"), up)
    assert up.statuses == 3


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="max_track_bytes"):
        CacheConfig(max_track_bytes=0)
    with pytest.raises(ValueError, match="negative_ttl"):
        CacheConfig(negative_ttl=-1)


async def test_inflight_budget_bounds_concurrent_fills() -> None:
    tracks = {key(n): [obj(i, b"z" * 1000) for i in range(3)] for n in (b"a", b"b")}
    up = ScriptedUpstream(tracks)
    up.gate = asyncio.Event()
    per_track = 3 * (1000 + OBJECT_OVERHEAD)
    cache = ObjectCache(CacheConfig(max_inflight_bytes=per_track + 10))
    ha = cache.fetch(key(b"a"), (0, 0), END, up)
    hb = cache.fetch(key(b"b"), (0, 0), END, up)
    up.gate.set()
    got_a = [o.object_id async for o in ha.objects()]
    with pytest.raises(RequestFailed) as ei:
        async for _ in hb.objects():
            pass
    assert got_a == [0, 1, 2]
    assert ei.value.code == RequestErrorCode.EXCESSIVE_LOAD
    assert cache.inflight_bytes == 0  # both fills gave their bytes back
    _, objs = await collect(cache, key(b"b"), up)  # with room again, the retry succeeds
    assert len(objs) == 3
