"""Handles on the requests of one MoQT connection, for role code.

Owns: the requester's side (``FetchHandle``, ``Subscription``: objects queued for the application with a
terminal state) and the responder's side (``IncomingRequest`` and one subclass per request type, with the
reply methods the peer's request allows; ``INCOMING_REQUEST_TYPES`` maps each proto event to its class).
The handles only turn calls into session actions on their connection, through its named methods for
them (``RequestConnection``: ``run_action``, ``cancel_request``, ``deliver_objects``/``stop_delivering``,
``objects_queued``/``objects_consumed``, ``release_request_slot``), never its private state; the
connection (``kvnet.net.connection.MoqtConnection``) routes the session's events to them. The handles
know it only through ``RequestConnection``, so that the two modules do not import each other.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from typing import Any, Protocol

from kvnet.net.errors import ConnectionClosed, RequestRejected
from proto import events as me
from proto.data import ObjectStatus
from proto.errors import RequestErrorCode, StreamResetCode
from proto.messages import NO_PARAMETERS, Location, MessageParameters, Properties
from proto.session import MoqtSession


class RequestConnection(Protocol):
    """What a handle uses of its connection (``kvnet.net.connection.MoqtConnection`` is one)."""

    @property
    def session(self) -> MoqtSession: ...

    @property
    def is_closed(self) -> bool: ...

    def run_action(self, action: Any, *args: Any, **kwargs: Any) -> Any: ...

    def cancel_request(self, request_id: int, code: StreamResetCode = StreamResetCode.CANCELLED) -> None: ...

    def deliver_objects(self, request_id: int, objects: _ObjectStream) -> None: ...

    def stop_delivering(self, request_id: int) -> None: ...

    def objects_queued(self, nbytes: int) -> None: ...

    def objects_consumed(self, nbytes: int) -> None: ...

    def release_request_slot(self, request_id: int) -> None: ...

    def is_writable(self) -> bool: ...

    async def wait_writable(self) -> None: ...


# -------------------------------------------------------------------------------- requesters' handles


class _ObjectStream:
    """Objects of one request, queued for the application, with a terminal state."""

    def __init__(self, conn: RequestConnection, request_id: int) -> None:
        self._conn = conn
        self.request_id = request_id
        self._objects: deque[me.ObjectReceived | me.SubgroupClosed] = deque()
        """Objects, and for a subscription the ends of its subgroup streams, in arrival order."""
        self._wakeup = asyncio.Event()
        self._error: BaseException | None = None
        self._finished = False

    def _push(self, obj: me.ObjectReceived) -> None:
        self._objects.append(obj)
        self._conn.objects_queued(len(obj.payload))
        self._wakeup.set()

    def _push_stream_end(self, ev: me.SubgroupClosed) -> None:
        self._objects.append(ev)
        self._wakeup.set()

    def _finish(self, error: BaseException | None = None) -> None:
        if self._finished:
            return
        self._finished = True
        self._error = error
        self._wakeup.set()
        self._conn.release_request_slot(self.request_id)

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def session_closed(self) -> bool:
        """The session this request was sent on is over (the request did not end on its own)."""
        return self._conn.is_closed

    @property
    def queued_bytes(self) -> int:
        """Payload bytes of the objects that arrived and were not read yet."""
        return sum(len(ev.payload) for ev in self._objects if isinstance(ev, me.ObjectReceived))

    def __aiter__(self) -> AsyncIterator[me.ObjectReceived]:
        return self._iterate()

    def next_queued(self) -> me.ObjectReceived | None:
        """The next object if one has arrived already (None otherwise, also at the end): a reader that
        arms a timer per wait skips it for objects that need none. Iteration goes on after it."""
        while (ev := self.next_queued_event()) is not None:
            if isinstance(ev, me.ObjectReceived):
                return ev
        return None

    def next_queued_event(self) -> me.ObjectReceived | me.SubgroupClosed | None:
        """``next_queued``, also returning the ends of subgroup streams (``Subscription.events``)."""
        if not self._objects:
            return None
        ev = self._objects.popleft()
        if isinstance(ev, me.ObjectReceived):
            self._conn.objects_consumed(len(ev.payload))
        return ev

    async def _iterate(self) -> AsyncIterator[me.ObjectReceived]:
        async for ev in self._iterate_events():
            if isinstance(ev, me.ObjectReceived):
                yield ev

    async def _iterate_events(self) -> AsyncIterator[me.ObjectReceived | me.SubgroupClosed]:
        while True:
            while (obj := self.next_queued_event()) is not None:
                yield obj
            if self._finished:
                if self._error is not None:
                    raise self._error
                return
            self._wakeup.clear()
            await self._wakeup.wait()

    def cancel(self) -> None:
        """Abandon the request (resets its streams); iteration ends and unread objects are dropped."""
        if not self._finished:
            self._conn.cancel_request(self.request_id)
            self._finish(None)
        self._discard()

    def _discard(self) -> None:
        """Drop unread objects, giving their bytes back to the connection's receive budget."""
        while self._objects:
            ev = self._objects.popleft()
            if isinstance(ev, me.ObjectReceived):
                self._conn.objects_consumed(len(ev.payload))


class FetchHandle(_ObjectStream):
    """A FETCH in progress: ``await handle.ok()`` for FETCH_OK, ``async for obj in handle`` for objects.
    Iteration raises ``RequestRejected`` on REQUEST_ERROR and ``StreamResetError`` on a reset fetch stream."""

    def __init__(self, conn: RequestConnection, request_id: int) -> None:
        super().__init__(conn, request_id)
        self._ok: asyncio.Future[me.FetchOkReceived] = asyncio.get_running_loop().create_future()
        self.data_complete = False
        """The fetch stream ended before FETCH_OK arrived; the fetch completes with FETCH_OK."""

    async def ok(self) -> me.FetchOkReceived:
        return await asyncio.shield(self._ok)

    def _finish(self, error: BaseException | None = None) -> None:
        if not self._ok.done():
            self._ok.set_exception(error or ConnectionClosed(0, "fetch ended before FETCH_OK"))
            self._ok.exception()  # mark retrieved: iteration reports the error too
        super()._finish(error)

    async def read_all(self) -> list[me.ObjectReceived]:
        """All objects until the fetch completes."""
        return [obj async for obj in self]


class Subscription(_ObjectStream):
    """An accepted SUBSCRIBE (or an incoming PUBLISH's objects): ``ok`` is the SUBSCRIBE_OK; ``async for
    obj in sub`` until PUBLISH_DONE and then until as many subgroup streams as its Stream Count have
    ended (bounded by ``ConnectionLimits.publish_done_timeout``), so no object still in flight is lost."""

    def __init__(self, conn: RequestConnection, request_id: int) -> None:
        super().__init__(conn, request_id)
        self.ok: me.SubscribeOkReceived | None = None
        self.done: me.PublishDoneReceived | None = None
        self.streams_closed = 0
        """Subgroup streams of this subscription that ended (FIN or reset)."""

    def events(self) -> AsyncIterator[me.ObjectReceived | me.SubgroupClosed]:
        """Like ``async for obj in sub``, with the end of each subgroup stream (``SubgroupClosed``: FIN or
        reset) after its last object: what a relay needs to close its own streams exactly when the
        upstream's end (draft "Closing Subgroup Streams")."""
        return self._iterate_events()


# -------------------------------------------------------------------------------- incoming requests


class IncomingRequest:
    """A request the peer sent us (``event`` is the proto event). Answer it exactly once."""

    def __init__(self, conn: RequestConnection, event: me.MoqtEvent) -> None:
        self.conn = conn
        self.event = event
        self.request_id: int = event.request_id  # type: ignore[attr-defined]
        self.cancelled = asyncio.Event()
        """Set when the peer cancels the request (RequestCancelled, or STOP_SENDING on a FETCH's data
        stream) or the session ends."""

    @property
    def gone(self) -> bool:
        """The request can no longer be answered: the peer cancelled it or the session is over. Check it
        after every ``await`` before acting on the request (the peer may cancel at any moment)."""
        return self.cancelled.is_set() or self.conn.is_closed

    def reject(self, code: RequestErrorCode, reason: str = "", retry_interval: int = 0) -> None:
        self.conn.run_action(self.conn.session.reject_request, self.request_id, code, reason, retry_interval)

    def accept(self, parameters: MessageParameters = NO_PARAMETERS) -> None:
        """REQUEST_OK (PUBLISH_NAMESPACE, SUBSCRIBE_NAMESPACE, SUBSCRIBE_TRACKS, PUBLISH, REQUEST_UPDATE)."""
        self.conn.run_action(self.conn.session.accept_request, self.request_id, parameters)

    @property
    def writable(self) -> bool:
        """QUIC's send buffer is below the connection's bound: ``drain`` would return at once."""
        return self.conn.is_writable()

    async def drain(self) -> None:
        """Wait until QUIC's send buffer is below the connection's bound (back-pressure)."""
        await self.conn.wait_writable()

    def cancel(self, code: StreamResetCode = StreamResetCode.CANCELLED) -> None:
        """Abandon the request after answering it: resets its request and data streams with ``code``."""
        self.conn.cancel_request(self.request_id, code)


class IncomingTrackStatus(IncomingRequest):
    event: me.TrackStatusReceived

    def respond(
        self, parameters: MessageParameters = NO_PARAMETERS, track_properties: Properties = ()
    ) -> None:
        self.conn.run_action(
            self.conn.session.respond_track_status, self.request_id, parameters, track_properties
        )


class IncomingFetch(IncomingRequest):
    event: me.FetchReceived

    def accept_fetch(
        self, end_of_track: bool, end_location: Location, parameters: MessageParameters = NO_PARAMETERS
    ) -> None:
        self.conn.run_action(
            self.conn.session.accept_fetch, self.request_id, end_of_track, end_location, parameters
        )

    def send_object(
        self, group_id: int, subgroup_id: int | None, object_id: int, payload: bytes,
        publisher_priority: int = 128, properties: Properties = (),
    ) -> None:
        self.conn.run_action(
            self.conn.session.send_fetch_object, self.request_id, group_id, subgroup_id, object_id, payload,
            publisher_priority, properties,
        )

    def finish(self) -> None:
        self.conn.run_action(self.conn.session.finish_fetch, self.request_id)


class IncomingSubscribe(IncomingRequest):
    event: me.SubscribeReceived

    def accept_subscribe(
        self,
        track_alias: int,
        parameters: MessageParameters = NO_PARAMETERS,
        track_properties: Properties = (),
    ) -> None:
        self.track_alias = track_alias
        self.conn.run_action(
            self.conn.session.accept_subscribe, self.request_id, track_alias, parameters, track_properties
        )

    def open_subgroup(self, group_id: int, subgroup_id: int, publisher_priority: int | None = None,
                      **kwargs: bool) -> int:
        sid: int = self.conn.run_action(
            self.conn.session.open_subgroup, self.track_alias, group_id, subgroup_id, publisher_priority,
            **kwargs,
        )
        return sid

    def send_object(
        self, stream_id: int, object_id: int, payload: bytes, end_stream: bool = False,
        properties: Properties = (), status: ObjectStatus = ObjectStatus.NORMAL,
    ) -> None:
        self.conn.run_action(
            self.conn.session.send_subgroup_object, stream_id, object_id, payload, properties, status,
            end_stream,
        )

    def close_subgroup(self, stream_id: int) -> None:
        self.conn.run_action(self.conn.session.close_subgroup, stream_id)

    def publish_done(self, status_code: int, reason: str = "") -> None:
        self.conn.run_action(self.conn.session.publish_done, self.request_id, status_code, reason)


class IncomingPublishNamespace(IncomingRequest):
    event: me.PublishNamespaceReceived


class IncomingPublish(IncomingRequest):
    """A PUBLISH from the peer. Its objects are buffered from the moment the PUBLISH arrived (objects
    may follow it at once, before the application has decided), counted against
    ``ConnectionLimits.max_receive_buffer``; ``accept_publish`` answers PUBLISH_OK and returns them."""

    event: me.PublishReceived

    def __init__(self, conn: RequestConnection, event: me.MoqtEvent) -> None:
        super().__init__(conn, event)
        self.objects = Subscription(conn, self.request_id)
        """The track's objects; iteration ends after PUBLISH_DONE (see ``Subscription``)."""
        conn.deliver_objects(self.request_id, self.objects)

    def accept_publish(self, parameters: MessageParameters = NO_PARAMETERS) -> Subscription:
        """PUBLISH_OK; returns the objects (those that arrived before it first)."""
        self.accept(parameters)
        return self.objects

    def reject(self, code: RequestErrorCode, reason: str = "", retry_interval: int = 0) -> None:
        self.conn.stop_delivering(self.request_id)
        self.objects._finish(RequestRejected(code, "PUBLISH refused"))
        self.objects._discard()
        super().reject(code, reason, retry_interval)


INCOMING_REQUEST_TYPES: dict[type, type[IncomingRequest]] = {
    me.TrackStatusReceived: IncomingTrackStatus,
    me.FetchReceived: IncomingFetch,
    me.SubscribeReceived: IncomingSubscribe,
    me.PublishNamespaceReceived: IncomingPublishNamespace,
    me.SubscribeNamespaceReceived: IncomingRequest,
    me.SubscribeTracksReceived: IncomingRequest,
    me.PublishReceived: IncomingPublish,
    me.RequestUpdateReceived: IncomingRequest,
}
