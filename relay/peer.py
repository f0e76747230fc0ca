"""One relay session: ``Peer`` dispatches the session's requests to child tasks, applies the per-session
limits (request slots, slow reader, authorization) and keeps the session's bookkeeping (its FETCHes,
SUBSCRIBEs, namespaces and bytes written) behind methods.

Each request is its own task, so a slow or failing request never blocks another; an exception in one
session's runner closes that session only. What a request does is its handler's business: the relay
that hosts the session gives ``Peer`` one table from request kind to handler (``SessionHost``), and
``Peer`` knows the relay only through that interface, never ``relay.relay`` itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any, Protocol

from kvnet.net.connection import MoqtConnection
from kvnet.net.errors import ConnectionClosed
from kvnet.net.handles import (
    IncomingFetch,
    IncomingRequest,
)
from kvnet.security.tokens import AuthError
from proto import events as me
from proto.errors import ProtocolError, RequestErrorCode, SessionErrorCode, StreamResetCode
from proto.messages import AuthToken, Location
from relay.auth import RelayAuth, SessionAuth, request_target
from relay.cache import TrackKey
from relay.config import RelayConfig
from relay.limits import LimitExceeded, Quota, Slots, acquire_request
from relay.metrics import Metrics
from relay.tasks import spawn
from relay.upstream import UpstreamRelay

logger = logging.getLogger(__name__)


def code_name(code: int) -> str:
    try:
        return RequestErrorCode(code).name.lower()
    except ValueError:
        return f"code_{code:#x}"


REQUEST_KINDS: Mapping[type[me.MoqtEvent], str] = {
    me.FetchReceived: "fetch",
    me.SubscribeReceived: "subscribe",
    me.TrackStatusReceived: "track_status",
    me.PublishNamespaceReceived: "publish_namespace",
    me.PublishReceived: "publish",
    me.SubscribeNamespaceReceived: "subscribe_namespace",
    me.SubscribeTracksReceived: "subscribe_tracks",
    me.RequestUpdateReceived: "request_update",
}
"""The name of each kind of request: its label in metrics and logs, and its key in the handler table."""

DATA_REQUEST_KINDS = frozenset({"fetch", "subscribe", "publish"})
"""Kinds that move objects through the relay's buffers: refused while those are full."""


def request_kind(ev: me.MoqtEvent) -> str:
    return REQUEST_KINDS.get(type(ev), "other")


RequestHandler = Callable[["Peer", Any], Coroutine[Any, Any, None]]
"""Serves one request of a session to its end: ``handler(peer, request)``, the request being the
``IncomingRequest`` subclass of its kind (``IncomingFetch`` for "fetch", ...)."""


class SessionHost(Protocol):
    """What a session needs of the relay that hosts it: the limits it applies and counts against, where it
    reports, and the handler of each kind of request (``relay.relay.Relay`` is the one implementation)."""

    config: RelayConfig
    metrics: Metrics
    auth: RelayAuth | None
    going_away: bool
    requests: Slots
    address_requests: Quota
    identity_requests: Quota
    handlers: Mapping[str, RequestHandler]

    def clock(self) -> float: ...

    def buffers_full(self) -> bool: ...

    def reject(
        self, req: IncomingRequest, kind: str, code: int, reason: str, retry_interval: int = 0
    ) -> None: ...

    def cancelled(
        self, peer: Peer, req: IncomingRequest, kind: str, exc: BaseException | None = None
    ) -> None: ...

    def spawn(self, coro: Coroutine[object, object, None]) -> None: ...

    def drop_subscriptions(self, peer: Peer, code: StreamResetCode, limit: str) -> int:
        """Drop every subscription the relay serves to ``peer`` with ``code``; returns how many."""
        ...

    def forget_peer(self, peer: Peer) -> None:
        """The session ended: release what the relay keeps for it."""
        ...


class Peer:
    """One session: accepted from a client, or our own session to an upstream relay (``upstream``)."""

    def __init__(
        self, relay: SessionHost, conn: MoqtConnection, peer_id: int, upstream: UpstreamRelay | None = None
    ) -> None:
        self.relay = relay
        self.conn = conn
        self.id = peer_id
        self.upstream = upstream
        """Set when this is our session to an upstream relay: its requests are never sent back upstream."""
        self.addr = conn.peer_address
        self.name = f"session:{peer_id}" if upstream is None else upstream.name
        self.host: str | None = None
        """Source IP address the per-address quotas count this session under (None: upstream session)."""
        self.identity: str | None = None
        """Token identity the per-identity quotas count this session under (None: no SETUP token)."""
        self.auth: SessionAuth | None = None
        """This session's credential when the relay requires authorization (never for upstream sessions)."""
        self.requests = Slots("requests per session", relay.config.limits.max_requests_per_session)
        self.namespaces: set[tuple[bytes, ...]] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        now = relay.clock()
        self.last_active = now
        """When a request of this session last started or ended, or the relay last saw that it had sent
        stream data (``idle_for``; idle timeouts)."""
        self._stream_bytes_seen = 0
        """``conn.stream_bytes_received`` when ``idle_for`` last looked."""
        self._subscriptions: dict[int, asyncio.Future[tuple[TrackKey, Location | None]]] = {}
        """This session's SUBSCRIBEs being served, by request id: resolved with the track and the Largest
        Location it started after once accepted (what a joining FETCH needs); cancelled if refused."""
        self._fetches: dict[int, IncomingFetch] = {}
        """FETCHes streaming to this peer; one that is cut off is removed and its loop stops."""
        self.written = 0
        """Object payload bytes the relay wrote toward this peer."""
        self._progress = (now, 0)
        """(when, bytes the peer had consumed then): the last time its send buffer drained a byte."""
        self._cut_at: float | None = None
        self._header_timeouts = 0
        """Request-header timeouts of this session already counted in the metrics."""
        self._refusals_counted: dict[str, int] = {}
        """``conn.refused_requests`` already counted in the metrics, by limit."""
        self.slow = False
        """As a route: it let a forwarded request pass the route deadline (``relay.upstream.Source``)."""
        self._aliases = itertools.count(1)
        self.log = logging.LoggerAdapter(logger, {"session": peer_id, "peer": self.addr})

    async def connection(self) -> MoqtConnection | None:
        return None if self.conn.is_closed else self.conn

    # -- bookkeeping ----------------------------------------------------------------------------------
    def fetch_started(self, req: IncomingFetch) -> None:
        """``req`` streams objects to this peer until ``fetch_ended`` (or ``cut``)."""
        self._fetches[req.request_id] = req

    def fetch_streaming(self, req: IncomingFetch) -> bool:
        """``req`` still streams: neither ended nor cut off by a limit."""
        return req.request_id in self._fetches

    def fetch_ended(self, req: IncomingFetch) -> None:
        self._fetches.pop(req.request_id, None)

    def wrote(self, nbytes: int) -> None:
        """The relay wrote ``nbytes`` of object payload toward this peer (the slow-peer rule's measure)."""
        self.written += nbytes

    def subscription_started(
        self, request_id: int, started: asyncio.Future[tuple[TrackKey, Location | None]]
    ) -> None:
        """SUBSCRIBE ``request_id`` is being served; ``started`` resolves once it is accepted."""
        self._subscriptions[request_id] = started

    def subscription_ended(self, request_id: int) -> None:
        self._subscriptions.pop(request_id, None)

    def subscription(self, request_id: int) -> asyncio.Future[tuple[TrackKey, Location | None]] | None:
        """SUBSCRIBE ``request_id`` of this session, while it is served (what a joining FETCH joins)."""
        return self._subscriptions.get(request_id)

    def count_refusals(self) -> tuple[int, dict[str, int]]:
        """What this session's connection refused on its own since the last call: request-header
        timeouts, and requests refused for a limit before they reached the relay, by limit."""
        timeouts = max(0, self.conn.request_header_timeouts - self._header_timeouts)
        self._header_timeouts += timeouts
        refused: dict[str, int] = {}
        for limit, total in self.conn.refused_requests.items():
            new = total - self._refusals_counted.get(limit, 0)
            if new > 0:
                refused[limit] = new
                self._refusals_counted[limit] = total
        return timeouts, refused

    def next_alias(self) -> int:
        return next(self._aliases)

    async def run(self) -> None:
        relay = self.relay
        try:
            async for req in self.conn.incoming_requests():
                self.dispatch(req)
        finally:
            for task in list(self.tasks):
                task.cancel()
            if self.tasks:
                await asyncio.gather(*self.tasks, return_exceptions=True)
            relay.forget_peer(self)

    def _spawn(self, req: IncomingRequest, kind: str, coro_fn: Callable[[], Awaitable[None]]) -> None:
        relay = self.relay
        try:
            relay.address_requests.acquire(self.host)
            try:
                relay.identity_requests.acquire(self.identity)
            except LimitExceeded:
                relay.address_requests.release(self.host)
                raise
            try:
                acquire_request(
                    self.requests, relay.requests, relay.config.limits.reserved_requests_per_session
                )
            except LimitExceeded:
                relay.address_requests.release(self.host)
                relay.identity_requests.release(self.identity)
                raise
        except LimitExceeded as exc:
            relay.reject(req, kind, exc.code, str(exc), relay.config.limits.retry_interval_ms + 1)
            label = "requests_global" if exc.what == relay.requests.what else exc.what.replace(" ", "_")
            relay.metrics.inc("limit_rejections_total", labels={"limit": label})
            return
        self.last_active = relay.clock()

        async def runner() -> None:
            try:
                if req.gone:
                    relay.cancelled(self, req, kind)  # cancelled while queued: nothing to do
                    return
                await coro_fn()
            except asyncio.CancelledError:
                relay.cancelled(self, req, kind)  # its session ended (or the relay is stopping)
            except ConnectionClosed:
                pass  # the session ended under the request; nothing left to answer
            except Exception as exc:
                if req.gone:
                    # The requester cancelled (or left) between a check and an action on its request:
                    # the action found the request gone. That is its cancellation, not a failure.
                    relay.cancelled(self, req, kind, exc)
                    return
                self.log.exception("request handler failed", extra={"request_id": req.request_id})
                with contextlib.suppress(Exception):
                    self.relay.reject(req, kind, RequestErrorCode.INTERNAL_ERROR, "relay internal error")
            finally:
                self.requests.release()
                relay.requests.release()
                relay.address_requests.release(self.host)
                relay.identity_requests.release(self.identity)
                self.last_active = relay.clock()

        spawn(runner(), self.tasks, f"{kind} request")

    def check_progress(self, now: float, buffered: int) -> None:
        """Slow-peer rule: bytes queued toward the peer and none of them drained for
        ``slow_peer_timeout``: its data requests are reset (TOO_FAR_BEHIND); still stuck after another
        ``slow_peer_timeout`` (or nothing to reset), the session is closed."""
        consumed = self.written - buffered
        if buffered == 0 or consumed > self._progress[1]:
            self._progress = (now, consumed)
            self._cut_at = None
            return
        timeout = self.relay.config.limits.slow_peer_timeout
        if now - self._progress[0] < timeout or (self._cut_at is not None and now - self._cut_at < timeout):
            return
        if self._cut_at is None and self.cut(StreamResetCode.TOO_FAR_BEHIND, "slow_peer"):
            self._cut_at = now
            return
        self.close_for("slow_peer", "relay limit reached: peer is not reading")

    def cut(self, code: StreamResetCode, limit: str) -> int:
        """Reset every FETCH and SUBSCRIBE streaming to this peer with ``code``; returns how many."""
        n = 0
        for rid, req in list(self._fetches.items()):
            del self._fetches[rid]
            with contextlib.suppress(Exception):
                req.cancel(code)
            self.relay.metrics.inc("limit_rejections_total", labels={"limit": limit})
            n += 1
        n += self.relay.drop_subscriptions(self, code, limit)
        if n:
            self.log.warning("peer over a limit; data requests reset", extra={"limit": limit, "requests": n})
        return n

    def idle_for(self, now: float) -> float:
        """Seconds this session has been idle at ``now``. Stream data received since the last look counts
        as activity now: requests refused at dispatch, or still queued behind a busy relay, change no
        request's start or end, yet their session is plainly active (keep-alive PINGs are not stream data,
        so an idle session that only keeps its connection alive stays idle)."""
        received = self.conn.stream_bytes_received
        if received != self._stream_bytes_seen:
            self._stream_bytes_seen = received
            self.last_active = max(self.last_active, now)
        return now - self.last_active

    def reapable(self, idle: float) -> bool:
        """May be closed to make room when the relay is under pressure: no open request, no announced
        namespace (an idle publisher is waiting for requests, not wasting a slot), idle long enough."""
        timeout = self.relay.config.limits.pressure_idle_timeout
        return bool(timeout) and self.requests.used == 0 and not self.namespaces and idle >= timeout

    def close_for(self, reason: str, text: str) -> None:
        """Close this session because of a limit (counted once, in ``sessions_closed_total``)."""
        if self.conn.is_closed:
            return
        self.relay.metrics.inc("sessions_closed_total", labels={"reason": reason})
        self.log.warning("closing session", extra={"reason": reason})
        code = SessionErrorCode.NO_ERROR if reason == "idle_timeout" else SessionErrorCode.INTERNAL_ERROR
        self.conn.run_action(self.conn.session.close, code, text)

    def authorized(self, req: IncomingRequest, kind: str) -> bool:
        """The authorization check, before anything looks at caches or routes (see relay.auth)."""
        if self.relay.auth is None or self.upstream is not None:
            return True  # no authorization configured, or our own session to a relay we chose
        ev = req.event
        target = request_target(ev)
        if target is None:
            return True  # refused below as not supported, or a joining FETCH (its SUBSCRIBE was checked)
        assert self.auth is not None
        tokens: tuple[AuthToken, ...] = ev.parameters.authorization_tokens  # type: ignore[attr-defined]
        try:
            self.auth.check(tokens, *target)
        except AuthError as exc:
            err = exc.to_request_error()
            self.relay.metrics.inc("auth_refusals_total", labels={"code": code_name(err.error_code)})
            self.relay.reject(req, kind, err.error_code, err.reason, err.retry_interval)
            return False
        except ProtocolError as exc:
            self.log.warning("closing session: token alias misuse", extra={"reason": str(exc)})
            self.relay.spawn(self.conn.close_session(exc.error_code, str(exc)))
            return False
        return True

    def dispatch(self, req: IncomingRequest) -> None:
        """Hand ``req`` to its kind's handler in a task of its own, or refuse it (relay going away, not
        authorized, buffers full for a data request, no handler for its kind, a request limit)."""
        relay = self.relay
        kind = request_kind(req.event)
        if relay.going_away:
            relay.reject(req, kind, RequestErrorCode.GOING_AWAY, "relay is shutting down")
            return
        if not self.authorized(req, kind):
            return
        handler = relay.handlers.get(kind)
        if handler is None:
            relay.reject(req, kind, RequestErrorCode.NOT_SUPPORTED, "not supported by this relay")
            return
        if kind in DATA_REQUEST_KINDS and relay.buffers_full():
            relay.metrics.inc("limit_rejections_total", labels={"limit": "buffered_bytes_global"})
            relay.reject(
                req,
                kind,
                RequestErrorCode.EXCESSIVE_LOAD,
                f"relay buffers are full ({relay.config.limits.max_buffered_bytes} bytes)",
                relay.config.limits.retry_interval_ms + 1,
            )
            return
        self._spawn(req, kind, lambda: handler(self, req))
