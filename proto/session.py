"""The sans-I/O MoQT draft-18 session: bytes in, events out, transmissions out.

``MoqtSession`` sees QUIC only as stream ids, bytes, resets and datagrams. The glue feeds what QUIC
delivered (``receive_stream_data``, ``receive_stream_reset``, ``receive_stop_sending``,
``receive_datagram``, ``connection_lost``), pulls events (``next_event``), writes what
``transmit`` returns and keeps one timer at ``get_timer()`` that calls ``handle_timer(now)`` (time is
always a parameter; the session has no clock). Application actions are method calls that validate the
local state and raise ``UsageError`` on misuse; they never touch the wire directly.

Contract (h11's): peer bytes make no exception escape this class. A ``ProtocolError`` raised anywhere
below a ``receive_*`` method is caught once there and turned into ``close(code, reason)`` plus a
``SessionTerminated`` event; any other exception is a bug. Failures that belong to one request become
REQUEST_ERROR or a stream reset and the session stays up.

What lives here and nowhere else: the setup handshake, request ID rules (section "Request ID"), the
request streams (each with a ``proto.request_state.RequestStateMachine``, whose one table of what each
side of each request kind may send rejects both peer messages and local misuse), track alias
bookkeeping, the mapping of data streams and datagrams back to requests, GOAWAY, and limits (including
the deadline for a request stream's first message, which needs the wire framing).
The role (client/server, publisher/subscriber) is a parameter, never a separate code path.
"""

from __future__ import annotations

import heapq
import logging
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol, TypeAlias

from .data import (
    ControlStreamHeader,
    DataStreamReader,
    FetchEndOfRange,
    FetchHeader,
    FetchObject,
    FetchObjectEncoder,
    ObjectDatagram,
    ObjectStatus,
    PaddingStreamHeader,
    StreamEnd,
    SubgroupHeader,
    SubgroupIdMode,
    SubgroupObject,
    decode_datagram,
    encode_datagram,
    encode_fetch_header,
    encode_subgroup_header,
    subgroup_object_prefix,
)
from .errors import (
    DuplicateTrackAlias,
    InvalidAuthority,
    InvalidPath,
    InvalidRequestId,
    LimitExceeded,
    ProtocolError,
    ProtocolViolation,
    PublishDoneCode,
    RequestErrorCode,
    SessionErrorCode,
    StreamResetCode,
    UsageError,
)
from .events import (
    DataStreamStopped,
    FetchCompleted,
    FetchOkReceived,
    FetchRangeReceived,
    FetchReceived,
    FetchStreamReset,
    GoawayReceived,
    MoqtEvent,
    NamespaceDoneReceived,
    NamespaceReceived,
    ObjectReceived,
    PublishBlockedReceived,
    PublishDoneReceived,
    PublishNamespaceReceived,
    PublishOkReceived,
    PublishReceived,
    RequestCancelled,
    RequestErrorReceived,
    RequestOkReceived,
    RequestRefused,
    RequestUpdateReceived,
    SessionTerminated,
    SetupCompleted,
    SubgroupClosed,
    SubscribeNamespaceReceived,
    SubscribeOkReceived,
    SubscribeReceived,
    SubscribeTracksReceived,
    TrackStatusOkReceived,
    TrackStatusReceived,
)
from .messages import (
    MAX_MESSAGE_LENGTH,
    NO_PARAMETERS,
    AuthToken,
    ControlMessage,
    ControlMessageReader,
    Fetch,
    FetchOk,
    FetchType,
    Goaway,
    GroupOrder,
    JoiningFetch,
    Location,
    MessageParameters,
    Namespace,
    NamespaceDone,
    Properties,
    Publish,
    PublishBlocked,
    PublishDone,
    PublishNamespace,
    PublishOk,
    Redirect,
    RequestError,
    RequestOk,
    RequestUpdate,
    Setup,
    StandaloneFetch,
    Subscribe,
    SubscribeNamespace,
    SubscribeOk,
    SubscribeTracks,
    TrackNamespace,
    TrackStatus,
    encode_message,
)
from .request_state import (
    KIND_NAMES,
    REQUEST_CLASSES,
    RequestState,
    RequestStateMachine,
    RequestTransitionError,
    Side,
)

__all__ = [
    "CloseConnection",
    "MoqtSession",
    "ResetStream",
    "SendDatagram",
    "SendStreamData",
    "SessionConfig",
    "StopSending",
    "StreamIdAllocator",
    "Transmit",
]

logger = logging.getLogger(__name__)

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


# -- request state machine (proto/request_state.py) ---------------------------------------------

_IDLE, _ACCEPTED, _DONE = RequestState.IDLE, RequestState.ACCEPTED, RequestState.DONE
_REQ, _RESP = Side.REQUESTER, Side.RESPONDER

_SUB, _PUB, _FETCH, _TS = Subscribe.TYPE, Publish.TYPE, Fetch.TYPE, TrackStatus.TYPE
_PNS, _SNS, _STR = PublishNamespace.TYPE, SubscribeNamespace.TYPE, SubscribeTracks.TYPE


# -- per-stream bookkeeping ---------------------------------------------------------------------


def _control_reader(config: SessionConfig) -> ControlMessageReader:
    # The session bounds buffered bytes per stream itself (before and after SETUP), so the
    # reader only enforces the message size limit, from the Length field.
    return ControlMessageReader(max_buffer=None, max_message_size=config.max_control_message_size)


@dataclass(eq=False)
class _Request:
    """One request and its bidirectional stream."""

    stream_id: int
    local: bool
    """True when we sent the request (we are the requester)."""
    framer: ControlMessageReader
    request_id: int = -1
    state: RequestStateMachine = field(default_factory=RequestStateMachine)
    """Both sides' states and outstanding REQUEST_UPDATEs; its ``kind`` is the request's type (None until
    the first message)."""
    send_closed: bool = False
    """Our sending side is finished (FIN or reset)."""
    recv_closed: bool = False
    """The peer's sending side is finished and fully processed, or we stopped it."""
    peer_goaway: bool = False
    ended: bool = False
    """The request is over for the application (no more events for it)."""
    counted: bool = False
    """Counts against max_requests_in_flight (peer request that is not auto-rejected)."""
    fin_received: bool = False
    """The peer's FIN arrived (messages before it may still be buffered)."""
    track_alias: int | None = None
    full_track_name: tuple[TrackNamespace, bytes] | None = None
    fetch: Fetch | None = None
    fetch_data_stream: int | None = None
    fetch_data_done: bool = False
    fetch_encoder: FetchObjectEncoder | None = None
    data_streams: set[int] = field(default_factory=set)
    """Publisher side: our open data streams for this request."""
    streams_opened: int = 0
    namespaces: set[TrackNamespace] = field(default_factory=set)
    """SUBSCRIBE_NAMESPACE: suffixes announced by NAMESPACE and not withdrawn yet."""

    @property
    def our_side(self) -> Side:
        return _REQ if self.local else _RESP

    @property
    def peer_side(self) -> Side:
        return _RESP if self.local else _REQ

    @property
    def name(self) -> str:
        return self.state.name


@dataclass(eq=False)
class _SubscribedTrack:
    """Subscriber side: a Track Alias the peer (as publisher) assigned to one of our subscriptions."""

    request_id: int
    full_track_name: tuple[TrackNamespace, bytes]
    active: bool = True
    """False once we cancelled: late objects are dropped, late streams stopped."""
    established: bool = True
    """The subscription is live (not ended by PUBLISH_DONE, REQUEST_ERROR or cancellation)."""


class _DataKind(Enum):
    UNKNOWN = "unknown"
    CONTROL = "control"
    PADDING = "padding"
    SUBGROUP = "subgroup"
    FETCH = "fetch"


@dataclass(eq=False)
class _IncomingStream:
    """A peer-initiated unidirectional stream."""

    stream_id: int
    reader: DataStreamReader
    kind: _DataKind = _DataKind.UNKNOWN
    header: SubgroupHeader | None = None
    request_id: int | None = None
    discarding: bool = False
    """We sent STOP_SENDING (or the stream is over for us): ignore anything further."""
    fin: bool = False
    counted: bool = False


@dataclass(eq=False)
class _OutgoingSubgroup:
    """A subgroup stream we opened."""

    stream_id: int
    header: SubgroupHeader
    request_id: int
    prev_object_id: int | None = None
    closed: bool = False
    stopped: bool = False
    """The peer sent STOP_SENDING: further objects are dropped quietly."""


class _PeerRequestIds:
    """Duplicate and parity checks for the peer's Request IDs (section "Request ID").

    Requests arrive on separate streams, so IDs may come out of order. Every ID below ``floor`` has
    been seen; IDs seen above it are kept in a set that is bounded by forgetting the gap below its
    smallest member (a request whose stream was reset before its first byte never shows up).
    """

    def __init__(self, first: int, max_out_of_order: int) -> None:
        self.floor = first
        self._seen: set[int] = set()
        self._parity = first & 1
        self._max = max_out_of_order

    def check(self, request_id: int) -> None:
        if request_id & 1 != self._parity:
            raise InvalidRequestId(f"Request ID {request_id} has the wrong parity for the peer")
        if request_id < self.floor or request_id in self._seen:
            raise InvalidRequestId(f"duplicate Request ID {request_id}")
        self._seen.add(request_id)
        if len(self._seen) > self._max:
            self.floor = min(self._seen)
        while self.floor in self._seen:
            self._seen.discard(self.floor)
            self.floor += 2


@dataclass(frozen=True, slots=True)
class _Context:
    """What the receive path knows about a message before its handler runs."""

    request: _Request | None
    """The request stream it came on (None: the control stream)."""
    initial_reply: bool = False
    """It is the responder's first reply to the request."""
    answers: int | None = None
    """For a reply to a REQUEST_UPDATE: that update's Request ID."""


_Handler: TypeAlias = Callable[[_Context, ControlMessage], None]


def _is_local(stream_id: int, is_client: bool) -> bool:
    # RFC 9000 section 2.1: bit 0 is the initiator (0 client), bit 1 the direction (1 uni).
    return (stream_id & 1) == (0 if is_client else 1)


def _is_uni(stream_id: int) -> bool:
    return bool(stream_id & 2)


# -- the session --------------------------------------------------------------------------------



class _HandledPeerStreams:
    """Peer stream ids already handled, so that late frames do not resurrect them.

    Frames of different streams may arrive out of order, hence a set rather than a high-water mark; it is
    bounded by forgetting the smallest ids, which a heap finds in O(log n) (taking ``min`` of the set was
    O(n) per new stream: 10% of a publisher's CPU answering a locate's TRACK_STATUS probes).
    """

    __slots__ = ("_heap", "_ids", "_limit")

    def __init__(self, limit: int) -> None:
        self._ids: set[int] = set()
        self._heap: list[int] = []
        self._limit = limit

    def __contains__(self, stream_id: int) -> bool:
        return stream_id in self._ids

    def add(self, stream_id: int) -> None:
        if stream_id in self._ids:
            return
        self._ids.add(stream_id)
        heapq.heappush(self._heap, stream_id)
        if len(self._ids) > self._limit:
            self._ids.discard(heapq.heappop(self._heap))


class MoqtSession:
    """One MoQT session over one QUIC connection, without I/O.

    Call ``initiate()`` once QUIC is connected (both endpoints do: each opens its own control
    stream with SETUP). Feed everything QUIC delivers to the ``receive_*`` methods, then drain
    ``next_event()`` and write ``transmit()``. If any method here raises something other than
    ``UsageError`` (local misuse), that is a bug.
    """

    def __init__(self, config: SessionConfig, streams: StreamIdAllocator) -> None:
        self.config = config
        self._streams = streams
        self._events: deque[MoqtEvent] = deque()
        self._transmits: list[Transmit] = []
        self.closed: tuple[int, str] | None = None
        """(error code, reason) once the session is over, whoever ended it."""
        self._initiated = False
        self._control_stream_id: int | None = None
        self._peer_control: _IncomingStream | None = None
        self._peer_control_framer = _control_reader(config)
        self._peer_setup: Setup | None = None
        self._setup_reported = False
        self._next_local_stream = {False: -1, True: -1}
        self._next_request_id = 0 if config.is_client else 1
        self._peer_ids = _PeerRequestIds(1 if config.is_client else 0, config.max_out_of_order_request_ids)
        self._requests: dict[int, _Request] = {}
        """Request ID -> request, for requests still alive (ours and the peer's)."""
        self._bidi: dict[int, _Request] = {}
        """Stream id -> request, while the bidirectional stream is open in some direction."""
        self._updates: dict[int, _Request] = {}
        """Peer REQUEST_UPDATE Request ID -> request it updates, until we answer it."""
        self._incoming: dict[int, _IncomingStream] = {}
        self._seen_bidi = _HandledPeerStreams(4 * self.config.max_requests_in_flight + 1024)
        self._seen_uni = _HandledPeerStreams(4 * self.config.max_data_streams + 1024)
        self._data_streams_open = 0
        self._peer_requests_open = 0
        self._pending_alias: dict[int, list[_IncomingStream]] = {}
        """Subgroup streams waiting for the SUBSCRIBE_OK / PUBLISH that defines their Track Alias."""
        self._sub_tracks: dict[int, _SubscribedTrack] = {}
        """Subscriber side: Track Alias -> subscription (active ones and recently ended ones)."""
        self._retired_sub_aliases: OrderedDict[int, None] = OrderedDict()
        """Aliases of ended subscriptions in the order they ended, so the oldest are forgotten first."""
        self._pub_aliases: dict[int, int] = {}
        """Publisher side: Track Alias we assigned -> Request ID of the subscription."""
        self._outgoing: dict[int, _OutgoingSubgroup] = {}
        self._goaway_sent = False
        self._goaway_floor: int | None = None
        """Peer Request IDs at or above this are refused with GOING_AWAY (we sent GOAWAY)."""
        self._goaway_received = False
        self._header_deadlines: dict[int, float] = {}
        """Peer request stream id -> when its first control message must be complete. Deadlines are
        added in arrival order with one timeout, so the first entry is always the earliest."""
        self.request_header_timeouts = 0
        """Peer request streams reset because their first control message came too late."""
        self._log = logging.LoggerAdapter(logger, {"role": "client" if config.is_client else "server"})
        self._handlers: dict[int, _Handler] = {
            Setup.TYPE: self._handle_setup,
            Goaway.TYPE: self._handle_goaway,
            Subscribe.TYPE: self._handle_subscribe,
            SubscribeOk.TYPE: self._handle_subscribe_ok,
            Publish.TYPE: self._handle_publish,
            PublishOk.TYPE: self._handle_publish_ok,
            PublishDone.TYPE: self._handle_publish_done,
            Fetch.TYPE: self._handle_fetch,
            FetchOk.TYPE: self._handle_fetch_ok,
            TrackStatus.TYPE: self._handle_track_status,
            PublishNamespace.TYPE: self._handle_publish_namespace,
            SubscribeNamespace.TYPE: self._handle_subscribe_namespace,
            SubscribeTracks.TYPE: self._handle_subscribe_tracks,
            Namespace.TYPE: self._handle_namespace,
            NamespaceDone.TYPE: self._handle_namespace_done,
            PublishBlocked.TYPE: self._handle_publish_blocked,
            RequestUpdate.TYPE: self._handle_request_update,
            RequestOk.TYPE: self._handle_request_ok,
            RequestError.TYPE: self._handle_request_error,
        }

    # -- properties ------------------------------------------------------------------------------

    @property
    def is_client(self) -> bool:
        return self.config.is_client

    @property
    def established(self) -> bool:
        """Our SETUP is queued and the peer's SETUP has arrived."""
        return self._initiated and self._peer_setup is not None and self.closed is None

    @property
    def peer_setup(self) -> Setup | None:
        """The peer's SETUP message, once received."""
        return self._peer_setup

    @property
    def goaway_received(self) -> bool:
        """The peer sent GOAWAY on the control stream: no new requests may be initiated."""
        return self._goaway_received

    def request_is_open(self, request_id: int) -> bool:
        """The request exists and is not over yet: events and actions for it are still possible."""
        req = self._requests.get(request_id)
        return req is not None and not req.ended

    # -- output ----------------------------------------------------------------------------------

    def next_event(self) -> MoqtEvent | None:
        """The next event, or None when there is none."""
        return self._events.popleft() if self._events else None

    def transmit(self) -> list[Transmit]:
        """Everything to hand to QUIC, in order; empties the queue."""
        out, self._transmits = self._transmits, []
        return out

    # -- QUIC in ---------------------------------------------------------------------------------

    def initiate(self) -> None:
        """Open our control stream and queue SETUP (call once, when QUIC is connected)."""
        self._check_open()
        if self._initiated:
            raise UsageError("initiate() was already called")
        cfg = self.config
        setup = Setup(
            path=cfg.path,
            authority=cfg.authority,
            max_auth_token_cache_size=cfg.max_auth_token_cache_size,
            authorization_tokens=cfg.authorization_tokens,
            implementation=cfg.implementation,
        )
        data = encode_message(setup)
        self._control_stream_id = self._allocate_stream(unidirectional=True)
        self._initiated = True
        self._send(self._control_stream_id, data)
        try:
            # The peer's SETUP and requests may already be buffered; handling them is peer input.
            self._after_setup_progress()
        except ProtocolError as exc:
            self._close_on_error(exc)

    def receive_stream_data(
        self, stream_id: int, data: bytes, end_stream: bool, now: float | None = None
    ) -> None:
        """Bytes QUIC delivered on ``stream_id``, in order; ``end_stream`` is the FIN. ``now`` (the
        clock ``handle_timer`` is given) is needed when ``request_header_timeout`` is set."""
        if self.closed is not None:
            return
        try:
            if _is_uni(stream_id):
                self._receive_uni(stream_id, data, end_stream)
            else:
                self._receive_bidi(stream_id, data, end_stream, now)
        except ProtocolError as exc:
            self._close_on_error(exc)

    def receive_stream_reset(self, stream_id: int, error_code: int) -> None:
        """The peer reset its sending side of ``stream_id`` (RESET_STREAM)."""
        if self.closed is not None:
            return
        try:
            self._on_stream_reset(stream_id, error_code)
        except ProtocolError as exc:
            self._close_on_error(exc)

    def receive_stop_sending(self, stream_id: int, error_code: int) -> None:
        """The peer asked us to stop sending on ``stream_id`` (STOP_SENDING); QUIC resets it."""
        if self.closed is not None:
            return
        try:
            self._on_stop_sending(stream_id, error_code)
        except ProtocolError as exc:
            self._close_on_error(exc)

    def receive_datagram(self, data: bytes) -> None:
        """One QUIC DATAGRAM from the peer."""
        if self.closed is not None:
            return
        try:
            self._on_datagram(data)
        except ProtocolError as exc:
            self._close_on_error(exc)

    def connection_lost(self, error_code: int = SessionErrorCode.NO_ERROR, reason: str = "") -> None:
        """The QUIC connection is gone (peer CONNECTION_CLOSE, idle timeout, ...)."""
        if self.closed is not None:
            return
        self.closed = (error_code, reason)
        self._events.append(SessionTerminated(error_code, reason, by_peer=True))
        self._forget_everything()

    # -- time ------------------------------------------------------------------------------------

    def get_timer(self) -> float | None:
        """When ``handle_timer`` must next be called (the clock of ``now``), or None for never."""
        if self.closed is not None or not self._header_deadlines:
            return None
        return next(iter(self._header_deadlines.values()))

    def handle_timer(self, now: float) -> None:
        """Run what is due at ``now``: request streams whose first control message is late are reset
        and stopped with DELIVERY_TIMEOUT; one more than ``max_request_header_timeouts`` closes the
        session with CONTROL_MESSAGE_TIMEOUT."""
        deadlines = self._header_deadlines
        while self.closed is None and deadlines:
            stream_id, deadline = next(iter(deadlines.items()))
            if deadline > now:
                return
            del deadlines[stream_id]
            req = self._bidi.get(stream_id)
            if req is None or req.state.kind is not None or req.framer.has_message():
                continue  # the stream ended or its first message is complete
            self.request_header_timeouts += 1
            if self.request_header_timeouts > self.config.max_request_header_timeouts:
                self._log.warning("closing session: %d request streams without a timely message",
                                  self.request_header_timeouts)
                self.close(
                    SessionErrorCode.CONTROL_MESSAGE_TIMEOUT,
                    "request streams without a complete control message in time",
                )
                return
            self._log.info("request stream %d: no complete control message in time; resetting", stream_id)
            self._refuse_stream(req, StreamResetCode.DELIVERY_TIMEOUT)

    # -- session actions ---------------------------------------------------------------------------

    def close(self, code: SessionErrorCode = SessionErrorCode.NO_ERROR, reason: str = "") -> None:
        """Close the session (CONNECTION_CLOSE with ``code``); a no-op once closed."""
        if self.closed is not None:
            return
        self._log.debug("closing session: %s %s", getattr(code, "name", code), reason)
        self.closed = (code, reason)
        self._transmits.append(CloseConnection(int(code), reason))
        self._events.append(SessionTerminated(int(code), reason, by_peer=False))
        self._forget_everything()

    def goaway(self, new_session_uri: bytes = b"", timeout: int = 0, request_id: int | None = None) -> None:
        """Send GOAWAY (section "GOAWAY"): on the control stream, or on one request's stream.

        After a control-stream GOAWAY, peer requests that were not processed yet (and any new
        one) are refused with REQUEST_ERROR GOING_AWAY, as the draft requires.
        """
        self._check_initiated()
        if new_session_uri and self.is_client:
            raise UsageError("a client sends GOAWAY with an empty New Session URI")
        if request_id is not None:
            req = self._request(request_id)
            if req.send_closed:
                raise UsageError(f"request {request_id} stream is closed")
            self._send(req.stream_id, encode_message(Goaway(new_session_uri, timeout)))
            return
        if self._goaway_sent:
            raise UsageError("GOAWAY was already sent on the control stream")
        floor = self._peer_ids.floor
        assert self._control_stream_id is not None
        self._send(self._control_stream_id, encode_message(Goaway(new_session_uri, timeout, floor)))
        self._goaway_sent = True
        self._goaway_floor = floor

    # -- requests we send --------------------------------------------------------------------------

    def subscribe(
        self,
        track_namespace: TrackNamespace,
        track_name: bytes,
        parameters: MessageParameters = NO_PARAMETERS,
    ) -> int:
        """Send SUBSCRIBE on a new request stream; returns its Request ID."""

        def build(rid: int) -> Subscribe:
            return Subscribe(rid, track_namespace, track_name, parameters)

        req = self._open_request(build)
        req.full_track_name = (track_namespace, track_name)
        return req.request_id

    def fetch(
        self,
        track_namespace: TrackNamespace,
        track_name: bytes,
        start: Location,
        end: Location,
        parameters: MessageParameters = NO_PARAMETERS,
    ) -> int:
        """Send a standalone FETCH for [start, end) (``end`` is the last Object plus 1, or {G, 0})."""
        if _range_end_before(end, start):
            raise UsageError("FETCH End Location is before its Start Location")
        standalone = StandaloneFetch(track_namespace, track_name, start, end)

        def build(rid: int) -> Fetch:
            return Fetch(rid, FetchType.STANDALONE, standalone, None, parameters)

        req = self._open_request(build)
        req.full_track_name = (track_namespace, track_name)
        return req.request_id

    def joining_fetch(
        self,
        joining_request_id: int,
        joining_start: int,
        relative: bool = True,
        parameters: MessageParameters = NO_PARAMETERS,
    ) -> int:
        """Send a relative (or absolute) Joining FETCH for our subscription ``joining_request_id``."""
        sub = self._requests.get(joining_request_id)
        if sub is None or not sub.local or sub.state.kind != _SUB:
            raise UsageError(f"{joining_request_id} is not one of our subscriptions")
        fetch_type = FetchType.RELATIVE_JOINING if relative else FetchType.ABSOLUTE_JOINING
        joining = JoiningFetch(joining_request_id, joining_start)

        def build(rid: int) -> Fetch:
            return Fetch(rid, fetch_type, None, joining, parameters)

        req = self._open_request(build)
        req.full_track_name = sub.full_track_name
        return req.request_id

    def track_status(
        self,
        track_namespace: TrackNamespace,
        track_name: bytes,
        parameters: MessageParameters = NO_PARAMETERS,
    ) -> int:
        """Send TRACK_STATUS; answered by TrackStatusOkReceived or RequestErrorReceived."""

        def build(rid: int) -> TrackStatus:
            return TrackStatus(rid, track_namespace, track_name, parameters)

        req = self._open_request(build)
        req.full_track_name = (track_namespace, track_name)
        return req.request_id

    def publish_namespace(
        self, track_namespace: TrackNamespace, parameters: MessageParameters = NO_PARAMETERS
    ) -> int:
        """Send PUBLISH_NAMESPACE; withdraw it later with cancel_request."""
        return self._open_request(lambda rid: PublishNamespace(rid, track_namespace, parameters)).request_id

    def subscribe_namespace(
        self, track_namespace_prefix: TrackNamespace, parameters: MessageParameters = NO_PARAMETERS
    ) -> int:
        """Send SUBSCRIBE_NAMESPACE; NAMESPACE / NAMESPACE_DONE follow on its stream."""

        def build(rid: int) -> SubscribeNamespace:
            return SubscribeNamespace(rid, track_namespace_prefix, parameters)

        return self._open_request(build).request_id

    def subscribe_tracks(
        self, track_namespace_prefix: TrackNamespace, parameters: MessageParameters = NO_PARAMETERS
    ) -> int:
        """Send SUBSCRIBE_TRACKS; the peer answers with PUBLISH requests of its own."""

        def build(rid: int) -> SubscribeTracks:
            return SubscribeTracks(rid, track_namespace_prefix, parameters)

        return self._open_request(build).request_id

    def publish(
        self,
        track_namespace: TrackNamespace,
        track_name: bytes,
        track_alias: int,
        parameters: MessageParameters = NO_PARAMETERS,
        track_properties: Properties = (),
    ) -> int:
        """Send PUBLISH for a track we publish under ``track_alias``; objects may follow at once."""
        self._check_alias_free(track_alias)

        def build(rid: int) -> Publish:
            return Publish(rid, track_namespace, track_name, track_alias, parameters, track_properties)

        req = self._open_request(build)
        req.full_track_name = (track_namespace, track_name)
        req.track_alias = track_alias
        self._pub_aliases[track_alias] = req.request_id
        return req.request_id

    def request_update(self, request_id: int, parameters: MessageParameters = NO_PARAMETERS) -> int:
        """Send REQUEST_UPDATE for an existing request; returns the update's own Request ID."""
        req = self._request(request_id)
        update_id = self._next_request_id
        self._send_on_request(req, RequestUpdate(update_id, parameters))
        self._next_request_id += 2
        req.state.pending_updates[req.our_side].append(update_id)
        return update_id

    # -- replies -----------------------------------------------------------------------------------

    def accept_subscribe(
        self,
        request_id: int,
        track_alias: int,
        parameters: MessageParameters = NO_PARAMETERS,
        track_properties: Properties = (),
    ) -> None:
        """Answer a SUBSCRIBE with SUBSCRIBE_OK; objects then go out under ``track_alias``."""
        req = self._peer_request(request_id, _SUB)
        self._check_alias_free(track_alias)
        self._send_on_request(req, SubscribeOk(track_alias, parameters, track_properties))
        req.track_alias = track_alias
        self._pub_aliases[track_alias] = request_id

    def accept_fetch(
        self,
        request_id: int,
        end_of_track: bool,
        end_location: Location,
        parameters: MessageParameters = NO_PARAMETERS,
        track_properties: Properties = (),
    ) -> None:
        """Answer a FETCH with FETCH_OK; send the objects with send_fetch_object, then finish_fetch."""
        req = self._peer_request(request_id, _FETCH)
        self._send_on_request(req, FetchOk(end_of_track, end_location, parameters, track_properties))
        if req.fetch_data_done:
            self._fin_our_side(req)  # the response is complete: nothing more goes on the request stream

    def respond_track_status(
        self,
        request_id: int,
        parameters: MessageParameters = NO_PARAMETERS,
        track_properties: Properties = (),
    ) -> None:
        """Answer a TRACK_STATUS with REQUEST_OK (TRACK_STATUS_OK) and close its stream."""
        req = self._peer_request(request_id, _TS)
        self._send_on_request(req, RequestOk(parameters, track_properties))

    def accept_request(self, request_id: int, parameters: MessageParameters = NO_PARAMETERS) -> None:
        """REQUEST_OK for a PUBLISH (PUBLISH_OK), PUBLISH_NAMESPACE, SUBSCRIBE_NAMESPACE,
        SUBSCRIBE_TRACKS, or for a REQUEST_UPDATE (pass the update's Request ID)."""
        update_of = self._updates.get(request_id)
        if update_of is not None:
            self._answer_update(update_of, request_id, RequestOk(parameters))
            return
        req = self._request(request_id)
        if req.local:
            raise UsageError(f"request {request_id} is ours; the peer answers it")
        if req.state.kind in (_SUB, _FETCH, _TS):
            raise UsageError(f"{req.name} is answered with its own reply method, not accept_request")
        self._send_on_request(req, RequestOk(parameters))

    def reject_request(
        self,
        request_id: int,
        code: RequestErrorCode,
        reason: str = "",
        retry_interval: int = 0,
        redirect: Redirect | None = None,
    ) -> None:
        """Answer a peer request (or REQUEST_UPDATE) with REQUEST_ERROR; the request stream is closed."""
        msg = RequestError(int(code), retry_interval, reason, redirect)
        update_of = self._updates.get(request_id)
        if update_of is not None:
            self._answer_update(update_of, request_id, msg)
            return
        req = self._request(request_id)
        if req.local:
            raise UsageError(f"request {request_id} is ours; cancel it with cancel_request")
        self._send_on_request(req, msg)
        # "Objects MUST NOT be sent for requests that end with an error": a fetch stream already
        # opened is reset rather than left for the application to close.
        self._stop_data_of(req, StreamResetCode.CANCELLED)
        self._end_request(req)

    def publish_done(self, request_id: int, status_code: PublishDoneCode, reason: str = "") -> None:
        """End a subscription we publish (SUBSCRIBE we accepted, or our PUBLISH) with PUBLISH_DONE.

        The draft forbids PUBLISH_DONE while data streams of the subscription are open.
        """
        req = self._request(request_id)
        if not self._publishes(req):
            raise UsageError(f"request {request_id} is not a subscription we publish")
        if req.data_streams:
            raise UsageError("close or reset the subscription's data streams before PUBLISH_DONE")
        self._send_on_request(req, PublishDone(int(status_code), req.streams_opened, reason))
        self._release_pub_alias(req)
        self._end_request(req)

    def namespace(self, request_id: int, track_namespace_suffix: TrackNamespace) -> None:
        """Send NAMESPACE on an accepted SUBSCRIBE_NAMESPACE."""
        req = self._peer_request(request_id, _SNS)
        self._send_on_request(req, Namespace(track_namespace_suffix))
        req.namespaces.add(track_namespace_suffix)

    def namespace_done(self, request_id: int, track_namespace_suffix: TrackNamespace) -> None:
        """Send NAMESPACE_DONE for a suffix previously sent with NAMESPACE."""
        req = self._peer_request(request_id, _SNS)
        if track_namespace_suffix not in req.namespaces:
            raise UsageError("NAMESPACE_DONE for a namespace that was not announced with NAMESPACE")
        self._send_on_request(req, NamespaceDone(track_namespace_suffix))
        req.namespaces.discard(track_namespace_suffix)

    def publish_blocked(
        self, request_id: int, track_namespace_suffix: TrackNamespace, track_name: bytes
    ) -> None:
        """Send PUBLISH_BLOCKED on an accepted SUBSCRIBE_TRACKS."""
        req = self._peer_request(request_id, _STR)
        self._send_on_request(req, PublishBlocked(track_namespace_suffix, track_name))

    def cancel_request(self, request_id: int, code: StreamResetCode = StreamResetCode.CANCELLED) -> None:
        """Abandon a request either side started (section "Request Cancellation and Rejection").

        Resets our side of the request stream, sends STOP_SENDING for the peer's, and resets or
        stops the data streams tied to it (a publisher "MUST reset any open streams").
        """
        req = self._request(request_id)
        self._abort_request(req, int(code))

    # -- objects we send -------------------------------------------------------------------------

    def open_subgroup(
        self,
        track_alias: int,
        group_id: int,
        subgroup_id: int,
        publisher_priority: int | None = None,
        *,
        has_properties: bool = False,
        end_of_group: bool = False,
        first_object: bool = False,
    ) -> int:
        """Open a subgroup stream (SUBGROUP_HEADER) for a subscription we publish; returns its id.

        ``publisher_priority`` None inherits the subscription's priority (DEFAULT_PRIORITY bit).
        """
        self._check_open()
        request_id = self._pub_aliases.get(track_alias)
        if request_id is None:
            raise UsageError(f"Track Alias {track_alias} belongs to no subscription we publish")
        req = self._requests[request_id]
        mode = SubgroupIdMode.ZERO if subgroup_id == 0 else SubgroupIdMode.EXPLICIT
        header = SubgroupHeader(
            track_alias,
            group_id,
            subgroup_id,
            mode,
            publisher_priority,
            has_properties,
            end_of_group,
            first_object,
        )
        data = encode_subgroup_header(header)
        stream_id = self._allocate_stream(unidirectional=True)
        self._outgoing[stream_id] = _OutgoingSubgroup(stream_id, header, request_id)
        req.data_streams.add(stream_id)
        req.streams_opened += 1
        self._send(stream_id, data)
        return stream_id

    def send_subgroup_object(
        self,
        stream_id: int,
        object_id: int,
        payload: bytes | bytearray | memoryview,
        properties: Properties = (),
        status: ObjectStatus = ObjectStatus.NORMAL,
        end_stream: bool = False,
    ) -> None:
        """Send one object on a subgroup stream; ``end_stream`` FINs the stream after it.

        Objects on a stream the peer stopped (STOP_SENDING) are dropped without error.
        """
        sub = self._outgoing_subgroup(stream_id)
        if sub.stopped:
            return
        prefix = subgroup_object_prefix(
            sub.header, object_id, sub.prev_object_id, len(payload), status, properties
        )
        sub.prev_object_id = object_id
        if payload:
            self._send(stream_id, prefix)
            # The payload goes out as its own write: no concatenation copy of a large object.
            self._send(stream_id, payload if isinstance(payload, bytes) else bytes(payload), end_stream)
        else:
            self._send(stream_id, prefix, end_stream)
        if end_stream:
            self._finish_outgoing(sub)

    def close_subgroup(self, stream_id: int) -> None:
        """FIN a subgroup stream: every object of the subgroup has been sent."""
        sub = self._outgoing_subgroup(stream_id)
        if not sub.stopped:
            self._send(stream_id, b"", end_stream=True)
        self._finish_outgoing(sub)

    def reset_subgroup(self, stream_id: int, code: StreamResetCode = StreamResetCode.CANCELLED) -> None:
        """Reset a subgroup stream before all its objects were sent (section "Closing Subgroup Streams")."""
        sub = self._outgoing_subgroup(stream_id)
        if not sub.stopped:
            self._transmits.append(ResetStream(stream_id, int(code)))
        self._finish_outgoing(sub)

    def send_fetch_object(
        self,
        request_id: int,
        group_id: int,
        subgroup_id: int | None,
        object_id: int,
        payload: bytes | bytearray | memoryview,
        publisher_priority: int = 128,
        properties: Properties = (),
    ) -> None:
        """Send one object of a FETCH response on its fetch stream (opened with FETCH_HEADER on first use).

        ``subgroup_id`` None marks an object whose Forwarding Preference is Datagram.
        """
        req = self._fetch_to_serve(request_id)
        if req.fetch_data_done:
            return  # the peer stopped the fetch stream
        encoder = self._fetch_stream(req)
        assert req.fetch_data_stream is not None
        data = payload if isinstance(payload, bytes) else bytes(payload)
        item = FetchObject(group_id, object_id, subgroup_id, publisher_priority, data, properties)
        # Prefix and payload go out as separate writes: no concatenation copy of a large object.
        self._send(req.fetch_data_stream, encoder.encode_prefix(item))
        if data:
            self._send(req.fetch_data_stream, data)

    def send_fetch_end_of_range(
        self, request_id: int, group_id: int, object_id: int, unknown: bool = False
    ) -> None:
        """Mark objects up to {group_id, object_id} as non-existent (or of unknown status, ``unknown``)."""
        req = self._fetch_to_serve(request_id)
        if req.fetch_data_done:
            return
        encoder = self._fetch_stream(req)
        assert req.fetch_data_stream is not None
        self._send(req.fetch_data_stream, encoder.encode(FetchEndOfRange(group_id, object_id, unknown)))

    def finish_fetch(self, request_id: int) -> None:
        """FIN the fetch stream (opening it first if the range holds no objects)."""
        req = self._fetch_to_serve(request_id)
        if req.fetch_data_done:
            return
        self._fetch_stream(req)
        assert req.fetch_data_stream is not None
        self._send(req.fetch_data_stream, b"", end_stream=True)
        req.fetch_data_done = True
        req.data_streams.discard(req.fetch_data_stream)
        if req.state.states[_RESP] is _ACCEPTED:
            # "It can destroy all FETCH state after closing the data stream with a FIN."
            self._fin_our_side(req)
        self._maybe_forget(req)

    def send_object_datagram(
        self,
        track_alias: int,
        group_id: int,
        object_id: int,
        payload: bytes = b"",
        publisher_priority: int | None = None,
        properties: Properties = (),
        status: ObjectStatus | None = None,
        end_of_group: bool = False,
    ) -> None:
        """Send one object as an OBJECT_DATAGRAM for a subscription we publish."""
        self._check_open()
        if track_alias not in self._pub_aliases:
            raise UsageError(f"Track Alias {track_alias} belongs to no subscription we publish")
        dgram = ObjectDatagram(
            track_alias, group_id, object_id, publisher_priority, payload, status, properties, end_of_group
        )
        self._transmits.append(SendDatagram(encode_datagram(dgram)))

    # =============================================================================================
    # internals: output helpers

    def _send(self, stream_id: int, data: bytes, end_stream: bool = False) -> None:
        self._transmits.append(SendStreamData(stream_id, data, end_stream))

    def _allocate_stream(self, unidirectional: bool) -> int:
        # QuicConnection hands out the same id until data is written on it, and several streams may
        # be opened before the glue flushes; never reuse one we already took.
        stream_id = max(
            self._streams.get_next_available_stream_id(unidirectional),
            self._next_local_stream[unidirectional],
        )
        if not _is_local(stream_id, self.is_client) or _is_uni(stream_id) != unidirectional:
            raise UsageError(
                f"stream allocator returned {stream_id}, not a local {'uni' if unidirectional else 'bidi'} id"
            )
        self._next_local_stream[unidirectional] = stream_id + 4
        return stream_id

    def _check_open(self) -> None:
        if self.closed is not None:
            raise UsageError("the session is closed")

    def _check_initiated(self) -> None:
        self._check_open()
        if not self._initiated:
            raise UsageError("call initiate() first")

    def _close_on_error(self, exc: ProtocolError) -> None:
        self._log.info("peer protocol error: %r", exc)
        self.close(exc.error_code, exc.reason)

    def _forget_everything(self) -> None:
        self._header_deadlines.clear()
        self._requests.clear()
        self._bidi.clear()
        self._updates.clear()
        self._incoming.clear()
        self._pending_alias.clear()
        self._outgoing.clear()

    # =============================================================================================
    # internals: request streams

    def _open_request(self, build: Callable[[int], ControlMessage]) -> _Request:
        self._check_initiated()
        if self._goaway_received:
            raise UsageError("the peer sent GOAWAY: no new requests on this session")
        request_id = self._next_request_id
        msg = build(request_id)
        data = encode_message(msg)  # UsageError for unencodable values, before any state changes
        stream_id = self._allocate_stream(unidirectional=False)
        req = _Request(stream_id, local=True, framer=_control_reader(self.config))
        req.state.open(msg.TYPE)
        req.request_id = request_id
        if isinstance(msg, Fetch):
            req.fetch = msg
        self._next_request_id += 2
        self._requests[request_id] = req
        self._bidi[stream_id] = req
        req.send_closed = not req.state.can_send_more(_REQ)
        self._send(stream_id, data, end_stream=req.send_closed)
        return req

    def _request(self, request_id: int) -> _Request:
        self._check_open()
        req = self._requests.get(request_id)
        if req is None or req.ended:
            raise UsageError(f"no live request with Request ID {request_id}")
        return req

    def _peer_request(self, request_id: int, kind: int) -> _Request:
        req = self._request(request_id)
        if req.local or req.state.kind != kind:
            raise UsageError(f"request {request_id} is not a {KIND_NAMES[kind]} from the peer")
        return req

    def _send_on_request(self, req: _Request, msg: ControlMessage) -> tuple[int, ...]:
        """Send ``msg`` on the request's stream as our side, following the transition table (a
        ``RequestTransitionError``, which is a ``UsageError``, if it does not allow it). Returns the
        Request IDs of the peer's REQUEST_UPDATEs it answered."""
        transition = req.state.check(req.our_side, msg.TYPE)
        if req.send_closed:
            raise UsageError(f"the {req.name} stream is closed")
        data = encode_message(msg)
        answered = req.state.apply(transition)
        self._send(req.stream_id, data, end_stream=transition.fin)
        if transition.fin:
            req.send_closed = True
            self._maybe_forget(req)
        return answered

    def _answer_update(self, req: _Request, update_id: int, msg: RequestOk | RequestError) -> None:
        pending = req.state.pending_updates[req.peer_side]
        if not pending or pending[0] != update_id:
            raise UsageError("answer REQUEST_UPDATEs in the order they arrived")
        for rid in self._send_on_request(req, msg):
            self._updates.pop(rid, None)

    def _receive_bidi(self, stream_id: int, data: bytes, end_stream: bool, now: float | None) -> None:
        req = self._bidi.get(stream_id)
        if req is None:
            if _is_local(stream_id, self.is_client) or stream_id in self._seen_bidi:
                return  # a request stream we already finished with; late bytes are harmless
            timeout = self.config.request_header_timeout
            if timeout is not None:
                if now is None:
                    raise UsageError("request_header_timeout is set: receive_stream_data needs now")
                self._header_deadlines[stream_id] = now + timeout
            self._seen_bidi.add(stream_id)
            req = _Request(stream_id, local=False, framer=_control_reader(self.config))
            self._bidi[stream_id] = req
        if req.fin_received:
            return
        req.framer.feed(data)
        req.fin_received = end_stream
        self._pump_request(req)
        if stream_id in self._header_deadlines and (
            req.state.kind is not None or req.framer.has_message() or self._bidi.get(stream_id) is not req
        ):
            del self._header_deadlines[stream_id]

    def _pump_request(self, req: _Request) -> None:
        """Process what is buffered on a request stream, unless SETUP has not completed yet."""
        if not self.established:
            if req.framer.buffered > self.config.max_buffered_bytes_per_stream:
                self._refuse_stream(req, StreamResetCode.EXCESSIVE_LOAD)
            return
        while self.closed is None and self._bidi.get(req.stream_id) is req and not req.recv_closed:
            msg = req.framer.next_message()
            if msg is None:
                if req.fin_received:
                    self._on_request_fin(req)
                return
            self._on_request_message(req, msg)

    def _refuse_stream(self, req: _Request, code: int) -> None:
        """Drop a request stream we will not process: reset and stop whatever is still open."""
        if not req.send_closed:
            self._transmits.append(ResetStream(req.stream_id, int(code)))
        if not (req.fin_received or req.recv_closed):
            self._transmits.append(StopSending(req.stream_id, int(code)))
        req.send_closed = req.recv_closed = True
        self._bidi.pop(req.stream_id, None)

    def _on_request_message(self, req: _Request, msg: ControlMessage) -> None:
        if req.state.kind is None:
            self._open_peer_request(req, msg)
            return
        if isinstance(msg, Goaway):
            self._on_request_goaway(req, msg)
            return
        try:
            transition = req.state.check(req.peer_side, msg.TYPE)
        except RequestTransitionError as exc:
            raise ProtocolViolation(str(exc)) from None  # the same table, broken by the peer
        answered = req.state.apply(transition)
        answers = answered[0] if answered else None
        self._handlers[msg.TYPE](_Context(req, transition.first_reply, answers), msg)
        if transition.new_state is _DONE and not req.send_closed and self.closed is None:
            # The peer's side is finished (REQUEST_ERROR, PUBLISH_DONE, TRACK_STATUS reply): FIN ours.
            self._send(req.stream_id, b"", end_stream=True)
            req.send_closed = True
        self._maybe_forget(req)

    def _open_peer_request(self, req: _Request, msg: ControlMessage) -> None:
        if not isinstance(msg, REQUEST_CLASSES):
            raise ProtocolViolation(f"request stream begins with {type(msg).__name__}, not a request")
        self._peer_ids.check(msg.request_id)
        req.state.open(msg.TYPE)
        req.request_id = msg.request_id
        if isinstance(msg, Fetch):
            req.fetch = msg
        self._requests[msg.request_id] = req
        if self._goaway_floor is not None:
            # Section "GOAWAY": requests at or above the advertised ID, and any arriving after the
            # GOAWAY, "MUST be rejected with REQUEST_ERROR using error code GOING_AWAY".
            self._auto_reject(req, RequestErrorCode.GOING_AWAY, "going away", 0)
            return
        if self._peer_requests_open >= self.config.max_requests_in_flight:
            retry = self.config.excessive_load_retry_interval
            self._auto_reject(req, RequestErrorCode.EXCESSIVE_LOAD, "too many requests", retry)
            return
        req.counted = True
        self._peer_requests_open += 1
        self._handlers[msg.TYPE](_Context(req), msg)
        self._maybe_forget(req)

    def _auto_reject(self, req: _Request, code: RequestErrorCode, reason: str, retry: int) -> None:
        self._send_on_request(req, RequestError(int(code), retry, reason))
        self._end_request(req)
        self._events.append(RequestRefused(req.request_id, int(code), reason))

    def _on_request_goaway(self, req: _Request, msg: Goaway) -> None:
        if req.peer_goaway:
            raise ProtocolViolation("second GOAWAY on one request stream")
        if msg.request_id is not None:
            raise ProtocolViolation("GOAWAY on a request stream carries a Request ID")
        if msg.new_session_uri and not self.is_client:
            raise ProtocolViolation("GOAWAY from a client with a New Session URI")
        req.peer_goaway = True
        if not req.ended:
            self._events.append(GoawayReceived(msg.new_session_uri, msg.timeout, None, req.request_id))

    def _on_request_fin(self, req: _Request) -> None:
        """The peer FIN'd its side and every message before the FIN has been handled."""
        if req.framer.buffered:
            raise ProtocolViolation(f"{req.name} stream ended inside a control message")
        req.recv_closed = True
        if req.state.kind is None:
            self._refuse_stream(req, StreamResetCode.CANCELLED)  # FIN before any message
            return
        side = req.peer_side
        if req.state.states[side] is not _DONE and not req.ended:
            if side is _RESP and req.state.states[side] is _IDLE:
                raise ProtocolViolation(f"{req.name} stream closed without a reply")
            if req.state.fin_ends_request(side):
                self._events.append(RequestCancelled(req.request_id, None))
                self._stop_data_of(req, StreamResetCode.CANCELLED)
                if not req.send_closed:
                    self._send(req.stream_id, b"", end_stream=True)
                    req.send_closed = True
                self._end_request(req)
        self._maybe_forget(req)

    def _maybe_forget(self, req: _Request) -> None:
        """Drop the bookkeeping of a request once nothing can refer to it any more."""
        closed = req.send_closed and req.recv_closed
        if closed:
            self._bidi.pop(req.stream_id, None)
        if not (closed or req.ended) or req.data_streams:
            return  # a publisher keeps the request while its data streams are open
        if req.local and req.state.kind == _FETCH and not req.ended and not req.fetch_data_done:
            return  # the FETCH response stream may still come
        self._end_request(req)
        if self._requests.get(req.request_id) is req:
            del self._requests[req.request_id]

    def _end_request(self, req: _Request) -> None:
        """The request is over for the application: no events for it, no actions on it."""
        if req.ended:
            return
        req.ended = True
        if req.counted:
            req.counted = False
            self._peer_requests_open -= 1
        for rid in req.state.pending_updates[req.peer_side]:
            self._updates.pop(rid, None)
        req.state.pending_updates[req.peer_side].clear()
        if req.track_alias is not None:
            track = self._sub_tracks.get(req.track_alias)
            if track is not None and track.request_id == req.request_id:
                self._retire_sub_track(req.track_alias, track)
        self._maybe_forget(req)

    def _abort_request(self, req: _Request, code: int) -> None:
        """Cancel a request locally: reset and stop its stream and its data streams."""
        self._stop_data_of(req, code)
        self._refuse_stream(req, code)
        self._end_request(req)

    def _peer_cancelled(self, req: _Request, error_code: int) -> None:
        """The peer reset or stopped a request stream: the request is cancelled."""
        if req.state.kind is not None and not req.ended:
            self._events.append(RequestCancelled(req.request_id, error_code))
        self._stop_data_of(req, StreamResetCode.CANCELLED)
        self._refuse_stream(req, StreamResetCode.CANCELLED)
        self._end_request(req)

    def _stop_data_of(self, req: _Request, code: int) -> None:
        """Reset our data streams of a request and stop the peer's ones delivering to it."""
        # Publisher: "MUST reset any open streams associated with the SUBSCRIBE" / the fetch stream.
        for stream_id in sorted(req.data_streams):
            sub = self._outgoing.pop(stream_id, None)
            if (sub is not None and not sub.stopped) or stream_id == req.fetch_data_stream:
                self._transmits.append(ResetStream(stream_id, code))
        req.data_streams.clear()
        if not req.local and req.fetch_data_stream is not None:
            req.fetch_data_done = True
        self._release_pub_alias(req)
        # Subscriber: stop the streams that deliver to it and drop its late objects.
        if req.state.kind in (_SUB, _FETCH, _PUB) and req.request_id >= 0:
            for stream in list(self._incoming.values()):
                if stream.request_id == req.request_id and stream.kind in (
                    _DataKind.SUBGROUP,
                    _DataKind.FETCH,
                ):
                    self._abandon_incoming(stream, code, report=False)
            if req.track_alias is not None:
                track = self._sub_tracks.get(req.track_alias)
                if track is not None and track.request_id == req.request_id:
                    track.active = False
                    self._retire_sub_track(req.track_alias, track)
        if req.local and req.state.kind == _FETCH:
            req.fetch_data_done = True

    def _release_pub_alias(self, req: _Request) -> None:
        alias = req.track_alias
        if alias is not None and self._pub_aliases.get(alias) == req.request_id and self._publishes(req):
            del self._pub_aliases[alias]

    @staticmethod
    def _publishes(req: _Request) -> bool:
        """We are the publisher of this subscription (we accepted its SUBSCRIBE, or sent its PUBLISH)."""
        return (req.state.kind == _SUB and not req.local) or (req.state.kind == _PUB and req.local)

    def _check_alias_free(self, track_alias: int) -> None:
        if not 0 <= track_alias < 1 << 64:
            raise UsageError("Track Alias must be a 64-bit unsigned integer")
        if track_alias in self._pub_aliases:
            raise UsageError(
                f"Track Alias {track_alias} is in use by request {self._pub_aliases[track_alias]}"
            )

    # =============================================================================================
    # internals: message handlers (one per control message type)

    def _handle_setup(self, ctx: _Context, msg: ControlMessage) -> None:
        assert isinstance(msg, Setup)
        if ctx.request is not None or self._peer_setup is not None:
            raise ProtocolViolation("SETUP is only the first message of the control stream")
        if self.is_client:
            # PATH and AUTHORITY "MUST NOT be used by the server" (section "Setup Options").
            if msg.path is not None:
                raise InvalidPath("PATH option from the server")
            if msg.authority is not None:
                raise InvalidAuthority("AUTHORITY option from the server")
        self._peer_setup = msg
        self._after_setup_progress()

    def _handle_goaway(self, ctx: _Context, msg: ControlMessage) -> None:
        assert isinstance(msg, Goaway)
        if self._goaway_received:
            raise ProtocolViolation("second GOAWAY on the control stream")
        if msg.new_session_uri and not self.is_client:
            raise ProtocolViolation("GOAWAY from a client with a New Session URI")
        if msg.request_id is None:
            raise ProtocolViolation("GOAWAY on the control stream without a Request ID")
        if msg.request_id & 1 != (0 if self.is_client else 1):
            raise InvalidRequestId(f"GOAWAY Request ID {msg.request_id} has the wrong parity")
        self._goaway_received = True
        self._events.append(GoawayReceived(msg.new_session_uri, msg.timeout, msg.request_id))

    def _handle_subscribe(self, ctx: _Context, msg: ControlMessage) -> None:
        assert isinstance(msg, Subscribe) and ctx.request is not None
        ctx.request.full_track_name = (msg.track_namespace, msg.track_name)
        self._events.append(
            SubscribeReceived(msg.request_id, msg.track_namespace, msg.track_name, msg.parameters)
        )

    def _handle_subscribe_ok(self, ctx: _Context, msg: ControlMessage) -> None:
        assert isinstance(msg, SubscribeOk) and ctx.request is not None
        req = ctx.request
        self._bind_sub_alias(req, msg.track_alias)
        if not req.ended:
            self._events.append(
                SubscribeOkReceived(req.request_id, msg.track_alias, msg.parameters, msg.track_properties)
            )
        self._release_pending_alias(msg.track_alias)

    def _handle_publish(self, ctx: _Context, msg: ControlMessage) -> None:
        assert isinstance(msg, Publish) and ctx.request is not None
        req = ctx.request
        req.full_track_name = (msg.track_namespace, msg.track_name)
        self._bind_sub_alias(req, msg.track_alias)
        self._events.append(
            PublishReceived(
                msg.request_id, msg.track_namespace, msg.track_name, msg.track_alias, msg.parameters,
                msg.track_properties,
            )
        )  # fmt: skip
        self._release_pending_alias(msg.track_alias)

    def _handle_publish_ok(self, ctx: _Context, msg: ControlMessage) -> None:
        assert isinstance(msg, PublishOk) and ctx.request is not None
        if not ctx.request.ended:
            self._events.append(PublishOkReceived(ctx.request.request_id, msg.parameters))

    def _handle_publish_done(self, ctx: _Context, msg: ControlMessage) -> None:
        assert isinstance(msg, PublishDone) and ctx.request is not None
        req = ctx.request
        if not req.ended:
            self._events.append(
                PublishDoneReceived(req.request_id, msg.status_code, msg.stream_count, msg.reason)
            )
        # Late objects may still arrive; the alias stays known (inactive only when we cancel).
        self._end_request(req)

    def _handle_fetch(self, ctx: _Context, msg: ControlMessage) -> None:
        assert isinstance(msg, Fetch) and ctx.request is not None
        s, j = msg.standalone, msg.joining
        self._events.append(
            FetchReceived(
                msg.request_id,
                msg.fetch_type,
                s.track_namespace if s else None,
                s.track_name if s else None,
                s.start if s else None,
                s.end if s else None,
                j.joining_request_id if j else None,
                j.joining_start if j else None,
                msg.parameters,
            )
        )

    def _handle_fetch_ok(self, ctx: _Context, msg: ControlMessage) -> None:
        assert isinstance(msg, FetchOk) and ctx.request is not None
        req = ctx.request
        standalone = req.fetch.standalone if req.fetch is not None else None
        if standalone is not None and _range_end_before(msg.end_location, standalone.start):
            raise ProtocolViolation("FETCH_OK End Location is smaller than the FETCH Start Location")
        if not req.ended:
            self._events.append(
                FetchOkReceived(
                    req.request_id, msg.end_of_track, msg.end_location, msg.parameters, msg.track_properties
                )
            )

    def _handle_track_status(self, ctx: _Context, msg: ControlMessage) -> None:
        assert isinstance(msg, TrackStatus) and ctx.request is not None
        self._events.append(
            TrackStatusReceived(msg.request_id, msg.track_namespace, msg.track_name, msg.parameters)
        )

    def _handle_publish_namespace(self, ctx: _Context, msg: ControlMessage) -> None:
        assert isinstance(msg, PublishNamespace)
        self._events.append(PublishNamespaceReceived(msg.request_id, msg.track_namespace, msg.parameters))

    def _handle_subscribe_namespace(self, ctx: _Context, msg: ControlMessage) -> None:
        assert isinstance(msg, SubscribeNamespace)
        self._events.append(
            SubscribeNamespaceReceived(msg.request_id, msg.track_namespace_prefix, msg.parameters)
        )

    def _handle_subscribe_tracks(self, ctx: _Context, msg: ControlMessage) -> None:
        assert isinstance(msg, SubscribeTracks)
        self._events.append(
            SubscribeTracksReceived(msg.request_id, msg.track_namespace_prefix, msg.parameters)
        )

    def _handle_namespace(self, ctx: _Context, msg: ControlMessage) -> None:
        assert isinstance(msg, Namespace) and ctx.request is not None
        req = ctx.request
        req.namespaces.add(msg.track_namespace_suffix)
        if not req.ended:
            self._events.append(NamespaceReceived(req.request_id, msg.track_namespace_suffix))

    def _handle_namespace_done(self, ctx: _Context, msg: ControlMessage) -> None:
        assert isinstance(msg, NamespaceDone) and ctx.request is not None
        req = ctx.request
        if msg.track_namespace_suffix not in req.namespaces:
            raise ProtocolViolation("NAMESPACE_DONE before the corresponding NAMESPACE")
        req.namespaces.discard(msg.track_namespace_suffix)
        if not req.ended:
            self._events.append(NamespaceDoneReceived(req.request_id, msg.track_namespace_suffix))

    def _handle_publish_blocked(self, ctx: _Context, msg: ControlMessage) -> None:
        assert isinstance(msg, PublishBlocked) and ctx.request is not None
        if not ctx.request.ended:
            self._events.append(
                PublishBlockedReceived(ctx.request.request_id, msg.track_namespace_suffix, msg.track_name)
            )

    def _handle_request_update(self, ctx: _Context, msg: ControlMessage) -> None:
        assert isinstance(msg, RequestUpdate) and ctx.request is not None
        req = ctx.request
        self._peer_ids.check(msg.request_id)
        if req.ended or req.send_closed:
            return  # we already ended the request (rejected or cancelled): nothing can answer it
        req.state.pending_updates[req.peer_side].append(msg.request_id)
        self._updates[msg.request_id] = req
        self._events.append(RequestUpdateReceived(msg.request_id, req.request_id, msg.parameters))

    def _handle_request_ok(self, ctx: _Context, msg: ControlMessage) -> None:
        assert isinstance(msg, RequestOk) and ctx.request is not None
        req = ctx.request
        if msg.track_properties and not (ctx.initial_reply and req.state.kind == _TS):
            # Section "REQUEST_OK": Track Properties only in TRACK_STATUS_OK.
            raise ProtocolViolation("REQUEST_OK with Track Properties outside TRACK_STATUS_OK")
        if req.ended:
            return
        event: MoqtEvent
        if ctx.answers is not None:
            event = RequestOkReceived(ctx.answers, msg.parameters)
        elif req.state.kind == _TS:
            event = TrackStatusOkReceived(req.request_id, msg.parameters, msg.track_properties)
        elif req.state.kind == _PUB:
            event = PublishOkReceived(req.request_id, msg.parameters)
        else:
            event = RequestOkReceived(req.request_id, msg.parameters)
        self._events.append(event)
        if req.state.kind == _TS:
            self._end_request(req)

    def _handle_request_error(self, ctx: _Context, msg: ControlMessage) -> None:
        assert isinstance(msg, RequestError) and ctx.request is not None
        req = ctx.request
        if msg.redirect is not None:
            if msg.redirect.connect_uri and not self.is_client:
                raise ProtocolViolation("Redirect with a Connect URI sent to a server")
            if req.state.kind in (_SNS, _PNS) and msg.redirect.track_name:
                raise ProtocolViolation("Redirect with a Track Name for a namespace request")
        if req.ended:
            return
        rid = ctx.answers if ctx.answers is not None else req.request_id
        self._events.append(
            RequestErrorReceived(rid, msg.error_code, msg.reason, msg.retry_interval, msg.redirect)
        )
        if ctx.answers is None:
            # "A REQUEST_ERROR indicates no objects will be delivered": the request is over.
            self._end_request(req)
            if req.state.kind == _FETCH:
                req.fetch_data_done = True

    # =============================================================================================
    # internals: setup and the control stream

    def _after_setup_progress(self) -> None:
        if not self.established or self._setup_reported:
            return
        self._setup_reported = True
        peer = self._peer_setup
        assert peer is not None
        self._events.append(
            SetupCompleted(
                peer.path, peer.authority, peer.authorization_tokens, peer.max_auth_token_cache_size or 0,
                peer.implementation, peer.unknown_options,
            )
        )  # fmt: skip
        # Streams that arrived before SETUP completed were buffered; process them now.
        for req in list(self._bidi.values()):
            if not req.local:
                self._pump_request(req)
                if self.closed is not None:
                    return
        for stream in list(self._incoming.values()):
            if stream.kind is not _DataKind.CONTROL:
                self._pump_data(stream)
                if self.closed is not None:
                    return

    def _on_control_bytes(self, data: bytes | bytearray | memoryview, end_stream: bool) -> None:
        framer = self._peer_control_framer
        framer.feed(data)
        while self.closed is None:
            msg = framer.next_message()
            if msg is None:
                break
            if self._peer_setup is None and not isinstance(msg, Setup):
                raise ProtocolViolation(f"{type(msg).__name__} before SETUP on the control stream")
            if not isinstance(msg, Setup | Goaway):
                raise ProtocolViolation(f"{type(msg).__name__} is not allowed on the control stream")
            self._handlers[msg.TYPE](_Context(None), msg)
        if framer.buffered > self.config.max_control_message_size + 16:
            raise LimitExceeded("control stream holds more than one control message")
        if end_stream and self.closed is None:
            # "A control stream MUST NOT be closed at the underlying transport layer" (section
            # "Session initialization").
            raise ProtocolViolation("the peer closed its control stream")

    # =============================================================================================
    # internals: unidirectional streams

    def _receive_uni(self, stream_id: int, data: bytes, end_stream: bool) -> None:
        if _is_local(stream_id, self.is_client):
            return  # QUIC never delivers data on our own unidirectional streams
        stream = self._incoming.get(stream_id)
        if stream is None:
            if stream_id in self._seen_uni:
                return
            self._seen_uni.add(stream_id)
            stream = _IncomingStream(stream_id, DataStreamReader(self.config.max_object_size))
            self._incoming[stream_id] = stream
        if stream.fin:
            return
        stream.fin = end_stream
        if stream.kind is _DataKind.CONTROL:
            self._on_control_bytes(data, end_stream)
            return
        if stream.discarding:
            if end_stream:
                self._drop_incoming(stream)
            return
        stream.reader.feed(data, end_stream)
        self._pump_data(stream)

    def _pump_data(self, stream: _IncomingStream) -> None:
        """Parse what is buffered on a peer unidirectional stream and report complete objects."""
        try:
            self._pump_data_items(stream)
        except LimitExceeded as exc:
            # An object larger than we accept fails that stream only.
            self._log.info("abandoning stream %d: %s", stream.stream_id, exc.reason)
            self._abandon_incoming(stream, StreamResetCode.EXCESSIVE_LOAD)

    def _pump_data_items(self, stream: _IncomingStream) -> None:
        reader = stream.reader
        if stream.kind is _DataKind.UNKNOWN:
            item = reader.next_item()
            if item is None:
                return
            if not self._classify_stream(stream, item):
                return
        while not stream.discarding and self.closed is None:
            if not self.established or not self._stream_bound(stream):
                if reader.buffered > self.config.max_buffered_bytes_per_stream:
                    self._abandon_incoming(stream, StreamResetCode.EXCESSIVE_LOAD)
                return
            item = reader.next_item()
            if item is None:
                return
            self._on_data_item(stream, item)

    def _classify_stream(self, stream: _IncomingStream, item: object) -> bool:
        """Handle the first item of a stream; False when nothing more is to be parsed here."""
        if isinstance(item, ControlStreamHeader):
            if self._peer_control is not None:
                raise ProtocolViolation("a second control stream")
            stream.kind = _DataKind.CONTROL
            self._peer_control = stream
            self._on_control_bytes(stream.reader.take_buffered(), stream.fin)
            return False
        if isinstance(item, PaddingStreamHeader):
            stream.kind = _DataKind.PADDING
            stream.discarding = True  # "The receiver MUST discard all data received on a padding stream"
            if stream.fin:
                self._drop_incoming(stream)
            return False
        if self._data_streams_open >= self.config.max_data_streams:
            self._abandon_incoming(stream, StreamResetCode.EXCESSIVE_LOAD)
            return False
        stream.counted = True
        self._data_streams_open += 1
        if isinstance(item, SubgroupHeader):
            stream.kind = _DataKind.SUBGROUP
            stream.header = item
            return True
        if isinstance(item, FetchHeader):
            stream.kind = _DataKind.FETCH
            stream.request_id = item.request_id
            return True
        raise ProtocolViolation("data stream without a header")  # the reader returns headers first

    def _stream_bound(self, stream: _IncomingStream) -> bool:
        """Tie a data stream to its request; False while it has to wait (unknown Track Alias)."""
        if stream.request_id is not None and stream.kind is _DataKind.SUBGROUP:
            return True
        if stream.kind is _DataKind.FETCH:
            return self._bind_fetch_stream(stream)
        header = stream.header
        assert header is not None
        track = self._sub_tracks.get(header.track_alias)
        if track is None:
            # Reordering with the SUBSCRIBE_OK / PUBLISH that defines the alias (section "Subgroup
            # Header": "choose to buffer it for a brief period").
            waiting = self._pending_alias.setdefault(header.track_alias, [])
            if stream not in waiting:
                waiting.append(stream)
            return False
        if not track.active:
            self._abandon_incoming(stream, StreamResetCode.CANCELLED)
            return False
        stream.request_id = track.request_id
        return True

    def _bind_fetch_stream(self, stream: _IncomingStream) -> bool:
        if stream.discarding:
            return False
        rid = stream.request_id
        assert rid is not None
        req = self._requests.get(rid)
        if req is not None and req.local and req.state.kind == _FETCH:
            if req.fetch_data_stream == stream.stream_id:
                return True
            if req.fetch_data_stream is not None:
                raise ProtocolViolation(f"a second fetch stream for request {rid}")
            if req.ended or req.fetch_data_done:
                self._abandon_incoming(stream, StreamResetCode.CANCELLED)
                return False
            req.fetch_data_stream = stream.stream_id
            group_order = req.fetch.parameters.group_order if req.fetch is not None else None
            stream.reader.group_order = group_order or GroupOrder.ASCENDING
            return True
        ours = rid & 1 == (0 if self.is_client else 1) and rid < self._next_request_id
        if not ours or (req is not None and req.state.kind != _FETCH):
            raise ProtocolViolation(f"FETCH_HEADER for Request ID {rid}, which is no FETCH of ours")
        self._abandon_incoming(stream, StreamResetCode.CANCELLED)  # a fetch we already ended
        return False

    def _on_data_item(self, stream: _IncomingStream, item: object) -> None:
        rid = stream.request_id
        assert rid is not None
        if isinstance(item, SubgroupObject):
            header = stream.header
            assert header is not None
            self._events.append(
                ObjectReceived(
                    rid, header.track_alias, header.group_id, stream.reader.subgroup_id, item.object_id,
                    header.publisher_priority, int(item.status), item.properties, item.payload, "subgroup",
                    stream.stream_id,
                )
            )  # fmt: skip
        elif isinstance(item, FetchObject):
            self._events.append(
                ObjectReceived(
                    rid, None, item.group_id, item.subgroup_id, item.object_id, item.publisher_priority,
                    int(ObjectStatus.NORMAL), item.properties, item.payload, "fetch", stream.stream_id,
                )
            )  # fmt: skip
        elif isinstance(item, FetchEndOfRange):
            self._events.append(FetchRangeReceived(rid, item.group_id, item.object_id, item.unknown))
        elif isinstance(item, StreamEnd):
            if stream.kind is _DataKind.FETCH:
                self._events.append(FetchCompleted(rid))
                self._fetch_stream_over(rid)
            else:
                self._subgroup_closed(stream, None)
            self._drop_incoming(stream)

    def _subgroup_closed(self, stream: _IncomingStream, error_code: int | None) -> None:
        header = stream.header
        if header is None or stream.request_id is None:
            return
        self._events.append(
            SubgroupClosed(
                stream.request_id, header.track_alias, header.group_id, stream.reader.subgroup_id,
                stream.stream_id, error_code,
            )
        )  # fmt: skip

    def _fetch_stream_over(self, request_id: int) -> None:
        req = self._requests.get(request_id)
        if req is not None and req.local and req.state.kind == _FETCH:
            req.fetch_data_done = True
            # The subscriber keeps FETCH state until the data stream ends; FETCH_OK may still come.
            self._fin_our_side(req)
            self._maybe_forget(req)

    def _fin_our_side(self, req: _Request) -> None:
        if not req.send_closed and self.closed is None:
            self._send(req.stream_id, b"", end_stream=True)
            req.send_closed = True

    def _abandon_incoming(self, stream: _IncomingStream, code: int, report: bool = True) -> None:
        """Stop reading a data stream (STOP_SENDING); ``report`` tells the application if it was bound."""
        if stream.discarding:
            return
        stream.discarding = True
        if not stream.fin:
            self._transmits.append(StopSending(stream.stream_id, int(code)))
        if report and stream.request_id is not None:
            if stream.kind is _DataKind.SUBGROUP:
                self._subgroup_closed(stream, int(code))
            elif stream.kind is _DataKind.FETCH:
                req = self._requests.get(stream.request_id)
                if req is not None and req.fetch_data_stream == stream.stream_id and not req.ended:
                    self._events.append(FetchStreamReset(stream.request_id, int(code)))
        if stream.kind is _DataKind.FETCH and stream.request_id is not None:
            req = self._requests.get(stream.request_id)
            if req is not None and req.fetch_data_stream == stream.stream_id:
                self._fetch_stream_over(stream.request_id)
        self._drop_incoming(stream)

    def _drop_incoming(self, stream: _IncomingStream) -> None:
        """Forget a peer data stream; ``_seen_uni`` keeps late bytes from reviving it."""
        stream.discarding = True
        if stream.counted:
            stream.counted = False
            self._data_streams_open -= 1
        if stream.header is not None:
            waiting = self._pending_alias.get(stream.header.track_alias)
            if waiting and stream in waiting:
                waiting.remove(stream)
                if not waiting:
                    del self._pending_alias[stream.header.track_alias]
        self._incoming.pop(stream.stream_id, None)

    def _bind_sub_alias(self, req: _Request, track_alias: int) -> None:
        """Subscriber side: the peer (publisher) assigned ``track_alias`` to request ``req``."""
        assert req.full_track_name is not None
        existing = self._sub_tracks.get(track_alias)
        if (
            existing is not None
            and existing.established
            and existing.request_id != req.request_id
            and existing.full_track_name != req.full_track_name
        ):
            raise DuplicateTrackAlias(f"Track Alias {track_alias} is already used for another track")
        req.track_alias = track_alias
        self._sub_tracks[track_alias] = _SubscribedTrack(req.request_id, req.full_track_name)
        self._retired_sub_aliases.pop(track_alias, None)  # bound again: live, not retired

    def _retire_sub_track(self, track_alias: int, track: _SubscribedTrack) -> None:
        """A subscription ended: keep its alias a while, so its late objects are dropped quietly, and
        forget the oldest ended ones beyond ``max_retired_aliases``. O(1) per subscription: a scan of
        every alias per PUBLISH made a publisher pushing N tracks on one session cost O(N^2)."""
        track.established = False
        self._retired_sub_aliases[track_alias] = None
        while len(self._retired_sub_aliases) > self.config.max_retired_aliases:
            alias, _ = self._retired_sub_aliases.popitem(last=False)
            retired = self._sub_tracks.get(alias)
            if retired is not None and not retired.established:
                del self._sub_tracks[alias]

    def _release_pending_alias(self, track_alias: int) -> None:
        for stream in self._pending_alias.pop(track_alias, []):
            if self.closed is not None:
                return
            if not stream.discarding:
                self._pump_data(stream)

    # =============================================================================================
    # internals: resets, STOP_SENDING, datagrams

    def _on_stream_reset(self, stream_id: int, error_code: int) -> None:
        if _is_uni(stream_id):
            stream = self._incoming.get(stream_id)
            if stream is None or _is_local(stream_id, self.is_client):
                return
            if stream.kind is _DataKind.CONTROL:
                raise ProtocolViolation("the peer reset its control stream")
            stream.fin = True  # nothing more will arrive; no STOP_SENDING needed
            if not stream.discarding and stream.request_id is not None:
                if stream.kind is _DataKind.SUBGROUP:
                    self._subgroup_closed(stream, error_code)
                elif stream.kind is _DataKind.FETCH:
                    req = self._requests.get(stream.request_id)
                    if req is not None and req.fetch_data_stream == stream_id:
                        if not req.ended:
                            self._events.append(FetchStreamReset(stream.request_id, error_code))
                        self._fetch_stream_over(stream.request_id)
            self._drop_incoming(stream)
            return
        req = self._bidi.get(stream_id)
        if req is None or req.recv_closed:
            return
        req.fin_received = req.recv_closed = True
        self._peer_cancelled(req, error_code)

    def _on_stop_sending(self, stream_id: int, error_code: int) -> None:
        if stream_id == self._control_stream_id:
            raise ProtocolViolation("the peer sent STOP_SENDING for our control stream")
        if _is_uni(stream_id):
            sub = self._outgoing.get(stream_id)
            if sub is not None:
                # QUIC resets the stream itself; later objects for it are dropped quietly and the
                # subscription no longer counts it as open.
                if not sub.stopped:
                    sub.stopped = True
                    self._transmits.append(ResetStream(stream_id, error_code))
                    self._events.append(DataStreamStopped(sub.request_id, stream_id, error_code))
                    req = self._requests.get(sub.request_id)
                    if req is not None:
                        req.data_streams.discard(stream_id)
                return
            for req in list(self._requests.values()):
                if req.fetch_data_stream == stream_id and not req.local and not req.fetch_data_done:
                    req.fetch_data_done = True
                    req.data_streams.discard(stream_id)
                    self._transmits.append(ResetStream(stream_id, error_code))
                    self._events.append(DataStreamStopped(req.request_id, stream_id, error_code))
                    self._maybe_forget(req)
                    return
            return
        req = self._bidi.get(stream_id)
        if req is None or req.send_closed:
            return
        req.send_closed = True
        self._transmits.append(ResetStream(stream_id, error_code))
        self._peer_cancelled(req, error_code)

    def _on_datagram(self, data: bytes) -> None:
        dgram = decode_datagram(data)
        if not isinstance(dgram, ObjectDatagram) or not self.established:
            return
        track = self._sub_tracks.get(dgram.track_alias)
        if track is None or not track.active:
            return  # "MAY drop the datagram" for an unknown Track Alias
        status = int(dgram.status) if dgram.status is not None else int(ObjectStatus.NORMAL)
        self._events.append(
            ObjectReceived(
                track.request_id, dgram.track_alias, dgram.group_id, None, dgram.object_id,
                dgram.publisher_priority, status, dgram.properties, dgram.payload, "datagram", None,
                dgram.end_of_group,
            )
        )  # fmt: skip

    # =============================================================================================
    # internals: publisher data streams

    def _outgoing_subgroup(self, stream_id: int) -> _OutgoingSubgroup:
        self._check_open()
        sub = self._outgoing.get(stream_id)
        if sub is None or sub.closed:
            raise UsageError(f"stream {stream_id} is not an open subgroup stream of ours")
        return sub

    def _finish_outgoing(self, sub: _OutgoingSubgroup) -> None:
        sub.closed = True
        self._outgoing.pop(sub.stream_id, None)
        req = self._requests.get(sub.request_id)
        if req is not None:
            req.data_streams.discard(sub.stream_id)
            self._maybe_forget(req)

    def _fetch_to_serve(self, request_id: int) -> _Request:
        self._check_open()
        req = self._requests.get(request_id)
        if req is None or req.local or req.state.kind != _FETCH:
            raise UsageError(f"{request_id} is not a FETCH we are serving")
        if req.state.states[_RESP] is _DONE:
            raise UsageError(f"FETCH {request_id} was rejected")
        return req

    def _fetch_stream(self, req: _Request) -> FetchObjectEncoder:
        if req.fetch_encoder is None:
            group_order = req.fetch.parameters.group_order if req.fetch is not None else None
            req.fetch_encoder = FetchObjectEncoder(group_order or GroupOrder.ASCENDING)
            stream_id = self._allocate_stream(unidirectional=True)
            req.fetch_data_stream = stream_id
            req.data_streams.add(stream_id)
            self._send(stream_id, encode_fetch_header(FetchHeader(req.request_id)))
        return req.fetch_encoder


def _range_end_before(end: Location, start: Location) -> bool:
    """True when a FETCH End Location (last Object plus 1, or {G, 0} for all of G) ends before ``start``."""
    if end.object == 0:
        return end.group < start.group
    return Location(end.group, end.object - 1) < start
