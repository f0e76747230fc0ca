"""Events a ``proto.qmux_connection.QMuxConnection`` reports, shaped like aioquic's QUIC events.

The names and fields are those of ``aioquic.quic.events`` so that code written against a QUIC stack's
events (``kvnet.net.connection``) reads these the same way. Fields are wire values only.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ConnectionTerminated",
    "DatagramFrameReceived",
    "HandshakeCompleted",
    "PingAcknowledged",
    "QMuxEvent",
    "StopSendingReceived",
    "StreamDataReceived",
    "StreamReset",
]


class QMuxEvent:
    """Base class of every QMux connection event."""

    __slots__ = ()


@dataclass(slots=True)
class HandshakeCompleted(QMuxEvent):
    """The peer's transport parameters arrived: streams and datagrams may now be used both ways."""

    alpn_protocol: str | None
    """The application protocol the underlying transport negotiated (given to ``connection_made``)."""
    early_data_accepted: bool = False
    """Always False: 0-RTT is not used."""
    session_resumed: bool = False
    """Whether the underlying TLS session was resumed (as given to ``connection_made``)."""


@dataclass(slots=True)
class StreamDataReceived(QMuxEvent):
    """Bytes of one stream, in order; ``end_stream`` marks the FIN."""

    data: bytes | memoryview
    """The bytes that followed the previous event's bytes on this stream: a view of what was handed to
    ``receive_data`` (or of the connection's own copy of a unit split across reads), valid until the next
    ``receive_data`` call. Copy what must outlive that: a transport that reuses its read buffer handles
    every event of a read before it reads again."""
    end_stream: bool
    """The peer finished its sending side: no more bytes follow."""
    stream_id: int
    """The stream they arrived on."""


@dataclass(slots=True)
class StreamReset(QMuxEvent):
    """The peer reset its sending side of a stream (RESET_STREAM)."""

    error_code: int
    """The application's error code."""
    stream_id: int
    """The stream that was reset."""


@dataclass(slots=True)
class StopSendingReceived(QMuxEvent):
    """The peer asked us to stop sending on a stream (STOP_SENDING); the stream was reset already."""

    error_code: int
    """The application's error code (also the code of the RESET_STREAM sent in answer)."""
    stream_id: int
    """The stream the peer no longer reads."""


@dataclass(slots=True)
class DatagramFrameReceived(QMuxEvent):
    """One DATAGRAM frame (RFC 9221) from the peer."""

    data: bytes
    """The datagram's payload."""


@dataclass(slots=True)
class PingAcknowledged(QMuxEvent):
    """The peer answered a ``send_ping`` (a QX_PING response)."""

    uid: int
    """The uid given to ``send_ping``."""


@dataclass(slots=True)
class ConnectionTerminated(QMuxEvent):
    """The connection ended: a CONNECTION_CLOSE either way, an idle timeout, or the transport closed."""

    error_code: int
    """The QUIC transport error code (frame_type given) or the application's code (frame_type None)."""
    frame_type: int | None
    """The frame type that caused a transport error, None for an application close."""
    reason_phrase: str
    """Why, in words."""
