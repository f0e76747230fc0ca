"""kvnet.net.routing: ``RequestRouter`` fed session events by hand, on a real (unconnected) session; the
same events over real connections are ``test_connection.py``'s."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any

import pytest

from kvnet.net.errors import ConnectionClosed, LimitError, RequestRejected
from kvnet.net.handles import FetchHandle
from kvnet.net.limits import ConnectionLimits
from kvnet.net.routing import RequestRouter
from proto import events as me
from proto.errors import RequestErrorCode, StreamResetCode
from proto.session import MoqtSession, SessionConfig
from tests.helpers.sessions import InMemoryStreams


class Routed:
    """A router with what a ``MoqtConnection`` gives it, standing in for the connection as the
    ``RequestConnection`` of the handles it delivers to."""

    def __init__(self, limits: ConnectionLimits | None = None) -> None:
        self.session = MoqtSession(SessionConfig(is_client=True), InMemoryStreams(True))
        self.other_events: deque[me.MoqtEvent] = deque()
        self.cancelled: list[tuple[int, StreamResetCode]] = []
        self.router = RequestRouter(
            self.session, limits or ConnectionLimits(), asyncio.get_running_loop(),
            logging.LoggerAdapter(logging.getLogger(__name__)), self.other_events, self._cancel,
        )
        self.is_closed = False

    def _cancel(self, request_id: int, code: StreamResetCode) -> None:
        self.cancelled.append((request_id, code))
        self.router.stop_delivering(request_id)

    def route(self, ev: me.MoqtEvent) -> None:
        RequestRouter.ROUTES[type(ev)](self.router, ev)

    # The parts of ``RequestConnection`` a handle uses while objects are queued and it finishes.
    def objects_queued(self, nbytes: int) -> None:
        self.router.received_bytes += nbytes

    def objects_consumed(self, nbytes: int) -> None:
        self.router.received_bytes -= nbytes

    def release_request_slot(self, request_id: int) -> None:
        pass

    def handle(self, request_id: int) -> FetchHandle:
        handle = FetchHandle(self, request_id)  # type: ignore[arg-type]  # only the parts above are used
        self.router.deliver_objects(request_id, handle)
        return handle


def _object(request_id: int, payload: bytes) -> me.ObjectReceived:
    return me.ObjectReceived(request_id, None, 0, None, 0, None, 0, (), payload, "fetch")


async def test_answers_resolve_with_the_answer_or_fail_with_its_error() -> None:
    r = Routed()
    ok, rejected, cancelled = (r.router.expect_answer(rid) for rid in (1, 2, 3))
    r.route(me.RequestOkReceived(1))
    r.route(me.RequestErrorReceived(2, RequestErrorCode.DOES_NOT_EXIST, "gone", retry_interval=5))
    r.route(me.RequestCancelled(3, None))
    assert ok.result() == me.RequestOkReceived(1)
    err = rejected.exception()
    assert isinstance(err, RequestRejected) and err.code == RequestErrorCode.DOES_NOT_EXIST
    assert isinstance(cancelled.exception(), ConnectionClosed)


async def test_an_answer_nobody_waits_for_any_more_is_dropped() -> None:
    r = Routed()
    fut = r.router.expect_answer(1)
    r.router.forget_answer(1)
    r.route(me.RequestOkReceived(1))
    assert not fut.done() and not r.other_events


async def test_the_end_of_the_session_fails_every_request() -> None:
    r = Routed()
    answer = r.router.expect_answer(1)
    handle = r.handle(2)
    r.router.fail_all(ConnectionClosed(0x1, "gone"))
    assert isinstance(answer.exception(), ConnectionClosed)
    with pytest.raises(ConnectionClosed):
        await handle.read_all()
    assert r.router.objects(2) is None


async def test_namespace_events_go_to_their_listener_or_else_to_other_events() -> None:
    r = Routed()
    heard: list[Any] = []
    r.router.listen_namespaces(1, heard.append)
    mine, theirs = me.NamespaceReceived(1, (b"a",)), me.NamespaceDoneReceived(2, (b"b",))
    r.route(mine)
    r.route(theirs)
    assert heard == [mine] and list(r.other_events) == [theirs]
    r.router.stop_listening(1)
    r.route(mine)
    assert heard == [mine] and list(r.other_events) == [theirs, mine]


async def test_a_request_over_the_receive_buffer_is_cancelled() -> None:
    r = Routed(ConnectionLimits(max_receive_buffer=10))
    handle = r.handle(1)
    r.route(_object(1, b"0123456789"))
    assert r.router.received_bytes == 10 and not r.cancelled
    r.route(_object(1, b"!"))
    assert r.cancelled == [(1, StreamResetCode.EXCESSIVE_LOAD)]
    assert r.router.objects(1) is None
    with pytest.raises(LimitError):
        await handle.read_all()


async def test_objects_of_a_request_without_a_handle_are_dropped() -> None:
    r = Routed()
    r.route(_object(9, b"x"))
    assert r.router.received_bytes == 0 and not r.other_events and not r.cancelled
