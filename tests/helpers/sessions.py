"""Shared test helpers: in-memory QUIC stand-ins for driving two ``MoqtSession``s back to back.

``InMemoryStreams`` hands out stream ids the way aioquic's ``QuicConnection`` does: the next id of each
kind is only used up once data is sent on it, so a session that asks twice before transmitting gets
the same answer twice. ``SessionPair`` moves transmissions between a client and a server session
(aioquic's ``roundtrip``, h11's ``ConnectionPair``), optionally cutting stream data into random
fragments, and records every event each side produced.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from proto.events import MoqtEvent, SessionTerminated
from proto.messages import TrackNamespace
from proto.session import (
    CloseConnection,
    MoqtSession,
    ResetStream,
    SendDatagram,
    SendStreamData,
    SessionConfig,
    StopSending,
    Transmit,
)

__all__ = ["InMemoryStreams", "SessionPair", "make_pair"]


class InMemoryStreams:
    """A ``StreamIdAllocator`` with QUIC's stream-id layout (RFC 9000 section 2.1)."""

    def __init__(self, is_client: bool) -> None:
        self.is_client = is_client
        # Lowest two bits: initiator (0 client, 1 server) and direction (0 bidi, 2 uni).
        self._next = {False: 0 if is_client else 1, True: 2 if is_client else 3}

    def get_next_available_stream_id(self, is_unidirectional: bool = False) -> int:
        return self._next[is_unidirectional]

    def mark_used(self, stream_id: int) -> None:
        """Record that data went out on a locally initiated stream (QUIC opens it implicitly)."""
        if (stream_id & 1) == (0 if self.is_client else 1):
            uni = bool(stream_id & 2)
            self._next[uni] = max(self._next[uni], stream_id + 4)


@dataclass
class _Side:
    session: MoqtSession
    streams: InMemoryStreams
    events: list[MoqtEvent] = field(default_factory=list)
    transmits: list[Transmit] = field(default_factory=list)
    connection_closed: tuple[int, str] | None = None


class SessionPair:
    """A client and a server session wired together in memory.

    ``fragment`` > 0 cuts every stream write into random pieces of 1..fragment bytes, so the
    receiving session sees arbitrary boundaries; ``rng`` makes that reproducible.
    """

    def __init__(
        self,
        client_config: SessionConfig | None = None,
        server_config: SessionConfig | None = None,
        *,
        fragment: int = 0,
        rng: random.Random | None = None,
    ) -> None:
        client_config = client_config or SessionConfig(is_client=True)
        server_config = server_config or SessionConfig(is_client=False)
        cstreams, sstreams = InMemoryStreams(True), InMemoryStreams(False)
        self._client = _Side(MoqtSession(client_config, cstreams), cstreams)
        self._server = _Side(MoqtSession(server_config, sstreams), sstreams)
        self.fragment = fragment
        self.rng = rng or random.Random(0)
        self.now = 0.0
        """The clock both sessions are given with stream data (``request_header_timeout``)."""

    @property
    def client(self) -> MoqtSession:
        return self._client.session

    @property
    def server(self) -> MoqtSession:
        return self._server.session

    @property
    def client_events(self) -> list[MoqtEvent]:
        return self._client.events

    @property
    def server_events(self) -> list[MoqtEvent]:
        return self._server.events

    @property
    def client_transmits(self) -> list[Transmit]:
        """Everything the client sent so far (for assertions on resets and FINs)."""
        return self._client.transmits

    @property
    def server_transmits(self) -> list[Transmit]:
        return self._server.transmits

    def setup(self) -> None:
        """Both sides open their control streams and exchange SETUP."""
        self.client.initiate()
        self.server.initiate()
        self.run()

    def subscribe_accepted(
        self, namespace: TrackNamespace, track_alias: int, track_name: bytes = b"t"
    ) -> int:
        """The client subscribes to ``namespace``/``track_name`` and the server accepts with ``track_alias``
        (its SUBSCRIBE_OK not yet moved to the client); returns the subscription's Request ID."""
        request_id = self.client.subscribe(namespace, track_name)
        self.run()
        self.server.accept_subscribe(request_id, track_alias)
        return request_id

    def run(self, max_rounds: int = 1000) -> None:
        """Move bytes both ways until neither side has anything left to send."""
        for _ in range(max_rounds):
            moved = self._flush(self._client, self._server) | self._flush(self._server, self._client)
            self._drain(self._client)
            self._drain(self._server)
            if not moved:
                return
        raise AssertionError("sessions kept sending after max_rounds")

    def take_client_events(self) -> list[MoqtEvent]:
        events, self._client.events[:] = list(self._client.events), []
        return events

    def take_server_events(self) -> list[MoqtEvent]:
        events, self._server.events[:] = list(self._server.events), []
        return events

    @staticmethod
    def _drain(side: _Side) -> None:
        while (event := side.session.next_event()) is not None:
            side.events.append(event)

    def _flush(self, src: _Side, dst: _Side) -> bool:
        transmits = src.session.transmit()
        for item in transmits:
            src.transmits.append(item)
            if isinstance(item, SendStreamData):
                src.streams.mark_used(item.stream_id)
                self._deliver(dst.session, item)
            elif isinstance(item, ResetStream):
                dst.session.receive_stream_reset(item.stream_id, item.error_code)
            elif isinstance(item, StopSending):
                dst.session.receive_stop_sending(item.stream_id, item.error_code)
            elif isinstance(item, SendDatagram):
                dst.session.receive_datagram(item.data)
            elif isinstance(item, CloseConnection):
                src.connection_closed = (item.error_code, item.reason)
                if dst.connection_closed is None:
                    dst.connection_closed = (item.error_code, item.reason)
                    dst.session.connection_lost(item.error_code, item.reason)
        return bool(transmits)

    def _deliver(self, dst: MoqtSession, item: SendStreamData) -> None:
        data = bytes(item.data)
        if self.fragment <= 0 or len(data) <= 1:
            dst.receive_stream_data(item.stream_id, data, item.end_stream, self.now)
            return
        pos = 0
        while pos < len(data):
            step = int(self.rng.random() * self.fragment) + 1
            chunk = data[pos : pos + step]
            pos += step
            dst.receive_stream_data(item.stream_id, chunk, item.end_stream and pos >= len(data), self.now)

    def terminated(self, events: list[MoqtEvent]) -> SessionTerminated | None:
        """The SessionTerminated among ``events``, if any."""
        for event in events:
            if isinstance(event, SessionTerminated):
                return event
        return None


def make_pair(fragment: int = 0, seed: int = 0, **limits: int) -> SessionPair:
    """A pair with SETUP done; ``limits`` override SessionConfig fields on both sides."""
    pair = SessionPair(
        SessionConfig(is_client=True, **limits),  # type: ignore[arg-type]
        SessionConfig(is_client=False, **limits),  # type: ignore[arg-type]
        fragment=fragment,
        rng=random.Random(seed),
    )
    pair.setup()
    return pair
