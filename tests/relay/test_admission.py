"""relay/admission.py: only complete block tracks signed by a trusted key pass; other tracks are not its
business."""

from __future__ import annotations

import secrets

import pytest

from kvnet.blocks.signing import Signer, TrustStore
from proto.kvobject import BlockManifest, block_track
from relay.admission import BlockAdmission
from relay.cache import CachedObject, TrackKey

SHAPE = (2, 4, 1, 8)
FINGERPRINT = secrets.token_bytes(32)


def signed_block(signer: Signer) -> tuple[TrackKey, list[CachedObject]]:
    payloads = [secrets.token_bytes(64) for _ in range(SHAPE[0])]
    block_hash = secrets.token_bytes(32)
    manifest = BlockManifest.for_payloads(
        fingerprint=FINGERPRINT,
        block_hash=block_hash,
        parent_hash=secrets.token_bytes(32),
        token_ids=list(range(SHAPE[1])),
        block_index=0,
        codec="lossless",
        dtype="float32",
        shape=SHAPE,
        payloads=payloads,
        key_id=signer.key_id,
    )
    manifest = manifest.with_signature(signer.sign_manifest(manifest))
    objects = [CachedObject(0, 0, i, 0, 0, (), p) for i, p in enumerate([manifest.encode(), *payloads])]
    end_of_track = CachedObject(0, 0, len(objects), 0, 3, (), b"")
    return block_track(FINGERPRINT, "default", block_hash, "lossless"), [*objects, end_of_track]


@pytest.fixture
def trusted() -> Signer:
    return Signer.generate()


@pytest.fixture
def admission(trusted: Signer) -> BlockAdmission:
    trust = TrustStore()
    trust.add(trusted.public_key)
    return BlockAdmission(trust)


def test_complete_trusted_block_is_admitted(admission: BlockAdmission, trusted: Signer) -> None:
    key, objects = signed_block(trusted)
    assert admission.is_block_track(key)
    assert admission.refusal(key, objects) is None


def test_untrusted_incomplete_altered_and_misnamed_blocks_are_refused(
    admission: BlockAdmission, trusted: Signer
) -> None:
    key, objects = signed_block(Signer.generate())
    assert "signature not from a trusted key" in (admission.refusal(key, objects) or "")
    key, objects = signed_block(trusted)
    assert admission.refusal(key, []) == "incomplete: no manifest"
    assert admission.refusal(key, objects[:2]) == "incomplete: 1 of 2 layer objects"
    layer = objects[1]
    flipped = CachedObject(0, 0, 1, 0, 0, (), bytes([layer.payload[0] ^ 1]) + layer.payload[1:])
    assert admission.refusal(key, [objects[0], flipped, *objects[2:]]) == "payload digest of layer 0 differs"
    other_key, _ = signed_block(trusted)
    assert admission.refusal(other_key, objects) == "block hash differs from the track name"
    assert (admission.refusal(key, [objects[0], CachedObject(0, 0, 0, 0, 0, (), b"x")]) or "").startswith(
        "unexpected"
    )


def test_tracks_that_are_not_blocks_are_admitted(admission: BlockAdmission) -> None:
    key = ((b"live", b"chat"), b"room-1")
    assert not admission.is_block_track(key)
    assert admission.refusal(key, [CachedObject(0, 0, 0, 0, 0, (), b"anything")]) is None


def test_an_empty_trust_set_is_a_configuration_error() -> None:
    with pytest.raises(ValueError, match="at least one publisher key"):
        BlockAdmission(TrustStore())
