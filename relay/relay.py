"""The relay daemon: shared state, request handling, limits sweep, accept loop and shutdown.

Owns: ``Relay`` (the shared state built once in ``serve``: cache, namespace router, fan-outs, upstream
relays, metrics) and ``serve``. Sessions are ``relay.peer.Peer``; fan-out of one track to its subscribers
is ``relay.fanout.Fanout``.

Does not know what payloads mean (content-agnostic, like moq-relay) and does no MoQT parsing: events and
actions come from ``kvnet.net.connection`` / ``proto.session``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import signal
import socket
import sys
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Protocol

from kvnet.blocks.disk import DiskTier
from kvnet.blocks.signing import SigningError, TrustStore
from kvnet.net.connection import ConnectionLimits, MoqtConnection
from kvnet.net.endpoint import freeze_startup_objects
from kvnet.net.endpoint import serve as serve_moqt
from kvnet.net.errors import ConnectionClosed, LimitError, RequestRejected, StreamResetError
from kvnet.net.handles import (
    IncomingFetch,
    IncomingPublish,
    IncomingPublishNamespace,
    IncomingRequest,
    IncomingSubscribe,
    IncomingTrackStatus,
)
from kvnet.net.sockets import tcp_server_sockets
from kvnet.net.url import QMUX
from kvnet.security.tokens import KVNET_TOKEN_TYPE, AuthError, read_token_file
from proto import events as me
from proto.data import ObjectStatus
from proto.errors import ProtocolError, RequestErrorCode, SessionErrorCode, StreamResetCode
from proto.messages import NO_PARAMETERS, AliasType, AuthToken, FetchType, Location, MessageParameters
from proto.session import SessionConfig
from relay.admission import BlockAdmission
from relay.auth import AUTH_TOKEN_CACHE_SIZE, RelayAuth, SessionAuth
from relay.cache import (
    CachedObject,
    FetchInfo,
    ObjectCache,
    RequestFailed,
    TrackKey,
    TrackStatus,
    exclusive_to_wire_end,
    wire_end_to_exclusive,
)
from relay.cache import Location as Position
from relay.config import RelayConfig, startup_reason
from relay.fanout import DownstreamSubscriber, Fanout
from relay.limits import HeldBytes, LimitExceeded, Quota, Slots, return_freed_memory, source_host
from relay.metrics import Metrics, MetricsServer
from relay.peer import Peer, code_name
from relay.router import NamespaceRouter, RouteLimitError
from relay.tasks import spawn
from relay.upstream import RoutedUpstream, Source, UpstreamRelay, cached_object, no_route

logger = logging.getLogger(__name__)

TRIM_AFTER_BYTES = 16 * 1024 * 1024
"""Held bytes released since memory was last handed back to the system that make it worth doing again."""


class Holding(Protocol):
    """Objects of one pushed track held for the session that pushed it (a PUBLISH-fed ``Fanout``, a
    contending copy): what ``Relay.hold`` charges and may drop."""

    @property
    def holder(self) -> Peer: ...

    @property
    def held_bytes(self) -> int: ...

    def drop_held(self) -> None:
        """Let go of every held object (releasing them with ``Relay.release_held``) and hold no more."""


class Relay:
    """Shared state of one relay process; built once by ``serve``."""

    def __init__(
        self, config: RelayConfig, metrics: Metrics, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.clock = clock
        self.admission = BlockAdmission(TrustStore.from_paths(config.trust)) if config.trust else None
        """With a trust set: block tracks are cached only when complete and signed by a trusted key."""
        disk = DiskTier(Path(config.cache.dir), config.cache.dir_bytes) if config.cache.dir else None
        self.cache = ObjectCache(
            config.cache, clock, self.admission_refusal if self.admission else None, disk
        )
        self.router: NamespaceRouter[Peer] = NamespaceRouter()
        self.peers: dict[int, Peer] = {}
        self.sessions = Slots("sessions", config.limits.max_sessions)
        self.requests = Slots("requests", config.limits.max_requests)
        """Requests of all sessions (``LimitsConfig.max_requests``)."""
        lim = config.limits
        self.address_sessions = Quota("sessions per address", lim.max_sessions_per_address)
        self.identity_sessions = Quota("sessions per identity", lim.max_sessions_per_identity)
        self.address_requests = Quota("requests per address", lim.max_requests_per_address)
        self.identity_requests = Quota("requests per identity", lim.max_requests_per_identity)
        self.buffered_sample = 0
        """Bytes buffered for all sessions at the last sweep (send + receive side)."""
        self.buffered_since = 0
        """Object bytes written toward peers since that sweep (so the estimate never lags behind)."""
        self._swept = asyncio.Event()
        self.held = HeldBytes(lim)
        """Bytes of pushed objects held outside the cache, per session, address, identity and in total."""
        self.holdings: dict[int, dict[Holding, None]] = {}
        """By session id: its tracks holding objects (``hold``), oldest first."""
        self._freed_since_trim = 0
        self.fanouts: dict[TrackKey, Fanout] = {}
        self.published_tracks: Counter[tuple[bytes, ...]] = Counter()
        """By namespace: its live tracks that reached us by PUBLISH. Such a namespace is published to us
        as much as one a PUBLISH_NAMESPACE announced, so SUBSCRIBE_NAMESPACE watchers hear of it too."""
        self.ns_watchers: dict[tuple[int, int], tuple[Peer, IncomingRequest, tuple[bytes, ...]]] = {}
        self.track_watchers: dict[tuple[int, int], tuple[Peer, tuple[bytes, ...]]] = {}
        """SUBSCRIBE_TRACKS by (session id, request id): (session, namespace prefix)."""
        self._routes_changed = asyncio.Event()
        """Set (and replaced) whenever a namespace or track gets a publisher (``routes_changed``)."""
        self.going_away = False
        self._ids = itertools.count(1)
        self._jobs: set[asyncio.Task[None]] = set()
        self.auth = (
            RelayAuth(config.auth_issuer_keys, time.time, config.auth_clock_skew)
            if config.auth_issuer_keys
            else None
        )
        upstream_tokens: tuple[AuthToken, ...] = ()
        if config.upstream_token is not None:
            value = read_token_file(config.upstream_token)
            upstream_tokens = (AuthToken(AliasType.USE_VALUE, token_type=KVNET_TOKEN_TYPE, value=value),)
        session_cfg = SessionConfig(
            is_client=True,
            authorization_tokens=upstream_tokens,
            max_requests_in_flight=config.limits.max_requests_per_session,
            max_object_size=config.limits.max_object_bytes,
            request_header_timeout=config.limits.request_header_timeout or None,
            max_request_header_timeouts=config.limits.max_request_header_timeouts,
        )
        self.upstreams = [
            UpstreamRelay(
                url,
                dataclasses.replace(
                    config.transport,
                    idle_timeout=config.limits.upstream_idle_timeout,
                    keepalive_interval=config.limits.upstream_idle_timeout / 3,
                ),
                config.upstream_tls or config.tls,
                session_cfg,
                self.connection_limits(),
                clock,
                on_session=self.serve_upstream_session,
                request_timeout=config.limits.upstream_timeout,
                on_namespace=self.upstream_namespace,
            )
            for url in config.upstreams
        ]
        self._register_metrics()

    def connection_limits(self) -> ConnectionLimits:
        lim = self.config.limits
        return ConnectionLimits(
            max_outstanding_requests=lim.max_requests_per_session,
            max_send_buffer=min(lim.max_buffered_bytes_per_session, 16 << 20),
            max_receive_buffer=lim.max_buffered_bytes_per_session,
            setup_timeout=lim.setup_timeout,
        )

    # -- relay-wide limits and timeouts ---------------------------------------------------------------
    def buffered_estimate(self) -> int:
        return self.buffered_sample + self.buffered_since

    def buffers_full(self) -> bool:
        """Bytes buffered for all sessions have reached ``max_buffered_bytes``."""
        return self.buffered_estimate() >= self.config.limits.max_buffered_bytes

    def buffer_fair_share(self) -> int:
        return self.config.limits.max_buffered_bytes // max(1, len(self.peers))

    async def wait_buffer_room(self, timeout: float) -> bool:
        """Wait (at most ``timeout``) until the relay-wide buffers are below their cap again."""
        deadline = self.clock() + timeout
        while self.buffers_full():
            remaining = deadline - self.clock()
            if remaining <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._swept.wait(), remaining)
        return True

    def sweep_interval(self) -> float:
        lim = self.config.limits
        timeouts = [
            t for t in (lim.session_idle_timeout, lim.slow_peer_timeout, lim.pressure_idle_timeout) if t > 0
        ]
        return min(1.0, max(0.05, min(timeouts) / 4))

    async def watch(self) -> None:
        """Apply the timeouts and the relay-wide buffer cap, every ``sweep_interval`` seconds."""
        interval = self.sweep_interval()
        while True:
            await asyncio.sleep(interval)
            try:
                self.sweep(self.clock())
            except Exception:  # the watchdog must outlive any one bad session
                logger.exception("sweep failed")

    def sweep(self, now: float) -> None:
        """One pass over the sessions: idle ones are closed, slow readers cut off, header timeouts and
        the sessions' own refusals counted; then, over ``max_buffered_bytes``, the sessions holding the
        most are cut off first."""
        lim = self.config.limits
        total = 0
        held: list[tuple[int, Peer]] = []
        by_host: dict[str, list[tuple[int, Peer]]] = {}
        by_identity: dict[str, list[tuple[int, Peer]]] = {}
        pressured = self.under_pressure()
        for peer in list(self.peers.values()):
            conn = peer.conn
            if conn.is_closed:
                continue
            self._count_session_refusals(peer)
            idle = peer.idle_for(now)
            if lim.session_idle_timeout and peer.requests.used == 0 and idle >= lim.session_idle_timeout:
                peer.close_for("idle_timeout", "idle timeout")
                continue
            if pressured and peer.reapable(idle):
                peer.close_for("pressure_idle", "idle timeout (relay under pressure)")
                continue
            sent = conn.send_buffered()
            total += sent + conn.receive_buffered
            held.append((sent, peer))
            if peer.host is not None:
                by_host.setdefault(peer.host, []).append((sent, peer))
            if peer.identity is not None:
                by_identity.setdefault(peer.identity, []).append((sent, peer))
            peer.check_progress(now, sent)
        for groups, limit, label in (
            (by_host, lim.max_buffered_bytes_per_address, "buffered_bytes_per_address"),
            (by_identity, lim.max_buffered_bytes_per_identity, "buffered_bytes_per_identity"),
        ):
            if limit:
                for group_held in groups.values():
                    self._cut_biggest(group_held, limit, label)
        self._cut_biggest(held, lim.max_buffered_bytes, "buffered_bytes_global", total)
        self.buffered_sample = total
        self.buffered_since = 0
        self.trim_freed_memory()
        self._swept.set()
        self._swept = asyncio.Event()

    def _cut_biggest(
        self, held: list[tuple[int, Peer]], limit: int, label: str, total: int | None = None
    ) -> None:
        """Over ``limit`` bytes (``total``, or the sum of ``held``), cut off the sessions holding the most
        until back under it: their data requests reset, or the session closed if it has none."""
        total = sum(sent for sent, _ in held) if total is None else total
        if total <= limit:
            return
        for sent, peer in sorted(held, key=lambda h: h[0], reverse=True):
            if total <= limit or sent == 0:
                break
            if not peer.cut(StreamResetCode.EXCESSIVE_LOAD, label):
                peer.close_for(label, f"relay limit reached: {label.replace('_', ' ')}")
            total -= sent

    def under_pressure(self) -> bool:
        """The session table is at least 90 % full (and pressure reaping is on)."""
        lim = self.config.limits
        return lim.pressure_idle_timeout > 0 and self.sessions.used * 10 >= lim.max_sessions * 9

    def admit_session(self) -> None:
        """Take a session slot; when none is left, close the longest-idle session of the address holding
        the most sessions (idle at least ``pressure_idle_timeout``) and take its slot instead."""
        try:
            self.sessions.acquire()
            return
        except LimitExceeded:
            if not self.config.limits.pressure_idle_timeout:
                raise
            now = self.clock()
            idle = [p for p in self.peers.values() if not p.conn.is_closed and p.reapable(p.idle_for(now))]
            if not idle:
                raise
            victim = max(
                idle, key=lambda p: (self.address_sessions.used.get(p.host or "", 0), p.idle_for(now))
            )
            victim.close_for("pressure_idle", "idle timeout (relay under pressure)")
            # The victim's slot is released when its session ends; until then the table is one over.
            self.sessions.used += 1

    def _count_session_refusals(self, peer: Peer) -> None:
        """Add to the metrics what the session's connection refused or reset on its own since the last
        call: request-header timeouts, and requests refused for a limit before they reached us."""
        n = peer.conn.request_header_timeouts
        if n > peer.header_timeouts:
            self.metrics.inc("request_header_timeouts_total", n - peer.header_timeouts)
            peer.header_timeouts = n
        for limit, total in peer.conn.refused_requests.items():
            new = total - peer.refusals_counted.get(limit, 0)
            if new > 0:
                self.metrics.inc("limit_rejections_total", new, labels={"limit": f"session_{limit}"})
                peer.refusals_counted[limit] = total

    def _register_metrics(self) -> None:
        m = self.metrics
        c = self.cache
        m.gauge_fn("sessions", "open sessions", lambda: len(self.peers))
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
        m.gauge_fn("namespaces", "announced namespace routes", lambda: len(self.router))
        m.gauge_fn(
            "upstreams_connected",
            "upstream relays with a session that takes requests",
            lambda: sum(up.connected for up in self.upstreams),
        )
        m.counter_fn(
            "upstream_sessions_total",
            "sessions established to upstream relays (the first and every reconnect)",
            lambda: sum(up.sessions for up in self.upstreams),
        )
        m.gauge_fn("fanouts", "tracks with live upstream subscriptions", lambda: len(self.fanouts))
        m.counter("bytes_in_total", "object payload bytes received")
        m.counter("bytes_out_total", "object payload bytes sent")
        m.counter("upstream_requests_total", "requests sent upstream")
        m.counter(
            "subscriptions_resumed_total",
            "upstream subscriptions subscribed again after their session was lost (subscribers kept)",
        )
        m.counter("limit_rejections_total", "requests or sessions refused by a limit")
        m.counter("auth_refusals_total", "requests and sessions refused by authorization, by code")
        m.counter("requests_total", "requests by type and outcome")
        m.counter(
            "live_fetch_waits_total",
            "FETCHes of a pushed track that waited for objects still arriving, by outcome (complete, short)",
        )
        m.gauge_fn("requests_inflight", "requests open on all sessions", lambda: self.requests.used)
        m.gauge_fn(
            "buffered_bytes", "bytes buffered for all sessions (last sweep)", lambda: self.buffered_sample
        )
        m.gauge_fn(
            "held_bytes",
            "bytes of pushed objects held for sessions outside the cache",
            lambda: self.held.total,
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

    # -- bookkeeping ---------------------------------------------------------------------------------
    def spawn(self, coro: Coroutine[object, object, None]) -> None:
        """Run a background job the relay owns (kept referenced until done, its failure logged once)."""
        spawn(coro, self._jobs, "relay job")

    def count(self, kind: str, outcome: str) -> None:
        self.metrics.inc("requests_total", labels={"type": kind, "outcome": outcome})

    def cancelled(
        self, peer: Peer, req: IncomingRequest, kind: str, exc: BaseException | None = None
    ) -> None:
        """The requester cancelled ``req`` (or its session ended) before we answered it in full."""
        self.count(kind, "cancelled")
        extra = {"request_id": req.request_id, "type": kind}
        if exc is not None:
            extra["error"] = str(exc)
        peer.log.debug("request cancelled by the requester", extra=extra)

    def reject(
        self, req: IncomingRequest, kind: str, code: int, reason: str, retry_interval: int = 0
    ) -> None:
        if req.gone:
            self.count(kind, "cancelled")  # nobody left to tell
            return
        self.count(kind, code_name(code))
        with contextlib.suppress(Exception):  # the request may have been cancelled meanwhile
            req.reject(
                RequestErrorCode(code) if code in RequestErrorCode._value2member_map_ else code,  # type: ignore[arg-type]
                reason,
                retry_interval,
            )

    def admission_refusal(self, key: TrackKey, objects: list[CachedObject]) -> str | None:
        """``BlockAdmission.refusal``, counted and logged: a refused block is an attack or a fault."""
        assert self.admission is not None
        reason = self.admission.refusal(key, objects)
        if reason is not None:
            kind = reason.split(":")[0].split(" ")[0]  # "signature", "incomplete", "payload", ...
            self.metrics.inc("blocks_refused_total", labels={"reason": kind})
            logger.warning(
                "SECURITY: block not admitted to the cache",
                extra={
                    "namespace": _ns_text(key[0]),
                    "track": key[1].decode(errors="replace"),
                    "reason": reason,
                },
            )
        return reason

    # -- objects held for sessions outside the cache -----------------------------------------------------
    def hold(self, holding: Holding, n: int) -> bool:
        """Charge ``n`` more held bytes to ``holding``'s session. Over a bound (per session, address,
        identity, or in total), holdings are dropped until it fits: the oldest of the session over it, or
        of the session holding the most in the address, identity or relay over it. False when ``holding``
        itself was dropped (or holds nothing and ``n`` alone is over a bound): the object is not held."""
        peer = holding.holder
        while (label := self.held.exceeded(peer.id, peer.host, peer.identity, n)) is not None:
            victim = self._held_victim(label, peer) or holding
            self.metrics.inc("limit_rejections_total", labels={"limit": label})
            victim.holder.log.warning(
                "dropping a held pushed track over a limit",
                extra={"limit": label, "bytes": victim.held_bytes},
            )
            victim.drop_held()
            if victim is holding:
                return False
        self.held.add(peer.id, peer.host, peer.identity, n)
        self.holdings.setdefault(peer.id, {})[holding] = None
        return True

    def unhold(self, holding: Holding, n: int) -> None:
        """``n`` bytes of ``holding`` were let go."""
        peer = holding.holder
        self.held.add(peer.id, peer.host, peer.identity, -n)
        self._freed_since_trim += n

    def release_held(self, holding: Holding) -> None:
        """``holding`` lets go of everything it held (its track ended, was cached, or was dropped)."""
        self.unhold(holding, holding.held_bytes)
        mine = self.holdings.get(holding.holder.id)
        if mine is not None:
            mine.pop(holding, None)
            if not mine:
                del self.holdings[holding.holder.id]

    def _held_victim(self, label: str, peer: Peer) -> Holding | None:
        """The holding to drop for bound ``label``: the oldest non-empty one of ``peer``'s session
        (session bound) or of the session holding the most within the scope over its bound."""
        if label == "held_bytes_per_session":
            owner = peer.id
        else:
            def in_scope(session: int) -> bool:
                first = next(iter(self.holdings[session]), None)
                if first is None:
                    return False
                if label == "held_bytes_per_address":
                    return first.holder.host == peer.host
                if label == "held_bytes_per_identity":
                    return first.holder.identity == peer.identity
                return True

            scope = [s for s in self.holdings if in_scope(s)]
            if not scope:
                return None
            owner = max(scope, key=lambda s: self.held.by_session.get(s, 0))
        return next((h for h in self.holdings.get(owner, {}) if h.held_bytes > 0), None)

    def trim_freed_memory(self) -> None:
        """Hand freed heap pages back to the system once enough held bytes were released."""
        if self._freed_since_trim >= TRIM_AFTER_BYTES:
            self._freed_since_trim = 0
            return_freed_memory()

    def candidates(self, key: TrackKey, exclude: Peer | None) -> list[Source]:
        """Longest-prefix publishers (at the hub of ``relay.workers``, then every other worker), then the
        upstream relays. A request that came from an upstream relay goes to local publishers only: sending
        it upstream again could only bring it back (a loop)."""
        return self._by_speed([*self._local_sources(key, exclude), *self._upstream_sources(exclude)])

    def _local_sources(self, key: TrackKey, exclude: Peer | None) -> list[Source]:
        """The longest-prefix publishers, and at the hub then every other worker."""
        pubs: list[Source] = [
            p for p in self.router.lookup(key[0]) if p is not exclude and not p.conn.is_closed
        ]
        if self.config.hub:
            # The workers' caches: blocks pushed into one stay there after their publisher left.
            pubs += [
                p for p in self.peers.values()
                if p is not exclude and not p.conn.is_closed and all(p is not q for q in pubs)
            ]
        return pubs

    def _upstream_sources(self, exclude: Peer | None) -> list[Source]:
        """The upstream relays, unless the request came from one."""
        return [] if exclude is not None and exclude.upstream is not None else list(self.upstreams)

    @staticmethod
    def _by_speed(sources: list[Source]) -> list[Source]:
        # Routes that recently let a request pass the route deadline go last (stable: order kept).
        return sorted(sources, key=lambda src: src.slow)

    def upstream_for(self, key: TrackKey, requester: Peer) -> RoutedUpstream:
        return self._routed(lambda: self.candidates(key, requester))

    def _routed(self, candidates: Callable[[], list[Source]]) -> RoutedUpstream:
        lim = self.config.limits
        return RoutedUpstream(candidates, lim.upstream_timeout, self.metrics, lim.route_timeout)

    async def track_status(self, key: TrackKey, requester: Peer) -> TrackStatus:
        """TRACK_STATUS through the cache. At the hub of ``relay.workers`` the workers are asked apart
        from the upstream relays, first and on every miss: a worker hears of a block pushed to it, the hub
        does not, so only the upstream relays' misses are negatively cached there (a block pushed at one
        worker is found at once from every other)."""
        from_upstream = requester.upstream is not None
        if not self.config.hub:
            return await self.cache.track_status(
                key, self.upstream_for(key, requester), from_upstream=from_upstream
            )
        workers = self._routed(lambda: self._by_speed(self._local_sources(key, requester)))
        upstreams = self._routed(lambda: self._by_speed(self._upstream_sources(requester)))
        return await self.cache.track_status(key, upstreams, asked_first=workers, from_upstream=from_upstream)

    def forget_peer(self, peer: Peer) -> None:
        self._count_session_refusals(peer)
        closed = peer.conn.session.closed
        if closed is not None and closed[0] == SessionErrorCode.CONTROL_MESSAGE_TIMEOUT:
            self.metrics.inc("sessions_closed_total", labels={"reason": "request_header_timeout"})
        if peer.upstream is None:
            self.peers.pop(peer.id, None)
            self.sessions.release()
            self.address_sessions.release(peer.host)
            self.identity_sessions.release(peer.identity)
        removed = self.router.remove_route(peer)
        for k in [k for k in self.ns_watchers if k[0] == peer.id]:
            del self.ns_watchers[k]
        for k in [k for k in self.track_watchers if k[0] == peer.id]:
            del self.track_watchers[k]
        for fan in list(self.fanouts.values()):
            for key in [k for k in fan.subs if k[0] == peer.id]:
                fan.remove(peer, key[1])
            if fan.source_peer is peer and fan.task is not None:
                fan.task.cancel()
        for holding in list(self.holdings.get(peer.id, {})):
            holding.drop_held()  # what the session pushed is released with it, whatever its tasks do
        self.trim_freed_memory()
        peer.log.info("session ended", extra={"routes_removed": removed, "closed": peer.conn.session.closed})

    # -- connections ---------------------------------------------------------------------------------
    async def on_connection(self, conn: MoqtConnection) -> None:
        if self.going_away:
            # Draining: a new session would get GOAWAY at once and be cut at the deadline; refused, the
            # client reconnects elsewhere (or here, after the restart) on its own backoff.
            self.metrics.inc("limit_rejections_total", labels={"limit": "draining"})
            logger.info("refusing session: relay is shutting down", extra={"peer": conn.peer_address})
            await conn.close_session(SessionErrorCode.NO_ERROR, "relay is shutting down")
            return
        session_auth: SessionAuth | None = None
        if self.auth is not None:
            try:
                session_auth = self.auth.session(conn.peer_setup)
            except (AuthError, ProtocolError) as exc:
                code = exc.error_code if isinstance(exc, ProtocolError) else exc.session_error_code
                self.metrics.inc(
                    "auth_refusals_total", labels={"code": f"session_{SessionErrorCode(code).name.lower()}"}
                )
                logger.warning(
                    "refusing session: SETUP authorization",
                    extra={"peer": conn.peer_address, "reason": str(exc)},
                )
                await conn.close_session(code, str(exc))
                return
        host = source_host(conn.peer_address)
        identity = session_auth.identity if session_auth is not None else None
        taken: list[tuple[Quota, str | None]] = []
        try:
            for quota, key in ((self.address_sessions, host), (self.identity_sessions, identity)):
                quota.acquire(key)
                taken.append((quota, key))
            self.admit_session()
        except LimitExceeded as exc:
            for quota, key in taken:
                quota.release(key)
            self.metrics.inc("limit_rejections_total", labels={"limit": exc.what.replace(" ", "_")})
            logger.warning("refusing session", extra={"peer": conn.peer_address, "reason": str(exc)})
            # The session registry has no load code; INTERNAL_ERROR with a clear reason is the closest.
            await conn.close_session(SessionErrorCode.INTERNAL_ERROR, f"relay {exc}")
            return
        peer = Peer(self, conn, next(self._ids))
        peer.host, peer.identity = host, identity
        peer.auth = session_auth
        self.peers[peer.id] = peer
        self.metrics.inc("sessions_total")
        peer.log.info("session started")
        await peer.run()

    async def serve_upstream_session(self, up: UpstreamRelay, conn: MoqtConnection) -> None:
        """Serve the requests an upstream relay routes to us (for namespaces we announced to it)."""
        peer = Peer(self, conn, next(self._ids), upstream=up)
        peer.log.info("serving upstream relay session")
        await peer.run()

    # -- FETCH -----------------------------------------------------------------------------------------
    async def serve_fetch(self, peer: Peer, req: IncomingFetch) -> None:
        try:
            key, start, end = await self._fetch_range(peer, req.event)
        except RequestFailed as exc:
            self.reject(req, "fetch", exc.code, exc.reason, exc.retry_interval)
            return
        objects: AsyncIterator[CachedObject]
        fan = self.fanouts.get(key)
        wait = self.config.limits.upstream_timeout
        short = False
        """The range is of a pushed track whose objects did not all arrive within the wait."""
        if fan is not None and self.cache.cached_status(key) is None and not fan.live_complete(start, end):
            # Objects of the range are still on their way from the publisher: wait for them (bounded)
            # rather than end the FETCH's stream after what we hold, which reads as the whole range. A
            # track the cache holds whole is served from it: a session that PUBLISHed the same name and
            # sends nothing (a squatter) must not hold its FETCHes.
            complete = await fan.wait_live(start, end, wait)
            outcome = "complete" if complete else "short"
            self.metrics.inc("live_fetch_waits_total", labels={"outcome": outcome})
            if req.gone:
                self.cancelled(peer, req, "fetch")
                return
            fan = self.fanouts.get(key)  # ended meanwhile: a complete track is in the cache now
            short = not complete
            if fan is not None and short:
                fan = None  # still short: ask the routes (the publisher's namespace) like any other miss
        live = [] if fan is None else fan.live_objects(start, end)
        if live and self.cache.cached_status(key) is not None:
            live = []  # the whole track is cached: the cache answers, as for any other track
        if fan is not None and live:
            # A live track that reached us by PUBLISH: nobody upstream has it, so serve what we hold.
            outcome = "live"
            served_end = (live[-1].group, live[-1].object_id + 1)
            # The answer reaches the end of the track only if the track ended and we hold nothing later.
            end_of_track = fan.track_ended and not fan.live_objects(served_end, (1 << 62, 0))
            objects = _iterate(live)
        else:
            handle = self.cache.fetch(
                key, start, end, self.upstream_for(key, peer), from_upstream=peer.upstream is not None
            )
            outcome = "cache_hit" if handle.from_cache else ("coalesced" if handle.coalesced else "miss")
            try:
                info = await handle.info()
            except RequestFailed as exc:
                if short and exc.code == RequestErrorCode.DOES_NOT_EXIST:
                    # It does exist, in part: TIMEOUT says "not yet" (a subscriber may ask again), where
                    # DOES_NOT_EXIST would read as a block nobody has.
                    reason = f"track still arriving from its publisher after {wait:g}s"
                    self.reject(req, "fetch", RequestErrorCode.TIMEOUT, reason, int(wait * 1000) + 1)
                    return
                self.reject(req, "fetch", exc.code, exc.reason, exc.retry_interval)
                return
            except (ConnectionClosed, StreamResetError) as exc:
                self.reject(req, "fetch", RequestErrorCode.INTERNAL_ERROR, f"upstream failed: {exc}")
                return
            end_of_track, served_end = info.end_of_track, info.end
            objects = handle.objects()
        if req.gone:
            self.cancelled(peer, req, "fetch")
            return
        req.accept_fetch(end_of_track, Location(*exclusive_to_wire_end(served_end)))
        stall = self.config.limits.slow_peer_timeout
        peer.fetches[req.request_id] = req
        try:
            async for obj in objects:
                if req.gone:
                    self.cancelled(peer, req, "fetch")
                    return
                if req.request_id not in peer.fetches:
                    return  # cut off by a limit (counted there)
                if self.buffers_full() and not await self.wait_buffer_room(stall):
                    self.metrics.inc("limit_rejections_total", labels={"limit": "buffered_bytes_global"})
                    req.cancel(StreamResetCode.EXCESSIVE_LOAD)
                    self.count("fetch", "excessive_load")
                    return
                if req.gone:  # cancelled while we waited for buffer room
                    self.cancelled(peer, req, "fetch")
                    return
                req.send_object(
                    obj.group, obj.subgroup, obj.object_id, obj.payload, obj.priority, obj.properties
                )
                peer.written += len(obj.payload)
                self.buffered_since += len(obj.payload)
                self.metrics.inc("bytes_out_total", len(obj.payload))
                if req.writable:
                    # No back-pressure: skip the timed wait (a task per object, ~1% of relay CPU) but still
                    # yield once per object, so other sessions and the packet sender interleave as before.
                    await asyncio.sleep(0)
                    continue
                try:
                    await asyncio.wait_for(req.drain(), stall)
                except TimeoutError:
                    # The peer stopped reading: give the buffered bytes back instead of holding them forever.
                    self.metrics.inc("limit_rejections_total", labels={"limit": "slow_peer"})
                    req.cancel(StreamResetCode.TOO_FAR_BEHIND)
                    self.count("fetch", "too_far_behind")
                    return
                if req.request_id not in peer.fetches:
                    return  # cut off by a limit while we waited
        except RequestFailed as exc:
            req.cancel(StreamResetCode.INTERNAL_ERROR)
            self.count("fetch", code_name(exc.code))
            return
        except (ConnectionClosed, StreamResetError, OSError) as exc:
            peer.log.info("upstream fetch broke mid-stream", extra={"error": str(exc)})
            req.cancel(StreamResetCode.INTERNAL_ERROR)
            self.count("fetch", "upstream_reset")
            return
        finally:
            peer.fetches.pop(req.request_id, None)
        if req.gone:
            # Cancelled while the last object was on its way: nothing to FIN, the request is over.
            self.cancelled(peer, req, "fetch")
            return
        req.finish()
        self.count("fetch", outcome)

    async def _fetch_range(self, peer: Peer, ev: me.FetchReceived) -> tuple[TrackKey, Position, Position]:
        """Track and ``[start, end)`` of a FETCH. A joining FETCH (draft "Joining Fetches") covers the
        groups before its SUBSCRIBE of the same session: from ``Joining Start`` groups back (relative) or
        from group ``Joining Start`` (absolute), up to the Largest Location the SUBSCRIBE started after."""
        if ev.fetch_type == FetchType.STANDALONE:
            assert ev.track_namespace is not None and ev.track_name is not None
            assert ev.start is not None and ev.end is not None
            end = wire_end_to_exclusive((ev.end.group, ev.end.object))
            return (ev.track_namespace, ev.track_name), (ev.start.group, ev.start.object), end
        assert ev.joining_request_id is not None and ev.joining_start is not None
        joined = peer.subscriptions.get(ev.joining_request_id)
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

    # -- TRACK_STATUS ------------------------------------------------------------------------------------
    async def serve_track_status(self, peer: Peer, req: IncomingTrackStatus) -> None:
        ev = req.event
        key: TrackKey = (ev.track_namespace, ev.track_name)
        hit = self.cache.cached_status(key) is not None
        try:
            st = await self.track_status(key, peer)
        except RequestFailed as exc:
            self.reject(req, "track_status", exc.code, exc.reason, exc.retry_interval)
            return
        if req.gone:
            self.cancelled(peer, req, "track_status")
            return
        params = (
            NO_PARAMETERS if st.largest is None else MessageParameters(largest_object=Location(*st.largest))
        )
        req.respond(params, st.properties)
        self.count("track_status", "cache_hit" if hit else "ok")

    # -- PUBLISH_NAMESPACE / SUBSCRIBE_NAMESPACE ---------------------------------------------------------
    async def serve_publish_namespace(self, peer: Peer, req: IncomingPublishNamespace) -> None:
        ns = req.event.track_namespace
        if len(peer.namespaces) >= self.config.limits.max_namespaces_per_session:
            self.metrics.inc("limit_rejections_total", labels={"limit": "namespaces_per_session"})
            self.reject(
                req,
                "publish_namespace",
                RequestErrorCode.EXCESSIVE_LOAD,
                f"at most {self.config.limits.max_namespaces_per_session} namespaces per session",
            )
            return
        try:
            self.router.add(ns, peer)
        except RouteLimitError as exc:
            self.metrics.inc("limit_rejections_total", labels={"limit": "namespaces"})
            self.reject(req, "publish_namespace", RequestErrorCode.EXCESSIVE_LOAD, str(exc))
            return
        peer.namespaces.add(ns)
        self.cache.invalidate_negative(ns)
        self.routes_changed()
        req.accept()
        self.count("publish_namespace", "ok")
        peer.log.info("namespace published", extra={"namespace": _ns_text(ns)})
        if self._namespace_sources(ns) == 1:
            self._notify_namespace(ns, added=True)
        self._propagate(ns, peer, added=True)
        # The registration lives until the publisher withdraws it or its session ends.
        try:
            await req.cancelled.wait()
        finally:
            self.router.remove(ns, peer)
            peer.namespaces.discard(ns)
            if self._namespace_sources(ns) == 0:
                self._notify_namespace(ns, added=False)
            self._propagate(ns, peer, added=False)
            peer.log.info("namespace withdrawn", extra={"namespace": _ns_text(ns)})

    def _propagate(self, ns: tuple[bytes, ...], source: Peer, added: bool) -> None:
        """Forward a PUBLISH_NAMESPACE (or its withdrawal) to the upstream relays (draft "Relays"), so
        they route requests for ``ns`` to us. Never back to the session it came from; withdrawn upstream
        only when no local session announces exactly ``ns`` any more."""
        if not added and any(n == ns for n, _ in self.router.under(ns)):
            return
        for up in self.upstreams:
            if up is source.upstream:
                continue
            if added:
                up.announce(ns)
            else:
                up.withdraw(ns)

    def _announcers(self, ns: tuple[bytes, ...]) -> int:
        """Local sessions announcing exactly ``ns``."""
        return sum(n == ns for n, _ in self.router.under(ns))

    def _known_upstream(self, ns: tuple[bytes, ...]) -> int:
        """Upstream relays that told us of ``ns`` (NAMESPACE on our forwarded SUBSCRIBE_NAMESPACE)."""
        return sum(ns in up.remote_namespaces for up in self.upstreams)

    def _namespace_sources(self, ns: tuple[bytes, ...]) -> int:
        """Why ``ns`` is published to us: local PUBLISH_NAMESPACEs, upstream relays that know it and live
        PUBLISHed tracks in it. Watchers get NAMESPACE when this becomes 1 and NAMESPACE_DONE at 0."""
        return self._announcers(ns) + self._known_upstream(ns) + self.published_tracks[ns]

    def upstream_namespace(self, ns: tuple[bytes, ...], added: bool) -> None:
        """An upstream relay announced ``ns`` to us (or withdrew it, or its session ended): tell the
        SUBSCRIBE_NAMESPACE watchers, unless it is known here from elsewhere too (then they already were
        told, and it has not gone)."""
        elsewhere = self._namespace_sources(ns) - (1 if added else 0)
        if elsewhere == 0:
            self._notify_namespace(ns, added)

    def _notify_namespace(self, ns: tuple[bytes, ...], added: bool) -> None:
        for wpeer, wreq, prefix in list(self.ns_watchers.values()):
            if ns[: len(prefix)] != prefix or wpeer.conn.is_closed:
                continue
            suffix = ns[len(prefix) :]
            with contextlib.suppress(Exception):
                if added:
                    wpeer.conn.namespace(wreq.request_id, suffix)
                else:
                    wpeer.conn.namespace_done(wreq.request_id, suffix)

    async def serve_subscribe_namespace(self, peer: Peer, req: IncomingRequest) -> None:
        ev = req.event
        assert isinstance(ev, me.SubscribeNamespaceReceived)
        prefix = ev.track_namespace_prefix
        for wpeer, _, other in self.ns_watchers.values():
            if wpeer is peer and (other[: len(prefix)] == prefix or prefix[: len(other)] == other):
                # Draft "SUBSCRIBE_NAMESPACE": one session's namespace subscriptions must not overlap.
                self.reject(
                    req,
                    "subscribe_namespace",
                    RequestErrorCode.PREFIX_OVERLAP,
                    "overlaps a SUBSCRIBE_NAMESPACE of this session",
                )
                return
        req.accept()
        self.count("subscribe_namespace", "ok")
        seen: set[tuple[bytes, ...]] = set()
        remote = (ns for up in self.upstreams for ns in up.remote_namespaces if ns[: len(prefix)] == prefix)
        pushed = [ns for ns in self.published_tracks if ns[: len(prefix)] == prefix]
        for ns in itertools.chain((ns for ns, _ in self.router.under(prefix)), remote, pushed):
            if ns not in seen:
                seen.add(ns)
                peer.conn.namespace(req.request_id, ns[len(prefix) :])
        self.ns_watchers[(peer.id, req.request_id)] = (peer, req, prefix)
        # Namespaces announced anywhere upstream are watched there too (draft "Relays"); a request that
        # came down from an upstream relay is never sent back up.
        forward = [] if peer.upstream is not None else self.upstreams
        for up in forward:
            up.watch(prefix)
        try:
            await req.cancelled.wait()
        finally:
            self.ns_watchers.pop((peer.id, req.request_id), None)
            for up in forward:
                up.unwatch(prefix)

    async def serve_subscribe_tracks(self, peer: Peer, req: IncomingRequest) -> None:
        """SUBSCRIBE_TRACKS: every track under the prefix that reached us by PUBLISH, now or later, is
        offered to the subscriber with a PUBLISH of our own (draft "Publisher Interactions")."""
        ev = req.event
        assert isinstance(ev, me.SubscribeTracksReceived)
        prefix = ev.track_namespace_prefix
        req.accept()
        self.count("subscribe_tracks", "ok")
        self.track_watchers[(peer.id, req.request_id)] = (peer, prefix)
        for key, fan in list(self.fanouts.items()):
            if fan.source_peer not in (None, peer) and key[0][: len(prefix)] == prefix:
                self.offer_track(fan, peer)
        try:
            await req.cancelled.wait()
        finally:
            self.track_watchers.pop((peer.id, req.request_id), None)

    def offer_track(self, fan: Fanout, peer: Peer) -> None:
        """Send PUBLISH for ``fan``'s track to ``peer`` and, once it answers PUBLISH_OK, forward the
        track's objects to it like to any subscriber. Runs as one of the peer's tasks."""

        async def run() -> None:
            alias = peer.next_alias()
            params = NO_PARAMETERS if fan.largest is None else MessageParameters(largest_object=fan.largest)
            try:
                ok = await peer.conn.publish(fan.key[0], fan.key[1], alias, params, fan.properties)
            except RequestRejected as exc:
                peer.log.info("PUBLISH refused by subscriber", extra={"code": exc.code})
                return
            if fan.ended or ok.parameters.forward == 0:
                return  # nothing left to forward, or the subscriber only wanted to know the track exists
            sub = DownstreamSubscriber(peer, ok.request_id, alias)
            fan.add(sub)
            try:
                await sub.ended.wait()
            finally:
                fan.remove(peer, sub.request_id)

        spawn(run(), peer.tasks, "PUBLISH to a SUBSCRIBE_TRACKS subscriber")

    # -- SUBSCRIBE / PUBLISH -------------------------------------------------------------------------------
    async def serve_subscribe(self, peer: Peer, req: IncomingSubscribe) -> None:
        # Joining FETCHes of this session wait on it: the track and where the subscription starts.
        started: asyncio.Future[tuple[TrackKey, Location | None]] = asyncio.get_running_loop().create_future()
        peer.subscriptions[req.request_id] = started
        try:
            await self._serve_subscribe(peer, req, started)
        finally:
            del peer.subscriptions[req.request_id]
            started.cancel()  # a no-op once it has its result

    async def _serve_subscribe(
        self, peer: Peer, req: IncomingSubscribe, started: asyncio.Future[tuple[TrackKey, Location | None]]
    ) -> None:
        ev = req.event
        key: TrackKey = (ev.track_namespace, ev.track_name)
        # RENDEZVOUS TIMEOUT: a SUBSCRIBE for a track nobody publishes yet is held that long (capped by
        # our limit) for a publisher to appear, then answered TIMEOUT (draft "SUBSCRIBE Parameters").
        rendezvous_ms = ev.parameters.rendezvous_timeout
        deadline = (
            None
            if not rendezvous_ms
            else self.clock() + min(rendezvous_ms / 1000, self.config.limits.max_rendezvous_timeout)
        )
        while True:
            routes_changed = self._routes_changed
            try:
                fan, outcome = await self._join_fanout(peer, key)
                break
            except RequestFailed as exc:
                if exc.code != RequestErrorCode.DOES_NOT_EXIST or deadline is None or req.gone:
                    self.reject(req, "subscribe", exc.code, exc.reason, exc.retry_interval)
                    return
            if not await self._wait_routes_changed(routes_changed, deadline):
                self.reject(
                    req, "subscribe", RequestErrorCode.TIMEOUT, "no publisher within the rendezvous timeout"
                )
                return
        if req.gone:
            self.cancelled(peer, req, "subscribe")
            fan.remove(peer, req.request_id)  # the last (only) subscriber gone: stop the upstream
            return
        if len(fan.subs) >= self.config.limits.max_subscribers_per_track:
            self.metrics.inc("limit_rejections_total", labels={"limit": "subscribers_per_track"})
            self.reject(
                req, "subscribe", RequestErrorCode.EXCESSIVE_LOAD, "too many subscribers for this track"
            )
            return
        alias = peer.next_alias()
        params = NO_PARAMETERS if fan.largest is None else MessageParameters(largest_object=fan.largest)
        req.accept_subscribe(alias, params, fan.properties)
        started.set_result((key, fan.largest))
        sub = DownstreamSubscriber(peer, req.request_id, alias)
        fan.add(sub)
        self.count("subscribe", outcome)
        waits = {asyncio.ensure_future(req.cancelled.wait()), asyncio.ensure_future(sub.ended.wait())}
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
            fan.remove(peer, req.request_id)

    async def _join_fanout(self, peer: Peer, key: TrackKey) -> tuple[Fanout, str]:
        """The live fan-out of ``key``, starting its upstream subscription if there is none; returns it
        with the outcome to count ("ok" or "joined"). ``RequestFailed`` when upstream refused."""
        for _ in range(3):
            fan = self.fanouts.get(key)
            if fan is None:
                fan = Fanout(self, key)
                self.fanouts[key] = fan
                try:
                    await self._subscribe_upstream(fan, peer)
                except BaseException as exc:
                    if self.fanouts.get(key) is fan:
                        del self.fanouts[key]
                    failed = (
                        exc
                        if isinstance(exc, RequestFailed)
                        else RequestFailed(RequestErrorCode.INTERNAL_ERROR, "upstream subscription abandoned")
                    )
                    fan.ready.set_exception(failed)
                    fan.ready.exception()  # joiners read it; retrieved here in case there are none
                    raise
                fan.ready.set_result(None)
                outcome = "ok"
            else:
                if self._would_wait_for_itself(fan, peer):
                    raise no_route()
                await asyncio.shield(fan.ready)
                outcome = "joined"
            if not fan.ended and self.fanouts.get(key) is fan:
                return fan, outcome
            # The fan-out ended while we waited (its upstream finished or its last subscriber left):
            # start over with a fresh upstream subscription.
        raise RequestFailed(RequestErrorCode.INTERNAL_ERROR, "upstream subscription kept ending")

    def _would_wait_for_itself(self, fan: Fanout, peer: Peer) -> bool:
        """A SUBSCRIBE from an upstream relay, which only local publishers may answer, finding the upstream
        subscription of ``fan`` still pending on its way upstream, perhaps to that very relay, which waits
        for our answer (two workers of ``relay.workers`` subscribing to one track at once): with no local
        publisher to answer it, it is answered at once instead of joining (as FETCH and TRACK_STATUS are,
        ``relay.cache`` rule 6)."""
        return (
            peer.upstream is not None
            and not fan.ready.done()
            and (fan.requester is None or fan.requester.upstream is None)
            and not self._local_sources(fan.key, peer)
        )

    def routes_changed(self) -> None:
        """A namespace or a track got a publisher: wake the requests waiting for one (rendezvous)."""
        self._routes_changed.set()
        self._routes_changed = asyncio.Event()

    async def _wait_routes_changed(self, changed: asyncio.Event, deadline: float) -> bool:
        """Wait until ``changed`` is set (True) or ``deadline`` passes (False)."""
        remaining = deadline - self.clock()
        if remaining <= 0:
            return False
        try:
            await asyncio.wait_for(changed.wait(), remaining)
        except TimeoutError:
            return False
        return True

    async def _subscribe_upstream(self, fan: Fanout, requester: Peer) -> None:
        fan.requester = requester
        sub = await self.upstream_for(fan.key, requester).subscribe(fan.key)
        assert sub.ok is not None
        fan.upstream = sub
        fan.largest = sub.ok.parameters.largest_object
        fan.properties = sub.ok.track_properties
        fan.task = spawn(fan.pump(sub), what="subscription fan-out")

    async def serve_publish(self, peer: Peer, req: IncomingPublish) -> None:
        ev = req.event
        key: TrackKey = (ev.track_namespace, ev.track_name)
        if key in self.fanouts:
            if self.admission is not None and self.admission.is_block_track(key):
                # The first PUBLISH of a block proves nothing (it may be empty or forged): with a trust set
                # every copy is collected and the first that passes admission is cached.
                await self._collect_contender(peer, req, key)
                return
            self.reject(
                req, "publish", RequestErrorCode.DUPLICATE_SUBSCRIPTION, "track already has a publisher"
            )
            return
        fan = Fanout(self, key)
        fan.source_peer = peer
        fan.properties = ev.track_properties
        fan.largest = ev.parameters.largest_object
        fan.publish_objects = deque()
        fan.ready.set_result(None)
        self.fanouts[key] = fan
        # Objects that followed the PUBLISH before this answer are buffered by the glue, not lost.
        source = req.accept_publish(MessageParameters(forward=1))
        self.cache.invalidate_negative(key[0])
        self.routes_changed()
        self.count("publish", "ok")
        for watcher, prefix in list(self.track_watchers.values()):
            if key[0][: len(prefix)] == prefix and watcher is not peer and not watcher.conn.is_closed:
                self.offer_track(fan, watcher)
        fan.task = spawn(fan.pump(source), what="published track fan-out")
        self._track_published(key[0], added=True)
        cancelled = asyncio.ensure_future(req.cancelled.wait())
        try:
            await asyncio.wait({fan.task, cancelled}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            try:
                cancelled.cancel()
                if not fan.task.done():
                    fan.task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await fan.task
            finally:
                self._track_published(key[0], added=False)

    def _track_published(self, ns: tuple[bytes, ...], added: bool) -> None:
        """A PUBLISHed track of ``ns`` started or ended: the first one makes ``ns`` known to namespace
        watchers (NAMESPACE), the last one's end withdraws it (NAMESPACE_DONE) unless it is known
        otherwise (draft "Subscribing to Namespaces": namespaces published to the relay are echoed)."""
        if added:
            self.published_tracks[ns] += 1
        else:
            self.published_tracks[ns] -= 1
            if self.published_tracks[ns] <= 0:
                del self.published_tracks[ns]
        if self._namespace_sources(ns) == (1 if added else 0):
            self._notify_namespace(ns, added)

    async def _collect_contender(self, peer: Peer, req: IncomingPublish, key: TrackKey) -> None:
        """Accept a PUBLISH of a block track another session is already publishing, collect its objects
        (at most ``cache.max_track_bytes``, charged to the session's held bytes) and offer the complete
        track to the cache, where admission decides. Subscribers are not fanned this copy live; they get
        it from the cache."""
        source = req.accept_publish(MessageParameters(forward=1))
        self.count("publish", "contender")
        copy = ContendingCopy(self, peer)
        budget = self.config.cache.max_track_bytes
        try:
            async for ev in source:
                obj = cached_object(ev)
                self.metrics.inc("bytes_in_total", len(ev.payload))
                if copy.dropped:
                    continue  # a held-bytes limit let go of it: nothing complete to offer
                if obj.status == ObjectStatus.END_OF_TRACK:
                    if self.cache.cached_status(key) is None:
                        end = (obj.group, obj.object_id)
                        info = FetchInfo(end, True, req.event.track_properties)
                        self.cache.put_track(key, copy.objects, info)
                    break
                if copy.held_bytes + obj.size > budget:
                    peer.log.info(
                        "contending PUBLISH over the track budget; dropped",
                        extra={"bytes": copy.held_bytes + obj.size},
                    )
                    break
                if self.hold(copy, obj.size):
                    copy.objects.append(obj)
                    copy.held_bytes += obj.size
        except (ConnectionClosed, RequestRejected, StreamResetError, LimitError):
            pass  # the contender went away: nothing complete to offer
        finally:
            copy.drop_held()

    # -- shutdown ------------------------------------------------------------------------------------------
    async def close(self) -> None:
        for up in self.upstreams:
            await up.close()


class ContendingCopy:
    """The objects of a contending PUBLISH being collected (``Relay._collect_contender``): a ``Holding``."""

    def __init__(self, relay: Relay, holder: Peer) -> None:
        self.relay = relay
        self.holder = holder
        self.objects: list[CachedObject] = []
        self.held_bytes = 0
        self.dropped = False

    def drop_held(self) -> None:
        self.relay.release_held(self)
        self.objects = []
        self.held_bytes = 0
        self.dropped = True


async def _iterate(objects: list[CachedObject]) -> AsyncIterator[CachedObject]:
    for obj in objects:
        yield obj


def _ns_text(ns: tuple[bytes, ...]) -> str:
    return "/".join(p.decode() if p.isascii() and p.decode().isprintable() else p.hex() for p in ns)


def run(config: RelayConfig, serving: Coroutine[object, object, None], name: str = "") -> int:
    """Run ``serving`` (``serve`` of ``config``, as a process's whole life) to its end; the exit code.
    What it raises comes from starting (reading key, token and cache files, binding the QUIC and metrics
    sockets): one line naming the flag, exit 2. Once it serves, a peer's failure ends that peer's session,
    not the relay. ``name`` prefixes the line (a worker of ``relay.workers``)."""
    freeze_startup_objects()
    try:
        asyncio.run(serving)
    except KeyboardInterrupt:
        return 130
    except (OSError, ValueError, SigningError) as exc:
        prefix = f"{name}: " if name else ""
        print(f"kvnet-relay: error: {prefix}{startup_reason(exc, config)}", file=sys.stderr)
        return 2
    return 0


async def serve(
    config: RelayConfig,
    stop: asyncio.Event | None = None,
    sock: socket.socket | None = None,
    on_listening: Callable[[tuple[str, int], int | None], None] | None = None,
    metrics: Metrics | None = None,
    qmux_sock: socket.socket | None = None,
) -> None:
    """Run a relay until SIGTERM/SIGINT (or ``stop``), then GOAWAY, drain and close. ``sock``: serve on
    that bound UDP socket instead of binding ``config``'s address (a worker of ``relay.workers``), and
    ``qmux_sock`` the same for the QMux listener (``config.qmux_host``), which serves beside QUIC into the
    same ``Relay`` (one cache, one set of limits and metrics); ``on_listening(quic address, metrics port)``
    is called once it serves; ``metrics``: the relay's (with families its caller added), else a new one."""
    metrics = metrics or Metrics()
    relay = Relay(config, metrics)
    session_cfg = SessionConfig(
        is_client=False,
        max_auth_token_cache_size=AUTH_TOKEN_CACHE_SIZE if config.auth_issuer_keys else None,
        max_requests_in_flight=config.limits.max_requests_per_session,
        max_object_size=config.limits.max_object_bytes,
        request_header_timeout=config.limits.request_header_timeout or None,
        max_request_header_timeouts=config.limits.max_request_header_timeouts,
    )
    server = await serve_moqt(
        config.host,
        config.port,
        config.transport,
        config.tls,
        relay.on_connection,
        session_config=session_cfg,
        limits=relay.connection_limits(),
        # The relay enforces max_sessions itself so refusals are counted and logged.
        max_connections=1 << 30,
        sock=sock,
    )
    qmux_server = None
    if config.qmux_host is not None:
        if qmux_sock is None:
            try:
                (qmux_sock,) = tcp_server_sockets(config.qmux_host, config.qmux_port, 1, config.transport)
            except OSError as exc:
                await server.close()
                where = f"--listen-qmux {config.qmux_host}:{config.qmux_port}"
                raise ValueError(f"{where}: cannot listen: {exc.strerror}") from exc
        qmux_server = await serve_moqt(
            config.qmux_host, config.qmux_port, config.transport, config.tls, relay.on_connection,
            session_config=session_cfg, limits=relay.connection_limits(), max_connections=1 << 30,
            sock=qmux_sock, stack=QMUX,
        )
    metrics_server: MetricsServer | None = None
    if config.metrics_port is not None:
        metrics_server = MetricsServer(metrics, config.metrics_host, config.metrics_port)
        await metrics_server.start()
    for up in relay.upstreams:
        up.start()
    watchdog = asyncio.get_running_loop().create_task(relay.watch())
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(RuntimeError, ValueError):  # not in the main thread
            loop.add_signal_handler(sig, stop.set)
    host, port = server.address
    logger.info(
        "listening",
        extra={
            "quic": f"{host}:{port}",
            "qmux": "off" if qmux_server is None else "{}:{}".format(*qmux_server.address),
            "metrics": f"{config.metrics_host}:{metrics_server.port}" if metrics_server else "off",
            "upstreams": ",".join(config.upstreams) or "none",
            "cache_bytes": config.cache.max_bytes,
        },
    )
    if on_listening is not None:
        on_listening((host, port), metrics_server.port if metrics_server else None)
    await stop.wait()
    started = time.monotonic()
    logger.info(
        "shutting down: GOAWAY to all sessions",
        extra={"sessions": len(relay.peers), "drain_timeout": config.drain_timeout},
    )
    relay.going_away = True
    await asyncio.gather(
        server.shutdown(config.goaway_uri, config.drain_timeout),
        *([] if qmux_server is None else [qmux_server.shutdown(config.goaway_uri, config.drain_timeout)]),
    )
    watchdog.cancel()
    await relay.close()
    if metrics_server is not None:
        await metrics_server.close()
    logger.info("stopped", extra={"drain_seconds": round(time.monotonic() - started, 3)})
