"""Where cache misses go: publisher sessions that announced a matching namespace, then upstream relays.

Owns: ``UpstreamRelay`` (a lazily connected, reconnecting client session to one ``--upstream`` relay, which
also carries our publishers' PUBLISH_NAMESPACE registrations to that relay and serves the requests it
routes back to us) and ``RoutedUpstream``, the ``relay.cache.Upstream`` implementation that tries the
longest-prefix publishers first and the upstream relays after them, translating MoQT answers into cache
terms. A candidate that says DOES_NOT_EXIST is skipped for the next one; every other failure is reported
with its code. A candidate that has not answered within the route deadline while others remain is
passed over: the next one is asked too and the first answer wins (a dead session is not waited for
until QUIC notices it is gone).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, Protocol, TypeVar

from kvnet.net.connection import ConnectionLimits, MoqtConnection
from kvnet.net.endpoint import connect
from kvnet.net.errors import ConnectionClosed, MoqtConnectionError, RequestRejected, StreamResetError
from kvnet.net.handles import FetchHandle, Subscription
from kvnet.net.quic import TlsSettings, TransportSettings
from proto.errors import RequestErrorCode
from proto.events import FetchOkReceived, ObjectReceived, TrackStatusOkReceived
from proto.messages import Location, MessageParameters, TrackNamespace
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
from relay.metrics import Metrics
from relay.tasks import retrieve, spawn

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

# After a failed connect, do not retry an upstream relay for this long (each miss would otherwise pay a
# full handshake timeout).
_RECONNECT_BACKOFF = 1.0


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
    """A client session to an upstream relay, connected on first use and re-established after it ends.

    Namespace propagation (draft "Relays"/"Publisher Interactions": the upstream relay routes requests for
    a namespace to the session that announced it): ``announce``/``withdraw`` keep the set of namespaces our
    publishers announced; each is sent upstream as PUBLISH_NAMESPACE on the current session (re-sent after
    a reconnect) and withdrawn by cancelling that request. Requests the upstream relay sends us on this
    session are handed to ``on_session`` (the relay serves them like any peer's).
    """

    def __init__(
        self,
        url: str,
        settings: TransportSettings,
        tls: TlsSettings,
        session_config: SessionConfig,
        limits: ConnectionLimits,
        clock: Callable[[], float],
        on_session: Callable[[UpstreamRelay, MoqtConnection], Awaitable[None]] | None = None,
        request_timeout: float = 10.0,
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
        self._conn: MoqtConnection | None = None
        self._connecting: asyncio.Task[MoqtConnection] | None = None
        self._failed_at: float | None = None
        self._wanted: set[TrackNamespace] = set()
        """Namespaces our publishers announced (to be announced upstream)."""
        self._announced: dict[TrackNamespace, int | None] = {}
        """On the current session: namespace -> PUBLISH_NAMESPACE Request ID (None while in flight)."""
        self._announced_on: MoqtConnection | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = False
        self.slow = False

    @property
    def announced(self) -> frozenset[TrackNamespace]:
        """Namespaces the upstream relay accepted from us on the current session."""
        return frozenset(ns for ns, rid in self._announced.items() if rid is not None)

    def announce(self, namespace: TrackNamespace) -> None:
        """Forward a publisher's PUBLISH_NAMESPACE upstream (now, or once connected)."""
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

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        spawn(coro, self._tasks, f"{self.name} job")

    async def _sync(self) -> None:
        """Announce every wanted namespace on the current session (connecting if needed)."""
        if self._closing or not self._wanted:
            return
        conn = await self.connection()
        if conn is None:
            # Unreachable: retry after the backoff so the upstream learns the routes once it is back.
            await asyncio.sleep(_RECONNECT_BACKOFF)
            if self._wanted and (self._conn is None or self._conn.is_closed):
                self._spawn(self._sync())
            return
        if self._announced_on is not conn:
            self._announced_on = conn
            self._announced = {}
        todo = [ns for ns in self._wanted if ns not in self._announced]
        for ns in todo:
            self._announced[ns] = None
        await asyncio.gather(*(self._announce_one(conn, ns) for ns in todo))

    async def _announce_one(self, conn: MoqtConnection, ns: TrackNamespace) -> None:
        try:
            rid = await asyncio.wait_for(conn.publish_namespace(ns), self._request_timeout)
        except (RequestRejected, ConnectionClosed, TimeoutError) as exc:
            logger.warning(
                "upstream relay refused PUBLISH_NAMESPACE", extra={"upstream": self.url, "error": str(exc)}
            )
            if self._announced_on is conn and self._announced.get(ns, 0) is None:
                del self._announced[ns]
            return
        if self._announced_on is not conn or ns not in self._wanted:
            conn.cancel_request(rid)  # withdrawn (or reconnected) while the announcement was in flight
            return
        self._announced[ns] = rid
        logger.info("namespace announced upstream", extra={"upstream": self.url})

    async def connection(self) -> MoqtConnection | None:
        conn = self._conn
        if conn is not None and not conn.is_closed and conn.goaway is None:
            return conn
        if self._failed_at is not None and self._clock() - self._failed_at < _RECONNECT_BACKOFF:
            return None
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
            # Read by the waiter below, unless every waiter was cancelled first.
            self._connecting.add_done_callback(lambda t: retrieve(t, f"{self.name} connect"))
        task = self._connecting
        try:
            conn = await asyncio.shield(task)
        except (MoqtConnectionError, OSError, TimeoutError) as exc:
            logger.warning("upstream relay unreachable", extra={"upstream": self.url, "error": str(exc)})
            self._failed_at = self._clock()
            return None
        finally:
            if self._connecting is task and task.done():
                self._connecting = None
        self._conn = conn
        self._failed_at = None
        return conn

    async def _connect(self) -> MoqtConnection:
        conn = await connect(self.url, self._settings, self._tls, self._session_config, self._limits)
        logger.info("connected to upstream relay", extra={"upstream": self.url})
        self._spawn(self._run_session(conn))
        return conn

    async def _run_session(self, conn: MoqtConnection) -> None:
        """Serve what the upstream relay asks of us on ``conn``; after it ends, re-announce elsewhere."""
        try:
            if self._on_session is not None:
                await self._on_session(self, conn)
            await conn.wait_session_closed()
        finally:
            if not self._closing:
                # The next request reconnects (a restarted upstream) or goes to another route.
                logger.warning(
                    "upstream session ended", extra={"upstream": self.url, "closed": conn.session.closed}
                )
            if not self._closing and self._wanted:
                logger.warning("upstream session ended; re-announcing", extra={"upstream": self.url})
                await asyncio.sleep(_RECONNECT_BACKOFF)
                self._spawn(self._sync())

    async def close(self) -> None:
        self._closing = True
        if self._connecting is not None:
            self._connecting.cancel()
        for task in list(self._tasks):
            task.cancel()
        if self._conn is not None and not self._conn.is_closed:
            with contextlib.suppress(TimeoutError, ConnectionError):
                await asyncio.wait_for(self._conn.close_session(), 2)


class _NoRoute(Exception):
    """A candidate had no live session."""


def _no_route() -> RequestFailed:
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
        asked: list[str] = []

        async def ask(src: Source) -> _T:
            conn = await src.connection()
            if conn is None or conn.is_closed:
                raise _NoRoute(src.name)
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
            except (_NoRoute, ConnectionClosed, StreamResetError):
                raise _no_route() from None
            src.slow = False
            return src, answer

        try:
            while True:
                if not running:
                    if not queue:
                        raise last or _no_route()
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
                    exc = task.exception()
                    if exc is None:
                        src.slow = False
                        return src, task.result()  # the others are cancelled (or discarded) below
                    if isinstance(exc, RequestRejected):
                        src.slow = False
                        last = RequestFailed(exc.code, exc.reason, exc.retry_interval)
                        if exc.code != RequestErrorCode.DOES_NOT_EXIST:
                            raise last
                    elif not isinstance(exc, _NoRoute | ConnectionClosed | StreamResetError):
                        raise exc
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
                    ev = await asyncio.wait_for(anext(it), self._timeout)
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
