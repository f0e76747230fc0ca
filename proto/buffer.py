"""Bounds-checked byte cursor and the draft-18 variable-length integer.

Shaped like aioquic's ``Buffer``: ``pull_*`` read at the cursor and raise
``BufferReadError`` when the input is too short, ``push_*`` write at the cursor.
Callers decide whether a short read means "wait for more bytes" (streams) or
"malformed" (a message whose length is already known).

The vi64 here is NOT the QUIC varint: draft-18 section "Variable-Length
Integers" counts leading 1 bits of the first byte to get the length (1-9 bytes)
and accepts non-minimal encodings. This module knows nothing about MoQT messages.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "VI64_MAX",
    "Buffer",
    "BufferReadError",
    "BufferWriteError",
    "vi64_decode",
    "vi64_encode",
    "vi64_size",
]

VI64_MAX: Final = (1 << 64) - 1

# Encoded length by first byte: number of leading 1 bits + 1 (section "Variable-Length Integers").
_VI64_LEN: Final = bytes(
    next((n for n in range(8) if not (b << n) & 0x80), 8) + 1 for b in range(256)
)
# Bits of value carried by an encoding of each length (7 per byte up to 8 bytes; 9 bytes carry 64).
_VI64_BITS: Final = (0, 7, 14, 21, 28, 35, 42, 49, 56, 64)
# First-byte prefix (the leading 1 bits and the terminating 0) per length.
_VI64_PREFIX: Final = (0, 0x00, 0x80, 0xC0, 0xE0, 0xF0, 0xF8, 0xFC, 0xFE, 0xFF)
# The one-byte encodings (values 0..127), built once.
_VI64_ONE_BYTE: Final = tuple(bytes((value,)) for value in range(0x80))


class BufferReadError(ValueError):
    """A read ran past the end of the available bytes."""


class BufferWriteError(ValueError):
    """A write would exceed the buffer's capacity or a value does not fit its field."""


def vi64_size(value: int) -> int:
    """Length in bytes of the minimal vi64 encoding of ``value``."""
    if value < 0 or value > VI64_MAX:
        raise BufferWriteError(f"vi64 value out of range: {value}")
    bits = value.bit_length()
    # 7 value bits per byte up to 8 bytes (56 bits); the 9-byte form carries all 64.
    return 9 if bits > 56 else max(1, (bits + 6) // 7)


def vi64_encode(value: int, length: int | None = None) -> bytes:
    """Encode ``value`` as vi64, minimally unless an explicit (valid, maybe longer) ``length`` is given."""
    if length is None and 0 <= value < 0x80:
        return _VI64_ONE_BYTE[value]  # request ids, lengths and counts are mostly this small
    minimal = vi64_size(value)
    if length is None:
        length = minimal
    elif length < minimal or length > 9:
        raise BufferWriteError(f"vi64 value {value} does not fit in {length} bytes")
    if length == 9:
        return b"\xff" + value.to_bytes(8, "big")
    return ((_VI64_PREFIX[length] << (8 * (length - 1))) | value).to_bytes(length, "big")


def vi64_decode(data: bytes | bytearray | memoryview, pos: int = 0) -> tuple[int, int] | None:
    """Decode one vi64 at ``pos``; return (value, new position) or None when more bytes are needed."""
    if pos >= len(data):
        return None
    length = _VI64_LEN[data[pos]]
    end = pos + length
    if end > len(data):
        return None
    if length == 1:
        return data[pos], end
    raw = int.from_bytes(data[pos:end], "big")
    return raw & ((1 << _VI64_BITS[length]) - 1), end


class Buffer:
    """A cursor over bytes for reading (``data=``) or a growable byte sink for writing (``capacity=``)."""

    __slots__ = ("_buf", "_capacity", "_end", "_pos")

    def __init__(
        self, data: bytes | bytearray | memoryview | None = None, capacity: int | None = None
    ) -> None:
        self._buf: bytearray | memoryview
        if data is not None:
            # Reading: a view, so slicing large payloads out of it does not copy the whole input.
            self._buf = memoryview(data).cast("B") if isinstance(data, memoryview) else memoryview(data)
            self._end = len(self._buf)
            self._capacity = self._end
        else:
            self._buf = bytearray()
            self._end = 0
            self._capacity = capacity if capacity is not None else VI64_MAX
        self._pos = 0

    # -- cursor -------------------------------------------------------------------------------

    @property
    def data(self) -> bytes:
        """The bytes before the cursor (what has been written, or consumed)."""
        return bytes(self._buf[: self._pos])

    @property
    def capacity(self) -> int:
        """The largest size this buffer may hold."""
        return self._capacity

    def data_slice(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the buffer."""
        if start < 0 or end > self._end or start > end:
            raise BufferReadError("slice out of bounds")
        return bytes(self._buf[start:end])

    def eof(self) -> bool:
        """True when the cursor is at the end of the available bytes."""
        return self._pos >= self._end

    def remaining(self) -> int:
        """Number of bytes after the cursor."""
        return self._end - self._pos

    def seek(self, pos: int) -> None:
        """Move the cursor to ``pos`` (0..end)."""
        if pos < 0 or pos > self._end:
            raise BufferReadError("seek out of bounds")
        self._pos = pos

    def tell(self) -> int:
        """Cursor position."""
        return self._pos

    # -- reading ------------------------------------------------------------------------------

    def _take(self, n: int) -> int:
        start = self._pos
        if n < 0 or start + n > self._end:
            raise BufferReadError("read out of bounds")
        self._pos = start + n
        return start

    def pull_bytes(self, length: int) -> bytes:
        """Read ``length`` bytes."""
        start = self._take(length)
        return bytes(self._buf[start : start + length])

    def pull_view(self, length: int) -> memoryview:
        """Read ``length`` bytes as a view into the input, without copying."""
        start = self._take(length)
        return memoryview(self._buf)[start : start + length]

    def pull_uint8(self) -> int:
        """Read an 8-bit unsigned integer."""
        start = self._take(1)
        return self._buf[start]

    def pull_uint16(self) -> int:
        """Read a 16-bit big-endian unsigned integer."""
        start = self._take(2)
        return int.from_bytes(self._buf[start : start + 2], "big")

    def pull_uint32(self) -> int:
        """Read a 32-bit big-endian unsigned integer."""
        start = self._take(4)
        return int.from_bytes(self._buf[start : start + 4], "big")

    def pull_uint64(self) -> int:
        """Read a 64-bit big-endian unsigned integer."""
        start = self._take(8)
        return int.from_bytes(self._buf[start : start + 8], "big")

    def pull_vi64(self) -> int:
        """Read a draft-18 vi64 (1-9 bytes, non-minimal encodings accepted)."""
        if self._pos >= self._end:
            raise BufferReadError("read out of bounds")
        length = _VI64_LEN[self._buf[self._pos]]
        start = self._take(length)
        if length == 1:
            return self._buf[start]
        raw = int.from_bytes(self._buf[start : start + length], "big")
        return raw & ((1 << _VI64_BITS[length]) - 1)

    # -- writing ------------------------------------------------------------------------------

    def _put(self, data: bytes | bytearray | memoryview) -> None:
        if not isinstance(self._buf, bytearray):
            raise BufferWriteError("buffer is read-only")
        end = self._pos + len(data)
        if end > self._capacity:
            raise BufferWriteError("write out of bounds")
        self._buf[self._pos : end] = data
        self._pos = end
        if end > self._end:
            self._end = end

    def push_bytes(self, value: bytes | bytearray | memoryview) -> None:
        """Write raw bytes."""
        self._put(value)

    def push_uint8(self, value: int) -> None:
        """Write an 8-bit unsigned integer."""
        self._put(_uint_bytes(value, 1))

    def push_uint16(self, value: int) -> None:
        """Write a 16-bit big-endian unsigned integer."""
        self._put(_uint_bytes(value, 2))

    def push_uint32(self, value: int) -> None:
        """Write a 32-bit big-endian unsigned integer."""
        self._put(_uint_bytes(value, 4))

    def push_uint64(self, value: int) -> None:
        """Write a 64-bit big-endian unsigned integer."""
        self._put(_uint_bytes(value, 8))

    def push_vi64(self, value: int, length: int | None = None) -> None:
        """Write a vi64, minimal unless ``length`` asks for a longer (still valid) encoding."""
        self._put(vi64_encode(value, length))


def _uint_bytes(value: int, size: int) -> bytes:
    if value < 0 or value >= 1 << (8 * size):
        raise BufferWriteError(f"value {value} does not fit in {size} bytes")
    return value.to_bytes(size, "big")
