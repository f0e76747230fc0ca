"""Tests for kvnet/security/signing.py: key files, key ids, manifest signatures and the trust store."""

from __future__ import annotations

import hashlib
import stat
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvnet.security import signing


@dataclass
class _Manifest:
    body: bytes

    def signing_bytes(self) -> bytes:
        return b"kvnet-manifest:" + self.body


def test_generate_and_load_roundtrip(tmp_path: Path) -> None:
    paths = signing.generate_keypair(tmp_path / "keys", "pub1")
    assert stat.S_IMODE(paths.private.stat().st_mode) == 0o600
    signer = signing.load_signer(paths.private)
    assert signer.key_id == paths.key_id
    assert signer.key_id == hashlib.sha256(signer.public_raw).digest()
    pub = signing.load_public_key(paths.public)
    assert signing.key_id(pub) == paths.key_id
    # A private key file also yields its public half (trusting one's own key).
    assert signing.key_id(signing.load_public_key(paths.private)) == paths.key_id


def test_generate_refuses_overwrite(tmp_path: Path) -> None:
    signing.generate_keypair(tmp_path, "a")
    with pytest.raises(signing.SigningError):
        signing.generate_keypair(tmp_path, "a")
    assert signing.generate_keypair(tmp_path, "a", overwrite=True).private.exists()
    with pytest.raises(signing.SigningError):
        signing.generate_keypair(tmp_path, "../evil")


def test_trusted_signature_verifies_and_tampering_fails() -> None:
    signer = signing.Signer.generate()
    store = signing.TrustStore()
    store.add(signer.public_key)
    m = _Manifest(b"block-0")
    sig = signer.sign_manifest(m)
    assert len(sig) == signing.SIGNATURE_LEN
    assert store.verify_manifest(m, signer.key_id, sig)
    assert not store.verify_manifest(_Manifest(b"block-1"), signer.key_id, sig)
    bad = bytes([sig[0] ^ 1]) + sig[1:]
    assert not store.verify_manifest(m, signer.key_id, bad)
    assert not store.verify_manifest(m, signer.key_id, sig[:-1])


def test_untrusted_key_is_rejected_even_with_valid_signature() -> None:
    trusted, stranger = signing.Signer.generate(), signing.Signer.generate()
    store = signing.TrustStore()
    store.add(trusted.public_key)
    m = _Manifest(b"x")
    assert not store.verify_manifest(m, stranger.key_id, stranger.sign_manifest(m))
    # Claiming the trusted key id with the stranger's signature fails too.
    assert not store.verify_manifest(m, trusted.key_id, stranger.sign_manifest(m))


def test_trust_store_from_directory(tmp_path: Path) -> None:
    a = signing.generate_keypair(tmp_path, "a")
    b = signing.generate_keypair(tmp_path, "b")
    store = signing.TrustStore.from_paths([tmp_path])
    assert len(store) == 2
    assert a.key_id in store and b.key_id in store


def test_load_rejects_non_ed25519(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    p = tmp_path / "ec.key"
    p.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    with pytest.raises(signing.SigningError):
        signing.load_signer(p)
    with pytest.raises(signing.SigningError):
        signing.load_signer(tmp_path / "missing.key")
