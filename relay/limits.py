"""Resource limits of the relay and the errors raised when one is hit.

Owns: ``LimitsConfig`` (every per-relay and per-session bound in one place) and small counters that
enforce them. Each limit maps to the draft's code for that situation: a request over a limit is answered
with REQUEST_ERROR EXCESSIVE_LOAD (and a Retry Interval), a session over a hard limit (an object larger than
allowed, more buffered bytes than allowed) is closed, other sessions are untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

from proto.errors import RequestErrorCode


@dataclass(frozen=True, slots=True)
class LimitsConfig:
    """Bounds on what peers can make the relay hold."""

    max_sessions: int = 1024
    """Concurrent sessions; the next handshake is refused with EXCESSIVE_LOAD."""
    max_requests_per_session: int = 8192
    """Concurrent requests a peer may have open (FETCH, SUBSCRIBE, TRACK_STATUS, ...)."""
    max_namespaces_per_session: int = 1024
    """PUBLISH_NAMESPACE registrations per publisher session."""
    max_object_bytes: int = 16 * 1024 * 1024
    """Largest object payload accepted from a peer."""
    max_buffered_bytes_per_session: int = 64 * 1024 * 1024
    """Bytes queued toward one peer that it has not yet read (a peer that never reads is cut off here)."""
    max_subscribers_per_track: int = 4096
    """Downstream subscriptions fanned out from one upstream track."""
    upstream_timeout: float = 10.0
    """Seconds to wait for an upstream answer (FETCH_OK, SUBSCRIBE_OK, TRACK_STATUS_OK) before TIMEOUT."""
    setup_timeout: float = 5.0
    """Seconds a new connection has to complete SETUP."""
    retry_interval_ms: int = 100
    """Retry Interval sent with EXCESSIVE_LOAD (draft: milliseconds plus one)."""

    def __post_init__(self) -> None:
        for name in (
            "max_sessions",
            "max_requests_per_session",
            "max_namespaces_per_session",
            "max_object_bytes",
            "max_buffered_bytes_per_session",
            "max_subscribers_per_track",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("upstream_timeout", "setup_timeout"):
            if not 0 < getattr(self, name) <= 3600:
                raise ValueError(f"{name} must be in (0, 3600] seconds, got {getattr(self, name)}")
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
    """A counted resource (sessions, requests of one session)."""

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
