"""Tenant isolation material: the node secret, per-tenant cache salts and namespace ids.

A shared prefix cache leaks across tenants unless their block hashes never meet: vLLM folds a per-tenant
``cache_salt`` into the first block hash for that reason, and timing probes against a shared prefix cache
tell cached from uncached prefixes almost perfectly. So each tenant's chain root is salted, and the salt
is *derived* here from a secret held by the node operator and the tenant id established by
authentication (the token's tenant claim or the gateway), never taken from a client as-is: a client that
could choose its salt could choose another tenant's.

Derivations (HMAC-SHA256 keyed with the node secret; the label separates the two uses so that knowing a
namespace id tells nothing about the salt)::

    msg(label, tenant) = label || u32(len(tenant_utf8)) || tenant_utf8      (u32 big-endian)
    salt               = HMAC-SHA256(secret, msg(b"kvnet/tenant-salt/v1\\0", tenant))        32 bytes
    namespace id       = "t" + hex(HMAC-SHA256(secret, msg(b"kvnet/tenant-ns/v1\\0", tenant))[:16])

Both are deterministic: every node holding the same secret derives the same salt (so tenants share
blocks across nodes) and the same namespace id (so they meet in the same MoQT namespace), while relays,
which see namespaces but not the secret, learn neither the salt nor the tenant's name.

The node secret file holds the secret as hex (one line), mode 0600; loading refuses files that group or
others may read, as ssh does for private keys.

This module knows nothing about the network or the model: it returns bytes and strings.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

__all__ = [
    "MAX_SECRET_LEN",
    "MAX_TENANT_ID_BYTES",
    "MIN_SECRET_LEN",
    "NAMESPACE_ID_LEN",
    "NodeSecret",
    "TenancyError",
    "derive_tenant_salt",
    "tenant_namespace_id",
]

MIN_SECRET_LEN: Final = 32
"""Shortest node secret accepted (256 bits: HMAC-SHA256's full strength)."""
MAX_SECRET_LEN: Final = 64
"""Longest node secret accepted (HMAC-SHA256's block size; longer keys are hashed first anyway)."""
MAX_TENANT_ID_BYTES: Final = 256
"""Longest tenant id in UTF-8 bytes (the same bound as a token's tenant claim)."""
NAMESPACE_ID_LEN: Final = 33
"""Characters of a tenant namespace id: "t" + 32 lowercase hex digits (fits the 64-char field)."""

_SALT_LABEL: Final = b"kvnet/tenant-salt/v1\x00"
_NAMESPACE_LABEL: Final = b"kvnet/tenant-ns/v1\x00"
_HEX_RE: Final = re.compile(rb"[0-9a-fA-F]+")


class TenancyError(Exception):
    """A node secret or tenant id is unusable (wrong length, bad file, unsafe permissions)."""


def _check_secret(secret: bytes) -> bytes:
    if not isinstance(secret, bytes):
        raise TenancyError("node secret must be bytes")
    if not MIN_SECRET_LEN <= len(secret) <= MAX_SECRET_LEN:
        raise TenancyError(f"node secret must be {MIN_SECRET_LEN}..{MAX_SECRET_LEN} bytes, got {len(secret)}")
    return secret


def _message(label: bytes, tenant_id: str) -> bytes:
    if not isinstance(tenant_id, str) or not tenant_id:
        raise TenancyError("tenant id must be a non-empty string")
    try:
        raw = tenant_id.encode("utf-8")
    except UnicodeEncodeError:
        raise TenancyError("tenant id is not encodable as UTF-8") from None
    if len(raw) > MAX_TENANT_ID_BYTES:
        raise TenancyError(f"tenant id is longer than {MAX_TENANT_ID_BYTES} UTF-8 bytes")
    # Length prefix: no two (label, tenant) pairs share a message, whatever bytes the tenant id holds.
    return label + struct.pack(">I", len(raw)) + raw


def derive_tenant_salt(node_secret: bytes, tenant_id: str) -> bytes:
    """The 32-byte cache salt of ``tenant_id`` (for ``kvnet.cache.hashing.root_hash(fingerprint, salt)``)."""
    return hmac.new(_check_secret(node_secret), _message(_SALT_LABEL, tenant_id), hashlib.sha256).digest()


def tenant_namespace_id(node_secret: bytes, tenant_id: str) -> str:
    """The namespace-id field of block namespaces: a pseudonym that is stable across nodes sharing the secret.

    128 bits of an HMAC under a different label than the salt, so it reveals neither the salt, the
    secret nor the tenant's name, and two tenants collide with probability about 2^-128.
    """
    mac = hmac.new(_check_secret(node_secret), _message(_NAMESPACE_LABEL, tenant_id), hashlib.sha256)
    return "t" + mac.digest()[:16].hex()


@dataclass(frozen=True, slots=True)
class NodeSecret:
    """The operator's secret from which tenant salts and namespace ids derive."""

    value: bytes = field(repr=False)
    """The secret bytes; kept out of ``repr`` so that logs and tracebacks don't carry it."""

    def __post_init__(self) -> None:
        _check_secret(self.value)

    def __repr__(self) -> str:
        return f"NodeSecret(<{len(self.value)} bytes>)"

    @classmethod
    def generate(cls, path: Path | str, length: int = MIN_SECRET_LEN, overwrite: bool = False) -> NodeSecret:
        """Create a random secret and write it to ``path`` (mode 0600 from creation on)."""
        secret = cls(secrets.token_bytes(length))
        flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if overwrite else os.O_EXCL)
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError:
            raise TenancyError(f"{path} already exists") from None
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(secret.value.hex() + "\n")
        # O_TRUNC on an existing file keeps its old mode; force ours.
        os.chmod(path, 0o600)
        return secret

    @classmethod
    def load(cls, path: Path | str) -> NodeSecret:
        """Read a secret file written by ``generate``; refuses group/other-accessible files."""
        p = Path(path)
        try:
            mode = p.stat().st_mode
            if mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise TenancyError(f"{p} is accessible by group or others (mode {stat.S_IMODE(mode):o}); "
                                   "chmod 600 it")
            # Two hex digits per byte plus a line break; read one byte more to notice longer files
            # without reading an arbitrarily large one.
            limit = 2 * MAX_SECRET_LEN + 2
            with p.open("rb") as f:
                data = f.read(limit + 1)
        except OSError as exc:
            raise TenancyError(f"cannot read node secret {p}: {exc.strerror or exc}") from None
        text = data.strip()
        # fullmatch rather than bytes.fromhex alone: fromhex accepts inner whitespace.
        if len(data) > limit or not _HEX_RE.fullmatch(text) or len(text) % 2:
            raise TenancyError(f"{p} does not hold a hex-encoded secret of at most {MAX_SECRET_LEN} bytes")
        return cls(bytes.fromhex(text.decode("ascii")))

    def tenant_salt(self, tenant_id: str) -> bytes:
        return derive_tenant_salt(self.value, tenant_id)

    def namespace_id(self, tenant_id: str) -> str:
        return tenant_namespace_id(self.value, tenant_id)
