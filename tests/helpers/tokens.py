"""Shared pieces of the token and authorization tests: fixed claims, a settable clock, a verifier."""

from __future__ import annotations

from kvnet.security.tokens import Action, Claims, IssuerKey, TokenVerifier, make_claims

FP = b"ab" * 32
TENANT_A = (b"kvnet", b"v1", FP, b"tenantA")
TENANT_B = (b"kvnet", b"v1", FP, b"tenantB")
NOW = 1_700_000_000.0


class Clock:
    def __init__(self, now: float = NOW) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def claims_for(
    actions: set[Action], prefixes: tuple[tuple[bytes, ...], ...] = (TENANT_A,), lifetime: float = 3600
) -> Claims:
    return make_claims("node-1", "tenantA", actions, prefixes, now=NOW, lifetime_s=lifetime)


def verifier_for(issuer: IssuerKey, clock: Clock | None = None) -> TokenVerifier:
    return TokenVerifier([issuer.public_key], clock or Clock(), max_token_size=8192, clock_skew_s=30)
