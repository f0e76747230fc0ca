"""What a receiver does with verified kvnet tokens: scope checks and the per-session token aliases.

Owns: ``Authorizer`` (action x namespace-prefix checks, plus a bounded LRU cache of verified tokens shared
by all sessions of a relay or node) and ``TokenAliasRegistry`` (the per-session registry of token
aliases with the draft's MAX_AUTH_TOKEN_CACHE_SIZE accounting, section "AUTHORIZATION TOKEN
Parameter"). The token format, issuer keys and signature verification are ``kvnet.security.tokens``.
Like it, this knows nothing about sockets or sessions: callers pass the action and the Track Namespace.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvnet.security.tokens import (
    KVNET_TOKEN_TYPE,
    TOKEN_ALIAS_OVERHEAD,
    Action,
    AuthError,
    Claims,
    ExpiredToken,
    MalformedToken,
    TokenVerifier,
    Unauthorized,
    format_field,
    namespace_in_scope,
)
from proto.errors import (
    AuthTokenCacheOverflow,
    DuplicateAuthTokenAlias,
    ProtocolViolation,
    UnknownAuthTokenAlias,
    UsageError,
)
from proto.messages import AliasType, AuthToken

T = TypeVar("T")


# -- authorization + verified-token cache ----------------------------------------------------------


class Authorizer:
    """Scope checks, plus an LRU cache of verified tokens shared by all sessions of a relay or node.

    The cache is keyed by SHA-256 of the Token Value, holds only successfully verified claims (so
    flooding it with garbage cannot evict good entries), and rechecks the validity window on every
    hit, so a cached token still expires on time. Build a new Authorizer (or ``clear()``) when the
    trusted issuer keys change.
    """

    def __init__(self, verifier: TokenVerifier, cache_entries: int = 4096) -> None:
        if cache_entries < 0:
            raise ValueError("cache_entries must not be negative")
        self.verifier = verifier
        self.cache_entries = cache_entries
        self._cache: OrderedDict[bytes, Claims] = OrderedDict()
        self.hits = 0
        """Verifications answered from the cache."""
        self.misses = 0
        """Verifications that ran the signature check."""

    def __len__(self) -> int:
        return len(self._cache)

    def clear(self) -> None:
        self._cache.clear()

    def verify(self, token: bytes) -> Claims:
        """``TokenVerifier.verify`` with the cache in front of the signature check."""
        digest = hashlib.sha256(token).digest() if len(token) <= self.verifier.max_token_size else b""
        claims = self._cache.get(digest) if digest else None
        if claims is not None:
            self.hits += 1
            self._cache.move_to_end(digest)
            try:
                self.verifier.check_validity(claims)
            except ExpiredToken:
                del self._cache[digest]
                raise
            return claims
        self.misses += 1
        claims = self.verifier.verify(token)
        if self.cache_entries and digest:
            self._cache[digest] = claims
            while len(self._cache) > self.cache_entries:
                self._cache.popitem(last=False)
        return claims

    @staticmethod
    def authorize(claims: Claims, action: Action, namespace: Sequence[bytes]) -> None:
        """Raise ``Unauthorized`` unless ``claims`` grant ``action`` on ``namespace``.

        For SUBSCRIBE_NAMESPACE and PUBLISH_NAMESPACE pass the requested prefix as ``namespace``: it must
        lie inside an allowed prefix, so a request for a broader prefix is refused, not narrowed.
        """
        if not claims.allows(action):
            raise Unauthorized(f"token does not allow {action.value}")
        if not namespace_in_scope(namespace, claims.prefixes):
            shown = "-".join(format_field(bytes(f)) for f in namespace) or "()"
            raise Unauthorized(f"namespace {shown} is outside the token's scope")

    def check(self, token: bytes, action: Action, namespace: Sequence[bytes]) -> Claims:
        """Verify ``token`` (through the cache) and authorize ``action`` on ``namespace``."""
        claims = self.verify(token)
        self.authorize(claims, action, namespace)
        return claims

    def check_any(
        self, tokens: Iterable[tuple[int, bytes]], action: Action, namespace: Sequence[bytes]
    ) -> Claims:
        """Authorize with the first of several ``(token_type, value)`` pairs that grants the request.

        The AUTHORIZATION TOKEN parameter may repeat; tokens of other types are skipped. When none
        grants the request, the error of the first kvnet token is raised (or ``Unauthorized`` when there
        is none), which is what the requester most likely needs to fix.
        """
        first: AuthError | None = None
        for token_type, value in tokens:
            if token_type != KVNET_TOKEN_TYPE:
                continue
            try:
                return self.check(value, action, namespace)
            except AuthError as exc:
                first = first or exc
        raise first or Unauthorized("no kvnet authorization token")


# -- token aliases (per session) -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ResolvedToken:
    """A token after alias resolution: what the receiver verifies."""

    token_type: int
    value: bytes


@dataclass(slots=True)
class _AliasEntry:
    token_type: int
    value: bytes | None
    size: int
    error: AuthError | None = None


class TokenAliasRegistry:
    """The aliases one peer registered with us in one session (section "AUTHORIZATION TOKEN Parameter").

    Sized by the MAX_AUTH_TOKEN_CACHE_SIZE we advertised: each registered token costs 16 bytes plus its
    value length, deletion gives that back, and a registration that would exceed the limit closes the
    session with AUTH_TOKEN_CACHE_OVERFLOW; the draft gives no eviction, so there is none. Errors are
    ``proto.errors`` session errors: DUPLICATE_AUTH_TOKEN_ALIAS, UNKNOWN_AUTH_TOKEN_ALIAS,
    AUTH_TOKEN_CACHE_OVERFLOW, PROTOCOL_VIOLATION (DELETE/USE_ALIAS in SETUP).
    """

    def __init__(self, max_cache_size: int = 0) -> None:
        """``max_cache_size``: the MAX_AUTH_TOKEN_CACHE_SIZE we sent (default 0 forbids aliases)."""
        if max_cache_size < 0:
            raise ValueError("max_cache_size must not be negative")
        self.max_cache_size = max_cache_size
        self._entries: dict[int, _AliasEntry] = {}
        self.size = 0
        """Bytes currently accounted against ``max_cache_size``."""

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, alias: object) -> bool:
        return alias in self._entries

    def register(self, alias: int, token_type: int, value: bytes, *, in_setup: bool = False) -> bool:
        """Register ``alias``; True if registered, False if a SETUP registration was over the limit.

        The draft: a SETUP registration over the limit is used as USE_VALUE, not a session error.
        """
        if alias in self._entries:
            raise DuplicateAuthTokenAlias(f"token alias {alias} is already registered")
        cost = TOKEN_ALIAS_OVERHEAD + len(value)
        if self.size + cost > self.max_cache_size:
            if in_setup:
                return False
            raise AuthTokenCacheOverflow(
                f"registering {cost} bytes would exceed MAX_AUTH_TOKEN_CACHE_SIZE {self.max_cache_size}"
            )
        self._entries[alias] = _AliasEntry(token_type, bytes(value), cost)
        self.size += cost
        return True

    def delete(self, alias: int) -> None:
        entry = self._entries.pop(alias, None)
        if entry is None:
            raise UnknownAuthTokenAlias(f"token alias {alias} is not registered")
        self.size -= entry.size

    def resolve(self, alias: int) -> ResolvedToken:
        """The token registered under ``alias``; re-raises a remembered permanent ``AuthError``."""
        entry = self._entries.get(alias)
        if entry is None:
            raise UnknownAuthTokenAlias(f"token alias {alias} is not registered")
        if entry.error is not None or entry.value is None:
            error = entry.error or MalformedToken("token value was discarded")
            raise type(error)(error.reason)
        return ResolvedToken(entry.token_type, entry.value)

    def remember_failure(self, alias: int, error: AuthError) -> None:
        """Store a permanent error in place of the token (the draft's MAY), freeing the value.

        Errors that could go away (unknown issuer, not yet valid, out of scope) are not stored. The
        accounted size does not change: the draft counts the value "regardless of whether it is stored".
        """
        entry = self._entries.get(alias)
        if entry is None or not error.permanent:
            return
        entry.error = error
        entry.value = None

    def apply(self, token: AuthToken, *, in_setup: bool = False) -> ResolvedToken | None:
        """Process one decoded Token structure; return the token to verify, or None for DELETE."""
        kind = token.alias_type
        if in_setup and kind in (AliasType.DELETE, AliasType.USE_ALIAS):
            raise ProtocolViolation(f"{kind.name} token alias in SETUP")
        has_alias = kind != AliasType.USE_VALUE
        has_value = kind in (AliasType.REGISTER, AliasType.USE_VALUE)
        # proto's decoder only builds consistent structures; anything else is a local bug.
        if has_alias != (token.alias is not None) or has_value != (
            token.token_type is not None and token.value is not None
        ):
            raise UsageError(f"inconsistent {kind.name} token structure")
        if kind == AliasType.DELETE:
            self.delete(_present(token.alias))
            return None
        if kind == AliasType.USE_ALIAS:
            return self.resolve(_present(token.alias))
        resolved = ResolvedToken(_present(token.token_type), _present(token.value))
        if kind == AliasType.REGISTER:
            self.register(_present(token.alias), resolved.token_type, resolved.value, in_setup=in_setup)
        return resolved


def _present(value: T | None) -> T:
    if value is None:
        raise UsageError("missing token field")
    return value


