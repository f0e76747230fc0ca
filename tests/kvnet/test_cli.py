"""The ``kvnet`` command: token issuance end to end, through main() as a user would call it."""

from __future__ import annotations

import stat
import time
from pathlib import Path

import pytest

from kvnet.cli import main
from kvnet.security import tokens as auth
from kvnet.security.authorization import Authorizer


def _issuer(tmp_path: Path) -> tuple[Path, Path]:
    key, pub = tmp_path / "issuer.pem", tmp_path / "issuer.pub"
    assert main(["token", "issuer", "--key", str(key), "--public", str(pub)]) == 0
    return key, pub


def _issue(key: Path, out: Path, *, subject: str, tenant: str, action: str, prefix: str) -> list[str]:
    """``kvnet token issue`` arguments for one token signed with ``key``, written to ``out``."""
    return [
        "token", "issue", "--issuer-key", str(key), "--subject", subject, "--tenant", tenant,
        "--action", action, "--prefix", prefix, "--out", str(out),
    ]


def test_token_issue_verifies_with_the_issuer_public_key(tmp_path: Path) -> None:
    key, pub = _issuer(tmp_path)
    out = tmp_path / "sub.tok"
    args = _issue(key, out, subject="node-b", tenant="acme", action="subscribe", prefix="kvnet-v1")
    assert main([*args, "--lifetime", "60"]) == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    verifier = auth.TokenVerifier([auth.load_issuer_public_key(pub)], clock=time.time)
    claims = verifier.verify(out.read_bytes())
    assert claims.subject == "node-b" and claims.tenant == "acme"
    assert claims.actions == frozenset({auth.Action.SUBSCRIBE})
    assert claims.prefixes == ((b"kvnet", b"v1"),)
    assert claims.expires - claims.not_before == 60
    Authorizer(verifier).authorize(claims, auth.Action.SUBSCRIBE, (b"kvnet", b"v1", b"fp", b"t1"))
    with pytest.raises(auth.Unauthorized):
        Authorizer(verifier).authorize(claims, auth.Action.PUBLISH, (b"kvnet", b"v1", b"fp", b"t1"))


def test_token_issue_refuses_to_overwrite_and_rejects_bad_actions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key, _ = _issuer(tmp_path)
    out = tmp_path / "t.tok"
    args = _issue(key, out, subject="s", tenant="t", action="publish", prefix="kvnet")
    assert main(args) == 0
    assert main(args) == 2  # the existing token file is kept
    assert capsys.readouterr().err == f"kvnet: error: {out} already exists (--force replaces it)\n"
    with pytest.raises(SystemExit):
        main(_issue(key, tmp_path / "x", subject="s", tenant="t", action="delete-everything", prefix="kvnet"))


def test_issuer_key_is_private_and_not_overwritten(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key, _ = _issuer(tmp_path)
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    capsys.readouterr()
    assert main(["token", "issuer", "--key", str(key), "--public", str(tmp_path / "p2")]) == 2
    # The error names the key file, not the temporary file it is written through.
    assert capsys.readouterr().err == f"kvnet: error: {key} already exists (--force replaces it)\n"


def test_file_errors_name_the_file_and_the_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing-dir" / "issuer.pem"
    assert main(["token", "issuer", "--key", str(missing), "--public", str(tmp_path / "p")]) == 2
    assert capsys.readouterr().err == f"kvnet: error: {missing}: No such file or directory\n"
    assert main(["certs", "show", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"kvnet: error: {tmp_path}: Is a directory\n"
