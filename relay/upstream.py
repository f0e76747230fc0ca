"""Where cache misses go once their routes are chosen (``relay.routes``): publisher sessions that announced
a matching namespace, then upstream relays.

Owns: ``UpstreamRelay`` (the client session to one ``--upstream`` relay, kept up from start to shutdown
with the reconnect backoff, which also carries our publishers' PUBLISH_NAMESPACE registrations and our
watchers' SUBSCRIBE_NAMESPACE to that relay and serves the requests it routes back to us; one per
``--upstream``, built by ``upstream_relays``) and ``RoutedUpstream``, the ``relay.cache.Upstream``
implementation that asks the routes in turn, translating MoQT answers into cache terms. A candidate that
says DOES_NOT_EXIST is skipped for the next one; every other failure is reported with its code. A
candidate that has not answered within the route deadline while others remain is passed over: the next
one is asked too and the first answer wins (a dead session is not waited for until QUIC notices it is
gone).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, Protocol, TypeVar

from kvnet.net.config import TlsConfig, TransportConfig
from kvnet.net.connection import MoqtConnection
from kvnet.net.endpoint import connect
from kvnet.net.errors import ConnectionClosed, MoqtConnectionError, RequestRejected, StreamResetError
from kvnet.net.handles import FetchHandle, Subscription
from kvnet.net.limits import ConnectionLimits
from kvnet.net.reconnect import STABLE_SESSION_S, Backoff, redirect_target
from kvnet.security.tokens import KVNET_TOKEN_TYPE, read_token_file
from proto import events as me
from proto.errors import RequestErrorCode, SessionErrorCode
from proto.events import FetchOkReceived, ObjectReceived, TrackStatusOkReceived
from proto.messages import AliasType, AuthToken, Location, MessageParameters, TrackNamespace
from proto.session import SessionConfig
from relay.cache import (
    CachedObject,
    FetchInfo,
    FillSink,
    RequestFailed,
    TrackKey,
    TrackStatus,
    exclusive_to_wire_end,
    wire_end_to_exclusive,
)
from relay.config import RelayConfig
from relay.metrics import Metrics
from relay.tasks import spawn

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

RETIRE_POLL_S = 0.05
"""How often a session that got GOAWAY is checked for requests still in flight."""

class Source(Protocol):
    """A session the relay can send requests to."""

    name: str
    slow: bool
    """It let a forwarded request pass its route deadline and has not answered anything since: later
    requests try it after the other routes."""

    async def connection(self) -> MoqtConnection | None:
        """The live connection, or None when unavailable."""
        ...


def cached_object(ev: ObjectReceived) -> CachedObject:
    return CachedObject(
        group=ev.group_id,
        subgroup=ev.subgroup_id,
        object_id=ev.object_id,
        priority=128 if ev.publisher_priority is None else ev.publisher_priority,
        status=int(ev.status),
        properties=ev.properties,
        payload=ev.payload,
    )


class UpstreamRelay:
    """A client session to an upstream relay, kept up from ``start`` until ``close``.

    Lifecycle: a supervisor task connects, and whenever the session closes (upstream restarted, keep-alive
    lost after ``--upstream-idle-timeout``) or the upstream sends GOAWAY, connects again after a delay from
    ``kvnet.net.reconnect.Backoff`` (the nodes' policy: capped exponential, jittered); a GOAWAY naming a
    New Session URI is followed at once (and back to ``url`` if that relay cannot be reached). A session
    that got GOAWAY takes no new request; it is left to finish what it carries until the upstream closes
    it (or we do, after its GOAWAY timeout). A session the upstream closed on purpose without an error
    (a relay's idle close: ``MoqtConnection.closed_by_peer``, NO_ERROR, no GOAWAY) after lasting
    ``STABLE_SESSION_S`` is replaced at once, without the backoff. A request finding no session waits for
    a connect attempt under way (or about to start), and otherwise fails at once with a clear error
    (``RoutedUpstream``) instead of waiting for the backoff.

    Namespace propagation (draft "Relays"/"Publisher Interactions": the upstream relay routes requests for
    a namespace to the session that announced it): ``announce``/``withdraw`` keep the set of namespaces our
    publishers announced; each is sent upstream as PUBLISH_NAMESPACE on the current session (re-sent on
    every new session) and withdrawn by cancelling that request. ``watch``/``unwatch`` do the same for
    the prefixes of our watchers' SUBSCRIBE_NAMESPACE; what the upstream announces in answer is kept in
    ``remote_namespaces`` and reported to ``on_namespace`` (and reported gone when the session is lost).
    Requests the upstream relay sends us on a session are handed to ``on_session`` (the relay serves them
    like any peer's).
    """

    def __init__(
        self,
        url: str,
        settings: TransportConfig,
        tls: TlsConfig,
        session_config: SessionConfig,
        limits: ConnectionLimits,
        clock: Callable[[], float],
        on_session: Callable[[UpstreamRelay, MoqtConnection], Awaitable[None]] | None = None,
        request_timeout: float = 10.0,
        backoff: Backoff | None = None,
        on_namespace: Callable[[TrackNamespace, bool], None] | None = None,
    ) -> None:
        self.url = url
        self.name = f"upstream:{url}"
        self._settings = settings
        self._tls = tls
        self._session_config = session_config
        self._limits = limits
        self._clock = clock
        self._on_session = on_session
        self._request_timeout = request_timeout
        self.backoff = backoff or Backoff()
        self._conn: MoqtConnection | None = None
        """The session new requests go to (None while down, or after its GOAWAY)."""
        self._next_session: asyncio.Future[MoqtConnection | None] | None = None
        """The session that comes next, for the requests that find none: resolves to it once connected, or
        to None when none comes without a backoff (the attempt failed, or the last session ended in a way
        that backs off). Set while a connect attempt is under way, and while a session is up (a request
        may find it just ended, before the supervisor has decided what follows)."""
        self.retry_at: float | None = None
        """While backing off: when the next attempt starts (clock time)."""
        self.last_error = ""
        """Why the last attempt or session failed (for the error a request gets meanwhile)."""
        self.sessions = 0
        """Sessions established so far."""
        self._supervisor: asyncio.Task[None] | None = None
        self._wanted: set[TrackNamespace] = set()
        """Namespaces our publishers announced (to be announced upstream)."""
        self._announced: dict[TrackNamespace, int | None] = {}
        """On the current session: namespace -> PUBLISH_NAMESPACE Request ID (None while in flight)."""
        self._announced_on: MoqtConnection | None = None
        self._watched: Counter[TrackNamespace] = Counter()
        """Prefixes downstream sessions sent SUBSCRIBE_NAMESPACE for (with how many are open)."""
        self._watching: dict[TrackNamespace, int | None] = {}
        """On the current session: prefix -> our SUBSCRIBE_NAMESPACE Request ID (None while in flight)."""
        self._watching_on: MoqtConnection | None = None
        self.remote_namespaces: set[TrackNamespace] = set()
        """Namespaces the upstream relay told us of (NAMESPACE) on the current session."""
        self._on_namespace = on_namespace
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = False
        self.slow = False

    @property
    def announced(self) -> frozenset[TrackNamespace]:
        """Namespaces the upstream relay accepted from us on the current session."""
        return frozenset(ns for ns, rid in self._announced.items() if rid is not None)

    @property
    def connected(self) -> bool:
        """A session that takes new requests is up."""
        return self._live(self._conn)

    def start(self) -> None:
        """Connect now and keep a session from then on."""
        if self._supervisor is None and not self._closing:
            self._supervisor = spawn(self._keep_connected(), what=f"{self.name} supervisor")

    def announce(self, namespace: TrackNamespace) -> None:
        """Forward a publisher's PUBLISH_NAMESPACE upstream (now, or on the next session)."""
        self._wanted.add(namespace)
        self._spawn(self._sync())

    def withdraw(self, namespace: TrackNamespace) -> None:
        """The last local announcer of ``namespace`` went away: cancel our PUBLISH_NAMESPACE upstream."""
        self._wanted.discard(namespace)
        rid = self._announced.pop(namespace, None)
        conn = self._announced_on
        if rid is not None and conn is not None and not conn.is_closed:
            conn.cancel_request(rid)
            logger.info("namespace withdrawn upstream", extra={"upstream": self.url})

    def watch(self, prefix: TrackNamespace) -> None:
        """A downstream session subscribed to namespaces under ``prefix``: subscribe upstream too (now, or
        on the next session), so namespaces announced anywhere upstream reach it (``on_namespace``)."""
        self._watched[prefix] += 1
        if self._watched[prefix] == 1:
            self._spawn(self._sync_watched())

    def unwatch(self, prefix: TrackNamespace) -> None:
        """The last downstream subscription to ``prefix`` ended."""
        self._watched[prefix] -= 1
        if self._watched[prefix] > 0:
            return
        del self._watched[prefix]
        self._spawn(self._sync_watched())
        # Namespaces only that prefix covered are no longer known from upstream.
        for ns in [n for n in self.remote_namespaces if not self._covered(n)]:
            self._namespace_gone(ns)

    def _covered(self, ns: TrackNamespace) -> bool:
        return any(ns[: len(p)] == p for p in self._watched)

    def _cover(self) -> set[TrackNamespace]:
        """The watched prefixes no other watched prefix contains: one session's namespace subscriptions
        must not overlap (draft "SUBSCRIBE_NAMESPACE", PREFIX_OVERLAP)."""
        return {p for p in self._watched if not any(q != p and p[: len(q)] == q for q in self._watched)}

    async def _sync_watched(self) -> None:
        """Bring the current session's SUBSCRIBE_NAMESPACE requests in line with the watched prefixes."""
        conn = self._conn
        if self._closing or conn is None or not self._live(conn):
            return  # the next session subscribes them all
        if self._watching_on is not conn:
            self._watching_on, self._watching = conn, {}
        cover = self._cover()
        for prefix in [p for p in self._watching if p not in cover]:
            rid = self._watching.pop(prefix)
            if rid is not None:
                conn.cancel_request(rid)
        todo = [p for p in cover if p not in self._watching]
        for prefix in todo:
            self._watching[prefix] = None
        await asyncio.gather(*(self._watch_one(conn, p) for p in todo))

    async def _watch_one(self, conn: MoqtConnection, prefix: TrackNamespace) -> None:
        def on_event(ev: me.NamespaceReceived | me.NamespaceDoneReceived) -> None:
            if self._watching_on is not conn:
                return  # a message of an earlier session
            ns = (*prefix, *ev.track_namespace_suffix)
            if isinstance(ev, me.NamespaceReceived):
                if ns not in self.remote_namespaces:
                    self.remote_namespaces.add(ns)
                    if self._on_namespace is not None:
                        self._on_namespace(ns, True)
            elif ns in self.remote_namespaces:
                self._namespace_gone(ns)

        await self._open_standing(
            "SUBSCRIBE_NAMESPACE", conn.subscribe_namespace(prefix, on_namespace=on_event), conn,
            self._watching, prefix, lambda: self._watching_on is conn and prefix in self._cover(),
        )

    async def _open_standing(
        self, what: str, request: Awaitable[int], conn: MoqtConnection,
        table: dict[TrackNamespace, int | None], key: TrackNamespace, still_wanted: Callable[[], bool],
    ) -> None:
        """Await one standing request (``what`` for ``key`` on ``conn``) and record its Request ID in
        ``table``, where it sits as None while in flight. Refused, it is forgotten (the next session
        tries again); no longer wanted once answered (withdrawn, or a new session meanwhile), cancelled."""
        try:
            async with asyncio.timeout(self._request_timeout):
                rid = await request
        except (RequestRejected, ConnectionClosed, TimeoutError) as exc:
            logger.warning(f"upstream relay refused {what}", extra={"upstream": self.url, "error": str(exc)})
            if table.get(key, 0) is None:
                del table[key]
            return
        if not still_wanted():
            conn.cancel_request(rid)
            return
        table[key] = rid
        logger.info(f"{what} accepted upstream", extra={"upstream": self.url})

    def _namespace_gone(self, ns: TrackNamespace) -> None:
        self.remote_namespaces.discard(ns)
        if self._on_namespace is not None:
            self._on_namespace(ns, False)

    def _forget_remote_namespaces(self) -> None:
        """The session they were learned on is over: none of them is known from upstream any more."""
        for ns in list(self.remote_namespaces):
            self._namespace_gone(ns)
        self._watching, self._watching_on = {}, None

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        spawn(coro, self._tasks, f"{self.name} job")

    @staticmethod
    def _live(conn: MoqtConnection | None) -> bool:
        return conn is not None and not conn.is_closed and conn.goaway is None

    async def _sync(self) -> None:
        """Announce every wanted namespace not yet announced on the current session."""
        conn = self._conn
        if self._closing or not self._wanted or conn is None or not self._live(conn):
            return  # the next session announces them all
        if self._announced_on is not conn:
            self._announced_on = conn
            self._announced = {}
        todo = [ns for ns in self._wanted if ns not in self._announced]
        for ns in todo:
            self._announced[ns] = None
        await asyncio.gather(*(self._announce_one(conn, ns) for ns in todo))

    async def _announce_one(self, conn: MoqtConnection, ns: TrackNamespace) -> None:
        await self._open_standing(
            "PUBLISH_NAMESPACE", conn.publish_namespace(ns), conn, self._announced, ns,
            lambda: self._announced_on is conn and ns in self._wanted,
        )

    async def connection(self) -> MoqtConnection | None:
        """The session for a new request: the current one, or the one a connect attempt under way (or
        about to start: the upstream closed the last one as idle) brings, bounded by the handshake and
        SETUP deadlines; None while backing off between attempts."""
        if self._live(self._conn):
            return self._conn
        upcoming = self._next_session
        if upcoming is None:
            return None
        conn = await asyncio.shield(upcoming)
        return conn if self._live(conn) else None

    def _no_next_session(self) -> None:
        """Wake the requests waiting for a next session: none comes without a backoff."""
        upcoming, self._next_session = self._next_session, None
        if upcoming is not None and not upcoming.done():
            upcoming.set_result(None)

    async def _keep_connected(self) -> None:
        loop = asyncio.get_running_loop()
        redirect: str | None = None
        """Where the last GOAWAY sent us (its New Session URI); the next attempt goes there."""
        while not self._closing:
            url = redirect or self.url
            if self._next_session is None:
                self._next_session = loop.create_future()
            attempt, self.retry_at = self._next_session, None
            try:
                # Bounded here too: a blackholed upstream must not hold the requests waiting for this attempt
                # for longer than one request may wait anyway.
                async with asyncio.timeout(self._request_timeout):
                    conn = await connect(url, self._settings, self._tls, self._session_config, self._limits)
            except BaseException as exc:
                self._no_next_session()  # wakes the requests waiting for this attempt
                if not isinstance(exc, MoqtConnectionError | OSError | TimeoutError):
                    raise  # cancelled (closing)
                self.last_error = str(exc) or type(exc).__name__
                redirect = None  # a redirect target that cannot be reached: back to the configured URL
                await self._back_off("upstream relay unreachable")
                continue
            if self._closing:
                # close() set _closing while the connect finished: nobody would end this session or
                # this task.
                self._no_next_session()
                with contextlib.suppress(TimeoutError, ConnectionError):
                    async with asyncio.timeout(2):
                        await conn.close_session()
                return
            self._conn = conn
            self.sessions += 1
            attempt.set_result(conn)
            self._next_session = loop.create_future()
            logger.info("connected to upstream relay", extra={"upstream": url, "session": self.sessions})
            started = self._clock()
            self._spawn(self._serve(conn))
            self._spawn(self._sync())
            self._spawn(self._sync_watched())
            self.last_error = await conn.wait_leaving()
            if self._closing:
                self._no_next_session()
                return
            self._conn = None  # new requests wait for (or fail without) the next session at once
            self._forget_remote_namespaces()
            if not conn.is_closed:
                self._spawn(self._retire(conn))
            lasted = self._clock() - started >= STABLE_SESSION_S
            if lasted:
                self.backoff.reset()
            if lasted and conn.goaway is None and self._closed_as_idle(conn):
                # Not a failure: requests that come meanwhile wait for the next session rather than being
                # refused through a backoff. A shorter session (an upstream that closes every session at
                # once) still backs off.
                logger.info("upstream closed the session as idle: reconnecting", extra={"upstream": url})
                continue  # to the same relay (``redirect`` still names it if a GOAWAY sent us there)
            came_by_redirect = redirect is not None
            redirect = None if conn.goaway is None else redirect_target(conn.goaway.new_session_uri)
            if redirect is not None and redirect != url and (lasted or not came_by_redirect):
                # Sent to another relay (a rolling restart): go at once; a chain of redirects that each
                # end at once is spaced by the backoff like any short session.
                logger.info("upstream relay redirects to another", extra={"upstream": url, "to": redirect})
                continue
            self._no_next_session()
            await self._back_off("upstream session ended")

    @staticmethod
    def _closed_as_idle(conn: MoqtConnection) -> bool:
        """The upstream ended the session on purpose without an error (a relay's idle close): not our
        QUIC idle timeout or keep-alive loss, which end it with NO_ERROR as well."""
        closed = conn.session.closed
        return conn.closed_by_peer and closed is not None and closed[0] == SessionErrorCode.NO_ERROR

    async def _back_off(self, what: str) -> None:
        delay = self.backoff.next_delay()
        self.retry_at = self._clock() + delay
        logger.warning(
            what, extra={"upstream": self.url, "error": self.last_error, "retry_in": round(delay, 3)}
        )
        await asyncio.sleep(delay)

    async def _retire(self, conn: MoqtConnection) -> None:
        """A session that got GOAWAY: the requests in flight on it (``MoqtConnection.requests_in_flight``)
        may finish, and we close it with NO_ERROR once they have (the draft's recommendation), or once its
        GOAWAY timeout (our request timeout if it named none) has passed, or the upstream closed it first.
        Waiting out the whole timeout would hold a draining relay's session, and its restart, for nothing."""
        goaway = conn.goaway
        grace = goaway.timeout / 1000 if goaway is not None and goaway.timeout else self._request_timeout
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + grace
        closed = asyncio.ensure_future(conn.wait_session_closed())
        try:
            # Polled: requests end in QUIC callbacks that signal nothing; retiring sessions are rare, brief.
            while conn.requests_in_flight and not closed.done() and loop.time() < give_up_at:
                await asyncio.wait({closed}, timeout=min(RETIRE_POLL_S, max(0.0, give_up_at - loop.time())))
        finally:
            closed.cancel()
        if not conn.is_closed:
            with contextlib.suppress(TimeoutError, ConnectionError):
                async with asyncio.timeout(2):
                    await conn.close_session()

    async def _serve(self, conn: MoqtConnection) -> None:
        """Serve what the upstream relay asks of us on ``conn`` until it ends."""
        if self._on_session is not None:
            await self._on_session(self, conn)
        await conn.wait_session_closed()

    def unavailable(self) -> RequestFailed:
        """The answer to a request that found no session: what failed, and when the next attempt is."""
        left = None if self.retry_at is None else max(0.0, self.retry_at - self._clock())
        wait = "" if left is None else f"; next attempt in {left:.1f} s"
        return RequestFailed(
            RequestErrorCode.INTERNAL_ERROR,
            f"upstream relay {self.url} not connected ({self.last_error or 'connecting'}){wait}",
            int((left or 0.0) * 1000) + 1,  # Retry Interval is milliseconds + 1 (0: "do not retry")
        )

    async def close(self) -> None:
        self._closing = True
        if self._supervisor is not None:
            self._supervisor.cancel()
            await asyncio.gather(self._supervisor, return_exceptions=True)
        self._no_next_session()
        for task in list(self._tasks):
            task.cancel()
        if self._conn is not None and not self._conn.is_closed:
            with contextlib.suppress(TimeoutError, ConnectionError):
                async with asyncio.timeout(2):
                    await self._conn.close_session()


def upstream_relays(
    config: RelayConfig,
    limits: ConnectionLimits,
    clock: Callable[[], float],
    on_session: Callable[[UpstreamRelay, MoqtConnection], Awaitable[None]],
    on_namespace: Callable[[TrackNamespace, bool], None],
) -> list[UpstreamRelay]:
    """One ``UpstreamRelay`` per ``--upstream`` of ``config``: its session presents ``--upstream-token``
    (if any) and is held to the same per-session request and object limits as the relay's own, with
    keep-alive at a third of ``--upstream-idle-timeout``; ``limits`` are its connection's."""
    tokens: tuple[AuthToken, ...] = ()
    if config.upstream_token is not None:
        value = read_token_file(config.upstream_token)
        tokens = (AuthToken(AliasType.USE_VALUE, token_type=KVNET_TOKEN_TYPE, value=value),)
    session_cfg = SessionConfig(
        is_client=True,
        authorization_tokens=tokens,
        max_requests_in_flight=config.limits.max_requests_per_session,
        max_object_size=config.limits.max_object_bytes,
        request_header_timeout=config.limits.request_header_timeout or None,
        max_request_header_timeouts=config.limits.max_request_header_timeouts,
    )
    return [
        UpstreamRelay(
            url,
            dataclasses.replace(
                config.transport,
                idle_timeout=config.limits.upstream_idle_timeout,
                keepalive_interval=config.limits.upstream_idle_timeout / 3,
            ),
            config.upstream_tls or config.tls,
            session_cfg,
            limits,
            clock,
            on_session=on_session,
            request_timeout=config.limits.upstream_timeout,
            on_namespace=on_namespace,
        )
        for url in config.upstreams
    ]


class _NoRoute(Exception):
    """A candidate had no live session; ``failure`` is what to answer if no other candidate does."""

    def __init__(self, failure: RequestFailed) -> None:
        super().__init__(failure.reason)
        self.failure = failure


def no_route() -> RequestFailed:
    """The answer when nothing may be asked: DOES_NOT_EXIST."""
    return RequestFailed(RequestErrorCode.DOES_NOT_EXIST, "no publisher or upstream relay for this track")


class RoutedUpstream:
    """``relay.cache.Upstream`` over an ordered list of candidate sources.

    Route deadline (``route_timeout``): a request goes to the first candidate; if it has not answered
    (FETCH_OK, TRACK_STATUS_OK, SUBSCRIBE_OK or REQUEST_ERROR) within ``route_timeout`` and another
    candidate remains, that one is asked as well, and so on. The first answer wins and the requests
    still outstanding are cancelled. A candidate passed over so is marked ``slow`` (later requests try
    it last) until it answers again. The whole exchange is bounded by ``timeout`` (TIMEOUT)."""

    def __init__(
        self,
        candidates: Callable[[], Sequence[Source]],
        timeout: float,
        metrics: Metrics,
        route_timeout: float = 0.0,
    ) -> None:
        # Looked up when a request first goes upstream: most requests are answered from the cache.
        self._find_candidates = candidates
        self._timeout = timeout
        self._route_timeout = route_timeout
        self._metrics = metrics

    async def _first_answer(
        self,
        kind: str,
        attempt: Callable[[Source, MoqtConnection], Awaitable[_T]],
        discard: Callable[[_T], None] = lambda _: None,
    ) -> tuple[Source, _T]:
        """Ask the candidates in order under the route deadline; returns the first one that answered
        with its answer. DOES_NOT_EXIST and a vanished session move on to the next candidate; any other
        REQUEST_ERROR is final (``RequestFailed`` with its code)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout
        queue = list(self._find_candidates())
        running: dict[asyncio.Task[_T], Source] = {}
        last: RequestFailed | None = None
        unreachable: RequestFailed | None = None
        asked: list[str] = []

        async def ask(src: Source) -> _T:
            conn = await src.connection()
            if conn is None or conn.is_closed:
                # An upstream relay that is reconnecting says so (the track may well exist there).
                raise _NoRoute(src.unavailable() if isinstance(src, UpstreamRelay) else no_route())
            self._metrics.inc("upstream_requests_total", labels={"type": kind})
            return await attempt(src, conn)

        def start_next() -> None:
            src = queue.pop(0)
            asked.append(src.name)
            running[asyncio.get_running_loop().create_task(ask(src))] = src

        if len(queue) == 1:
            # One candidate (the usual case: one publisher, or one origin relay): there is nobody to
            # race, so ask it in this task instead of a task of its own plus a wait per request.
            src = queue[0]
            try:
                async with asyncio.timeout(self._timeout):
                    answer = await ask(src)
            except TimeoutError:
                raise RequestFailed(RequestErrorCode.TIMEOUT, f"no {kind} answer from {src.name}") from None
            except RequestRejected as rejected:
                src.slow = False
                raise RequestFailed(rejected.code, rejected.reason, rejected.retry_interval) from None
            except _NoRoute as exc:
                raise exc.failure from None
            except (ConnectionClosed, StreamResetError):
                raise no_route() from None
            src.slow = False
            return src, answer

        try:
            while True:
                if not running:
                    if not queue:
                        raise unreachable or last or no_route()
                    start_next()
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise RequestFailed(RequestErrorCode.TIMEOUT, f"no {kind} answer from {', '.join(asked)}")
                wait = remaining
                if queue and self._route_timeout > 0:
                    wait = min(remaining, self._route_timeout)
                done, _ = await asyncio.wait(running, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    if queue and self._route_timeout > 0:
                        for src in running.values():
                            if not src.slow:
                                logger.info(
                                    "route did not answer in time; asking the next one too",
                                    extra={
                                        "route": src.name,
                                        "type": kind,
                                        "route_timeout": self._route_timeout,
                                    },
                                )
                            src.slow = True
                        start_next()
                    continue
                # Several may finish in one step: take them in the order they were asked.
                for task in [t for t in running if t in done]:
                    src = running.pop(task)
                    error = task.exception()
                    if error is None:
                        src.slow = False
                        return src, task.result()  # the others are cancelled (or discarded) below
                    if isinstance(error, RequestRejected):
                        src.slow = False
                        last = RequestFailed(error.code, error.reason, error.retry_interval)
                        if error.code != RequestErrorCode.DOES_NOT_EXIST:
                            raise last
                    elif isinstance(error, _NoRoute):
                        if error.failure.code != RequestErrorCode.DOES_NOT_EXIST:
                            unreachable = error.failure
                    elif not isinstance(error, ConnectionClosed | StreamResetError):
                        raise error
        finally:
            for task in running:
                task.cancel()
            for task in running:
                task.add_done_callback(
                    lambda t: discard(t.result()) if not t.cancelled() and t.exception() is None else None
                )

    async def fetch(
        self, key: TrackKey, start: tuple[int, int], end: tuple[int, int], sink: FillSink
    ) -> None:
        ns, name = key

        async def attempt(src: Source, conn: MoqtConnection) -> tuple[FetchHandle, FetchOkReceived]:
            handle = await conn.fetch(ns, name, Location(*start), Location(*exclusive_to_wire_end(end)))
            try:
                return handle, await handle.ok()
            except BaseException:
                handle.cancel()
                raise

        src, (handle, ok) = await self._first_answer("fetch", attempt, lambda r: r[0].cancel())
        sink.set_info(
            FetchInfo(
                wire_end_to_exclusive((ok.end_location.group, ok.end_location.object)),
                ok.end_of_track,
                ok.track_properties,
            )
        )
        try:
            it = aiter(handle)
            while True:
                try:
                    async with asyncio.timeout(self._timeout):
                        ev = await anext(it)
                except StopAsyncIteration:
                    break
                self._metrics.inc("bytes_in_total", len(ev.payload))
                sink.add(cached_object(ev))
        except TimeoutError:
            handle.cancel()
            raise RequestFailed(RequestErrorCode.TIMEOUT, f"fetch from {src.name} stalled") from None
        except RequestRejected as exc:
            raise RequestFailed(exc.code, exc.reason, exc.retry_interval) from None
        except BaseException:
            handle.cancel()
            raise

    async def track_status(self, key: TrackKey) -> TrackStatus:
        ns, name = key

        async def attempt(src: Source, conn: MoqtConnection) -> TrackStatusOkReceived:
            return await conn.track_status(ns, name)

        _, ok = await self._first_answer("track_status", attempt)
        lo = ok.parameters.largest_object
        return TrackStatus(None if lo is None else (lo.group, lo.object), False, ok.track_properties)

    async def subscribe(self, key: TrackKey) -> Subscription:
        """SUBSCRIBE (Forward=1) at the first candidate that accepts; the caller owns the subscription."""
        ns, name = key

        async def attempt(src: Source, conn: MoqtConnection) -> Subscription:
            return await conn.subscribe(ns, name, forward_parameters())

        _, sub = await self._first_answer("subscribe", attempt, lambda s: s.cancel())
        return sub


def forward_parameters() -> MessageParameters:
    """Upstream SUBSCRIBE parameters: Forward=1 whatever the downstream asked (draft: Forward Handling)."""
    return MessageParameters(forward=1)
