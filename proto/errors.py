"""Error code registries and typed errors of MoQT draft-18.

One IntEnum per IANA registry of the draft (section "Error Codes"). The registries
reuse numbers (INTERNAL_ERROR is 0x1 for sessions but 0x0 for requests and stream
resets), so a code of one enum must never be passed where another is expected.

``ProtocolError`` and its subclasses mean *the peer* broke the protocol: each
carries the Session Termination Error Code to close the session with. They are
raised by decoders and the session and caught once where bytes enter.
``UsageError`` means *local* API misuse and never goes on the wire.
"""

from __future__ import annotations

from enum import IntEnum
from typing import ClassVar

__all__ = [
    "AuthTokenCacheOverflow",
    "ControlMessageTimeout",
    "DataStreamTimeout",
    "DuplicateAuthTokenAlias",
    "DuplicateTrackAlias",
    "ExpiredAuthToken",
    "GoawayTimeout",
    "InternalError",
    "InvalidAuthority",
    "InvalidPath",
    "InvalidRequestId",
    "KeyValueFormattingError",
    "LimitExceeded",
    "MalformedAuthToken",
    "MalformedAuthority",
    "MalformedPath",
    "ProtocolError",
    "ProtocolViolation",
    "PublishDoneCode",
    "RequestErrorCode",
    "RequestRefusal",
    "SessionErrorCode",
    "StreamResetCode",
    "StreamTruncated",
    "TooManyRequests",
    "Unauthorized",
    "UnknownAuthTokenAlias",
    "UsageError",
    "VersionNegotiationFailed",
    "is_grease",
]


class SessionErrorCode(IntEnum):
    """Session Termination Error Codes (sections "Termination" and "Session Termination Error Codes")."""

    NO_ERROR = 0x0
    INTERNAL_ERROR = 0x1
    UNAUTHORIZED = 0x2
    PROTOCOL_VIOLATION = 0x3
    INVALID_REQUEST_ID = 0x4
    DUPLICATE_TRACK_ALIAS = 0x5
    KEY_VALUE_FORMATTING_ERROR = 0x6
    INVALID_PATH = 0x8
    MALFORMED_PATH = 0x9
    GOAWAY_TIMEOUT = 0x10
    CONTROL_MESSAGE_TIMEOUT = 0x11
    DATA_STREAM_TIMEOUT = 0x12
    AUTH_TOKEN_CACHE_OVERFLOW = 0x13
    DUPLICATE_AUTH_TOKEN_ALIAS = 0x14
    VERSION_NEGOTIATION_FAILED = 0x15
    MALFORMED_AUTH_TOKEN = 0x16
    UNKNOWN_AUTH_TOKEN_ALIAS = 0x17
    EXPIRED_AUTH_TOKEN = 0x18
    INVALID_AUTHORITY = 0x19
    MALFORMED_AUTHORITY = 0x1A


class RequestErrorCode(IntEnum):
    """REQUEST_ERROR Codes (sections "REQUEST_ERROR" and "REQUEST_ERROR Codes")."""

    INTERNAL_ERROR = 0x0
    UNAUTHORIZED = 0x1
    TIMEOUT = 0x2
    NOT_SUPPORTED = 0x3
    MALFORMED_AUTH_TOKEN = 0x4
    EXPIRED_AUTH_TOKEN = 0x5
    GOING_AWAY = 0x6
    EXCESSIVE_LOAD = 0x9
    DOES_NOT_EXIST = 0x10
    INVALID_RANGE = 0x11
    MALFORMED_TRACK = 0x12
    DUPLICATE_SUBSCRIPTION = 0x19
    UNINTERESTED = 0x20
    PREFIX_OVERLAP = 0x30
    NAMESPACE_TOO_LARGE = 0x31
    INVALID_JOINING_REQUEST_ID = 0x32
    UNSUPPORTED_EXTENSION = 0x33
    REDIRECT = 0x34


class PublishDoneCode(IntEnum):
    """PUBLISH_DONE Codes (sections "PUBLISH_DONE" and "PUBLISH_DONE Codes")."""

    INTERNAL_ERROR = 0x0
    UNAUTHORIZED = 0x1
    TRACK_ENDED = 0x2
    SUBSCRIPTION_ENDED = 0x3
    GOING_AWAY = 0x4
    TOO_FAR_BEHIND = 0x5
    EXPIRED = 0x6
    UPDATE_FAILED = 0x8
    EXCESSIVE_LOAD = 0x9
    MALFORMED_TRACK = 0x12


class StreamResetCode(IntEnum):
    """Stream Reset Error Codes (section "Stream Reset Error Codes"), for RESET_STREAM/STOP_SENDING."""

    INTERNAL_ERROR = 0x0
    CANCELLED = 0x1
    DELIVERY_TIMEOUT = 0x2
    SESSION_CLOSED = 0x3
    GOING_AWAY = 0x4
    TOO_FAR_BEHIND = 0x5
    UNKNOWN_OBJECT_STATUS = 0x6
    EXPIRED_AUTH_TOKEN = 0x7
    EXCESSIVE_LOAD = 0x9
    MALFORMED_TRACK = 0x12


def is_grease(code: int) -> bool:
    """True for the greasing code points 0x7f * N + 0x9D reserved in every registry (section "Grease")."""
    return code >= 0x9D and (code - 0x9D) % 0x7F == 0


class ProtocolError(Exception):
    """The peer violated the protocol; the session closes with ``error_code`` and ``reason``."""

    error_code: ClassVar[SessionErrorCode] = SessionErrorCode.PROTOCOL_VIOLATION

    def __init__(self, reason: str = "") -> None:
        super().__init__(reason)
        self.reason: str = reason

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.error_code.name}, {self.reason!r})"


class InternalError(ProtocolError):
    """An implementation specific failure while handling peer input."""

    error_code = SessionErrorCode.INTERNAL_ERROR


class LimitExceeded(InternalError):
    """The peer made us cross a local resource limit (buffered bytes, open streams).

    Draft-18 has no session code for this; INTERNAL_ERROR ("implementation specific")
    is used because the peer did not break a rule of the draft.
    """


class TooManyRequests(LimitExceeded):
    """The peer opened more concurrent requests than the configured limit.

    Draft-18 removed MAX_REQUEST_ID; per-request refusal uses REQUEST_ERROR
    EXCESSIVE_LOAD, this is for closing the session when the peer keeps going.
    """


class Unauthorized(ProtocolError):
    """The client is not authorized to establish a session."""

    error_code = SessionErrorCode.UNAUTHORIZED


class ProtocolViolation(ProtocolError):
    """The peer did something the draft disallows (malformed message, bad type, bad length...)."""

    error_code = SessionErrorCode.PROTOCOL_VIOLATION


class StreamTruncated(ProtocolViolation):
    """A stream ended with FIN in the middle of a header or object (section "Streams")."""


class InvalidRequestId(ProtocolError):
    """Request ID with the wrong parity for the sender, or a duplicate (section "Request ID")."""

    error_code = SessionErrorCode.INVALID_REQUEST_ID


class DuplicateTrackAlias(ProtocolError):
    """A Track Alias already in use for another track (section "Track Alias")."""

    error_code = SessionErrorCode.DUPLICATE_TRACK_ALIAS


class KeyValueFormattingError(ProtocolError):
    """A known key-value pair or token whose value does not match its serialization."""

    error_code = SessionErrorCode.KEY_VALUE_FORMATTING_ERROR


class InvalidPath(ProtocolError):
    """PATH used by a server, or a path the server does not support (section "PATH")."""

    error_code = SessionErrorCode.INVALID_PATH


class MalformedPath(ProtocolError):
    """PATH that does not follow the URI rules (section "PATH")."""

    error_code = SessionErrorCode.MALFORMED_PATH


class GoawayTimeout(ProtocolError):
    """The peer did not close in time after GOAWAY."""

    error_code = SessionErrorCode.GOAWAY_TIMEOUT


class ControlMessageTimeout(ProtocolError):
    """The peer took too long to respond to a control message."""

    error_code = SessionErrorCode.CONTROL_MESSAGE_TIMEOUT


class DataStreamTimeout(ProtocolError):
    """The peer took too long to send data expected on an open data stream."""

    error_code = SessionErrorCode.DATA_STREAM_TIMEOUT


class AuthTokenCacheOverflow(ProtocolError):
    """Registered tokens exceed MAX_AUTH_TOKEN_CACHE_SIZE."""

    error_code = SessionErrorCode.AUTH_TOKEN_CACHE_OVERFLOW


class DuplicateAuthTokenAlias(ProtocolError):
    """REGISTER of a token alias that is already registered."""

    error_code = SessionErrorCode.DUPLICATE_AUTH_TOKEN_ALIAS


class VersionNegotiationFailed(ProtocolError):
    """The client did not offer a version the server supports."""

    error_code = SessionErrorCode.VERSION_NEGOTIATION_FAILED


class MalformedAuthToken(ProtocolError):
    """Invalid token serialization during registration."""

    error_code = SessionErrorCode.MALFORMED_AUTH_TOKEN


class UnknownAuthTokenAlias(ProtocolError):
    """A token alias that is not registered."""

    error_code = SessionErrorCode.UNKNOWN_AUTH_TOKEN_ALIAS


class ExpiredAuthToken(ProtocolError):
    """The authorization token has expired."""

    error_code = SessionErrorCode.EXPIRED_AUTH_TOKEN


class InvalidAuthority(ProtocolError):
    """AUTHORITY from a server, or one this server does not serve (section "AUTHORITY")."""

    error_code = SessionErrorCode.INVALID_AUTHORITY


class MalformedAuthority(ProtocolError):
    """AUTHORITY that is syntactically invalid (section "AUTHORITY")."""

    error_code = SessionErrorCode.MALFORMED_AUTHORITY


class RequestRefusal(Exception):
    """A failure that belongs to one request: what to answer it with in REQUEST_ERROR (code, reason, retry
    interval), keeping the session. (``kvnet.net.errors.RequestRejected`` is a peer's REQUEST_ERROR as
    the requester sees it.)"""

    def __init__(self, error_code: RequestErrorCode, reason: str = "", retry_interval: int = 0) -> None:
        super().__init__(reason)
        self.error_code: RequestErrorCode = error_code
        self.reason: str = reason
        self.retry_interval: int = retry_interval


class UsageError(Exception):
    """Local misuse of the API (an invalid value to encode, a call in the wrong state). Never sent."""
