"""Tests of kvnet.blocks.codecs: round trips, error bounds and rejection of malformed payloads."""

from __future__ import annotations

import struct

import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from kvnet.blocks.codecs import (
    CODECS,
    CodecError,
    Int4Codec,
    Int8Codec,
    LosslessCodec,
    PlainCodec,
    get_codec,
    read_header,
)

FLOAT_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
SHAPE = (16, 4, 32)
EXACT = sorted(name for name, codec in CODECS.items() if codec.lossless)
# Codecs that encode a layer on its own (kvtc needs its model's tables and the layer: test_transform_codec).
PER_LAYER = sorted(name for name in CODECS if name != "kvtc")


def _kv(shape: tuple[int, int, int], dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(shape, generator=g) * 2.0
    v = torch.randn(shape, generator=g) * 0.5
    return k.to(dtype), v.to(dtype)


def _bits(x: torch.Tensor) -> torch.Tensor:
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    return x.contiguous().view(ints[x.element_size()])


def _special_values(dtype: torch.dtype) -> torch.Tensor:
    info = torch.finfo(dtype)
    # Subnormals: the smallest positive subnormal and a few multiples of it.
    tiny = info.smallest_normal
    specials = [float("inf"), float("-inf"), float("nan"), -0.0, 0.0, info.max, -info.max, tiny, -tiny]
    sub = torch.tensor([tiny], dtype=dtype) / torch.tensor([2.0**k for k in (1, 3, 5)], dtype=dtype)
    vals = torch.cat([torch.tensor(specials, dtype=dtype), sub])
    assert bool((sub != 0).all()) and bool((sub.abs() < tiny).all())
    return vals


def test_registry() -> None:
    assert set(CODECS) == {"lossless", "plain", "int8", "int4"}
    assert EXACT == ["lossless", "plain"]
    assert not get_codec("int8").lossless and not get_codec("int4").lossless
    assert len({c.codec_id for c in CODECS.values()}) == len(CODECS)
    with pytest.raises(CodecError):
        get_codec("zstd-99")


@pytest.mark.parametrize("name", EXACT)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_exact_renditions_are_bit_exact_with_special_values(name: str, dtype: torch.dtype) -> None:
    k, v = _kv(SHAPE, dtype)
    flat_k = k.view(-1)
    specials = _special_values(dtype)
    flat_k[: specials.numel()] = specials
    # A NaN with a non-default payload must survive too.
    nan_bits = _bits(torch.tensor([float("nan")], dtype=dtype)) ^ 1
    _bits(v).view(-1)[0] = nan_bits[0]
    _bits(v).view(-1)[1] = (_bits(torch.tensor([-float("nan")], dtype=dtype)) ^ 2)[0]  # signed NaN payload
    codec = get_codec(name)
    payload = codec.encode(k, v)
    k2, v2 = codec.decode(payload, SHAPE, dtype, torch.device("cpu"))
    assert k2.dtype == dtype and v2.dtype == dtype
    assert k2.shape == SHAPE and v2.shape == SHAPE
    assert torch.equal(_bits(k2), _bits(k))
    assert torch.equal(_bits(v2), _bits(v))


def test_lossless_compresses_bf16() -> None:
    k, v = _kv((16, 8, 64), torch.bfloat16)
    payload = get_codec("lossless").encode(k, v)
    assert len(payload) < 0.8 * 2 * k.numel() * 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lossless_reads_frames_of_any_zstd_setting(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The encoder's zstd settings are the publisher's choice, not the format: a payload written with
    plain level 1 (before the lossless codec's own settings) decodes bit for bit, and the codec's own
    frames still declare their content size."""
    k, v = _kv((64, 4, 64), dtype)
    codec = get_codec("lossless")
    tuned = codec.encode(k, v)
    older = LosslessCodec()
    monkeypatch.setattr(older, "_compressor", lambda: zstandard.ZstdCompressor(level=1))
    plain = older.encode(k, v)
    assert plain != tuned
    for payload in (plain, tuned):
        k2, v2 = codec.decode(payload, (64, 4, 64), dtype)
        assert torch.equal(_bits(k2), _bits(k)) and torch.equal(_bits(v2), _bits(v))
    header = read_header(tuned)
    table = 20 + 9 * header.num_sections
    offset = table
    for i in range(header.num_sections):
        mode, raw_len, stored = struct.unpack_from("<BII", tuned, 20 + 9 * i)
        if mode == 1:
            assert zstandard.frame_content_size(tuned[offset : offset + stored]) == raw_len
        offset += stored


def test_lossless_non_contiguous_input() -> None:
    k, v = _kv((4, 16, 32), torch.bfloat16)
    kt, vt = k.transpose(0, 1), v.transpose(0, 1)  # [16, 4, 32], not contiguous
    codec = get_codec("lossless")
    k2, v2 = codec.decode(codec.encode(kt, vt), (16, 4, 32), torch.bfloat16)
    assert torch.equal(_bits(k2), _bits(kt)) and torch.equal(_bits(v2), _bits(vt))


@given(
    t=st.integers(1, 9), h=st.integers(1, 3), d=st.integers(1, 9),
    dtype=st.sampled_from(FLOAT_DTYPES), seed=st.integers(0, 2**16),
)
@settings(max_examples=60, deadline=None)
def test_lossless_round_trip_any_shape(t: int, h: int, d: int, dtype: torch.dtype, seed: int) -> None:
    k, v = _kv((t, h, d), dtype, seed)
    codec = get_codec("lossless")
    k2, v2 = codec.decode(codec.encode(k, v), (t, h, d), dtype)
    assert torch.equal(_bits(k2), _bits(k)) and torch.equal(_bits(v2), _bits(v))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("key_per_channel", [True, False])
@pytest.mark.parametrize("value_per_channel", [True, False])
def test_int8_error_bound(dtype: torch.dtype, key_per_channel: bool, value_per_channel: bool) -> None:
    # Symmetric int8: |x - x'| <= scale / 2 (rounding) + one ulp of the output dtype, where
    # scale = absmax(group) / 127. We bound with the tensor-wide absmax.
    k, v = _kv(SHAPE, dtype)
    codec = Int8Codec(key_per_channel=key_per_channel, value_per_channel=value_per_channel)
    k2, v2 = get_codec("int8").decode(codec.encode(k, v), SHAPE, dtype)  # registered decoder reads flags
    for x, y in ((k, k2), (v, v2)):
        xf, yf = x.double(), y.double()
        bound = xf.abs().max() / 127 * 0.5 * 1.01 + xf.abs().max() * torch.finfo(dtype).eps
        assert float((xf - yf).abs().max()) <= float(bound)
        cos = torch.nn.functional.cosine_similarity(xf.flatten(), yf.flatten(), dim=0)
        assert float(cos) > 0.9998


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_int4_error_bound(dtype: torch.dtype) -> None:
    # Asymmetric 4-bit: |x - x'| <= (max - min) / 15 / 2 per group (+ stats rounding and output ulp).
    k, v = _kv((16, 4, 64), dtype)
    codec = get_codec("int4")
    k2, v2 = codec.decode(codec.encode(k, v), (16, 4, 64), dtype)
    kf, vf = k.double(), v.double()
    k_range = kf.amax(0, keepdim=True) - kf.amin(0, keepdim=True)  # per channel
    v_groups = vf.view(16, 4, 1, 64)
    v_range = (v_groups.amax(3, keepdim=True) - v_groups.amin(3, keepdim=True)).expand(16, 4, 1, 64)
    tol = 0.51 + 0.01  # half a step, plus fp16 statistics rounding
    eps = torch.finfo(dtype).eps * 8
    assert bool(((kf - k2.double()).abs() <= k_range / 15 * tol + kf.abs() * eps + 1e-3).all())
    assert bool(((vf - v2.double()).view(16, 4, 1, 64).abs() <= v_range / 15 * tol
                 + v_groups.abs() * eps + 1e-3).all())
    cos = torch.nn.functional.cosine_similarity(kf.flatten(), k2.double().flatten(), dim=0)
    assert float(cos) > 0.99


def test_int4_odd_sizes_and_group_fallback() -> None:
    shape = (3, 1, 5)  # odd element count, head_dim not a multiple of the group size
    k, v = _kv(shape, torch.float32)
    codec = Int4Codec(value_group=4)
    k2, v2 = codec.decode(codec.encode(k, v), shape, torch.float32)
    assert k2.shape == shape and v2.shape == shape
    assert float((v2 - v).abs().max()) <= float((v.max() - v.min()) / 15)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_lossy_constant_and_zero_groups(name: str) -> None:
    k = torch.zeros(SHAPE)
    v = torch.full(SHAPE, 3.0)
    codec = get_codec(name)
    k2, v2 = codec.decode(codec.encode(k, v), SHAPE, torch.float32)
    assert torch.equal(k2, k)
    assert float((v2 - v).abs().max()) < 1e-2


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_lossy_large_magnitudes_use_fp32_stats(name: str) -> None:
    k, v = _kv(SHAPE, torch.float32)
    k = k * 1e7  # scales beyond float16 range
    v = v * 1e-9  # scales below float16 normal range
    codec = get_codec(name)
    payload = codec.encode(k, v)
    assert read_header(payload).flags & 0x01
    k2, v2 = codec.decode(payload, SHAPE, torch.float32)
    rel_step = 0.51 / 127 if name == "int8" else 0.6 / 15 * 2
    assert float((k2 - k).abs().max()) <= float(k.abs().max()) * rel_step * 2
    assert float((v2 - v).abs().max()) <= float(v.abs().max()) * rel_step * 2


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_lossy_rejects_non_finite(name: str) -> None:
    k, v = _kv(SHAPE, torch.float32)
    k[0, 0, 0] = float("nan")
    with pytest.raises(CodecError):
        get_codec(name).encode(k, v)


@pytest.mark.parametrize("name", PER_LAYER)
def test_encode_rejects_bad_inputs(name: str) -> None:
    codec = get_codec(name)
    k, v = _kv(SHAPE, torch.float32)
    with pytest.raises(CodecError):
        codec.encode(k, v[:-1])
    with pytest.raises(CodecError):
        codec.encode(k, v.to(torch.float16))
    with pytest.raises(CodecError):
        codec.encode(k.flatten(), v.flatten())
    with pytest.raises(CodecError):
        codec.encode(k.to(torch.int32), v.to(torch.int32))


@pytest.mark.parametrize("name", PER_LAYER)
def test_decode_rejects_mismatched_expectations(name: str) -> None:
    codec = get_codec(name)
    k, v = _kv(SHAPE, torch.bfloat16)
    payload = codec.encode(k, v)
    with pytest.raises(CodecError):
        codec.decode(payload, (SHAPE[0] + 1, SHAPE[1], SHAPE[2]), torch.bfloat16)
    with pytest.raises(CodecError):
        codec.decode(payload, SHAPE, torch.float16)
    other = next(CODECS[n] for n in PER_LAYER if n != name)
    with pytest.raises(CodecError):
        other.decode(payload, SHAPE, torch.bfloat16)


@pytest.mark.parametrize("name", PER_LAYER)
def test_decode_truncated_or_padded(name: str) -> None:
    codec = get_codec(name)
    k, v = _kv(SHAPE, torch.bfloat16)
    payload = codec.encode(k, v)
    for cut in range(0, len(payload), max(1, len(payload) // 97)):
        with pytest.raises(CodecError):
            codec.decode(payload[:cut], SHAPE, torch.bfloat16)
    with pytest.raises(CodecError):
        codec.decode(payload + b"\x00", SHAPE, torch.bfloat16)


@pytest.mark.parametrize("name", PER_LAYER)
@given(data=st.data())
@settings(max_examples=150, deadline=None)
def test_decode_corrupted_never_crashes(name: str, data: st.DataObject) -> None:
    codec = get_codec(name)
    k, v = _kv(SHAPE, torch.bfloat16)
    payload = bytearray(codec.encode(k, v))
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(payload) - 1))
        payload[pos] = data.draw(st.integers(0, 255))
    try:
        k2, v2 = codec.decode(bytes(payload), SHAPE, torch.bfloat16)
    except CodecError:
        return
    # Mutations inside raw data sections legitimately decode (integrity is the manifest digest's job),
    # but the result must still have the promised shape and dtype.
    assert k2.shape == SHAPE and v2.shape == SHAPE
    assert k2.dtype == torch.bfloat16 and v2.dtype == torch.bfloat16


def test_decode_rejects_corrupt_header_fields() -> None:
    codec = get_codec("lossless")
    k, v = _kv(SHAPE, torch.bfloat16)
    payload = bytearray(codec.encode(k, v))
    cases = {0: 0x00, 2: 9, 3: 2, 4: 99, 6: 0, 7: 1}  # magic, version, codec id, dtype, sections, reserved
    for offset, value in cases.items():
        bad = bytearray(payload)
        bad[offset] = value
        with pytest.raises(CodecError):
            codec.decode(bytes(bad), SHAPE, torch.bfloat16)
    # A section table length that disagrees with the shape.
    bad = bytearray(payload)
    mode, raw_len, stored = struct.unpack_from("<BII", bad, 20)
    struct.pack_into("<BII", bad, 20, mode, raw_len + 2, stored)
    with pytest.raises(CodecError):
        codec.decode(bytes(bad), SHAPE, torch.bfloat16)


def _rebuild(sections: list[tuple[int, int, bytes]], header: bytes) -> bytes:
    table = b"".join(struct.pack("<BII", mode, raw_len, len(body)) for mode, raw_len, body in sections)
    return header + table + b"".join(body for _, _, body in sections)


def test_decode_rejects_zstd_frame_of_wrong_size() -> None:
    # The high byte plane of bf16 is zstd-compressed; swap in a frame that inflates to a different
    # size (declared, or undeclared) while the table still claims the right raw length.
    k, v = _kv(SHAPE, torch.bfloat16)
    codec = get_codec("lossless")
    payload = codec.encode(k, v)
    header = payload[:20]
    n = 2 * SHAPE[0] * SHAPE[1] * SHAPE[2]
    lo_mode, lo_len, lo_stored = struct.unpack_from("<BII", payload, 20)
    hi_mode, hi_len, _ = struct.unpack_from("<BII", payload, 29)
    assert hi_mode == 1 and lo_len == hi_len == n
    lo_body = payload[38 : 38 + lo_stored]
    for frame in (
        zstandard.ZstdCompressor(level=1).compress(b"\x3f" * (n + 7)),
        zstandard.ZstdCompressor(level=1, write_content_size=False).compress(b"\x3f" * n),
        b"\x28\xb5\x2f\xfd" + b"\x00" * 12,  # zstd magic, then garbage
    ):
        bad = _rebuild([(lo_mode, lo_len, lo_body), (1, n, frame)], header)
        with pytest.raises(CodecError):
            codec.decode(bad, SHAPE, torch.bfloat16)
    good = zstandard.ZstdCompressor(level=1).compress(b"\x3f" * n)
    k2, _ = codec.decode(_rebuild([(lo_mode, lo_len, lo_body), (1, n, good)], header), SHAPE, torch.bfloat16)
    assert k2.shape == SHAPE


@pytest.mark.parametrize("blob", [b"", b"KV", b"\x00" * 19, b"KV\x01\x01\x01\x00\x02\x00" + b"\xff" * 100])
def test_decode_garbage(blob: bytes) -> None:
    for codec in (CODECS[n] for n in PER_LAYER):
        with pytest.raises(CodecError):
            codec.decode(blob, SHAPE, torch.bfloat16)


def test_decode_accepts_memoryview_and_bytearray() -> None:
    codec = get_codec("lossless")
    k, v = _kv(SHAPE, torch.float16)
    payload = codec.encode(k, v)
    for buf in (bytearray(payload), memoryview(payload)):
        k2, _ = codec.decode(buf, SHAPE, torch.float16)
        assert torch.equal(_bits(k2), _bits(k))


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_key_outlier_channel_does_not_swamp_other_channels(name: str) -> None:
    # Keys are scaled per channel: one huge channel must not cost the others their precision.
    k, v = _kv(SHAPE, torch.float32)
    k[:, :, 0] *= 1000.0
    codec = get_codec(name)
    k2, _ = codec.decode(codec.encode(k, v), SHAPE, torch.float32)
    rest, rest2 = k[:, :, 1:], k2[:, :, 1:]
    rel = float((rest - rest2).norm() / rest.norm())
    assert rel < (0.01 if name == "int8" else 0.15)


@pytest.mark.parametrize("name", PER_LAYER)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_decode_into_writes_what_decode_returns(name: str, dtype: torch.dtype) -> None:
    codec = get_codec(name)
    k, v = _kv(SHAPE, dtype)
    if codec.lossless:
        k.view(-1)[: len(_special_values(dtype))] = _special_values(dtype)
    payload = codec.encode(k, v)
    want_k, want_v = codec.decode(payload, SHAPE, dtype)
    # Slots of a larger tensor, as the paged cache hands them out, filled with garbage first.
    store = torch.full((2, 3, *SHAPE), 7.0, dtype=dtype)
    codec.decode_into(payload, store[0, 1], store[1, 1])
    assert torch.equal(_bits(store[0, 1]), _bits(want_k)) and torch.equal(_bits(store[1, 1]), _bits(want_v))
    assert bool((store[:, 0] == 7.0).all()) and bool((store[:, 2] == 7.0).all())  # neighbours untouched
    # Non-contiguous outputs take the copying path and give the same bits.
    k_t = torch.empty((SHAPE[1], SHAPE[0], SHAPE[2]), dtype=dtype).transpose(0, 1)
    v_t = torch.empty((SHAPE[1], SHAPE[0], SHAPE[2]), dtype=dtype).transpose(0, 1)
    codec.decode_into(payload, k_t, v_t)
    assert torch.equal(_bits(k_t), _bits(want_k)) and torch.equal(_bits(v_t), _bits(want_v))


def test_decode_into_rejects_outputs_that_do_not_match_the_payload() -> None:
    codec = get_codec("lossless")
    k, v = _kv(SHAPE, torch.bfloat16)
    payload = codec.encode(k, v)
    out = torch.empty(SHAPE, dtype=torch.bfloat16)
    for k_out, v_out in (
        (torch.empty(SHAPE, dtype=torch.float16), torch.empty(SHAPE, dtype=torch.float16)),  # dtype
        (torch.empty((SHAPE[0] + 1, *SHAPE[1:]), dtype=torch.bfloat16),) * 2,  # shape
        (out, torch.empty((SHAPE[0] + 1, *SHAPE[1:]), dtype=torch.bfloat16)),  # k and v differ
        (out.view(-1), out.view(-1)),  # not [block_size, H_kv, D]
        (out, torch.empty(SHAPE, dtype=torch.bfloat16, device="meta")),  # not CPU
    ):
        with pytest.raises(CodecError):
            codec.decode_into(payload, k_out, v_out)
    with pytest.raises(CodecError):
        codec.decode_into(payload[:-1], out, out.clone())


# -- plain ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_plain_payload_is_the_elements_little_endian_bytes(dtype: torch.dtype) -> None:
    k, v = _kv(SHAPE, dtype)
    payload = PlainCodec().encode(k, v)
    n = k.numel() * k.element_size()
    header = read_header(payload)
    assert (header.codec_id, header.flags, header.param, header.num_sections) == (4, 0, 0, 2)
    assert struct.unpack_from("<BIIBII", payload, 20) == (0, n, n, 0, n, n)  # two raw sections
    body = payload[38:]
    assert body == _bits(k).numpy().astype("<i" + str(k.element_size())).tobytes() + \
        _bits(v).numpy().astype("<i" + str(v.element_size())).tobytes()


def test_plain_non_contiguous_input_and_output() -> None:
    base = torch.randn(SHAPE[1], SHAPE[0], SHAPE[2]).to(torch.bfloat16)
    k, v = base.transpose(0, 1), (base * 3).transpose(0, 1)
    codec = get_codec("plain")
    payload = codec.encode(k, v)
    k2, v2 = codec.decode(payload, SHAPE, torch.bfloat16)
    assert torch.equal(_bits(k2), _bits(k.contiguous())) and torch.equal(_bits(v2), _bits(v.contiguous()))
    k_out = torch.empty(SHAPE[1], SHAPE[0], SHAPE[2], dtype=torch.bfloat16).transpose(0, 1)
    v_out = torch.empty_like(k_out)
    codec.decode_into(payload, k_out, v_out)
    assert torch.equal(_bits(k_out), _bits(k.contiguous()))
    assert torch.equal(_bits(v_out), _bits(v.contiguous()))


def test_plain_decode_owns_its_tensors() -> None:
    # The payload may be a receive buffer that is reused: decode must copy, never alias it.
    k, v = _kv(SHAPE, torch.float16)
    payload = bytearray(get_codec("plain").encode(k, v))
    k2, v2 = get_codec("plain").decode(payload, SHAPE, torch.float16)
    payload[38:] = bytes(len(payload) - 38)
    assert torch.equal(_bits(k2), _bits(k)) and torch.equal(_bits(v2), _bits(v))


def test_plain_rejects_compressed_sections_flags_and_param() -> None:
    k = torch.zeros(SHAPE, dtype=torch.bfloat16)
    codec = get_codec("plain")
    payload = codec.encode(k, k)
    n = k.numel() * 2
    header = payload[:20]
    zeros = zstandard.ZstdCompressor(level=1).compress(bytes(n))
    # A zstd section holding exactly the right bytes is still not a plain payload.
    with pytest.raises(CodecError, match="stored raw"):
        codec.decode(_rebuild([(1, n, zeros), (0, n, bytes(n))], header), SHAPE, torch.bfloat16)
    for offset, value in ((5, 1), (16, 3)):  # flags, param
        bad = bytearray(payload)
        bad[offset] = value
        with pytest.raises(CodecError, match="flags or param"):
            codec.decode(bytes(bad), SHAPE, torch.bfloat16)
    one_section = bytearray(_rebuild([(0, 2 * n, payload[38:])], header))
    one_section[6] = 1
    with pytest.raises(CodecError, match="sections"):
        codec.decode(bytes(one_section), SHAPE, torch.bfloat16)


@given(blob=st.binary(max_size=200), keep=st.integers(0, 38))
@settings(max_examples=300, deadline=None)
def test_plain_random_bytes_after_a_valid_prefix_are_rejected_in_one_line(blob: bytes, keep: int) -> None:
    k = torch.zeros((2, 2, 4), dtype=torch.float32)
    valid = get_codec("plain").encode(k, k)
    data = valid[:keep] + blob
    try:
        k2, v2 = get_codec("plain").decode(data, (2, 2, 4), torch.float32)
    except CodecError as exc:
        assert "\n" not in str(exc)
        return
    # Only a payload of exactly the right length with a valid header and table decodes.
    assert len(data) == len(valid) and data[:38] == valid[:38]
    assert k2.shape == v2.shape == (2, 2, 4)
