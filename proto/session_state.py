"""The session's state and the records it keeps per request and per stream.

Owns: ``SessionState``, the base of every part of ``MoqtSession`` (its ``__init__`` creates all session
state, plus the output helpers every part uses: ``_send``, ``_allocate_stream``, the open/initiated
checks), and the records ``RequestStream``, ``SubscribedTrack``, ``IncomingStream``, ``OutgoingSubgroup``,
``MessageContext``. The parts are mixins over this one state, so a call between them is a plain method
call (no forwarding on the per-message path). Knows no wire format beyond the readers it creates."""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, TypeAlias

from .data import (
    DataStreamReader,
    FetchObjectEncoder,
    SubgroupHeader,
)
from .errors import (
    ProtocolError,
    SessionErrorCode,
    UsageError,
)
from .events import (
    MoqtEvent,
)
from .messages import (
    ControlMessage,
    ControlMessageReader,
    Fetch,
    Location,
    Publish,
    PublishNamespace,
    Setup,
    Subscribe,
    SubscribeNamespace,
    SubscribeTracks,
    TrackNamespace,
    TrackStatus,
)
from .request_state import (
    RequestState,
    RequestStateMachine,
    Side,
)
from .session_config import (
    SendStreamData,
    SessionConfig,
    StreamIdAllocator,
    Transmit,
)
from .session_limits import HandledPeerStreams, PeerRequestIds

# The session logs under one name, whichever of its parts does the logging.
logger = logging.getLogger("proto.session")

# -- request state machine (proto/request_state.py) ---------------------------------------------

IDLE, ACCEPTED, DONE = RequestState.IDLE, RequestState.ACCEPTED, RequestState.DONE
REQ, RESP = Side.REQUESTER, Side.RESPONDER

K_SUB, K_PUB, K_FETCH, K_TS = Subscribe.TYPE, Publish.TYPE, Fetch.TYPE, TrackStatus.TYPE
K_PNS, K_SNS, K_STR = PublishNamespace.TYPE, SubscribeNamespace.TYPE, SubscribeTracks.TYPE


# -- per-stream bookkeeping ---------------------------------------------------------------------


def control_reader(config: SessionConfig) -> ControlMessageReader:
    # The session bounds buffered bytes per stream itself (before and after SETUP), so the
    # reader only enforces the message size limit, from the Length field.
    return ControlMessageReader(max_buffer=None, max_message_size=config.max_control_message_size)


@dataclass(eq=False)
class RequestStream:
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
        return REQ if self.local else RESP

    @property
    def peer_side(self) -> Side:
        return RESP if self.local else REQ

    @property
    def name(self) -> str:
        return self.state.name


@dataclass(eq=False)
class SubscribedTrack:
    """Subscriber side: a Track Alias the peer (as publisher) assigned to one of our subscriptions."""

    request_id: int
    full_track_name: tuple[TrackNamespace, bytes]
    active: bool = True
    """False once we cancelled: late objects are dropped, late streams stopped."""
    established: bool = True
    """The subscription is live (not ended by PUBLISH_DONE, REQUEST_ERROR or cancellation)."""


class DataStreamKind(Enum):
    UNKNOWN = "unknown"
    CONTROL = "control"
    PADDING = "padding"
    SUBGROUP = "subgroup"
    FETCH = "fetch"


@dataclass(eq=False)
class IncomingStream:
    """A peer-initiated unidirectional stream."""

    stream_id: int
    reader: DataStreamReader
    kind: DataStreamKind = DataStreamKind.UNKNOWN
    header: SubgroupHeader | None = None
    request_id: int | None = None
    discarding: bool = False
    """We sent STOP_SENDING (or the stream is over for us): ignore anything further."""
    fin: bool = False
    counted: bool = False
    objects: int = 0
    """Objects read from it so far."""


@dataclass(eq=False)
class OutgoingSubgroup:
    """A subgroup stream we opened."""

    stream_id: int
    header: SubgroupHeader
    request_id: int
    prev_object_id: int | None = None
    closed: bool = False
    stopped: bool = False
    """The peer sent STOP_SENDING: further objects are dropped quietly."""


@dataclass(frozen=True, slots=True)
class MessageContext:
    """What the receive path knows about a message before its handler runs."""

    request: RequestStream | None
    """The request stream it came on (None: the control stream)."""
    initial_reply: bool = False
    """It is the responder's first reply to the request."""
    answers: int | None = None
    """For a reply to a REQUEST_UPDATE: that update's Request ID."""


MessageHandler: TypeAlias = Callable[[MessageContext, ControlMessage], None]


def is_local_stream(stream_id: int, is_client: bool) -> bool:
    # RFC 9000 section 2.1: bit 0 is the initiator (0 client), bit 1 the direction (1 uni).
    return (stream_id & 1) == (0 if is_client else 1)


def is_uni_stream(stream_id: int) -> bool:
    return bool(stream_id & 2)


def range_end_before(end: Location, start: Location) -> bool:
    """True when a FETCH End Location (last Object plus 1, or {G, 0} for all of G) ends before ``start``."""
    if end.object == 0:
        return end.group < start.group
    return Location(end.group, end.object - 1) < start


class SessionState:
    """The state shared by the parts of ``MoqtSession`` (``RequestStreams``,
    ``ControlMessages``, ``DataStreams``, ``ObjectSending``) and the helpers they all use."""

    def __init__(self, config: SessionConfig, streams: StreamIdAllocator) -> None:
        self.config = config
        self._streams = streams
        self._events: deque[MoqtEvent] = deque()
        self._transmits: list[Transmit] = []
        self.closed: tuple[int, str] | None = None
        """(error code, reason) once the session is over, whoever ended it."""
        self._initiated = False
        self._control_stream_id: int | None = None
        self._peer_control: IncomingStream | None = None
        self._peer_control_framer = control_reader(config)
        self._peer_setup: Setup | None = None
        self._setup_reported = False
        self._next_local_stream = {False: -1, True: -1}
        self._next_request_id = 0 if config.is_client else 1
        self._peer_ids = PeerRequestIds(1 if config.is_client else 0, config.max_out_of_order_request_ids)
        self._requests: dict[int, RequestStream] = {}
        """Request ID -> request, for requests still alive (ours and the peer's)."""
        self._bidi: dict[int, RequestStream] = {}
        """Stream id -> request, while the bidirectional stream is open in some direction."""
        self._updates: dict[int, RequestStream] = {}
        """Peer REQUEST_UPDATE Request ID -> request it updates, until we answer it."""
        self._incoming: dict[int, IncomingStream] = {}
        self._seen_bidi = HandledPeerStreams(4 * self.config.max_requests_in_flight + 1024)
        self._seen_uni = HandledPeerStreams(4 * self.config.max_data_streams + 1024)
        self._data_streams_open = 0
        self._peer_requests_open = 0
        self._pending_alias: dict[int, list[IncomingStream]] = {}
        """Subgroup streams waiting for the SUBSCRIBE_OK / PUBLISH that defines their Track Alias."""
        self._sub_tracks: dict[int, SubscribedTrack] = {}
        """Subscriber side: Track Alias -> subscription (active ones and recently ended ones)."""
        self._retired_sub_aliases: OrderedDict[int, None] = OrderedDict()
        """Aliases of ended subscriptions in the order they ended, so the oldest are forgotten first."""
        self._pub_aliases: dict[int, int] = {}
        """Publisher side: Track Alias we assigned -> Request ID of the subscription."""
        self._outgoing: dict[int, OutgoingSubgroup] = {}
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

    _handlers: dict[int, MessageHandler]
    """Control message type -> its handler (``MoqtSession`` builds the table)."""

    @property
    def is_client(self) -> bool:
        return self.config.is_client

    @property
    def established(self) -> bool:
        """Our SETUP is queued and the peer's SETUP has arrived."""
        return self._initiated and self._peer_setup is not None and self.closed is None

    if TYPE_CHECKING:
        # What one part of the session calls in another (MoqtSession composes them all).
        def close(self, code: SessionErrorCode = SessionErrorCode.NO_ERROR, reason: str = "") -> None: ...
        def _end_request(self, req: RequestStream) -> None: ...
        def _maybe_forget(self, req: RequestStream) -> None: ...
        def _fin_our_side(self, req: RequestStream) -> None: ...
        def _peer_cancelled(self, req: RequestStream, error_code: int) -> None: ...
        def _pump_request(self, req: RequestStream) -> None: ...
        def _on_control_bytes(self, data: bytes | bytearray | memoryview, end_stream: bool) -> None: ...
        def _pump_data(self, stream: IncomingStream) -> None: ...
        def _abandon_incoming(self, stream: IncomingStream, code: int, report: bool = True) -> None: ...
        def _bind_sub_alias(self, req: RequestStream, track_alias: int) -> None: ...
        def _retire_sub_track(self, track_alias: int, track: SubscribedTrack) -> None: ...
        def _release_pending_alias(self, track_alias: int) -> None: ...

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
        if not is_local_stream(stream_id, self.is_client) or is_uni_stream(stream_id) != unidirectional:
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

