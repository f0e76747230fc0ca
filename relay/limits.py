"""Resource limits of the relay and the errors raised when one is hit.

Owns: ``LimitsConfig`` (every per-relay and per-session bound in one place) and small counters that
enforce them. Each limit maps to the draft's code for that situation: a request over a limit is answered
with REQUEST_ERROR EXCESSIVE_LOAD (and a Retry Interval), a session over a hard limit (an object larger than
allowed, more buffered bytes than allowed) is closed, other sessions are untouched.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from proto.errors import RequestErrorCode


@dataclass(frozen=True, slots=True)
class LimitsConfig:
    """Bounds on what peers can make the relay hold."""

    max_sessions: int = 1024
    """Concurrent sessions; the next one is closed with INTERNAL_ERROR ("limit reached: sessions")."""
    max_sessions_per_address: int = 64
    """Concurrent sessions from one source IP address (0 = no quota), so that one host cannot take every
    session slot; the next one is closed with INTERNAL_ERROR ("limit reached: sessions per address")."""
    max_sessions_per_identity: int = 256
    """Concurrent sessions whose SETUP token names one subject (0 = no quota; needs authorization)."""
    max_requests_per_address: int = 16384
    """Concurrent requests of all sessions from one source IP address together (0 = no quota)."""
    max_requests_per_identity: int = 16384
    """Concurrent requests of all sessions of one token subject together (0 = no quota)."""
    max_buffered_bytes_per_address: int = 256 * 1024 * 1024
    """Bytes queued toward all sessions of one source address (0 = no quota); beyond it that address's
    sessions holding the most have their data requests reset (EXCESSIVE_LOAD)."""
    max_buffered_bytes_per_identity: int = 256 * 1024 * 1024
    """Bytes queued toward all sessions of one token subject, wherever they connect from (0 = no quota);
    beyond it that subject's sessions holding the most are cut off as for the per-address quota."""
    pressure_idle_timeout: float = 5.0
    """Under pressure (the session table at least 90 % full) sessions without an open request are closed
    after this many idle seconds (idle as for ``session_idle_timeout``) instead of that timeout; a
    session refused for the session limit first closes the longest-idle such session, from the address
    holding the most, and takes its slot. 0 disables both."""
    max_requests_per_session: int = 8192
    """Concurrent requests a peer may have open (FETCH, SUBSCRIBE, TRACK_STATUS, ...)."""
    max_requests: int = 65536
    """Concurrent requests of all sessions together; beyond it a request gets EXCESSIVE_LOAD unless its
    session holds fewer than ``reserved_requests_per_session`` (so the true bound is
    ``max_requests + max_sessions * reserved_requests_per_session``)."""
    reserved_requests_per_session: int = 4
    """Requests every session may have open whatever the global count, so that sessions flooding the
    relay cannot lock a well-behaved one out."""
    max_namespaces_per_session: int = 1024
    """PUBLISH_NAMESPACE registrations per publisher session."""
    max_object_bytes: int = 16 * 1024 * 1024
    """Largest object payload accepted from a peer."""
    max_buffered_bytes_per_session: int = 64 * 1024 * 1024
    """Bytes queued toward one peer that it has not yet read (a peer that never reads is cut off here)."""
    max_buffered_bytes: int = 1024 * 1024 * 1024
    """Bytes buffered for all sessions together (queued toward peers plus received and not yet
    consumed). Beyond it new FETCH/SUBSCRIBE/PUBLISH get EXCESSIVE_LOAD and the sessions holding the
    most are cut off (their data requests reset) until the total is back under it."""
    max_held_bytes_per_session: int = 256 * 1024 * 1024
    """Bytes of pushed objects held for one publisher session outside the cache: the objects of its
    PUBLISHed tracks that have not ended (kept to serve FETCHes of the live track and to cache it once
    complete) and the copies it contends with (``relay.admission``). Beyond it that session's oldest
    held track is dropped (its objects still flow to live subscribers; it is not cached whole)."""
    max_held_bytes_per_address: int = 512 * 1024 * 1024
    """The same for all sessions of one source address together (0 = no quota): the oldest held track of
    that address's session holding the most is dropped."""
    max_held_bytes_per_identity: int = 512 * 1024 * 1024
    """The same for all sessions of one token subject together (0 = no quota)."""
    max_held_bytes: int = 1024 * 1024 * 1024
    """Bytes of pushed objects held for all sessions together; beyond it the session holding the most
    loses its oldest held track first."""
    max_subscribers_per_track: int = 4096
    """Downstream subscriptions fanned out from one upstream track."""
    upstream_timeout: float = 10.0
    """Seconds to wait for an upstream answer (FETCH_OK, SUBSCRIBE_OK, TRACK_STATUS_OK) before TIMEOUT."""
    upstream_idle_timeout: float = 3.0
    """Seconds without a packet from an upstream relay before its session counts as dead (the QUIC idle
    timeout of our sessions to upstream relays, which send keep-alive PINGs every third of it): a killed or
    restarted upstream is noticed this fast and the next request reconnects or takes another route. The
    sessions peers open to us keep ``transport.idle_timeout``."""
    route_timeout: float = 1.5
    """Seconds one route (an announcing session or an upstream relay) has to answer a forwarded request
    while other routes for it exist; after that the next route is asked too (the first answer wins) and
    the slow route is tried last by later requests until it answers again. The last route left gets
    the rest of ``upstream_timeout``. 0 disables (routes are asked one after another, each with the
    full ``upstream_timeout``)."""
    setup_timeout: float = 5.0
    """Seconds a new connection has, from its first packet, to complete the QUIC handshake and SETUP."""
    session_idle_timeout: float = 300.0
    """Seconds a session may hold no open request, complete none and send no stream data (a request the
    relay refused still counts) before it is closed (NO_ERROR, "idle timeout"); 0 disables. Independent
    of the QUIC idle timeout, which PINGs defeat."""
    request_header_timeout: float = 10.0
    """Seconds a peer has to complete the first control message of a request stream it opened; late:
    the stream is reset (DELIVERY_TIMEOUT); 0 disables."""
    max_request_header_timeouts: int = 3
    """Request streams of one session that may time out so; one more closes the session
    (CONTROL_MESSAGE_TIMEOUT)."""
    slow_peer_timeout: float = 10.0
    """Seconds a peer's send buffer may stay non-empty without shrinking before its FETCH and SUBSCRIBE
    data streams are reset (TOO_FAR_BEHIND) and the bytes freed."""
    max_rendezvous_timeout: float = 30.0
    """Longest a SUBSCRIBE's RENDEZVOUS TIMEOUT may hold it waiting for a publisher (seconds); a larger
    requested timeout is cut to this."""
    retry_interval_ms: int = 100
    """Retry Interval sent with EXCESSIVE_LOAD (draft: milliseconds plus one)."""

    def __post_init__(self) -> None:
        for name in (
            "max_sessions",
            "max_requests_per_session",
            "max_requests",
            "max_buffered_bytes",
            "max_namespaces_per_session",
            "max_object_bytes",
            "max_buffered_bytes_per_session",
            "max_subscribers_per_track",
            "max_held_bytes_per_session",
            "max_held_bytes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.3 <= self.upstream_idle_timeout <= 3600:
            raise ValueError(
                f"upstream_idle_timeout must be in [0.3, 3600] seconds, got {self.upstream_idle_timeout}"
            )
        for name in ("upstream_timeout", "setup_timeout", "slow_peer_timeout"):
            if not 0 < getattr(self, name) <= 3600:
                raise ValueError(f"{name} must be in (0, 3600] seconds, got {getattr(self, name)}")
        if not 0 <= self.route_timeout <= self.upstream_timeout:
            raise ValueError(
                f"route_timeout must be in [0, upstream_timeout ({self.upstream_timeout})] s (0 = off), "
                f"got {self.route_timeout}"
            )
        for name in (
            "session_idle_timeout",
            "request_header_timeout",
            "max_rendezvous_timeout",
            "pressure_idle_timeout",
        ):
            if not 0 <= getattr(self, name) <= 86400:
                raise ValueError(f"{name} must be in [0, 86400] seconds (0 = off), got {getattr(self, name)}")
        for name in (
            "reserved_requests_per_session",
            "max_request_header_timeouts",
            "max_sessions_per_address",
            "max_sessions_per_identity",
            "max_requests_per_address",
            "max_requests_per_identity",
            "max_buffered_bytes_per_address",
            "max_buffered_bytes_per_identity",
            "max_held_bytes_per_address",
            "max_held_bytes_per_identity",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.retry_interval_ms <= 3_600_000:
            raise ValueError(f"retry_interval_ms must be in 0..3600000, got {self.retry_interval_ms}")


class LimitExceeded(Exception):
    """A limit was hit; ``code`` is the REQUEST_ERROR code to answer with."""

    def __init__(
        self, what: str, limit: int, code: RequestErrorCode = RequestErrorCode.EXCESSIVE_LOAD
    ) -> None:
        super().__init__(f"limit reached: {what} (max {limit})")
        self.what = what
        self.limit = limit
        self.code = code


class Slots:
    """A counted resource (sessions, requests of one session, requests of all sessions)."""

    def __init__(self, what: str, limit: int) -> None:
        self.what = what
        self.limit = limit
        self.used = 0

    def acquire(self) -> None:
        if self.used >= self.limit:
            raise LimitExceeded(self.what, self.limit)
        self.used += 1

    def release(self) -> None:
        if self.used > 0:
            self.used -= 1


def acquire_request(session: Slots, total: Slots, reserved: int) -> None:
    """Take one request slot of a session and one of the relay-wide pool.

    The session limit always applies. The global one is waived for a session's first ``reserved``
    requests, so a relay saturated by other sessions still serves a session that asks for little.
    """
    session.acquire()
    if total.used >= total.limit and session.used > reserved:
        session.release()
        raise LimitExceeded(total.what, total.limit)
    total.used += 1


class Quota:
    """One limit applied separately to each key (a source address, a token subject); 0 = no quota."""

    def __init__(self, what: str, limit: int) -> None:
        self.what = what
        self.limit = limit
        self.used: dict[str, int] = {}

    def acquire(self, key: str | None) -> None:
        """Count one more for ``key`` (None: not subject to this quota)."""
        if key is None or not self.limit:
            return
        n = self.used.get(key, 0)
        if n >= self.limit:
            raise LimitExceeded(self.what, self.limit)
        self.used[key] = n + 1

    def release(self, key: str | None) -> None:
        if key is None or not self.limit:
            return
        n = self.used.get(key, 0) - 1
        if n > 0:
            self.used[key] = n
        else:
            self.used.pop(key, None)  # keys do not accumulate: an address with nothing open is forgotten


def source_host(peer_address: str) -> str:
    """The IP address of ``host:port`` (IPv6 hosts contain colons; the port is after the last one)."""
    return peer_address.rpartition(":")[0] or peer_address


class HeldBytes:
    """Bytes the relay holds for sessions outside the cache (objects of pushed tracks), counted per
    session, per source address, per token subject and in total, against ``LimitsConfig``'s
    ``max_held_bytes*`` bounds. Only counts; what is dropped when a bound is hit is the relay's choice."""

    def __init__(self, limits: LimitsConfig) -> None:
        self.total = 0
        self.by_session: dict[int, int] = {}
        self.by_address: dict[str, int] = {}
        self.by_identity: dict[str, int] = {}
        self._bounds: tuple[tuple[str, dict[Any, int], int], ...] = (
            ("held_bytes_per_session", self.by_session, limits.max_held_bytes_per_session),
            ("held_bytes_per_address", self.by_address, limits.max_held_bytes_per_address),
            ("held_bytes_per_identity", self.by_identity, limits.max_held_bytes_per_identity),
        )
        self.limit = limits.max_held_bytes

    def exceeded(self, session: int, address: str | None, identity: str | None, n: int) -> str | None:
        """The first bound that ``n`` more bytes of ``session`` would pass (its metric label), or None."""
        for (label, used, limit), key in zip(self._bounds, (session, address, identity), strict=True):
            if key is not None and limit and used.get(key, 0) + n > limit:
                return label
        return "held_bytes_global" if self.total + n > self.limit else None

    def add(self, session: int, address: str | None, identity: str | None, n: int) -> None:
        """Count ``n`` more bytes (negative: fewer) for ``session``; a key left with none is forgotten."""
        self.total += n
        for (_, used, _), key in zip(self._bounds, (session, address, identity), strict=True):
            if key is None:
                continue
            left = used.get(key, 0) + n
            if left > 0:
                used[key] = left
            else:
                used.pop(key, None)


def return_freed_memory() -> None:
    """Hand the pages of freed heap memory back to the system (glibc's ``malloc_trim``). Large payloads
    freed in bulk (a session's held tracks) otherwise stay in the process's heap, counted in its RSS,
    until later allocations reuse them; elsewhere (no glibc) nothing is done."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim: Callable[[int], int] = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    return trim
