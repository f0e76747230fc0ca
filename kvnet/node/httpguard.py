"""Connection limits and read deadlines of the node's HTTP server: uvicorn's h11 protocol with a shared
``ConnectionGuard`` (``guarded_protocol``).

uvicorn's own settings do what they can and are used as they are: ``timeout_keep_alive`` closes a connection
idle after a response, ``h11_max_incomplete_event_size`` bounds a request head. What they lack is added here:

- the idle deadline also holds for a new connection that sends nothing (uvicorn arms it only after a
  response);
- a request head must be complete within ``head_timeout_s`` of its first byte (a slow head is answered 408);
- the connection cap cannot be held by idle or slow sockets. ``max_connections`` connections are *served*;
  up to ``max_overflow_connections`` more are accepted only so that their requests get an answer. A
  complete request head on an overflow connection takes the place of the served connection idle the longest
  (that one is answered 503 with ``Retry-After`` and closed, as if it had asked); when every served
  connection has a request in progress, a probe (``/health``, ``/ready``, ``/metrics``) is still answered and
  anything else gets 503 with ``Retry-After``. Past both bounds a new connection is answered 503 at once
  without being read, and past ``max_overflow_connections`` such answers still draining it is reset.

The body deadline and the admission queue are the API's (``kvnet.node.httpapi``): they need the request.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any, ClassVar

from uvicorn._types import ASGIReceiveCallable, ASGISendCallable, Scope
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

logger = logging.getLogger(__name__)

PROBE_PATHS = frozenset({"/health", "/ready", "/metrics"})
"""Answered on any accepted connection, however busy the server is."""
RETRY_AFTER_S = 1
LINGER_S = 2.0
"""How long a connection answered early (evicted, refused, timed out) may take to read that answer before
it is reset: its request may still be arriving, and closing with unread bytes would reset it at once."""


@dataclass(frozen=True)
class HttpLimits:
    """Connection bounds and deadlines of the HTTP server."""

    max_connections: int = 64
    """Connections served at once (a request in progress or idle between requests)."""
    max_overflow_connections: int = 512
    """Connections accepted past ``max_connections`` only to answer them (a probe, or 503)."""
    idle_timeout_s: int = 5
    """A connection with no request for this long is closed (uvicorn's ``timeout_keep_alive``)."""
    head_timeout_s: float = 10.0
    """From a request's first byte to its complete head."""

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError(f"--max-connections must be at least 1, got {self.max_connections}")
        if self.max_overflow_connections < 0 or self.idle_timeout_s <= 0 or self.head_timeout_s <= 0:
            raise ValueError("HTTP limits: overflow must be >= 0 and timeouts positive")


@dataclass
class ConnectionStats:
    """What the guard did (read by the node's metrics at scrape time)."""

    open: int = 0
    """Connections open now (served and overflow)."""
    evicted: int = 0
    """Idle connections closed (answered 503) to make room for a request."""
    refused: int = 0
    """Requests answered 503 because every served connection had a request in progress."""
    turned_away: int = 0
    """Connections answered 503 on arrival, unread: past both connection bounds."""
    reset: int = 0
    """Connections reset on arrival: past both bounds with too many answers still draining."""
    head_timeouts: int = 0
    """Connections whose request head did not arrive in time (answered 408)."""


def raw_response(status: int, reason: str, message: str, retry_after: int | None = None) -> bytes:
    """A whole HTTP/1.1 response with the API's one-line JSON error, ending the connection."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}).encode()
    head = [f"HTTP/1.1 {status} {reason}", "content-type: application/json", f"content-length: {len(body)}",
            "connection: close"]
    if retry_after is not None:
        head.append(f"retry-after: {retry_after}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class ConnectionGuard:
    """The connections of one server, split into served and overflow, and the choice of which to close."""

    def __init__(self, limits: HttpLimits) -> None:
        self.limits = limits
        self.stats = ConnectionStats()
        self._served: set[GuardedH11Protocol] = set()
        self._overflow: set[GuardedH11Protocol] = set()
        self._draining: set[GuardedH11Protocol] = set()
        """Connections answered early, waiting for their client to read the answer and close."""

    def opened(self, conn: GuardedH11Protocol) -> None:
        """Place a new connection: served, overflow, answered 503 at once or reset."""
        if len(self._served) < self.limits.max_connections:
            self._served.add(conn)
        elif len(self._overflow) < self.limits.max_overflow_connections:
            self._overflow.add(conn)
            conn.overflow = True
        elif len(self._draining) < self.limits.max_overflow_connections:
            self.stats.turned_away += 1
            conn.answer_and_close(raw_response(
                503, "Service Unavailable", "busy: too many connections; retry later", RETRY_AFTER_S
            ))
            return
        else:
            self.stats.reset += 1
            conn.transport.abort()
            return
        self.stats.open += 1

    def closed(self, conn: GuardedH11Protocol) -> None:
        """``conn`` is gone, or answered early and draining."""
        if conn in self._served or conn in self._overflow:
            self._served.discard(conn)
            self._overflow.discard(conn)
            self.stats.open -= 1

    def draining(self, conn: GuardedH11Protocol, now: bool) -> None:
        (self._draining.add if now else self._draining.discard)(conn)

    def take_slot(self, conn: GuardedH11Protocol) -> bool:
        """An overflow connection has a request: make it a served one, closing the served connection idle
        the longest if there is no room; False when every served connection is busy."""
        if len(self._served) >= self.limits.max_connections:
            idle = [c for c in self._served if c.idle_since is not None]
            if not idle:
                return False
            victim = min(idle, key=lambda c: c.idle_since or 0.0)
            self.stats.evicted += 1
            victim.answer_and_close(raw_response(
                503, "Service Unavailable", "busy: this idle connection was closed to serve another; retry",
                RETRY_AFTER_S,
            ))
        self._overflow.discard(conn)
        self._served.add(conn)
        conn.overflow = False
        return True


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol under a ``ConnectionGuard`` (the class attribute ``guarded_protocol`` sets)."""

    guard: ClassVar[ConnectionGuard]

    def __init__(
        self, config: Config, server_state: ServerState, app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._inner_app = self.app
        self.app = self._guarded_app
        self.overflow = False
        self.idle_since: float | None = None
        """Loop time since which no request is in progress; None while one is."""
        self._head_timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None
        self._answered = False
        """Answered outside h11 and closing: whatever the client still sends is dropped."""

    # -- asyncio.Protocol ----------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.guard.opened(self)
        if self._answered or transport.is_closing():
            return
        self.idle_since = self.loop.time()
        # A new connection gets the same idle deadline uvicorn gives one after a response.
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.closed(self)
        self.guard.draining(self, False)
        self._cancel_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._answered:
            return
        super().data_received(data)
        if self._in_request():
            self.idle_since = None
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
        elif self._head_timer is None and not self.transport.is_closing():
            self._head_timer = self.loop.call_later(self.guard.limits.head_timeout_s, self._head_too_slow)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self._in_request():  # (a pipelined request may have started already)
            self.idle_since = self.loop.time()

    # -- the guard ------------------------------------------------------------------------------------

    def _in_request(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if self._in_request() or self.transport.is_closing():
            return
        self.guard.stats.head_timeouts += 1
        limit = self.guard.limits.head_timeout_s
        logger.info("http %s: request head not complete within %g s; closed", _peer(self.client), limit)
        message = f"request head not complete within {limit:g} s"
        self.answer_and_close(raw_response(408, "Request Timeout", message))

    def answer_and_close(self, response: bytes) -> None:
        """Answer an idle connection outside h11; close it once the client read it (or after ``LINGER_S``)."""
        self._answered = True
        self.idle_since = None
        self.guard.closed(self)
        self._cancel_timers()
        if self.transport.is_closing():
            return
        self.guard.draining(self, True)
        self.transport.write(response)
        if self.transport.can_write_eof():
            self.transport.write_eof()  # the client reads the answer, then its EOF closes us
        self._linger_timer = self.loop.call_later(LINGER_S, self.transport.abort)

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._linger_timer, self.timeout_keep_alive_task):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._linger_timer = self.timeout_keep_alive_task = None

    async def _guarded_app(self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        if not self.overflow or self.guard.take_slot(self):
            await self._inner_app(scope, receive, send)
            return
        if self.cycle is not None:
            self.cycle.keep_alive = False  # an overflow connection answers once
        if scope["type"] == "http" and scope["path"] in PROBE_PATHS:
            await self._inner_app(scope, receive, send)
            return
        self.guard.stats.refused += 1
        await _drain_body(receive)
        message = (f"busy: all {self.guard.limits.max_connections} connections have a request in progress; "
                   "retry later")
        body = raw_response(503, "Service Unavailable", message).split(b"\r\n\r\n", 1)[1]
        await send({"type": "http.response.start", "status": 503, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"retry-after", str(RETRY_AFTER_S).encode()), (b"connection", b"close"),
        ]})
        await send({"type": "http.response.body", "body": body, "more_body": False})


async def _drain_body(receive: ASGIReceiveCallable) -> None:
    """Read (and drop) what is left of a refused request's body, briefly, so closing does not reset the
    connection before the client reads the answer."""
    try:
        async with asyncio.timeout(LINGER_S):
            while True:
                message = await receive()
                if message["type"] != "http.request" or not message.get("more_body", False):
                    return
    except TimeoutError:
        return


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "?"


def guarded_protocol(guard: ConnectionGuard) -> type[GuardedH11Protocol]:
    """The protocol class to give uvicorn (``Config(http=...)``) for connections under ``guard``."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"guard": guard})
