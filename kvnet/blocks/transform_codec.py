"""The ``kvtc`` rendition: K and V transform-coded like video (PCA basis, uniform quantizer, ANS coder).

Per layer of a block, K and V apart: each token's row (its heads concatenated, C = H_kv * head_dim values)
is centred, K weighted by its queries' metric (``TransformTables.key_weight``), and rotated into the
layer's PCA basis; the coefficients are rounded to one uniform step, and the integers are entropy-coded
with rANS (``constriction``) under a per-component Laplace model. Basis, key weight, means, steps and
Laplace scales are the model's ``TransformTables`` (kvnet.blocks.transform_tables): calibrated once per
model, content-addressed, signed and bound to the model fingerprint. Every payload names the exact tables
it was coded with.

The first token of a sequence is an attention sink: later queries put much of their weight on it, so its
error costs the model's output far more than any other row's (on SmolLM2, coding it exactly at the same
steps cuts the output KL about 4x). The encoder is told how many leading rows of the block are sinks
(``sink_rows``, the caller knows the block's position) and codes them with steps ``2**-SINK_SHIFT`` as
large; they cost a few hundred bytes once per sequence.

Payload: the common header of kvnet.blocks.codecs (codec id 5, Flags = sink rows, Param = layer index)
with three raw sections: the tables' SHA-256 digest (32 bytes), then for K and for V the rANS words (u32
LE) followed by the CRC-32 of the decoded integers (int32 LE), so a corrupted bitstream is refused, not
decoded into a wrong tensor. Decoding rebuilds a block's layers together in torch (one batched matmul), on
CPU or CUDA.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import constriction
import numpy as np
import torch

from kvnet.blocks.codecs import (
    _DTYPE_CODES,
    _HEADER,
    _MAGIC,
    _MODE_RAW,
    _SECTION,
    FORMAT_VERSION,
    Codec,
    CodecError,
    PayloadHeader,
    _check_inputs,
    _check_outputs,
    _finite_float32,
    _Section,
    read_header,
)

if TYPE_CHECKING:  # transform_tables imports codecs, which imports this module
    from kvnet.blocks.transform_tables import TransformTables

__all__ = ["TransformCodec"]

# Coefficients are clamped to this many steps either side of zero (the coder's alphabet).
_RANGE = 32767
_LAPLACE = constriction.stream.model.QuantizedLaplace(-_RANGE, _RANGE + 1)
_DIGEST_LEN = 32
# Sink rows are coded with steps this many halvings finer than the tables' (see the module docstring).
SINK_SHIFT = 6


def _row_scale(t: int, sink_rows: int) -> torch.Tensor:
    """``[t]`` factor of each row's steps: finer for the sink rows."""
    scale = torch.ones(t)
    scale[:sink_rows] = 2.0 ** -SINK_SHIFT
    return scale


def _laplace_scales(tables: TransformTables, layer: int, kind: int, t: int, sink_rows: int) -> np.ndarray:
    """The coder's Laplace scale of every symbol of a ``[t, C]`` stream, row-major: a sink row's integers
    are ``2**SINK_SHIFT`` times larger, and so is their scale."""
    spread = tables.spread[layer, kind].numpy().astype(np.float64)
    scales = np.tile(spread, (t, 1))
    scales[:sink_rows] *= 2.0 ** SINK_SHIFT
    return scales.reshape(-1)


class TransformCodec(Codec):
    """``kvtc``: needs the model's tables, installed with ``install`` (verified by the caller's
    ``TableStore``); a codec made ``for_model(fingerprint)`` refuses tables of any other model."""

    name = "kvtc"
    codec_id = 5
    lossless = False

    def __init__(self, fingerprint: bytes | None = None,
                 shared: dict[bytes, TransformTables] | None = None) -> None:
        super().__init__()
        self.fingerprint = fingerprint
        self._tables: dict[bytes, TransformTables] = {} if shared is None else shared
        self._device_tables: dict[tuple[bytes, str], tuple[torch.Tensor, ...]] = {}
        self._lock = threading.Lock()

    def for_model(self, fingerprint: bytes) -> TransformCodec:
        """A view of this codec (same installed tables) that decodes only blocks of ``fingerprint``."""
        return TransformCodec(fingerprint, self._tables)

    def install(self, tables: TransformTables) -> None:
        """Make verified tables available to encode and decode (keyed by their digest)."""
        with self._lock:
            self._tables[tables.digest] = tables

    def tables(self, digest: bytes) -> TransformTables:
        found = self._tables.get(bytes(digest))
        if found is None:
            raise CodecError(f"kvtc: tables {bytes(digest).hex()[:16]} are not installed (fetch the "
                             "model's tables first)")
        if self.fingerprint is not None and found.fingerprint != self.fingerprint:
            raise CodecError(f"kvtc: block coded with tables of model {found.fingerprint.hex()[:16]}, not "
                             f"{self.fingerprint.hex()[:16]}")
        return found

    # -- encode ---------------------------------------------------------------------------------------

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> bytes:
        raise CodecError("kvtc encodes with the model's tables and a layer index: use encode_layer")

    def encode_layer(self, k: torch.Tensor, v: torch.Tensor, layer: int, tables: TransformTables,
                     sink_rows: int = 0) -> bytes:
        """Encode layer ``layer`` of a block (``k, v: [block_size, H_kv, D]``) with ``tables``; its first
        ``sink_rows`` rows (the sequence's first tokens, in its first block) are coded finer."""
        shape, dtype = _check_inputs(k, v)
        t, h, d = shape
        if not 0 <= sink_rows <= min(t, 255):
            raise CodecError(f"kvtc: {sink_rows} sink rows in a block of {t}")
        if (h, d) != (tables.num_kv_heads, tables.head_dim) or not 0 <= layer < tables.num_layers:
            raise CodecError(f"kvtc: layer {layer} of shape {shape} does not fit tables for "
                             f"{tables.num_layers} layers of {tables.num_kv_heads}x{tables.head_dim}")
        self.install(tables)
        streams: list[_Section] = [(_MODE_RAW, _DIGEST_LEN, tables.digest)]
        for kind, x in enumerate((k, v)):
            rows = _finite_float32(x.detach().cpu(), "k" if kind == 0 else "v").reshape(t, h * d)
            coeffs = (rows - tables.mean[layer, kind]) @ tables.analysis[layer, kind]
            steps = tables.step[layer, kind] * _row_scale(t, sink_rows)[:, None]
            q = torch.round(coeffs / steps).clamp_(-_RANGE, _RANGE).to(torch.int32)
            symbols = q.numpy().reshape(-1)
            scales = _laplace_scales(tables, layer, kind, t, sink_rows)
            coder = constriction.stream.stack.AnsCoder()
            coder.encode_reverse(symbols, _LAPLACE, np.zeros_like(scales), scales)
            words = coder.get_compressed().astype("<u4").tobytes()
            # The CRC starts from the sink-row count, so a changed Flags byte is refused too.
            crc = zlib.crc32(symbols.astype("<i4").tobytes(), sink_rows).to_bytes(4, "little")
            body = words + crc
            streams.append((_MODE_RAW, len(body), body))
        header = _HEADER.pack(_MAGIC, FORMAT_VERSION, self.codec_id, _DTYPE_CODES[dtype], sink_rows,
                              len(streams), 0, t, h, d, layer, 0)
        table = b"".join(_SECTION.pack(mode, n, len(data)) for mode, n, data in streams)
        return b"".join([header, table, *(bytes(data) for _, _, data in streams)])

    def encode_block(self, k: torch.Tensor, v: torch.Tensor, tables: TransformTables,
                     sink_rows: int = 0) -> list[bytes]:
        """All layers of a block, ``k, v: [L, block_size, H_kv, D]``: one payload per layer."""
        return [self.encode_layer(k[layer], v[layer], layer, tables, sink_rows)
                for layer in range(k.shape[0])]

    # -- decode ---------------------------------------------------------------------------------------

    @staticmethod
    def tables_digest(data: bytes | bytearray | memoryview) -> bytes:
        """The digest of the tables a payload names (its first section), without decoding it: what a
        receiver fetches before it can decode (``CodecError`` if the payload is not a kvtc payload)."""
        header = read_header(data)
        start = _HEADER.size + header.num_sections * _SECTION.size
        if header.codec_id != TransformCodec.codec_id or header.num_sections != 3 or len(data) < start:
            raise CodecError("not a kvtc payload")
        mode, raw_len, stored = _SECTION.unpack_from(data, _HEADER.size)
        if (mode, raw_len, stored) != (_MODE_RAW, _DIGEST_LEN, _DIGEST_LEN) or \
                len(data) < start + _DIGEST_LEN:
            raise CodecError("kvtc payload does not start with its tables' digest")
        return bytes(memoryview(data)[start:start + _DIGEST_LEN])

    def _parse(self, data: bytes | bytearray | memoryview, shape: tuple[int, ...], dtype: torch.dtype
               ) -> tuple[PayloadHeader, TransformTables, np.ndarray]:
        """Header, tables and the entropy-decoded integers ``[2, T, C]`` of one payload."""
        header = read_header(data)
        if header.codec_id != self.codec_id:
            raise CodecError(f"payload was written by codec id {header.codec_id}, not {self.name}")
        if header.dtype != dtype or header.shape != tuple(shape):
            raise CodecError(f"kvtc payload {header.shape} {header.dtype} does not match expected "
                             f"{tuple(shape)} {dtype}")
        t, h, d = header.shape
        if header.flags > t or header.num_sections != 3:
            raise CodecError(f"kvtc payload has {header.flags} sink rows and {header.num_sections} sections")
        n = t * h * d
        view = memoryview(data).cast("B") if not isinstance(data, memoryview) else data.cast("B")
        offset = _HEADER.size + 3 * _SECTION.size
        if len(view) < offset:
            raise CodecError("kvtc payload truncated inside the section table")
        bodies: list[memoryview] = []
        for i in range(3):
            mode, raw_len, stored = _SECTION.unpack_from(view, _HEADER.size + i * _SECTION.size)
            # rANS spends at most ~32 bits on a symbol of this alphabet; more is not a kvtc stream.
            limit = _DIGEST_LEN if i == 0 else 4 * n + 8
            if mode != _MODE_RAW or raw_len != stored or (i == 0 and raw_len != _DIGEST_LEN) or \
                    (i > 0 and (raw_len % 4 or not 8 <= raw_len <= limit)):
                raise CodecError(f"kvtc section {i}: bad mode {mode} or length {raw_len}/{stored}")
            if offset + stored > len(view):
                raise CodecError(f"kvtc payload truncated in section {i}")
            bodies.append(view[offset:offset + stored])
            offset += stored
        if offset != len(view):
            raise CodecError(f"{len(view) - offset} trailing bytes after the last kvtc section")
        tables = self.tables(bytes(bodies[0]))
        layer = header.param
        if (h, d) != (tables.num_kv_heads, tables.head_dim) or layer >= tables.num_layers:
            raise CodecError(f"kvtc payload layer {layer} of {h}x{d} does not fit its tables")
        q = np.empty((2, t, h * d), dtype=np.int32)
        for kind in range(2):
            body = bodies[1 + kind]
            words = np.frombuffer(body[:-4], dtype="<u4").astype(np.uint32)
            scales = _laplace_scales(tables, layer, kind, t, header.flags)
            try:
                coder = constriction.stream.stack.AnsCoder(words)
                symbols = coder.decode(_LAPLACE, np.zeros_like(scales), scales)
                exhausted = coder.is_empty()
            except Exception as exc:  # the coder's own error types vary by input
                raise CodecError(f"kvtc: corrupt {'KV'[kind]} bitstream ({exc})") from None
            crc = zlib.crc32(symbols.astype("<i4").tobytes(), header.flags)
            if not exhausted or crc != int.from_bytes(body[-4:], "little"):
                raise CodecError(f"kvtc: corrupt {'KV'[kind]} bitstream (checksum mismatch)")
            q[kind] = symbols.reshape(t, h * d)
        return header, tables, q

    def _on_device(self, tables: TransformTables, device: torch.device) -> tuple[torch.Tensor, ...]:
        key = (tables.digest, str(device))
        found = self._device_tables.get(key)
        if found is None:
            found = (tables.mean.to(device), tables.synthesis.to(device),
                     tables.step.to(device))
            self._device_tables[key] = found
        return found

    def decode_block(
        self,
        payloads: Sequence[bytes | bytearray | memoryview],
        shape: tuple[int, int, int],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Decode several layers' payloads (of one block, or any) into ``(k, v)`` per payload, on ``device``.

        The entropy decode is the coder's (CPU); the inverse transform runs in torch for all the payloads
        at once: one batched matmul on ``device``.
        """
        dev = torch.device(device)
        parsed = [self._parse(p, shape, dtype) for p in payloads]
        if not parsed:
            return []
        t, h, d = shape
        digests = {tables.digest for _, tables, _ in parsed}
        if len(digests) != 1:
            raise CodecError("kvtc: payloads decoded together must share their tables")
        tables = parsed[0][1]
        mean, synthesis, step = self._on_device(tables, dev)
        layers = torch.tensor([header.param for header, _, _ in parsed], device=dev)
        q = torch.from_numpy(np.stack([p[2] for p in parsed])).to(dev)  # [n, 2, T, C]
        rows_scale = torch.stack([_row_scale(t, header.flags) for header, _, _ in parsed]).to(dev)  # [n, T]
        coeffs = q.to(torch.float32) * step[layers][:, :, None, :] * rows_scale[:, None, :, None]
        rows = torch.matmul(coeffs, synthesis[layers]) + mean[layers][:, :, None, :]
        out = rows.to(dtype).view(len(parsed), 2, t, h, d)
        return [(out[i, 0], out[i, 1]) for i in range(len(parsed))]

    def decode(
        self,
        data: bytes | bytearray | memoryview,
        shape: tuple[int, int, int],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.decode_block([data], tuple(shape), dtype, device)[0]  # type: ignore[arg-type]

    def decode_into(
        self, data: bytes | bytearray | memoryview, k_out: torch.Tensor, v_out: torch.Tensor
    ) -> None:
        _check_outputs(k_out, v_out)
        k, v = self.decode(data, tuple(k_out.shape), k_out.dtype, k_out.device)  # type: ignore[arg-type]
        k_out.copy_(k)
        v_out.copy_(v)

    # The section hooks of the fixed-size codecs do not apply: kvtc's streams vary in length.
    def _encode_sections(self, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, list[_Section]]:
        raise CodecError("kvtc encodes with encode_layer")

    def _section_sizes(self, header: PayloadHeader) -> list[int]:
        raise CodecError("kvtc payloads are parsed by TransformCodec._parse")

    def _decode_sections(self, header: PayloadHeader, raw: list[np.ndarray]
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        raise CodecError("kvtc payloads are parsed by TransformCodec._parse")

