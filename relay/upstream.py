"""Where cache misses go: publisher sessions that announced a matching namespace, then upstream relays.

Owns: ``UpstreamRelay`` (a lazily connected, reconnecting client session to one ``--upstream`` relay) and
``RoutedUpstream``, the ``relay.cache.Upstream`` implementation that tries the longest-prefix publishers
first and the upstream relays after them, translating MoQT answers into cache terms. A candidate that says
DOES_NOT_EXIST is skipped for the next one; every other failure is reported with its code.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

from kvnet.connection import (
    ConnectionClosed,
    ConnectionLimits,
    MoqtConnection,
    MoqtConnectionError,
    RequestRejected,
    StreamResetError,
    connect,
)
from kvnet.quic import TlsSettings, TransportSettings
from proto.errors import RequestErrorCode
from proto.events import ObjectReceived
from proto.messages import Location, MessageParameters
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

logger = logging.getLogger(__name__)

# After a failed connect, do not retry an upstream relay for this long (each miss would otherwise pay a
# full handshake timeout).
_RECONNECT_BACKOFF = 1.0


class Source(Protocol):
    """A session the relay can send requests to."""

    name: str

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
    """A client session to an upstream relay, connected on first use and re-established after it ends."""

    def __init__(
        self,
        url: str,
        settings: TransportSettings,
        tls: TlsSettings,
        session_config: SessionConfig,
        limits: ConnectionLimits,
        clock: Callable[[], float],
    ) -> None:
        self.url = url
        self.name = f"upstream:{url}"
        self._settings = settings
        self._tls = tls
        self._session_config = session_config
        self._limits = limits
        self._clock = clock
        self._conn: MoqtConnection | None = None
        self._connecting: asyncio.Task[MoqtConnection] | None = None
        self._failed_at: float | None = None

    async def connection(self) -> MoqtConnection | None:
        conn = self._conn
        if conn is not None and not conn.is_closed and conn.goaway is None:
            return conn
        if self._failed_at is not None and self._clock() - self._failed_at < _RECONNECT_BACKOFF:
            return None
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
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
        return conn

    async def close(self) -> None:
        if self._connecting is not None:
            self._connecting.cancel()
        if self._conn is not None and not self._conn.is_closed:
            with contextlib.suppress(TimeoutError, ConnectionError):
                await asyncio.wait_for(self._conn.close_session(), 2)


class RoutedUpstream:
    """``relay.cache.Upstream`` over an ordered list of candidate sources."""

    def __init__(
        self,
        candidates: Sequence[Source],
        timeout: float,
        metrics: Metrics,
    ) -> None:
        self._candidates = list(candidates)
        self._timeout = timeout
        self._metrics = metrics

    async def _each(self) -> AsyncIterator[tuple[Source, MoqtConnection]]:
        """Live candidates in order, connecting (to an upstream relay) only when the earlier ones failed."""
        found = False
        for src in self._candidates:
            conn = await src.connection()
            if conn is not None and not conn.is_closed:
                found = True
                yield src, conn
        if not found:
            raise RequestFailed(
                RequestErrorCode.DOES_NOT_EXIST, "no publisher or upstream relay for this track"
            )

    async def fetch(
        self, key: TrackKey, start: tuple[int, int], end: tuple[int, int], sink: FillSink
    ) -> None:
        ns, name = key
        last: RequestFailed | None = None
        async for src, conn in self._each():
            self._metrics.inc("upstream_requests_total", labels={"type": "fetch"})
            try:
                handle = await conn.fetch(ns, name, Location(*start), Location(*exclusive_to_wire_end(end)))
            except ConnectionClosed:
                continue
            try:
                ok = await asyncio.wait_for(handle.ok(), self._timeout)
            except RequestRejected as exc:
                last = RequestFailed(exc.code, exc.reason, exc.retry_interval)
                if exc.code == RequestErrorCode.DOES_NOT_EXIST:
                    continue
                raise last from None
            except TimeoutError:
                handle.cancel()
                raise RequestFailed(RequestErrorCode.TIMEOUT, f"no FETCH_OK from {src.name}") from None
            except (ConnectionClosed, StreamResetError):
                continue
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
            return
        raise last or RequestFailed(RequestErrorCode.DOES_NOT_EXIST, "track not found upstream")

    async def track_status(self, key: TrackKey) -> TrackStatus:
        ns, name = key
        last: RequestFailed | None = None
        async for src, conn in self._each():
            self._metrics.inc("upstream_requests_total", labels={"type": "track_status"})
            try:
                ok = await asyncio.wait_for(conn.track_status(ns, name), self._timeout)
            except RequestRejected as exc:
                last = RequestFailed(exc.code, exc.reason, exc.retry_interval)
                if exc.code == RequestErrorCode.DOES_NOT_EXIST:
                    continue
                raise last from None
            except TimeoutError:
                raise RequestFailed(
                    RequestErrorCode.TIMEOUT, f"no TRACK_STATUS answer from {src.name}"
                ) from None
            except ConnectionClosed:
                continue
            lo = ok.parameters.largest_object
            return TrackStatus(None if lo is None else (lo.group, lo.object), False, ok.track_properties)
        raise last or RequestFailed(RequestErrorCode.DOES_NOT_EXIST, "track not found upstream")


def forward_parameters() -> MessageParameters:
    """Upstream SUBSCRIBE parameters: Forward=1 whatever the downstream asked (draft: Forward Handling)."""
    return MessageParameters(forward=1)
