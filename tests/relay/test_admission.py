"""relay/admission.py: only complete, self-consistent block tracks signed by a trusted key pass; other
tracks are not its business. And against a real relay: a trusted key's inconsistent manifest pushed first
does not keep the honest copy out."""

from __future__ import annotations

import itertools
import secrets
from pathlib import Path

import pytest
import torch

from kvnet.blocks.transform_tables import calibrate, sign_tables
from kvnet.cache.hashing import hash_block
from kvnet.net.connection import MoqtConnection
from kvnet.security.keys import save_public_key
from kvnet.security.signing import Signer, TrustStore
from proto.data import ObjectStatus
from proto.kvobject import BlockManifest, block_track, parse_block_track, tables_track
from proto.messages import Location
from relay.admission import BlockAdmission
from relay.cache import CachedObject, TrackKey
from tests.helpers.processes import CertDir
from tests.relay.conftest import InProcessRelays
from tests.relay.peers import connect_client

SHAPE = (2, 4, 1, 8)
FINGERPRINT = secrets.token_bytes(32)


def signed_block(
    signer: Signer, token_ids: tuple[int, ...] = tuple(range(SHAPE[1])), named: bytes | None = None,
    parent: bytes | None = None,
) -> tuple[TrackKey, list[CachedObject]]:
    """A complete block track signed by ``signer``; its block hash is the chain hash of a parent and
    ``token_ids``, unless ``named`` gives the hash it claims (and the track is named by)."""
    payloads = [secrets.token_bytes(64) for _ in range(SHAPE[0])]
    parent_hash = parent or secrets.token_bytes(32)
    block_hash = named or hash_block(parent_hash, token_ids)
    manifest = BlockManifest.for_payloads(
        fingerprint=FINGERPRINT,
        block_hash=block_hash,
        parent_hash=parent_hash,
        token_ids=list(token_ids),
        block_index=0,
        codec="lossless",
        dtype="float32",
        shape=SHAPE,
        payloads=payloads,
        key_id=signer.key_id,
    )
    manifest = manifest.with_signature(signer.sign_manifest(manifest))
    objects = [CachedObject(0, 0, i, 0, 0, (), p) for i, p in enumerate([manifest.encode(), *payloads])]
    end_of_track = CachedObject(0, 0, len(objects), 0, ObjectStatus.END_OF_TRACK, (), b"")
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
    assert admission.checks(key)
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


def test_a_manifest_whose_block_hash_is_not_its_chain_hash_is_refused(
    admission: BlockAdmission, trusted: Signer
) -> None:
    honest_key, _ = signed_block(trusted)
    squat_hash = parse_block_track(*honest_key).block_hash
    # Signed by a trusted key, named for the honest block, but its parent and token ids hash elsewhere.
    key, objects = signed_block(trusted, token_ids=(9, 9, 9, 9), named=squat_hash)
    assert key == honest_key
    assert admission.refusal(key, objects) == (
        "chain: block hash is not the hash of the manifest's parent hash and token ids"
    )


def test_tracks_that_are_not_blocks_are_admitted(admission: BlockAdmission) -> None:
    key = ((b"live", b"chat"), b"room-1")
    assert not admission.checks(key)
    assert admission.refusal(key, [CachedObject(0, 0, 0, 0, 0, (), b"anything")]) is None


def signed_tables(signer: Signer, fingerprint: bytes = FINGERPRINT) -> tuple[bytes, bytes]:
    """A kvtc table object signed by ``signer`` and its digest (tables of a 2-layer, 1x8-head model)."""
    g = torch.Generator().manual_seed(3)
    k, v = (torch.randn(2, 64, 1, 8, generator=g) for _ in range(2))
    tables = calibrate(k, v, fingerprint)
    return sign_tables(tables, signer), tables.digest


def tables_objects(data: bytes, piece: int = 1000) -> list[CachedObject]:
    pieces = [data[i:i + piece] for i in range(0, len(data), piece)]
    objects = [CachedObject(0, 0, i, 0, 0, (), p) for i, p in enumerate(pieces)]
    return [*objects, CachedObject(0, 0, len(objects), 0, ObjectStatus.END_OF_TRACK, (), b"")]


def test_tables_tracks_are_admitted_only_signed_whole_and_named_by_their_digest(
    admission: BlockAdmission, trusted: Signer
) -> None:
    data, digest = signed_tables(trusted)
    key = tables_track(FINGERPRINT, "default", digest)
    objects = tables_objects(data)
    assert admission.checks(key) and len(objects) > 3
    assert admission.refusal(key, objects) is None
    stranger, _ = signed_tables(Signer.generate())
    assert "signature not from a trusted key" in (admission.refusal(key, tables_objects(stranger)) or "")
    assert admission.refusal(tables_track(FINGERPRINT, "default", bytes(32)), objects) == (
        "tables digest differs from the track name")
    other_model, other_digest = signed_tables(trusted, secrets.token_bytes(32))
    other_key = tables_track(FINGERPRINT, "default", other_digest)
    assert admission.refusal(other_key, tables_objects(other_model)) == (
        "model fingerprint differs from the track's namespace")
    assert (admission.refusal(key, objects[:2]) or "").startswith("malformed tables")
    assert admission.refusal(key, [objects[1], objects[0], *objects[2:]]) == "unexpected tables object 0/1"


def test_an_empty_trust_set_is_a_configuration_error() -> None:
    with pytest.raises(ValueError, match="at least one publisher key"):
        BlockAdmission(TrustStore())


async def push_ended_not_done(
    conn: MoqtConnection, alias: int, key: TrackKey, objects: list[CachedObject]
) -> None:
    """PUBLISH a whole block track (END_OF_TRACK and FIN) and leave the PUBLISH open (no PUBLISH_DONE)."""
    await conn.publish(key[0], key[1], alias)
    sid = conn.open_subgroup(alias, 0, 0)
    for obj in objects:
        end = obj.status == ObjectStatus.END_OF_TRACK
        conn.send_subgroup_object(sid, obj.object_id, obj.payload, (), ObjectStatus(obj.status), end)
    await conn.wait_stream_sent(sid)


async def test_a_trusted_keys_inconsistent_manifest_first_does_not_keep_the_honest_copy_out(
    cert_dir: CertDir, in_process_relays: InProcessRelays, tmp_path: Path
) -> None:
    signer = Signer.generate()
    save_public_key(tmp_path / "publisher.pub", signer.public_key)
    rp = await in_process_relays("--trust", str(tmp_path / "publisher.pub"))
    parent = secrets.token_bytes(32)
    key, honest = signed_block(signer, parent=parent)
    squat_hash = parse_block_track(*key).block_hash
    _, squat = signed_block(signer, token_ids=(7, 7, 7, 7), named=squat_hash, parent=parent)
    squatter = await connect_client(rp.url, str(cert_dir.ca))
    publisher = await connect_client(rp.url, str(cert_dir.ca))
    aliases = itertools.count(1)
    try:
        await push_ended_not_done(squatter, next(aliases), key, squat)
        await rp.wait_value("blocks_refused_total", 1, reason="chain")
        await push_ended_not_done(publisher, next(aliases), key, honest)
        await rp.wait_value("cache_tracks", 1)
        fetch = await squatter.fetch(key[0], key[1], Location(0, 0), Location(0, len(honest) - 1))
        got = [o.payload for o in await fetch.read_all()]
        assert got == [o.payload for o in honest[:-1]]  # the honest copy, manifest first
    finally:
        for conn in (squatter, publisher):
            await conn.close_session()
