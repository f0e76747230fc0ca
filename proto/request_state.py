"""The state machine of draft-18 request streams, written down as data (in the manner of h11's ``_state.py``).

Rule 1: everything that decides which control message may follow which on a request stream lives here:
the transition table, which FIN ends a request rather than half-closing it, and which REQUEST_UPDATE a
later REQUEST_OK / REQUEST_ERROR answers. Rule 2: this module does not know which side we are, what the
messages carry, or anything about streams and bytes: the side is a parameter and messages are their type
numbers. An unlisted (kind, side, state, message) is a ``RequestTransitionError``; the session reports it
as ``UsageError`` for our own calls and as a PROTOCOL_VIOLATION for the peer's messages.
"""

from __future__ import annotations

from collections import deque
from enum import Enum
from typing import Final, NamedTuple

from .errors import UsageError
from .messages import (
    MESSAGE_TYPES,
    Fetch,
    FetchOk,
    Namespace,
    NamespaceDone,
    Publish,
    PublishBlocked,
    PublishDone,
    PublishNamespace,
    PublishOk,
    RequestError,
    RequestOk,
    RequestUpdate,
    Subscribe,
    SubscribeNamespace,
    SubscribeOk,
    SubscribeTracks,
    TrackStatus,
)

__all__ = [
    "FIN_ENDS_REQUEST",
    "KIND_NAMES",
    "REQUEST_CLASSES",
    "REQUEST_TYPES",
    "TRANSITIONS",
    "RequestState",
    "RequestStateMachine",
    "RequestTransitionError",
    "Side",
    "Transition",
    "can_send_more",
    "next_request_state",
    "other_side",
]


class Side(Enum):
    """Which end of a request stream sends a message."""

    REQUESTER = "requester"
    RESPONDER = "responder"

    # Members are singletons compared by identity; the identity hash keeps the table lookups done for
    # every message in C (Enum's own __hash__ is a Python call).
    __hash__ = object.__hash__


class RequestState(Enum):
    """State of one side of a request stream: what it has sent so far."""

    IDLE = "idle"
    """Nothing sent yet."""
    OPEN = "open"
    """Requester: the request is out."""
    ACCEPTED = "accepted"
    """Responder: the positive first reply is out."""
    DONE = "done"
    """This side has nothing more to send (the stream is FIN'd after it)."""

    __hash__ = object.__hash__  # as Side's


_IDLE, _OPEN, _ACCEPTED, _DONE = (
    RequestState.IDLE,
    RequestState.OPEN,
    RequestState.ACCEPTED,
    RequestState.DONE,
)
_REQ, _RESP = Side.REQUESTER, Side.RESPONDER

_SUB, _PUB, _FETCH, _TS = Subscribe.TYPE, Publish.TYPE, Fetch.TYPE, TrackStatus.TYPE
_PNS, _SNS, _STR = PublishNamespace.TYPE, SubscribeNamespace.TYPE, SubscribeTracks.TYPE
_OK, _ERR, _UPD = RequestOk.TYPE, RequestError.TYPE, RequestUpdate.TYPE

# Messages that may begin a request stream (section "Session initialization"); a request's kind is the
# type of its first message.
REQUEST_CLASSES: Final = (
    Subscribe,
    Publish,
    Fetch,
    TrackStatus,
    PublishNamespace,
    SubscribeNamespace,
    SubscribeTracks,
)
REQUEST_TYPES: Final = frozenset(cls.TYPE for cls in REQUEST_CLASSES)

# (request kind, sending side) -> state -> {message type: next state}. Sources: sections "Subscriptions",
# "Fetch State Management", "REQUEST_OK", "REQUEST_UPDATE", "TRACK_STATUS", "PUBLISH_NAMESPACE",
# "SUBSCRIBE_NAMESPACE", "SUBSCRIBE_TRACKS". REQUEST_OK/REQUEST_ERROR after the first reply answer
# a REQUEST_UPDATE of the other side (``RequestStateMachine.check``: one reply per outstanding update).
TRANSITIONS: Final[dict[tuple[int, Side], dict[RequestState, dict[int, RequestState]]]] = {
    (_SUB, _REQ): {_IDLE: {_SUB: _OPEN}, _OPEN: {_UPD: _OPEN}},
    (_SUB, _RESP): {
        _IDLE: {SubscribeOk.TYPE: _ACCEPTED, _ERR: _DONE},
        _ACCEPTED: {_OK: _ACCEPTED, _ERR: _ACCEPTED, PublishDone.TYPE: _DONE},
    },
    # PUBLISH: the requester is the publisher; the subscriber may REQUEST_UPDATE once accepted.
    (_PUB, _REQ): {_IDLE: {_PUB: _OPEN}, _OPEN: {_OK: _OPEN, _ERR: _OPEN, PublishDone.TYPE: _DONE}},
    (_PUB, _RESP): {
        _IDLE: {_OK: _ACCEPTED, PublishOk.TYPE: _ACCEPTED, _ERR: _DONE},
        _ACCEPTED: {_UPD: _ACCEPTED},
    },
    (_FETCH, _REQ): {_IDLE: {_FETCH: _OPEN}, _OPEN: {_UPD: _OPEN}},
    (_FETCH, _RESP): {
        _IDLE: {FetchOk.TYPE: _ACCEPTED, _ERR: _DONE},
        _ACCEPTED: {_OK: _ACCEPTED, _ERR: _ACCEPTED},
    },
    # TRACK_STATUS is "the first and only message" and is answered once.
    (_TS, _REQ): {_IDLE: {_TS: _OPEN}},
    (_TS, _RESP): {_IDLE: {_OK: _DONE, _ERR: _DONE}},
    (_PNS, _REQ): {_IDLE: {_PNS: _OPEN}, _OPEN: {_UPD: _OPEN}},
    (_PNS, _RESP): {_IDLE: {_OK: _ACCEPTED, _ERR: _DONE}, _ACCEPTED: {_OK: _ACCEPTED, _ERR: _ACCEPTED}},
    (_SNS, _REQ): {_IDLE: {_SNS: _OPEN}, _OPEN: {_UPD: _OPEN}},
    (_SNS, _RESP): {
        _IDLE: {_OK: _ACCEPTED, _ERR: _DONE},
        _ACCEPTED: {
            Namespace.TYPE: _ACCEPTED,
            NamespaceDone.TYPE: _ACCEPTED,
            _OK: _ACCEPTED,
            _ERR: _ACCEPTED,
        },
    },
    (_STR, _REQ): {_IDLE: {_STR: _OPEN}, _OPEN: {_UPD: _OPEN}},
    (_STR, _RESP): {
        _IDLE: {_OK: _ACCEPTED, _ERR: _DONE},
        _ACCEPTED: {PublishBlocked.TYPE: _ACCEPTED, _OK: _ACCEPTED, _ERR: _ACCEPTED},
    },
}

# A FIN from this side ends the request (rather than only half-closing it) while the side is not DONE:
# namespace requests are "cancelled by closing the stream", and a publisher closing an accepted
# SUBSCRIBE without PUBLISH_DONE ends the subscription.
FIN_ENDS_REQUEST: Final = frozenset(
    {(_SUB, _RESP), (_PNS, _REQ), (_PNS, _RESP), (_SNS, _REQ), (_SNS, _RESP), (_STR, _REQ), (_STR, _RESP)}
)

KIND_NAMES: Final = {
    _SUB: "SUBSCRIBE",
    _PUB: "PUBLISH",
    _FETCH: "FETCH",
    _TS: "TRACK_STATUS",
    _PNS: "PUBLISH_NAMESPACE",
    _SNS: "SUBSCRIBE_NAMESPACE",
    _STR: "SUBSCRIBE_TRACKS",
}


def _message_name(msg_type: int) -> str:
    cls = MESSAGE_TYPES.get(msg_type)
    return cls.__name__ if cls is not None else f"message {msg_type:#x}"


class RequestTransitionError(UsageError):
    """A message the table does not allow: ``side`` may not send ``msg_type`` on a ``kind`` request in
    ``state`` (or a REQUEST_OK/REQUEST_ERROR answers no outstanding REQUEST_UPDATE)."""

    def __init__(
        self, kind: int | None, side: Side, state: RequestState, msg_type: int, why: str = ""
    ) -> None:
        name = KIND_NAMES.get(kind, "request") if kind is not None else "request"
        allowed = f"{_message_name(msg_type)} not allowed from the {side.value} of a {name}"
        super().__init__(why or f"{allowed} in state {state.value}")
        self.kind = kind
        self.side = side
        self.state = state
        self.msg_type = msg_type


def other_side(side: Side) -> Side:
    return _RESP if side is _REQ else _REQ


def next_request_state(kind: int, side: Side, state: RequestState, msg_type: int) -> RequestState:
    """The state after ``side`` sends ``msg_type`` on a ``kind`` request stream in ``state``; raises
    ``RequestTransitionError`` when the table does not list it."""
    new_state = TRANSITIONS[(kind, side)].get(state, {}).get(msg_type)
    if new_state is None:
        raise RequestTransitionError(kind, side, state, msg_type)
    return new_state


def can_send_more(kind: int, side: Side, state: RequestState) -> bool:
    """Whether ``side`` may still send anything in ``state`` (if not, it FINs)."""
    return bool(TRANSITIONS[(kind, side)].get(state))


class Transition(NamedTuple):
    """One message checked against the table, not applied yet (``RequestStateMachine.apply``). A named
    tuple: one is built for every message on every request stream."""

    side: Side
    """Who sends the message."""
    msg_type: int
    """Its control message type."""
    new_state: RequestState
    """The sender's state after it."""
    first_reply: bool
    """It is the responder's first reply, accepting or refusing the request."""
    answers_update: bool
    """It is a REQUEST_OK/REQUEST_ERROR answering the other side's oldest outstanding REQUEST_UPDATE
    (a REQUEST_ERROR answers every outstanding one, section "REQUEST_UPDATE")."""
    fin: bool
    """The sender has nothing more to send after it and closes its side of the stream."""


class RequestStateMachine:
    """Both sides of one request stream: the kind of request, each side's state, and the Request IDs of
    the REQUEST_UPDATEs each side sent that the other has not answered yet."""

    def __init__(self) -> None:
        self.kind: int | None = None
        """Type of the request's first message; None until it is known."""
        self.states: dict[Side, RequestState] = {_REQ: _IDLE, _RESP: _IDLE}
        self.pending_updates: dict[Side, deque[int]] = {_REQ: deque(), _RESP: deque()}
        """Side -> Request IDs of its REQUEST_UPDATEs not answered yet, oldest first."""

    @property
    def name(self) -> str:
        """The request kind's name for messages ("SUBSCRIBE", ...), "request" while unknown."""
        return KIND_NAMES.get(self.kind, "request") if self.kind is not None else "request"

    def open(self, kind: int) -> None:
        """The requester sent the request itself, a message of type ``kind``."""
        if self.kind is not None or kind not in REQUEST_TYPES:
            raise RequestTransitionError(self.kind, _REQ, self.states[_REQ], kind)
        self.kind = kind
        self.states[_REQ] = TRANSITIONS[(kind, _REQ)][_IDLE][kind]

    def check(self, side: Side, msg_type: int) -> Transition:
        """``side`` sending ``msg_type`` now, checked against the table without changing anything."""
        kind = self.kind
        state = self.states[side]
        if kind is None:
            raise RequestTransitionError(None, side, state, msg_type, "the request has not been sent yet")
        table = TRANSITIONS[(kind, side)]
        new_state = table.get(state, {}).get(msg_type)
        if new_state is None:
            raise RequestTransitionError(kind, side, state, msg_type)
        first_reply = side is _RESP and state is _IDLE
        answers_update = not first_reply and (msg_type in (_OK, _ERR))
        if answers_update and not self.pending_updates[_REQ if side is _RESP else _RESP]:
            raise RequestTransitionError(
                kind, side, state, msg_type,
                f"{_message_name(msg_type)} after the first reply answers a REQUEST_UPDATE; none is pending",
            )
        return Transition(side, msg_type, new_state, first_reply, answers_update, not table.get(new_state))

    def apply(self, transition: Transition) -> tuple[int, ...]:
        """Make a checked ``transition`` happen; returns the Request IDs of the updates it answered."""
        self.states[transition.side] = transition.new_state
        if not transition.answers_update:
            return ()
        pending = self.pending_updates[other_side(transition.side)]
        if transition.msg_type == _ERR:
            answered = tuple(pending)  # one REQUEST_ERROR answers every coalesced update
            pending.clear()
            return answered
        return (pending.popleft(),)

    def can_send_more(self, side: Side) -> bool:
        """Whether ``side`` may still send anything."""
        return self.kind is not None and can_send_more(self.kind, side, self.states[side])

    def fin_ends_request(self, side: Side) -> bool:
        """A FIN from ``side`` now ends the request rather than only closing that side."""
        return (self.kind, side) in FIN_ENDS_REQUEST and self.states[side] is not _DONE
