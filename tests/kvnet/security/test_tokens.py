"""Tests for kvnet.security.tokens: token format, verification errors, claims, actions, namespaces, token
files."""

from __future__ import annotations

import base64
import contextlib
import os
import stat
from pathlib import Path

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvnet.security.tokens import (
    KVNET_TOKEN_TYPE,
    MAGIC,
    SIGNING_CONTEXT,
    Action,
    AuthError,
    Claims,
    ExpiredToken,
    InvalidSignature,
    IssuerKey,
    MalformedToken,
    NotYetValid,
    TokenVerifier,
    UnknownIssuer,
    action_for_message,
    format_namespace,
    issue_token,
    load_issuer_public_key,
    make_claims,
    parse_namespace,
    read_token_file,
)
from proto.errors import (
    RequestErrorCode,
    SessionErrorCode,
)
from tests.helpers.tokens import NOW, TENANT_A, Clock, claims_for, verifier_for

# -- round trip and wire format --------------------------------------------------------------------


def test_round_trip(issuer: IssuerKey) -> None:
    claims = claims_for({Action.SUBSCRIBE, Action.PUBLISH})
    token = issue_token(issuer, claims)
    got = verifier_for(issuer).verify(token)
    assert got.subject == "node-1" and got.tenant == "tenantA"
    assert got.actions == {Action.SUBSCRIBE, Action.PUBLISH}
    assert got.prefixes == (TENANT_A,)
    assert (got.not_before, got.expires) == (int(NOW), int(NOW) + 3600)
    assert got.issuer_key_id == issuer.key_id
    assert len(got.token_id) == 16


def test_wire_layout(issuer: IssuerKey) -> None:
    token = issue_token(issuer, claims_for({Action.SUBSCRIBE}))
    assert token[:4] == MAGIC
    assert token[4:36] == issuer.key_id
    claims = msgpack.unpackb(token[36:-64], raw=False)
    assert list(claims) == ["act", "exp", "jti", "nbf", "pfx", "sub", "ten", "v"]
    assert claims["act"] == ["subscribe"] and claims["pfx"] == [list(TENANT_A)]
    issuer.public_key.verify(token[-64:], SIGNING_CONTEXT + token[:-64])
    assert KVNET_TOKEN_TYPE == 0  # the draft's "negotiated out-of-band" type: no private range exists


def test_token_ids_are_fresh(issuer: IssuerKey) -> None:
    claims = claims_for({Action.SUBSCRIBE})
    assert issue_token(issuer, claims) != issue_token(issuer, claims)


def test_pem_save_load(tmp_path: Path, issuer: IssuerKey) -> None:
    path = tmp_path / "issuer.key"
    issuer.save(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with pytest.raises(FileExistsError):
        issuer.save(path)
    loaded = IssuerKey.load(path)
    assert loaded.key_id == issuer.key_id
    issuer.save_public(tmp_path / "issuer.pub")
    pub = load_issuer_public_key(tmp_path / "issuer.pub")
    token = issue_token(loaded, claims_for({Action.SUBSCRIBE}))
    assert TokenVerifier([pub], Clock()).verify(token).subject == "node-1"
    with pytest.raises(ValueError):
        IssuerKey.from_pem(b"-----BEGIN PRIVATE KEY-----\nnope\n-----END PRIVATE KEY-----\n")


# -- verification errors ---------------------------------------------------------------------------


def test_expired_and_not_yet_valid(issuer: IssuerKey) -> None:
    clock = Clock()
    verifier = verifier_for(issuer, clock)
    token = issue_token(issuer, claims_for({Action.SUBSCRIBE}, lifetime=60))
    clock.now = NOW + 60 + 29  # inside the clock skew allowance
    verifier.verify(token)
    clock.now = NOW + 60 + 30
    with pytest.raises(ExpiredToken) as exc:
        verifier.verify(token)
    assert exc.value.request_error_code == RequestErrorCode.EXPIRED_AUTH_TOKEN
    assert exc.value.session_error_code == SessionErrorCode.EXPIRED_AUTH_TOKEN
    clock.now = NOW - 100
    with pytest.raises(NotYetValid) as early:
        verifier.verify(token)
    assert early.value.request_error_code == RequestErrorCode.UNAUTHORIZED
    assert early.value.retry_after_s == pytest.approx(70)
    assert early.value.to_request_error().retry_interval == 70_001


def test_forged_signature(issuer: IssuerKey) -> None:
    token = bytearray(issue_token(issuer, claims_for({Action.SUBSCRIBE})))
    token[-1] ^= 1
    with pytest.raises(InvalidSignature) as exc:
        verifier_for(issuer).verify(bytes(token))
    assert exc.value.request_error_code == RequestErrorCode.MALFORMED_AUTH_TOKEN


def test_altered_claims_fail_signature(issuer: IssuerKey) -> None:
    token = issue_token(issuer, claims_for({Action.SUBSCRIBE}))
    # Widen the tenant field in the claims without re-signing.
    forged = token.replace(b"tenantA", b"tenantB")
    assert forged != token
    with pytest.raises(InvalidSignature):
        verifier_for(issuer).verify(forged)


def test_other_key_signing_under_trusted_key_id(issuer: IssuerKey) -> None:
    attacker = IssuerKey.generate()
    token = issue_token(attacker, claims_for({Action.PUBLISH}))
    forged = token[:4] + issuer.key_id + token[36:]
    with pytest.raises(InvalidSignature):
        verifier_for(issuer).verify(forged)


def test_unknown_issuer(issuer: IssuerKey) -> None:
    token = issue_token(IssuerKey.generate(), claims_for({Action.SUBSCRIBE}))
    with pytest.raises(UnknownIssuer) as exc:
        verifier_for(issuer).verify(token)
    assert exc.value.request_error_code == RequestErrorCode.UNAUTHORIZED
    assert not exc.value.permanent


def test_truncated(issuer: IssuerKey) -> None:
    token = issue_token(issuer, claims_for({Action.SUBSCRIBE}))
    verifier = verifier_for(issuer)
    for cut in range(len(token)):
        with pytest.raises((MalformedToken, InvalidSignature)):
            verifier.verify(token[:cut])
    with pytest.raises(MalformedToken):
        verifier.verify(token[:100])


def test_oversized(issuer: IssuerKey) -> None:
    verifier = TokenVerifier([issuer.public_key], Clock(), max_token_size=200)
    with pytest.raises(MalformedToken):
        verifier.verify(issue_token(issuer, claims_for({Action.SUBSCRIBE}, prefixes=(TENANT_A,) * 8)))


def test_other_type0_token_is_malformed(issuer: IssuerKey) -> None:
    with pytest.raises(MalformedToken) as exc:
        verifier_for(issuer).verify(b"eyJhbGciOiJFUzI1NiJ9." + b"x" * 200)
    assert exc.value.to_session_error().error_code == SessionErrorCode.MALFORMED_AUTH_TOKEN


def _sign_raw_claims(issuer: IssuerKey, claims: bytes) -> bytes:
    signed = MAGIC + issuer.key_id + claims
    return signed + issuer.sign(SIGNING_CONTEXT + signed)


def test_signed_but_non_canonical_claims_rejected(issuer: IssuerKey) -> None:
    good = issue_token(issuer, claims_for({Action.SUBSCRIBE}))
    obj = msgpack.unpackb(good[36:-64], raw=False)
    verifier = verifier_for(issuer)
    reordered = dict(reversed(list(obj.items())))
    duplicated = dict(obj, act=["subscribe", "subscribe"])
    as_bool = dict(obj, nbf=True)
    unknown_action = dict(obj, act=["admin"])
    extra_key = dict(obj, zzz=1)
    for bad in (reordered, duplicated, as_bool, unknown_action, extra_key):
        with pytest.raises(MalformedToken):
            verifier.verify(_sign_raw_claims(issuer, msgpack.packb(bad, use_bin_type=True)))
    # A wider integer encoding of the same value is not canonical.
    wide = good[36:-64].replace(b"\xa3nbf\xce", b"\xa3nbf\xcf\x00\x00\x00\x00")
    assert wide != good[36:-64]
    with pytest.raises(MalformedToken):
        verifier.verify(_sign_raw_claims(issuer, wide))
    verifier.verify(_sign_raw_claims(issuer, good[36:-64]))


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=400))
def test_random_bytes_only_typed_errors(data: bytes) -> None:
    verifier = TokenVerifier([IssuerKey.generate().public_key], Clock(), max_token_size=300)
    with pytest.raises(AuthError):
        verifier.verify(data)
    with pytest.raises((MalformedToken, UnknownIssuer, InvalidSignature)):
        verifier.verify(MAGIC + data)


_FUZZ_ISSUER = IssuerKey.generate()


@settings(max_examples=200, deadline=None)
@given(claims=st.binary(min_size=1, max_size=300))
def test_random_signed_claims_only_typed_errors(claims: bytes) -> None:
    key = _FUZZ_ISSUER
    verifier = TokenVerifier([key.public_key], Clock())
    # Any outcome but a typed AuthError (or success) fails the test.
    with contextlib.suppress(AuthError):
        verifier.verify(_sign_raw_claims(key, claims))


@settings(max_examples=100, deadline=None)
@given(position=st.integers(min_value=0), value=st.integers(min_value=1, max_value=255))
def test_bit_flips_never_verify(issuer: IssuerKey, position: int, value: int) -> None:
    token = bytearray(issue_token(issuer, claims_for({Action.SUBSCRIBE})))
    token[position % len(token)] ^= value
    with pytest.raises((MalformedToken, UnknownIssuer, InvalidSignature)):
        verifier_for(issuer).verify(bytes(token))


# -- claims validation ------------------------------------------------------------------------------


def test_claims_validation() -> None:
    with pytest.raises(ValueError):
        make_claims("s", "t", [], [TENANT_A], now=NOW, lifetime_s=10)
    with pytest.raises(ValueError):
        make_claims("s", "t", ["admin"], [TENANT_A], now=NOW, lifetime_s=10)
    with pytest.raises(ValueError):
        make_claims("s", "t", ["subscribe"], [], now=NOW, lifetime_s=10)
    with pytest.raises(ValueError):
        make_claims("s", "t", ["subscribe"], [(b"x",) * 33], now=NOW, lifetime_s=10)
    with pytest.raises(ValueError):
        make_claims("", "t", ["subscribe"], [TENANT_A], now=NOW, lifetime_s=10)
    with pytest.raises(ValueError):
        make_claims("s", "t", ["subscribe"], [TENANT_A], now=NOW, lifetime_s=0)
    with pytest.raises(ValueError):
        Claims("s", "t", frozenset({Action.PUBLISH}), (TENANT_A,), not_before=10, expires=10)
    with pytest.raises(ValueError):
        issue_token(IssuerKey.generate(), Claims("s", "t", frozenset({Action.PUBLISH}), (TENANT_A,),
                                                 not_before=1, expires=2, issuer_key_id=b"k" * 32))


# -- scopes -----------------------------------------------------------------------------------------


def test_action_for_message() -> None:
    assert action_for_message("FETCH") is Action.SUBSCRIBE
    assert action_for_message("TRACK_STATUS") is Action.SUBSCRIBE
    assert action_for_message("SUBSCRIBE_NAMESPACE") is Action.SUBSCRIBE
    assert action_for_message("PUBLISH_NAMESPACE") is Action.PUBLISH
    with pytest.raises(ValueError):
        action_for_message("GOAWAY")


# -- namespace rendering ----------------------------------------------------------------------------


def test_namespace_rendering() -> None:
    ns = (b"kvnet", b"v1", b"ab12", b"tenant-A.x")
    text = format_namespace(ns)
    assert text == "kvnet-v1-ab12-tenant.2dA.2ex"
    assert parse_namespace(text) == ns
    assert parse_namespace("") == ()
    for bad in ("a.61", "a.2D", "a.", "a.2", "a b", "é"):
        with pytest.raises(ValueError):
            parse_namespace(bad)


@given(st.lists(st.binary(min_size=1, max_size=12), min_size=1, max_size=6))
def test_namespace_rendering_round_trip(fields: list[bytes]) -> None:
    ns = tuple(fields)
    assert parse_namespace(format_namespace(ns)) == ns


# -- token files ----------------------------------------------------------------------------------


def test_token_file_raw_or_base64url(tmp_path: Path, issuer: IssuerKey) -> None:
    token = issue_token(issuer, claims_for({Action.SUBSCRIBE}))
    raw = tmp_path / "raw.tok"
    raw.write_bytes(token)
    assert read_token_file(raw) == token
    text = base64.urlsafe_b64encode(token).rstrip(b"=")
    wrapped = tmp_path / "b64.tok"
    wrapped.write_bytes(b"\n".join(text[i : i + 64] for i in range(0, len(text), 64)) + b"\n")
    assert read_token_file(wrapped) == token
    padded = tmp_path / "padded.tok"
    padded.write_bytes(base64.urlsafe_b64encode(token))
    assert read_token_file(padded) == token


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "not a kvnet token"),
        (b"hello, relay", "not a kvnet token"),
        (b"!!!not base64!!!", "not a kvnet token"),
        (base64.urlsafe_b64encode(b"JWT." + bytes(40)), "not a kvnet token"),
        (MAGIC + bytes(9000), "at most 8192 bytes"),
        (MAGIC + bytes(20000), "larger than any token file"),
        (base64.urlsafe_b64encode(MAGIC + bytes(9000)), "at most 8192 bytes"),
    ],
)
def test_token_file_refuses_what_is_no_token(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.tok"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message) as info:
        read_token_file(path)
    assert str(path) in str(info.value)

