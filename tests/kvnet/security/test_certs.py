"""Tests for kvnet.security.certs and the `kvnet certs` command."""

from __future__ import annotations

import ipaddress
import ssl
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from kvnet.cli import main
from kvnet.security import certs


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_ca_and_leaf_files_and_modes(tmp_path: Path) -> None:
    ca = certs.create_ca(tmp_path)
    issued = certs.issue_cert(tmp_path, "relay", ["localhost", "127.0.0.1", "::1"])
    assert _mode(ca.key) == 0o600
    assert _mode(issued.key) == 0o600
    chain = x509.load_pem_x509_certificates(issued.cert.read_bytes())
    assert len(chain) == 2
    leaf, ca_cert = chain
    assert ca_cert.subject == x509.load_pem_x509_certificate(ca.cert.read_bytes()).subject
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert set(san.get_values_for_type(x509.IPAddress)) == {
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("::1"),
    }
    eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in eku and ExtendedKeyUsageOID.CLIENT_AUTH in eku
    assert leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    leaf.verify_directly_issued_by(ca_cert)


def test_leaf_verifies_with_stdlib_tls(tmp_path: Path) -> None:
    # The stdlib verifier is strict about extensions; if it accepts the chain, TLS stacks will.
    certs.create_ca(tmp_path)
    issued = certs.issue_cert(tmp_path, "srv", ["localhost"])
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(issued.cert, issued.key)
    client_ctx = ssl.create_default_context(cafile=str(issued.ca))
    client_ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    client = client_ctx.wrap_bio(c_in, c_out, server_hostname="localhost")
    server = server_ctx.wrap_bio(s_in, s_out, server_side=True)
    done = {"c": False, "s": False}
    for _ in range(10):
        for name, obj in (("c", client), ("s", server)):
            if not done[name]:
                try:
                    obj.do_handshake()
                    done[name] = True
                except ssl.SSLWantReadError:
                    pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if all(done.values()):
            break
    assert all(done.values())
    assert client.version() == "TLSv1.3"


def test_refuses_overwrite_and_bad_input(tmp_path: Path) -> None:
    certs.create_ca(tmp_path)
    with pytest.raises(FileExistsError) as existing:
        certs.create_ca(tmp_path)
    assert existing.value.filename == str(tmp_path / "ca.pem")
    certs.create_ca(tmp_path, overwrite=True)
    with pytest.raises(certs.CertError, match="invalid certificate name"):
        certs.issue_cert(tmp_path, "../evil", ["localhost"])
    with pytest.raises(certs.CertError, match="invalid host"):
        certs.issue_cert(tmp_path, "x", ["bad host!"])
    with pytest.raises(certs.CertError, match="at least one host"):
        certs.issue_cert(tmp_path, "x", [])
    with pytest.raises(certs.CertError, match="no CA"):
        certs.issue_cert(tmp_path / "empty", "x", ["localhost"])
    with pytest.raises(certs.CertError, match="valid_days"):
        certs.issue_cert(tmp_path, "x", ["localhost"], valid_days=0)


def test_cli_init_issue_show(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "pki"
    assert main(["certs", "init", "--dir", str(d)]) == 0
    assert main(["certs", "issue", "--dir", str(d), "--name", "relay", "--host", "localhost",
                 "--host", "127.0.0.1"]) == 0
    assert (d / "relay.pem").is_file() and _mode(d / "relay-key.pem") == 0o600
    capsys.readouterr()
    assert main(["certs", "show", str(d / "relay.pem")]) == 0
    out = capsys.readouterr().out
    assert "CN=relay" in out and "127.0.0.1" in out
    # A second init without --force is a clear error, not a traceback.
    assert main(["certs", "init", "--dir", str(d)]) == 2
    assert capsys.readouterr().err == f"kvnet: error: {d / 'ca.pem'} already exists (--force replaces it)\n"
