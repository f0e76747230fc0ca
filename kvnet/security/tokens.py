"""Authorization tokens carried in MoQT draft-18's AUTHORIZATION TOKEN, and what a receiver does with them.

Owns: issuer keys; the kvnet token format (claims + Ed25519 signature); verification against a set of
trusted issuer public keys with an injected clock; actions and namespace scopes (what a claim grants).
What a receiver does with verified tokens (the scope check with its cache of verified tokens, the
per-session token aliases) is ``kvnet.security.authorization``.

It knows nothing about sockets, sessions or which message is being handled: callers pass the action and
the Track Namespace. Every failure on token bytes raises an ``AuthError`` subclass (or, for alias
bookkeeping, a ``proto.errors.ProtocolError`` subclass) and nothing else.

Token type
----------
The draft's "MOQT Auth Token Type" registry has no private-use range: its only entry is 0x0, "reserved
to indicate that the type is not defined in the table and is negotiated out-of-band between client and
receiver", plus the greasing code points. So kvnet tokens travel with Token Type ``KVNET_TOKEN_TYPE =
0x0`` (the out-of-band agreement is "this deployment uses kvnet tokens"), and the value starts with a
magic and format version so that other type-0 tokens are told apart and rejected as malformed rather
than misread.

Token Value (all integers big-endian)::

    offset  size  field
    0       4     magic b"KVT" + format version 0x01
    4       32    issuer key id = SHA-256(raw 32-byte Ed25519 public key of the issuer)
    36      n     claims: canonical msgpack map (below)
    36+n    64    Ed25519 signature by the issuer over SIGNING_CONTEXT || bytes[0 : 36+n]

Claims map, keys in this (sorted) order, encoded with msgpack's shortest forms (bin type for bytes,
str for text) and nothing else, so that one set of claims has exactly one encoding::

    "act"  array of str, sorted, unique, from {"publish", "relay", "subscribe"}
    "exp"  uint, expiry, Unix seconds (exclusive)
    "jti"  bin(16), random token id (for audit logs and revocation lists)
    "nbf"  uint, not-before, Unix seconds
    "pfx"  array (1..32) of namespace prefixes, each an array (0..32) of bin fields
    "sub"  str, subject (who the token was issued to)
    "ten"  str, tenant the subject acts for
    "v"    uint, claims version = 1

Actions: ``publish`` covers PUBLISH and PUBLISH_NAMESPACE; ``subscribe`` covers SUBSCRIBE, FETCH,
TRACK_STATUS, SUBSCRIBE_NAMESPACE and SUBSCRIBE_TRACKS; ``relay`` is for relay-to-relay links and implies
both, within the same prefixes. A namespace is in scope when one allowed prefix is a *field-wise* prefix
of it (the draft's namespace prefix matching), never a byte-string prefix of a field.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import ClassVar, Final

import msgpack
from cryptography.exceptions import InvalidSignature as _CryptoInvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from kvnet.security import keys
from proto.errors import ExpiredAuthToken as _SessionExpiredAuthToken
from proto.errors import MalformedAuthToken as _SessionMalformedAuthToken
from proto.errors import (
    ProtocolError,
    RequestErrorCode,
    RequestRefusal,
    SessionErrorCode,
)
from proto.errors import Unauthorized as _SessionUnauthorized

__all__ = [
    "CLAIMS_VERSION",
    "DEFAULT_CLOCK_SKEW_S",
    "DEFAULT_MAX_TOKEN_SIZE",
    "KVNET_TOKEN_TYPE",
    "MAGIC",
    "SIGNING_CONTEXT",
    "TOKEN_ALIAS_OVERHEAD",
    "Action",
    "AuthError",
    "Claims",
    "ExpiredToken",
    "InvalidSignature",
    "IssuerKey",
    "MalformedToken",
    "Namespace",
    "NotYetValid",
    "TokenVerifier",
    "Unauthorized",
    "UnknownIssuer",
    "action_for_message",
    "format_namespace",
    "issue_token",
    "issuer_key_id",
    "load_issuer_public_key",
    "make_claims",
    "namespace_in_scope",
    "parse_namespace",
]


Namespace = tuple[bytes, ...]
"""A Track Namespace (or namespace prefix): 0..32 byte-string fields."""

KVNET_TOKEN_TYPE: Final = 0x0
"""Token Type of kvnet tokens: the draft's out-of-band type (its registry has no private-use range)."""
MAGIC: Final = b"KVT\x01"
"""First bytes of every kvnet Token Value: format tag and version."""
SIGNING_CONTEXT: Final = b"kvnet/auth-token/v1\x00"
"""Prepended to the signed bytes so that no other kvnet signature (e.g. a manifest's) is a valid token."""
CLAIMS_VERSION: Final = 1
KEY_ID_LEN: Final = keys.KEY_ID_LEN
SIGNATURE_LEN: Final = 64
TOKEN_ID_LEN: Final = 16
_HEADER_LEN: Final = len(MAGIC) + KEY_ID_LEN

DEFAULT_MAX_TOKEN_SIZE: Final = 8192
"""Largest Token Value a verifier reads; 32 prefixes of a full kvnet block namespace fit in ~5 KiB."""
DEFAULT_CLOCK_SKEW_S: Final = 5.0
"""Clock skew tolerated between issuer and verifier on both ends of the validity window: a token is
refused from ``expires + clock_skew_s`` on. Small, because every second of it extends a leaked token's life;
NTP-synchronised hosts differ by milliseconds (SECURITY.md "Authorization tokens")."""
TOKEN_ALIAS_OVERHEAD: Final = 16
"""Bytes each registered alias costs on top of its Token Value (section "MAX_AUTH_TOKEN_CACHE_SIZE")."""

MAX_PREFIXES: Final = 32
MAX_NAMESPACE_FIELDS: Final = 32
"""Draft-18 limit on Track Namespace Fields (section "Track Names")."""
MAX_NAMESPACE_BYTES: Final = 4096
"""Draft-18 limit on the total length of a Full Track Name, hence of any namespace."""
MAX_TEXT_BYTES: Final = 256
"""Longest subject or tenant (UTF-8 bytes)."""
_MAX_TIME: Final = 2**63 - 1


# -- errors --------------------------------------------------------------------------------------


class AuthError(Exception):
    """A token could not be used to authorize an operation.

    Which code goes on the wire depends on where the token came from: a token in a request message
    (SUBSCRIBE, FETCH, PUBLISH_NAMESPACE, ...) fails that request with REQUEST_ERROR and
    ``request_error_code`` (``RequestErrorCode``); a token in the SETUP option fails the session with
    ``session_error_code`` (``SessionErrorCode``). ``permanent`` says whether the same token can never
    succeed, so a receiver MAY remember the error in place of a registered alias (the draft forbids
    doing that for tokens that might become valid later).
    """

    request_error_code: ClassVar[RequestErrorCode] = RequestErrorCode.UNAUTHORIZED
    session_error_code: ClassVar[SessionErrorCode] = SessionErrorCode.UNAUTHORIZED
    permanent: ClassVar[bool] = False

    def __init__(self, reason: str, retry_after_s: float = 0.0) -> None:
        super().__init__(reason)
        self.reason: str = reason
        self.retry_after_s: float = retry_after_s
        """Seconds after which retrying with the same token may succeed (0: don't retry it)."""

    def to_request_error(self) -> RequestRefusal:
        """The REQUEST_ERROR to answer a request carrying this token with (Retry Interval in ms)."""
        # Retry Interval 0 means "do not retry"; 1 means "immediately", so round up to at least 1 ms.
        retry = max(1, int(self.retry_after_s * 1000) + 1) if self.retry_after_s > 0 else 0
        return RequestRefusal(self.request_error_code, self.reason, retry)

    def to_session_error(self) -> ProtocolError:
        """The session error to close with when this token was the SETUP's credential."""
        cls = _SESSION_ERRORS[self.session_error_code]
        return cls(self.reason)


class MalformedToken(AuthError):
    """The Token Value is not a well-formed kvnet token (bad magic, length, claims encoding)."""

    request_error_code = RequestErrorCode.MALFORMED_AUTH_TOKEN
    session_error_code = SessionErrorCode.MALFORMED_AUTH_TOKEN
    permanent = True


class InvalidSignature(AuthError):
    """The signature does not verify under the named issuer key: forged or altered.

    The draft answers a well-formed Token structure carrying an "otherwise invalid" token with
    MALFORMED_AUTH_TOKEN, and a forgery never becomes valid.
    """

    request_error_code = RequestErrorCode.MALFORMED_AUTH_TOKEN
    session_error_code = SessionErrorCode.MALFORMED_AUTH_TOKEN
    permanent = True


class UnknownIssuer(AuthError):
    """The token names an issuer key that this verifier does not trust.

    UNAUTHORIZED and not permanent: the key may be added to the trusted set later (key rotation).
    """


class ExpiredToken(AuthError):
    """The token's expiry (plus the clock skew allowance) has passed."""

    request_error_code = RequestErrorCode.EXPIRED_AUTH_TOKEN
    session_error_code = SessionErrorCode.EXPIRED_AUTH_TOKEN
    permanent = True


class NotYetValid(AuthError):
    """The token's not-before time (minus the clock skew allowance) is still in the future.

    The draft's UNAUTHORIZED "might be retryable if the authorization token is not yet valid", so this
    carries ``retry_after_s``.
    """


class Unauthorized(AuthError):
    """A valid token that does not grant this action on this namespace."""


_SESSION_ERRORS: Final[Mapping[SessionErrorCode, type[ProtocolError]]] = {
    SessionErrorCode.UNAUTHORIZED: _SessionUnauthorized,
    SessionErrorCode.MALFORMED_AUTH_TOKEN: _SessionMalformedAuthToken,
    SessionErrorCode.EXPIRED_AUTH_TOKEN: _SessionExpiredAuthToken,
}


# -- actions and namespaces ----------------------------------------------------------------------


class Action(StrEnum):
    """What a token allows its holder to do."""

    PUBLISH = "publish"
    """PUBLISH, PUBLISH_NAMESPACE."""
    SUBSCRIBE = "subscribe"
    """SUBSCRIBE, FETCH, TRACK_STATUS, SUBSCRIBE_NAMESPACE, SUBSCRIBE_TRACKS."""
    RELAY = "relay"
    """A relay-to-relay link: implies PUBLISH and SUBSCRIBE within the same prefixes."""


_MESSAGE_ACTIONS: Final[Mapping[str, Action]] = {
    "PUBLISH": Action.PUBLISH,
    "PUBLISH_NAMESPACE": Action.PUBLISH,
    "SUBSCRIBE": Action.SUBSCRIBE,
    "FETCH": Action.SUBSCRIBE,
    "TRACK_STATUS": Action.SUBSCRIBE,
    "SUBSCRIBE_NAMESPACE": Action.SUBSCRIBE,
    "SUBSCRIBE_TRACKS": Action.SUBSCRIBE,
}


def action_for_message(message_name: str) -> Action:
    """The action a draft-18 request message needs, by the draft's message name.

    REQUEST_UPDATE is not listed: it is authorized as the request it updates.
    """
    try:
        return _MESSAGE_ACTIONS[message_name]
    except KeyError:
        raise ValueError(f"message {message_name!r} carries no authorization token") from None


def _check_namespace(what: str, ns: Sequence[bytes]) -> Namespace:
    fields = tuple(ns)
    if len(fields) > MAX_NAMESPACE_FIELDS:
        raise ValueError(f"{what} has {len(fields)} fields, more than {MAX_NAMESPACE_FIELDS}")
    if not all(isinstance(f, bytes) for f in fields):
        raise ValueError(f"{what} fields must be bytes")
    if sum(len(f) for f in fields) > MAX_NAMESPACE_BYTES:
        raise ValueError(f"{what} is longer than {MAX_NAMESPACE_BYTES} bytes")
    return fields


def namespace_in_scope(namespace: Sequence[bytes], prefixes: Iterable[Namespace]) -> bool:
    """True when some prefix is a field-wise prefix of ``namespace`` (equal fields, in order).

    ``("kvnet", "v2", fp, "tenantA")`` covers ``("kvnet", "v2", fp, "tenantA", ...)`` but neither
    ``(..., "tenantB")`` nor ``(..., "tenantAB")``: fields are compared whole, never as string prefixes.
    """
    ns = tuple(namespace)
    return any(len(p) <= len(ns) and ns[: len(p)] == p for p in prefixes)


_LITERAL: Final = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")
_HEX: Final = frozenset(b"0123456789abcdef")


def format_field(field: bytes) -> str:
    return "".join(chr(b) if b in _LITERAL else f".{b:02x}" for b in field)


def format_namespace(namespace: Sequence[bytes]) -> str:
    """Render a namespace as the draft recommends ("Representing Namespace and Track Names").

    Fields joined by ``-``; bytes outside ``[A-Za-z0-9_]`` as ``.`` + two lowercase hex digits. The empty
    namespace renders as the empty string (so a namespace of one empty field cannot be rendered).
    """
    ns = tuple(namespace)
    if ns == (b"",):
        raise ValueError("a namespace of one empty field has no rendering")
    return "-".join(format_field(f) for f in ns)


def _parse_field(text: str) -> bytes:
    raw = text.encode("ascii")
    out = bytearray()
    i = 0
    while i < len(raw):
        b = raw[i]
        if b in _LITERAL:
            out.append(b)
            i += 1
            continue
        if b != ord(".") or i + 3 > len(raw) or raw[i + 1] not in _HEX or raw[i + 2] not in _HEX:
            raise ValueError(f"invalid escape or character at offset {i} in {text!r}")
        value = int(raw[i + 1 : i + 3], 16)
        if value in _LITERAL:
            # The draft requires one encoding per value: literal bytes must not be escaped.
            raise ValueError(f"redundant escape .{value:02x} in {text!r}")
        out.append(value)
        i += 3
    return bytes(out)


def parse_namespace(text: str) -> Namespace:
    """Inverse of ``format_namespace``, rejecting every non-canonical rendering as the draft requires."""
    if not text:
        return ()
    if not text.isascii():
        raise ValueError(f"namespace {text!r} is not ASCII")
    return _check_namespace("namespace", tuple(_parse_field(part) for part in text.split("-")))


# -- keys ----------------------------------------------------------------------------------------


def issuer_key_id(public_key: Ed25519PublicKey | bytes) -> bytes:
    """SHA-256 of the raw 32-byte Ed25519 public key (``kvnet.security.keys.key_id``, as for manifest
    signers)."""
    return keys.key_id(public_key)


@dataclass(frozen=True)
class IssuerKey:
    """A token issuer's Ed25519 private key.

    Relays only ever need the public half (``kvnet.security.keys`` files)."""

    private_key: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> IssuerKey:
        return cls(keys.generate_private_key())

    @classmethod
    def from_pem(cls, data: bytes) -> IssuerKey:
        """Parse an unencrypted PKCS#8 PEM Ed25519 private key (``ValueError`` if it is not one)."""
        return cls(keys.private_key_from_pem(data))

    @classmethod
    def load(cls, path: Path | str) -> IssuerKey:
        return cls(keys.load_private_key(path))

    def to_pem(self) -> bytes:
        return keys.private_key_pem(self.private_key)

    def save(self, path: Path | str, overwrite: bool = False) -> None:
        """Write the private key as PEM, mode 0600 from creation on; ``FileExistsError`` if it exists."""
        keys.save_private_key(path, self.private_key, overwrite)

    def save_public(self, path: Path | str) -> None:
        """Write the public key (PEM SubjectPublicKeyInfo) for distribution to relays."""
        keys.save_public_key(path, self.public_key)

    @property
    def public_key(self) -> Ed25519PublicKey:
        return self.private_key.public_key()

    @property
    def key_id(self) -> bytes:
        return issuer_key_id(self.public_key)

    def public_pem(self) -> bytes:
        return keys.public_key_pem(self.public_key)

    def sign(self, data: bytes) -> bytes:
        return self.private_key.sign(data)


def load_issuer_public_key(path: Path | str) -> Ed25519PublicKey:
    """Read a PEM Ed25519 public key (what a relay is configured with); ``ValueError`` if it is not one."""
    return keys.load_public_key(path)


# -- claims --------------------------------------------------------------------------------------


def _check_text(what: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string")
    if len(value.encode("utf-8", "surrogatepass")) > MAX_TEXT_BYTES:
        raise ValueError(f"{what} is longer than {MAX_TEXT_BYTES} UTF-8 bytes")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} is not encodable as UTF-8") from None
    return value


def _check_time(what: str, value: object) -> int:
    # bool is an int subclass and msgpack decodes true/false to bool: never a timestamp.
    if type(value) is not int or not 0 <= value <= _MAX_TIME:
        raise ValueError(f"{what} must be an integer in [0, 2^63)")
    return value


@dataclass(frozen=True, slots=True)
class Claims:
    """What a token asserts. Validated on construction, so invalid claims cannot exist."""

    subject: str
    """Who the token was issued to (a node, a relay, a user)."""
    tenant: str
    """The tenant the subject acts for."""
    actions: frozenset[Action]
    """Allowed actions."""
    prefixes: tuple[Namespace, ...]
    """Allowed namespace prefixes (field-wise); ``()`` as a prefix allows every namespace."""
    not_before: int
    """Unix seconds before which the token is not valid."""
    expires: int
    """Unix seconds from which the token is no longer valid."""
    issuer_key_id: bytes = b""
    """Key id of the issuer; empty until ``issue_token`` fills it in."""
    token_id: bytes = b""
    """16 random bytes naming this token; empty until ``issue_token`` fills it in."""

    def __post_init__(self) -> None:
        _check_text("subject", self.subject)
        _check_text("tenant", self.tenant)
        actions = frozenset(self.actions)
        if not actions or not all(isinstance(a, Action) for a in actions):
            raise ValueError(f"actions must be a non-empty set of Action, got {self.actions!r}")
        object.__setattr__(self, "actions", actions)
        prefixes = tuple(_check_namespace("prefix", p) for p in self.prefixes)
        if not 1 <= len(prefixes) <= MAX_PREFIXES:
            raise ValueError(f"a token names 1..{MAX_PREFIXES} prefixes, got {len(prefixes)}")
        object.__setattr__(self, "prefixes", prefixes)
        _check_time("not_before", self.not_before)
        _check_time("expires", self.expires)
        if self.expires <= self.not_before:
            raise ValueError("expires must be after not_before")
        if len(self.issuer_key_id) not in (0, KEY_ID_LEN):
            raise ValueError(f"issuer_key_id must be {KEY_ID_LEN} bytes")
        if len(self.token_id) not in (0, TOKEN_ID_LEN):
            raise ValueError(f"token_id must be {TOKEN_ID_LEN} bytes")

    def allows(self, action: Action) -> bool:
        if action in self.actions:
            return True
        return Action.RELAY in self.actions and action in (Action.PUBLISH, Action.SUBSCRIBE)


def make_claims(
    subject: str,
    tenant: str,
    actions: Iterable[Action | str],
    prefixes: Iterable[Sequence[bytes]],
    *,
    now: float,
    lifetime_s: float,
    not_before_s: float = 0.0,
) -> Claims:
    """Claims valid from ``now + not_before_s`` for ``lifetime_s`` seconds (for ``kvnet token issue``)."""
    if lifetime_s <= 0:
        raise ValueError("lifetime_s must be positive")
    start = int(now + not_before_s)
    return Claims(
        subject=subject,
        tenant=tenant,
        actions=frozenset(Action(a) for a in actions),
        prefixes=tuple(tuple(p) for p in prefixes),
        not_before=start,
        expires=start + max(1, int(lifetime_s)),
    )


def _claims_map(claims: Claims) -> dict[str, object]:
    # Insertion order is the sorted key order; msgpack keeps it, which makes the encoding canonical.
    return {
        "act": sorted(a.value for a in claims.actions),
        "exp": claims.expires,
        "jti": claims.token_id,
        "nbf": claims.not_before,
        "pfx": [list(p) for p in claims.prefixes],
        "sub": claims.subject,
        "ten": claims.tenant,
        "v": CLAIMS_VERSION,
    }


def _encode_claims(claims: Claims) -> bytes:
    return msgpack.packb(_claims_map(claims), use_bin_type=True)


def issue_token(issuer: IssuerKey, claims: Claims) -> bytes:
    """Sign ``claims`` and return the Token Value (Token Type ``KVNET_TOKEN_TYPE``).

    Fills in the issuer key id and a fresh random token id when the claims leave them empty.
    """
    kid = issuer.key_id
    if claims.issuer_key_id and claims.issuer_key_id != kid:
        raise ValueError("claims name a different issuer key")
    claims = dataclasses.replace(
        claims, issuer_key_id=kid, token_id=claims.token_id or secrets.token_bytes(TOKEN_ID_LEN)
    )
    signed = MAGIC + kid + _encode_claims(claims)
    return signed + issuer.sign(SIGNING_CONTEXT + signed)


_CLAIM_KEYS: Final = frozenset({"act", "exp", "jti", "nbf", "pfx", "sub", "ten", "v"})


def _decode_claims(data: bytes, kid: bytes) -> Claims:
    try:
        # Limits keep a hostile (or buggy) issuer's claims from allocating more than the token's size;
        # ext types are refused outright.
        obj = msgpack.unpackb(
            data,
            raw=False,
            use_list=False,
            strict_map_key=True,
            max_str_len=len(data),
            max_bin_len=len(data),
            max_array_len=MAX_NAMESPACE_FIELDS,
            max_map_len=len(_CLAIM_KEYS),
            max_ext_len=0,
        )
    # The C unpacker signals malformed input with ValueError subclasses (ExtraData, FormatError,
    # StackError, UnicodeDecodeError) and occasionally TypeError or OverflowError, depending on version.
    except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as exc:
        raise MalformedToken(f"undecodable claims: {type(exc).__name__}") from None
    if not isinstance(obj, dict) or set(obj) != _CLAIM_KEYS:
        raise MalformedToken("claims must be a map with exactly the kvnet claim keys")
    if type(obj["v"]) is not int or obj["v"] != CLAIMS_VERSION:
        raise MalformedToken(f"unsupported claims version {obj['v']!r}")
    act, pfx, jti = obj["act"], obj["pfx"], obj["jti"]
    if not isinstance(act, tuple) or not all(isinstance(a, str) for a in act):
        raise MalformedToken("act must be an array of strings")
    if not isinstance(pfx, tuple) or not all(isinstance(p, tuple) for p in pfx):
        raise MalformedToken("pfx must be an array of arrays")
    if not isinstance(jti, bytes) or len(jti) != TOKEN_ID_LEN:
        raise MalformedToken("jti must be 16 bytes")
    try:
        claims = Claims(
            subject=obj["sub"],
            tenant=obj["ten"],
            actions=frozenset(Action(a) for a in act),
            prefixes=pfx,
            not_before=obj["nbf"],
            expires=obj["exp"],
            issuer_key_id=kid,
            token_id=jti,
        )
    except ValueError as exc:
        raise MalformedToken(f"invalid claims: {exc}") from None
    # Canonical form: exactly one byte string per set of claims, so token digests and signatures are
    # unambiguous (no duplicate actions, no alternative integer widths, keys in order).
    if _encode_claims(claims) != data:
        raise MalformedToken("claims are not canonically encoded")
    return claims


# -- verification --------------------------------------------------------------------------------


class TokenVerifier:
    """Checks kvnet tokens against trusted issuer public keys and an injected clock."""

    def __init__(
        self,
        trusted_issuer_public_keys: Iterable[Ed25519PublicKey | bytes],
        clock: Callable[[], float],
        max_token_size: int = DEFAULT_MAX_TOKEN_SIZE,
        clock_skew_s: float = DEFAULT_CLOCK_SKEW_S,
    ) -> None:
        """``trusted_issuer_public_keys``: keys, or raw 32-byte public keys; ``clock``: Unix seconds."""
        if max_token_size < _HEADER_LEN + SIGNATURE_LEN + 1:
            raise ValueError(f"max_token_size {max_token_size} cannot hold a token")
        if clock_skew_s < 0:
            raise ValueError("clock_skew_s must not be negative")
        self._keys: dict[bytes, Ed25519PublicKey] = {}
        for key in trusted_issuer_public_keys:
            pub = Ed25519PublicKey.from_public_bytes(key) if isinstance(key, bytes) else key
            self._keys[issuer_key_id(pub)] = pub
        self.clock = clock
        self.max_token_size = max_token_size
        self.clock_skew_s = clock_skew_s

    @property
    def trusted_key_ids(self) -> frozenset[bytes]:
        return frozenset(self._keys)

    def verify(self, token: bytes) -> Claims:
        """Return the claims of a genuine token that is valid now; raise an ``AuthError`` otherwise.

        Order: shape, issuer, signature, then claims, then time. Untrusted bytes are never parsed as
        msgpack before the signature has been checked.
        """
        if not isinstance(token, bytes | bytearray | memoryview):
            raise MalformedToken("token must be bytes")
        token = bytes(token)
        if len(token) > self.max_token_size:
            raise MalformedToken(f"token of {len(token)} bytes exceeds {self.max_token_size}")
        if len(token) < _HEADER_LEN + SIGNATURE_LEN + 1:
            raise MalformedToken(f"token of {len(token)} bytes is too short")
        if token[: len(MAGIC)] != MAGIC:
            raise MalformedToken("not a kvnet token (bad magic or version)")
        kid = token[len(MAGIC) : _HEADER_LEN]
        pub = self._keys.get(kid)
        if pub is None:
            raise UnknownIssuer(f"issuer key {kid.hex()[:16]}... is not trusted")
        signed, signature = token[:-SIGNATURE_LEN], token[-SIGNATURE_LEN:]
        try:
            pub.verify(signature, SIGNING_CONTEXT + signed)
        except _CryptoInvalidSignature:
            raise InvalidSignature("token signature does not verify") from None
        claims = _decode_claims(signed[_HEADER_LEN:], kid)
        self.check_validity(claims)
        return claims

    def check_validity(self, claims: Claims) -> None:
        """Raise ``NotYetValid`` or ``ExpiredToken`` unless ``claims`` are within their window now."""
        now = self.clock()
        if now + self.clock_skew_s < claims.not_before:
            wait = claims.not_before - self.clock_skew_s - now
            raise NotYetValid(f"token not valid for another {wait:.0f} s", retry_after_s=wait)
        if now - self.clock_skew_s >= claims.expires:
            raise ExpiredToken(f"token expired {now - claims.expires:.0f} s ago")


_MAX_TOKEN_FILE_SIZE: Final = 2 * DEFAULT_MAX_TOKEN_SIZE
"""Largest token file read: a base64url token of ``DEFAULT_MAX_TOKEN_SIZE`` bytes plus line breaks."""


def read_token_file(path: Path) -> bytes:
    """The kvnet Token Value in ``path`` (``kvnet token issue`` writes one): the raw bytes, or their
    base64url text (padding and line breaks optional). ``ValueError`` naming the file when it is too large
    or holds no kvnet token; ``OSError`` when it cannot be read. Nodes and relays read tokens only here."""
    with Path(path).open("rb") as f:
        data = f.read(_MAX_TOKEN_FILE_SIZE + 1)
    if len(data) > _MAX_TOKEN_FILE_SIZE:
        raise ValueError(f"{path}: larger than any token file ({_MAX_TOKEN_FILE_SIZE} bytes)")
    token = data
    if not data.startswith(MAGIC):
        text = b"".join(data.split())
        try:
            token = base64.urlsafe_b64decode(text + b"=" * (-len(text) % 4))
        except (binascii.Error, ValueError):
            raise ValueError(f"{path}: not a kvnet token (raw or base64url)") from None
    if not token.startswith(MAGIC):
        raise ValueError(f"{path}: not a kvnet token (raw or base64url)")
    if len(token) > DEFAULT_MAX_TOKEN_SIZE:
        raise ValueError(f"{path}: a token has at most {DEFAULT_MAX_TOKEN_SIZE} bytes, this one {len(token)}")
    return token
