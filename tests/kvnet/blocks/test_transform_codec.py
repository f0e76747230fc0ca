"""Tests of the kvtc rendition (kvnet.blocks.transform_codec) and its tables (transform_tables)."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvnet.blocks.codecs import CODECS, CodecError
from kvnet.blocks.kvtc_entropy import (
    _CLASS_MAX,
    _CLASS_MIN,
    RANGE,
    SINK_SHIFT,
    TOKEN_SHIFT_SPAN,
    _class_model,
)
from kvnet.blocks.transform_codec import TransformCodec, token_shifts_from_importance
from kvnet.blocks.transform_tables import (
    TableStore,
    TransformTables,
    calibrate,
    load_tables,
    parse_tables_body,
    sign_tables,
    verify_tables,
)
from kvnet.exchange.abr import QUALITY_ORDER
from kvnet.model.transformer import apply_rope
from kvnet.node.verification import EXACT_RENDITIONS
from kvnet.security.signing import Signer, TrustStore

LAYERS, TOKENS, HEADS, DIM = 3, 16, 2, 8
SHAPE = (TOKENS, HEADS, DIM)
FP_A = hashlib.sha256(b"model a").digest()
FP_B = hashlib.sha256(b"model b").digest()
"""The first 16 hex digits of the SHA-256 of ``test_the_bitstream_is_the_same_on_every_host``'s words."""


def _kv(seed: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Correlated K/V ``[L, tokens, H, D]``: a few latent factors mixed into every channel, plus noise."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(LAYERS, 2, 4, HEADS * DIM, generator=torch.Generator().manual_seed(99))
    latent = torch.randn(LAYERS, 2, tokens, 4, generator=g)
    x = latent @ mix + 0.05 * torch.randn(LAYERS, 2, tokens, HEADS * DIM, generator=g)
    x = x.view(LAYERS, 2, tokens, HEADS, DIM)
    return x[:, 0], x[:, 1]


def _tables(fp: bytes = FP_A, rel_step: float = 0.02, predict: bool = True) -> TransformTables:
    """Tables calibrated on 512 tokens, enough to predict layers 1 and 2 from the layer before (unless not
    ``predict``: each layer relative to its mean, coded alone)."""
    k, v = _kv(0, 512)
    return calibrate(k, v, fp, rel_step, predict=predict)


def test_a_lossy_network_rendition_outside_the_per_layer_registry() -> None:
    """Nodes publish and accept kvtc (the ABR ranks it last in quality), but it is not among the codecs
    that code a layer alone: it needs its model's tables, which kvnet.exchange.tables fetches."""
    assert QUALITY_ORDER[-1] == "kvtc" and "kvtc" not in EXACT_RENDITIONS
    assert "kvtc" not in CODECS and not TransformCodec().lossless
    assert TransformCodec.codec_id not in {c.codec_id for c in CODECS.values()}


def test_round_trip_within_bound() -> None:
    tables = _tables(rel_step=0.02)
    codec = TransformCodec().for_model(FP_A)
    k, v = _kv(1, TOKENS)  # not the calibration tokens
    payloads = codec.encode_block(k, v, tables)
    decoded = codec.decode_block(payloads, SHAPE, torch.float32)
    raw = 2 * k.numel() * 4
    assert sum(map(len, payloads)) < raw / 3
    for layer, (k2, v2) in enumerate(decoded):
        for kind, (x, y) in enumerate(((k[layer], k2), (v[layer], v2))):
            # Orthonormal basis: the error is the coefficients' rounding, at most step / 2 each.
            bound = float(tables.step[layer, kind].norm()) / 2 * 1.001
            assert float((x - y).reshape(TOKENS, -1).norm(dim=1).max()) <= bound
        # one payload decoded from its layer before (as decoded) equals the block's decode, bit for bit
        single = codec.decode_block([payloads[layer]], SHAPE, torch.float32,
                                    previous=decoded[layer - 1] if layer else None)[0]
        assert torch.equal(single[0], k2) and torch.equal(single[1], v2)
    bf = codec.decode(codec.encode_layer(k[0].bfloat16(), v[0].bfloat16(), 0, tables), SHAPE, torch.bfloat16)
    assert bf[0].dtype == torch.bfloat16


def test_tables_signed_and_bound_to_fingerprint(tmp_path: Path) -> None:
    signer, other = Signer.generate(), Signer.generate()
    trust = TrustStore()
    trust.add(signer.public_key)
    tables = _tables()
    data = sign_tables(tables, signer)
    assert verify_tables(data, trust, FP_A).digest == tables.digest
    with pytest.raises(CodecError, match="bound to model"):
        verify_tables(data, trust, FP_B)
    with pytest.raises(CodecError, match="signature"):
        verify_tables(sign_tables(tables, other), trust, FP_A)
    tampered = bytearray(data)
    tampered[200] ^= 1
    with pytest.raises(CodecError, match="signature"):
        verify_tables(bytes(tampered), trust, FP_A)
    with pytest.raises(CodecError, match="digest"):
        verify_tables(data, trust, FP_A, digest=bytes(32))
    store = TableStore(tmp_path, trust, FP_A)
    store.add(data)
    fresh = TableStore(tmp_path, trust, FP_A)  # a restarted node reads (and re-verifies) from disk
    loaded = fresh.get(tables.digest)
    assert loaded is not None and loaded.digest == tables.digest
    (tmp_path / f"{tables.digest.hex()}.kvtt").write_bytes(bytes(tampered))
    with pytest.raises(CodecError):
        TableStore(tmp_path, trust, FP_A).get(tables.digest)
    with pytest.raises(CodecError, match="bound to model"):
        TableStore(tmp_path / "b", trust, FP_B).add(data)


def test_a_nodes_own_tables_file_is_checked_against_its_model(tmp_path: Path) -> None:
    """``kvnet-node --kvtc-tables``: the body ``kvnet kvtc calibrate`` writes, or a signed object (the node
    signs again); another model's tables, a truncated file or a missing one are refused in one line."""
    tables = _tables()
    body, signed = tmp_path / "body.kvtc", tmp_path / "signed.kvtt"
    body.write_bytes(tables.body())
    signed.write_bytes(sign_tables(tables, Signer.generate()))
    assert load_tables(body, FP_A).digest == load_tables(signed, FP_A).digest == tables.digest
    truncated = tmp_path / "truncated.kvtc"
    truncated.write_bytes(tables.body()[:-5])
    cases = [(body, FP_B, "calibrated for model"), (truncated, FP_A, "does not match"),
             (tmp_path / "missing", FP_A, "No such file")]
    for path, fingerprint, message in cases:
        with pytest.raises(CodecError, match=message) as info:
            load_tables(path, fingerprint)
        assert "\n" not in str(info.value)


def test_block_with_another_models_tables_refused() -> None:
    shared = TransformCodec()
    tables_b = _tables(FP_B)
    k, v = _kv(2, TOKENS)
    payload = shared.encode_layer(k[0], v[0], 0, tables_b)
    with pytest.raises(CodecError, match="model"):
        shared.for_model(FP_A).decode(payload, SHAPE, torch.float32)
    with pytest.raises(CodecError, match="not installed"):
        TransformCodec().decode(payload, SHAPE, torch.float32)


def test_corrupted_bitstream_rejected() -> None:
    codec = TransformCodec()
    tables = _tables(predict=False)
    k, v = _kv(3, TOKENS)
    payload = codec.encode_layer(k[1], v[1], 1, tables)
    body_start = 20 + 4 * 9 + 32 + 4
    for position in range(body_start, len(payload)):
        bad = bytearray(payload)
        bad[position] ^= 0x5A
        with pytest.raises(CodecError):
            codec.decode(bytes(bad), SHAPE, torch.float32)
    for cut in (1, 4, len(payload) - 30):
        with pytest.raises(CodecError):
            codec.decode(payload[:-cut], SHAPE, torch.float32)
    with pytest.raises(CodecError):
        codec.decode(payload + b"\x00", SHAPE, torch.float32)
    with pytest.raises(CodecError):
        codec.encode(k[0], v[0])
    with pytest.raises(CodecError):
        codec.encode_layer(k[0], v[0], LAYERS, tables)


_FUZZ_TABLES = _tables()
_FUZZ_CODEC = TransformCodec()
_FUZZ_K, _FUZZ_V = _kv(4, TOKENS)
# Sink row, token shifts and all: every part of a stream is under the fuzzer.
_FUZZ_SHIFTS = np.tile(np.arange(TOKENS) % 5 - 2, (LAYERS, 1))
# Layer 2, predicted from layer 1 as decoded: the position section is under the fuzzer too.
_FUZZ_LAYER_1, _FUZZ_PAYLOAD = _FUZZ_CODEC.encode_block(_FUZZ_K, _FUZZ_V, _FUZZ_TABLES, sink_rows=1,
                                                        token_shifts=_FUZZ_SHIFTS, first_position=TOKENS)[1:]
_FUZZ_PREVIOUS = _FUZZ_CODEC.decode_block([_FUZZ_LAYER_1], SHAPE, torch.float32,
                                          previous=_FUZZ_CODEC.decode_block(
                                              [_FUZZ_CODEC.encode_block(_FUZZ_K, _FUZZ_V, _FUZZ_TABLES,
                                                                        first_position=TOKENS)[0]],
                                              SHAPE, torch.float32)[0])[0]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(_FUZZ_PAYLOAD) - 1), st.integers(1, 255)), min_size=1,
                max_size=4), st.integers(0, 8))
def test_fuzz_decoder(flips: list[tuple[int, int]], trim: int) -> None:
    data = bytearray(_FUZZ_PAYLOAD)
    for position, mask in flips:
        data[position] ^= mask
    data = data[: len(data) - trim]
    try:
        k, v = _FUZZ_CODEC.decode_block([bytes(data)], SHAPE, torch.float32, previous=_FUZZ_PREVIOUS)[0]
    except CodecError:
        return
    # Only a change the checks cannot see survives (none expected); it must still be the right shape.
    assert k.shape == SHAPE and v.shape == SHAPE


def test_sink_rows_coded_finer() -> None:
    """The sequence's first rows (attention sinks) come back within steps 2**-SINK_SHIFT as large; the
    other rows keep the tables' bound; a payload's sink-row count is checked against the block."""
    tables = _tables(rel_step=0.05, predict=False)
    codec = TransformCodec()
    k, v = _kv(5, TOKENS)
    payload = codec.encode_layer(k[1], v[1], 1, tables, sink_rows=2)
    k2, v2 = codec.decode(payload, SHAPE, torch.float32)
    for kind, (x, y) in enumerate(((k[1], k2), (v[1], v2))):
        err = (x - y).reshape(TOKENS, -1).norm(dim=1)
        bound = float(tables.step[1, kind].norm()) / 2 * 1.001
        assert float(err[:2].max()) <= bound * 2.0 ** -SINK_SHIFT
        assert float(err[2:].max()) <= bound
    plain = codec.encode_layer(k[1], v[1], 1, tables)
    assert len(plain) < len(payload)  # the finer rows cost bytes
    # The Flags byte (offset 5) names the sink rows and seeds the CRC: changed, the payload is refused.
    for flags in (0, 1, 3, TOKENS + 1):
        bad = bytearray(payload)
        bad[5] = flags
        with pytest.raises(CodecError):
            codec.decode(bytes(bad), SHAPE, torch.float32)
    with pytest.raises(CodecError, match="sink rows"):
        codec.encode_layer(k[1], v[1], 1, tables, sink_rows=TOKENS + 1)


def _with_row_steps_out(k: torch.Tensor, row: int, steps: float, tables: TransformTables) -> torch.Tensor:
    """Layer 1's ``k`` with ``row`` moved so that its widest coefficient is ``steps`` of the tables' steps
    (the direction of its own coefficients kept)."""
    out = k.clone()
    coeffs = (out.reshape(TOKENS, -1) - tables.mean[1, 0]) @ tables.analysis[1, 0] / tables.step[1, 0]
    out[row] = tables.mean[1, 0].view(HEADS, DIM) + (
        (coeffs[row] / coeffs[row].abs().max() * steps * tables.step[1, 0]) @ tables.synthesis[1, 0]
    ).view(HEADS, DIM)
    return out


def test_a_sink_row_too_large_for_the_finest_shift_is_coded_at_the_finest_that_fits() -> None:
    """A sink row thousands of steps out (K's sink on SmolLM2 in its last layers, at fine steps) would
    leave the coder's range at 2**-SINK_SHIFT steps; the encoder codes it as finely as the range allows,
    and it comes back within that step, not clamped. Each of K and V picks its own shift."""
    tables = _tables(rel_step=0.05, predict=False)
    codec = TransformCodec()
    k, v = _kv(5, TOKENS)
    k1 = _with_row_steps_out(k[1], 0, 3000.0, tables)  # 2**3 finer fits the range, 2**4 does not
    payload = codec.encode_layer(k1, v[1], 1, tables, sink_rows=1)
    k2, v2 = codec.decode(payload, SHAPE, torch.float32)
    bound = float(tables.step[1, 0].norm()) / 2 * 1.001
    assert float((k1[0] - k2[0]).norm()) <= bound * 2.0 ** -3
    assert float((k1[0] - k2[0]).norm()) > bound * 2.0 ** -SINK_SHIFT  # not the finest shift
    v_bound = float(tables.step[1, 1].norm()) / 2 * 1.001
    assert float((v[1][0] - v2[0]).norm()) <= v_bound * 2.0 ** -SINK_SHIFT  # V's sink at the finest


def test_token_shifts_code_each_row_finer_or_coarser() -> None:
    """A row asked for ``s`` halvings comes back within the tables' bound times ``2**-s`` (coarser for a
    negative ``s``); one that would leave the coder's range that fine is coded as finely as fits, never
    clamped; the sink row keeps its own shift; shifts of the wrong shape or beyond the span are refused;
    all-zero shifts are no shifts."""
    tables = _tables(rel_step=0.05, predict=False)
    codec = TransformCodec()
    k, v = _kv(5, TOKENS)
    k1 = _with_row_steps_out(k[1], 4, 5000.0, tables)  # 2**2 finer fits the range, 2**3 does not
    shifts = np.array([3, 2, -2, 1, 3, -3, 0, 1, 2, 3, -1, -2, 0, 0, 1, -3])
    payload = codec.encode_layer(k1, v[1], 1, tables, sink_rows=1, token_shifts=shifts)
    k2, v2 = codec.decode(payload, SHAPE, torch.float32)
    allowed = shifts.copy()
    allowed[4] = 2
    for kind, (x, y) in enumerate(((k1, k2), (v[1], v2))):
        err = (x - y).reshape(TOKENS, -1).norm(dim=1)
        bound = float(tables.step[1, kind].norm()) / 2 * 1.001
        assert float(err[0]) <= bound * 2.0 ** -SINK_SHIFT
        for row in range(1, TOKENS):
            row_shift = int(allowed[row]) if kind == 0 else int(shifts[row])
            assert float(err[row]) <= bound * 2.0 ** -row_shift, (kind, row)
    for bad in (shifts[:-1], np.full(TOKENS, 4), np.full(TOKENS, -4)):
        with pytest.raises(CodecError, match="token shifts"):
            codec.encode_layer(k1, v[1], 1, tables, token_shifts=bad)
    assert codec.encode_layer(k1, v[1], 1, tables, token_shifts=np.zeros(TOKENS, dtype=np.int64)) == \
        codec.encode_layer(k1, v[1], 1, tables)


def test_token_shifts_follow_the_attention_a_token_gets() -> None:
    """``2**x`` times the layer's geometric-mean attention codes a token ``x / 2`` halvings finer, rounded
    and within the span; a span beyond what the stream can carry is refused."""
    importance = torch.tensor([[1.0, 1.0, 4.0, 0.25], [1.0, 2.0**8, 2.0**-8, 1.0]])
    assert token_shifts_from_importance(importance).tolist() == [[0, 0, 1, -1], [0, 2, -2, 0]]
    assert token_shifts_from_importance(importance, span=3).tolist()[1] == [0, 3, -3, 0]
    assert token_shifts_from_importance(importance, power=1.0).tolist()[0] == [0, 0, 2, -2]
    with pytest.raises(CodecError, match="span"):
        token_shifts_from_importance(importance, span=TOKEN_SHIFT_SPAN + 1)


def test_step_scale_allocates_per_layer_kind_and_component() -> None:
    """``step_scale`` multiplies the calibrated steps; the round trip keeps each component within half its
    own step; a body of another version or with a non-positive step is refused with one line."""
    k, v = _kv(0, 512)
    base = calibrate(k, v, FP_A, 0.02, predict=False)  # (predicted, a layer's step follows the one before)
    scale = torch.ones(LAYERS, 2, HEADS * DIM)
    scale[0, 0] = 0.5  # layer 0's K finer
    scale[2, 1, HEADS * DIM // 2:] = 8.0  # layer 2's weak V components coarser
    tables = calibrate(k, v, FP_A, 0.02, step_scale=scale, predict=False)
    torch.testing.assert_close(tables.step, base.step * scale)
    assert tables.digest != base.digest
    codec = TransformCodec()
    k1, v1 = _kv(6, TOKENS)
    payloads = codec.encode_block(k1, v1, tables)
    before = codec.encode_block(k1, v1, base)
    assert len(payloads[0]) > len(before[0]) and len(payloads[2]) < len(before[2])  # finer K, coarser V
    for layer, (k2, v2) in enumerate(codec.decode_block(payloads, SHAPE, torch.float32)):
        for kind, (x, y) in enumerate(((k1[layer], k2), (v1[layer], v2))):
            rows = x.reshape(TOKENS, -1) - tables.mean[layer, kind]
            err = (rows - (y.reshape(TOKENS, -1) - tables.mean[layer, kind])) @ tables.basis[layer, kind]
            assert bool((err.abs() <= tables.step[layer, kind] / 2 * 1.001 + 1e-5).all())
    with pytest.raises(CodecError, match="step scale"):
        calibrate(k, v, FP_A, 0.02, step_scale=torch.ones(LAYERS, 3))
    with pytest.raises(CodecError, match="step scale"):
        calibrate(k, v, FP_A, 0.02, step_scale=torch.zeros(LAYERS, 2))
    body = bytearray(tables.body())
    assert parse_tables_body(bytes(body)).digest == tables.digest
    old = bytearray(body)
    old[4] = 1  # version 1 had one step per (layer, K/V)
    with pytest.raises(CodecError, match="version 1"):
        parse_tables_body(bytes(old))
    offset = 4 + 1 + 32 + 6 + 4 * (LAYERS * 2 * HEADS * DIM) * (1 + HEADS * DIM)  # first step value
    body[offset:offset + 4] = struct.pack("<f", 0.0)
    with pytest.raises(CodecError, match="non-positive quantizer step"):
        parse_tables_body(bytes(body))


def test_query_metric_spends_bits_where_queries_look() -> None:
    """With the queries' metric, K's error is measured as the attention logits' error: queries that read
    only two dimensions of each head get logits over twice as close for no more bytes; the tables carry
    the weight and its inverse through their body, and a malformed metric is refused with one line."""
    g = torch.Generator().manual_seed(5)
    # Keys of full rank, and queries with almost all their energy on dimensions 0 and 1 of each head.
    k, k1 = torch.randn(2, LAYERS, 512, HEADS, DIM, generator=g)
    v = torch.randn(LAYERS, 512, HEADS, DIM, generator=g)
    spread = torch.full((DIM,), 0.02)
    spread[:2] = 1.0
    queries = torch.randn(LAYERS, 256, HEADS, DIM, generator=g) * spread
    metric = torch.einsum("lthd,lthe->lhde", queries, queries) / 256
    plain = calibrate(k, v, FP_A, 0.05)
    weighted = calibrate(k, v, FP_A, 0.05, query_metric=metric)
    codec = TransformCodec()
    k1, v1 = k1[:, :TOKENS], v[:, :TOKENS]

    def logits_error(tables: TransformTables) -> tuple[float, int]:
        payloads = codec.encode_block(k1, v1, tables)
        decoded = codec.decode_block(payloads, SHAPE, torch.float32)
        err = torch.stack([dk for dk, _ in decoded]) - k1  # [L, T, H, D]
        return float(torch.einsum("lqhd,lthd->lqth", queries, err).pow(2).mean()), sum(map(len, payloads))

    plain_err, plain_size = logits_error(plain)
    weighted_err, weighted_size = logits_error(weighted)
    assert weighted_size <= plain_size and weighted_err * 2 < plain_err  # here: 981 vs 1177 B, 3.4x
    torch.testing.assert_close(weighted.synthesis @ weighted.analysis,
                               torch.eye(HEADS * DIM).expand_as(weighted.analysis), atol=1e-4, rtol=0)
    parsed = parse_tables_body(weighted.body())
    assert parsed.digest == weighted.digest and parsed.digest != plain.digest
    torch.testing.assert_close(parsed.key_weight_inverse, weighted.key_weight_inverse)
    with pytest.raises(CodecError, match="query metric"):
        calibrate(k, v, FP_A, 0.05, query_metric=metric[:, :1])
    with pytest.raises(CodecError, match="query metric"):
        calibrate(k, v, FP_A, 0.05, query_metric=metric * float("nan"))
    silent_head = metric.clone()
    silent_head[0, 1] = 0
    with pytest.raises(CodecError, match="query metric is zero"):
        calibrate(k, v, FP_A, 0.05, query_metric=silent_head)


@pytest.mark.parametrize("damage, refusal", [("skew", "not symmetric"), ("singular", "not positive definite"),
                                             ("negative", "not positive definite"),
                                             ("zero", "not positive definite")])
def test_received_key_weight_that_cannot_be_inverted_refused(damage: str, refusal: str) -> None:
    """The decoder inverts the key weight itself (the tables do not carry the inverse), so a body whose
    weight is not symmetric positive definite is refused when parsed, in one line, not at decode."""
    k, v = torch.randn(2, LAYERS, 256, HEADS, DIM, generator=torch.Generator().manual_seed(9))
    tables = calibrate(k, v, FP_A, 0.05, query_metric=torch.eye(DIM).expand(LAYERS, HEADS, DIM, DIM))
    weight = tables.key_weight.clone()
    if damage == "skew":
        weight[0, 0, 0, 1] += 0.5
    elif damage == "zero":
        weight.zero_()
    elif damage == "singular":
        weight[1, 0] = torch.diag(torch.tensor([1.0] + [0.0] * (DIM - 1)))
    else:
        weight[0, 1] = -weight[0, 1]
    body = tables.body()
    weight_offset = len(body) - 4 * (weight.numel() + tables.predictor.numel() + tables.rope_inv_freq.numel())
    damaged = body[:weight_offset] + weight.numpy().astype("<f4").tobytes() + body[weight_offset + 4 *
                                                                                   weight.numel():]
    assert parse_tables_body(body).key_weight_inverse.shape == weight.shape
    with pytest.raises(CodecError, match=refusal):
        parse_tables_body(damaged)


def test_an_outlier_token_comes_back_within_the_bound() -> None:
    """A token far outside its components' calibrated spread widens the classes the encoder picks for
    them (or travels as escapes) and comes back within the same bound as every other; so does a layer
    whose every coefficient is an escape at the edge of the coder's range, the worst case for the
    stream's size limit (what an encoder writes, a decoder accepts). A coefficient beyond that range is
    refused at encode, never clamped into a wrong value."""
    tables = _tables(rel_step=0.02, predict=False)
    codec = TransformCodec()
    k, v = _kv(7, TOKENS)
    k[1, 3] *= 300.0  # one token's K of layer 1, hundreds of steps out in its strongest components
    payload = codec.encode_layer(k[1], v[1], 1, tables)
    k2, _ = codec.decode(payload, SHAPE, torch.float32)
    bound = float(tables.step[1, 0].norm()) / 2 * 1.001
    assert float((k[1] - k2).reshape(TOKENS, -1).norm(dim=1).max()) <= bound
    centred = [(x.reshape(TOKENS, -1) - tables.mean[1, kind]) @ tables.analysis[1, kind]
               for kind, x in enumerate((k[1], v[1]))]
    edge = [((c.sign() + (c == 0)) * (RANGE - 0.5)) for c in centred]  # every coefficient |32766.5| steps
    k_edge, v_edge = ((e * tables.step[1, kind]) @ tables.synthesis[1, kind] + tables.mean[1, kind]
                      for kind, e in enumerate(edge))
    edge_payload = codec.encode_layer(k_edge.view(SHAPE), v_edge.view(SHAPE), 1, tables)
    n = TOKENS * HEADS * DIM
    assert len(edge_payload) > 2 * 4 * n  # escapes: more than 4 bytes per integer, within 5n + C + 64
    k3, _ = codec.decode(edge_payload, SHAPE, torch.float32)
    assert float((k3 - k_edge.view(SHAPE)).abs().max()) <= float(tables.step[1, 0].norm()) * 1.001
    with pytest.raises(CodecError, match=r"layer 1's K holds a coefficient of .* beyond the coder's 32767"):
        codec.encode_layer(k[1] * 1e6, v[1], 1, tables)


def test_prepare_computes_what_the_first_decode_would() -> None:
    """A receiver prepares verified tables off its event loop, so the first block decoded with them does
    not build the coder's models (97 of them) or the synthesis matrices."""
    tables = _tables()
    TransformCodec.prepare(tables)
    assert "_synthesis" in tables.__dict__
    assert _class_model.cache_info().currsize == _CLASS_MAX - _CLASS_MIN + 1


def _layered_kv(seed: int, tokens: int, first_position: int = 0, inv_freq: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V ``[L, tokens, H, D]`` whose every layer is mostly a fixed linear map of the layer before (as a
    transformer's residual stream makes them), K rotated by its positions when ``inv_freq`` is given."""
    g = torch.Generator().manual_seed(seed)
    maps = torch.eye(2 * HEADS * DIM) + 0.3 * torch.randn(LAYERS, 2 * HEADS * DIM, 2 * HEADS * DIM,
                                                          generator=torch.Generator().manual_seed(98))
    x = torch.randn(tokens, 2 * HEADS * DIM, generator=g)
    layers = []
    for layer in range(LAYERS):
        x = x @ maps[layer] / 1.5 + 0.05 * torch.randn(tokens, 2 * HEADS * DIM, generator=g)
        layers.append(x)
    kv = torch.stack(layers).view(LAYERS, tokens, 2, HEADS, DIM)
    k, v = kv[:, :, 0].contiguous(), kv[:, :, 1].contiguous()
    if inv_freq is not None:
        angles = torch.arange(first_position, first_position + tokens, dtype=torch.float64)[:, None] * \
            inv_freq.double()[None, :]
        angles = torch.cat((angles, angles), dim=-1).float()  # the model's rotate-half layout
        k = torch.stack([apply_rope(k[layer], angles.cos(), angles.sin()) for layer in range(LAYERS)])
    return k, v


def test_layers_predicted_from_the_layer_before_cost_fewer_bytes_at_the_same_bound() -> None:
    """With enough calibration text each layer after the first is predicted from the one before it as
    decoded (K's rotary embedding undone and redone at the block's positions), and only the residual is
    coded: blocks of a far later position come back within the tables' bound, in fewer bytes than the
    same tables' layers coded each relative to their mean. Too little text predicts nothing."""
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, DIM, 2).float() / DIM)
    k, v = _layered_kv(0, 512, inv_freq=inv_freq)
    predicted = calibrate(k, v, FP_A, 0.05, rope_inv_freq=inv_freq)
    alone = calibrate(k, v, FP_A, 0.05, rope_inv_freq=inv_freq, predict=False)
    assert predicted.predicted_layers == (False, True, True) and not any(alone.predicted_layers)
    assert not any(calibrate(k[:, :200], v[:, :200], FP_A, 0.05).predicted_layers)  # 200 < 8 x 33
    codec = TransformCodec()
    position = 123_456
    k1, v1 = _layered_kv(1, TOKENS, position, inv_freq)
    sizes = {}
    for name, tables in (("predicted", predicted), ("alone", alone)):
        payloads = codec.encode_block(k1, v1, tables, first_position=position)
        sizes[name] = sum(map(len, payloads[1:]))
        for layer, (k2, v2) in enumerate(codec.decode_block(payloads, SHAPE, torch.float32)):
            for kind, (x, y) in enumerate(((k1[layer], k2), (v1[layer], v2))):
                bound = float(tables.step[layer, kind].norm()) / 2 * 1.001
                assert float((x - y).reshape(TOKENS, -1).norm(dim=1).max()) <= bound + 1e-5, (name, layer)
    assert sizes["predicted"] < 0.8 * sizes["alone"], sizes
    # The prediction rotates K by the payload's position: at another position it is another block.
    moved = codec.encode_block(k1, v1, predicted, first_position=position + 1)
    assert moved[1] != codec.encode_block(k1, v1, predicted, first_position=position)[1]


def test_a_predicted_layer_decodes_only_from_the_layer_before_it() -> None:
    """A predicted layer without its layer before, with one of the wrong shape, or a block's layers out of
    order or of two positions, are refused in one line; so are tables whose layer 0 claims a predictor
    (it has no layer before) or whose rotation does not fit an odd head dim."""
    tables = _tables()
    codec = TransformCodec()
    k, v = _kv(8, TOKENS)
    payloads = codec.encode_block(k, v, tables, first_position=32)
    layer_0 = codec.decode_block(payloads[:1], SHAPE, torch.float32)[0]
    cases = [
        (lambda: codec.decode(payloads[1], SHAPE, torch.float32), "not given"),
        (lambda: codec.decode_block(payloads[1:2], SHAPE, torch.float32,
                                    previous=(layer_0[0][:8], layer_0[1][:8])), "wrong shape"),
        (lambda: codec.decode_block([payloads[0], payloads[2]], SHAPE, torch.float32), "does not follow"),
        (lambda: codec.decode_block([payloads[0], codec.encode_block(k, v, tables)[1]], SHAPE,
                                    torch.float32), "does not follow"),
        (lambda: codec.encode_layer(k[1], v[1], 1, tables), "not given"),
    ]
    for call, message in cases:
        with pytest.raises(CodecError, match=message) as info:
            call()
        assert "\n" not in str(info.value)
    assert codec.decode_block(payloads[1:], SHAPE, torch.float32, previous=layer_0)  # from layer 0, fine
    body = bytearray(tables.body())
    predictor_at = len(body) - 4 * (tables.predictor.numel() + tables.rope_inv_freq.numel())
    body[predictor_at:predictor_at + 4] = struct.pack("<f", 1.0)  # layer 0's first weight
    with pytest.raises(CodecError, match="layer 0 has no layer before"):
        parse_tables_body(bytes(body))
    with pytest.raises(CodecError, match="rotary"):
        calibrate(k, v, FP_A, 0.05, rope_inv_freq=torch.ones(3))
