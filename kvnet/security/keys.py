"""Ed25519 key material: the one implementation behind publisher signing keys and token issuer keys.

Owns: generating keys, raw public key bytes, key ids, and PEM files. ``kvnet.security.signing`` (manifest
signers and the subscriber trust store) and ``kvnet.security.tokens`` (authorization token issuers) both
build on it, so a key id or a key file means the same thing everywhere. It knows nothing about what the
keys sign.

Files (PEM, so standard tools read them)::

    private key   PKCS#8, unencrypted, mode 0600 from creation on; an existing file is never replaced
                  unless the caller asks for it
    public key    SubjectPublicKeyInfo

Key id: SHA-256 of the 32 raw public key bytes (32 bytes). It names a key inside manifests and tokens, so
a verifier looks the key up in O(1) instead of trying every key it trusts.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path
from typing import Final

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

__all__ = [
    "KEY_ID_LEN",
    "RAW_PUBLIC_KEY_LEN",
    "KeyMaterialError",
    "generate_private_key",
    "key_id",
    "load_private_key",
    "load_public_key",
    "private_key_from_pem",
    "private_key_pem",
    "public_key_from_pem",
    "public_key_pem",
    "raw_public_key",
    "save_private_key",
    "save_public_key",
]

KEY_ID_LEN: Final = 32
RAW_PUBLIC_KEY_LEN: Final = 32


class KeyMaterialError(ValueError):
    """Bytes or a file that are not the Ed25519 key they should be (wrong type, not PEM, wrong length)."""


def generate_private_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def raw_public_key(public_key: Ed25519PublicKey) -> bytes:
    """The 32 raw bytes of an Ed25519 public key (RFC 8032 encoding)."""
    return public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_id(public_key: Ed25519PublicKey | bytes) -> bytes:
    """SHA-256 of the raw 32-byte public key; ``public_key`` may be the key or its raw bytes."""
    raw = public_key if isinstance(public_key, bytes) else raw_public_key(public_key)
    if len(raw) != RAW_PUBLIC_KEY_LEN:
        raise KeyMaterialError(f"an Ed25519 public key has {RAW_PUBLIC_KEY_LEN} raw bytes, got {len(raw)}")
    return hashlib.sha256(raw).digest()


def private_key_pem(private_key: Ed25519PrivateKey) -> bytes:
    return private_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def public_key_pem(public_key: Ed25519PublicKey) -> bytes:
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    return public_key.public_bytes(serialization.Encoding.PEM, spki)


def private_key_from_pem(data: bytes) -> Ed25519PrivateKey:
    """Parse an unencrypted PKCS#8 PEM Ed25519 private key."""
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise KeyMaterialError(f"not an unencrypted PEM private key: {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyMaterialError("not an Ed25519 private key")
    return key


def public_key_from_pem(data: bytes, *, allow_private: bool = False) -> Ed25519PublicKey:
    """Parse a PEM Ed25519 public key; with ``allow_private``, a private key PEM yields its public half."""
    if allow_private and b"PRIVATE KEY" in data:
        return private_key_from_pem(data).public_key()
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as exc:
        raise KeyMaterialError(f"not a PEM public key: {exc}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise KeyMaterialError("not an Ed25519 public key")
    return key


def _write_new_file(path: Path, data: bytes, mode: int, overwrite: bool) -> None:
    """Write ``data`` to a private temporary file beside ``path`` (``mode`` from creation on), then put it
    in place in one step: a reader sees the whole file or none. Without ``overwrite`` the link fails with
    ``FileExistsError`` when ``path`` exists, so of two processes creating one key exactly one wins."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            if overwrite:
                os.replace(tmp, path)
            else:
                os.link(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    except OSError as exc:
        # Name the file the caller asked for: the temporary name means nothing to whoever reads the error.
        raise OSError(exc.errno, exc.strerror, str(path)) from None


def save_private_key(path: Path | str, private_key: Ed25519PrivateKey, overwrite: bool = False) -> None:
    """Write ``private_key`` as PEM with mode 0600 from creation on (never readable by others, not even
    briefly), atomically. Raises ``FileExistsError`` if ``path`` exists and ``overwrite`` is false."""
    _write_new_file(Path(path), private_key_pem(private_key), 0o600, overwrite)


def save_public_key(path: Path | str, public_key: Ed25519PublicKey) -> None:
    _write_new_file(Path(path), public_key_pem(public_key), 0o644, overwrite=True)


def load_private_key(path: Path | str) -> Ed25519PrivateKey:
    """Read a PEM private key file; ``KeyMaterialError`` names the file when it is not one."""
    data = Path(path).read_bytes()
    try:
        return private_key_from_pem(data)
    except KeyMaterialError as exc:
        raise KeyMaterialError(f"{path}: {exc}") from None


def load_public_key(path: Path | str, *, allow_private: bool = False) -> Ed25519PublicKey:
    """Read a PEM public key file (see ``public_key_from_pem``)."""
    data = Path(path).read_bytes()
    try:
        return public_key_from_pem(data, allow_private=allow_private)
    except KeyMaterialError as exc:
        raise KeyMaterialError(f"{path}: {exc}") from None
