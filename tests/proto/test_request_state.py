"""proto/request_state.py: the request transition table and per-stream state machine, without a session."""

from __future__ import annotations

import pytest

from proto.errors import UsageError
from proto.messages import (
    MESSAGE_TYPES,
    Fetch,
    FetchOk,
    Namespace,
    Publish,
    PublishDone,
    PublishNamespace,
    RequestError,
    RequestOk,
    RequestUpdate,
    Subscribe,
    SubscribeNamespace,
    SubscribeOk,
    SubscribeTracks,
    TrackStatus,
)
from proto.request_state import (
    FIN_ENDS_REQUEST,
    KIND_NAMES,
    REQUEST_TYPES,
    TRANSITIONS,
    RequestState,
    RequestStateMachine,
    RequestTransitionError,
    Side,
    can_send_more,
    next_request_state,
)
from proto.session import SessionConfig
from tests.helpers.sessions import SessionPair

REQ, RESP = Side.REQUESTER, Side.RESPONDER
IDLE, OPEN, ACCEPTED, DONE = RequestState.IDLE, RequestState.OPEN, RequestState.ACCEPTED, RequestState.DONE
OK, ERR, UPD = RequestOk.TYPE, RequestError.TYPE, RequestUpdate.TYPE


def _machine(kind: int) -> RequestStateMachine:
    machine = RequestStateMachine()
    machine.open(kind)
    return machine


def _send(machine: RequestStateMachine, side: Side, msg_type: int) -> tuple[int, ...]:
    return machine.apply(machine.check(side, msg_type))


def test_every_request_kind_has_both_sides_and_a_name() -> None:
    assert {kind for kind, _ in TRANSITIONS} == REQUEST_TYPES == set(KIND_NAMES)
    assert {side for _, side in TRANSITIONS} == {REQ, RESP}
    assert len(TRANSITIONS) == 2 * len(REQUEST_TYPES)
    for kind in REQUEST_TYPES:
        # The request message is the requester's only way out of IDLE.
        assert TRANSITIONS[(kind, REQ)][IDLE] == {kind: OPEN}
    assert {kind for kind, _ in FIN_ENDS_REQUEST} <= REQUEST_TYPES


def test_every_unlisted_pair_is_a_typed_error() -> None:
    for (kind, side), states in TRANSITIONS.items():
        for state in RequestState:
            for msg_type in MESSAGE_TYPES:
                listed = states.get(state, {}).get(msg_type)
                if listed is not None:
                    assert next_request_state(kind, side, state, msg_type) is listed
                    continue
                with pytest.raises(RequestTransitionError) as info:
                    next_request_state(kind, side, state, msg_type)
                err = info.value
                assert (err.kind, err.side, err.state, err.msg_type) == (kind, side, state, msg_type)
                assert isinstance(err, UsageError) and KIND_NAMES[kind] in str(err)


def test_subscribe_lifecycle() -> None:
    m = _machine(Subscribe.TYPE)
    assert m.states == {REQ: OPEN, RESP: IDLE} and m.name == "SUBSCRIBE"
    t = m.check(RESP, SubscribeOk.TYPE)
    assert t.first_reply and not t.answers_update and not t.fin and t.new_state is ACCEPTED
    assert m.states[RESP] is IDLE  # check changes nothing
    m.apply(t)
    with pytest.raises(RequestTransitionError):
        m.check(RESP, SubscribeOk.TYPE)  # only one first reply
    done = m.check(RESP, PublishDone.TYPE)
    assert done.new_state is DONE and done.fin
    m.apply(done)
    assert not m.can_send_more(RESP) and m.can_send_more(REQ)


def test_track_status_is_one_message_each_way() -> None:
    m = _machine(TrackStatus.TYPE)
    assert not m.can_send_more(REQ)  # the requester FINs with the request
    with pytest.raises(RequestTransitionError):
        m.check(REQ, UPD)
    assert m.check(RESP, OK).fin and m.check(RESP, ERR).fin


def test_replies_after_the_first_answer_updates() -> None:
    m = _machine(Fetch.TYPE)
    _send(m, RESP, FetchOk.TYPE)
    with pytest.raises(RequestTransitionError, match="none is pending"):
        m.check(RESP, OK)
    for update_id in (10, 12, 14):
        _send(m, REQ, UPD)
        m.pending_updates[REQ].append(update_id)
    t = m.check(RESP, OK)
    assert t.answers_update and not t.first_reply
    assert m.apply(t) == (10,)
    assert _send(m, RESP, ERR) == (12, 14)  # one REQUEST_ERROR answers every outstanding update
    assert not m.pending_updates[REQ] and m.states[RESP] is ACCEPTED


def test_open_only_once_and_only_with_a_request() -> None:
    with pytest.raises(RequestTransitionError):
        RequestStateMachine().open(SubscribeOk.TYPE)
    m = _machine(PublishNamespace.TYPE)
    with pytest.raises(RequestTransitionError):
        m.open(PublishNamespace.TYPE)
    with pytest.raises(RequestTransitionError, match="not been sent"):
        RequestStateMachine().check(RESP, OK)
    assert RequestStateMachine().name == "request" and not RequestStateMachine().can_send_more(REQ)


def test_fin_ends_namespace_requests_and_an_accepted_subscribe() -> None:
    for kind in (PublishNamespace.TYPE, SubscribeNamespace.TYPE, SubscribeTracks.TYPE):
        m = _machine(kind)
        assert m.fin_ends_request(REQ)
        _send(m, RESP, OK)
        assert m.fin_ends_request(RESP)
    m = _machine(Subscribe.TYPE)
    assert not m.fin_ends_request(REQ)  # a SUBSCRIBE is ended by its publisher, not its FIN
    _send(m, RESP, SubscribeOk.TYPE)
    assert m.fin_ends_request(RESP)
    _send(m, RESP, PublishDone.TYPE)
    assert not m.fin_ends_request(RESP)  # DONE: the FIN only closes the side
    assert not _machine(Publish.TYPE).fin_ends_request(REQ)


def test_namespace_messages_only_after_acceptance() -> None:
    assert not can_send_more(SubscribeNamespace.TYPE, RESP, DONE)
    with pytest.raises(RequestTransitionError):
        next_request_state(SubscribeNamespace.TYPE, RESP, IDLE, Namespace.TYPE)
    assert next_request_state(SubscribeNamespace.TYPE, RESP, ACCEPTED, Namespace.TYPE) is ACCEPTED


def test_the_session_reports_a_broken_transition_per_side() -> None:
    # Ours: the typed error reaches the caller (a UsageError); nothing is sent.
    pair = SessionPair(SessionConfig(is_client=True), SessionConfig(is_client=False))
    pair.setup()
    rid = pair.client.track_status((b"kvnet",), b"t")
    pair.run()
    with pytest.raises(RequestTransitionError):
        pair.client.request_update(rid)
    assert pair.client.transmit() == [] and pair.client.closed is None
