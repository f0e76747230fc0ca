"""KV block codecs: the renditions one layer of one block can travel in.

A codec turns the keys and values of ONE layer of ONE block (``k, v: [block_size, H_kv, D]``) into one
self-describing byte payload and back. Renditions are registered by name in ``CODECS``; the name is what
appears in track names (see proto/KVOBJECT.md), so a name, once published, never changes meaning.

- ``lossless``: byte-plane shuffle + zstd (``_LOSSLESS_ZSTD``), bit-exact for every float dtype (NaN
  payloads, -0.0, subnormals and infinities included).
- ``plain``: the elements' own little-endian bytes, K then V, uncompressed: bit-exact like ``lossless``
  and larger on the wire, but decoding is one copy of each half straight into the destination (the
  paged cache's slots, or a new tensor). For links fast enough that zstd's decode costs more than the
  bytes it saves (the ABR weighs the two, ``kvnet.exchange.abr``).
- ``int8``: symmetric 8-bit quantization. Keys per channel, values per (token, head), chosen by measurement
  (benchmarks/bench_codecs.py), each followed by an optional zstd stage that is kept only where it pays.
- ``int4``: asymmetric 4-bit grouped quantization in the KIVI style: keys per channel (the group is the
  block's tokens), values per token (groups of ``value_group`` channels), two nibbles per byte, fp16 (or
  fp32) scales and zero points.

Payload layout (all integers little-endian)::

    header   20 bytes   magic "KV", version, codec id, dtype code, flags, section count, reserved,
                        block_size u32, num_kv_heads u16, head_dim u16, param u16, reserved u16
    table    9 bytes per section: mode u8 (0 raw, 1 zstd), raw length u32, stored length u32
    bodies   the sections' stored bytes, concatenated in table order

A zstd section is one frame that must declare its content size (equal to the raw length).
``decode`` checks the header against the shape and dtype the caller expects (they come from the signed
manifest) and every section length against the length that shape implies before it touches the data, so
a truncated, padded or corrupt payload raises ``CodecError`` instead of yielding a wrong tensor.

This module knows nothing about tracks, manifests or the network; it only maps tensors to bytes.
"""

from __future__ import annotations

import struct
import sys
import threading
from abc import ABC, abstractmethod
from typing import ClassVar, NamedTuple

import numpy as np
import torch
import zstandard

from kvnet.errors import CodecError

__all__ = [
    "CODECS",
    "Codec",
    "CodecError",
    "Int4Codec",
    "Int8Codec",
    "LosslessCodec",
    "PayloadHeader",
    "PlainCodec",
    "get_codec",
    "read_header",
]

FORMAT_VERSION = 1
_MAGIC = b"KV"
_HEADER = struct.Struct("<2sBBBBBBIHHHH")
_SECTION = struct.Struct("<BII")
_MODE_RAW = 0
_MODE_ZSTD = 1
# A zstd section is kept only if it saves at least this fraction; otherwise raw bytes decode for free.
_MIN_SAVING = 0.03
_MAX_SECTIONS = 16
# The whole section table of a payload of n sections, read in one call.
_TABLES = [struct.Struct("<" + "BII" * n) for n in range(_MAX_SECTIONS + 1)]

# Wire codes of the element dtypes. The decoded tensor always has the dtype recorded here.
_DTYPE_CODES: dict[torch.dtype, int] = {
    torch.bfloat16: 1,
    torch.float16: 2,
    torch.float32: 3,
    torch.float64: 4,
}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}
# Element size -> (torch int dtype to view bits, numpy unsigned view, numpy signed view for torch).
_INT_VIEW: dict[int, tuple[torch.dtype, type[np.unsignedinteger], type[np.signedinteger]]] = {
    2: (torch.int16, np.uint16, np.int16),
    4: (torch.int32, np.uint32, np.int32),
    8: (torch.int64, np.uint64, np.int64),
}
# Element size -> torch unsigned dtype of that width (a cache slot's words, seen by numpy unsigned).
_UINT_TORCH: dict[int, torch.dtype] = {2: torch.uint16, 4: torch.uint32, 8: torch.uint64}
_LITTLE_ENDIAN = sys.byteorder == "little"

# Flag bits shared by the quantizing codecs.
_FLAG_FP32_STATS = 0x01  # scales/zero points stored as float32 because float16 would not hold them
_FLAG_K_PER_TOKEN = 0x02  # int8: key scales per (token, head) instead of per channel
_FLAG_V_PER_CHANNEL = 0x04  # int8: value scales per channel instead of per (token, head)
_FP16_MAX = 65504.0
_FP16_MIN_NORMAL = 6.104e-05
# zstd level 1 for the lossless codec's planes, but matching only runs of 7+ bytes in a 64-entry table:
# the sign/exponent plane is near-entropy bytes in which level 1 finds short matches that cost more
# than the literals they replace. Any zstd decoder reads the frames (nothing changes on the wire);
# measured on SmolLM2's bf16 KV (1410 layers of 64 tokens): ratio 2.66 against 2.56, the node's
# decompress 18 against 31 us per layer, the publisher's compress ~2.8x faster (docs/performance.md).
_LOSSLESS_ZSTD = zstandard.ZstdCompressionParameters.from_level(1, min_match=7, hash_log=6, search_log=1)


class PayloadHeader(NamedTuple):
    """The fixed header at the start of every codec payload (a tuple: read once per layer object)."""

    version: int
    """Payload format version (``FORMAT_VERSION``)."""
    codec_id: int
    """Numeric id of the codec that wrote the payload."""
    dtype: torch.dtype
    """Element dtype of the encoded (and decoded) tensors."""
    flags: int
    """Codec-specific flag bits."""
    num_sections: int
    """Number of entries in the section table."""
    shape: tuple[int, int, int]
    """(block_size, num_kv_heads, head_dim) of each of K and V."""
    param: int
    """Codec-specific parameter (int4: value group size)."""


_Section = tuple[int, int, bytes | memoryview]
"""A section: mode, raw length and its stored bytes (a plain tuple: a fetch splits every layer object
into sections, where each Python step counts)."""


def read_header(data: bytes | bytearray | memoryview) -> PayloadHeader:
    """Parse and validate the fixed header of a payload without touching the sections."""
    if len(data) < _HEADER.size:
        raise CodecError(f"payload of {len(data)} bytes is shorter than the {_HEADER.size}-byte header")
    magic, version, codec_id, dtype_code, flags, nsect, reserved, t, h, d, param, reserved2 = (
        _HEADER.unpack_from(data, 0)
    )
    if magic != _MAGIC:
        raise CodecError(f"bad payload magic {magic!r}")
    if version != FORMAT_VERSION:
        raise CodecError(f"unsupported payload version {version}")
    if dtype_code not in _CODE_DTYPES:
        raise CodecError(f"unknown dtype code {dtype_code}")
    if reserved or reserved2:
        raise CodecError("reserved header bytes must be zero")
    if not 1 <= nsect <= _MAX_SECTIONS:
        raise CodecError(f"section count {nsect} out of range")
    return PayloadHeader(version, codec_id, _CODE_DTYPES[dtype_code], flags, nsect, (t, h, d), param)


class Codec(ABC):
    """One rendition of a block layer: ``encode(k, v) -> bytes`` and ``decode(...) -> (k, v)``."""

    name: ClassVar[str]
    """Rendition name as used in track names (lowercase ASCII)."""
    codec_id: ClassVar[int]
    """Numeric id written in each payload header."""
    lossless: ClassVar[bool]
    """True if decode(encode(k, v)) reproduces k and v bit for bit."""
    compresses: ClassVar[bool] = True
    """False: every section is raw, and a payload with a zstd section is malformed (``plain``)."""

    def __init__(self) -> None:
        # zstd contexts are reusable but not thread-safe, so each thread gets its own pair.
        self._local = threading.local()

    # -- public API ---------------------------------------------------------------------------------

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> bytes:
        """Encode one layer of one block; ``k, v: [block_size, H_kv, D]``, same float dtype."""
        shape, dtype = _check_inputs(k, v)
        flags, param, sections = self._encode_sections(k.detach().cpu(), v.detach().cpu())
        header = _HEADER.pack(
            _MAGIC, FORMAT_VERSION, self.codec_id, _DTYPE_CODES[dtype], flags, len(sections), 0, *shape,
            param, 0,
        )
        table = b"".join(_SECTION.pack(mode, raw_len, len(data)) for mode, raw_len, data in sections)
        return b"".join([header, table, *(data for _, _, data in sections)])

    def decode(
        self,
        data: bytes | bytearray | memoryview,
        shape: tuple[int, int, int],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode a payload into ``(k, v)``, each ``shape`` and ``dtype`` on ``device``.

        ``shape`` and ``dtype`` are what the caller expects (from the manifest); any disagreement with
        the payload, and any malformed byte, raises ``CodecError``.
        """
        header, raw = self._inflated(data, tuple(shape), dtype)
        k, v = self._decode_sections(header, raw)
        if device != "cpu" and torch.device(device).type != "cpu":
            k, v = k.to(device), v.to(device)
        return k, v

    def decode_into(
        self, data: bytes | bytearray | memoryview, k_out: torch.Tensor, v_out: torch.Tensor
    ) -> None:
        """Decode a payload straight into ``k_out`` and ``v_out`` (``[block_size, H_kv, D]`` each, CPU).

        The outputs say what the payload must be: their shape and dtype play the part of ``decode``'s
        ``shape`` and ``dtype``. Made for the paged cache's slots of a block reserved for an import (the
        fetch path): the lossless codec writes its words into them directly, with no intermediate tensor
        and no copy. A malformed payload raises ``CodecError``, possibly after part of the outputs was
        written, so the caller hands in only memory nobody reads until the layer is known good.
        """
        _check_outputs(k_out, v_out)
        if k_out.device.type != "cpu" or v_out.device.type != "cpu":
            raise CodecError("decode_into writes CPU tensors (stage a device's slots through host memory)")
        header, raw = self._inflated(data, tuple(k_out.shape), k_out.dtype)
        self._decode_sections_into(header, raw, k_out, v_out)

    def _inflated(
        self, data: bytes | bytearray | memoryview, shape: tuple[int, ...], dtype: torch.dtype
    ) -> tuple[PayloadHeader, list[np.ndarray]]:
        """The validated header and the raw (inflated) sections of a payload expected to be ``shape``,
        ``dtype``."""
        header = read_header(data)
        if header.codec_id != self.codec_id:
            raise CodecError(f"payload was written by codec id {header.codec_id}, not {self.name}")
        if header.dtype != dtype:
            raise CodecError(f"payload dtype {header.dtype} does not match expected {dtype}")
        if shape != header.shape:
            raise CodecError(f"payload shape {header.shape} does not match expected {shape}")
        if min(header.shape) <= 0:
            raise CodecError(f"payload shape {header.shape} has an empty dimension")
        expected = self._section_sizes(header)
        sections = self._split_sections(data, header, expected)
        return header, [self._inflate(*section) for section in sections]

    # -- per-codec hooks ----------------------------------------------------------------------------

    @abstractmethod
    def _encode_sections(self, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, list[_Section]]:
        """Return (flags, param, sections) for CPU tensors ``k, v``."""

    @abstractmethod
    def _section_sizes(self, header: PayloadHeader) -> list[int]:
        """Raw byte length of every section implied by the header (validates flags and param)."""

    @abstractmethod
    def _decode_sections(
        self, header: PayloadHeader, raw: list[np.ndarray]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rebuild CPU ``(k, v)`` from the raw (uint8) section arrays of the validated sizes."""

    def _decode_sections_into(
        self, header: PayloadHeader, raw: list[np.ndarray], k_out: torch.Tensor, v_out: torch.Tensor
    ) -> None:
        """Rebuild ``(k, v)`` into the given CPU tensors; codecs that can write in place override this."""
        k, v = self._decode_sections(header, raw)
        k_out.copy_(k)
        v_out.copy_(v)

    # -- shared machinery ---------------------------------------------------------------------------

    def _zstd(self) -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
        pair: tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor] | None = getattr(
            self._local, "pair", None
        )
        if pair is None:
            pair = (self._compressor(), zstandard.ZstdDecompressor())
            self._local.pair = pair
        return pair

    def _compressor(self) -> zstandard.ZstdCompressor:
        """A new zstd compressor with this codec's settings (``_zstd`` keeps one per thread)."""
        return zstandard.ZstdCompressor(level=1)

    def _section(self, raw: np.ndarray, try_zstd: bool = True) -> _Section:
        """Wrap contiguous bytes as a section, zstd-compressed only if that saves ``_MIN_SAVING``."""
        view = np.ascontiguousarray(raw).data.cast("B")
        if try_zstd and len(view) > 64:
            packed = self._zstd()[0].compress(view)
            if len(packed) <= len(view) * (1.0 - _MIN_SAVING):
                return (_MODE_ZSTD, len(view), packed)
        return (_MODE_RAW, len(view), view)

    def _split_sections(
        self, data: bytes | bytearray | memoryview, header: PayloadHeader, expected: list[int]
    ) -> list[_Section]:
        if header.num_sections != len(expected):
            raise CodecError(f"{self.name}: expected {len(expected)} sections, header says "
                             f"{header.num_sections}")
        table_end = _HEADER.size + _SECTION.size * header.num_sections
        if len(data) < table_end:
            raise CodecError("payload truncated inside the section table")
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        table = _TABLES[header.num_sections].unpack_from(view, _HEADER.size)
        sections: list[_Section] = []
        offset = table_end
        for i, want in enumerate(expected):
            mode, raw_len, stored_len = table[3 * i : 3 * i + 3]
            if raw_len != want:
                raise CodecError(f"section {i}: raw length {raw_len}, shape implies {want}")
            if mode == _MODE_RAW:
                if stored_len != raw_len:
                    raise CodecError(f"section {i}: raw section stores {stored_len} of {raw_len} bytes")
            elif mode != _MODE_ZSTD:
                raise CodecError(f"section {i}: unknown mode {mode}")
            elif not self.compresses:
                raise CodecError(f"section {i}: compressed, but {self.name} payloads are stored raw")
            if offset + stored_len > len(view):
                raise CodecError(f"payload truncated in section {i}")
            sections.append((mode, raw_len, view[offset : offset + stored_len]))
            offset += stored_len
        if offset != len(view):
            raise CodecError(f"{len(view) - offset} trailing bytes after the last section")
        return sections

    def _inflate(self, mode: int, raw_len: int, data: bytes | memoryview) -> np.ndarray:
        if mode == _MODE_RAW:
            return np.frombuffer(data, dtype=np.uint8)
        # The frame must declare exactly the size the shape implies, so a hostile frame cannot make us
        # allocate more than the validated length.
        try:
            declared = zstandard.frame_content_size(data)
            if declared != raw_len:
                raise CodecError(f"zstd frame declares {declared} bytes, expected {raw_len}")
            out = self._zstd()[1].decompress(data, max_output_size=raw_len)
        except zstandard.ZstdError as exc:
            raise CodecError(f"corrupt zstd section: {exc}") from exc
        if len(out) != raw_len:
            raise CodecError(f"zstd section inflated to {len(out)} bytes, expected {raw_len}")
        return np.frombuffer(out, dtype=np.uint8)


def _check_inputs(k: torch.Tensor, v: torch.Tensor) -> tuple[tuple[int, int, int], torch.dtype]:
    if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
        raise CodecError("k and v must be tensors")
    if k.dim() != 3 or k.shape != v.shape:
        raise CodecError(f"k and v must both be [block_size, H_kv, D]; got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if k.dtype != v.dtype or k.dtype not in _DTYPE_CODES:
        raise CodecError(f"unsupported dtypes {k.dtype}/{v.dtype}; need one of {list(_DTYPE_CODES)}")
    t, h, d = (int(n) for n in k.shape)
    if not (0 < t < 2**32 and 0 < h < 2**16 and 0 < d < 2**16):
        raise CodecError(f"shape {(t, h, d)} outside the payload header limits")
    return (t, h, d), k.dtype


def _check_outputs(k_out: torch.Tensor, v_out: torch.Tensor) -> None:
    """``decode_into``'s outputs: the two halves of one layer, so one shape ``[block_size, H_kv, D]`` and
    one dtype."""
    if k_out.shape != v_out.shape or k_out.dtype != v_out.dtype or k_out.dim() != 3:
        raise CodecError(f"k_out and v_out must both be [block_size, H_kv, D] of one dtype; got "
                         f"{tuple(k_out.shape)} {k_out.dtype} and {tuple(v_out.shape)} {v_out.dtype}")


def _as_uint(x: torch.Tensor) -> np.ndarray:
    """Little-endian unsigned-integer numpy view of a float tensor's bits (no copy when contiguous)."""
    esize = x.element_size()
    int_dtype, np_dtype, _ = _INT_VIEW[esize]
    arr = x.contiguous().view(int_dtype).numpy().view(np_dtype).reshape(-1)
    return arr if _LITTLE_ENDIAN else arr.byteswap()


# ---------------------------------------------------------------------------------------------------
# lossless
# ---------------------------------------------------------------------------------------------------


class LosslessCodec(Codec):
    """Byte-plane shuffle + zstd (``_LOSSLESS_ZSTD``): bit-exact.

    The elements of K then V are split into byte planes, least significant first. The plane holding the
    sign and exponent is highly repetitive and compresses well; the low mantissa planes are close to
    random and are stored raw (zstd would gain nothing and cost time). One section per plane.
    """

    name = "lossless"
    codec_id = 1
    lossless = True

    def _compressor(self) -> zstandard.ZstdCompressor:
        return zstandard.ZstdCompressor(compression_params=_LOSSLESS_ZSTD)

    def _encode_sections(self, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, list[_Section]]:
        words = np.concatenate([_as_uint(k), _as_uint(v)])
        planes = words.view(np.uint8).reshape(-1, words.itemsize)
        return 0, 0, [self._section(planes[:, p]) for p in range(words.itemsize)]

    def _section_sizes(self, header: PayloadHeader) -> list[int]:
        if header.flags or header.param:
            raise CodecError("lossless payload has non-zero flags or param")
        t, h, d = header.shape
        return [2 * t * h * d] * header.dtype.itemsize

    def _decode_sections(
        self, header: PayloadHeader, raw: list[np.ndarray]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        _, np_dtype, np_signed = _INT_VIEW[len(raw)]
        words = np.empty(raw[0].size, dtype=np_dtype)
        _join_planes(raw, words)
        if not _LITTLE_ENDIAN:
            words = words.byteswap()
        k, v = torch.from_numpy(words.view(np_signed).reshape(2, *header.shape)).view(header.dtype).unbind(0)
        return k, v

    def _decode_sections_into(
        self, header: PayloadHeader, raw: list[np.ndarray], k_out: torch.Tensor, v_out: torch.Tensor
    ) -> None:
        if not (_LITTLE_ENDIAN and k_out.is_contiguous() and v_out.is_contiguous()):
            super()._decode_sections_into(header, raw, k_out, v_out)
            return
        word_dtype = _UINT_TORCH[len(raw)]
        n = raw[0].size // 2  # the planes hold K's elements, then V's
        _join_planes(raw, k_out.view(word_dtype).numpy().reshape(n), 0)
        _join_planes(raw, v_out.view(word_dtype).numpy().reshape(n), n)


def _join_planes(planes: list[np.ndarray], words: np.ndarray, start: int = 0) -> None:
    """Write elements ``start`` to ``start + words.size`` of byte planes (plane p holds byte p, little-endian
    order, of every word) into ``words``, an unsigned array of one word per element (a new array, or a
    cache slot's own memory)."""
    stop = start + words.size
    if len(planes) == 2:
        # Shifting whole planes into the uint16 words is ~3x faster than a strided byte scatter.
        np.left_shift(planes[1][start:stop], 8, out=words, dtype=np.uint16)
        np.bitwise_or(words, planes[0][start:stop], out=words)
        return
    interleaved = words.view(np.uint8).reshape(words.size, len(planes))
    for p, plane in enumerate(planes):
        interleaved[:, p] = plane[start:stop]


# ---------------------------------------------------------------------------------------------------
# plain
# ---------------------------------------------------------------------------------------------------


class PlainCodec(Codec):
    """The elements' little-endian bytes, uncompressed: bit-exact, decoded by one copy per half.

    Two raw sections: K's elements, then V's (``n * itemsize`` bytes each, the tensors' memory as is on
    a little-endian host). A zstd section is malformed. ``decode_into`` validates the header and table,
    then copies each section straight from the payload into the output's memory: the only work a plain
    layer costs a receiver besides its digest.
    """

    name = "plain"
    codec_id = 4
    lossless = True
    compresses = False

    def _encode_sections(self, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, list[_Section]]:
        return 0, 0, [self._section(_as_uint(x).view(np.uint8), try_zstd=False) for x in (k, v)]

    def _section_sizes(self, header: PayloadHeader) -> list[int]:
        if header.flags or header.param:
            raise CodecError("plain payload has non-zero flags or param")
        t, h, d = header.shape
        return [t * h * d * header.dtype.itemsize] * 2

    def _decode_sections(
        self, header: PayloadHeader, raw: list[np.ndarray]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k = torch.empty(header.shape, dtype=header.dtype)
        v = torch.empty(header.shape, dtype=header.dtype)
        self._decode_sections_into(header, raw, k, v)
        return k, v

    def _decode_sections_into(
        self, header: PayloadHeader, raw: list[np.ndarray], k_out: torch.Tensor, v_out: torch.Tensor
    ) -> None:
        for section, out in zip(raw, (k_out, v_out), strict=True):
            if _LITTLE_ENDIAN and out.is_contiguous():
                # One memcpy from the payload into the destination's memory, through flat uint8 views
                # (~2 us per 64 KiB; Tensor.copy_ from a read-only array, or assigning into a memoryview
                # cast from the 3-d array, took 25-40x longer).
                np.copyto(out.view(torch.uint8).numpy().reshape(-1), section)
            else:
                _, np_dtype, np_signed = _INT_VIEW[header.dtype.itemsize]
                words = section.view(np_dtype)
                if not _LITTLE_ENDIAN:
                    words = words.byteswap()
                out.copy_(torch.from_numpy(words.view(np_signed).reshape(header.shape).copy())
                          .view(header.dtype))


# ---------------------------------------------------------------------------------------------------
# quantizing codecs
# ---------------------------------------------------------------------------------------------------


def _finite_float32(x: torch.Tensor, what: str) -> torch.Tensor:
    xf = x.to(torch.float32)
    if not bool(torch.isfinite(xf).all()):
        raise CodecError(f"{what} contains inf or nan; lossy renditions need finite values")
    return xf


def _stats_dtype(*stats: torch.Tensor) -> tuple[torch.dtype, int]:
    """float16 when every statistic fits its normal range (or is zero), else float32."""
    for s in stats:
        a = s.abs()
        smallest_nonzero = torch.where(a > 0, a, torch.inf).amin()
        if float(a.amax()) > _FP16_MAX or float(smallest_nonzero) < _FP16_MIN_NORMAL:
            return torch.float32, _FLAG_FP32_STATS
    return torch.float16, 0


def _stats_bytes(s: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    return s.to(dtype).contiguous().numpy().view(np.uint8).reshape(-1)


def _stats_from(raw: np.ndarray, fp32: bool, shape: tuple[int, ...]) -> torch.Tensor:
    # Copy: the raw bytes may be unaligned and read-only; statistics are small.
    arr = raw.view(np.float32 if fp32 else np.float16).astype(np.float32).reshape(shape)
    if not np.isfinite(arr).all():
        raise CodecError("non-finite scale or zero point in payload")
    return torch.from_numpy(arr)


class Int8Codec(Codec):
    """Symmetric int8: ``x ≈ q * scale``, ``q in [-127, 127]``, one scale per group.

    Keys use one scale per channel (h, d) over the block's tokens, values one scale per (token, head)
    over the head dimension, chosen with bench_codecs.py: per-channel key scales cut the key error by
    about a quarter on the reference model's K/V and keep outlier channels (which trained models have,
    per KIVI) from flattening the rest; per-channel value scales were also slightly more accurate there,
    but cost ~4% of the ratio at 16-token blocks, and trained models' value outliers are per token.
    Either layout of each tensor is selectable and recorded in the flags, so decoders accept both.
    Sections: K codes, V codes (int8, zstd if it pays), K scales, V scales.
    """

    name = "int8"
    codec_id = 2
    lossless = False

    def __init__(self, key_per_channel: bool = True, value_per_channel: bool = False) -> None:
        super().__init__()
        self.key_per_channel = key_per_channel
        self.value_per_channel = value_per_channel

    @staticmethod
    def _reduce_dims(per_channel: bool) -> int:
        # per channel: reduce over tokens (dim 0); per (token, head): reduce over head_dim (dim 2).
        return 0 if per_channel else 2

    def _encode_sections(self, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, list[_Section]]:
        xs = [_finite_float32(k, "k"), _finite_float32(v, "v")]
        dims = [self._reduce_dims(self.key_per_channel), self._reduce_dims(self.value_per_channel)]
        scales = [x.abs().amax(dim=dim, keepdim=True) / 127.0 for x, dim in zip(xs, dims, strict=True)]
        stats_dtype, flags = _stats_dtype(*scales)
        codes: list[_Section] = []
        for i, x in enumerate(xs):
            # Quantize against the scale as stored, so decode multiplies by exactly what encode divided by.
            scales[i] = scales[i].to(stats_dtype).to(torch.float32)
            safe = torch.where(scales[i] > 0, scales[i], torch.ones_like(scales[i]))
            q = torch.round(x / safe).clamp_(-127, 127).to(torch.int8)
            codes.append(self._section(q.numpy().view(np.uint8).reshape(-1)))
        if not self.key_per_channel:
            flags |= _FLAG_K_PER_TOKEN
        if self.value_per_channel:
            flags |= _FLAG_V_PER_CHANNEL
        stat_sections = [self._section(_stats_bytes(s, stats_dtype), try_zstd=False) for s in scales]
        return flags, 0, [*codes, *stat_sections]

    def _stat_shape(self, shape: tuple[int, int, int], per_channel: bool) -> tuple[int, int, int]:
        t, h, d = shape
        return (1, h, d) if per_channel else (t, h, 1)

    def _section_sizes(self, header: PayloadHeader) -> list[int]:
        if header.flags & ~(_FLAG_FP32_STATS | _FLAG_K_PER_TOKEN | _FLAG_V_PER_CHANNEL) or header.param:
            raise CodecError(f"int8 payload has unknown flags {header.flags:#x} or param {header.param}")
        t, h, d = header.shape
        width = 4 if header.flags & _FLAG_FP32_STATS else 2
        k_pc = not header.flags & _FLAG_K_PER_TOKEN
        v_pc = bool(header.flags & _FLAG_V_PER_CHANNEL)
        k_stats = int(np.prod(self._stat_shape(header.shape, k_pc)))
        v_stats = int(np.prod(self._stat_shape(header.shape, v_pc)))
        return [t * h * d, t * h * d, k_stats * width, v_stats * width]

    def _decode_sections(
        self, header: PayloadHeader, raw: list[np.ndarray]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        fp32 = bool(header.flags & _FLAG_FP32_STATS)
        per_channel = (not header.flags & _FLAG_K_PER_TOKEN, bool(header.flags & _FLAG_V_PER_CHANNEL))
        out: list[torch.Tensor] = []
        for i in range(2):
            scale = _stats_from(raw[2 + i], fp32, self._stat_shape(header.shape, per_channel[i]))
            q = torch.from_numpy(raw[i].view(np.int8).astype(np.float32)).view(header.shape)
            out.append((q * scale).to(header.dtype))
        return out[0], out[1]


class Int4Codec(Codec):
    """Asymmetric 4-bit grouped quantization: ``x ≈ q * scale + zero``, ``q in [0, 15]``.

    KIVI layout: keys per channel (one (scale, zero) per (head, channel) over the block's tokens), values
    per token (one (scale, zero) per ``value_group`` consecutive channels of a (token, head)). Codes are
    packed two per byte, element 2i in the low nibble. Sections: K codes, V codes, K scales, K zeros,
    V scales, V zeros. ``param`` in the header is the value group size.
    """

    name = "int4"
    codec_id = 3
    lossless = False

    def __init__(self, value_group: int = 64) -> None:
        super().__init__()
        if not 1 <= value_group < 2**16:
            raise ValueError(f"value_group must be in [1, 65535], got {value_group}")
        self.value_group = value_group

    def _group_size(self, d: int) -> int:
        # Fall back to whole rows when head_dim is not a multiple of the configured group.
        return self.value_group if d % self.value_group == 0 else d

    @staticmethod
    def _min_max(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, zero) mapping the group's [min, max] onto the 16 code points."""
        lo = x.amin(dim=dim, keepdim=True)
        hi = x.amax(dim=dim, keepdim=True)
        return (hi - lo) / 15.0, lo

    @staticmethod
    def _pack(q: torch.Tensor) -> np.ndarray:
        flat = q.reshape(-1)
        if flat.numel() % 2:
            flat = torch.cat([flat, flat.new_zeros(1)])
        pairs = flat.view(-1, 2)
        return (pairs[:, 0] | (pairs[:, 1] << 4)).numpy()

    def _encode_sections(self, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, list[_Section]]:
        t, h, d = k.shape
        g = self._group_size(d)
        kf = _finite_float32(k, "k")
        vf = _finite_float32(v, "v").view(t, h, d // g, g)
        k_scale, k_zero = self._min_max(kf, 0)  # [1, H, D]
        v_scale, v_zero = self._min_max(vf, 3)  # [T, H, D/g, 1]
        stats_dtype, flags = _stats_dtype(k_scale, k_zero, v_scale, v_zero)
        stored = [s.to(stats_dtype).to(torch.float32) for s in (k_scale, k_zero, v_scale, v_zero)]
        codes: list[_Section] = []
        for x, scale, zero in ((kf, stored[0], stored[1]), (vf, stored[2], stored[3])):
            safe = torch.where(scale > 0, scale, torch.ones_like(scale))
            q = torch.round((x - zero) / safe).clamp_(0, 15).to(torch.uint8)
            codes.append(self._section(self._pack(q), try_zstd=False))
        stat_sections = [self._section(_stats_bytes(s, stats_dtype), try_zstd=False) for s in stored]
        return flags, g, [*codes, *stat_sections]

    def _section_sizes(self, header: PayloadHeader) -> list[int]:
        t, h, d = header.shape
        g = header.param
        if header.flags & ~_FLAG_FP32_STATS:
            raise CodecError(f"int4 payload has unknown flags {header.flags:#x}")
        if g <= 0 or d % g:
            raise CodecError(f"int4 value group {g} does not divide head_dim {d}")
        width = 4 if header.flags & _FLAG_FP32_STATS else 2
        packed = (t * h * d + 1) // 2
        return [packed, packed, h * d * width, h * d * width, t * h * (d // g) * width,
                t * h * (d // g) * width]

    @staticmethod
    def _unpack(raw: np.ndarray, n: int) -> torch.Tensor:
        packed = torch.from_numpy(raw.copy())
        q = torch.stack([packed & 0x0F, packed >> 4], dim=1).view(-1)[:n]
        return q.to(torch.float32)

    def _decode_sections(
        self, header: PayloadHeader, raw: list[np.ndarray]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        t, h, d = header.shape
        g = header.param
        fp32 = bool(header.flags & _FLAG_FP32_STATS)
        n = t * h * d
        k_scale = _stats_from(raw[2], fp32, (1, h, d))
        k_zero = _stats_from(raw[3], fp32, (1, h, d))
        v_scale = _stats_from(raw[4], fp32, (t, h, d // g, 1))
        v_zero = _stats_from(raw[5], fp32, (t, h, d // g, 1))
        k = self._unpack(raw[0], n).view(t, h, d) * k_scale + k_zero
        v = self._unpack(raw[1], n).view(t, h, d // g, g) * v_scale + v_zero
        return k.to(header.dtype), v.view(t, h, d).to(header.dtype)


CODECS: dict[str, Codec] = {c.name: c for c in (LosslessCodec(), PlainCodec(), Int8Codec(), Int4Codec())}
"""Registered renditions by name; the names are part of the wire format (track names)."""



def get_codec(name: str) -> Codec:
    """The registered codec called ``name``; ``CodecError`` if there is none."""
    try:
        return CODECS[name]
    except KeyError:
        raise CodecError(f"unknown codec {name!r}; known: {sorted(CODECS)}") from None
