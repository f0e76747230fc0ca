"""What each request of one connection is waiting on, and the session's request events delivered to it.

Owns: ``RequestRouter``, the per-request tables of one ``MoqtConnection`` (answers awaited as futures,
object handles of ``kvnet.net.handles``, the peer's open requests, listeners of our SUBSCRIBE_NAMESPACE,
subscriptions waiting for their trailing streams after PUBLISH_DONE, the object bytes queued for the
application), and one handler per request event kind (``RequestRouter.ROUTES``). Events of the session as
a whole (SETUP, its end, GOAWAY, new peer requests) stay with the connection, whose one table from event
kind to handler includes these. Called from QUIC callbacks: nothing here awaits.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any, ClassVar

from kvnet.net.errors import ConnectionClosed, LimitError, RequestRejected, StreamResetError
from kvnet.net.handles import FetchHandle, IncomingFetch, IncomingRequest, Subscription, _ObjectStream
from kvnet.net.limits import ConnectionLimits
from proto import events as me
from proto.errors import StreamResetCode
from proto.session import MoqtSession

# Smallest size at which the table of incoming requests is swept of answered ones.
_INCOMING_PRUNE_MIN = 256

NamespaceListener = Callable[[me.NamespaceReceived | me.NamespaceDoneReceived], None]
"""Receives the NAMESPACE / NAMESPACE_DONE of one of our SUBSCRIBE_NAMESPACE requests."""

CancelRequest = Callable[[int, StreamResetCode], None]
"""Stops delivering a request's objects and cancels it in the session (``MoqtConnection._cancel``)."""


class RequestRouter:
    """The requests of one connection, by Request ID, and the delivery of their events."""

    ROUTES: ClassVar[dict[type[me.MoqtEvent], Callable[[RequestRouter, Any], None]]]
    """Request event kind -> its handler (set below the class)."""

    def __init__(
        self,
        session: MoqtSession,
        limits: ConnectionLimits,
        loop: asyncio.AbstractEventLoop,
        log: logging.LoggerAdapter[logging.Logger],
        other_events: deque[me.MoqtEvent],
        cancel: CancelRequest,
    ) -> None:
        self._session = session
        self._limits = limits
        self._loop = loop
        self._log = log
        self._other_events = other_events
        """The connection's ``other_events``: what arrives for a request nobody consumes it for."""
        self._cancel = cancel
        self._answers: dict[int, asyncio.Future[Any]] = {}
        self._objects: dict[int, _ObjectStream] = {}
        self._namespace_listeners: dict[int, NamespaceListener] = {}
        """Our SUBSCRIBE_NAMESPACE requests whose NAMESPACE / NAMESPACE_DONE go to a callback."""
        self._trailing: dict[int, float] = {}
        """Subscriptions past PUBLISH_DONE whose announced streams are still open, by request id: when
        bytes of theirs last arrived (see ``_await_trailing_streams``)."""
        self._incoming: dict[int, IncomingRequest] = {}
        # Answered requests are dropped from the table when it reaches this size (see remember_incoming).
        self._incoming_prune_at = _INCOMING_PRUNE_MIN
        self.received_bytes = 0
        """Object bytes queued by the handles for the application and not yet consumed, over all requests."""

    # ---- what the connection records as it sends requests and receives the peer's

    def expect_answer(self, request_id: int) -> asyncio.Future[Any]:
        """A future resolved with the answer to our request ``request_id`` (raising ``RequestRejected`` on
        REQUEST_ERROR, ``ConnectionClosed`` if it is cancelled or the session ends)."""
        fut: asyncio.Future[Any] = self._loop.create_future()
        self._answers[request_id] = fut
        return fut

    def forget_answer(self, request_id: int) -> None:
        """Nobody waits for the answer to ``request_id`` any more."""
        self._answers.pop(request_id, None)

    def listen_namespaces(self, request_id: int, listener: NamespaceListener) -> None:
        """Send the NAMESPACE / NAMESPACE_DONE of our SUBSCRIBE_NAMESPACE ``request_id`` to ``listener``."""
        self._namespace_listeners[request_id] = listener

    def stop_listening(self, request_id: int) -> None:
        self._namespace_listeners.pop(request_id, None)

    def deliver_objects(self, request_id: int, objects: _ObjectStream) -> None:
        """Route the objects and the end of request ``request_id`` to ``objects``."""
        self._objects[request_id] = objects

    def objects(self, request_id: int) -> _ObjectStream | None:
        """The handle the objects of ``request_id`` go to, if any."""
        return self._objects.get(request_id)

    def stop_delivering(self, request_id: int) -> _ObjectStream | None:
        """Route nothing more to the handle of ``request_id``; returns that handle, if there was one."""
        return self._objects.pop(request_id, None)

    def remember_incoming(self, req: IncomingRequest) -> None:
        """Keep ``req`` findable by id for cancellations. The session ends requests without an event
        (answered, finished), so the table is swept of the ones it no longer knows whenever it has doubled
        since the last sweep: amortised O(1) per request, and a long session's table stays as large as
        its open requests rather than growing with every request ever answered."""
        if len(self._incoming) >= self._incoming_prune_at:
            session = self._session
            self._incoming = {rid: inc for rid, inc in self._incoming.items() if session.request_is_open(rid)}
            self._incoming_prune_at = max(_INCOMING_PRUNE_MIN, 2 * len(self._incoming))
        self._incoming[req.request_id] = req

    @property
    def requests_in_flight(self) -> int:
        """What a session that got GOAWAY finishes before it is closed: our requests awaiting their answer
        or still delivering objects (fetches, subscriptions), and the peer's FETCHes still being served.
        Standing requests (our SUBSCRIBE_NAMESPACE and PUBLISH_NAMESPACE once answered) do not count: they
        are made again on the next session, so they would only hold this one open."""
        session = self._session
        serving = sum(1 for rid, inc in self._incoming.items()
                      if isinstance(inc, IncomingFetch) and session.request_is_open(rid))
        return len(self._answers) + len(self._objects) + serving

    @property
    def open_incoming(self) -> int:
        """Incoming requests still tracked (open ones, plus answered ones until the next sweep)."""
        return len(self._incoming)

    def data_arrived(self, stream_id: int, now: float) -> None:
        """Bytes arrived on ``stream_id``: a subscription waiting for its trailing streams sees progress
        (part of a large object counts too)."""
        if self._trailing and (rid := self._session.data_stream_request(stream_id)) in self._trailing:
            self._trailing[rid] = now

    def fail_all(self, err: ConnectionClosed) -> None:
        """The session ended: every request fails with ``err``, every peer request is cancelled."""
        for fut in self._answers.values():
            if not fut.done():
                fut.set_exception(err)
        self._answers.clear()
        for st in self._objects.values():
            st._finish(err)
        self._objects.clear()
        for inc in self._incoming.values():
            inc.cancelled.set()

    # ---- the handlers of ``ROUTES``, one per event kind

    def _on_object(self, ev: me.ObjectReceived) -> None:
        st = self._objects.get(ev.request_id)
        if st is not None and not st.finished:
            st._push(ev)
            if self.received_bytes > self._limits.max_receive_buffer:
                self._log.warning("request %d exceeds the receive buffer; cancelling", ev.request_id)
                self._cancel(ev.request_id, StreamResetCode.EXCESSIVE_LOAD)
                st._finish(LimitError(f"receive buffer limit {self._limits.max_receive_buffer} reached"))

    def _on_request_error(self, ev: me.RequestErrorReceived) -> None:
        err = RequestRejected(ev.error_code, ev.reason, ev.retry_interval)
        self._resolve(ev.request_id, error=err)
        if (st := self._objects.pop(ev.request_id, None)) is not None:
            st._finish(err)

    def _on_fetch_ok(self, ev: me.FetchOkReceived) -> None:
        st = self._objects.get(ev.request_id)
        if isinstance(st, FetchHandle) and not st._ok.done():
            st._ok.set_result(ev)
            if st.data_complete:
                del self._objects[ev.request_id]
                st._finish(None)

    def _on_publish_done(self, ev: me.PublishDoneReceived) -> None:
        st = self._objects.get(ev.request_id)
        if isinstance(st, Subscription):
            st.done = ev
            if st.streams_closed >= ev.stream_count:
                self._end_subscription(st)
            elif st.request_id not in self._trailing:
                # Subgroup streams announced by the Stream Count are still in flight.
                self._await_trailing_streams(st)
        elif st is not None:
            self._objects.pop(ev.request_id, None)
            st._finish(None)

    def _on_subgroup_closed(self, ev: me.SubgroupClosed) -> None:
        st = self._objects.get(ev.request_id)
        if isinstance(st, Subscription):
            st.streams_closed += 1
            if not st.finished:
                st._push_stream_end(ev)
            if st.done is not None and st.streams_closed >= st.done.stream_count:
                self._end_subscription(st)
        else:
            self._other_events.append(ev)

    def _on_fetch_completed(self, ev: me.FetchCompleted) -> None:
        st = self._objects.get(ev.request_id)
        if isinstance(st, FetchHandle) and not st._ok.done():
            # The fetch stream and FETCH_OK travel on different streams: the data can all arrive first.
            # The fetch completes once FETCH_OK is in too.
            st.data_complete = True
        elif st is not None:
            del self._objects[ev.request_id]
            st._finish(None)

    def _on_fetch_stream_reset(self, ev: me.FetchStreamReset) -> None:
        if (st := self._objects.pop(ev.request_id, None)) is not None:
            st._finish(StreamResetError(ev.error_code, ev.reason))

    def _on_subscribe_ok(self, ev: me.SubscribeOkReceived) -> None:
        st = self._objects.get(ev.request_id)
        if isinstance(st, Subscription):
            st.ok = ev
        self._resolve(ev.request_id, ev)

    def _on_answer(self, ev: me.TrackStatusOkReceived | me.RequestOkReceived | me.PublishOkReceived) -> None:
        self._resolve(ev.request_id, ev)

    def _on_request_cancelled(self, ev: me.RequestCancelled) -> None:
        if (inc := self._incoming.pop(ev.request_id, None)) is not None:
            inc.cancelled.set()
        if (st := self._objects.pop(ev.request_id, None)) is not None:
            st._finish(ConnectionClosed(ev.error_code or 0, "request cancelled"))
        self._resolve(ev.request_id, error=ConnectionClosed(ev.error_code or 0, "request cancelled"))

    def _on_data_stream_stopped(self, ev: me.DataStreamStopped) -> None:
        # A FETCH has one data stream: the requester stopping it abandons the request.
        inc = self._incoming.get(ev.request_id)
        if isinstance(inc, IncomingFetch):
            del self._incoming[ev.request_id]
            inc.cancelled.set()
        self._other_events.append(ev)

    def _on_namespace(self, ev: me.NamespaceReceived | me.NamespaceDoneReceived) -> None:
        listener = self._namespace_listeners.get(ev.request_id)
        if listener is None:
            self._other_events.append(ev)
        else:
            listener(ev)

    # ---- what the handlers share

    def _resolve(self, request_id: int, value: Any = None, error: BaseException | None = None) -> None:
        fut = self._answers.pop(request_id, None)
        if fut is not None and not fut.done():
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(value)

    def _await_trailing_streams(self, st: Subscription) -> None:
        """Wait for the streams a PUBLISH_DONE announced: the subscription ends only after
        ``publish_done_timeout`` in which none of its bytes arrived, so a slow path (small datagrams, a
        long push, one large object taking seconds) that is still delivering is never cut off. Arrivals
        only stamp ``_trailing`` (``data_arrived``); the one timer re-arms itself from the stamp when it
        fires."""
        self._trailing[st.request_id] = self._loop.time()
        self._loop.call_later(self._limits.publish_done_timeout, self._trailing_wait_check, st)

    def _trailing_wait_check(self, st: Subscription) -> None:
        progressed_at = self._trailing.get(st.request_id)
        if progressed_at is None or st.finished:
            self._trailing.pop(st.request_id, None)
            return
        due = progressed_at + self._limits.publish_done_timeout
        if self._loop.time() < due:
            self._loop.call_at(due, self._trailing_wait_check, st)
        else:
            self._end_subscription(st)

    def _end_subscription(self, st: Subscription) -> None:
        self._trailing.pop(st.request_id, None)
        if self._objects.get(st.request_id) is st:
            del self._objects[st.request_id]
        st._finish(None)


RequestRouter.ROUTES = {
    me.ObjectReceived: RequestRouter._on_object,
    me.RequestErrorReceived: RequestRouter._on_request_error,
    me.FetchOkReceived: RequestRouter._on_fetch_ok,
    me.PublishDoneReceived: RequestRouter._on_publish_done,
    me.SubgroupClosed: RequestRouter._on_subgroup_closed,
    me.FetchCompleted: RequestRouter._on_fetch_completed,
    me.FetchStreamReset: RequestRouter._on_fetch_stream_reset,
    me.SubscribeOkReceived: RequestRouter._on_subscribe_ok,
    me.TrackStatusOkReceived: RequestRouter._on_answer,
    me.RequestOkReceived: RequestRouter._on_answer,
    me.PublishOkReceived: RequestRouter._on_answer,
    me.RequestCancelled: RequestRouter._on_request_cancelled,
    me.DataStreamStopped: RequestRouter._on_data_stream_stopped,
    me.NamespaceReceived: RequestRouter._on_namespace,
    me.NamespaceDoneReceived: RequestRouter._on_namespace,
}
