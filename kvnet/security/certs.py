"""Development certificate authority and leaf certificates for kvnet.

Owns: creating a private CA and issuing leaf certificates (server and client auth, so the same certificate
serves TLS servers and mTLS clients) as PEM files. Keys are ECDSA P-256, which every TLS 1.3 stack, aioquic
included, accepts for both CA and leaf signatures.

Layout of a certificate directory::

    DIR/ca.pem          CA certificate (give this to peers as ``ca_file``)
    DIR/ca-key.pem      CA private key (mode 0600)
    DIR/NAME.pem        leaf certificate followed by the CA certificate (a chain)
    DIR/NAME-key.pem    leaf private key (mode 0600)

This module knows nothing about QUIC; ``kvnet.net.config.TlsConfig`` names the files.
``check_tls_files`` lets a command refuse unusable ones at start-up, with a reason, rather than at the first
handshake.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvnet.errors import file_exists_error

CA_CERT_NAME = "ca.pem"
CA_KEY_NAME = "ca-key.pem"
# Names become file names: keep them to a safe alphabet so "../x" or "a/b" cannot escape the directory.
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
# A DNS label set per RFC 1123 (letters, digits, hyphens; optional leading wildcard label).
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_DNS_RE = re.compile(rf"^(\*\.)?{_LABEL}(\.{_LABEL})*$")
MAX_HOSTS = 100
MAX_VALID_DAYS = 3650


class CertError(Exception):
    """A certificate operation failed (bad name or host, missing CA); an existing file is FileExistsError."""


@dataclass(frozen=True, slots=True)
class CertPaths:
    """Where one certificate and its key were written."""

    cert: Path
    """PEM certificate (for a leaf: leaf then CA, a full chain)."""
    key: Path
    """PEM private key (PKCS#8, unencrypted, mode 0600)."""


@dataclass(frozen=True, slots=True)
class IssuedCert:
    """A leaf certificate in a directory, with the CA that signed it."""

    cert: Path
    key: Path
    ca: Path
    """The CA certificate that peers use to verify this one."""


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _write_private(path: Path, data: bytes, overwrite: bool) -> None:
    # O_EXCL + mode at creation: the key is never readable by others, not even for an instant.
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if overwrite else os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        raise file_exists_error(path) from None
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)


def _write_public(path: Path, data: bytes, overwrite: bool) -> None:
    if path.exists() and not overwrite:
        raise file_exists_error(path)
    path.write_bytes(data)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _check_days(valid_days: int) -> None:
    if not 1 <= valid_days <= MAX_VALID_DAYS:
        raise CertError(f"valid_days must be in 1..{MAX_VALID_DAYS}, got {valid_days}")


def parse_host(host: str) -> x509.GeneralName:
    """Turn a host string into a SAN entry: an IP address if it parses as one, else a DNS name."""
    host = host.strip()
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        pass
    if len(host) > 253 or not _DNS_RE.match(host):
        raise CertError(f"invalid host {host!r}: not an IP address or DNS name")
    return x509.DNSName(host.lower())


def create_ca(
    directory: Path | str,
    common_name: str = "kvnet development CA",
    valid_days: int = MAX_VALID_DAYS,
    overwrite: bool = False,
) -> CertPaths:
    """Create a CA key and self-signed certificate in ``directory`` (created 0700 if missing)."""
    _check_days(valid_days)
    d = Path(directory)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = _now()
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        # Backdate a little so peers with slightly skewed clocks accept a fresh certificate.
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=valid_days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ski, critical=False)
        .sign(key, hashes.SHA256())
    )
    paths = CertPaths(cert=d / CA_CERT_NAME, key=d / CA_KEY_NAME)
    if not overwrite:
        for p in (paths.cert, paths.key):
            if p.exists():
                raise file_exists_error(p)
    _write_private(paths.key, _key_pem(key), overwrite)
    _write_public(paths.cert, cert.public_bytes(serialization.Encoding.PEM), overwrite)
    return paths


def _load_ca(d: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert_path, key_path = d / CA_CERT_NAME, d / CA_KEY_NAME
    if not cert_path.is_file() or not key_path.is_file():
        raise CertError(f"no CA in {d}: run 'kvnet certs init --dir {d}' first")
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CertError(f"{key_path} is not an EC private key")
    return cert, key


def issue_cert(
    directory: Path | str,
    name: str,
    hosts: Sequence[str],
    valid_days: int = 825,
    overwrite: bool = False,
) -> IssuedCert:
    """Issue ``NAME.pem``/``NAME-key.pem`` signed by the CA in ``directory``.

    ``hosts`` are DNS names and IP addresses put in the subjectAltName (TLS clients check the server name
    against them). The certificate carries both serverAuth and clientAuth, so a node can use one certificate
    as a server and as an mTLS client.
    """
    if not _NAME_RE.match(name) or name in ("ca", "ca-key"):
        raise CertError(f"invalid certificate name {name!r}: use letters, digits, '_', '.', '-' (not 'ca')")
    if not hosts:
        raise CertError("at least one host is required")
    if len(hosts) > MAX_HOSTS:
        raise CertError(f"too many hosts ({len(hosts)} > {MAX_HOSTS})")
    _check_days(valid_days)
    d = Path(directory)
    ca_cert, ca_key = _load_ca(d)
    sans: list[x509.GeneralName] = []
    for h in hosts:
        san = parse_host(h)
        if san not in sans:
            sans.append(san)
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    not_after = min(now + datetime.timedelta(days=valid_days), ca_cert.not_valid_after_utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    cert_path, key_path = d / f"{name}.pem", d / f"{name}-key.pem"
    if not overwrite:
        for p in (cert_path, key_path):
            if p.exists():
                raise file_exists_error(p)
    _write_private(key_path, _key_pem(key), overwrite)
    chain = cert.public_bytes(serialization.Encoding.PEM) + ca_cert.public_bytes(serialization.Encoding.PEM)
    _write_public(cert_path, chain, overwrite)
    return IssuedCert(cert=cert_path, key=key_path, ca=d / CA_CERT_NAME)


def describe(cert_file: Path | str) -> str:
    """One line per certificate in a PEM file: subject, SANs, expiry (for `kvnet certs show`)."""
    lines = []
    try:
        certs = x509.load_pem_x509_certificates(Path(cert_file).read_bytes())
    except ValueError:
        raise CertError(f"{cert_file}: not a PEM certificate") from None
    for cert in certs:
        try:
            san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            hosts = [str(v) for v in san.get_values_for_type(x509.DNSName)] + [
                str(v) for v in san.get_values_for_type(x509.IPAddress)
            ]
        except x509.ExtensionNotFound:
            hosts = []
        lines.append(
            f"subject={cert.subject.rfc4514_string()} issuer={cert.issuer.rfc4514_string()} "
            f"hosts={','.join(hosts) or '-'} not_after={cert.not_valid_after_utc.isoformat()}"
        )
    return "\n".join(lines)


def _tls_reason(exc: Exception) -> str:
    if isinstance(exc, ssl.SSLError):
        if exc.reason is None and "PEM lib" in str(exc):
            # OpenSSL's only word for a file of the wrong kind, e.g. a certificate given as the key.
            return "not a PEM certificate chain and its private key (OpenSSL: PEM lib)"
        return exc.reason or exc.strerror or str(exc)  # e.g. NO_CERTIFICATE_OR_CRL_FOUND for a non-PEM file
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    return str(exc)


def check_tls_files(ca_file: Path | None, cert_file: Path | None, key_file: Path | None) -> None:
    """Load the CA certificate(s) and the certificate chain with its key as TLS will; ``ValueError`` naming
    the flag, the file and the reason (``--ca ca.txt: not a usable PEM CA certificate: NO_...``)."""
    context = ssl.create_default_context()
    if ca_file is not None:
        try:
            context.load_verify_locations(cafile=str(ca_file))
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(f"--ca {ca_file}: not a usable PEM CA certificate: {_tls_reason(exc)}") from None
    if (cert_file is None) != (key_file is None):
        raise ValueError("--cert and --key go together (a certificate chain and its private key)")
    if cert_file is not None and key_file is not None:
        try:
            context.load_cert_chain(str(cert_file), str(key_file))
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(f"--cert {cert_file} / --key {key_file}: unusable: {_tls_reason(exc)}") from None
