"""Configuration and per-stream state of a QMux connection (``proto.qmux_connection``).

``Stream`` holds both halves of one QUIC stream (RFC 9000 section 3) as QMux needs them: offsets and
flow-control limits, the queue of data not yet framed, and the frames owed (FIN, RESET_STREAM,
STOP_SENDING). Acknowledgement is the hand-over to the transport (draft section "QUIC Frames"), so a
half is over as soon as its FIN or RESET_STREAM is framed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Final

from . import qmux_frames as qf
from .qmux_frames import TransportParameters

__all__ = ["BIDI", "UNI", "QMuxConfiguration", "Stream"]

BIDI: Final = 0
UNI: Final = 1
_MIB: Final = 1 << 20


@dataclass(frozen=True, slots=True)
class QMuxConfiguration:
    """What one endpoint allows its peer and how it sends; one per connection."""

    is_client: bool
    """Client or server: decides which stream ids are ours (RFC 9000 section 2.1)."""
    max_idle_timeout: float = 60.0
    """Seconds without a complete record either way before the connection ends; 0 disables ours."""
    max_data: int = 32 * _MIB
    """Connection flow-control window: bytes of stream data the peer may send ahead of delivery."""
    max_stream_data_bidi_local: int = 8 * _MIB
    """Per-stream window on bidirectional streams we open."""
    max_stream_data_bidi_remote: int = 8 * _MIB
    """Per-stream window on bidirectional streams the peer opens."""
    max_stream_data_uni: int = 8 * _MIB
    """Per-stream window on unidirectional streams the peer opens."""
    max_streams_bidi: int = 1024
    """Concurrent bidirectional streams the peer may open."""
    max_streams_uni: int = 1024
    """Concurrent unidirectional streams the peer may open."""
    max_record_size: int = _MIB
    """Largest record Size we accept (``max_record_size``; also bounds what a partial record holds)."""
    max_send_record_size: int = _MIB
    """Largest record we build, whatever the peer accepts."""
    max_datagram_frame_size: int | None = None
    """RFC 9221: the largest DATAGRAM frame we accept; None does not negotiate datagrams."""
    max_queued_datagrams: int = 1024
    """Datagrams held for sending before new ones are dropped."""

    def __post_init__(self) -> None:
        for name in ("max_data", "max_stream_data_bidi_local", "max_stream_data_bidi_remote",
                     "max_stream_data_uni", "max_streams_bidi", "max_streams_uni", "max_queued_datagrams"):
            value = getattr(self, name)
            if not 0 <= value <= qf.VARINT_MAX:
                raise ValueError(f"{name} must be in 0..2^62-1, got {value}")
        if self.max_streams_bidi > qf.MAX_STREAMS_LIMIT or self.max_streams_uni > qf.MAX_STREAMS_LIMIT:
            raise ValueError("max_streams_bidi and max_streams_uni must be at most 2^60")
        if not 0 <= self.max_idle_timeout <= 86400:
            raise ValueError(f"max_idle_timeout must be in 0..86400 s, got {self.max_idle_timeout}")
        for name in ("max_record_size", "max_send_record_size"):
            if not qf.DEFAULT_MAX_RECORD_SIZE <= getattr(self, name) <= 1 << 30:
                raise ValueError(f"{name} must be in {qf.DEFAULT_MAX_RECORD_SIZE}..2^30")
        if self.max_datagram_frame_size is not None and not 0 < self.max_datagram_frame_size <= qf.VARINT_MAX:
            raise ValueError("max_datagram_frame_size must be positive (or None)")

    def transport_parameters(self) -> TransportParameters:
        """The parameters this configuration declares in QX_TRANSPORT_PARAMETERS."""
        return TransportParameters(
            max_idle_timeout_ms=round(self.max_idle_timeout * 1000),
            initial_max_data=self.max_data,
            initial_max_stream_data_bidi_local=self.max_stream_data_bidi_local,
            initial_max_stream_data_bidi_remote=self.max_stream_data_bidi_remote,
            initial_max_stream_data_uni=self.max_stream_data_uni,
            initial_max_streams_bidi=self.max_streams_bidi,
            initial_max_streams_uni=self.max_streams_uni,
            max_record_size=self.max_record_size,
            max_datagram_frame_size=self.max_datagram_frame_size,
        )


class Stream:
    """Both halves of one stream. A half that does not exist (the far side of a unidirectional stream)
    starts finished."""

    __slots__ = (
        "blocked_at", "recv_done", "recv_final", "recv_max", "recv_offset", "recv_stopped", "recv_window",
        "send_done", "send_fin", "send_max", "send_offset", "send_queue", "send_queued", "send_reset",
        "stop_code", "stopped_by_peer", "stream_id",
    )

    def __init__(
        self, stream_id: int, *, can_send: bool, can_recv: bool, send_max: int, recv_max: int
    ) -> None:
        self.stream_id = stream_id
        self.recv_offset = 0
        self.recv_max = self.recv_window = recv_max
        self.recv_final: int | None = None
        self.recv_done = not can_recv
        self.recv_stopped = False
        """We sent STOP_SENDING: what still arrives is counted and dropped."""
        self.send_queue: deque[memoryview] = deque()
        self.send_queued = 0
        self.send_offset = 0
        self.send_max = send_max
        self.send_fin = False
        """The application ended the stream; the FIN goes with the last queued byte."""
        self.send_done = not can_send
        self.send_reset: int | None = None
        """RESET_STREAM to send, with this code."""
        self.stopped_by_peer = False
        """The peer's STOP_SENDING reset our half: later writes are dropped, as aioquic does."""
        self.stop_code: int | None = None
        """STOP_SENDING to send, with this code."""
        self.blocked_at = -1

    def has_work(self) -> bool:
        return bool(self.send_queued or self.send_fin) or self.send_reset is not None or (
            self.stop_code is not None
        )
