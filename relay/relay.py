"""The relay's core: its shared state, the sessions it accepts and the handler of each kind of request.

Owns: ``Relay`` (the shared state built once in ``relay.server.serve``: cache, namespace router, fan-outs,
upstream relays, metrics), the table from request kind to handler and the handlers. Sessions are
``relay.peer.Peer``; fan-out of one track to its subscribers is ``relay.fanout.Fanout``; the buffered and
held bytes and the sweep over the sessions are ``relay.pressure.Pressure``; where a miss goes is
``relay.routes.Routes``; FETCH is served by ``relay.fetching``; the metric families are declared by
``relay.metric_families``; listening and shutdown are ``relay.server``'s.

Does not know what payloads mean (content-agnostic, like moq-relay) and does no MoQT parsing: events and
actions come from ``kvnet.net.connection`` / ``proto.session``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path

from kvnet.net.connection import MoqtConnection
from kvnet.net.errors import ConnectionClosed, LimitError, RequestRejected, StreamResetError
from kvnet.net.handles import (
    IncomingPublish,
    IncomingPublishNamespace,
    IncomingRequest,
    IncomingSubscribe,
    IncomingTrackStatus,
)
from kvnet.net.limits import ConnectionLimits
from kvnet.security.signing import TrustStore
from kvnet.security.tokens import AuthError
from kvnet.storage.disk import DiskTier
from proto import events as me
from proto.data import ObjectStatus
from proto.errors import ProtocolError, RequestErrorCode, SessionErrorCode, StreamResetCode
from proto.messages import NO_PARAMETERS, Location, MessageParameters
from relay import fetching
from relay.admission import BlockAdmission
from relay.auth import RelayAuth, SessionAuth
from relay.cache import (
    CachedObject,
    FetchInfo,
    ObjectCache,
    RequestFailed,
    TrackKey,
)
from relay.config import RelayConfig
from relay.fanout import DownstreamSubscriber, Fanout, Holding
from relay.limits import LimitExceeded, Quota, Slots, source_host
from relay.metric_families import register_families
from relay.metrics import Metrics
from relay.peer import Peer, RequestHandler, code_name
from relay.pressure import Pressure
from relay.router import NamespaceRouter, RouteLimitError
from relay.routes import Routes
from relay.tasks import spawn
from relay.upstream import RoutedUpstream, UpstreamRelay, cached_object, no_route, upstream_relays

logger = logging.getLogger(__name__)


class Relay:
    """Shared state of one relay process; built once by ``relay.server.serve``."""

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
        self.pressure = Pressure(lim, metrics, clock, self.peers, self.sessions, self.address_sessions)
        """Buffered and held bytes, and the sweep that applies the timeouts and buffer caps (``watch``)."""
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
        self.upstreams = upstream_relays(
            config, self.connection_limits(), clock, self.serve_upstream_session, self.upstream_namespace
        )
        self.routes = Routes(self.router, self.peers, self.upstreams, config.hub, lim, metrics, self.cache)
        """Where a miss goes: which sessions and upstream relays are asked, in what order."""
        self.handlers: Mapping[str, RequestHandler] = {
            "fetch": functools.partial(fetching.serve_fetch, self),
            "track_status": self.serve_track_status,
            "subscribe": self.serve_subscribe,
            "publish_namespace": self.serve_publish_namespace,
            "subscribe_namespace": self.serve_subscribe_namespace,
            "subscribe_tracks": self.serve_subscribe_tracks,
            "publish": self.serve_publish,
        }
        """The handler of each kind of request a session may send (``relay.peer.REQUEST_KINDS``); a kind
        missing here is refused as NOT_SUPPORTED."""
        register_families(
            metrics, self.cache, self.pressure, self.requests, self.peers, self.router, self.fanouts,
            self.upstreams,
        )

    def connection_limits(self) -> ConnectionLimits:
        lim = self.config.limits
        return ConnectionLimits(
            max_outstanding_requests=lim.max_requests_per_session,
            max_send_buffer=min(lim.max_buffered_bytes_per_session, 16 << 20),
            max_receive_buffer=lim.max_buffered_bytes_per_session,
            setup_timeout=lim.setup_timeout,
        )

    # -- what sessions and fan-outs ask of the relay-wide pressure (``SessionHost``, ``FanoutHost``) -------
    def buffers_full(self) -> bool:
        return self.pressure.buffers_full()

    def buffer_fair_share(self) -> int:
        return self.pressure.buffer_fair_share()

    def wrote(self, nbytes: int) -> None:
        self.pressure.wrote(nbytes)

    def hold(self, holding: Holding, n: int) -> bool:
        return self.pressure.hold(holding, n)

    def unhold(self, holding: Holding, n: int) -> None:
        self.pressure.unhold(holding, n)

    def release_held(self, holding: Holding) -> None:
        self.pressure.release_held(holding)

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

    def upstream_for(self, key: TrackKey, requester: Peer) -> RoutedUpstream:
        return self.routes.upstream_for(key, requester)

    def drop_subscriptions(self, peer: Peer, code: StreamResetCode, limit: str) -> int:
        """Drop every subscription the relay's fan-outs serve to ``peer`` with ``code``; returns how many."""
        n = 0
        for fan in list(self.fanouts.values()):
            for sub in [s for s in fan.subs.values() if s.peer is peer and not s.dropped]:
                fan.drop(sub, code, limit)
                n += 1
        return n

    def forget_peer(self, peer: Peer) -> None:
        self.pressure.count_session_refusals(peer)
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
        for holding in list(self.pressure.holdings.get(peer.id, {})):
            holding.drop_held()  # what the session pushed is released with it, whatever its tasks do
        self.pressure.trim_freed_memory()
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
            self.pressure.admit_session()
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

    # -- TRACK_STATUS ------------------------------------------------------------------------------------
    async def serve_track_status(self, peer: Peer, req: IncomingTrackStatus) -> None:
        ev = req.event
        key: TrackKey = (ev.track_namespace, ev.track_name)
        hit = self.cache.cached_status(key) is not None
        try:
            st = await self.routes.track_status(key, peer)
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
        peer.subscription_started(req.request_id, started)
        try:
            await self._serve_subscribe(peer, req, started)
        finally:
            peer.subscription_ended(req.request_id)
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
            and not self.routes.local_sources(fan.key, peer)
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
            async with asyncio.timeout(remaining):
                await changed.wait()
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
            if self.admission is not None and self.admission.checks(key):
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


def _ns_text(ns: tuple[bytes, ...]) -> str:
    return "/".join(p.decode() if p.isascii() and p.decode().isprintable() else p.hex() for p in ns)
