"""Tests for kvnet.security.tenancy: salt and namespace-id derivation, node secret files."""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kvnet.cache.hashing import root_hash
from kvnet.security.tenancy import (
    MAX_SECRET_LEN,
    MIN_SECRET_LEN,
    NAMESPACE_ID_LEN,
    NodeSecret,
    TenancyError,
    derive_tenant_salt,
    tenant_namespace_id,
)
from proto.kvobject import block_namespace

SECRET = bytes(range(32))
OTHER_SECRET = bytes(range(1, 33))
REPO = Path(__file__).resolve().parents[3]


def test_salts_differ_per_tenant_and_secret() -> None:
    a = derive_tenant_salt(SECRET, "tenantA")
    assert len(a) == 32
    assert a == derive_tenant_salt(SECRET, "tenantA")
    assert a != derive_tenant_salt(SECRET, "tenantB")
    assert a != derive_tenant_salt(OTHER_SECRET, "tenantA")
    fp = bytes(32)
    assert root_hash(fp, a) != root_hash(fp, derive_tenant_salt(SECRET, "tenantB"))


def test_salt_is_not_the_tenant_id_or_namespace_id() -> None:
    salt = derive_tenant_salt(SECRET, "tenantA")
    ns_id = tenant_namespace_id(SECRET, "tenantA")
    assert salt != b"tenantA"
    assert bytes.fromhex(ns_id[1:]) != salt[:16]
    # Documented construction, so other implementations can derive the same values.
    msg = b"kvnet/tenant-salt/v1\x00" + len(b"tenantA").to_bytes(4, "big") + b"tenantA"
    assert salt == hmac.new(SECRET, msg, hashlib.sha256).digest()


def test_length_prefix_separates_tenant_ids() -> None:
    # Without a length prefix these would be one message under some encodings.
    assert derive_tenant_salt(SECRET, "ab") != derive_tenant_salt(SECRET, "a\x00b")
    assert derive_tenant_salt(SECRET, "é") != derive_tenant_salt(SECRET, "e\u0301")


def test_namespace_id_fits_block_namespace() -> None:
    ns_id = tenant_namespace_id(SECRET, "Acme Corp / prod")
    assert len(ns_id) == NAMESPACE_ID_LEN
    assert ns_id == tenant_namespace_id(SECRET, "Acme Corp / prod")
    assert ns_id != tenant_namespace_id(SECRET, "Acme Corp / dev")
    assert ns_id != tenant_namespace_id(OTHER_SECRET, "Acme Corp / prod")
    assert "Acme" not in ns_id
    assert block_namespace(bytes(32), ns_id)[3] == ns_id.encode()


def test_deterministic_across_processes() -> None:
    code = (
        "from kvnet.security.tenancy import derive_tenant_salt, tenant_namespace_id;"
        f"s = {SECRET!r};"
        "print(derive_tenant_salt(s, 'tenantA').hex(), tenant_namespace_id(s, 'tenantA'))"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         check=True, timeout=60).stdout.split()
    assert out == [derive_tenant_salt(SECRET, "tenantA").hex(), tenant_namespace_id(SECRET, "tenantA")]


@pytest.mark.parametrize("secret", [b"", b"x" * (MIN_SECRET_LEN - 1), b"x" * (MAX_SECRET_LEN + 1)])
def test_secret_length_validated(secret: bytes) -> None:
    with pytest.raises(TenancyError):
        derive_tenant_salt(secret, "t")
    with pytest.raises(TenancyError):
        NodeSecret(secret)


@pytest.mark.parametrize("tenant", ["", "x" * 257, "\ud800"])
def test_tenant_id_validated(tenant: str) -> None:
    with pytest.raises(TenancyError):
        derive_tenant_salt(SECRET, tenant)


def test_generate_and_load(tmp_path: Path) -> None:
    path = tmp_path / "node.secret"
    secret = NodeSecret.generate(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(secret.value) == MIN_SECRET_LEN
    assert secret.value.hex() not in repr(secret)
    loaded = NodeSecret.load(path)
    assert loaded == secret
    assert loaded.tenant_salt("t") == derive_tenant_salt(secret.value, "t")
    assert loaded.namespace_id("t") == tenant_namespace_id(secret.value, "t")
    with pytest.raises(TenancyError):
        NodeSecret.generate(path)
    assert NodeSecret.generate(path, length=64, overwrite=True) != secret
    assert len(NodeSecret.load(path).value) == 64


def test_load_refuses_readable_file(tmp_path: Path) -> None:
    path = tmp_path / "node.secret"
    NodeSecret.generate(path)
    path.chmod(0o644)
    with pytest.raises(TenancyError, match="chmod 600"):
        NodeSecret.load(path)


@pytest.mark.parametrize(
    "content",
    [b"", b"zz" * 32, b"ab" * 31, b"ab" * 65, b"ab" * 16 + b" " + b"ab" * 16, b"abc" * 21, b"\xff" * 64],
)
def test_load_rejects_bad_contents(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "node.secret"
    path.write_bytes(content)
    path.chmod(0o600)
    with pytest.raises(TenancyError):
        NodeSecret.load(path)


def test_load_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TenancyError):
        NodeSecret.load(tmp_path / "absent")
