"""Which kvnet block tracks a relay admits to its cache: only complete ones signed by a trusted publisher.

Owns: ``BlockAdmission``, a sans-I/O check over a track's objects, used when the relay is given a trust set
(``--trust``: publisher public keys). A block track (``proto.kvobject`` naming) is admitted only when its
manifest is signed by a trusted key, names the track's fingerprint, block hash and rendition, and every
layer object is present with the digest the manifest lists. Anything else (an empty or incomplete track, a
forgery, an untrusted key) never enters the cache, so it can neither be served from it nor keep a trusted
copy out (SECURITY.md "Sharing an attacker cannot squat"). Tracks that are not kvnet block tracks are not
this check's business and are admitted as before.

A tables track (``tables.<digest>``, KVOBJECT.md 2.3: the decoder tables kvtc blocks name) is admitted
only when its objects join into a table object whose body hashes to the digest in its name, whose model
fingerprint is the namespace's, and whose signature verifies under a trusted key: a squatter's copy under
that name would otherwise keep every subscriber from decoding the publisher's kvtc blocks.

Before the signature, the manifest must be consistent in itself: its block hash is the chain hash of its
parent hash and token ids (``kvnet.cache.hashing.hash_block``, one SHA-256; no tokenizer or model needed).
A trusted key that signs a manifest whose block hash is not its own could otherwise take any block's track
name, be cached first and keep the honest copy out; subscribers recheck all of it.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvnet.cache.hashing import hash_block
from kvnet.security.signing import TrustStore
from proto.data import ObjectStatus
from proto.kvobject import (
    BLOCK_GROUP_ID,
    MANIFEST_OBJECT_ID,
    MAX_TABLES_BYTES,
    BlockManifest,
    KVObjectError,
    TablesTrack,
    parse_block_track,
    parse_tables_track,
    split_signed_tables,
)
from relay.cache import CachedObject, TrackKey


class BlockAdmission:
    """Checks complete block tracks against the relay's trust set before they are cached."""

    def __init__(self, trust: TrustStore) -> None:
        if not len(trust):
            raise ValueError("a trust set needs at least one publisher key")
        self.trust = trust

    @staticmethod
    def checks(key: TrackKey) -> bool:
        """Whether the track must pass this check before it is cached: a kvnet block or tables track."""
        for parse in (parse_block_track, parse_tables_track):
            try:
                parse(key[0], key[1])
            except KVObjectError:
                continue
            return True
        return False

    def refusal(self, key: TrackKey, objects: Sequence[CachedObject]) -> str | None:
        """Why the track's ``objects`` must not be cached, or None to admit them."""
        try:
            track = parse_block_track(key[0], key[1])
        except KVObjectError:
            try:
                return self._tables_refusal(parse_tables_track(key[0], key[1]), objects)
            except KVObjectError:
                return None  # not a kvnet track
        payloads: dict[int, bytes] = {}
        for obj in objects:
            if obj.status != ObjectStatus.NORMAL:
                continue  # END_OF_TRACK and other markers carry nothing
            if obj.group != BLOCK_GROUP_ID or obj.object_id in payloads:
                return f"unexpected object {obj.group}/{obj.object_id}"
            payloads[obj.object_id] = obj.payload
        data = payloads.get(MANIFEST_OBJECT_ID)
        if data is None:
            return "incomplete: no manifest"
        try:
            manifest = BlockManifest.decode(data)
        except KVObjectError as exc:
            return f"malformed manifest: {exc}"
        try:
            chained = hash_block(manifest.parent_hash, manifest.token_ids)
        except ValueError as exc:
            return f"malformed manifest: {exc}"
        if chained != manifest.block_hash:
            return "chain: block hash is not the hash of the manifest's parent hash and token ids"
        if not manifest.signature or not self.trust.verify_manifest(
            manifest, manifest.key_id, manifest.signature
        ):
            return f"signature not from a trusted key (key id {manifest.key_id.hex()[:16]})"
        if manifest.fingerprint != track.fingerprint:
            return "model fingerprint differs from the track's namespace"
        if manifest.block_hash != track.block_hash:
            return "block hash differs from the track name"
        if manifest.codec != track.rendition:
            return f"codec {manifest.codec} differs from the track's rendition {track.rendition}"
        layers = manifest.num_layers
        if sorted(payloads) != list(range(layers + 1)):
            return f"incomplete: {len(payloads) - 1} of {layers} layer objects"
        for object_id in range(1, layers + 1):
            if not manifest.verify_payload(object_id, payloads[object_id]):
                return f"payload digest of layer {object_id - 1} differs"
        return None

    def _tables_refusal(self, track: TablesTrack, objects: Sequence[CachedObject]) -> str | None:
        parts: list[bytes] = []
        size = 0
        for obj in objects:
            if obj.status != ObjectStatus.NORMAL:
                continue
            if obj.group != BLOCK_GROUP_ID or obj.object_id != len(parts):
                return f"unexpected tables object {obj.group}/{obj.object_id}"
            size += len(obj.payload)
            if size > MAX_TABLES_BYTES:
                return f"tables larger than {MAX_TABLES_BYTES} bytes"
            parts.append(obj.payload)
        try:
            signed = split_signed_tables(b"".join(parts))
        except KVObjectError as exc:
            return f"malformed tables: {exc}"
        if signed.digest != track.digest:
            return "tables digest differs from the track name"
        if signed.fingerprint != track.fingerprint:
            return "model fingerprint differs from the track's namespace"
        if not self.trust.verify(signed.key_id, signed.signing_bytes(), signed.signature):
            return f"signature not from a trusted key (key id {signed.key_id.hex()[:16]})"
        return None
