"""Tests of proto.kvobject: block track naming, object ids and the block manifest."""

from __future__ import annotations

import dataclasses
import hashlib

import msgpack
import pytest
from blake3 import blake3
from hypothesis import given, settings
from hypothesis import strategies as st

from proto.kvobject import (
    DEFAULT_DIGEST_ALGORITHM,
    DTYPES,
    FORMAT_VERSION,
    MAX_MANIFEST_BYTES,
    SIGNING_CONTEXT,
    TABLES_CHUNK_BYTES,
    TABLES_HEADER,
    TABLES_MAGIC,
    BlockManifest,
    BlockTrack,
    KVObjectError,
    TablesTrack,
    block_namespace,
    block_track,
    end_of_track_object_id,
    layer_object_id,
    object_layer,
    parse_block_track,
    parse_tables_track,
    payload_digest,
    split_signed_tables,
    tables_chunks,
    tables_track,
)

FP = hashlib.sha256(b"model").digest()
H0 = hashlib.sha256(b"block0").digest()
H1 = hashlib.sha256(b"block1").digest()
# SHA-256 of _manifest().signing_bytes() in format version 1 (SHA-256 payload digests), pinned when that
# format was defined, and in version 2 (BLAKE3 payload digests), pinned when version 2 was.
PINNED_V1 = "869ad0f6633af1104f84d3f3a809e7fed440e0063ae2091dd5a71aa61ec063d3"
PINNED_V2 = "337c7b6f14ca7ff1422aa0013a52921821e844f1456dd5c95df1754bfc245c97"


def _manifest(**overrides: object) -> BlockManifest:
    """A two-layer manifest; ``digest_algorithm`` picks how it is built, other keys replace fields after."""
    digest_algorithm = str(overrides.pop("digest_algorithm", DEFAULT_DIGEST_ALGORITHM))
    payloads = [b"layer0-payload", b"layer1-payload"]
    m = BlockManifest.for_payloads(
        fingerprint=FP, block_hash=H1, parent_hash=H0, token_ids=[1, 2, 3, 70000], block_index=1,
        codec="lossless", dtype="bfloat16", shape=(2, 4, 2, 8), payloads=payloads, key_id=b"key-1",
        created_at_ms=1_700_000_000_000, digest_algorithm=digest_algorithm,
    )
    return dataclasses.replace(m, **overrides)  # type: ignore[arg-type]


def _manifest_v1() -> BlockManifest:
    """What a version 1 publisher wrote: SHA-256 digests, no ``da`` key."""
    return _manifest(digest_algorithm="sha256", format_version=1)


# -- track naming -----------------------------------------------------------------------------------


def test_block_track_layout() -> None:
    namespace, name = block_track(FP, "ns-a", H1, "int8")
    assert namespace == (b"kvnet", b"v2", FP.hex().encode(), b"ns-a")
    assert namespace == block_namespace(FP, "ns-a")
    assert name == H1.hex().encode() + b".int8"
    assert sum(len(f) for f in namespace) + len(name) <= 4096
    assert parse_block_track(namespace, name) == BlockTrack(FP, "ns-a", H1, "int8")


@given(
    fp=st.binary(min_size=32, max_size=32),
    block_hash=st.binary(min_size=32, max_size=32),
    namespace_id=st.text(alphabet="abcXYZ019_.-", min_size=1, max_size=64),
    rendition=st.text(alphabet="abcz09_", min_size=1, max_size=32),
)
def test_track_round_trip(fp: bytes, block_hash: bytes, namespace_id: str, rendition: str) -> None:
    namespace, name = block_track(fp, namespace_id, block_hash, rendition)
    assert len(namespace) == 4 and all(namespace)
    # Every field and the name are UTF-8 text (relays in the field refuse other names).
    for text in (*namespace, name):
        text.decode("utf-8")
    assert parse_block_track(list(namespace), name) == BlockTrack(fp, namespace_id, block_hash, rendition)


@pytest.mark.parametrize(
    ("fp", "namespace_id", "block_hash", "rendition"),
    [
        (FP[:31], "t", H1, "int8"),
        (FP, "", H1, "int8"),
        (FP, "a" * 65, H1, "int8"),
        (FP, "ns/x", H1, "int8"),
        (FP, "näme", H1, "int8"),
        (FP, "t", H1 + b"x", "int8"),
        (FP, "t", H1, ""),
        (FP, "t", H1, "Int8"),
        (FP, "t", H1, "int.8"),
        (FP, "t", H1, "x" * 33),
    ],
)
def test_block_track_rejects_bad_parts(
    fp: bytes, namespace_id: str, block_hash: bytes, rendition: str
) -> None:
    with pytest.raises(KVObjectError):
        block_track(fp, namespace_id, block_hash, rendition)


def test_parse_block_track_rejects_bad_names() -> None:
    ns, name = block_track(FP, "t", H1, "int4")
    bad: list[tuple[tuple[bytes, ...], bytes]] = [
        (ns[:3], name),
        ((*ns, b"extra"), name),
        ((b"kvnetx", *ns[1:]), name),
        ((ns[0], b"v1", *ns[2:]), name),
        ((ns[0], ns[1], FP.hex().upper().encode(), ns[3]), name),
        ((ns[0], ns[1], FP.hex().encode()[:-2], ns[3]), name),
        ((*ns[:3], b"bad namespace id"), name),
        ((*ns[:3], b""), name),
        (ns, H1.hex().encode() + b"int4"),
        (ns, H1.hex().encode() + b"."),
        (ns, H1.hex().encode()[:-2] + b".int4"),
        (ns, H1.hex().encode() + b"-int4"),
        (ns, H1.hex().encode() + b".INT4"),
        (ns, H1.hex().upper().encode() + b".int4"),
        (ns, H1 + b".int4"),
        (ns, b""),
    ]
    for namespace, track_name in bad:
        with pytest.raises(KVObjectError):
            parse_block_track(namespace, track_name)


def test_tables_track_is_named_by_digest_and_never_parses_as_a_block() -> None:
    ns, name = tables_track(FP, "t", H1)
    assert ns == block_namespace(FP, "t") and name == b"tables." + H1.hex().encode()
    assert parse_tables_track(ns, name) == TablesTrack(FP, "t", H1)
    with pytest.raises(KVObjectError):
        parse_block_track(ns, name)
    block_ns, block_name = block_track(FP, "t", H1, "kvtc")
    bad: list[tuple[tuple[bytes, ...], bytes]] = [
        (block_ns, block_name),
        (ns, b"tables." + H1.hex().upper().encode()),
        (ns, b"tables." + H1.hex().encode()[:-2]),
        (ns, b"tables" + H1.hex().encode()),
        (ns, b"tables." + H1),
        (ns[:3], name),
        ((*ns[:3], b"bad namespace id"), name),
    ]
    for namespace, track_name in bad:
        with pytest.raises(KVObjectError):
            parse_tables_track(namespace, track_name)


def test_tables_chunks_join_to_the_object_and_fit_the_manifest_bound() -> None:
    data = bytes(range(256)) * (3 * TABLES_CHUNK_BYTES // 256 + 7)
    chunks = tables_chunks(data)
    assert b"".join(chunks) == data and len(chunks) == 4
    assert all(len(c) <= TABLES_CHUNK_BYTES <= MAX_MANIFEST_BYTES for c in chunks)


def test_object_ids() -> None:
    assert layer_object_id(0, 3) == 1 and layer_object_id(2, 3) == 3
    assert object_layer(1, 3) == 0 and object_layer(3, 3) == 2
    assert end_of_track_object_id(3) == 4
    for bad in (-1, 3, True):
        with pytest.raises(KVObjectError):
            layer_object_id(bad, 3)
    for bad in (0, 4, -1):
        with pytest.raises(KVObjectError):
            object_layer(bad, 3)


# -- manifest ---------------------------------------------------------------------------------------


manifests = st.builds(
    lambda nl, bs, h, d, tokens, idx, codec, dtype, key, sig, ts, seed: BlockManifest.for_payloads(
        fingerprint=hashlib.sha256(b"fp%d" % seed).digest(),
        block_hash=hashlib.sha256(b"h%d" % seed).digest(),
        parent_hash=hashlib.sha256(b"p%d" % seed).digest(),
        token_ids=(tokens * bs)[:bs], block_index=idx, codec=codec, dtype=dtype, shape=(nl, bs, h, d),
        payloads=[b"%d:%d" % (seed, i) for i in range(nl)], key_id=key, created_at_ms=ts,
    ).with_signature(sig),
    st.integers(1, 12), st.integers(1, 64), st.integers(1, 16), st.integers(1, 256),
    st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=8), st.integers(0, 2**32 - 1),
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_", min_size=1, max_size=32),
    st.sampled_from(sorted(DTYPES)), st.binary(max_size=64), st.binary(max_size=256),
    st.integers(0, 2**63 - 1), st.integers(0, 1000),
)


@given(manifests)
@settings(max_examples=150)
def test_manifest_round_trip(m: BlockManifest) -> None:
    data = m.encode()
    assert BlockManifest.decode(data) == m
    assert BlockManifest.decode(bytearray(data)) == m
    assert m.encode() == data  # deterministic


@given(manifests)
@settings(max_examples=60)
def test_signing_bytes_exclude_only_signature(m: BlockManifest) -> None:
    sb = m.signing_bytes()
    assert sb.startswith(SIGNING_CONTEXT)
    assert m.with_signature(b"\x01" * 64).signing_bytes() == sb
    assert m.with_signature(b"").signing_bytes() == sb
    fields = msgpack.unpackb(sb[len(SIGNING_CONTEXT):], raw=False)
    assert "sig" not in fields
    assert fields["t"] == list(m.token_ids) and fields["d"] == list(m.payload_digests)


def test_signing_bytes_cover_every_other_field() -> None:
    base = _manifest()
    changes: dict[str, object] = {
        "fingerprint": H0, "block_hash": H0, "parent_hash": H1, "token_ids": (1, 2, 3, 4),
        "block_index": 2, "codec": "int8", "dtype": "float32", "num_kv_heads": 3, "head_dim": 16,
        "payload_digests": (H0, H1), "total_payload_bytes": 1, "key_id": b"key-2", "created_at_ms": 5,
    }
    for field, value in changes.items():
        changed = dataclasses.replace(base, **{field: value})  # type: ignore[arg-type]
        assert changed.signing_bytes() != base.signing_bytes(), field
    shape_changed = dataclasses.replace(base, num_layers=1, payload_digests=(H0,))
    assert shape_changed.signing_bytes() != base.signing_bytes()
    shape_changed = dataclasses.replace(base, block_size=3, token_ids=(1, 2, 3))
    assert shape_changed.signing_bytes() != base.signing_bytes()


def test_signing_bytes_stable_known_answer() -> None:
    # The canonical encoding is a wire format: an independent construction must agree, and the pinned
    # digest changes only with a deliberate format change.
    m = _manifest()
    assert m.format_version == FORMAT_VERSION == 2 and m.digest_algorithm == "blake3"
    assert m.payload_digests[0] == blake3(b"layer0-payload").digest()
    assert m.signing_bytes() == SIGNING_CONTEXT + _expected_unsigned_encoding(m)
    assert m.encode()[:1] == b"\x8f"  # fixmap with 15 entries
    assert m.encode()[1:4] == b"\xa2bi"  # first key in bytewise order
    assert hashlib.sha256(m.signing_bytes()).hexdigest() == PINNED_V2


def test_version_1_manifest_still_reads_and_verifies() -> None:
    # A block published before version 2 (disk tiers, relays' caches, a node not yet upgraded).
    m = _manifest_v1()
    assert m.signing_bytes() == SIGNING_CONTEXT + _expected_unsigned_encoding(m)
    assert m.encode()[:1] == b"\x8e"  # fixmap with 14 entries: no "da"
    assert hashlib.sha256(m.signing_bytes()).hexdigest() == PINNED_V1
    decoded = BlockManifest.decode(m.encode())
    assert decoded == m and decoded.digest_algorithm == "sha256" and decoded.format_version == 1
    assert decoded.payload_digests[0] == hashlib.sha256(b"layer0-payload").digest()
    assert decoded.verify_payload(1, b"layer0-payload")
    assert not decoded.verify_payload(1, b"layer1-payload")


def test_digest_algorithm_is_signed_and_checked() -> None:
    blake, sha = _manifest(), _manifest(digest_algorithm="sha256")
    assert sha.format_version == 2 and BlockManifest.decode(sha.encode()) == sha
    assert sha.verify_payload(2, b"layer1-payload") and blake.verify_payload(2, b"layer1-payload")
    # The same digests under the other algorithm's name: signed differently, and no payload matches.
    renamed = dataclasses.replace(blake, digest_algorithm="sha256")
    assert renamed.signing_bytes() != blake.signing_bytes()
    assert not renamed.verify_payload(1, b"layer0-payload")
    for overrides in ({"digest_algorithm": "md5"}, {"digest_algorithm": 3}, {"format_version": 3},
                      {"format_version": 1}):  # version 1 cannot name BLAKE3
        with pytest.raises(KVObjectError):
            dataclasses.replace(blake, **overrides)
    with pytest.raises(KVObjectError, match="md5"):
        payload_digest(b"x", "md5")


def _expected_unsigned_encoding(m: BlockManifest) -> bytes:
    # Independent construction of the canonical map: keys sorted, shortest msgpack encodings.
    fields = {
        "bi": m.block_index, "c": m.codec, "d": list(m.payload_digests), "dt": m.dtype,
        "fp": m.fingerprint, "h": m.block_hash, "k": m.key_id, "n": m.total_payload_bytes,
        "p": m.parent_hash, "s": [m.num_layers, m.block_size, m.num_kv_heads, m.head_dim],
        "t": list(m.token_ids), "ts": m.created_at_ms, "v": m.format_version,
    }
    if m.format_version == 2:
        fields["da"] = m.digest_algorithm
    return msgpack.packb(dict(sorted(fields.items())), use_bin_type=True)


def test_verify_helpers() -> None:
    m = _manifest()
    assert m.verify_tokens([1, 2, 3, 70000])
    assert m.verify_tokens((1, 2, 3, 70000))
    assert not m.verify_tokens([1, 2, 3])
    assert not m.verify_tokens([1, 2, 3, 70001])
    assert m.verify_payload(1, b"layer0-payload")
    assert m.verify_payload(2, memoryview(b"layer1-payload"))
    assert not m.verify_payload(1, b"layer1-payload")
    assert not m.verify_payload(2, b"layer1-payload\x00")
    assert m.total_payload_bytes == len(b"layer0-payload") * 2
    assert m.payload_digests[0] == payload_digest(b"layer0-payload")
    for bad_index in (0, 3, -1):
        with pytest.raises(KVObjectError):
            m.verify_payload(bad_index, b"layer0-payload")


@pytest.mark.parametrize(
    "overrides",
    [
        {"fingerprint": b"short"},
        {"block_hash": H1 + b"x"},
        {"parent_hash": "not bytes"},
        {"token_ids": (1, 2, 3)},
        {"token_ids": [1, 2, 3, 4]},
        {"token_ids": (1, 2, 3, -1)},
        {"token_ids": (1, 2, 3, 2**32)},
        {"token_ids": (1, 2, 3, True)},
        {"block_index": -1},
        {"codec": "Lossless"},
        {"codec": ""},
        {"dtype": "int8"},
        {"num_layers": 0},
        {"num_layers": 3},
        {"num_kv_heads": 0},
        {"payload_digests": (H0, H1[:31])},
        {"total_payload_bytes": -1},
        {"key_id": b"k" * 65},
        {"signature": b"s" * 257},
        {"created_at_ms": -5},
        {"block_size": 5000},
    ],
)
def test_manifest_rejects_invalid_fields(overrides: dict[str, object]) -> None:
    with pytest.raises(KVObjectError):
        _manifest(**overrides)


def _raw_fields() -> dict[str, object]:
    decoded: dict[str, object] = msgpack.unpackb(_manifest().encode(), raw=False)
    return decoded


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("v", 3),
        ("v", 1),  # version 1 has no "da"
        ("v", True),
        ("da", "sha512"),
        ("da", b"blake3"),
        ("s", [2, 4, 2]),
        ("s", "2,4,2,8"),
        ("t", b"\x00\x01"),
        ("d", [b"x" * 32]),
        ("d", "digests"),
        ("fp", "hex"),
        ("dt", ["bfloat16"]),
        ("c", 5),
        ("n", 1.5),
        ("k", "str-not-bytes"),
        ("sig", None),
        ("ts", -1),
        ("bi", 2**33),
    ],
)
def test_decode_rejects_wrong_types(key: str, value: object) -> None:
    fields = _raw_fields()
    fields[key] = value
    data = msgpack.packb(dict(sorted(fields.items())), use_bin_type=True)
    with pytest.raises(KVObjectError):
        BlockManifest.decode(data)


def test_decode_rejects_missing_extra_and_non_canonical() -> None:
    fields = _raw_fields()
    for variant in (
        {k: v for k, v in fields.items() if k != "sig"},
        {k: v for k, v in fields.items() if k != "da"},
        {**fields, "zz": 1},
    ):
        with pytest.raises(KVObjectError):
            BlockManifest.decode(msgpack.packb(dict(sorted(variant.items())), use_bin_type=True))
    # Same content, keys out of order: not canonical.
    shuffled = dict(reversed(sorted(fields.items())))
    with pytest.raises(KVObjectError, match="canonical"):
        BlockManifest.decode(msgpack.packb(shuffled, use_bin_type=True))
    # Same content, a non-minimal integer encoding (block index 1 as uint32).
    canonical = _manifest().encode()
    widened = canonical.replace(b"\xa2bi\x01", b"\xa2bi\xce\x00\x00\x00\x01", 1)
    assert widened != canonical
    with pytest.raises(KVObjectError, match="canonical"):
        BlockManifest.decode(widened)
    # Trailing bytes after the map.
    with pytest.raises(KVObjectError):
        BlockManifest.decode(canonical + b"\x00")


def test_decode_rejects_oversize_before_parsing() -> None:
    with pytest.raises(KVObjectError, match="exceeds"):
        BlockManifest.decode(b"\x80" * (MAX_MANIFEST_BYTES + 1))


@given(st.binary(max_size=400), st.integers(0, 3), st.integers(0, 3), st.integers(0, 8), st.integers(0, 80))
@settings(max_examples=400)
def test_signed_tables_from_any_bytes_split_or_raise_kvobject_error(
    tail: bytes, layers: int, heads: int, head_dim: int, kid_len: int
) -> None:
    """Random sizes behind a real header (and random bytes alone): the parts add up exactly, or one
    KVObjectError."""
    for data in (TABLES_HEADER.pack(TABLES_MAGIC, 4, FP, layers, heads, head_dim) + bytes([kid_len]) + tail,
                 tail):
        try:
            signed = split_signed_tables(data)
        except KVObjectError:
            continue
        assert signed.body + bytes([len(signed.key_id)]) + signed.key_id + signed.signature == data
        assert signed.fingerprint == FP and len(signed.signature) == 64


@given(st.binary(max_size=600))
@settings(max_examples=400)
def test_decode_random_bytes_only_kvobject_error(data: bytes) -> None:
    try:
        m = BlockManifest.decode(data)
    except KVObjectError:
        return
    assert m.encode() == data


@given(st.data())
@settings(max_examples=300)
def test_decode_mutated_manifest_only_kvobject_error(data: st.DataObject) -> None:
    raw = bytearray(_manifest().encode())
    for _ in range(data.draw(st.integers(1, 3))):
        pos = data.draw(st.integers(0, len(raw) - 1))
        raw[pos] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    try:
        m = BlockManifest.decode(bytes(raw[:cut]))
    except KVObjectError:
        return
    assert m.encode() == bytes(raw[:cut])


def test_decode_nested_and_hostile_structures() -> None:
    for blob in (
        b"\x91" * 5000 + b"\x00",  # deep nesting
        b"\xdd\xff\xff\xff\xff",  # array claiming 4G entries
        b"\xc6\xff\xff\xff\xff",  # bin claiming 4G bytes
        b"\x81\x91\x00\x00",  # map with an array key
        b"\xd6\xff\x00\x00\x00\x00",  # timestamp ext
        b"\x81\xa1v\xa2\xff\xfe",  # invalid UTF-8 string
    ):
        with pytest.raises(KVObjectError):
            BlockManifest.decode(blob)
