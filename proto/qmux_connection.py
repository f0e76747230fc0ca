"""A sans-I/O QMux version 1 connection (draft-ietf-quic-qmux): QUIC streams and datagrams over one
ordered, reliable byte stream such as TLS over TCP.

Owns records (section "QMux Records"), the order of frames (QX_TRANSPORT_PARAMETERS first, prohibited
frames refused), streams with QUIC's states and flow control (RFC 9000 sections 2-4) with in-order
offsets (section "Ordering of STREAM Frames"), QX_PING, DATAGRAM when negotiated, the idle timeout and
closing (section "Connection Termination"). No socket, no TLS, no clock: bytes of the transport go in
through ``receive_data(data, now)``, bytes to write come out of ``data_to_send(now)``, time is passed
to ``handle_timer(now)``. The methods and events have the names and shapes of aioquic's
``QuicConnection`` (``send_stream_data``, ``reset_stream``, ``stop_stream``, ``next_event``, ...), so
code written for a QUIC stack drives this one the same way.

Data path: received STREAM payload is handed to the application as it arrives, without waiting for
the rest of its record (the ordered transport makes reassembly unnecessary); payload bytes are copied
once, into the event. Sent data is kept as the caller's buffers until it is framed; records are as large
as the peer's ``max_record_size`` allows (and ``QMuxConfiguration.max_send_record_size``). Every peer
error is a typed ``QMuxError`` carrying its QUIC transport error code, caught once in
``receive_data`` and turned into CONNECTION_CLOSE and a ``ConnectionTerminated`` event.
"""

from __future__ import annotations

from collections import deque
from typing import Final

from . import qmux_frames as qf
from .qmux_events import (
    ConnectionTerminated,
    DatagramFrameReceived,
    HandshakeCompleted,
    PingAcknowledged,
    QMuxEvent,
    StopSendingReceived,
    StreamDataReceived,
    StreamReset,
)
from .qmux_frames import (
    QMuxError,
    QMuxErrorCode,
    QMuxFinalSizeError,
    QMuxFlowControlError,
    QMuxFrameEncodingError,
    QMuxProtocolViolation,
    QMuxStreamLimitError,
    QMuxStreamStateError,
    QMuxUsageError,
    ShortRead,
    TransportParameters,
    decode_varint,
    encode_varint,
)
from .qmux_sending import RecordBuilder
from .qmux_streams import BIDI as _BIDI
from .qmux_streams import UNI as _UNI
from .qmux_streams import QMuxConfiguration, Stream

__all__ = ["QMuxConfiguration", "QMuxConnection"]

_MAX_OUTSTANDING_PINGS: Final = 64
_TLS_RECORD: Final = 16384
"""TLS's largest record plaintext: ``records_to_send`` cuts its pieces at multiples of it."""


def _tls_aligned(out: list[bytes | memoryview]) -> list[bytes | memoryview]:
    """``out`` re-cut so that every piece but the last is a whole number of TLS records: the small pieces
    and the ends of large ones joined (at most two records' worth copied per large piece), the rest of
    each large piece left as a view. A TLS layer encrypting each piece on its own then writes the same
    full records one joined buffer would have (a short record per piece cost the receiver a read each)."""
    pieces: list[bytes | memoryview] = []
    run: list[bytes | memoryview] = []
    run_len = 0
    for piece in out:
        n = len(piece)
        head = -run_len % _TLS_RECORD
        if n - head < _TLS_RECORD:
            run.append(piece)
            run_len += n
            continue
        view = memoryview(piece)
        middle_end = head + (n - head) // _TLS_RECORD * _TLS_RECORD
        if run_len:
            run.append(view[:head])
            pieces.append(b"".join(run))
        pieces.append(view[head:middle_end])
        run = [view[middle_end:]] if middle_end < n else []
        run_len = n - middle_end
    if run_len:
        pieces.append(b"".join(run))
    return pieces


class QMuxConnection:
    """One QMux connection. Call ``connection_made`` once the transport is up, feed it what the
    transport reads (``receive_data``), write what ``data_to_send`` returns, drain ``next_event``, and
    keep one timer at ``get_timer()`` that calls ``handle_timer``.

    Any exception other than ``QMuxUsageError`` (local misuse) escaping a method is a bug.
    """

    def __init__(self, configuration: QMuxConfiguration) -> None:
        self.configuration = configuration
        self._is_client = configuration.is_client
        self._local_tp = configuration.transport_parameters()
        self._peer_tp: TransportParameters | None = None
        self._alpn: str | None = None
        self._session_resumed = False
        self._events: deque[QMuxEvent] = deque()
        self._streams: dict[int, Stream] = {}
        self._sendable: dict[int, Stream] = {}
        self._close_event: ConnectionTerminated | None = None
        self._close_frame: bytes | None = None
        self._tp_sent = False
        self._finished = False  # nothing more will be sent
        # receiving: a partial unit (record size or frame) and the STREAM payload being handed over
        self._pending = b""
        self._record_left = 0
        self._rx_stream: Stream | None = None
        self._rx_left = 0
        self._rx_fin = False
        self._first_frame = True
        self._frame_type: int | None = None  # of the frame being parsed, for CONNECTION_CLOSE
        self._now = 0.0
        self._last_activity = 0.0
        # connection flow control (RFC 9000 section 4.1)
        self._rx_max_data = configuration.max_data
        self._rx_data = 0
        self._max_data_pending = False
        self._tx_max_data = 0
        self._tx_data = 0
        self._data_blocked_at = -1
        self._max_stream_data_pending: dict[int, Stream] = {}
        # stream counts (RFC 9000 section 4.6), indexed by _BIDI / _UNI
        self._local_opened = [0, 0]
        self._peer_max_streams = [0, 0]
        self._streams_blocked_at = [-1, -1]
        self._peer_opened = [0, 0]
        self._peer_closed = [0, 0]
        self._initial_max_streams = [configuration.max_streams_bidi, configuration.max_streams_uni]
        self._local_max_streams = list(self._initial_max_streams)
        self._max_streams_pending = [False, False]
        # QX_PING and datagrams
        self._ping_sent_seq = 0
        self._ping_uids: dict[int, int] = {}
        self._ping_requests: list[int] = []
        self._ping_received_seq = -1
        self._ping_response: int | None = None
        self._datagrams: deque[bytes] = deque()
        self.datagrams_dropped = 0
        """Datagrams not sent: not negotiated, too large for the peer, or over the queue limit."""
        self._handlers = {
            qf.RESET_STREAM: self._on_reset_stream,
            qf.STOP_SENDING: self._on_stop_sending,
            qf.MAX_DATA: self._on_max_data,
            qf.MAX_STREAM_DATA: self._on_max_stream_data,
            qf.MAX_STREAMS_BIDI: self._on_max_streams,
            qf.MAX_STREAMS_UNI: self._on_max_streams,
            qf.DATA_BLOCKED: self._on_data_blocked,
            qf.STREAM_DATA_BLOCKED: self._on_stream_data_blocked,
            qf.STREAMS_BLOCKED_BIDI: self._on_streams_blocked,
            qf.STREAMS_BLOCKED_UNI: self._on_streams_blocked,
            qf.CONNECTION_CLOSE: self._on_connection_close,
            qf.CONNECTION_CLOSE_APP: self._on_connection_close,
            qf.DATAGRAM: self._on_datagram,
            qf.DATAGRAM_LEN: self._on_datagram,
            qf.QX_TRANSPORT_PARAMETERS: self._on_transport_parameters,
            qf.QX_PING_REQUEST: self._on_ping,
            qf.QX_PING_RESPONSE: self._on_ping,
        }

    # ------------------------------------------------------------------ state the adapter reads

    @property
    def close_event(self) -> ConnectionTerminated | None:
        """How the connection ended (or is ending), once it has."""
        return self._close_event

    @property
    def finished(self) -> bool:
        """Nothing more will be sent: once ``data_to_send`` is written, shut down the sending side."""
        return self._finished

    @property
    def closed_by_us(self) -> bool:
        """We sent CONNECTION_CLOSE (``close``, or a peer error we answered with one): the peer may still be
        sending until it reads it, so the transport is best kept open for its close in turn."""
        return self._close_frame is not None

    @property
    def peer_transport_parameters(self) -> TransportParameters | None:
        """The peer's QX_TRANSPORT_PARAMETERS, once received."""
        return self._peer_tp

    def unsent(self, stream_id: int) -> int:
        """Bytes written to ``stream_id`` and not yet framed for the transport."""
        stream = self._streams.get(stream_id)
        return 0 if stream is None else stream.send_queued

    # ------------------------------------------------------------------ lifecycle

    def connection_made(
        self, now: float, alpn_protocol: str | None = None, session_resumed: bool = False
    ) -> None:
        """The transport (e.g. TLS) is established: our QX_TRANSPORT_PARAMETERS go out with the next
        ``data_to_send`` (section "QX_TRANSPORT_PARAMETERS Frames": as soon as the transport is up)."""
        self._alpn = alpn_protocol
        self._session_resumed = session_resumed
        self._now = self._last_activity = now

    def close(self, error_code: int = 0, frame_type: int | None = None, reason_phrase: str = "") -> None:
        """Send CONNECTION_CLOSE (the application form unless ``frame_type`` is given) and stop."""
        if self._close_event is not None:
            return
        self._close_frame = qf.encode_connection_close(error_code, frame_type, reason_phrase)
        self._terminate(ConnectionTerminated(error_code, frame_type, reason_phrase))

    def receive_eof(self) -> None:
        """The peer shut down its sending side of the transport."""
        if self._close_event is None:
            inside = self._record_left or self._pending
            reason = "transport closed inside a record" if inside else "transport closed by the peer"
            code = QMuxErrorCode.PROTOCOL_VIOLATION if inside else QMuxErrorCode.NO_ERROR
            self._terminate(ConnectionTerminated(code, None, reason))

    def connection_lost(self, reason: str = "transport lost") -> None:
        """The transport failed (reset, TLS alert): the connection ends at once (section "Handling
        Resets")."""
        if self._close_event is None:
            self._terminate(ConnectionTerminated(QMuxErrorCode.INTERNAL_ERROR, None, reason))
        self._finished = True

    def _terminate(self, event: ConnectionTerminated) -> None:
        self._close_event = event
        self._events.append(event)
        self._sendable.clear()
        self._datagrams.clear()
        self._pending = b""
        self._rx_stream = None
        if self._close_frame is None:
            self._finished = True

    # ------------------------------------------------------------------ timers

    def _idle_timeout(self) -> float | None:
        ours = self.configuration.max_idle_timeout
        theirs = self._peer_tp.max_idle_timeout_ms / 1000 if self._peer_tp is not None else 0.0
        if ours > 0 and theirs > 0:
            return min(ours, theirs)
        return ours if ours > 0 else theirs if theirs > 0 else None

    def get_timer(self) -> float | None:
        """When ``handle_timer`` must be called next (the idle deadline), or None."""
        if self._close_event is not None:
            return None
        timeout = self._idle_timeout()
        return None if timeout is None else self._last_activity + timeout

    def handle_timer(self, now: float) -> None:
        """The idle timeout expired: the connection ends without sending a frame (section "Initiating a
        Connection Close")."""
        deadline = self.get_timer()
        if deadline is not None and now >= deadline:
            self._terminate(ConnectionTerminated(QMuxErrorCode.NO_ERROR, None, "idle timeout"))

    # ------------------------------------------------------------------ events

    def next_event(self) -> QMuxEvent | None:
        """The next event, or None."""
        return self._events.popleft() if self._events else None

    # ------------------------------------------------------------------ streams: API

    def _is_local(self, stream_id: int) -> bool:
        return (stream_id & 1) == (0 if self._is_client else 1)

    def get_next_available_stream_id(self, is_unidirectional: bool = False) -> int:
        """The id the next stream we open gets (opened by its first ``send_stream_data``)."""
        kind = _UNI if is_unidirectional else _BIDI
        return self._local_opened[kind] << 2 | (2 if is_unidirectional else 0) | (0 if self._is_client else 1)

    def send_stream_data(self, stream_id: int, data: bytes | memoryview, end_stream: bool = False) -> None:
        """Queue ``data`` on ``stream_id`` (opening it if it is our next one); ``end_stream`` sends FIN.

        ``data`` is kept, not copied, until framed: pass bytes, or a view that stays unchanged.
        Writes to a stream the peer stopped are dropped (it was reset in answer to STOP_SENDING).
        """
        if self._close_event is not None:
            return
        stream = self._streams.get(stream_id)
        if stream is None:
            stream = self._open_local(stream_id)
        if stream.stopped_by_peer or stream.send_reset is not None:
            return
        if stream.send_done or stream.send_fin:
            raise QMuxUsageError(f"stream {stream_id} is finished: no more data may be sent on it")
        if data:
            view = memoryview(bytes(data) if isinstance(data, bytearray) else data)
            stream.send_queue.append(view if view.format == "B" and view.ndim == 1 else view.cast("B"))
            stream.send_queued += view.nbytes
        if end_stream:
            stream.send_fin = True
        self._sendable[stream_id] = stream

    def reset_stream(self, stream_id: int, error_code: int) -> None:
        """Abandon our sending half of ``stream_id`` (RESET_STREAM); a no-op once it has finished."""
        stream = self._streams.get(stream_id)
        if stream is None or self._close_event is not None:
            return
        if stream.send_done or stream.send_reset is not None:
            return
        self._reset_send(stream, error_code)

    def stop_stream(self, stream_id: int, error_code: int) -> None:
        """Ask the peer to stop sending on ``stream_id`` (STOP_SENDING); what still arrives is dropped."""
        stream = self._streams.get(stream_id)
        if stream is None or self._close_event is not None or stream.recv_done or stream.recv_stopped:
            return
        stream.recv_stopped = True
        stream.stop_code = error_code
        self._sendable[stream_id] = stream

    def send_datagram_frame(self, data: bytes) -> None:
        """Queue one DATAGRAM (RFC 9221); dropped (and counted) when it cannot be sent."""
        if self._close_event is not None:
            return
        if len(self._datagrams) >= self.configuration.max_queued_datagrams or (
            self._peer_tp is not None and not self._datagram_fits(len(data))
        ):
            self.datagrams_dropped += 1
            return
        self._datagrams.append(bytes(data))

    def _datagram_fits(self, length: int) -> bool:
        assert self._peer_tp is not None
        size = 1 + qf.varint_size(length) + length
        limit = self._peer_tp.max_datagram_frame_size
        return limit is not None and size <= limit and size <= self._send_record_cap()

    def send_ping(self, uid: int) -> None:
        """Send a QX_PING; ``PingAcknowledged(uid)`` follows when the peer answers."""
        if self._close_event is not None:
            return
        self._ping_sent_seq += 1
        self._ping_uids[self._ping_sent_seq] = uid
        if len(self._ping_uids) > _MAX_OUTSTANDING_PINGS:
            del self._ping_uids[next(iter(self._ping_uids))]
        self._ping_requests.append(self._ping_sent_seq)

    def _open_local(self, stream_id: int) -> Stream:
        if not self._is_local(stream_id):
            raise QMuxUsageError(f"stream {stream_id} is not open (the peer opens it, or it is closed)")
        uni = bool(stream_id & 2)
        kind = _UNI if uni else _BIDI
        index = stream_id >> 2
        if index != self._local_opened[kind]:
            state = "closed" if index < self._local_opened[kind] else "not the next stream to open"
            raise QMuxUsageError(f"stream {stream_id} is {state}")
        self._local_opened[kind] += 1
        peer = self._peer_tp
        if peer is None:
            send_max = 0  # raised when the peer's parameters arrive
        else:
            send_max = peer.initial_max_stream_data_uni if uni else peer.initial_max_stream_data_bidi_remote
        stream = Stream(stream_id, can_send=True, can_recv=not uni, send_max=send_max,
                         recv_max=0 if uni else self.configuration.max_stream_data_bidi_local)
        self._streams[stream_id] = stream
        return stream

    def _reset_send(self, stream: Stream, error_code: int) -> None:
        stream.send_queue.clear()
        stream.send_queued = 0
        stream.send_fin = False
        stream.send_reset = error_code
        self._sendable[stream.stream_id] = stream

    def _maybe_discard(self, stream: Stream) -> None:
        """Forget a stream whose both halves are over; a peer's stream frees credit for another."""
        if not (stream.send_done and stream.recv_done) or stream.has_work():
            return
        sid = stream.stream_id
        if self._streams.pop(sid, None) is None:
            return
        self._max_stream_data_pending.pop(sid, None)
        if not self._is_local(sid):
            kind = _UNI if sid & 2 else _BIDI
            self._peer_closed[kind] += 1
            self._update_max_streams(kind, force=False)

    def _update_max_streams(self, kind: int, *, force: bool) -> None:
        """Give the peer back the streams it closed once less than half its credit is left (or it said
        it is blocked), so it never waits on streams we have already forgotten."""
        new_max = self._initial_max_streams[kind] + self._peer_closed[kind]
        if new_max <= self._local_max_streams[kind]:
            return
        left = self._local_max_streams[kind] - self._peer_opened[kind]
        if force or left < max(1, self._initial_max_streams[kind] // 2):
            self._local_max_streams[kind] = new_max
            self._max_streams_pending[kind] = True

    # ------------------------------------------------------------------ receiving

    def receive_data(self, data: bytes | bytearray | memoryview, now: float) -> None:
        """Process bytes read from the transport (any split). A peer error closes the connection with
        its code; after a close, what arrives is discarded (section "Initiating a Connection Close")."""
        if self._close_event is not None:
            return
        self._now = now
        view = memoryview(data).cast("B") if isinstance(data, memoryview) else memoryview(data)
        total = len(view)
        pos = 0
        try:
            while self._pending:
                # A unit split across reads: top up the partial bytes geometrically (bounded by the record).
                if pos == total:
                    return
                have = len(self._pending)
                need = min(self._record_left, max(64, 2 * have)) if self._record_left else 16
                take = min(total - pos, max(1, need - len(self._pending)))
                self._pending += view[pos : pos + take]
                pos += take
                used = self._parse(memoryview(self._pending))
                self._pending = self._pending[used:]
            if pos < total:
                pos += self._parse(view[pos:])
                if pos < total and self._close_event is None:
                    self._pending = bytes(view[pos:])
        except QMuxError as exc:
            frame_type = exc.frame_type if exc.frame_type is not None else qf.PADDING
            self.close(exc.error_code, frame_type, exc.reason)

    def _parse(self, buf: memoryview) -> int:
        """Process whole units of ``buf`` (record sizes, frames, STREAM payload pieces); return how many
        bytes were used. What is left is less than one unit."""
        pos, end = 0, len(buf)
        while pos < end and self._close_event is None:
            if self._rx_left:
                n = min(self._rx_left, end - pos)
                self._rx_left -= n
                self._record_left -= n
                self._deliver(buf[pos : pos + n], self._rx_left == 0)
                pos += n
            elif not self._record_left:
                try:
                    size, new_pos = decode_varint(buf, pos, end)
                except ShortRead:
                    break
                if size > self.configuration.max_record_size:
                    raise QMuxFrameEncodingError(
                        f"record of {size} bytes exceeds max_record_size {self.configuration.max_record_size}"
                    )
                if size == 0:  # as a QUIC packet without frames (RFC 9000 section 12.4)
                    raise QMuxProtocolViolation("empty record")
                self._record_left = size
                pos = new_pos
                continue
            else:
                record_end = pos + self._record_left
                avail = min(end, record_end)
                self._frame_type = None
                try:
                    new_pos = self._parse_frame(buf, pos, avail, record_end)
                except ShortRead:
                    if avail == record_end:
                        raise QMuxFrameEncodingError(
                            "frame truncated by the end of its record", self._frame_type
                        ) from None
                    break
                self._record_left -= new_pos - pos
                pos = new_pos
            if not self._record_left and not self._rx_left:
                self._last_activity = self._now  # a record completely received
        return pos

    def _parse_frame(self, buf: memoryview, pos: int, avail: int, record_end: int) -> int:
        frame_type, p = decode_varint(buf, pos, avail)
        self._frame_type = frame_type
        if self._first_frame and frame_type != qf.QX_TRANSPORT_PARAMETERS:
            raise QMuxProtocolViolation("the first frame is not QX_TRANSPORT_PARAMETERS", frame_type)
        try:
            if qf.STREAM <= frame_type <= 0x0F:
                return self._on_stream(buf, p, avail, record_end, frame_type)
            if frame_type == qf.PADDING:
                run = bytes(buf[p:avail])
                return avail - len(run.lstrip(b"\x00"))
            handler = self._handlers.get(frame_type)
            if handler is None:
                if frame_type in qf.PROHIBITED_FRAME_TYPES:
                    raise QMuxFrameEncodingError(f"frame type {frame_type:#x} is prohibited in QMux")
                raise QMuxFrameEncodingError(f"unknown frame type {frame_type:#x}")
            return handler(buf, p, avail, record_end, frame_type)
        except QMuxError as exc:
            if exc.frame_type is None:
                exc.frame_type = frame_type
            raise

    def _deliver(self, piece: memoryview, last: bool) -> None:
        stream = self._rx_stream
        assert stream is not None
        fin = last and self._rx_fin
        if not stream.recv_stopped and (piece or fin):
            # A view, not a copy: the application copies what it keeps anyway (MoQT's stream readers do),
            # and a copy here was a third copy of every byte received (see StreamDataReceived.data).
            self._events.append(StreamDataReceived(piece, fin, stream.stream_id))
        if last:
            self._rx_stream = None
            self._after_receive(stream, fin)

    def _after_receive(self, stream: Stream, fin: bool) -> None:
        """Credit the delivered bytes back (RFC 9000 section 4.2): a new limit goes out once less than
        half of the window is left."""
        if fin:
            stream.recv_done = True
            self._maybe_discard(stream)
        elif stream.recv_max - stream.recv_offset < stream.recv_window // 2:
            stream.recv_max = stream.recv_offset + stream.recv_window
            self._max_stream_data_pending[stream.stream_id] = stream
        window = self.configuration.max_data
        if self._rx_max_data - self._rx_data < window // 2:
            self._rx_max_data = self._rx_data + window
            self._max_data_pending = True

    def _peer_stream(self, stream_id: int, *, sending: bool) -> Stream | None:
        """The stream a frame names, opening peer streams up to it (RFC 9000 section 3.2); None when it
        is closed and forgotten. ``sending``: the frame is about the peer's sending half."""
        local = self._is_local(stream_id)
        uni = bool(stream_id & 2)
        if uni and local == sending:
            side = "send-only" if local else "receive-only"
            raise QMuxStreamStateError(f"frame for the peer's {'sending' if sending else 'receiving'} "
                                       f"half of {side} stream {stream_id}")
        stream = self._streams.get(stream_id)
        if stream is not None:
            return stream
        kind = _UNI if uni else _BIDI
        index = stream_id >> 2
        if local:
            if index >= self._local_opened[kind]:
                raise QMuxStreamStateError(f"stream {stream_id} has not been opened")
            return None
        if index < self._peer_opened[kind]:
            return None
        if index >= self._local_max_streams[kind]:
            limit = self._local_max_streams[kind]
            raise QMuxStreamLimitError(f"stream {stream_id} exceeds the stream limit {limit}")
        peer = self._peer_tp
        assert peer is not None  # the first frame was QX_TRANSPORT_PARAMETERS
        cfg = self.configuration
        for i in range(self._peer_opened[kind], index + 1):
            sid = i << 2 | (stream_id & 3)
            self._streams[sid] = Stream(
                sid, can_send=not uni, can_recv=True,
                send_max=0 if uni else peer.initial_max_stream_data_bidi_local,
                recv_max=cfg.max_stream_data_uni if uni else cfg.max_stream_data_bidi_remote,
            )
        self._peer_opened[kind] = index + 1
        self._update_max_streams(kind, force=False)
        return self._streams[stream_id]

    def _on_stream(
        self, buf: memoryview, p: int, avail: int, record_end: int, frame_type: int
    ) -> int:
        stream_id, p = decode_varint(buf, p, avail)
        offset = 0
        if frame_type & qf.STREAM_OFF:
            offset, p = decode_varint(buf, p, avail)
        if frame_type & qf.STREAM_LEN:
            length, p = decode_varint(buf, p, avail)
            if p + length > record_end:
                raise QMuxFrameEncodingError("STREAM frame longer than its record")
        else:
            length = record_end - p
        if offset + length > qf.VARINT_MAX:
            raise QMuxFrameEncodingError("STREAM frame beyond the largest offset 2^62-1")
        fin = bool(frame_type & qf.STREAM_FIN)
        stream = self._peer_stream(stream_id, sending=True)
        if stream is None:
            raise QMuxStreamStateError(f"STREAM frame for closed stream {stream_id}")
        if offset != stream.recv_offset:
            raise QMuxProtocolViolation(
                f"STREAM frame at offset {offset} of stream {stream_id}, expected {stream.recv_offset}"
            )
        end_offset = offset + length
        if stream.recv_final is not None:
            if length or (fin and end_offset != stream.recv_final):
                raise QMuxFinalSizeError(f"data beyond the final size of stream {stream_id}")
            return p  # an empty frame at the final size changes nothing
        if end_offset > stream.recv_max:
            raise QMuxFlowControlError(f"stream {stream_id} exceeded its limit {stream.recv_max}")
        if self._rx_data + length > self._rx_max_data:
            raise QMuxFlowControlError(f"connection exceeded its data limit {self._rx_max_data}")
        self._rx_data += length
        stream.recv_offset = end_offset
        if fin:
            stream.recv_final = end_offset
        self._rx_stream = stream
        self._rx_fin = fin
        if length:
            self._rx_left = length
        else:
            self._deliver(buf[p:p], True)
        return p

    def _on_reset_stream(
        self, buf: memoryview, p: int, avail: int, record_end: int, frame_type: int
    ) -> int:
        stream_id, p = decode_varint(buf, p, avail)
        error_code, p = decode_varint(buf, p, avail)
        final_size, p = decode_varint(buf, p, avail)
        stream = self._peer_stream(stream_id, sending=True)
        if stream is None or stream.recv_done:
            return p  # all of it was delivered already: the reset changes nothing
        if stream.recv_final is not None and final_size != stream.recv_final:
            raise QMuxFinalSizeError(f"RESET_STREAM changes the final size of stream {stream_id}")
        if final_size < stream.recv_offset:
            raise QMuxFinalSizeError(f"RESET_STREAM final size {final_size} below the data received")
        if final_size > stream.recv_max:
            raise QMuxFlowControlError(f"RESET_STREAM final size beyond the limit of stream {stream_id}")
        unseen = final_size - stream.recv_offset  # counted against the connection (RFC 9000 section 4.5)
        if self._rx_data + unseen > self._rx_max_data:
            raise QMuxFlowControlError("RESET_STREAM final size beyond the connection's data limit")
        self._rx_data += unseen
        stream.recv_offset = final_size
        stream.recv_final = final_size
        stream.recv_done = True
        self._events.append(StreamReset(error_code, stream_id))
        self._maybe_discard(stream)
        return p

    def _on_stop_sending(
        self, buf: memoryview, p: int, avail: int, record_end: int, frame_type: int
    ) -> int:
        stream_id, p = decode_varint(buf, p, avail)
        error_code, p = decode_varint(buf, p, avail)
        stream = self._peer_stream(stream_id, sending=False)
        if stream is None:
            return p
        if not stream.send_done and stream.send_reset is None:
            # RFC 9000 section 3.5: answer with RESET_STREAM, the peer's code copied.
            self._reset_send(stream, error_code)
            stream.stopped_by_peer = True
        self._events.append(StopSendingReceived(error_code, stream_id))
        return p

    def _on_max_data(
        self, buf: memoryview, p: int, avail: int, record_end: int, frame_type: int
    ) -> int:
        limit, p = decode_varint(buf, p, avail)
        self._tx_max_data = max(self._tx_max_data, limit)
        return p

    def _on_max_stream_data(
        self, buf: memoryview, p: int, avail: int, record_end: int, frame_type: int
    ) -> int:
        stream_id, p = decode_varint(buf, p, avail)
        limit, p = decode_varint(buf, p, avail)
        stream = self._peer_stream(stream_id, sending=False)
        if stream is not None and limit > stream.send_max:
            stream.send_max = limit
        return p

    def _on_max_streams(
        self, buf: memoryview, p: int, avail: int, record_end: int, frame_type: int
    ) -> int:
        limit, p = decode_varint(buf, p, avail)
        if limit > qf.MAX_STREAMS_LIMIT:
            raise QMuxFrameEncodingError("MAX_STREAMS above 2^60")
        kind = _BIDI if frame_type == qf.MAX_STREAMS_BIDI else _UNI
        self._peer_max_streams[kind] = max(self._peer_max_streams[kind], limit)
        return p

    def _on_data_blocked(
        self, buf: memoryview, p: int, avail: int, record_end: int, frame_type: int
    ) -> int:
        _, p = decode_varint(buf, p, avail)  # credit is returned as data is delivered; nothing to do
        return p

    def _on_stream_data_blocked(
        self, buf: memoryview, p: int, avail: int, record_end: int, frame_type: int
    ) -> int:
        stream_id, p = decode_varint(buf, p, avail)
        _, p = decode_varint(buf, p, avail)
        self._peer_stream(stream_id, sending=True)  # only its validity matters
        return p

    def _on_streams_blocked(
        self, buf: memoryview, p: int, avail: int, record_end: int, frame_type: int
    ) -> int:
        limit, p = decode_varint(buf, p, avail)
        if limit > qf.MAX_STREAMS_LIMIT:
            raise QMuxFrameEncodingError("STREAMS_BLOCKED above 2^60")
        self._update_max_streams(_BIDI if frame_type == qf.STREAMS_BLOCKED_BIDI else _UNI, force=True)
        return p

    def _on_connection_close(
        self, buf: memoryview, p: int, avail: int, record_end: int, frame_type: int
    ) -> int:
        error_code, p = decode_varint(buf, p, avail)
        closing_frame: int | None = None
        if frame_type == qf.CONNECTION_CLOSE:
            closing_frame, p = decode_varint(buf, p, avail)
        length, p = decode_varint(buf, p, avail)
        if p + length > record_end:
            raise QMuxFrameEncodingError("CONNECTION_CLOSE reason longer than its record")
        if p + length > avail:
            raise ShortRead
        reason = bytes(buf[p : p + length]).decode("utf-8", errors="replace")
        # Section "Responding to a Connection Close": shut down without sending a frame.
        self._terminate(ConnectionTerminated(error_code, closing_frame, reason))
        return p + length

    def _on_datagram(
        self, buf: memoryview, p: int, avail: int, record_end: int, frame_type: int
    ) -> int:
        start = p
        limit = self.configuration.max_datagram_frame_size
        if limit is None:
            raise QMuxProtocolViolation("DATAGRAM frame, but datagrams were not negotiated")
        if frame_type == qf.DATAGRAM_LEN:
            length, p = decode_varint(buf, p, avail)
            if p + length > record_end:
                raise QMuxFrameEncodingError("DATAGRAM frame longer than its record")
        else:
            length = record_end - p
        if (p - start) + length + 1 > limit:  # RFC 9221 section 3: the whole frame counts
            raise QMuxProtocolViolation(f"DATAGRAM frame larger than max_datagram_frame_size {limit}")
        if p + length > avail:
            raise ShortRead
        self._events.append(DatagramFrameReceived(bytes(buf[p : p + length])))
        return p + length

    def _on_transport_parameters(
        self, buf: memoryview, p: int, avail: int, record_end: int, frame_type: int
    ) -> int:
        if not self._first_frame:
            raise QMuxProtocolViolation("QX_TRANSPORT_PARAMETERS other than as the first frame")
        length, p = decode_varint(buf, p, avail)
        if p + length > record_end:
            raise QMuxFrameEncodingError("QX_TRANSPORT_PARAMETERS longer than its record")
        if p + length > avail:
            raise ShortRead
        peer = qf.decode_transport_parameters(buf[p : p + length])
        self._first_frame = False
        self._peer_tp = peer
        self._tx_max_data = peer.initial_max_data
        self._peer_max_streams = [peer.initial_max_streams_bidi, peer.initial_max_streams_uni]
        uni_max, bidi_max = peer.initial_max_stream_data_uni, peer.initial_max_stream_data_bidi_remote
        for stream in self._streams.values():  # streams we opened before the parameters came
            stream.send_max = uni_max if stream.stream_id & 2 else bidi_max
        if self._datagrams:
            kept = [d for d in self._datagrams if self._datagram_fits(len(d))]
            self.datagrams_dropped += len(self._datagrams) - len(kept)
            self._datagrams = deque(kept)
        self._events.append(HandshakeCompleted(self._alpn, False, self._session_resumed))
        return p + length

    def _on_ping(
        self, buf: memoryview, p: int, avail: int, record_end: int, frame_type: int
    ) -> int:
        seq, p = decode_varint(buf, p, avail)
        if frame_type == qf.QX_PING_REQUEST:
            if seq <= self._ping_received_seq:
                raise QMuxProtocolViolation(f"QX_PING sequence {seq} not above the previous one")
            self._ping_received_seq = seq
            self._ping_response = seq  # one answer with the largest is enough (section "QX_PING Frames")
        else:
            if seq > self._ping_sent_seq:
                raise QMuxProtocolViolation(f"QX_PING response {seq} to a ping never sent")
            uid = self._ping_uids.pop(seq, None)
            if uid is not None:
                self._events.append(PingAcknowledged(uid))
        return p

    # ------------------------------------------------------------------ sending

    def _send_record_cap(self) -> int:
        peer = self._peer_tp.max_record_size if self._peer_tp is not None else qf.DEFAULT_MAX_RECORD_SIZE
        return min(peer, self.configuration.max_send_record_size)

    def data_to_send(self, now: float, max_bytes: int | None = None) -> bytes:
        """Records to write to the transport, as one buffer (b"" when there is nothing): ``records_to_send``
        joined."""
        return b"".join(self.records_to_send(now, max_bytes))

    def records_to_send(self, now: float, max_bytes: int | None = None) -> list[bytes | memoryview]:
        """Records to write to the transport, in order, as pieces ([] when there is nothing): the small
        pieces (record lengths, frame headers, control frames) and the ends of stream data joined, the
        rest of the stream data left as views of what the application queued, cut so that every piece
        but the last is a whole number of TLS records (``_tls_aligned``). A transport that takes the
        pieces one by one (asyncio's SSL transport encrypts each piece of ``writelines`` at once) then
        hardly copies stream data on the way: a relay's join of every MB it served was 7% of its send
        path.

        ``max_bytes`` stops adding stream data once about that much is framed (the transport's free
        buffer), so that what waits here can still be prioritised or reset.
        """
        if self._finished:
            return []
        out: list[bytes | memoryview] = []
        if not self._tp_sent:
            self._tp_sent = True
            tp = qf.encode_qx_transport_parameters(self._local_tp)
            out += (encode_varint(len(tp)), tp)
        if self._close_frame is not None:
            out += (encode_varint(len(self._close_frame)), self._close_frame)
            self._finished = True
        elif self._peer_tp is not None:
            # Nothing but our parameters may go before the peer's arrive (section "QX_TRANSPORT_PARAMETERS
            # Frames"): every other frame depends on them.
            RecordBuilder(self, out, max_bytes).build()
        if not out:
            return out
        self._last_activity = now  # a record completely sent
        return _tls_aligned(out)
