"""The session's configuration and its seam to QUIC.

Owns: ``SessionConfig`` (limits and SETUP options), ``StreamIdAllocator`` (where new stream ids come
from) and the ``Transmit`` records ``MoqtSession.transmit`` hands the glue. Knows nothing of the session's
state; ``proto.session`` re-exports every name here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypeAlias

from .messages import (
    MAX_MESSAGE_LENGTH,
    AuthToken,
)

# -- configuration and transport seam -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SessionConfig:
    """Settings of one session: our SETUP options and the limits we enforce on the peer."""

    is_client: bool
    """True on the endpoint that opened the QUIC connection (even Request IDs, client stream ids)."""
    path: str | None = None
    """PATH Setup Option (client only, native QUIC): path-abempty [ "?" query ] of the MoQT URI."""
    authority: str | None = None
    """AUTHORITY Setup Option (client only, native QUIC): authority of the MoQT URI."""
    authorization_tokens: tuple[AuthToken, ...] = ()
    """AUTHORIZATION TOKEN Setup Options to send."""
    max_auth_token_cache_size: int | None = None
    """MAX_AUTH_TOKEN_CACHE_SIZE to announce (None: omit, which means 0)."""
    implementation: bytes | None = b"kvnet-proto/0.1"
    """MOQT_IMPLEMENTATION to announce (None: omit)."""
    max_requests_in_flight: int = 256
    """Peer-initiated requests open at once; more are refused with REQUEST_ERROR EXCESSIVE_LOAD."""
    excessive_load_retry_interval: int = 1001
    """Retry Interval (ms + 1) sent with those EXCESSIVE_LOAD refusals."""
    max_control_message_size: int = MAX_MESSAGE_LENGTH
    """Largest control message payload accepted; larger closes the session (INTERNAL_ERROR)."""
    max_buffered_bytes_per_stream: int = 1 << 20
    """Bytes held for a stream we cannot process yet (before SETUP, unknown Track Alias)."""
    max_object_size: int = 64 << 20
    """Largest object payload accepted; a larger one gets its stream stopped with EXCESSIVE_LOAD."""
    object_size_limits: Mapping[tuple[int, int], int] = field(default_factory=dict)
    """Smaller limits than ``max_object_size`` for the objects at these (Group ID, Object ID) locations
    of every track (an application whose object 0 is a small header sets its bound here), enforced the
    same way as the length arrives."""
    max_data_streams: int = 1024
    """Incoming data streams open at once; more are stopped with EXCESSIVE_LOAD."""
    max_retired_aliases: int = 1024
    """Ended subscriptions remembered so late objects for them are dropped quietly."""
    max_out_of_order_request_ids: int = 4096
    """Peer Request IDs remembered above the lowest unseen one (for duplicate detection)."""
    request_header_timeout: float | None = None
    """Seconds a peer has, from the first byte on a new request stream, to complete the stream's first
    control message (slowloris defence). Late: the stream is reset and stopped with DELIVERY_TIMEOUT.
    None: no deadline. When set, ``receive_stream_data`` needs ``now`` and the glue runs ``get_timer``."""
    max_request_header_timeouts: int = 3
    """Request streams of one session that may hit ``request_header_timeout``; the next one closes the
    session with CONTROL_MESSAGE_TIMEOUT."""

    def __post_init__(self) -> None:
        if not self.is_client and (self.path is not None or self.authority is not None):
            raise ValueError("path/authority: PATH and AUTHORITY are client-only setup options")
        positive = (
            "max_requests_in_flight",
            "max_buffered_bytes_per_stream",
            "max_object_size",
            "max_data_streams",
            "max_retired_aliases",
            "max_out_of_order_request_ids",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if any(limit < 0 for limit in self.object_size_limits.values()):
            raise ValueError("object_size_limits must not be negative")
        if not 1 <= self.max_control_message_size <= MAX_MESSAGE_LENGTH:
            raise ValueError(f"max_control_message_size must be within 1..{MAX_MESSAGE_LENGTH}")
        if self.excessive_load_retry_interval < 0:
            raise ValueError("excessive_load_retry_interval must not be negative")
        if self.max_auth_token_cache_size is not None and self.max_auth_token_cache_size < 0:
            raise ValueError("max_auth_token_cache_size must not be negative")
        if self.request_header_timeout is not None and not self.request_header_timeout > 0:
            raise ValueError("request_header_timeout must be positive (or None)")
        if self.max_request_header_timeouts < 0:
            raise ValueError("max_request_header_timeouts must not be negative")


class StreamIdAllocator(Protocol):
    """Where new stream ids come from; aioquic's ``QuicConnection`` satisfies this as is."""

    def get_next_available_stream_id(self, is_unidirectional: bool = False) -> int: ...


@dataclass(frozen=True, slots=True)
class SendStreamData:
    """Write ``data`` on ``stream_id`` (opening it if new); ``end_stream`` sends the FIN."""

    stream_id: int
    data: bytes
    end_stream: bool = False


@dataclass(frozen=True, slots=True)
class ResetStream:
    """RESET_STREAM on our sending side of ``stream_id``."""

    stream_id: int
    error_code: int


@dataclass(frozen=True, slots=True)
class StopSending:
    """STOP_SENDING for the peer's sending side of ``stream_id``."""

    stream_id: int
    error_code: int


@dataclass(frozen=True, slots=True)
class SendDatagram:
    """Send one QUIC DATAGRAM."""

    data: bytes


@dataclass(frozen=True, slots=True)
class CloseConnection:
    """Close the QUIC connection with an application error code (section "Termination")."""

    error_code: int
    reason: str


Transmit: TypeAlias = SendStreamData | ResetStream | StopSending | SendDatagram | CloseConnection


