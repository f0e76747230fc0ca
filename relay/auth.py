"""Relay authorization: which session may do what, from the draft's AUTHORIZATION TOKEN (kvnet tokens).

Owns: ``RelayAuth`` (the trusted issuer keys and the verified-token cache shared by all sessions),
``SessionAuth`` (one peer's SETUP credential and its token aliases). The token format, the token-file
reader, scope rules and error codes are ``kvnet.security.tokens``'s.

Rules (docs/relay.md "Authorization"):

* The SETUP token is the session's default credential. A SETUP token that fails verification closes the
  session with the draft's session code (UNAUTHORIZED, MALFORMED_AUTH_TOKEN, EXPIRED_AUTH_TOKEN); a
  session without one may still send requests that carry their own token.
* A token in a request overrides the session's. PUBLISH_NAMESPACE and PUBLISH need ``publish`` on the
  namespace, SUBSCRIBE/FETCH/TRACK_STATUS/SUBSCRIBE_NAMESPACE need ``subscribe``; ``relay`` (relay-to-relay
  links) implies both. Refusals are REQUEST_ERROR with the code of the failure.
* The check runs first, before any cache, route or negative-cache lookup, and depends only on the token
  and the requested namespace: a request outside the token's scope gets the same UNAUTHORIZED answer
  (code and reason) whether or not the track exists or is cached, and in the same time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from kvnet.security.authorization import Authorizer, TokenAliasRegistry
from kvnet.security.tokens import (
    KVNET_TOKEN_TYPE,
    Action,
    Claims,
    TokenVerifier,
    Unauthorized,
    load_issuer_public_key,
)
from proto import events as me
from proto.messages import AuthToken

AUTH_TOKEN_CACHE_SIZE = 16 * 1024
"""MAX_AUTH_TOKEN_CACHE_SIZE the relay announces when it requires authorization (bytes per session)."""


def request_target(ev: me.MoqtEvent) -> tuple[Action, tuple[bytes, ...]] | None:
    """The action and namespace a request needs, or None for requests the relay refuses anyway."""
    if isinstance(ev, me.PublishNamespaceReceived | me.PublishReceived):
        return Action.PUBLISH, ev.track_namespace
    if isinstance(ev, me.SubscribeReceived | me.TrackStatusReceived):
        return Action.SUBSCRIBE, ev.track_namespace
    if isinstance(ev, me.FetchReceived):
        # A joining FETCH names no track: it rides on a SUBSCRIBE of the same session, already checked.
        return None if ev.track_namespace is None else (Action.SUBSCRIBE, ev.track_namespace)
    if isinstance(ev, me.SubscribeNamespaceReceived | me.SubscribeTracksReceived):
        return Action.SUBSCRIBE, ev.track_namespace_prefix
    return None


class RelayAuth:
    """Trusted issuers and the verified-token cache of one relay process."""

    def __init__(self, issuer_keys: Sequence[Path], clock: Callable[[], float], clock_skew_s: float) -> None:
        verifier = TokenVerifier(
            [load_issuer_public_key(p) for p in issuer_keys], clock, clock_skew_s=clock_skew_s
        )
        self.authorizer = Authorizer(verifier)

    def session(self, setup: me.SetupCompleted | None) -> SessionAuth:
        """State of one peer from its SETUP. Raises ``ProtocolError`` (alias misuse) or ``AuthError``
        (a SETUP token that does not verify): the caller closes the session with its code."""
        registry = TokenAliasRegistry(AUTH_TOKEN_CACHE_SIZE)
        claims: Claims | None = None
        tokens = setup.authorization_tokens if setup is not None else ()
        resolved = [registry.apply(t, in_setup=True) for t in tokens]
        values = [r.value for r in resolved if r is not None and r.token_type == KVNET_TOKEN_TYPE]
        if values:
            # The first kvnet token is the session's credential.
            claims = self.authorizer.verify(values[0])
        return SessionAuth(self.authorizer, registry, claims)


class SessionAuth:
    """One peer's credential (from SETUP) and token aliases."""

    def __init__(self, authorizer: Authorizer, registry: TokenAliasRegistry, claims: Claims | None) -> None:
        self._authorizer = authorizer
        self._registry = registry
        self.claims = claims
        """Claims of the SETUP token, or None when the session has no default credential."""

    @property
    def identity(self) -> str | None:
        """Who the SETUP token names (tenant and subject), for per-identity quotas; None without one."""
        return None if self.claims is None else f"{self.claims.tenant}/{self.claims.subject}"

    def check(self, tokens: Sequence[AuthToken], action: Action, namespace: Sequence[bytes]) -> Claims:
        """Authorize one request; raises ``AuthError`` (answer REQUEST_ERROR with its code) or
        ``ProtocolError`` (alias misuse: close the session)."""
        resolved = [self._registry.apply(t) for t in tokens]
        given = [(r.token_type, r.value) for r in resolved if r is not None]
        if given:
            return self._authorizer.check_any(given, action, namespace)
        if self.claims is None:
            raise Unauthorized("no authorization token")
        # A session credential can expire while the session lives: check its window on every request.
        self._authorizer.verifier.check_validity(self.claims)
        self._authorizer.authorize(self.claims, action, namespace)
        return self.claims
