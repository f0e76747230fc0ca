"""The ``kvtc`` rendition: K and V transform-coded like video (PCA basis, uniform quantizer, ANS coder).

Per layer of a block, K and V apart: each token's row (its heads concatenated, C = H_kv * head_dim values)
less what the block's layer before predicts for it (as the decoder decoded that layer; the first layer,
and any the tables do not predict, less its mean: ``TransformTables.predictor``), K weighted by its
queries' metric (``TransformTables.key_weight``), is rotated into the layer's PCA basis; the coefficients
are rounded to one uniform step, and the integers are entropy-coded with rANS (``constriction``) under a
per-component Laplace model whose scale the encoder picks from the block's own coefficients (sent as an
offset from the calibrated one; each class of scales, a quarter octave wide, is one precomputed
categorical model: kvnet.blocks.kvtc_entropy, the stage between words and integers). Basis, key weight,
predictors, means, steps and Laplace scales are the model's ``TransformTables``
(kvnet.blocks.transform_tables): calibrated once per model, content-addressed, signed and bound to the
model fingerprint. Every payload names the exact tables it was coded with.

The first token of a sequence is an attention sink: later queries put much of their weight on it, so its
error costs the model's output far more than any other row's (on SmolLM2, coding it exactly at the same
steps cuts the output KL about 4x). The encoder is told how many leading rows of the block are sinks
(``sink_rows``, the caller knows the block's position) and codes them with steps ``2**-SINK_SHIFT`` as
large, or as fine as the coder's range allows (a sink's coefficients can be thousands of steps: the
encoder picks the shift per stream and sends it); they cost a few hundred bytes once per sequence. No
coefficient is ever clamped: a block with one beyond the coder's range is refused (``CodecError``).

The same holds, less sharply, for every token: an error in a token's K or V reaches the output in
proportion to the attention it gets, and most tokens get little. The publisher measures that attention
with its own last queries (``kvnet.model.importance``) and codes each row up to ``TOKEN_SHIFT_SPAN``
halvings finer or coarser (``token_shifts_from_importance``; on SmolLM2 3.9x less KL at the same size,
docs/performance.md "kvtc steps per token"); the shifts travel in the stream (~23 bytes a stream).

Payload: the common header of kvnet.blocks.codecs (codec id 5, Flags = sink rows, Param = layer index)
with four raw sections: the tables' SHA-256 digest (32 bytes), the position of the block's first token in
its sequence (u32 LE: the prediction undoes and redoes K's rotary embedding), then for K and for V the
rANS words (u32 LE) followed by the CRC-32 of the decoded integers (int32 LE), class offsets and row
shifts, so a corrupted bitstream is refused, not decoded into a wrong tensor. Inside a stream: the sink
rows' shift (with sink rows), whether the other rows have shifts and if so each one's, each component's
class offset, then the integers class by class, then the escaped values (proto/KVOBJECT.md section 5
states the order for other implementations).
Decoding is two stages: ``parse`` entropy-decodes one payload (the costly part, on the CPU, independent of
every other layer, so a receiver runs layers in parallel: in processes, ``EntropyProcesses``, as the coder
holds the GIL), and ``reconstruct`` rebuilds its K and V in
torch, on CPU or CUDA, from the layer before's as decoded: in layer order. The encoder reconstructs each
layer with the same function to predict the next, so on one device both hold the same values; another
device may round a value's last bit differently, and that difference is carried into the layers after
(not corrected, as the quantization error is: benchmarks/device/bench_kvtc.py measures it).
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

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
from kvnet.blocks.kvtc_entropy import (
    RANGE,
    SINK_SHIFT,
    TOKEN_SHIFT_SPAN,
    EntropyProcesses,
    StreamJob,
    build_models,
    class_of,
    decode_layer_streams,
    encode_stream,
)

if TYPE_CHECKING:  # transform_tables imports codecs, which imports this module
    from kvnet.blocks.transform_tables import TransformTables

__all__ = ["TOKEN_SHIFT_SPAN", "CodedLayer", "TransformCodec", "token_shifts_from_importance"]

_DIGEST_LEN = 32
# A payload's block starts at this position of its sequence (u32 LE): the angles of K's rotary embedding,
# which the prediction from the layer before undoes and redoes.
_POSITION = struct.Struct("<I")
_MAX_POSITION = 2**32 - 1
_SECTIONS = 4  # digest, first position, K, V
_ROTATIONS_KEPT = 64  # blocks' rotary angles a codec keeps (``TransformCodec._rotation``)
TOKEN_SHIFT_POWER = 0.5
"""Halvings per doubling of a token's attention: its KL share goes with attention x step**2, so equal
shares want the step to go with attention**-1/2 (on SmolLM2 0.5 measured better than 0.35 or 0.75, and a
span of 2 better than 3: docs/performance.md, "kvtc steps per token")."""


def _row_scale(shifts: np.ndarray) -> torch.Tensor:
    """The factor of each row's steps, ``2**-shift`` (any shape of shifts)."""
    return torch.from_numpy(np.exp2(-shifts.astype(np.float64))).to(torch.float32)


def _quantize(coeffs: torch.Tensor, steps: torch.Tensor, sink_rows: int, token_shifts: np.ndarray | None,
              what: str) -> tuple[torch.Tensor, np.ndarray]:
    """The integers of ``coeffs`` (``[t, C]``) and each row's shift: the sink rows as many halvings finer
    (at most ``SINK_SHIFT``) as keep them within the coder's range; every other row at its requested
    ``token_shifts`` (``[t]``, none: 0), lowered as far as the range needs for a finer one.
    ``CodecError`` for a coefficient beyond the range at the tables' own step (never clamped: that would
    decode a wrong value)."""
    units = coeffs / steps
    widest = units.abs().amax(1)  # [t]
    if float(widest.max()) > RANGE:
        raise CodecError(f"kvtc: {what} holds a coefficient of {float(widest.max()):.3g} steps, beyond the "
                         f"coder's {RANGE} (far outside what its tables were calibrated on)")
    shifts = np.zeros(int(units.shape[0]), dtype=np.int64)
    if token_shifts is not None:
        shifts[sink_rows:] = token_shifts[sink_rows:]
        row_widest = widest.double().numpy()
        fits = np.floor(np.log2(RANGE / np.maximum(row_widest, 1e-30))).astype(np.int64)
        fits -= row_widest * np.exp2(fits) > RANGE  # the logarithm's last bit may round up
        shifts[sink_rows:] = np.minimum(shifts[sink_rows:], np.maximum(fits[sink_rows:], 0))
    if sink_rows:
        sink_widest = float(widest[:sink_rows].max())
        sink_shift = 0
        while sink_shift < SINK_SHIFT and sink_widest * 2.0 ** (sink_shift + 1) <= RANGE:
            sink_shift += 1
        shifts[:sink_rows] = sink_shift
    units *= torch.from_numpy(np.exp2(shifts.astype(np.float64))).to(units.dtype)[:, None]  # exact
    return torch.round(units).to(torch.int32), shifts


def _checked_shifts(token_shifts: np.ndarray | None, shape: tuple[int, ...]) -> np.ndarray | None:
    """``token_shifts`` as int64 of ``shape`` (``[block_size]`` a layer, ``[L, block_size]`` a block),
    each within ``TOKEN_SHIFT_SPAN``; ``CodecError`` otherwise."""
    if token_shifts is None:
        return None
    shifts = np.asarray(token_shifts, dtype=np.int64)
    if shifts.shape != shape or int(np.abs(shifts).max(initial=0)) > TOKEN_SHIFT_SPAN:
        raise CodecError(f"kvtc: token shifts must be {list(shape)} integers within +-{TOKEN_SHIFT_SPAN}")
    return shifts


def token_shifts_from_importance(importance: torch.Tensor, power: float = TOKEN_SHIFT_POWER,
                                 span: int = 2) -> np.ndarray:
    """Per (layer, token) shifts ``[L, N]`` for ``encode_block``'s ``token_shifts`` from the attention
    importance of a sequence's tokens (``[L, N]``, e.g. ``kvnet.model.importance.token_importance``): a
    token that gets ``2**x`` times the layer's geometric-mean attention is coded ``power * x`` halvings
    finer (rounded, within ``span`` either way), so the steps, hence the rate, stay about where they were
    on average while the error moves to the tokens later queries weigh least."""
    if not 0 <= span <= TOKEN_SHIFT_SPAN:
        raise CodecError(f"kvtc: token shifts span at most {TOKEN_SHIFT_SPAN} halvings, not {span}")
    logs = torch.log2(importance.double().clamp(min=1e-30))
    relative = logs - logs.mean(1, keepdim=True)
    return torch.round(power * relative).clamp(-span, span).to(torch.int64).numpy()


@dataclass(frozen=True, slots=True, eq=False)
class CodedLayer:
    """One layer's payload entropy-decoded (``TransformCodec.parse``): its tables, layer index, its block's
    first position, dtype, integers ``[2, T, C]`` (K, V; int16) and each row's step factor ``[2, T]``."""

    tables: TransformTables
    layer: int
    first_position: int
    dtype: torch.dtype
    integers: torch.Tensor
    row_scale: torch.Tensor

    @property
    def needs_previous(self) -> bool:
        """Predicted from its block's layer before: decoded after it, from it."""
        return self.tables.predicted_layers[self.layer]


class TransformCodec(Codec):
    """``kvtc``: needs the model's tables, installed with ``install`` (verified by the caller's
    ``TableStore``); a codec made ``for_model(fingerprint)`` refuses tables of any other model."""

    name = "kvtc"
    codec_id = 5
    lossless = False

    def __init__(self, fingerprint: bytes | None = None,
                 shared: dict[bytes, TransformTables] | None = None,
                 entropy: EntropyProcesses | None = None) -> None:
        super().__init__()
        self.fingerprint = fingerprint
        self.entropy = entropy
        """Worker processes that ``parse_layers`` entropy-decodes on (None: the calling thread)."""
        self._tables: dict[bytes, TransformTables] = {} if shared is None else shared
        self._device_tables: dict[tuple[bytes, str], tuple[torch.Tensor, ...]] = {}
        self._bases: dict[tuple[bytes, int, int], np.ndarray] = {}
        self._rotations: dict[tuple[bytes, int, int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def for_model(self, fingerprint: bytes) -> TransformCodec:
        """A view of this codec (same installed tables) that decodes only blocks of ``fingerprint``."""
        return TransformCodec(fingerprint, self._tables, self.entropy)

    def install(self, tables: TransformTables) -> None:
        """Make verified tables available to encode and decode (keyed by their digest)."""
        with self._lock:
            self._tables[tables.digest] = tables

    @staticmethod
    def prepare(tables: TransformTables) -> None:
        """Compute what decoding with ``tables`` needs before the first block does: the synthesis matrices
        and every coder model (~70 ms for SmolLM2's), e.g. on the thread that verified them."""
        _ = tables.synthesis
        build_models()

    def tables(self, digest: bytes) -> TransformTables:
        found = self._tables.get(bytes(digest))
        if found is None:
            raise CodecError(f"kvtc: tables {bytes(digest).hex()[:16]} are not installed (fetch the "
                             "model's tables first)")
        if self.fingerprint is not None and found.fingerprint != self.fingerprint:
            raise CodecError(f"kvtc: block coded with tables of model {found.fingerprint.hex()[:16]}, not "
                             f"{self.fingerprint.hex()[:16]}")
        return found

    def _base_classes(self, tables: TransformTables, layer: int, kind: int) -> np.ndarray:
        """The class of each component's calibrated spread, for one layer's K (``kind`` 0) or V; kept per
        tables (a dict assignment of an equal value is harmless when two threads make it at once)."""
        key = (tables.digest, layer, kind)
        base = self._bases.get(key)
        if base is None:
            base = self._bases[key] = class_of(tables.spread[layer, kind].numpy().astype(np.float64))
        return base

    # -- encode ---------------------------------------------------------------------------------------

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> bytes:
        raise CodecError("kvtc encodes a whole block with the model's tables: use encode_block")

    def encode_block(self, k: torch.Tensor, v: torch.Tensor, tables: TransformTables,
                     sink_rows: int = 0, token_shifts: np.ndarray | None = None, first_position: int = 0
                     ) -> list[bytes]:
        """All layers of a block, ``k, v: [L, block_size, H_kv, D]``, whose first token is at position
        ``first_position`` of its sequence: one payload per layer, each predicted from the layer before as
        the decoder will have decoded it (``TransformTables.predictor``). Its first ``sink_rows`` rows
        (the sequence's first tokens, in its first block) are coded finer, and every other row
        ``token_shifts[layer, row]`` halvings finer (negative: coarser; ``[L, block_size]`` integers
        within ``TOKEN_SHIFT_SPAN``, from ``token_shifts_from_importance``)."""
        if k.dim() != 4 or k.shape != v.shape:
            raise CodecError("kvtc: a block's K and V must both be [layers, block_size, heads, head_dim]")
        layers = int(k.shape[0])
        if layers != tables.num_layers:
            raise CodecError(f"kvtc: a block of {layers} layers does not fit tables for {tables.num_layers}")
        shifts = _checked_shifts(token_shifts, (layers, int(k.shape[1])))
        self.install(tables)
        previous: tuple[torch.Tensor, torch.Tensor] | None = None
        payloads = []
        for layer in range(layers):
            payload, previous = self._encode_layer(k[layer], v[layer], layer, tables, sink_rows,
                                                   None if shifts is None else shifts[layer], first_position,
                                                   previous)
            payloads.append(payload)
        return payloads

    def encode_layer(self, k: torch.Tensor, v: torch.Tensor, layer: int, tables: TransformTables,
                     sink_rows: int = 0, token_shifts: np.ndarray | None = None, first_position: int = 0,
                     previous: tuple[torch.Tensor, torch.Tensor] | None = None) -> bytes:
        """One layer of a block (``k, v: [block_size, H_kv, D]``; ``encode_block`` says the rest): a
        predicted layer needs its block's layer before as the decoder decodes it (``previous``)."""
        if not 0 <= layer < tables.num_layers:
            raise CodecError(f"kvtc: layer {layer} does not fit tables for {tables.num_layers} layers")
        shifts = _checked_shifts(token_shifts, (int(k.shape[0]),))
        self.install(tables)
        return self._encode_layer(k, v, layer, tables, sink_rows, shifts, first_position, previous)[0]

    def _encode_layer(self, k: torch.Tensor, v: torch.Tensor, layer: int, tables: TransformTables,
                      sink_rows: int, token_shifts: np.ndarray | None, first_position: int,
                      previous: tuple[torch.Tensor, torch.Tensor] | None,
                      ) -> tuple[bytes, tuple[torch.Tensor, torch.Tensor]]:
        """Layer ``layer``'s payload and what a decoder will make of it (``previous`` for the next layer)."""
        shape, dtype = _check_inputs(k, v)
        t, h, d = shape
        if not 0 <= sink_rows <= min(t, 255):
            raise CodecError(f"kvtc: {sink_rows} sink rows in a block of {t}")
        if (h, d) != (tables.num_kv_heads, tables.head_dim):
            raise CodecError(f"kvtc: layer {layer} of shape {shape} does not fit tables for "
                             f"{tables.num_layers} layers of {tables.num_kv_heads}x{tables.head_dim}")
        if not 0 <= first_position <= _MAX_POSITION - t:
            raise CodecError(f"kvtc: first position {first_position} out of range")
        base = self._base(tables, layer, first_position, t, previous, torch.device("cpu"))
        streams: list[_Section] = [(_MODE_RAW, _DIGEST_LEN, tables.digest),
                                   (_MODE_RAW, _POSITION.size, _POSITION.pack(first_position))]
        integers: list[torch.Tensor] = []
        scales: list[torch.Tensor] = []
        for kind, x in enumerate((k, v)):
            rows = _finite_float32(x.detach().cpu(), "k" if kind == 0 else "v").reshape(t, h * d)
            coeffs = (rows - base[kind]) @ tables.analysis[layer, kind]
            what = f"layer {layer}'s {'KV'[kind]}"
            q, shifts = _quantize(coeffs, tables.step[layer, kind], sink_rows, token_shifts, what)
            body = encode_stream(q.numpy(), self._base_classes(tables, layer, kind), shifts, sink_rows)
            streams.append((_MODE_RAW, len(body), body))
            integers.append(q)
            scales.append(_row_scale(shifts))
        decoded = self._reconstruct(tables, layer, torch.stack(integers), torch.stack(scales), base, dtype)
        header = _HEADER.pack(_MAGIC, FORMAT_VERSION, self.codec_id, _DTYPE_CODES[dtype], sink_rows,
                              len(streams), 0, t, h, d, layer, 0)
        table = b"".join(_SECTION.pack(mode, n, len(data)) for mode, n, data in streams)
        payload = b"".join([header, table, *(bytes(data) for _, _, data in streams)])
        return payload, decoded

    def _base(self, tables: TransformTables, layer: int, first_position: int, rows: int,
              previous: tuple[torch.Tensor, torch.Tensor] | None, device: torch.device) -> torch.Tensor:
        """``[2, rows or 1, C]`` float32 what layer ``layer``'s K and V rows (of a block of ``rows`` tokens
        at ``first_position``) are coded relative to: the prediction from the decoded layer before
        (``previous``, ``[rows, H, D]`` each), else the mean."""
        mean, _, _, predictor = self._on_device(tables, device)
        if not tables.predicted_layers[layer]:
            return mean[layer][:, None, :]
        if previous is None:
            raise CodecError(f"kvtc: layer {layer} is predicted from layer {layer - 1}, which was not given")
        c = tables.channels
        if any(tuple(x.shape[:1]) != (rows,) or x.numel() != rows * c for x in previous):
            raise CodecError(f"kvtc: layer {layer - 1} given to predict layer {layer} has the wrong shape")
        cos, sin = self._rotation(tables, first_position, rows, device)
        previous_k = previous[0].reshape(previous[0].shape[0], -1).to(device, torch.float32)
        previous_v = previous[1].reshape(previous[1].shape[0], -1).to(device, torch.float32)
        features = torch.cat((tables.rotate(previous_k, cos, sin, inverse=True), previous_v), 1)
        w = predictor[layer]
        predicted = torch.addmm(w[-1], features, w[:-1])
        return torch.stack((tables.rotate(predicted[:, :c].contiguous(), cos, sin), predicted[:, c:]))

    def _reconstruct(self, tables: TransformTables, layer: int, q: torch.Tensor, row_scale: torch.Tensor,
                     base: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[T, H, D]`` in ``dtype`` from a layer's integers ``[2, T, C]`` and row factors
        ``[2, T]`` (on ``base``'s device): the one computation the encoder and the decoder share, so that
        on one device both hold the same values to predict the next layer from."""
        _, synthesis, step, _ = self._on_device(tables, base.device)
        coeffs = q.to(torch.float32) * step[layer][:, None, :] * row_scale[:, :, None]
        rows = (torch.matmul(coeffs, synthesis[layer]) + base).to(dtype)
        shape = (rows.shape[1], tables.num_kv_heads, tables.head_dim)
        return rows[0].view(shape), rows[1].view(shape)

    # -- decode ---------------------------------------------------------------------------------------

    @staticmethod
    def tables_digest(data: bytes | bytearray | memoryview) -> bytes:
        """The digest of the tables a payload names (its first section), without decoding it: what a
        receiver fetches before it can decode (``CodecError`` if the payload is not a kvtc payload)."""
        header = read_header(data)
        start = _HEADER.size + header.num_sections * _SECTION.size
        if header.codec_id != TransformCodec.codec_id or header.num_sections != _SECTIONS or \
                len(data) < start:
            raise CodecError("not a kvtc payload")
        mode, raw_len, stored = _SECTION.unpack_from(data, _HEADER.size)
        if (mode, raw_len, stored) != (_MODE_RAW, _DIGEST_LEN, _DIGEST_LEN) or \
                len(data) < start + _DIGEST_LEN:
            raise CodecError("kvtc payload does not start with its tables' digest")
        return bytes(memoryview(data)[start:start + _DIGEST_LEN])

    def parse(self, data: bytes | bytearray | memoryview, shape: tuple[int, ...], dtype: torch.dtype
              ) -> CodedLayer:
        """One payload entropy-decoded and checked (the costly half of decoding, independent of every
        other layer: any thread may run it); ``reconstruct`` makes K and V of it."""
        return self.parse_layers([data], shape, dtype)[0]

    def parse_layers(self, payloads: Sequence[bytes | bytearray | memoryview], shape: tuple[int, ...],
                     dtype: torch.dtype) -> list[CodedLayer]:
        """``parse`` of each payload: on this codec's entropy processes where it has them (``entropy``; the
        calling thread waits for them without the GIL), else on the calling thread."""
        framed = [self._frame(data, shape, dtype) for data in payloads]
        jobs = [job for _, job in framed]
        entropy = self.entropy
        decoded = entropy.decode(jobs) if entropy is not None else [decode_layer_streams(job) for job in jobs]
        return [CodedLayer(tables, layer, first_position, dtype, torch.from_numpy(q), _row_scale(shifts))
                for ((tables, layer, first_position), _), (q, shifts) in zip(framed, decoded, strict=True)]

    def _frame(self, data: bytes | bytearray | memoryview, shape: tuple[int, ...], dtype: torch.dtype
               ) -> tuple[tuple[TransformTables, int, int], StreamJob]:
        """A payload's header and sections checked: its tables, layer and first position, and what its
        entropy decoding needs (``CodecError`` with one line for anything a kvtc encoder does not write)."""
        header = read_header(data)
        if header.codec_id != self.codec_id:
            raise CodecError(f"payload was written by codec id {header.codec_id}, not {self.name}")
        if header.dtype != dtype or header.shape != tuple(shape):
            raise CodecError(f"kvtc payload {header.shape} {header.dtype} does not match expected "
                             f"{tuple(shape)} {dtype}")
        t, h, d = header.shape
        if header.flags > t or header.num_sections != _SECTIONS:
            raise CodecError(f"kvtc payload has {header.flags} sink rows and {header.num_sections} sections")
        n = t * h * d
        view = memoryview(data).cast("B") if not isinstance(data, memoryview) else data.cast("B")
        offset = _HEADER.size + _SECTIONS * _SECTION.size
        if len(view) < offset:
            raise CodecError("kvtc payload truncated inside the section table")
        bodies: list[memoryview] = []
        for i in range(_SECTIONS):
            mode, raw_len, stored = _SECTION.unpack_from(view, _HEADER.size + i * _SECTION.size)
            # rANS spends at most 24 bits on a class symbol (its models' precision) and 16 more on an
            # escaped value, 5 bits on a component's class offset, 3 on a row's shift, plus its state,
            # the flags and the CRC (64 bytes allow for them); more is not a kvtc stream.
            fixed = (_DIGEST_LEN, _POSITION.size)
            limit = fixed[i] if i < len(fixed) else 5 * n + h * d + t + 64
            if mode != _MODE_RAW or raw_len != stored or (i < len(fixed) and raw_len != fixed[i]) or \
                    (i >= len(fixed) and (raw_len % 4 or not 8 <= raw_len <= limit)):
                raise CodecError(f"kvtc section {i}: bad mode {mode} or length {raw_len}/{stored}")
            if offset + stored > len(view):
                raise CodecError(f"kvtc payload truncated in section {i}")
            bodies.append(view[offset:offset + stored])
            offset += stored
        if offset != len(view):
            raise CodecError(f"{len(view) - offset} trailing bytes after the last kvtc section")
        tables = self.tables(bytes(bodies[0]))
        (first_position,) = _POSITION.unpack(bodies[1])
        layer = header.param
        if (h, d) != (tables.num_kv_heads, tables.head_dim) or layer >= tables.num_layers:
            raise CodecError(f"kvtc payload layer {layer} of {h}x{d} does not fit its tables")
        if first_position > _MAX_POSITION - t:
            raise CodecError(f"kvtc payload's first position {first_position} is out of range")
        job = StreamJob((bodies[2], bodies[3]),
                        (self._base_classes(tables, layer, 0), self._base_classes(tables, layer, 1)), t,
                        header.flags)
        return (tables, layer, first_position), job

    def _on_device(self, tables: TransformTables, device: torch.device) -> tuple[torch.Tensor, ...]:
        """mean, synthesis, step and predictor of ``tables`` on ``device``, copied there once."""
        key = (tables.digest, str(device))
        found = self._device_tables.get(key)
        if found is None:
            found = (tables.mean.to(device), tables.synthesis.to(device), tables.step.to(device),
                     tables.predictor.to(device))
            self._device_tables[key] = found
        return found

    def _rotation(self, tables: TransformTables, first_position: int, rows: int, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """``tables.rotation``, computed once per block and device (its layers share it; a few recent
        blocks are kept, as decoders of several blocks at once ask)."""
        key = (tables.digest, first_position, rows, str(device))
        found = self._rotations.get(key)
        if found is None:
            found = tables.rotation(first_position, rows, device)
            with self._lock:
                if len(self._rotations) >= _ROTATIONS_KEPT:
                    self._rotations.clear()
                self._rotations[key] = found
        return found

    def reconstruct(self, coded: CodedLayer, device: torch.device | str = "cpu",
                    previous: tuple[torch.Tensor, torch.Tensor] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[T, H, D]`` of a parsed layer, on ``device``. A predicted layer needs the K and V its
        block's layer before decoded to (``previous``; ``CodedLayer.needs_previous``), as this codec
        returned them."""
        dev = torch.device(device)
        t = int(coded.integers.shape[1])
        base = self._base(coded.tables, coded.layer, coded.first_position, t, previous, dev)
        return self._reconstruct(coded.tables, coded.layer, coded.integers.to(dev), coded.row_scale.to(dev),
                                 base, coded.dtype)

    def decode_block(
        self,
        payloads: Sequence[bytes | bytearray | memoryview],
        shape: tuple[int, int, int],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        previous: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Decode consecutive layers' payloads of one block, in layer order, into ``(k, v)`` per payload
        on ``device``: each predicted layer from the one decoded before it (the first from ``previous``,
        the layer before it, when it is not layer 0)."""
        out: list[tuple[torch.Tensor, torch.Tensor]] = []
        first: CodedLayer | None = None
        for data in payloads:
            coded = self.parse(data, shape, dtype)
            if first is None:
                first = coded
            elif (coded.layer, coded.first_position, coded.tables) != \
                    (first.layer + len(out), first.first_position, first.tables):
                raise CodecError(f"kvtc: layer {coded.layer} at position {coded.first_position} does not "
                                 f"follow layer {first.layer + len(out) - 1} of the block decoded with it")
            out.append(self.reconstruct(coded, device, out[-1] if out else previous))
        return out

    def decode(
        self,
        data: bytes | bytearray | memoryview,
        shape: tuple[int, int, int],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.decode_block([data], tuple(shape), dtype, device)[0]  # type: ignore[arg-type]

    def decode_into(
        self, data: bytes | bytearray | memoryview, k_out: torch.Tensor, v_out: torch.Tensor,
        previous: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """``decode`` into ``k_out, v_out``; a predicted layer needs its block's layer before
        (``previous``, as decoded)."""
        _check_outputs(k_out, v_out)
        coded = self.parse(data, tuple(k_out.shape), k_out.dtype)
        k, v = self.reconstruct(coded, k_out.device, previous)
        k_out.copy_(k)
        v_out.copy_(v)

    # The section hooks of the fixed-size codecs do not apply: kvtc's streams vary in length.
    def _encode_sections(self, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, list[_Section]]:
        raise CodecError("kvtc encodes with encode_block")

    def _section_sizes(self, header: PayloadHeader) -> list[int]:
        raise CodecError("kvtc payloads are parsed by TransformCodec.parse")

    def _decode_sections(self, header: PayloadHeader, raw: list[np.ndarray]
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        raise CodecError("kvtc payloads are parsed by TransformCodec.parse")

