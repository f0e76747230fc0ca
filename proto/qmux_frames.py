"""QMux version 1 wire format: the QUIC varint, frame types, transport parameters, error codes.

QMux (draft-ietf-quic-qmux) carries QUIC version 1 frames in length-prefixed records over an ordered,
reliable byte stream such as TLS over TCP. This module owns the byte layout only: the QUIC
variable-length integer (RFC 9000 section 16; NOT MoQT's vi64 of ``proto.buffer``), the frame type
numbers and which of them QMux permits (draft section "QUIC Frames"), the encoders of the frames a
connection sends, the QX_TRANSPORT_PARAMETERS payload with its permitted and forbidden parameters
(section "Transport Parameters"), and the QUIC Transport Error Codes with one typed error per code.
Stream state, flow control and record framing live in ``proto.qmux_connection``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import ClassVar, Final

__all__ = [
    "DEFAULT_MAX_RECORD_SIZE",
    "MAX_STREAMS_LIMIT",
    "PROHIBITED_FRAME_TYPES",
    "VARINT_MAX",
    "QMuxError",
    "QMuxErrorCode",
    "QMuxFinalSizeError",
    "QMuxFlowControlError",
    "QMuxFrameEncodingError",
    "QMuxProtocolViolation",
    "QMuxStreamLimitError",
    "QMuxStreamStateError",
    "QMuxTransportParameterError",
    "QMuxUsageError",
    "ShortRead",
    "TransportParameters",
    "decode_transport_parameters",
    "decode_varint",
    "encode_transport_parameters",
    "encode_varint",
    "varint_size",
]

VARINT_MAX: Final = (1 << 62) - 1
MAX_STREAMS_LIMIT: Final = 1 << 60  # RFC 9000 section 4.6: stream counts above 2^60 are invalid
DEFAULT_MAX_RECORD_SIZE: Final = 16382  # section "max_record_size Transport Parameter"

# -- frame types (RFC 9000 section 19, RFC 9221, draft sections "QX_TRANSPORT_PARAMETERS Frames" and
# "QX_PING Frames") ------------------------------------------------------------------------------
PADDING: Final = 0x00
PING: Final = 0x01
ACK: Final = 0x02
ACK_ECN: Final = 0x03
RESET_STREAM: Final = 0x04
STOP_SENDING: Final = 0x05
CRYPTO: Final = 0x06
NEW_TOKEN: Final = 0x07
STREAM: Final = 0x08  # 0x08..0x0f: OFF 0x04, LEN 0x02, FIN 0x01
STREAM_OFF: Final = 0x04
STREAM_LEN: Final = 0x02
STREAM_FIN: Final = 0x01
MAX_DATA: Final = 0x10
MAX_STREAM_DATA: Final = 0x11
MAX_STREAMS_BIDI: Final = 0x12
MAX_STREAMS_UNI: Final = 0x13
DATA_BLOCKED: Final = 0x14
STREAM_DATA_BLOCKED: Final = 0x15
STREAMS_BLOCKED_BIDI: Final = 0x16
STREAMS_BLOCKED_UNI: Final = 0x17
NEW_CONNECTION_ID: Final = 0x18
RETIRE_CONNECTION_ID: Final = 0x19
PATH_CHALLENGE: Final = 0x1A
PATH_RESPONSE: Final = 0x1B
CONNECTION_CLOSE: Final = 0x1C  # transport close: error code, frame type, reason
CONNECTION_CLOSE_APP: Final = 0x1D  # application close: error code, reason
HANDSHAKE_DONE: Final = 0x1E
DATAGRAM: Final = 0x30  # RFC 9221: 0x30 extends to the end of the record, 0x31 has a Length
DATAGRAM_LEN: Final = 0x31
QX_TRANSPORT_PARAMETERS: Final = 0x3F5153300D0A0D0A
QX_PING_REQUEST: Final = 0x348C67529EF8C7BD
QX_PING_RESPONSE: Final = 0x348C67529EF8C7BE

PROHIBITED_FRAME_TYPES: Final = frozenset({
    PING, ACK, ACK_ECN, CRYPTO, NEW_TOKEN, NEW_CONNECTION_ID, RETIRE_CONNECTION_ID, PATH_CHALLENGE,
    PATH_RESPONSE, HANDSHAKE_DONE,
})
"""Section "QUIC Frames": receiving one of these is a FRAME_ENCODING_ERROR."""

# -- transport parameter ids (RFC 9000 section 18.2, RFC 9221, the draft) --------------------------
TP_MAX_IDLE_TIMEOUT: Final = 0x01
TP_INITIAL_MAX_DATA: Final = 0x04
TP_INITIAL_MAX_STREAM_DATA_BIDI_LOCAL: Final = 0x05
TP_INITIAL_MAX_STREAM_DATA_BIDI_REMOTE: Final = 0x06
TP_INITIAL_MAX_STREAM_DATA_UNI: Final = 0x07
TP_INITIAL_MAX_STREAMS_BIDI: Final = 0x08
TP_INITIAL_MAX_STREAMS_UNI: Final = 0x09
TP_MAX_DATAGRAM_FRAME_SIZE: Final = 0x20
TP_MAX_RECORD_SIZE: Final = 0x0571C59429CD0845

FORBIDDEN_TRANSPORT_PARAMETERS: Final = {
    0x00: "original_destination_connection_id",
    0x02: "stateless_reset_token",
    0x03: "max_udp_payload_size",
    0x0A: "ack_delay_exponent",
    0x0B: "max_ack_delay",
    0x0C: "disable_active_migration",
    0x0D: "preferred_address",
    0x0E: "active_connection_id_limit",
    0x0F: "initial_source_connection_id",
    0x10: "retry_source_connection_id",
}
"""Section "Permitted and Forbidden Transport Parameters": receiving one is a TRANSPORT_PARAMETER_ERROR."""


# -- errors ------------------------------------------------------------------------------------------


class QMuxErrorCode(IntEnum):
    """QUIC Transport Error Codes (RFC 9000 section 20.1), the codes QMux closes connections with."""

    NO_ERROR = 0x0
    INTERNAL_ERROR = 0x1
    CONNECTION_REFUSED = 0x2
    FLOW_CONTROL_ERROR = 0x3
    STREAM_LIMIT_ERROR = 0x4
    STREAM_STATE_ERROR = 0x5
    FINAL_SIZE_ERROR = 0x6
    FRAME_ENCODING_ERROR = 0x7
    TRANSPORT_PARAMETER_ERROR = 0x8
    CONNECTION_ID_LIMIT_ERROR = 0x9
    PROTOCOL_VIOLATION = 0xA
    APPLICATION_ERROR = 0xC


class QMuxError(Exception):
    """The peer broke QMux or QUIC framing rules; the connection closes with ``error_code``.

    ``frame_type`` is the type of the frame being processed (reported in CONNECTION_CLOSE), or None.
    """

    error_code: ClassVar[QMuxErrorCode] = QMuxErrorCode.PROTOCOL_VIOLATION

    def __init__(self, reason: str, frame_type: int | None = None) -> None:
        super().__init__(reason)
        self.reason: str = reason
        self.frame_type: int | None = frame_type

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.error_code.name}, {self.reason!r})"


class QMuxProtocolViolation(QMuxError):
    """A rule of QMux or QUIC that has no more specific code was broken."""

    error_code = QMuxErrorCode.PROTOCOL_VIOLATION


class QMuxFrameEncodingError(QMuxError):
    """A malformed, truncated, prohibited or unknown frame, or an oversized record."""

    error_code = QMuxErrorCode.FRAME_ENCODING_ERROR


class QMuxFlowControlError(QMuxError):
    """The peer sent more than the connection or stream flow-control limit allowed."""

    error_code = QMuxErrorCode.FLOW_CONTROL_ERROR


class QMuxStreamLimitError(QMuxError):
    """The peer opened a stream beyond the stream count it was allowed."""

    error_code = QMuxErrorCode.STREAM_LIMIT_ERROR


class QMuxStreamStateError(QMuxError):
    """A frame for a stream in a state (or direction) that does not allow it."""

    error_code = QMuxErrorCode.STREAM_STATE_ERROR


class QMuxFinalSizeError(QMuxError):
    """Data beyond a stream's final size, or a final size that changed."""

    error_code = QMuxErrorCode.FINAL_SIZE_ERROR


class QMuxTransportParameterError(QMuxError):
    """A forbidden, duplicated or invalid transport parameter."""

    error_code = QMuxErrorCode.TRANSPORT_PARAMETER_ERROR


class QMuxUsageError(ValueError):
    """Local misuse of the connection API (a stream we may not send on, data after FIN). Never sent."""


class ShortRead(Exception):
    """A read ran past the end of the bytes available (more may be needed, or the frame is truncated)."""


# -- the QUIC variable-length integer (RFC 9000 section 16) ------------------------------------------

_VARINT_MASK: Final = (0, 0x3F, 0x3FFF, 0, 0x3FFF_FFFF, 0, 0, 0, 0x3FFF_FFFF_FFFF_FFFF)
_ONE_BYTE: Final = tuple(bytes((value,)) for value in range(0x40))


def varint_size(value: int) -> int:
    """Length of the minimal encoding of ``value``."""
    if value < 0x40:
        return 1
    if value < 0x4000:
        return 2
    if value < 0x4000_0000:
        return 4
    if value <= VARINT_MAX:
        return 8
    raise QMuxUsageError(f"varint value out of range: {value}")


def encode_varint(value: int) -> bytes:
    """The minimal encoding of ``value`` (0..2^62-1)."""
    if value < 0x40:
        if value < 0:
            raise QMuxUsageError(f"varint value out of range: {value}")
        return _ONE_BYTE[value]
    if value < 0x4000:
        return (value | 0x4000).to_bytes(2, "big")
    if value < 0x4000_0000:
        return (value | 0x8000_0000).to_bytes(4, "big")
    if value <= VARINT_MAX:
        return (value | 0xC000_0000_0000_0000).to_bytes(8, "big")
    raise QMuxUsageError(f"varint value out of range: {value}")


def decode_varint(buf: bytes | memoryview, pos: int, end: int) -> tuple[int, int]:
    """Decode one varint at ``pos`` reading no further than ``end``; (value, new position).

    Raises ``ShortRead`` when the encoding runs past ``end``.
    """
    if pos >= end:
        raise ShortRead
    first = buf[pos]
    length = 1 << (first >> 6)
    if length == 1:
        return first, pos + 1
    stop = pos + length
    if stop > end:
        raise ShortRead
    return int.from_bytes(buf[pos:stop], "big") & _VARINT_MASK[length], stop


# -- transport parameters (draft section "Transport Parameters", RFC 9000 section 18) ----------------


@dataclass(frozen=True, slots=True)
class TransportParameters:
    """The transport parameters one endpoint declares; absent ones take RFC 9000's defaults."""

    max_idle_timeout_ms: int = 0
    """0: this endpoint has no idle timeout."""
    initial_max_data: int = 0
    initial_max_stream_data_bidi_local: int = 0
    initial_max_stream_data_bidi_remote: int = 0
    initial_max_stream_data_uni: int = 0
    initial_max_streams_bidi: int = 0
    initial_max_streams_uni: int = 0
    max_record_size: int = DEFAULT_MAX_RECORD_SIZE
    """Largest Size field of a record this endpoint accepts."""
    max_datagram_frame_size: int | None = None
    """RFC 9221: None means DATAGRAM frames are not accepted (the extension is not negotiated)."""


_INT_PARAMETERS: Final = {
    TP_MAX_IDLE_TIMEOUT: "max_idle_timeout_ms",
    TP_INITIAL_MAX_DATA: "initial_max_data",
    TP_INITIAL_MAX_STREAM_DATA_BIDI_LOCAL: "initial_max_stream_data_bidi_local",
    TP_INITIAL_MAX_STREAM_DATA_BIDI_REMOTE: "initial_max_stream_data_bidi_remote",
    TP_INITIAL_MAX_STREAM_DATA_UNI: "initial_max_stream_data_uni",
    TP_INITIAL_MAX_STREAMS_BIDI: "initial_max_streams_bidi",
    TP_INITIAL_MAX_STREAMS_UNI: "initial_max_streams_uni",
    TP_MAX_RECORD_SIZE: "max_record_size",
    TP_MAX_DATAGRAM_FRAME_SIZE: "max_datagram_frame_size",
}


def encode_transport_parameters(params: TransportParameters) -> bytes:
    """The Transport Parameters field (a sequence of id, length, value) for ``params``.

    Parameters equal to their default are left out; only permitted parameters are ever written.
    """
    out: list[bytes] = []
    defaults = TransportParameters()
    for param_id, name in _INT_PARAMETERS.items():
        value = getattr(params, name)
        if value is None or (value == getattr(defaults, name) and param_id != TP_MAX_DATAGRAM_FRAME_SIZE):
            continue
        encoded = encode_varint(value)
        out += (encode_varint(param_id), encode_varint(len(encoded)), encoded)
    return b"".join(out)


def decode_transport_parameters(data: bytes | memoryview) -> TransportParameters:
    """Parse the peer's Transport Parameters field, enforcing the draft's rules.

    Forbidden parameters, duplicates, malformed values, a ``max_record_size`` below the default and
    stream counts above 2^60 raise ``QMuxTransportParameterError``. Unknown parameters (including the
    reserved ones of RFC 9000 section 18.1) are ignored, as the draft requires.
    """
    values: dict[str, int] = {}
    seen: set[int] = set()
    pos, end = 0, len(data)
    try:
        while pos < end:
            param_id, pos = decode_varint(data, pos, end)
            length, pos = decode_varint(data, pos, end)
            stop = pos + length
            if stop > end:
                raise ShortRead
            if param_id in seen:
                raise QMuxTransportParameterError(f"transport parameter {param_id:#x} sent twice")
            seen.add(param_id)
            if param_id in FORBIDDEN_TRANSPORT_PARAMETERS:
                name = FORBIDDEN_TRANSPORT_PARAMETERS[param_id]
                raise QMuxTransportParameterError(f"transport parameter {name} is forbidden in QMux")
            name = _INT_PARAMETERS.get(param_id, "")
            if name:
                value, used = decode_varint(data, pos, stop)
                if used != stop:
                    raise QMuxTransportParameterError(f"transport parameter {name}: length does not match")
                values[name] = value
            pos = stop
    except ShortRead:
        raise QMuxTransportParameterError("transport parameters truncated") from None
    params = TransportParameters(**values)
    if params.max_record_size < DEFAULT_MAX_RECORD_SIZE:
        raise QMuxTransportParameterError(
            f"max_record_size {params.max_record_size} is below the default {DEFAULT_MAX_RECORD_SIZE}"
        )
    if max(params.initial_max_streams_bidi, params.initial_max_streams_uni) > MAX_STREAMS_LIMIT:
        raise QMuxTransportParameterError("initial_max_streams above 2^60")
    return params


# -- frame encoders ------------------------------------------------------------------------------


def encode_frame(frame_type: int, *fields: int) -> bytes:
    """A frame made of its type and varint fields (MAX_DATA, RESET_STREAM, QX_PING, ...)."""
    return b"".join([encode_varint(frame_type), *map(encode_varint, fields)])


def encode_qx_transport_parameters(params: TransportParameters) -> bytes:
    """QX_TRANSPORT_PARAMETERS frame (section "QX_TRANSPORT_PARAMETERS Frames")."""
    payload = encode_transport_parameters(params)
    return encode_varint(QX_TRANSPORT_PARAMETERS) + encode_varint(len(payload)) + payload


def encode_connection_close(error_code: int, frame_type: int | None, reason: str) -> bytes:
    """CONNECTION_CLOSE: the transport form (0x1c) when ``frame_type`` is given, else the application form."""
    phrase = reason.encode("utf-8", errors="replace")
    if frame_type is None:
        head = encode_frame(CONNECTION_CLOSE_APP, error_code)
    else:
        head = encode_frame(CONNECTION_CLOSE, error_code, frame_type)
    return head + encode_varint(len(phrase)) + phrase


def stream_frame_header(stream_id: int, offset: int, length: int, fin: bool) -> bytes:
    """The header of a STREAM frame carrying ``length`` bytes at ``offset`` (always with a Length)."""
    frame_type = STREAM | STREAM_LEN | (STREAM_FIN if fin else 0)
    if offset:
        frame_type |= STREAM_OFF
        return b"".join((
            _ONE_BYTE[frame_type], encode_varint(stream_id), encode_varint(offset), encode_varint(length)
        ))
    return b"".join((_ONE_BYTE[frame_type], encode_varint(stream_id), encode_varint(length)))
