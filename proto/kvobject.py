"""The KV object format: how one KV-cache block maps onto MoQT draft-18 names, groups and objects.

This module owns the naming of block tracks (namespace and track name), the object layout of a block
track and the block manifest (a canonical msgpack map). The normative description, precise enough for
a third-party implementation, is proto/KVOBJECT.md; this code follows it.

What it must not know: tensors, codecs and hashing. Payloads are opaque bytes, the signature is opaque
bytes (kvnet signs and verifies it), and the chain rule ``block_hash == hash_block(parent_hash,
token_ids)`` is checked by the caller with kvnet.hashing: proto only carries the fields. Every failure
on peer-supplied bytes raises ``KVObjectError`` and nothing else.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgpack
from blake3 import blake3

__all__ = [
    "BLOCK_GROUP_ID",
    "DEFAULT_DIGEST_ALGORITHM",
    "DIGEST_ALGORITHMS",
    "DTYPES",
    "FORMAT_VERSION",
    "HASH_LEN",
    "MANIFEST_OBJECT_ID",
    "MAX_BLOCK_TOKENS",
    "MAX_LAYERS",
    "MAX_MANIFEST_BYTES",
    "MAX_TABLES_BYTES",
    "NAMESPACE_ROOT",
    "NAMESPACE_VERSION",
    "SIGNING_CONTEXT",
    "TABLES_CHUNK_BYTES",
    "TABLES_HEADER",
    "TABLES_MAGIC",
    "TABLES_SIGNATURE_LEN",
    "TABLES_SIGNING_CONTEXT",
    "TABLES_TRACK_PREFIX",
    "BlockManifest",
    "BlockTrack",
    "KVObjectError",
    "SignedTables",
    "TablesTrack",
    "block_namespace",
    "block_track",
    "end_of_track_object_id",
    "layer_object_id",
    "object_layer",
    "parse_block_track",
    "parse_tables_track",
    "payload_digest",
    "split_signed_tables",
    "tables_body_length",
    "tables_chunks",
    "tables_track",
]

FORMAT_VERSION: Final = 2
"""Manifest format version (field ``v``) written; version 1 (SHA-256 payload digests, no ``da`` key) is
still read, so blocks published before version 2 stay usable."""
_DIGESTS: Final[dict[str, Callable[[bytes | bytearray | memoryview], Any]]] = {
    "blake3": blake3, "sha256": hashlib.sha256,
}
"""Each payload digest algorithm's hash constructor (both give 32-byte digests and release the GIL while
they hash, so verify threads run in parallel)."""
DIGEST_ALGORITHMS: Final = tuple(_DIGESTS)
"""Payload digest algorithms a manifest may name (field ``da``)."""
DEFAULT_DIGEST_ALGORITHM: Final = "blake3"
"""What publishers digest payloads with: BLAKE3 hashes a layer ~4x faster per core than SHA-256 with the
CPU's SHA extensions (7.4 against 1.8 GB/s here), and the subscriber hashes every byte it fetches."""
NAMESPACE_ROOT: Final = b"kvnet"
"""First Track Namespace Field of every kvnet track."""
NAMESPACE_VERSION: Final = b"v2"
"""Second Track Namespace Field: version of this naming scheme (v2: every name is UTF-8 text)."""
HASH_LEN: Final = 32
"""Bytes in a block hash, parent hash, fingerprint (SHA-256) and payload digest (either algorithm)."""
TRACK_NAME_SEPARATOR: Final = b"."
"""Byte between the hex block hash and the rendition name in a Track Name."""
BLOCK_GROUP_ID: Final = 0
"""The only group of a block track."""
MANIFEST_OBJECT_ID: Final = 0
"""Object ID of the manifest; layer ``l`` is object ``l + 1``."""
SIGNING_CONTEXT: Final = b"kvnet-manifest-v1\x00"
"""Domain-separation prefix of ``BlockManifest.signing_bytes``."""

MAX_BLOCK_TOKENS: Final = 4096
MAX_LAYERS: Final = 1024
MAX_KV_HEADS: Final = 4096
MAX_HEAD_DIM: Final = 4096
MAX_TOKEN_ID: Final = 2**32 - 1
MAX_BLOCK_INDEX: Final = 2**32 - 1
MAX_TOTAL_PAYLOAD: Final = 2**48 - 1
MAX_CREATED_AT_MS: Final = 2**63 - 1
MAX_KEY_ID_LEN: Final = 64
MAX_SIGNATURE_LEN: Final = 256
MAX_NAMESPACE_ID_LEN: Final = 64
MAX_RENDITION_LEN: Final = 32
MAX_MANIFEST_BYTES: Final = 256 * 1024
"""Upper bound of an encoded manifest; checked before unpacking anything."""
TABLES_TRACK_PREFIX: Final = b"tables."
"""Start of a tables track's name (a codec's decoder tables, named by their digest; KVOBJECT.md 2.3)."""
TABLES_SIGNATURE_LEN: Final = 64
"""Ed25519 signature at the end of a table object."""
TABLES_CHUNK_BYTES: Final = MAX_MANIFEST_BYTES
"""Largest object of a tables track: no larger than a manifest, so every object fits a receiver's limit
for the object at (0, 0)."""

DTYPES: Final = frozenset({"bfloat16", "float16", "float32", "float64"})
"""Element dtype names a manifest may carry (torch names without the ``torch.`` prefix)."""

_RENDITION_RE = re.compile(rb"[a-z0-9_]{1,%d}" % MAX_RENDITION_LEN)
_NAMESPACE_ID_RE = re.compile(rb"[A-Za-z0-9_.\-]{1,%d}" % MAX_NAMESPACE_ID_LEN)
_HASH_HEX_RE = re.compile(rb"[0-9a-f]{%d}" % (2 * HASH_LEN))
"""A fingerprint or block hash in a name: lowercase hex, so one byte string per hash."""

# Manifest map keys (short, so the manifest stays small); the canonical form sorts them bytewise.
_K_BLOCK_INDEX = "bi"
_K_CODEC = "c"
_K_DIGESTS = "d"
_K_DIGEST_ALGORITHM = "da"
_K_DTYPE = "dt"
_K_FINGERPRINT = "fp"
_K_BLOCK_HASH = "h"
_K_KEY_ID = "k"
_K_TOTAL = "n"
_K_PARENT = "p"
_K_SHAPE = "s"
_K_SIGNATURE = "sig"
_K_TOKENS = "t"
_K_CREATED_AT = "ts"
_K_VERSION = "v"
_KEYS_V1: Final = frozenset({
    _K_BLOCK_INDEX, _K_CODEC, _K_DIGESTS, _K_DTYPE, _K_FINGERPRINT, _K_BLOCK_HASH, _K_KEY_ID, _K_TOTAL,
    _K_PARENT, _K_SHAPE, _K_SIGNATURE, _K_TOKENS, _K_CREATED_AT, _K_VERSION,
})
_KEYS: Final = {1: _KEYS_V1, 2: _KEYS_V1 | {_K_DIGEST_ALGORITHM}}
"""The keys of a manifest of each format version, all required."""


class KVObjectError(ValueError):
    """A block track name, object id or manifest is malformed or violates a limit."""


def payload_digest(payload: bytes | bytearray | memoryview,
                   algorithm: str = DEFAULT_DIGEST_ALGORITHM) -> bytes:
    """The digest of one layer object's payload, as listed in the manifest, by one of
    ``DIGEST_ALGORITHMS``."""
    hasher = _DIGESTS.get(algorithm)
    if hasher is None:
        raise KVObjectError(f"payload digest algorithm {algorithm!r} not one of {list(DIGEST_ALGORITHMS)}")
    digest: bytes = hasher(payload).digest()
    return digest


# ---------------------------------------------------------------------------------------------------
# Track naming
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BlockTrack:
    """The parts of a block track's Full Track Name."""

    fingerprint: bytes
    """32-byte model fingerprint."""
    namespace_id: str
    """Namespace id: the tenant's name or pseudonym (ASCII ``[A-Za-z0-9_.-]``, 1..64 characters)."""
    block_hash: bytes
    """32-byte chained block hash."""
    rendition: str
    """Codec / rendition name (``[a-z0-9_]``, 1..32 characters)."""


def _check_hash(name: str, value: object) -> bytes:
    if not isinstance(value, bytes) or len(value) != HASH_LEN:
        raise KVObjectError(f"{name} must be {HASH_LEN} bytes, got {_describe(value)}")
    return value


def _check_ascii(name: str, value: object, pattern: re.Pattern[bytes]) -> bytes:
    if not isinstance(value, str):
        raise KVObjectError(f"{name} must be a str, got {type(value).__name__}")
    try:
        raw = value.encode("ascii")
    except UnicodeEncodeError:
        raise KVObjectError(f"{name} {value!r} is not ASCII") from None
    if not pattern.fullmatch(raw):
        raise KVObjectError(f"{name} {value!r} does not match {pattern.pattern.decode()}")
    return raw


def _describe(value: object) -> str:
    if isinstance(value, bytes | bytearray):
        return f"{len(value)} bytes"
    return type(value).__name__


def block_namespace(fingerprint: bytes, namespace_id: str) -> tuple[bytes, ...]:
    """Track Namespace of every block of ``namespace_id`` under model ``fingerprint``.

    ``("kvnet", "v2", <fingerprint as 64 lowercase hex digits>, <namespace id>)``; a publisher announces
    exactly this tuple with PUBLISH_NAMESPACE.
    """
    fp = _check_hash("fingerprint", fingerprint)
    return (NAMESPACE_ROOT, NAMESPACE_VERSION, fp.hex().encode("ascii"),
            _check_ascii("namespace_id", namespace_id, _NAMESPACE_ID_RE))


def block_track(
    fingerprint: bytes, namespace_id: str, block_hash: bytes, rendition: str
) -> tuple[tuple[bytes, ...], bytes]:
    """``(track_namespace, track_name)`` of one block in one rendition.

    Track Name = block hash as 64 lowercase hex digits + ``b"."`` + ASCII rendition name: text only, so
    relays that insist on UTF-8 names carry it.
    """
    namespace = block_namespace(fingerprint, namespace_id)
    name = _check_hash("block_hash", block_hash).hex().encode("ascii") + TRACK_NAME_SEPARATOR + _check_ascii(
        "rendition", rendition, _RENDITION_RE
    )
    return namespace, name


def parse_block_track(namespace: Sequence[bytes], track_name: bytes) -> BlockTrack:
    """Inverse of ``block_track``; ``KVObjectError`` for anything ``block_track`` cannot produce."""
    fields = tuple(namespace)
    if len(fields) != 4 or not all(isinstance(f, bytes) for f in fields):
        raise KVObjectError(f"block namespace must be 4 byte fields, got {len(fields)} field(s)")
    root, version, fp_hex, namespace_id_raw = fields
    if root != NAMESPACE_ROOT:
        raise KVObjectError(f"namespace root {root!r} is not {NAMESPACE_ROOT!r}")
    if version != NAMESPACE_VERSION:
        raise KVObjectError(f"unsupported namespace version {version!r}")
    if not _HASH_HEX_RE.fullmatch(fp_hex):
        raise KVObjectError("fingerprint field must be 64 lowercase hex digits")
    if not _NAMESPACE_ID_RE.fullmatch(namespace_id_raw):
        raise KVObjectError(
            f"namespace id field {namespace_id_raw!r} is not 1..{MAX_NAMESPACE_ID_LEN} of [A-Za-z0-9_.-]"
        )
    if not isinstance(track_name, bytes):
        raise KVObjectError(f"track name must be bytes, got {type(track_name).__name__}")
    hex_len = 2 * HASH_LEN
    hash_hex, sep, rendition = (
        track_name[:hex_len], track_name[hex_len : hex_len + 1], track_name[hex_len + 1 :],
    )
    if not _HASH_HEX_RE.fullmatch(hash_hex) or sep != TRACK_NAME_SEPARATOR:
        raise KVObjectError("track name must be a block hash in 64 lowercase hex digits, '.', a rendition")
    if not _RENDITION_RE.fullmatch(rendition):
        raise KVObjectError(f"rendition {rendition!r} is not 1..{MAX_RENDITION_LEN} of [a-z0-9_]")
    return BlockTrack(bytes.fromhex(fp_hex.decode("ascii")), namespace_id_raw.decode("ascii"),
                      bytes.fromhex(hash_hex.decode("ascii")), rendition.decode("ascii"))


@dataclass(frozen=True, slots=True)
class TablesTrack:
    """The parts of a tables track's Full Track Name."""

    fingerprint: bytes
    namespace_id: str
    digest: bytes
    """SHA-256 of the tables' body: what a payload coded with them names."""


def tables_track(fingerprint: bytes, namespace_id: str, digest: bytes) -> tuple[tuple[bytes, ...], bytes]:
    """``(track_namespace, track_name)`` of a codec's decoder tables (kvtc's ``TransformTables``), in the
    block namespace of the publisher that codes with them.

    Track Name = ``b"tables."`` + the tables' digest as 64 lowercase hex digits: it never parses as a block
    track (those start with the hex hash), so relays and servers tell the two apart by name.
    """
    namespace = block_namespace(fingerprint, namespace_id)
    return namespace, TABLES_TRACK_PREFIX + _check_hash("digest", digest).hex().encode("ascii")


def parse_tables_track(namespace: Sequence[bytes], track_name: bytes) -> TablesTrack:
    """Inverse of ``tables_track``; ``KVObjectError`` for anything ``tables_track`` cannot produce."""
    if not isinstance(track_name, bytes) or not track_name.startswith(TABLES_TRACK_PREFIX):
        raise KVObjectError("not a tables track name")
    digest_hex = track_name[len(TABLES_TRACK_PREFIX):]
    if not _HASH_HEX_RE.fullmatch(digest_hex):
        raise KVObjectError("tables track name must be 'tables.' and a digest in 64 lowercase hex digits")
    # The namespace is a block namespace; parse it with a syntactically valid block name.
    parts = parse_block_track(namespace, digest_hex + TRACK_NAME_SEPARATOR + b"tables")
    return TablesTrack(parts.fingerprint, parts.namespace_id, bytes.fromhex(digest_hex.decode("ascii")))


TABLES_SIGNING_CONTEXT: Final = b"kvnet-kvtc-tables-v1\x00"
"""Domain-separation prefix of what a table object's signature covers (``SignedTables.signing_bytes``)."""
TABLES_MAGIC: Final = b"KVTT"
MAX_TABLES_BYTES: Final = 256 * 1024 * 1024
"""Largest table object a receiver accepts (joined from its track's objects)."""
TABLES_HEADER: Final = struct.Struct("<4sB32sHHH")
"""Start of a tables body: magic, version, model fingerprint, layers, KV heads, head dim."""


@dataclass(frozen=True, slots=True)
class SignedTables:
    """A table object cut into its parts (KVOBJECT.md 2.3): what a relay checks before it caches one, and
    what a node verifies before it decodes with it. The body's arrays are the codec's business."""

    body: bytes
    fingerprint: bytes
    key_id: bytes
    signature: bytes

    @property
    def digest(self) -> bytes:
        """The tables' name: SHA-256 of the body."""
        return hashlib.sha256(self.body).digest()

    def signing_bytes(self) -> bytes:
        return TABLES_SIGNING_CONTEXT + self.digest


def tables_array_sizes(layers: int, heads: int, head_dim: int) -> tuple[int, ...]:
    """How many float32 values each array of a kvtc tables body holds, in order (C = heads x head_dim):
    mean ``[L, 2, C]``, basis ``[L, 2, C, C]``, step ``[L, 2, C]``, spread ``[L, 2, C]``, key weight
    ``[L, H, D, D]``, predictor ``[L, 2C + 1, 2C]``, rotary inverse frequencies ``[D / 2]``
    (kvnet.blocks.transform_tables)."""
    c = heads * head_dim
    return (layers * 2 * c, layers * 2 * c * c, layers * 2 * c, layers * 2 * c,
            layers * heads * head_dim * head_dim, layers * (2 * c + 1) * 2 * c, head_dim // 2)


def tables_body_length(data: bytes) -> int:
    """Bytes of the kvtc tables body that starts ``data``: its header names the model's shape, and the
    arrays of ``tables_array_sizes`` follow it."""
    if len(data) < TABLES_HEADER.size:
        raise KVObjectError("kvtc tables shorter than their header")
    magic, _, _, layers, heads, head_dim = TABLES_HEADER.unpack_from(data, 0)
    if magic != TABLES_MAGIC:
        raise KVObjectError(f"kvtc tables: bad magic {magic!r}")
    return TABLES_HEADER.size + 4 * sum(tables_array_sizes(layers, heads, head_dim))


def split_signed_tables(data: bytes) -> SignedTables:
    """``body || key id length (u8) || key id || signature (64)`` cut apart; ``KVObjectError`` when the
    sizes do not add up (nothing is verified here)."""
    if not TABLES_HEADER.size + 1 + TABLES_SIGNATURE_LEN <= len(data) <= MAX_TABLES_BYTES:
        raise KVObjectError(f"kvtc tables: object of {len(data)} bytes out of bounds")
    body_len = tables_body_length(data)
    if body_len >= len(data) - TABLES_SIGNATURE_LEN:
        raise KVObjectError("kvtc tables: object truncated")
    kid_len = data[body_len]
    if body_len + 1 + kid_len + TABLES_SIGNATURE_LEN != len(data):
        raise KVObjectError("kvtc tables: key id length does not match the object size")
    fingerprint: bytes = TABLES_HEADER.unpack_from(data, 0)[2]
    return SignedTables(bytes(data[:body_len]), fingerprint, bytes(data[body_len + 1:body_len + 1 + kid_len]),
                        bytes(data[-TABLES_SIGNATURE_LEN:]))


def tables_chunks(data: bytes) -> tuple[bytes, ...]:
    """A signed tables object cut into the objects of its track (0, 1, ... in group 0), each at most
    ``TABLES_CHUNK_BYTES``; the receiver joins them in order."""
    return tuple(data[i:i + TABLES_CHUNK_BYTES] for i in range(0, len(data), TABLES_CHUNK_BYTES)) or (b"",)


# ---------------------------------------------------------------------------------------------------
# Objects
# ---------------------------------------------------------------------------------------------------


def layer_object_id(layer: int, num_layers: int) -> int:
    """Object ID (in group 0) of the payload of ``layer``."""
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < num_layers:
        raise KVObjectError(f"layer {layer!r} outside 0..{num_layers - 1}")
    return layer + 1


def object_layer(object_id: int, num_layers: int) -> int:
    """Layer carried by ``object_id``; ``KVObjectError`` for the manifest or ids past the last layer."""
    if isinstance(object_id, bool) or not isinstance(object_id, int) or not 1 <= object_id <= num_layers:
        raise KVObjectError(f"object id {object_id!r} is not a layer object (1..{num_layers})")
    return object_id - 1


def end_of_track_object_id(num_layers: int) -> int:
    """Object ID at which END_OF_TRACK is signalled: one past the last layer object."""
    return num_layers + 1


# ---------------------------------------------------------------------------------------------------
# Manifest
# ---------------------------------------------------------------------------------------------------


def _check_int(name: str, value: object, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise KVObjectError(f"{name} must be an int in [{lo}, {hi}], got {value!r}"[:200])
    return value


def _check_bytes(name: str, value: object, max_len: int) -> bytes:
    if not isinstance(value, bytes) or len(value) > max_len:
        raise KVObjectError(f"{name} must be at most {max_len} bytes, got {_describe(value)}")
    return value


@dataclass(frozen=True, slots=True)
class BlockManifest:
    """Object 0 of a block track: what the block is, how its layer objects are encoded and digests.

    Validated on construction, so an instance always encodes to a valid manifest.
    """

    fingerprint: bytes
    """32-byte model fingerprint (equals the one in the track namespace)."""
    block_hash: bytes
    """32-byte chained hash of this block (equals the one in the track name)."""
    parent_hash: bytes
    """32-byte hash of the previous block, or the chain root for block 0."""
    token_ids: tuple[int, ...]
    """The block's token ids, ``block_size`` of them."""
    block_index: int
    """Position of the block in its chain (0 for the first block of a prompt)."""
    codec: str
    """Rendition name of the layer payloads (equals the one in the track name)."""
    dtype: str
    """Element dtype of the decoded K/V, one of ``DTYPES``."""
    num_layers: int
    """Layers, hence layer objects (object ids 1..num_layers)."""
    block_size: int
    """Tokens in the block."""
    num_kv_heads: int
    """Key/value heads per layer."""
    head_dim: int
    """Channels per head."""
    payload_digests: tuple[bytes, ...]
    """The digest of each layer object's payload (by ``digest_algorithm``), in layer order."""
    total_payload_bytes: int
    """Sum of the layer payload lengths."""
    key_id: bytes = b""
    """Identifier of the publisher's signing key (opaque here; empty if unsigned)."""
    signature: bytes = b""
    """Signature over ``signing_bytes()`` (opaque here; empty until signed)."""
    created_at_ms: int = 0
    """Creation time, milliseconds since the Unix epoch."""
    digest_algorithm: str = DEFAULT_DIGEST_ALGORITHM
    """What ``payload_digests`` were computed with, one of ``DIGEST_ALGORITHMS``."""
    format_version: int = FORMAT_VERSION
    """1 (read only: SHA-256 digests, no ``da`` key) or 2."""

    def __post_init__(self) -> None:
        _check_hash("fingerprint", self.fingerprint)
        _check_hash("block_hash", self.block_hash)
        _check_hash("parent_hash", self.parent_hash)
        _check_int("num_layers", self.num_layers, 1, MAX_LAYERS)
        _check_int("block_size", self.block_size, 1, MAX_BLOCK_TOKENS)
        _check_int("num_kv_heads", self.num_kv_heads, 1, MAX_KV_HEADS)
        _check_int("head_dim", self.head_dim, 1, MAX_HEAD_DIM)
        _check_int("block_index", self.block_index, 0, MAX_BLOCK_INDEX)
        _check_int("total_payload_bytes", self.total_payload_bytes, 0, MAX_TOTAL_PAYLOAD)
        _check_int("created_at_ms", self.created_at_ms, 0, MAX_CREATED_AT_MS)
        if not isinstance(self.token_ids, tuple) or len(self.token_ids) != self.block_size:
            raise KVObjectError(f"token_ids must be a tuple of block_size={self.block_size} ints")
        for tok in self.token_ids:
            _check_int("token id", tok, 0, MAX_TOKEN_ID)
        _check_ascii("codec", self.codec, _RENDITION_RE)
        if not isinstance(self.dtype, str) or self.dtype not in DTYPES:
            raise KVObjectError(f"dtype {self.dtype!r} not one of {sorted(DTYPES)}")
        if not isinstance(self.payload_digests, tuple) or len(self.payload_digests) != self.num_layers:
            raise KVObjectError(f"payload_digests must be a tuple of num_layers={self.num_layers} digests")
        for digest in self.payload_digests:
            _check_hash("payload digest", digest)
        _check_bytes("key_id", self.key_id, MAX_KEY_ID_LEN)
        _check_bytes("signature", self.signature, MAX_SIGNATURE_LEN)
        _check_int("format version", self.format_version, 1, FORMAT_VERSION)
        if not isinstance(self.digest_algorithm, str) or self.digest_algorithm not in DIGEST_ALGORITHMS:
            named = repr(self.digest_algorithm)[:40]
            raise KVObjectError(f"payload digest algorithm {named} not one of {list(DIGEST_ALGORITHMS)}")
        if self.format_version == 1 and self.digest_algorithm != "sha256":
            raise KVObjectError("a version 1 manifest's payload digests are SHA-256")

    # -- construction helpers -----------------------------------------------------------------------

    @classmethod
    def for_payloads(
        cls,
        *,
        fingerprint: bytes,
        block_hash: bytes,
        parent_hash: bytes,
        token_ids: Sequence[int],
        block_index: int,
        codec: str,
        dtype: str,
        shape: tuple[int, int, int, int],
        payloads: Sequence[bytes | bytearray | memoryview],
        key_id: bytes = b"",
        created_at_ms: int = 0,
        digest_algorithm: str = DEFAULT_DIGEST_ALGORITHM,
    ) -> BlockManifest:
        """Build an unsigned manifest whose digests (by ``digest_algorithm``) and total match ``payloads``
        (one per layer)."""
        num_layers, block_size, num_kv_heads, head_dim = shape
        return cls(
            fingerprint=fingerprint, block_hash=block_hash, parent_hash=parent_hash,
            token_ids=tuple(token_ids), block_index=block_index, codec=codec, dtype=dtype,
            num_layers=num_layers, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
            payload_digests=tuple(payload_digest(p, digest_algorithm) for p in payloads),
            total_payload_bytes=sum(len(p) for p in payloads), key_id=key_id, created_at_ms=created_at_ms,
            digest_algorithm=digest_algorithm,
        )

    def with_signature(self, signature: bytes, key_id: bytes | None = None) -> BlockManifest:
        """A copy carrying ``signature`` (and ``key_id`` if given); the signed bytes are unchanged
        unless ``key_id`` changes."""
        return dataclasses.replace(self, signature=signature,
                                   key_id=self.key_id if key_id is None else key_id)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(num_layers, block_size, num_kv_heads, head_dim)``."""
        return (self.num_layers, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def layer_shape(self) -> tuple[int, int, int]:
        """Shape of K (and of V) in one layer object: ``(block_size, num_kv_heads, head_dim)``."""
        return (self.block_size, self.num_kv_heads, self.head_dim)

    # -- canonical encoding -------------------------------------------------------------------------

    def _fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {
            _K_BLOCK_INDEX: self.block_index,
            _K_CODEC: self.codec,
            _K_DIGESTS: list(self.payload_digests),
            _K_DTYPE: self.dtype,
            _K_FINGERPRINT: self.fingerprint,
            _K_BLOCK_HASH: self.block_hash,
            _K_KEY_ID: self.key_id,
            _K_TOTAL: self.total_payload_bytes,
            _K_PARENT: self.parent_hash,
            _K_SHAPE: list(self.shape),
            _K_SIGNATURE: self.signature,
            _K_TOKENS: list(self.token_ids),
            _K_CREATED_AT: self.created_at_ms,
            _K_VERSION: self.format_version,
        }
        if self.format_version >= 2:
            fields[_K_DIGEST_ALGORITHM] = self.digest_algorithm
        return fields

    @staticmethod
    def _pack(fields: dict[str, Any]) -> bytes:
        # Canonical: keys sorted bytewise, msgpack's shortest encodings, str for text, bin for bytes.
        ordered = {key: fields[key] for key in sorted(fields, key=lambda k: k.encode("ascii"))}
        packed: bytes = msgpack.packb(ordered, use_bin_type=True)
        return packed

    def encode(self) -> bytes:
        """The canonical msgpack encoding (the payload of object 0)."""
        return self._pack(self._fields())

    def signing_bytes(self) -> bytes:
        """What the signature covers: ``SIGNING_CONTEXT`` + canonical encoding of every field but ``sig``."""
        fields = self._fields()
        del fields[_K_SIGNATURE]
        return SIGNING_CONTEXT + self._pack(fields)

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> BlockManifest:
        """Parse a manifest; ``KVObjectError`` for malformed, non-canonical or out-of-limit input."""
        if len(data) > MAX_MANIFEST_BYTES:
            raise KVObjectError(f"manifest of {len(data)} bytes exceeds {MAX_MANIFEST_BYTES}")
        try:
            obj = msgpack.unpackb(
                bytes(data), raw=False, use_list=True, strict_map_key=True, timestamp=0,
                max_bin_len=MAX_SIGNATURE_LEN, max_str_len=MAX_RENDITION_LEN,
                max_array_len=MAX_BLOCK_TOKENS, max_map_len=len(_KEYS[FORMAT_VERSION]), max_ext_len=0,
            )
        except Exception as exc:
            # msgpack reports malformed input through several exception types (ValueError subclasses,
            # TypeError for unhashable keys, UnicodeDecodeError); all mean the same thing here.
            raise KVObjectError(f"manifest is not valid msgpack: {exc}"[:200]) from None
        if not isinstance(obj, dict):
            raise KVObjectError(f"manifest must be a map, got {type(obj).__name__}")
        version = _check_int("format version", obj.get(_K_VERSION), 1, FORMAT_VERSION)
        keys = _KEYS[version]
        if set(obj) != keys:
            missing = sorted(keys - set(obj))
            extra = sorted(map(repr, set(obj) - keys))
            raise KVObjectError(f"manifest keys wrong: missing {missing}, unknown {extra}"[:200])
        shape = obj[_K_SHAPE]
        if not isinstance(shape, list) or len(shape) != 4:
            raise KVObjectError("shape must be a list of 4 ints")
        tokens, digests = obj[_K_TOKENS], obj[_K_DIGESTS]
        if not isinstance(tokens, list) or not isinstance(digests, list):
            raise KVObjectError("token ids and payload digests must be lists")
        manifest = cls(
            fingerprint=obj[_K_FINGERPRINT], block_hash=obj[_K_BLOCK_HASH], parent_hash=obj[_K_PARENT],
            token_ids=tuple(tokens), block_index=obj[_K_BLOCK_INDEX], codec=obj[_K_CODEC],
            dtype=obj[_K_DTYPE], num_layers=shape[0], block_size=shape[1], num_kv_heads=shape[2],
            head_dim=shape[3], payload_digests=tuple(digests), total_payload_bytes=obj[_K_TOTAL],
            key_id=obj[_K_KEY_ID], signature=obj[_K_SIGNATURE], created_at_ms=obj[_K_CREATED_AT],
            digest_algorithm=obj.get(_K_DIGEST_ALGORITHM, "sha256"), format_version=version,
        )
        # Exactly one byte string per manifest: anything else could carry a second meaning past a
        # signature check, or make two relays disagree about "the same" object.
        if manifest.encode() != bytes(data):
            raise KVObjectError("manifest is not in canonical encoding")
        return manifest

    # -- verification helpers -----------------------------------------------------------------------

    def verify_tokens(self, expected_token_ids: Sequence[int]) -> bool:
        """True if the block carries exactly ``expected_token_ids`` (the subscriber's own prompt slice)."""
        return tuple(expected_token_ids) == self.token_ids

    def verify_payload(self, object_index: int, payload: bytes | bytearray | memoryview) -> bool:
        """True if ``payload`` is the layer object ``object_index`` (1..num_layers) this manifest lists."""
        layer = object_layer(object_index, self.num_layers)
        digest = payload_digest(payload, self.digest_algorithm)
        return hmac.compare_digest(digest, self.payload_digests[layer])
