"""The relay's metric families: each declared once, with its help text, and the gauges and counters read
from the relay's state at scrape time (``relay.metrics.Metrics``: values are never copied, so they cannot
drift). Counters the relay increments are declared here so they are exported (as 0) before the first.
"""

from __future__ import annotations

from collections.abc import Sequence, Sized

from relay.cache import ObjectCache
from relay.limits import Slots
from relay.metrics import Metrics
from relay.pressure import Pressure
from relay.upstream import UpstreamRelay


def register_families(
    metrics: Metrics,
    cache: ObjectCache,
    pressure: Pressure,
    requests: Slots,
    peers: Sized,
    router: Sized,
    fanouts: Sized,
    upstreams: Sequence[UpstreamRelay],
) -> None:
    """Declare the relay's families on ``metrics``, reading the live objects given (the relay's cache,
    pressure, request slots, session table, namespace routes, fan-outs and upstream relays)."""
    m = metrics
    c = cache
    m.gauge_fn("sessions", "open sessions", lambda: len(peers))
    if c.disk is not None:
        disk = c.disk
        m.gauge_fn("cache_disk_bytes", "bytes of track files in the persistent tier", lambda: disk.bytes)
        m.gauge_fn("cache_disk_tracks", "tracks in the persistent tier", lambda: len(disk))
        m.gauge_fn("cache_disk_dropped", "damaged track files found and deleted", lambda: disk.dropped)
        m.gauge_fn(
            "cache_disk_loads", "tracks loaded from the persistent tier", lambda: c.stats.disk_loads
        )
    m.counter("sessions_total", "sessions accepted")
    m.gauge_fn("cache_bytes", "bytes held by the cache", lambda: c.size_bytes)
    m.gauge_fn("cache_objects", "objects held by the cache", lambda: c.objects)
    m.gauge_fn("cache_tracks", "tracks held by the cache", lambda: c.tracks)
    m.gauge_fn("cache_inflight_fills", "upstream fetches in flight", lambda: c.inflight())
    m.gauge_fn(
        "cache_inflight_bytes", "bytes held by upstream fetches in flight", lambda: c.inflight_bytes
    )
    m.counter_fn("cache_hits_total", "fetches served from cache", lambda: c.stats.hits)
    m.counter_fn("cache_misses_total", "fetches that went upstream", lambda: c.stats.misses)
    m.counter_fn("cache_evictions_total", "tracks evicted", lambda: c.stats.evictions)
    m.counter_fn(
        "cache_coalesced_total",
        "requests joined to an in-flight upstream request",
        lambda: c.stats.coalesced,
    )
    m.counter_fn(
        "track_status_cache_hits_total", "TRACK_STATUS answered from cache", lambda: c.stats.status_hits
    )
    m.counter_fn(
        "track_status_negative_hits_total",
        "TRACK_STATUS answered from the negative cache",
        lambda: c.stats.negative_hits,
    )
    m.gauge_fn("namespaces", "announced namespace routes", lambda: len(router))
    m.gauge_fn(
        "upstreams_connected",
        "upstream relays with a session that takes requests",
        lambda: sum(up.connected for up in upstreams),
    )
    m.counter_fn(
        "upstream_sessions_total",
        "sessions established to upstream relays (the first and every reconnect)",
        lambda: sum(up.sessions for up in upstreams),
    )
    m.gauge_fn("fanouts", "tracks with live upstream subscriptions", lambda: len(fanouts))
    m.counter("bytes_in_total", "object payload bytes received")
    m.counter("bytes_out_total", "object payload bytes sent")
    m.counter("upstream_requests_total", "requests sent upstream")
    m.counter(
        "subscriptions_resumed_total",
        "upstream subscriptions subscribed again after their session was lost (subscribers kept)",
    )
    m.counter("limit_rejections_total", "requests or sessions refused by a limit")
    m.counter("blocks_refused_total", "pushed blocks not admitted to the cache, by reason")
    m.counter("auth_refusals_total", "requests and sessions refused by authorization, by code")
    m.counter("requests_total", "requests by type and outcome")
    m.counter(
        "live_fetch_waits_total",
        "FETCHes of a pushed track that waited for objects still arriving, by outcome (complete, short)",
    )
    m.gauge_fn("requests_inflight", "requests open on all sessions", lambda: requests.used)
    m.gauge_fn(
        "buffered_bytes", "bytes buffered for all sessions (last sweep)", lambda: pressure.buffered_sample
    )
    m.gauge_fn(
        "held_bytes",
        "bytes of pushed objects held for sessions outside the cache",
        lambda: pressure.held.total,
    )
    m.counter("sessions_closed_total", "sessions closed by a timeout or limit, by reason")
    m.counter("request_header_timeouts_total", "request streams reset for a late first message")
    m.gauge_fn("cache_share_groups", "cache share groups holding tracks", lambda: c.share_groups)
    m.gauge_fn(
        "cache_share_groups_full", "cache share groups at 90% or more of their share", c.share_groups_full
    )
    m.counter_fn(
        "cache_share_evictions_total",
        "tracks evicted because their group was over its share",
        lambda: c.stats.share_evictions,
    )
