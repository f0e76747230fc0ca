"""Model fingerprint and chained block hashes: the names of KV blocks.

Owns the canonical byte encodings below and nothing else. It knows nothing about tensors, the cache,
the model or the network; every input is plain bytes, ints, strings or integer arrays. All hashes are
SHA-256 over explicit, length-prefixed, big-endian encodings, so they are identical across processes,
machines, Python versions and ``PYTHONHASHSEED`` (no ``hash()``, no pickle, no randomness).

Encodings (``u32`` = 4-byte big-endian unsigned, ``||`` = concatenation):

* Fingerprint: ``SHA-256(b"kvnet/fingerprint/v1\\0" || u32(n_fields) || field_1 || ... || field_n)``,
  fields sorted by the UTF-8 bytes of their key, each ``u32(len(key)) || key || tag || value``:

  ======== ===== ======================================================================
  type     tag   value
  ======== ===== ======================================================================
  bool     ``?`` 1 byte, 0x00 or 0x01 (checked before int: bool is an int subclass)
  int      ``i`` ``u32(len) || minimal big-endian two's complement`` (any size)
  float    ``f`` ``struct.pack(">d", value)`` (IEEE 754 binary64; -0.0 and 0.0 differ)
  str      ``s`` ``u32(len) || UTF-8``
  bytes    ``b`` ``u32(len) || raw bytes``
  ======== ===== ======================================================================

* Root: ``SHA-256(b"kvnet/root/v1\\0" || u32(32) || fingerprint || u32(len(salt)) || salt)``.
  Different salts (tenants) give unrelated roots, so their chains never meet.
* Block: ``SHA-256(b"kvnet/block/v1\\0" || parent(32) || u32(n_tokens) || tokens || u32(len(extra))
  || extra)`` with ``tokens`` the ids as big-endian uint32 (``numpy dtype '>u4'``), so
  ``h_i = hash_block(h_{i-1}, tokens of block i, extra)`` and ``h_0``'s parent is the root.

The distinct tags keep the three kinds of digest from ever colliding with each other.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from kvnet.errors import InvalidTokenError

HASH_SIZE = 32
"""Bytes in a fingerprint, root or block hash (SHA-256 digest)."""

MAX_TOKEN_ID = 2**32 - 1
"""Largest token id the block encoding (uint32) can carry."""

_FINGERPRINT_TAG = b"kvnet/fingerprint/v1\x00"
_ROOT_TAG = b"kvnet/root/v1\x00"
_BLOCK_TAG = b"kvnet/block/v1\x00"

_U32 = struct.Struct(">I")
_F64 = struct.Struct(">d")

TokenIds = Sequence[int] | npt.NDArray[np.integer]
"""Token ids: a sequence of ints or an integer numpy array (a CPU torch tensor also converts)."""

FingerprintValue = int | str | float | bytes | bool
"""Value types a fingerprint field may hold."""


def _length_prefixed(data: bytes) -> bytes:
    if len(data) > 0xFFFFFFFF:
        raise ValueError(f"field of {len(data)} bytes is too long to encode")
    return _U32.pack(len(data)) + data


def _encode_value(key: str, value: FingerprintValue) -> bytes:
    if isinstance(value, bool):
        return b"?" + (b"\x01" if value else b"\x00")
    if isinstance(value, int):
        width = (value + (value < 0)).bit_length() // 8 + 1
        return b"i" + _length_prefixed(value.to_bytes(width, "big", signed=True))
    if isinstance(value, float):
        return b"f" + _F64.pack(value)
    if isinstance(value, str):
        return b"s" + _length_prefixed(value.encode("utf-8"))
    if isinstance(value, bytes):
        return b"b" + _length_prefixed(value)
    raise TypeError(f"fingerprint field {key!r} has unsupported type {type(value).__name__}")


def canonical_fingerprint(fields: Mapping[str, FingerprintValue]) -> bytes:
    """SHA-256 (32 bytes) over the canonical encoding of ``fields`` described in the module docstring.

    Keys must be ``str`` and values ``bool``, ``int``, ``float``, ``str`` or ``bytes``; anything else
    raises ``TypeError``. Key order of the mapping does not matter.
    """
    encoded: list[tuple[bytes, bytes]] = []
    for key, value in fields.items():
        if not isinstance(key, str):
            raise TypeError(f"fingerprint keys must be str, got {type(key).__name__}")
        key_bytes = key.encode("utf-8")
        encoded.append((key_bytes, _length_prefixed(key_bytes) + _encode_value(key, value)))
    encoded.sort(key=lambda item: item[0])
    digest = hashlib.sha256(_FINGERPRINT_TAG)
    digest.update(_U32.pack(len(encoded)))
    for _, item in encoded:
        digest.update(item)
    return digest.digest()


def _check_digest(name: str, value: bytes) -> None:
    if not isinstance(value, bytes) or len(value) != HASH_SIZE:
        raise ValueError(f"{name} must be {HASH_SIZE} bytes, got {value!r}")


def _check_bytes(name: str, value: bytes) -> None:
    if not isinstance(value, bytes):
        raise TypeError(f"{name} must be bytes, got {type(value).__name__}")


def root_hash(fingerprint: bytes, salt: bytes = b"") -> bytes:
    """Chain root for a model ``fingerprint`` (32 bytes) and an optional tenant ``salt``."""
    _check_digest("fingerprint", fingerprint)
    _check_bytes("salt", salt)
    return hashlib.sha256(_ROOT_TAG + _length_prefixed(fingerprint) + _length_prefixed(salt)).digest()


def token_ids_bytes(token_ids: TokenIds) -> bytes:
    """Token ids as concatenated big-endian uint32, converted in one vectorised step.

    Raises ``InvalidTokenError`` unless ``token_ids`` is one-dimensional, integer-typed and within
    ``[0, MAX_TOKEN_ID]``.
    """
    array = np.asarray(token_ids)
    if array.ndim != 1:
        raise InvalidTokenError(f"token ids must be one-dimensional, got shape {array.shape}")
    if array.size == 0:
        return b""
    if array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.integer):
        raise InvalidTokenError(f"token ids must be integers, got dtype {array.dtype}")
    if int(array.min()) < 0 or int(array.max()) > MAX_TOKEN_ID:
        raise InvalidTokenError(f"token ids must lie in [0, {MAX_TOKEN_ID}]")
    return array.astype(">u4", copy=False).tobytes()


def hash_block(parent: bytes, token_ids: TokenIds, extra: bytes = b"") -> bytes:
    """Hash of one block: its ``parent`` hash (root or previous block), its token ids and ``extra`` keys.

    ``extra`` carries anything else that changes the block's K/V (e.g. a LoRA id or multimodal input
    digest), already canonically encoded by the caller.
    """
    _check_digest("parent", parent)
    _check_bytes("extra", extra)
    tokens = token_ids_bytes(token_ids)
    return hashlib.sha256(
        _BLOCK_TAG + parent + _U32.pack(len(tokens) // 4) + tokens + _length_prefixed(extra)
    ).digest()


def block_hashes(token_ids: TokenIds, block_size: int, root: bytes, extra: bytes = b"") -> list[bytes]:
    """Chained hashes of every FULL block of ``token_ids``; a trailing partial block is not hashed.

    ``result[i] == hash_block(result[i - 1] (or root), token_ids[i*block_size:(i+1)*block_size], extra)``.
    Tokens are encoded once with numpy; the loop runs per block, never per token.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    _check_digest("root", root)
    _check_bytes("extra", extra)
    tokens = token_ids_bytes(token_ids)
    num_blocks = len(tokens) // (4 * block_size)
    stride = 4 * block_size
    count_prefix = _U32.pack(block_size)
    extra_suffix = _length_prefixed(extra)
    view = memoryview(tokens)
    hashes: list[bytes] = []
    parent = root
    for index in range(num_blocks):
        digest = hashlib.sha256(_BLOCK_TAG)
        digest.update(parent)
        digest.update(count_prefix)
        digest.update(view[index * stride : (index + 1) * stride])
        digest.update(extra_suffix)
        parent = digest.digest()
        hashes.append(parent)
    return hashes
