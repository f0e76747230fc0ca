"""The tables of the ``kvtc`` rendition: a per-model, per-layer PCA basis and quantizer/coder parameters.

Owns: calibrating the tables from a model's K/V, their byte format, their content address (SHA-256 of the
body), signing them, verifying a received table object (signature, digest, model fingerprint) and a
directory store that keeps verified table objects beside a node's blocks. Nothing here knows the network.

A table object is, all integers little-endian::

    body       magic "KVTT", version u8, model fingerprint (32), num_layers u16, num_kv_heads u16,
               head_dim u16, then float32 arrays: mean [L, 2, C], basis [L, 2, C, C] (columns are the
               components, strongest first), step [L, 2, C], spread [L, 2, C], key_weight [L, H, D, D],
               predictor [L, 2C + 1, 2C], rope_inv_freq [D / 2]
               (C = num_kv_heads * head_dim = H * D; index 0 of the "2" axis is K, 1 is V)
    key id     u8 length, then that many bytes
    signature  64 bytes, Ed25519 over "kvnet-kvtc-tables-v1" || 0x00 || SHA-256(body)

The digest (the tables' name, carried in every ``kvtc`` payload) is SHA-256 of the body, so it binds the
basis, the quantizer steps and the model fingerprint; the signature binds them to a publisher key.

K is coded in the metric the model reads it through. A key only ever enters the model as the logits
``q . k`` of the queries that attend to it, so an error along a direction no query looks at costs
nothing, and one along the queries' strong directions costs most. ``key_weight`` is, per KV head, the
square root of the second moment ``E[q q^T]`` of the queries that read the head (summed over its query
group); K rows are multiplied by it before the PCA and the quantizer, so their squared error is the
logits' squared error. On SmolLM2 bf16 this lowered the output KL at the same size by about a quarter
(docs/performance.md). The same for V (weighted by the output projection) measured worse than no weight,
so V is not weighted. The decoder's inverse of the weight is computed from it, not carried: a weight
that is not symmetric positive definite, or too ill-conditioned to invert, is refused when parsed.

A layer's K and V are predicted from the layer before it, as a video codec predicts a frame from the one
it decoded last, and only the residual is transform-coded. The previous layer's decoded K, its rotary
position embedding undone (``rope_inv_freq``, the model's inverse frequencies in the rotate-half layout;
zeros: no rotation), its decoded V and a constant 1 are the features; ``predictor[l]`` maps them to layer
``l``'s K before rotation and V (a ridge regression fitted on the calibration text in the decoder's own
closed loop: on what the previous layer decodes to, in the cache's dtype, not on its exact values). The
prediction's K is rotated to the block's positions, so one predictor serves every position. On SmolLM2
bf16 this made blocks about 1.4x smaller at about the same output KL (docs/performance.md, "kvtc
predicted from the layer before"). A fit needs text:
with fewer than ``PREDICT_TOKENS_PER_FEATURE`` tokens per feature it overfits (worse than none), and the
layer's predictor stays zero (predicted by its mean alone, as layer 0 always is).
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from kvnet.blocks.codecs import CodecError
from kvnet.security.signing import Signer, TrustStore
from proto.kvobject import (
    MAX_TABLES_BYTES,
    TABLES_HEADER,
    TABLES_MAGIC,
    TABLES_SIGNING_CONTEXT,
    KVObjectError,
    split_signed_tables,
    tables_array_sizes,
    tables_body_length,
)

__all__ = [
    "TableStore", "TransformTables", "calibrate", "key_weights", "load_tables", "parse_tables_body",
    "predictor_tokens", "sign_tables", "verify_tables",
]

TABLES_VERSION = 5
# Laplace scales below this (in quantizer steps) are raised to it: a component that was always zero in
# calibration can still be coded, at a few bits, if a block ever has it non-zero.
_MIN_SPREAD = 0.02
# The query metric's eigenvalues are raised by this fraction of their mean before the square root, so
# the key weight stays invertible and a direction no calibration query used is still coded coarsely.
_METRIC_RIDGE = 0.01
# A received key weight whose eigenvalues spread wider than this is refused: the ridge above bounds an
# honest one's spread by sqrt(head_dim / _METRIC_RIDGE), about 80 for 64 dimensions.
_MAX_WEIGHT_CONDITION = 1e4
PREDICT_TOKENS_PER_FEATURE = 8
"""Calibration tokens per predictor feature (2C + 1) below which layers are not predicted: on SmolLM2
(385 features) 960 tokens overfit (3.3x the output KL of no prediction), 4,096 fit."""
_PREDICT_RIDGE = 0.01
"""Ridge of the predictor's fit, relative to each feature's energy."""


_T = TypeVar("_T")


@dataclass(frozen=True, eq=False)
class TransformTables:
    """What a ``kvtc`` decoder needs beyond the block, for one model (all float32, CPU)."""

    fingerprint: bytes
    num_layers: int
    num_kv_heads: int
    head_dim: int
    mean: torch.Tensor
    """[L, 2, C] per-layer mean of K and V rows (a token's heads concatenated)."""
    basis: torch.Tensor
    """[L, 2, C, C] orthonormal PCA basis; column j is component j."""
    step: torch.Tensor
    """[L, 2, C] uniform quantizer step of each component's coefficient (the bit allocation)."""
    spread: torch.Tensor
    """[L, 2, C] Laplace scale of each component's quantized coefficient, in steps (the entropy model)."""
    key_weight: torch.Tensor
    """[L, H, D, D] per KV head, the square root of its queries' second moment (identity: unweighted)."""
    predictor: torch.Tensor
    """[L, 2C + 1, 2C] layer ``l``'s K (rotation undone) and V from layer ``l - 1``'s decoded K (rotation
    undone), V and 1 (the module docstring); all zero for layer 0 and any layer not predicted."""
    rope_inv_freq: torch.Tensor
    """[D / 2] the model's rotary inverse frequencies (rotate-half layout); zeros: K is not rotated."""

    @property
    def channels(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rotates(self) -> bool:
        """Whether K carries a rotary position embedding (non-zero ``rope_inv_freq``)."""
        return self._cached("_rotates", lambda: bool(self.rope_inv_freq.any()))

    @property
    def predicted_layers(self) -> tuple[bool, ...]:
        """Whether each layer is predicted from the one before (a non-zero predictor)."""
        return self._cached("_predicted", lambda: tuple(bool(x) for x in self.predictor.flatten(1).any(1)))

    def rotation(self, first_position: int, rows: int, device: torch.device | str = "cpu"
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[rows, 1, D / 2]`` (float32) of positions ``first_position ..`` (angles in float64,
        so encoder and decoder agree however their float32 arithmetic differs)."""
        positions = torch.arange(first_position, first_position + rows, dtype=torch.float64)
        angles = positions[:, None] * self.rope_inv_freq.to(torch.float64)[None, :]
        return angles.cos().float()[:, None].to(device), angles.sin().float()[:, None].to(device)

    def rotate(self, rows: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False
               ) -> torch.Tensor:
        """K rows ``[T, C]`` rotated by ``rotation``'s angles (``inverse``: rotated back)."""
        if not self.rotates:
            return rows
        x = rows.view(rows.shape[0], self.num_kv_heads, self.head_dim)
        x1, x2 = x.chunk(2, dim=-1)
        s = -sin if inverse else sin
        return torch.cat((x1 * cos - x2 * s, x2 * cos + x1 * s), dim=-1).view(rows.shape)

    def _cached(self, name: str, make: Callable[[], _T]) -> _T:
        found: _T | None = self.__dict__.get(name)
        if found is None:
            found = make()
            object.__setattr__(self, name, found)
        return found

    @property
    def key_weight_inverse(self) -> torch.Tensor:
        """[L, H, D, D] the inverse of ``key_weight``, which the decoder applies (``CodecError`` if the
        weight is not symmetric positive definite)."""
        return self._cached("_key_weight_inverse", lambda: _symmetric_inverse(self.key_weight))

    @property
    def analysis(self) -> torch.Tensor:
        """[L, 2, C, C] centred rows to coefficients: the key weight, then the basis (V: the basis)."""
        return self._cached("_analysis", lambda: torch.stack(
            (_block_diagonal(self.key_weight) @ self.basis[:, 0], self.basis[:, 1]), dim=1))

    @property
    def synthesis(self) -> torch.Tensor:
        """[L, 2, C, C] coefficients to centred rows: the inverse of ``analysis``."""
        return self._cached("_synthesis", lambda: torch.stack(
            (self.basis[:, 0].transpose(-1, -2) @ _block_diagonal(self.key_weight_inverse),
             self.basis[:, 1].transpose(-1, -2)), dim=1).contiguous())

    def body(self) -> bytes:
        header = TABLES_HEADER.pack(TABLES_MAGIC, TABLES_VERSION, self.fingerprint, self.num_layers,
                                   self.num_kv_heads, self.head_dim)
        arrays = (self.mean, self.basis, self.step, self.spread, self.key_weight, self.predictor,
                  self.rope_inv_freq)
        return header + b"".join(a.to(torch.float32).contiguous().numpy().astype("<f4").tobytes()
                                 for a in arrays)

    @property
    def digest(self) -> bytes:
        return self._cached("_digest", lambda: hashlib.sha256(self.body()).digest())


def _block_diagonal(blocks: torch.Tensor) -> torch.Tensor:
    """``[L, H, D, D]`` per-head blocks as ``[L, H*D, H*D]`` block-diagonal matrices."""
    layers, heads, d, _ = blocks.shape
    out = blocks.new_zeros(layers, heads * d, heads * d)
    for h in range(heads):
        out[:, h * d:(h + 1) * d, h * d:(h + 1) * d] = blocks[:, h]
    return out


def parse_tables_body(body: bytes) -> TransformTables:
    """Tables from a body (unverified: a received object goes through ``verify_tables``)."""
    if len(body) < TABLES_HEADER.size:
        raise CodecError("kvtc tables: body shorter than its header")
    magic, version, fingerprint, layers, heads, head_dim = TABLES_HEADER.unpack_from(body, 0)
    if magic != TABLES_MAGIC:
        raise CodecError(f"kvtc tables: bad magic {magic!r}")
    if version != TABLES_VERSION:
        raise CodecError(f"kvtc tables: format version {version}, not {TABLES_VERSION} (calibrate them again "
                         "with 'kvnet kvtc calibrate')")
    if not (layers and heads and head_dim):
        raise CodecError("kvtc tables: empty model shape")
    c = heads * head_dim
    counts = tables_array_sizes(layers, heads, head_dim)
    if TABLES_HEADER.size + 4 * sum(counts) != len(body):
        raise CodecError(f"kvtc tables: body of {len(body)} bytes does not match its shape")
    flat = np.frombuffer(body, dtype="<f4", offset=TABLES_HEADER.size).astype(np.float32)
    if not np.isfinite(flat).all():
        raise CodecError("kvtc tables: non-finite value")
    parts, offset = [], 0
    for n in counts:
        parts.append(torch.from_numpy(flat[offset:offset + n].copy()))
        offset += n
    step, spread = parts[2].view(layers, 2, c), parts[3].view(layers, 2, c)
    if bool((step <= 0).any()) or bool((spread <= 0).any()):
        raise CodecError("kvtc tables: non-positive quantizer step or spread")
    predictor = parts[5].view(layers, 2 * c + 1, 2 * c)
    if bool(predictor[0].any()):
        raise CodecError("kvtc tables: layer 0 has no layer before it to be predicted from")
    if head_dim % 2 and bool(parts[6].any()):
        raise CodecError(f"kvtc tables: a rotary embedding needs an even head dim, not {head_dim}")
    tables = TransformTables(fingerprint, layers, heads, head_dim, parts[0].view(layers, 2, c),
                             parts[1].view(layers, 2, c, c), step, spread,
                             parts[4].view(layers, heads, head_dim, head_dim), predictor, parts[6])
    _ = tables.key_weight_inverse  # refuses a weight the decoder could not invert, here rather than at decode
    return tables


def load_tables(path: Path, fingerprint: bytes) -> TransformTables:
    """A node's own tables from ``path`` (what ``kvnet kvtc calibrate`` writes: a body, or a signed table
    object whose signature is ignored, since the node signs them again with its key), checked against the
    model ``fingerprint``; ``CodecError`` with one line when they cannot be used."""
    try:
        if path.stat().st_size > MAX_TABLES_BYTES:
            raise CodecError(f"kvtc tables {path}: larger than {MAX_TABLES_BYTES} bytes")
        data = path.read_bytes()
    except OSError as exc:
        raise CodecError(f"kvtc tables {path}: {exc.strerror or exc}") from None
    try:
        tables = parse_tables_body(data[:tables_body_length(data)])
    except (CodecError, KVObjectError) as exc:
        raise CodecError(f"{path}: {exc}") from None
    if tables.fingerprint != fingerprint:
        raise CodecError(f"kvtc tables {path} were calibrated for model {tables.fingerprint.hex()[:16]}, not "
                         f"this node's {fingerprint.hex()[:16]} (calibrate them with the same model, dtype "
                         "and block size)")
    return tables


def sign_tables(tables: TransformTables, signer: Signer) -> bytes:
    """The table object: body, key id and signature over the body's digest."""
    kid = signer.key_id
    signature = signer.sign(TABLES_SIGNING_CONTEXT + tables.digest)
    return tables.body() + bytes([len(kid)]) + kid + signature


def verify_tables(data: bytes, trust: TrustStore, fingerprint: bytes,
                  digest: bytes | None = None) -> TransformTables:
    """Parse a table object and check it: signed by a trusted key, for the model ``fingerprint``, and (when
    given) named ``digest``. Any failure raises ``CodecError`` with one line."""
    try:
        signed = split_signed_tables(data)
    except KVObjectError as exc:
        raise CodecError(str(exc)) from None
    body_digest = signed.digest
    if digest is not None and body_digest != digest:
        raise CodecError(f"kvtc tables: content digest {body_digest.hex()[:16]} is not the requested "
                         f"{digest.hex()[:16]}")
    if not trust.verify(signed.key_id, signed.signing_bytes(), signed.signature):
        raise CodecError("kvtc tables: signature does not verify under a trusted key")
    tables = parse_tables_body(signed.body)
    if tables.fingerprint != fingerprint:
        raise CodecError(f"kvtc tables are bound to model {tables.fingerprint.hex()[:16]}, not "
                         f"{fingerprint.hex()[:16]}")
    return tables


def key_weights(query_metric: torch.Tensor) -> torch.Tensor:
    """``key_weight`` (``[L, H, D, D]``) from each KV head's query second moment: the symmetric square
    root of ``E[q q^T]``, its eigenvalues raised by ``_METRIC_RIDGE`` of their mean. A head no query
    reads (an all-zero metric) has no metric to code in: ``CodecError``."""
    m = query_metric.to(torch.float64)
    m = (m + m.transpose(-1, -2)) / 2
    values, vectors = torch.linalg.eigh(m)
    values = values.clamp(min=0)
    mean = values.mean(-1, keepdim=True)
    if not bool((mean > 0).all()):
        raise CodecError("kvtc query metric is zero for some KV head (no query energy to weight K by)")
    values = values + _METRIC_RIDGE * mean
    return ((vectors * values.sqrt()[..., None, :]) @ vectors.transpose(-1, -2)).float()


def _symmetric_inverse(weight: torch.Tensor) -> torch.Tensor:
    """The inverse of each ``[D, D]`` block of a symmetric positive definite ``[L, H, D, D]`` weight,
    through its eigenvectors (float64); anything else raises ``CodecError``."""
    w = weight.to(torch.float64)
    if float((w - w.transpose(-1, -2)).abs().max()) > 1e-5 * float(w.abs().max()):
        raise CodecError("kvtc tables: key weight is not symmetric")
    values, vectors = torch.linalg.eigh((w + w.transpose(-1, -2)) / 2)
    if not bool((values[..., 0] * _MAX_WEIGHT_CONDITION > values[..., -1]).all()):
        raise CodecError("kvtc tables: key weight is not positive definite or too ill-conditioned")
    return ((vectors * values.reciprocal()[..., None, :]) @ vectors.transpose(-1, -2)).float()


def predictor_tokens(channels: int) -> int:
    """Calibration tokens ``calibrate`` needs to predict layers of ``channels`` (H x D) K/V values."""
    return PREDICT_TOKENS_PER_FEATURE * (2 * channels + 1)


def calibrate(k: torch.Tensor, v: torch.Tensor, fingerprint: bytes, rel_step: float = 0.04,
              key_rel_step: float | None = None, step_scale: torch.Tensor | None = None,
              query_metric: torch.Tensor | None = None, positions: torch.Tensor | None = None,
              rope_inv_freq: torch.Tensor | None = None, cache_dtype: torch.dtype = torch.float32,
              predict: bool = True) -> TransformTables:
    """Tables from calibration K/V ``[L, N, H, D]`` (N tokens of ordinary text, not the evaluation text).

    Layer by layer, in order, and for K and V apart: what the layer before predicts (the module docstring;
    layer 0, or too little text: the rows' mean), the eigenvectors of the residuals' covariance (PCA), and
    one uniform step for all components, ``rel_step * sqrt(12) * rms`` of the centred rows (so a predicted
    layer keeps the error it would have unpredicted, in fewer bits). One step for every
    component is the MSE-optimal allocation of an entropy-coded uniform quantizer (reverse water-filling):
    weak components round to zero and cost almost nothing, strong ones get the bits. Tying the step to
    each layer's RMS gives every layer the same relative error. ``spread`` is each component's mean
    absolute quantized value, the Laplace scale the entropy coder models it with. Each layer is then
    decoded as a receiver decodes it (rounded to ``cache_dtype``, the cache's), and the next layer's
    predictor is fitted on that: the decoder predicts from what it decoded, never from the exact values.

    ``positions`` (``[N]``, each token's position in its sequence; default ``0 .. N - 1``) and
    ``rope_inv_freq`` (the model's rotary inverse frequencies ``[D / 2]``; none: K is not rotated) let
    the predictor undo K's rotation, so what it learns holds at every position. Without ``predict``, or
    with too little text to fit it (``PREDICT_TOKENS_PER_FEATURE``), every layer is coded relative to
    its mean.

    ``query_metric`` (``[L, H, D, D]``, each KV head's ``E[q q^T]`` over the queries that read it, taken
    on the same text) makes that MSE the error of the attention logits rather than of K itself: K rows
    are weighted by its square root before the PCA (the module docstring). Without it K is unweighted.

    Equal relative error is not equal harm to the model's output: ``step_scale`` (``[L, 2]``, or ``[L, 2,
    C]`` per component) multiplies each step by a factor chosen from the model's measured sensitivity
    (``kvnet.node.kvtc_calibration.measure_step_scale`` measures it as output KL on the calibration
    text), spending bits where the output needs them.
    """
    if k.dim() != 4 or k.shape != v.shape:
        raise CodecError("calibration K/V must both be [layers, tokens, heads, head_dim]")
    layers, n, heads, head_dim = (int(x) for x in k.shape)
    c = heads * head_dim
    if step_scale is not None and (tuple(step_scale.shape) not in ((layers, 2), (layers, 2, c))
                                   or not bool((step_scale > 0).all())):
        raise CodecError(f"kvtc step scale of shape {tuple(step_scale.shape)} is not positive [L, 2(, C)]")
    if query_metric is None:
        weight = torch.eye(head_dim).expand(layers, heads, head_dim, head_dim).contiguous()
    elif tuple(query_metric.shape) != (layers, heads, head_dim, head_dim) or \
            not bool(torch.isfinite(query_metric).all()):
        raise CodecError(f"kvtc query metric of shape {tuple(query_metric.shape)} is not finite "
                         f"[{layers}, {heads}, {head_dim}, {head_dim}]")
    else:
        weight = key_weights(query_metric)
    if rope_inv_freq is None:
        rope_inv_freq = torch.zeros(head_dim // 2)
    elif tuple(rope_inv_freq.shape) != (head_dim // 2,) or head_dim % 2 or \
            not bool(torch.isfinite(rope_inv_freq).all()):
        raise CodecError(f"kvtc rotary inverse frequencies of shape {tuple(rope_inv_freq.shape)} do not fit "
                         f"a head dim of {head_dim}")
    positions = torch.arange(n) if positions is None else positions.reshape(-1)
    if positions.numel() != n:
        raise CodecError(f"kvtc calibration has {n} tokens but {positions.numel()} positions")
    key_weight = _block_diagonal(weight.to(torch.float64))
    key_weight_inverse = _block_diagonal(_symmetric_inverse(weight).to(torch.float64))
    tables = TransformTables(bytes(fingerprint), layers, heads, head_dim, torch.zeros(layers, 2, c),
                             torch.zeros(layers, 2, c, c), torch.ones(layers, 2, c), torch.ones(layers, 2, c),
                             weight, torch.zeros(layers, 2 * c + 1, 2 * c), rope_inv_freq.float())
    # Every position's angles at once: ``rotation`` takes a run of positions, these may restart.
    angles = positions.to(torch.float64)[:, None] * tables.rope_inv_freq.to(torch.float64)[None, :]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    predict = predict and n >= predictor_tokens(c)
    decoded: tuple[torch.Tensor, torch.Tensor] | None = None  # the previous layer, as a receiver holds it
    for layer in range(layers):
        exact = (k[layer].reshape(n, c).to(torch.float64), v[layer].reshape(n, c).to(torch.float64))
        if predict and decoded is not None:
            features = torch.cat((tables.rotate(decoded[0], cos, sin, inverse=True), decoded[1],
                                  exact[0].new_ones(n, 1)), 1)
            target = torch.cat((tables.rotate(exact[0], cos, sin, inverse=True), exact[1]), 1)
            gram = features.T @ features
            w = torch.linalg.solve(gram + _PREDICT_RIDGE * torch.diag(gram.diagonal()), features.T @ target)
            tables.predictor[layer] = w.float()
            # The encoder predicts in float32 from float32 weights: so does the fit's closed loop.
            predicted = features.float() @ w.float()
            base = (tables.rotate(predicted[:, :c], cos.float(), sin.float()).double(),
                    predicted[:, c:].double())
        else:
            base = exact[0].mean(0).expand(n, c), exact[1].mean(0).expand(n, c)
            tables.mean[layer, 0], tables.mean[layer, 1] = base[0][0].float(), base[1][0].float()
        rebuilt = []
        for kind in range(2):
            residual = exact[kind] - base[kind]
            centred = exact[kind] - exact[kind].mean(0)
            if kind == 0:
                residual, centred = residual @ key_weight[layer], centred @ key_weight[layer]
            _, vectors = torch.linalg.eigh(residual.T @ residual / n)
            vectors = vectors.flip(1)  # strongest component first
            rel = key_rel_step if (kind == 0 and key_rel_step is not None) else rel_step
            # Relative to the layer's own spread, not the residual's: a predicted layer keeps the error
            # of one that is not, in fewer bits.
            s = torch.full((c,), rel * math.sqrt(12.0) * float(centred.pow(2).mean().sqrt()) or 1.0,
                           dtype=torch.float64)
            if step_scale is not None:
                s = s * step_scale[layer, kind].to(torch.float64)
            q = torch.round(residual @ vectors / s)
            tables.basis[layer, kind] = vectors.float()
            tables.step[layer, kind] = s.float()
            tables.spread[layer, kind] = q.abs().mean(0).clamp(min=_MIN_SPREAD).float()
            restored = (q * s) @ vectors.T
            if kind == 0:
                restored = restored @ key_weight_inverse[layer]
            rebuilt.append((restored + base[kind]).to(cache_dtype).to(torch.float64))
        decoded = (rebuilt[0], rebuilt[1])
    return tables


class TableStore:
    """Verified table objects kept in a directory (``<digest hex>.kvtt``) and in memory by digest.

    ``add`` verifies before it stores; ``get`` re-verifies what it reads from disk (a file may have been
    altered since), so nothing unverified is ever handed to the decoder.
    """

    def __init__(self, directory: Path | str, trust: TrustStore, fingerprint: bytes) -> None:
        self.directory = Path(directory)
        self.trust = trust
        self.fingerprint = fingerprint
        self._loaded: dict[bytes, TransformTables] = {}
        self._lock = threading.Lock()

    def _path(self, digest: bytes) -> Path:
        return self.directory / f"{digest.hex()}.kvtt"

    def add(self, data: bytes) -> TransformTables:
        tables = verify_tables(data, self.trust, self.fingerprint)
        self.keep(data, tables)
        return tables

    def keep(self, data: bytes, tables: TransformTables) -> None:
        """Store ``data``, which the caller verified into ``tables`` (``verify_tables``)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self._path(tables.digest).with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, self._path(tables.digest))
        with self._lock:
            self._loaded[tables.digest] = tables

    def get(self, digest: bytes) -> TransformTables | None:
        with self._lock:
            tables = self._loaded.get(digest)
        if tables is not None:
            return tables
        path = self._path(digest)
        if not path.is_file() or path.stat().st_size > MAX_TABLES_BYTES:
            return None
        tables = verify_tables(path.read_bytes(), self.trust, self.fingerprint, digest)
        with self._lock:
            self._loaded[digest] = tables
        return tables
