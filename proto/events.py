"""Events a ``MoqtSession`` reports: what the peer did, in the past tense.

Every event is a frozen, slotted dataclass holding wire values only (ints, bytes, tuples and the
frozen message structures of ``proto.messages``), never sockets, futures or session objects, so an
event can be logged, compared in tests and handed across tasks. Request-scoped events carry the
Request ID the application uses to answer or cancel. Error codes are kept as plain ints because the
draft requires unknown (greased) codes to survive; compare them with the enums of ``proto.errors``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .messages import (
    NO_PARAMETERS,
    AuthToken,
    FetchType,
    Location,
    MessageParameters,
    Properties,
    Redirect,
    TrackNamespace,
)

__all__ = [
    "DataStreamStopped",
    "FetchCompleted",
    "FetchOkReceived",
    "FetchRangeReceived",
    "FetchReceived",
    "FetchStreamReset",
    "GoawayReceived",
    "MoqtEvent",
    "NamespaceDoneReceived",
    "NamespaceReceived",
    "ObjectReceived",
    "ObjectVia",
    "PublishBlockedReceived",
    "PublishDoneReceived",
    "PublishNamespaceReceived",
    "PublishOkReceived",
    "PublishReceived",
    "RequestCancelled",
    "RequestErrorReceived",
    "RequestOkReceived",
    "RequestRefused",
    "RequestUpdateReceived",
    "SessionTerminated",
    "SetupCompleted",
    "SubgroupClosed",
    "SubscribeNamespaceReceived",
    "SubscribeOkReceived",
    "SubscribeReceived",
    "SubscribeTracksReceived",
    "TrackStatusOkReceived",
    "TrackStatusReceived",
]

ObjectVia = Literal["subgroup", "fetch", "datagram"]
"""How an object arrived: on a subgroup stream, a fetch stream or in an OBJECT_DATAGRAM."""


class MoqtEvent:
    """Base class of all session events."""

    __slots__ = ()


# -- session ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SetupCompleted(MoqtEvent):
    """Both SETUP messages have been exchanged; requests may now flow both ways."""

    path: str | None
    """PATH Setup Option of the peer (clients only)."""
    authority: str | None
    """AUTHORITY Setup Option of the peer (clients only)."""
    authorization_tokens: tuple[AuthToken, ...]
    """AUTHORIZATION TOKEN Setup Options of the peer, in order."""
    max_auth_token_cache_size: int
    """MAX_AUTH_TOKEN_CACHE_SIZE of the peer (0 when absent, the draft's default)."""
    implementation: bytes | None
    """MOQT_IMPLEMENTATION of the peer, as sent."""
    unknown_options: Properties
    """Setup Options this implementation does not know (the draft says to ignore them)."""


@dataclass(frozen=True, slots=True)
class GoawayReceived(MoqtEvent):
    """The peer sent GOAWAY: on the control stream (``request_id`` of the request is None) or on
    one request stream (then ``request_id`` names that request)."""

    new_session_uri: bytes
    """Where to reconnect; empty means reuse the current URI."""
    timeout: int
    """Milliseconds the peer waits before closing (0: no specific timeout)."""
    last_request_id: int | None
    """Control-stream GOAWAY: the smallest of our Request IDs the peer did not (or may not) process."""
    request_id: int | None = None
    """Request-stream GOAWAY: the request to migrate; None for the control stream."""


@dataclass(frozen=True, slots=True)
class SessionTerminated(MoqtEvent):
    """The session is over; nothing more will be sent or received."""

    error_code: int
    """Session Termination Error Code (SessionErrorCode value, or an unknown code from the peer)."""
    reason: str
    """Reason phrase."""
    by_peer: bool
    """True when the peer (or the transport) ended the session, False when we closed it."""


# -- requests received (we are the responder) ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class SubscribeReceived(MoqtEvent):
    """The peer sent SUBSCRIBE; answer with accept_subscribe or reject_request."""

    request_id: int
    """Request ID of the SUBSCRIBE."""
    track_namespace: TrackNamespace
    """Track Namespace."""
    track_name: bytes
    """Track Name."""
    parameters: MessageParameters = NO_PARAMETERS
    """Message Parameters of the SUBSCRIBE."""


@dataclass(frozen=True, slots=True)
class FetchReceived(MoqtEvent):
    """The peer sent FETCH; answer with accept_fetch (and fetch objects) or reject_request."""

    request_id: int
    """Request ID of the FETCH."""
    fetch_type: FetchType
    """Standalone, relative joining or absolute joining."""
    track_namespace: TrackNamespace | None
    """Track Namespace (standalone fetches; None for joining fetches)."""
    track_name: bytes | None
    """Track Name (standalone fetches; None for joining fetches)."""
    start: Location | None
    """Start Location (standalone fetches)."""
    end: Location | None
    """End Location, the last Object plus 1 or {G, 0} for all of group G (standalone fetches)."""
    joining_request_id: int | None
    """Request ID of the joined subscription (joining fetches)."""
    joining_start: int | None
    """Joining Start, relative or absolute per ``fetch_type`` (joining fetches)."""
    parameters: MessageParameters = NO_PARAMETERS
    """Message Parameters of the FETCH."""


@dataclass(frozen=True, slots=True)
class TrackStatusReceived(MoqtEvent):
    """The peer sent TRACK_STATUS; answer with respond_track_status or reject_request."""

    request_id: int
    """Request ID of the TRACK_STATUS."""
    track_namespace: TrackNamespace
    """Track Namespace."""
    track_name: bytes
    """Track Name."""
    parameters: MessageParameters = NO_PARAMETERS
    """Message Parameters of the TRACK_STATUS."""


@dataclass(frozen=True, slots=True)
class PublishNamespaceReceived(MoqtEvent):
    """The peer sent PUBLISH_NAMESPACE; answer with accept_request or reject_request."""

    request_id: int
    """Request ID of the PUBLISH_NAMESPACE."""
    track_namespace: TrackNamespace
    """The namespace the peer publishes."""
    parameters: MessageParameters = NO_PARAMETERS
    """Message Parameters of the PUBLISH_NAMESPACE."""


@dataclass(frozen=True, slots=True)
class SubscribeNamespaceReceived(MoqtEvent):
    """The peer sent SUBSCRIBE_NAMESPACE; answer with accept_request then namespace/namespace_done."""

    request_id: int
    """Request ID of the SUBSCRIBE_NAMESPACE."""
    track_namespace_prefix: TrackNamespace
    """Prefix the peer wants NAMESPACE messages for."""
    parameters: MessageParameters = NO_PARAMETERS
    """Message Parameters of the SUBSCRIBE_NAMESPACE."""


@dataclass(frozen=True, slots=True)
class SubscribeTracksReceived(MoqtEvent):
    """The peer sent SUBSCRIBE_TRACKS; answer with accept_request or reject_request."""

    request_id: int
    """Request ID of the SUBSCRIBE_TRACKS."""
    track_namespace_prefix: TrackNamespace
    """Prefix the peer wants PUBLISH messages for."""
    parameters: MessageParameters = NO_PARAMETERS
    """Message Parameters of the SUBSCRIBE_TRACKS."""


@dataclass(frozen=True, slots=True)
class PublishReceived(MoqtEvent):
    """The peer sent PUBLISH; answer with accept_publish or reject_request."""

    request_id: int
    """Request ID of the PUBLISH."""
    track_namespace: TrackNamespace
    """Track Namespace."""
    track_name: bytes
    """Track Name."""
    track_alias: int
    """Track Alias the peer will use in data streams and datagrams of this track."""
    parameters: MessageParameters = NO_PARAMETERS
    """Message Parameters of the PUBLISH."""
    track_properties: Properties = ()
    """Track Properties."""


@dataclass(frozen=True, slots=True)
class RequestUpdateReceived(MoqtEvent):
    """The peer sent REQUEST_UPDATE for an existing request; answer with accept_request or
    reject_request using ``request_id`` (the update's own Request ID)."""

    request_id: int
    """Request ID of the REQUEST_UPDATE itself."""
    existing_request_id: int
    """Request ID of the request being updated."""
    parameters: MessageParameters = NO_PARAMETERS
    """The changed Message Parameters."""


# -- responses received (we are the requester) --------------------------------------------------


@dataclass(frozen=True, slots=True)
class SubscribeOkReceived(MoqtEvent):
    """The peer accepted our SUBSCRIBE."""

    request_id: int
    """Request ID of our SUBSCRIBE."""
    track_alias: int
    """Track Alias of the subscribed track in data streams and datagrams."""
    parameters: MessageParameters = NO_PARAMETERS
    """Message Parameters (EXPIRES, LARGEST_OBJECT)."""
    track_properties: Properties = ()
    """Track Properties."""


@dataclass(frozen=True, slots=True)
class FetchOkReceived(MoqtEvent):
    """The peer accepted our FETCH."""

    request_id: int
    """Request ID of our FETCH."""
    end_of_track: bool
    """True when End Location is the final Object of the track."""
    end_location: Location
    """End of the range the response covers (last Object plus 1, or {G, 0})."""
    parameters: MessageParameters = NO_PARAMETERS
    """Message Parameters."""
    track_properties: Properties = ()
    """Track Properties."""


@dataclass(frozen=True, slots=True)
class TrackStatusOkReceived(MoqtEvent):
    """The peer answered our TRACK_STATUS with REQUEST_OK (TRACK_STATUS_OK)."""

    request_id: int
    """Request ID of our TRACK_STATUS."""
    parameters: MessageParameters = NO_PARAMETERS
    """Message Parameters (LARGEST_OBJECT when objects exist, EXPIRES)."""
    track_properties: Properties = ()
    """Track Properties."""


@dataclass(frozen=True, slots=True)
class PublishOkReceived(MoqtEvent):
    """The peer accepted our PUBLISH (PUBLISH_OK, sent as REQUEST_OK or as message 0x1E)."""

    request_id: int
    """Request ID of our PUBLISH."""
    parameters: MessageParameters = NO_PARAMETERS
    """Message Parameters (FORWARD, SUBSCRIBER_PRIORITY, filter, ...)."""


@dataclass(frozen=True, slots=True)
class RequestOkReceived(MoqtEvent):
    """REQUEST_OK for a PUBLISH_NAMESPACE, SUBSCRIBE_NAMESPACE, SUBSCRIBE_TRACKS or a REQUEST_UPDATE."""

    request_id: int
    """Request ID answered: the original request, or the REQUEST_UPDATE's own Request ID."""
    parameters: MessageParameters = NO_PARAMETERS
    """Message Parameters."""


@dataclass(frozen=True, slots=True)
class RequestErrorReceived(MoqtEvent):
    """The peer rejected a request (or a REQUEST_UPDATE) with REQUEST_ERROR."""

    request_id: int
    """Request ID answered: the original request, or the REQUEST_UPDATE's own Request ID."""
    error_code: int
    """REQUEST_ERROR code (RequestErrorCode value, or unknown: treat as INTERNAL_ERROR)."""
    reason: str
    """Error Reason."""
    retry_interval: int = 0
    """Minimum milliseconds before retrying, plus one; 0 means do not retry."""
    redirect: Redirect | None = None
    """Where to retry, present iff the code is REDIRECT."""


@dataclass(frozen=True, slots=True)
class PublishDoneReceived(MoqtEvent):
    """The publisher ended a subscription with PUBLISH_DONE; late objects may still arrive."""

    request_id: int
    """Request ID of the SUBSCRIBE or PUBLISH that established the subscription."""
    status_code: int
    """PUBLISH_DONE status (PublishDoneCode value, or unknown: treat as INTERNAL_ERROR)."""
    stream_count: int
    """Number of data streams the publisher opened for the subscription (2^62-1: unknown)."""
    reason: str
    """Error Reason."""


@dataclass(frozen=True, slots=True)
class NamespaceReceived(MoqtEvent):
    """NAMESPACE on one of our SUBSCRIBE_NAMESPACE streams."""

    request_id: int
    """Request ID of our SUBSCRIBE_NAMESPACE."""
    track_namespace_suffix: TrackNamespace
    """Namespace fields after the subscribed prefix."""


@dataclass(frozen=True, slots=True)
class NamespaceDoneReceived(MoqtEvent):
    """NAMESPACE_DONE on one of our SUBSCRIBE_NAMESPACE streams."""

    request_id: int
    """Request ID of our SUBSCRIBE_NAMESPACE."""
    track_namespace_suffix: TrackNamespace
    """Namespace fields after the subscribed prefix."""


@dataclass(frozen=True, slots=True)
class PublishBlockedReceived(MoqtEvent):
    """PUBLISH_BLOCKED on one of our SUBSCRIBE_TRACKS streams: subscribe to that track instead."""

    request_id: int
    """Request ID of our SUBSCRIBE_TRACKS."""
    track_namespace_suffix: TrackNamespace
    """Namespace fields after the subscribed prefix."""
    track_name: bytes
    """Track Name."""


@dataclass(frozen=True, slots=True)
class RequestCancelled(MoqtEvent):
    """The peer ended a request stream early: RESET_STREAM, STOP_SENDING, or a FIN that ends the
    request (SUBSCRIBE_NAMESPACE, SUBSCRIBE_TRACKS, PUBLISH_NAMESPACE, an accepted SUBSCRIBE)."""

    request_id: int
    """Request ID of the cancelled request."""
    error_code: int | None
    """Stream Reset Error Code (StreamResetCode value or unknown), None for a FIN."""


@dataclass(frozen=True, slots=True)
class RequestRefused(MoqtEvent):
    """The session answered a peer request with REQUEST_ERROR itself, without reporting the request:
    over ``SessionConfig.max_requests_in_flight`` (EXCESSIVE_LOAD) or after GOAWAY (GOING_AWAY). For
    counting; there is nothing to answer."""

    request_id: int
    error_code: int
    """Request Error Code sent."""
    reason: str


# -- objects ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ObjectReceived(MoqtEvent):
    """One complete Object (or an object status) from a subgroup stream, a fetch stream or a datagram."""

    request_id: int
    """Request ID of the subscription (SUBSCRIBE or PUBLISH) or of the FETCH it belongs to."""
    track_alias: int | None
    """Track Alias (subgroups and datagrams; None for fetch objects)."""
    group_id: int
    """Group ID."""
    subgroup_id: int | None
    """Subgroup ID (None for datagrams and for fetched objects sent as datagrams)."""
    object_id: int
    """Object ID."""
    publisher_priority: int | None
    """Publisher Priority (None when inherited from the subscription: DEFAULT_PRIORITY)."""
    status: int
    """Object Status: 0 normal, 0x3 end of group, 0x4 end of track."""
    properties: Properties
    """Object Properties."""
    payload: bytes
    """Object Payload (empty for a status object)."""
    via: ObjectVia
    """Transport the object came on."""
    stream_id: int | None = None
    """QUIC stream it arrived on (None for datagrams)."""
    end_of_group: bool = False
    """Datagrams only: the END_OF_GROUP bit (no larger Object ID in this group)."""
    first_object: bool = False
    """Subgroups only: the first object on its stream, whose header has the FIRST_OBJECT bit: the first
    object the original publisher sent in the subgroup (a relay forwarding it sets the bit too)."""


@dataclass(frozen=True, slots=True)
class FetchRangeReceived(MoqtEvent):
    """An End of Range marker on a fetch stream: the objects after the previous one, up to and
    including {group_id, object_id}, do not exist (``unknown`` False) or have unknown status."""

    request_id: int
    """Request ID of our FETCH."""
    group_id: int
    """Group ID of the last Location in the range."""
    object_id: int
    """Object ID of the last Location in the range."""
    unknown: bool
    """True for End of Unknown Range (0x10C), False for End of Non-Existent Range (0x8C)."""


@dataclass(frozen=True, slots=True)
class DataStreamStopped(MoqtEvent):
    """The peer sent STOP_SENDING for one of our subgroup or fetch streams; it has been reset and
    further objects for it are dropped (close_subgroup still releases it)."""

    request_id: int
    """Request ID of the subscription or FETCH the stream serves."""
    stream_id: int
    """QUIC stream id."""
    error_code: int
    """Stream Reset Error Code from the STOP_SENDING."""


@dataclass(frozen=True, slots=True)
class FetchCompleted(MoqtEvent):
    """The fetch data stream ended with FIN: every object of the response has been delivered."""

    request_id: int
    """Request ID of our FETCH."""


@dataclass(frozen=True, slots=True)
class FetchStreamReset(MoqtEvent):
    """The fetch data stream was reset before FIN; objects after the last one received are missing."""

    request_id: int
    """Request ID of our FETCH."""
    error_code: int
    """Stream Reset Error Code (StreamResetCode value or unknown)."""
    reason: str = ""
    """Why this side stopped reading the stream (STOP_SENDING), e.g. an object over a size limit; empty
    when the peer reset it."""


@dataclass(frozen=True, slots=True)
class SubgroupClosed(MoqtEvent):
    """A subgroup data stream ended: with FIN (``error_code`` None: all objects delivered) or reset."""

    request_id: int
    """Request ID of the subscription."""
    track_alias: int
    """Track Alias of the stream."""
    group_id: int
    """Group ID of the subgroup."""
    subgroup_id: int | None
    """Subgroup ID (None if the stream ended before its first object fixed it)."""
    stream_id: int
    """QUIC stream id."""
    error_code: int | None
    """Stream Reset Error Code when reset (or the code we used to abandon it), None for FIN."""
