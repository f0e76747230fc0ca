"""Tests for kvnet.security.authorization: scope checks, the verified-token cache, token aliases."""

from __future__ import annotations

import os

import pytest

from kvnet.security.authorization import Authorizer, TokenAliasRegistry
from kvnet.security.tokens import (
    KVNET_TOKEN_TYPE,
    TOKEN_ALIAS_OVERHEAD,
    Action,
    ExpiredToken,
    IssuerKey,
    MalformedToken,
    NotYetValid,
    Unauthorized,
    issue_token,
)
from proto.errors import (
    AuthTokenCacheOverflow,
    DuplicateAuthTokenAlias,
    ProtocolViolation,
    RequestErrorCode,
    SessionErrorCode,
    UnknownAuthTokenAlias,
)
from proto.messages import AliasType, AuthToken, decode_auth_token
from tests.helpers.tokens import FP, NOW, TENANT_A, TENANT_B, Clock, claims_for, verifier_for

# -- scope checks ------------------------------------------------------------------------------------


def test_publish_only_cannot_subscribe() -> None:
    claims = claims_for({Action.PUBLISH})
    Authorizer.authorize(claims, Action.PUBLISH, TENANT_A)
    with pytest.raises(Unauthorized) as exc:
        Authorizer.authorize(claims, Action.SUBSCRIBE, TENANT_A)
    assert exc.value.request_error_code == RequestErrorCode.UNAUTHORIZED
    with pytest.raises(Unauthorized):
        Authorizer.authorize(claims, Action.RELAY, TENANT_A)


def test_subscribe_only_cannot_publish() -> None:
    with pytest.raises(Unauthorized):
        Authorizer.authorize(claims_for({Action.SUBSCRIBE}), Action.PUBLISH, TENANT_A)


def test_relay_implies_publish_and_subscribe() -> None:
    claims = claims_for({Action.RELAY})
    for action in Action:
        Authorizer.authorize(claims, action, TENANT_A)
    with pytest.raises(Unauthorized):
        Authorizer.authorize(claims, Action.SUBSCRIBE, TENANT_B)


def test_prefix_is_field_wise() -> None:
    claims = claims_for({Action.SUBSCRIBE, Action.PUBLISH})
    Authorizer.authorize(claims, Action.SUBSCRIBE, TENANT_A)
    Authorizer.authorize(claims, Action.SUBSCRIBE, (*TENANT_A, b"more"))
    for outside in (
        TENANT_B,
        (b"kvnet", b"v1", FP, b"tenantAB"),  # the allowed field is a byte-string prefix of this one
        (b"kvnet", b"v1", FP, b"tenant"),  # this field is a byte-string prefix of the allowed one
        (b"kvnet", b"v1", FP),  # broader than the grant
        (b"kvnet", b"v1", FP + b"tenantA"),  # concatenation of two allowed fields
        (),
    ):
        with pytest.raises(Unauthorized):
            Authorizer.authorize(claims, Action.SUBSCRIBE, outside)


def test_empty_prefix_allows_everything() -> None:
    claims = claims_for({Action.SUBSCRIBE}, prefixes=((),))
    Authorizer.authorize(claims, Action.SUBSCRIBE, ())
    Authorizer.authorize(claims, Action.SUBSCRIBE, TENANT_B)


def test_several_prefixes() -> None:
    claims = claims_for({Action.SUBSCRIBE}, prefixes=(TENANT_A, TENANT_B))
    Authorizer.authorize(claims, Action.SUBSCRIBE, TENANT_A)
    Authorizer.authorize(claims, Action.SUBSCRIBE, TENANT_B)
    with pytest.raises(Unauthorized):
        Authorizer.authorize(claims, Action.SUBSCRIBE, (b"kvnet", b"v1", FP, b"tenantC"))


# -- verified-token cache --------------------------------------------------------------------------


def test_authorizer_cache_bounded_and_expiring(issuer: IssuerKey) -> None:
    clock = Clock()
    auth = Authorizer(verifier_for(issuer, clock), cache_entries=3)
    tokens = [issue_token(issuer, claims_for({Action.SUBSCRIBE}, lifetime=100)) for _ in range(5)]
    for t in tokens:
        auth.check(t, Action.SUBSCRIBE, TENANT_A)
    assert len(auth) == 3 and auth.misses == 5
    auth.check(tokens[-1], Action.SUBSCRIBE, TENANT_A)
    assert auth.hits == 1
    auth.check(tokens[0], Action.SUBSCRIBE, TENANT_A)  # evicted first (LRU): verified again
    assert auth.misses == 6
    with pytest.raises(Unauthorized):  # a cached token is still scope-checked
        auth.check(tokens[-1], Action.PUBLISH, TENANT_A)
    clock.now = NOW + 200
    with pytest.raises(ExpiredToken):  # a cached token still expires
        auth.check(tokens[-1], Action.SUBSCRIBE, TENANT_A)
    assert len(auth) == 2


def test_authorizer_does_not_cache_failures(issuer: IssuerKey) -> None:
    auth = Authorizer(verifier_for(issuer), cache_entries=3)
    for _ in range(3):
        with pytest.raises(MalformedToken):
            auth.verify(os.urandom(120))
    assert len(auth) == 0


def test_check_any(issuer: IssuerKey) -> None:
    auth = Authorizer(verifier_for(issuer))
    pub = issue_token(issuer, claims_for({Action.PUBLISH}))
    sub = issue_token(issuer, claims_for({Action.SUBSCRIBE}))
    claims = auth.check_any([(7, b"other"), (KVNET_TOKEN_TYPE, pub), (KVNET_TOKEN_TYPE, sub)],
                            Action.SUBSCRIBE, TENANT_A)
    assert claims.actions == {Action.SUBSCRIBE}
    with pytest.raises(Unauthorized):
        auth.check_any([(KVNET_TOKEN_TYPE, pub)], Action.SUBSCRIBE, TENANT_A)
    with pytest.raises(Unauthorized):
        auth.check_any([], Action.SUBSCRIBE, TENANT_A)


# -- aliases ----------------------------------------------------------------------------------------


def test_alias_register_use_delete() -> None:
    reg = TokenAliasRegistry(max_cache_size=100)
    got = reg.apply(AuthToken(AliasType.REGISTER, 1, 0, b"a" * 20))
    assert got is not None and got.value == b"a" * 20
    assert reg.size == TOKEN_ALIAS_OVERHEAD + 20
    used = reg.apply(AuthToken(AliasType.USE_ALIAS, 1))
    assert used is not None and used.value == b"a" * 20 and used.token_type == 0
    assert reg.apply(AuthToken(AliasType.DELETE, 1)) is None
    assert reg.size == 0 and 1 not in reg
    with pytest.raises(UnknownAuthTokenAlias) as exc:
        reg.apply(AuthToken(AliasType.USE_ALIAS, 1))
    assert exc.value.error_code == SessionErrorCode.UNKNOWN_AUTH_TOKEN_ALIAS
    with pytest.raises(UnknownAuthTokenAlias):
        reg.apply(AuthToken(AliasType.DELETE, 1))
    # Re-registration after deletion is allowed.
    reg.apply(AuthToken(AliasType.REGISTER, 1, 0, b"b"))


def test_alias_duplicate() -> None:
    reg = TokenAliasRegistry(max_cache_size=1000)
    reg.register(5, 0, b"x")
    with pytest.raises(DuplicateAuthTokenAlias) as exc:
        reg.register(5, 0, b"y")
    assert exc.value.error_code == SessionErrorCode.DUPLICATE_AUTH_TOKEN_ALIAS


def test_alias_cache_bounded() -> None:
    reg = TokenAliasRegistry(max_cache_size=3 * (TOKEN_ALIAS_OVERHEAD + 10))
    for alias in range(3):
        assert reg.register(alias, 0, b"v" * 10)
    with pytest.raises(AuthTokenCacheOverflow) as exc:
        reg.register(3, 0, b"v")
    assert exc.value.error_code == SessionErrorCode.AUTH_TOKEN_CACHE_OVERFLOW
    assert len(reg) == 3
    reg.delete(0)
    assert reg.register(3, 0, b"v" * 10)


def test_alias_default_size_forbids_aliases() -> None:
    reg = TokenAliasRegistry()
    with pytest.raises(AuthTokenCacheOverflow):
        reg.register(1, 0, b"")


def test_alias_in_setup() -> None:
    reg = TokenAliasRegistry(max_cache_size=0)
    # Over the limit in SETUP: used as USE_VALUE, not registered, no session error.
    got = reg.apply(AuthToken(AliasType.REGISTER, 1, 0, b"tok"), in_setup=True)
    assert got is not None and got.value == b"tok" and 1 not in reg
    for kind in (AliasType.DELETE, AliasType.USE_ALIAS):
        with pytest.raises(ProtocolViolation):
            reg.apply(AuthToken(kind, 1), in_setup=True)


def test_alias_remembers_only_permanent_failures(issuer: IssuerKey) -> None:
    reg = TokenAliasRegistry(max_cache_size=1000)
    reg.register(1, 0, b"garbage")
    reg.register(2, 0, b"later")
    size = reg.size
    reg.remember_failure(1, MalformedToken("bad"))
    reg.remember_failure(2, NotYetValid("soon", retry_after_s=5))
    with pytest.raises(MalformedToken):
        reg.resolve(1)
    assert reg.resolve(2).value == b"later"
    assert reg.size == size  # the draft counts the value whether or not it is kept


def test_alias_round_trip_through_proto_decoder() -> None:
    reg = TokenAliasRegistry(max_cache_size=200)
    wire = bytes([AliasType.REGISTER, 9, 0]) + b"value"
    got = reg.apply(decode_auth_token(wire))
    assert got is not None and got.value == b"value" and 9 in reg
