"""Tests for kvnet.cache.hashing: canonical encodings, determinism across processes, chaining rules."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from kvnet.cache.hashing import (
    HASH_SIZE,
    FingerprintValue,
    block_hashes,
    canonical_fingerprint,
    hash_block,
    root_hash,
    token_ids_bytes,
)
from kvnet.errors import InvalidTokenError

FIELDS: dict[str, FingerprintValue] = {
    "arch": "llama",
    "n_layers": 2,
    "rope_theta": 10000.0,
    "weights": b"\x01\x02",
    "tied": False,
}

# Known-answer vectors: freezing them catches any accidental change to the canonical encoding.
KAT_FINGERPRINT = "6e0d5424d17a9ca2024dbf9df3454b2e725162e87b75a0284c56fe8d9a1819cd"
KAT_ROOT = "cc950e1097997e7aa14afaac7190700057c6c3c2ca4bf778f2ba5d3e9d969cc9"
KAT_BLOCK = "f153ffc280c89bc65cfa00258869af22779fbdd388942ed3a53b9f783ed62fbe"

SUBPROCESS_SCRIPT = """
from kvnet.cache.hashing import block_hashes, canonical_fingerprint, root_hash
fields = {"arch": "llama", "n_layers": 2, "rope_theta": 10000.0, "weights": b"\\x01\\x02", "tied": False}
root = root_hash(canonical_fingerprint(fields), b"tenant")
print(",".join(h.hex() for h in block_hashes(list(range(1000, 1100)), 16, root)))
"""


def _u32(value: int) -> bytes:
    return struct.pack(">I", value)


def test_known_answer_vectors() -> None:
    fingerprint = canonical_fingerprint({"a": 1, "b": "x", "c": 1.5, "d": b"\x00", "e": True})
    root = root_hash(fingerprint)
    assert fingerprint.hex() == KAT_FINGERPRINT
    assert root.hex() == KAT_ROOT
    assert hash_block(root, [1, 2, 3, 4]).hex() == KAT_BLOCK


def test_encoding_matches_documented_layout() -> None:
    # Rebuild every digest by hand from the module docstring's layout.
    fields: dict[str, FingerprintValue] = {"b": "x", "a": 1, "c": 1.5, "e": True, "d": b"\x00", "n": -129}
    expected_fp = hashlib.sha256(
        b"kvnet/fingerprint/v1\x00"
        + _u32(6)
        + _u32(1) + b"a" + b"i" + _u32(1) + b"\x01"
        + _u32(1) + b"b" + b"s" + _u32(1) + b"x"
        + _u32(1) + b"c" + b"f" + struct.pack(">d", 1.5)
        + _u32(1) + b"d" + b"b" + _u32(1) + b"\x00"
        + _u32(1) + b"e" + b"?" + b"\x01"
        + _u32(1) + b"n" + b"i" + _u32(2) + b"\xff\x7f"
    ).digest()
    assert canonical_fingerprint(fields) == expected_fp
    root = root_hash(expected_fp, b"s")
    assert root == hashlib.sha256(b"kvnet/root/v1\x00" + _u32(32) + expected_fp + _u32(1) + b"s").digest()
    block = hash_block(root, [1, 70000], b"xy")
    tokens = struct.pack(">II", 1, 70000)
    assert block == hashlib.sha256(b"kvnet/block/v1\x00" + root + _u32(2) + tokens + _u32(2) + b"xy").digest()


def test_fingerprint_is_order_independent_and_type_sensitive() -> None:
    reordered = dict(reversed(list(FIELDS.items())))
    assert canonical_fingerprint(reordered) == canonical_fingerprint(FIELDS)
    assert canonical_fingerprint({"x": 1}) != canonical_fingerprint({"x": True})
    assert canonical_fingerprint({"x": 1}) != canonical_fingerprint({"x": 1.0})
    assert canonical_fingerprint({"x": "1"}) != canonical_fingerprint({"x": b"1"})
    # Length prefixes keep key/value boundaries unambiguous.
    assert canonical_fingerprint({"ab": "c"}) != canonical_fingerprint({"a": "bc"})
    assert len(canonical_fingerprint(FIELDS)) == HASH_SIZE


def test_fingerprint_rejects_unsupported_types() -> None:
    with pytest.raises(TypeError, match="unsupported"):
        canonical_fingerprint({"x": [1, 2]})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="keys"):
        canonical_fingerprint({1: 2})  # type: ignore[dict-item]


def test_hashes_identical_across_processes_and_hash_seeds() -> None:
    outputs = set()
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run(
            [sys.executable, "-c", SUBPROCESS_SCRIPT], env=env, capture_output=True, text=True, check=True
        )
        outputs.add(result.stdout.strip())
    assert len(outputs) == 1
    root = root_hash(canonical_fingerprint(FIELDS), b"tenant")
    local = ",".join(h.hex() for h in block_hashes(list(range(1000, 1100)), 16, root))
    assert outputs == {local}


def test_salt_changes_root_and_every_block_hash() -> None:
    fingerprint = canonical_fingerprint(FIELDS)
    tokens = np.arange(64)
    plain = block_hashes(tokens, 16, root_hash(fingerprint))
    salted = block_hashes(tokens, 16, root_hash(fingerprint, b"tenant-a"))
    other = block_hashes(tokens, 16, root_hash(fingerprint, b"tenant-b"))
    assert root_hash(fingerprint) != root_hash(fingerprint, b"tenant-a")
    assert not set(plain) & set(salted)
    assert not set(salted) & set(other)


def test_partial_last_block_is_ignored() -> None:
    root = root_hash(canonical_fingerprint(FIELDS))
    full = block_hashes(list(range(32)), 16, root)
    assert len(full) == 2
    assert block_hashes(list(range(47)), 16, root) == full
    assert len(block_hashes(list(range(48)), 16, root)) == 3
    assert block_hashes(list(range(15)), 16, root) == []
    assert block_hashes([], 16, root) == []


def test_block_hashes_chain_through_hash_block() -> None:
    root = root_hash(canonical_fingerprint(FIELDS))
    tokens = np.random.default_rng(7).integers(0, 2**32, size=100, dtype=np.int64)
    chained = block_hashes(tokens, 8, root, extra=b"lora:3")
    parent = root
    for index, block_hash in enumerate(chained):
        parent = hash_block(parent, tokens[index * 8 : (index + 1) * 8], b"lora:3")
        assert block_hash == parent
    assert block_hashes(tokens, 8, root) != chained  # extra keys change the hashes


def test_prefix_property_and_input_types_agree() -> None:
    root = root_hash(canonical_fingerprint(FIELDS))
    tokens = list(range(200, 300))
    as_list = block_hashes(tokens, 10, root)
    assert block_hashes(np.array(tokens, dtype=np.int32), 10, root) == as_list
    assert block_hashes(np.array(tokens, dtype=np.uint64), 10, root) == as_list
    # A prompt sharing the first 50 tokens shares exactly the first 5 block hashes.
    diverged = block_hashes(tokens[:50] + [9] * 50, 10, root)
    assert diverged[:5] == as_list[:5]
    assert not set(diverged[5:]) & set(as_list[5:])


@pytest.mark.parametrize(
    "bad",
    [[-1, 2], [2**32], [1.5, 2.0], np.array([True, False]), np.zeros((2, 2), dtype=np.int64), ["a"]],
)
def test_invalid_token_ids_raise(bad: object) -> None:
    root = root_hash(canonical_fingerprint(FIELDS))
    with pytest.raises(InvalidTokenError):
        block_hashes(bad, 1, root)  # type: ignore[arg-type]
    with pytest.raises(InvalidTokenError):
        hash_block(root, bad)  # type: ignore[arg-type]


def test_encode_token_ids_is_big_endian_uint32() -> None:
    assert token_ids_bytes([1, 0x01020304]) == b"\x00\x00\x00\x01\x01\x02\x03\x04"
    assert token_ids_bytes([]) == b""


def test_bad_digests_and_block_size_raise() -> None:
    root = root_hash(canonical_fingerprint(FIELDS))
    with pytest.raises(ValueError, match="fingerprint"):
        root_hash(b"short")
    with pytest.raises(ValueError, match="parent"):
        hash_block(b"x" * 31, [1])
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1, 2], 0, root)
    with pytest.raises(TypeError, match="salt"):
        root_hash(root, "salt")  # type: ignore[arg-type]
