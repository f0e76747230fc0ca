"""Ed25519 signing of KV block manifests and the trust store of accepted publisher keys.

Owns: generating, saving and loading publisher keys; key ids; signing the bytes a manifest defines as signed
(``BlockManifest.signing_bytes()``); checking a signature against a set of trusted public keys.

A shared KV cache is only as trustworthy as whoever may publish into it: anyone who can publish a block for a
hash decides what every subscriber computes. So subscribers accept a block only when its manifest is signed by
a key in their trust store. This module knows nothing about the manifest's layout, the network or the model:
it signs and verifies byte strings and names keys.

Key files and key ids are ``kvnet.security.keys``'s (shared with token issuers)::

    NAME.key   Ed25519 private key, PKCS#8, unencrypted, mode 0600
    NAME.pub   Ed25519 public key, SubjectPublicKeyInfo

Key id: SHA-256 of the 32 raw public key bytes. It names the signer inside manifests, so a verifier looks
the key up in O(1) instead of trying every trusted key.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from kvnet.security import keys

KEY_ID_LEN = keys.KEY_ID_LEN
SIGNATURE_LEN = 64
PRIVATE_SUFFIX = ".key"
PUBLIC_SUFFIX = ".pub"


class SigningError(Exception):
    """A key cannot be created, read or used (missing file, wrong key type, bad name)."""


class SupportsSigningBytes(Protocol):
    """Anything with a canonical byte string to sign (the KV block manifest)."""

    def signing_bytes(self) -> bytes: ...


def key_id(pub: Ed25519PublicKey | bytes) -> bytes:
    """SHA-256 of the raw 32-byte public key (``kvnet.security.keys.key_id``)."""
    try:
        return keys.key_id(pub)
    except keys.KeyMaterialError as exc:
        raise SigningError(str(exc)) from None


@dataclass(frozen=True)
class Signer:
    """A publisher's private key, ready to sign manifests."""

    private_key: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> Signer:
        return cls(keys.generate_private_key())

    @property
    def public_key(self) -> Ed25519PublicKey:
        return self.private_key.public_key()

    @property
    def public_raw(self) -> bytes:
        return keys.raw_public_key(self.public_key)

    @property
    def key_id(self) -> bytes:
        return key_id(self.public_key)

    def sign(self, data: bytes) -> bytes:
        return self.private_key.sign(data)

    def sign_manifest(self, manifest: SupportsSigningBytes) -> bytes:
        """Signature over the manifest's canonical signing bytes (64 bytes)."""
        return self.sign(manifest.signing_bytes())


@dataclass(frozen=True, slots=True)
class KeyPaths:
    """Where a generated key pair was written."""

    private: Path
    public: Path
    key_id: bytes


def generate_keypair(directory: Path | str, name: str = "publisher", overwrite: bool = False) -> KeyPaths:
    """Create ``NAME.key`` and ``NAME.pub`` in ``directory`` (created 0700 if missing)."""
    if not name or "/" in name or name.startswith(".") or len(name) > 64:
        raise SigningError(f"invalid key name {name!r}")
    d = Path(directory)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    signer = Signer.generate()
    priv, pub = d / f"{name}{PRIVATE_SUFFIX}", d / f"{name}{PUBLIC_SUFFIX}"
    if not overwrite and (priv.exists() or pub.exists()):
        raise SigningError(f"{priv} or {pub} already exists")
    try:
        keys.save_private_key(priv, signer.private_key, overwrite)
    except FileExistsError as exc:
        raise SigningError(f"{priv} already exists") from exc
    keys.save_public_key(pub, signer.public_key)
    return KeyPaths(private=priv, public=pub, key_id=signer.key_id)


def load_signer(path: Path | str) -> Signer:
    """Read an Ed25519 private key (PEM PKCS#8)."""
    try:
        return Signer(keys.load_private_key(path))
    except (OSError, keys.KeyMaterialError) as exc:
        raise SigningError(f"cannot read private key {path}: {exc}") from exc


def load_public_key(path: Path | str) -> Ed25519PublicKey:
    """Read an Ed25519 public key (PEM SPKI; a private key file yields its public half)."""
    try:
        return keys.load_public_key(path, allow_private=True)
    except (OSError, keys.KeyMaterialError) as exc:
        raise SigningError(f"cannot read public key {path}: {exc}") from exc


@dataclass
class TrustStore:
    """Public keys whose signatures a subscriber accepts, indexed by key id."""

    _keys: dict[bytes, Ed25519PublicKey] = field(default_factory=dict)

    def add(self, pub: Ed25519PublicKey) -> bytes:
        kid = key_id(pub)
        self._keys[kid] = pub
        return kid

    def add_raw(self, raw: bytes) -> bytes:
        return self.add(Ed25519PublicKey.from_public_bytes(raw))

    def add_file(self, path: Path | str) -> bytes:
        return self.add(load_public_key(path))

    def add_path(self, path: Path | str) -> list[bytes]:
        """Trust one key file, or every ``*.pub`` file in a directory."""
        p = Path(path)
        if p.is_dir():
            return [self.add_file(f) for f in sorted(p.glob(f"*{PUBLIC_SUFFIX}"))]
        return [self.add_file(p)]

    @classmethod
    def from_paths(cls, paths: Iterable[Path | str]) -> TrustStore:
        store = cls()
        for p in paths:
            store.add_path(p)
        return store

    def __contains__(self, kid: object) -> bool:
        return kid in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def key_ids(self) -> list[bytes]:
        return list(self._keys)

    def verify(self, kid: bytes, data: bytes, signature: bytes) -> bool:
        """True only when ``kid`` is trusted and ``signature`` is its valid signature over ``data``."""
        pub = self._keys.get(bytes(kid))
        if pub is None or len(signature) != SIGNATURE_LEN:
            return False
        try:
            pub.verify(bytes(signature), data)
        except InvalidSignature:
            return False
        return True

    def verify_manifest(self, manifest: SupportsSigningBytes, kid: bytes, signature: bytes) -> bool:
        return self.verify(kid, manifest.signing_bytes(), signature)
