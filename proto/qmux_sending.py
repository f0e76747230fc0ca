"""Framing what a QMux connection sends into records (``proto.qmux_connection``'s send path).

Control frames first (QX_PING answers, credit updates, datagrams), then stream data round robin, each
stream up to one record's worth per turn. Records are as large as the peer's ``max_record_size`` (and
our ``max_send_record_size``) allow; stream payload stays a view of the caller's buffer, and
``records_to_send`` hands large views on unjoined. Flow control (RFC 9000 section 4) decides how much
each stream may send, and a blocked sender says so once per limit (DATA_BLOCKED, STREAM_DATA_BLOCKED,
STREAMS_BLOCKED).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from . import qmux_frames as qf
from .qmux_frames import encode_frame, encode_varint
from .qmux_streams import BIDI, UNI, Stream

if TYPE_CHECKING:
    from .qmux_connection import QMuxConnection

__all__ = ["RecordBuilder"]

_STREAM_HEADER_MAX: Final = 1 + 8 + 8 + 8  # type, stream id, offset, length
_MIN_STREAM_PIECE: Final = 1024  # below this much room, a record is closed rather than split finely


class RecordBuilder:
    """Frames everything the connection may send now into records of at most the peer's size."""

    def __init__(self, conn: QMuxConnection, out: list[bytes | memoryview], max_bytes: int | None) -> None:
        self.conn = conn
        self.out = out
        self.cap = conn._send_record_cap()
        self.frames: list[bytes | memoryview] = []
        self.size = 0
        self.sent = 0
        self.budget = max_bytes if max_bytes is not None else 1 << 62

    def add(self, frame: bytes) -> None:
        if self.size + len(frame) > self.cap:
            self.flush()
        self.frames.append(frame)
        self.size += len(frame)

    def flush(self) -> None:
        if self.size:
            self.out.append(encode_varint(self.size))
            self.out.extend(self.frames)
            self.sent += self.size
            self.frames = []
            self.size = 0

    def build(self) -> None:
        conn = self.conn
        if conn._ping_response is not None:
            self.add(encode_frame(qf.QX_PING_RESPONSE, conn._ping_response))
            conn._ping_response = None
        for seq in conn._ping_requests:
            self.add(encode_frame(qf.QX_PING_REQUEST, seq))
        conn._ping_requests.clear()
        if conn._max_data_pending:
            self.add(encode_frame(qf.MAX_DATA, conn._rx_max_data))
            conn._max_data_pending = False
        for kind, frame_type in ((BIDI, qf.MAX_STREAMS_BIDI), (UNI, qf.MAX_STREAMS_UNI)):
            if conn._max_streams_pending[kind]:
                self.add(encode_frame(frame_type, conn._local_max_streams[kind]))
                conn._max_streams_pending[kind] = False
        for stream in conn._max_stream_data_pending.values():
            self.add(encode_frame(qf.MAX_STREAM_DATA, stream.stream_id, stream.recv_max))
        conn._max_stream_data_pending.clear()
        while conn._datagrams:
            data = conn._datagrams.popleft()
            self.add(encode_frame(qf.DATAGRAM_LEN, len(data)) + data)
        self.streams()
        self.flush()

    def streams(self) -> None:
        """Round robin: each stream in turn frames up to one record's worth, until nothing more can go."""
        conn = self.conn
        progressed = True
        while progressed and conn._sendable and self.sent + self.size < self.budget:
            progressed = False
            for stream in list(conn._sendable.values()):
                if self.sent + self.size >= self.budget:
                    break
                sid = stream.stream_id
                if conn._is_local(sid):
                    kind = UNI if sid & 2 else BIDI
                    if sid >> 2 >= conn._peer_max_streams[kind]:
                        self.streams_blocked(kind)
                        continue
                moved = self.stream(stream)
                progressed = progressed or moved
                del conn._sendable[sid]
                if stream.has_work():
                    conn._sendable[sid] = stream  # to the back of the line
                else:
                    conn._maybe_discard(stream)

    def stream(self, stream: Stream) -> bool:
        """Frame what ``stream`` may send now (up to a record's worth); whether anything was framed."""
        conn = self.conn
        sid = stream.stream_id
        moved = False
        if stream.stop_code is not None:
            self.add(encode_frame(qf.STOP_SENDING, sid, stream.stop_code))
            stream.stop_code = None
            moved = True
        if stream.send_reset is not None:
            self.add(encode_frame(qf.RESET_STREAM, sid, stream.send_reset, stream.send_offset))
            stream.send_reset = None
            stream.send_done = True
            return True
        quantum = self.cap
        while stream.send_queued or stream.send_fin:
            credit = min(stream.send_max - stream.send_offset, conn._tx_max_data - conn._tx_data)
            room = self.cap - self.size - _STREAM_HEADER_MAX
            if room < min(_MIN_STREAM_PIECE, stream.send_queued) and self.size:
                self.flush()
                room = self.cap - _STREAM_HEADER_MAX
            n = min(room, stream.send_queued, credit, quantum, max(0, self.budget - self.sent - self.size))
            if n <= 0 and stream.send_queued:
                if credit <= 0:
                    self.data_blocked(stream)
                break
            fin = stream.send_fin and n == stream.send_queued
            header = qf.stream_frame_header(sid, stream.send_offset, n, fin)
            self.frames.append(header)
            self.take(stream, n)
            self.size += len(header) + n
            stream.send_offset += n
            conn._tx_data += n
            quantum -= n
            moved = True
            if fin:
                stream.send_fin = False
                stream.send_done = True
                break
        return moved

    def take(self, stream: Stream, n: int) -> None:
        """Move the first ``n`` queued bytes of ``stream`` into the record, as views."""
        queue = stream.send_queue
        stream.send_queued -= n
        while n:
            head = queue[0]
            if len(head) <= n:
                self.frames.append(queue.popleft())
                n -= len(head)
            else:
                self.frames.append(head[:n])
                queue[0] = head[n:]
                n = 0

    def data_blocked(self, stream: Stream) -> None:
        """DATA_BLOCKED / STREAM_DATA_BLOCKED, once per limit (RFC 9000 section 4.1)."""
        conn = self.conn
        if conn._tx_data >= conn._tx_max_data and conn._data_blocked_at != conn._tx_max_data:
            conn._data_blocked_at = conn._tx_max_data
            self.add(encode_frame(qf.DATA_BLOCKED, conn._tx_max_data))
        if stream.send_offset >= stream.send_max and stream.blocked_at != stream.send_max:
            stream.blocked_at = stream.send_max
            self.add(encode_frame(qf.STREAM_DATA_BLOCKED, stream.stream_id, stream.send_max))

    def streams_blocked(self, kind: int) -> None:
        conn = self.conn
        limit = conn._peer_max_streams[kind]
        if conn._streams_blocked_at[kind] != limit:
            conn._streams_blocked_at[kind] = limit
            frame_type = qf.STREAMS_BLOCKED_BIDI if kind == BIDI else qf.STREAMS_BLOCKED_UNI
            self.add(encode_frame(frame_type, limit))
