"""Tests for proto/buffer.py: the Buffer cursor and the draft-18 vi64."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proto.buffer import (
    VI64_MAX,
    Buffer,
    BufferReadError,
    BufferWriteError,
    vi64_decode,
    vi64_encode,
    vi64_size,
)

# The draft's "Example Integer Encodings" table (section "Variable-Length Integers").
DRAFT_EXAMPLES = [
    ("25", 37),
    ("8025", 37),
    ("bbbd", 15_293),
    ("ed7f3e7d", 226_442_877),
    ("faa1a0e403d8", 2_893_212_287_960),
    ("fc8998abc66bc0", 151_288_809_941_952),
    ("fefa318fa8e3ca11", 70_423_237_261_249_041),
    ("ffffffffffffffffff", 18_446_744_073_709_551_615),
]

# (largest value, length) for each encoding length (section "Summary of Integer Encodings").
BOUNDARIES = [
    (127, 1),
    (16383, 2),
    (2097151, 3),
    (268435455, 4),
    (34359738367, 5),
    (4398046511103, 6),
    (562949953421311, 7),
    (72057594037927935, 8),
    (18446744073709551615, 9),
]


@pytest.mark.parametrize(("hexstr", "value"), DRAFT_EXAMPLES)
def test_draft_examples_decode(hexstr: str, value: int) -> None:
    data = bytes.fromhex(hexstr)
    buf = Buffer(data)
    assert buf.pull_vi64() == value
    assert buf.eof()
    assert vi64_decode(data) == (value, len(data))


def test_draft_examples_minimal_encode() -> None:
    # 0x8025 is a valid non-minimal encoding of 37; the encoder writes the minimal one.
    assert vi64_encode(37) == bytes.fromhex("25")
    assert vi64_encode(37, 2) == bytes.fromhex("8025")
    for hexstr, value in DRAFT_EXAMPLES[2:]:
        assert vi64_encode(value) == bytes.fromhex(hexstr)


@pytest.mark.parametrize(("top", "length"), BOUNDARIES)
def test_length_boundaries(top: int, length: int) -> None:
    assert vi64_size(top) == length
    assert len(vi64_encode(top)) == length
    assert Buffer(vi64_encode(top)).pull_vi64() == top
    if length < 9:
        assert vi64_size(top + 1) == length + 1
        assert Buffer(vi64_encode(top + 1)).pull_vi64() == top + 1


def test_out_of_range() -> None:
    with pytest.raises(BufferWriteError):
        vi64_encode(VI64_MAX + 1)
    with pytest.raises(BufferWriteError):
        vi64_encode(-1)
    with pytest.raises(BufferWriteError):
        vi64_encode(128, 1)
    with pytest.raises(BufferWriteError):
        vi64_encode(1, 10)


@given(st.integers(0, VI64_MAX), st.integers(1, 9))
def test_vi64_round_trip_any_length(value: int, length: int) -> None:
    if length < vi64_size(value):
        length = vi64_size(value)
    data = vi64_encode(value, length)
    assert len(data) == length
    buf = Buffer(data)
    assert buf.pull_vi64() == value
    assert buf.eof()


@pytest.mark.parametrize(("top", "length"), BOUNDARIES)
def test_truncated_vi64(top: int, length: int) -> None:
    data = vi64_encode(top)
    for cut in range(length):
        assert vi64_decode(data[:cut]) is None
        with pytest.raises(BufferReadError):
            Buffer(data[:cut]).pull_vi64()


def test_fixed_width_ints_round_trip() -> None:
    buf = Buffer()
    buf.push_uint8(0xAB)
    buf.push_uint16(0xBEEF)
    buf.push_uint32(0xDEADBEEF)
    buf.push_uint64(0x0123456789ABCDEF)
    buf.push_vi64(300)  # 0x12c -> 0b10_000001 0x2c
    buf.push_bytes(b"xyz")
    data = buf.data
    assert data == bytes.fromhex("abbeefdeadbeef0123456789abcdef812c78797a")
    rd = Buffer(data)
    assert rd.pull_uint8() == 0xAB
    assert rd.pull_uint16() == 0xBEEF
    assert rd.pull_uint32() == 0xDEADBEEF
    assert rd.pull_uint64() == 0x0123456789ABCDEF
    assert rd.pull_vi64() == 300
    assert rd.tell() == 17
    assert bytes(rd.pull_view(3)) == b"xyz"
    assert rd.eof()


def test_short_reads_raise() -> None:
    rd = Buffer(b"\x01")
    with pytest.raises(BufferReadError):
        rd.pull_uint16()
    assert rd.tell() == 0  # a failed read does not move the cursor
    with pytest.raises(BufferReadError):
        rd.pull_bytes(2)
    with pytest.raises(BufferReadError):
        rd.pull_bytes(-1)
    assert rd.pull_uint8() == 1
    for pull in (rd.pull_uint8, rd.pull_uint32, rd.pull_uint64, rd.pull_vi64):
        with pytest.raises(BufferReadError):
            pull()


def test_seek_and_slices() -> None:
    rd = Buffer(b"abcdef")
    rd.seek(4)
    assert rd.pull_bytes(2) == b"ef"
    assert rd.data == b"abcdef"
    assert rd.data_slice(1, 3) == b"bc"
    with pytest.raises(BufferReadError):
        rd.seek(7)
    with pytest.raises(BufferReadError):
        rd.data_slice(3, 9)


def test_write_capacity_and_read_only() -> None:
    wr = Buffer(capacity=2)
    wr.push_uint16(1)
    with pytest.raises(BufferWriteError):
        wr.push_uint8(1)
    with pytest.raises(BufferWriteError):
        Buffer(b"ab").push_uint8(1)
    with pytest.raises(BufferWriteError):
        Buffer().push_uint8(256)


def test_overwrite_after_seek() -> None:
    wr = Buffer()
    wr.push_uint16(0)
    wr.push_bytes(b"payload")
    end = wr.tell()
    wr.seek(0)
    wr.push_uint16(7)  # patch a length field in place
    wr.seek(end)
    assert wr.data == b"\x00\x07payload"
