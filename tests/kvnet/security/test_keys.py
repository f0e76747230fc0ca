"""kvnet.security.keys: the one Ed25519 key implementation behind signers and token issuers."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest

from kvnet.security import keys, signing
from kvnet.security import tokens as auth


def test_key_id_is_sha256_of_raw_public_key() -> None:
    priv = keys.generate_private_key()
    raw = keys.raw_public_key(priv.public_key())
    assert len(raw) == keys.RAW_PUBLIC_KEY_LEN
    assert keys.key_id(priv.public_key()) == keys.key_id(raw) == hashlib.sha256(raw).digest()
    with pytest.raises(keys.KeyMaterialError):
        keys.key_id(raw[:31])


def test_private_key_file_is_0600_and_never_replaced(tmp_path: Path) -> None:
    path = tmp_path / "k.key"
    priv = keys.generate_private_key()
    keys.save_private_key(path, priv)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    other = keys.generate_private_key()
    with pytest.raises(FileExistsError):
        keys.save_private_key(path, other)
    assert keys.key_id(keys.load_private_key(path).public_key()) == keys.key_id(priv.public_key())
    # Overwriting on request also resets a looser mode.
    os.chmod(path, 0o644)
    keys.save_private_key(path, other, overwrite=True)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert keys.key_id(keys.load_private_key(path).public_key()) == keys.key_id(other.public_key())


def test_public_key_round_trip_and_private_only_when_allowed(tmp_path: Path) -> None:
    priv = keys.generate_private_key()
    keys.save_public_key(tmp_path / "k.pub", priv.public_key())
    loaded = keys.load_public_key(tmp_path / "k.pub")
    assert keys.raw_public_key(loaded) == keys.raw_public_key(priv.public_key())
    keys.save_private_key(tmp_path / "k.key", priv)
    with pytest.raises(keys.KeyMaterialError):
        keys.load_public_key(tmp_path / "k.key")
    half = keys.load_public_key(tmp_path / "k.key", allow_private=True)
    assert keys.raw_public_key(half) == keys.raw_public_key(priv.public_key())


def test_garbage_and_wrong_key_types_raise_key_material_error(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives.asymmetric import ec

    with pytest.raises(keys.KeyMaterialError):
        keys.private_key_from_pem(b"-----BEGIN PRIVATE KEY-----\nnope\n-----END PRIVATE KEY-----\n")
    with pytest.raises(keys.KeyMaterialError):
        keys.public_key_from_pem(b"not pem")
    ec_key = ec.generate_private_key(ec.SECP256R1())
    from cryptography.hazmat.primitives import serialization

    pem = ec_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    with pytest.raises(keys.KeyMaterialError, match="Ed25519"):
        keys.private_key_from_pem(pem)
    (tmp_path / "ec.key").write_bytes(pem)
    with pytest.raises(keys.KeyMaterialError, match=r"ec\.key"):
        keys.load_private_key(tmp_path / "ec.key")


def test_signers_and_issuers_share_key_files_and_ids(tmp_path: Path) -> None:
    """A key written by one module reads back identically through the other: one implementation."""
    paths = signing.generate_keypair(tmp_path, "pub")
    issuer = auth.IssuerKey.load(paths.private)
    assert issuer.key_id == paths.key_id == signing.key_id(signing.load_public_key(paths.public))
    assert auth.issuer_key_id(auth.load_issuer_public_key(paths.public)) == paths.key_id
    issuer.save(tmp_path / "issuer.key")
    assert signing.load_signer(tmp_path / "issuer.key").key_id == issuer.key_id
