"""The structures MoQT draft-18 control messages are built from, and their codecs.

Owns: the limits and enums of the control-message wire format, Track Namespace / Track Name ("Track
Naming"), Location, Key-Value-Pair and Properties, Reason Phrase, the AUTHORIZATION TOKEN structure, the
Subscription Filter and Message Parameters (which parameter has which encoding). ``proto.messages``
builds each message from these and re-exports the public names. Decoding peer bytes raises only
``ProtocolError`` subclasses; encoding what cannot be represented raises ``UsageError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Final, TypeAlias

from .buffer import VI64_MAX, Buffer, BufferReadError, BufferWriteError
from .errors import (
    KeyValueFormattingError,
    ProtocolViolation,
    UsageError,
)

# -- limits ------------------------------------------------------------------------------------

MAX_MESSAGE_LENGTH: Final = 0xFFFF  # Message Length is 16 bits (section "Control Messages")
MAX_NAMESPACE_FIELDS: Final = 32  # section "Track Naming"
MAX_FULL_TRACK_NAME_LENGTH: Final = 4096  # section "Track Naming"
MAX_REASON_PHRASE_LENGTH: Final = 1024  # section "Reason Phrase Structure"
MAX_KEY_VALUE_LENGTH: Final = 0xFFFF  # section "Key-Value-Pair Structure"
MAX_NEW_SESSION_URI_LENGTH: Final = 8192  # section "GOAWAY"

TrackNamespace: TypeAlias = tuple[bytes, ...]
"""Track Namespace: 0..32 non-empty fields (section "Track Naming")."""


# -- enums -------------------------------------------------------------------------------------


class GroupOrder(IntEnum):
    """GROUP_ORDER values (section "GROUP ORDER Parameter")."""

    ASCENDING = 0x1
    DESCENDING = 0x2


class FilterType(IntEnum):
    """Subscription Filter types (section "Subscription Filters")."""

    NEXT_GROUP_START = 0x1
    LARGEST_OBJECT = 0x2
    ABSOLUTE_START = 0x3
    ABSOLUTE_RANGE = 0x4


class FetchType(IntEnum):
    """Fetch Type (section "FETCH")."""

    STANDALONE = 0x1
    RELATIVE_JOINING = 0x2
    ABSOLUTE_JOINING = 0x3


class AliasType(IntEnum):
    """Authorization Token Alias Type registry (section "AUTHORIZATION TOKEN Parameter")."""

    DELETE = 0x0
    REGISTER = 0x1
    USE_ALIAS = 0x2
    USE_VALUE = 0x3


class ParameterType(IntEnum):
    """Message Parameter types (IANA "Message Parameters")."""

    OBJECT_DELIVERY_TIMEOUT = 0x02
    AUTHORIZATION_TOKEN = 0x03
    RENDEZVOUS_TIMEOUT = 0x04
    SUBGROUP_DELIVERY_TIMEOUT = 0x06
    EXPIRES = 0x08
    LARGEST_OBJECT = 0x09
    FILL_TIMEOUT = 0x0A
    FORWARD = 0x10
    SUBSCRIBER_PRIORITY = 0x20
    SUBSCRIPTION_FILTER = 0x21
    GROUP_ORDER = 0x22
    NEW_GROUP_REQUEST = 0x32
    TRACK_NAMESPACE_PREFIX = 0x34


class SetupOptionType(IntEnum):
    """Setup Option types (IANA "Setup Options")."""

    PATH = 0x01
    AUTHORIZATION_TOKEN = 0x03
    MAX_AUTH_TOKEN_CACHE_SIZE = 0x04
    AUTHORITY = 0x05
    MOQT_IMPLEMENTATION = 0x07


class PropertyType(IntEnum):
    """Property types defined by draft-18 (IANA "Properties")."""

    OBJECT_DELIVERY_TIMEOUT = 0x02
    MAX_CACHE_DURATION = 0x04
    SUBGROUP_DELIVERY_TIMEOUT = 0x06
    IMMUTABLE_PROPERTIES = 0x0B
    DEFAULT_PUBLISHER_PRIORITY = 0x0E
    DEFAULT_PUBLISHER_GROUP_ORDER = 0x22
    DYNAMIC_GROUPS = 0x30
    PRIOR_GROUP_ID_GAP = 0x3C
    PRIOR_OBJECT_ID_GAP = 0x3E


# -- shared structures -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, order=True)
class Location:
    """{Group, Object} (section "Location Structure"); ordering is the draft's Location order."""

    group: int
    object: int


@dataclass(frozen=True, slots=True)
class KeyValuePair:
    """One Key-Value-Pair (section "Key-Value-Pair Structure"): even type -> int, odd type -> bytes."""

    type: int
    value: int | bytes


Properties: TypeAlias = tuple[KeyValuePair, ...]
"""Track or Object Properties: Key-Value-Pairs in non-decreasing type order (section "Properties")."""


@dataclass(frozen=True, slots=True)
class AuthToken:
    """The Token structure of AUTHORIZATION TOKEN (section "AUTHORIZATION TOKEN Parameter").

    DELETE and USE_ALIAS carry only ``alias``; REGISTER carries ``alias``, ``token_type``
    and ``value``; USE_VALUE carries ``token_type`` and ``value``.
    """

    alias_type: AliasType
    alias: int | None = None
    token_type: int | None = None
    value: bytes | None = None


@dataclass(frozen=True, slots=True)
class SubscriptionFilter:
    """Subscription Filter (section "Subscription Filters").

    ``start`` is present for ABSOLUTE_START and ABSOLUTE_RANGE, ``end_group_delta`` for
    ABSOLUTE_RANGE only.
    """

    filter_type: FilterType
    start: Location | None = None
    end_group_delta: int | None = None


@dataclass(frozen=True, slots=True)
class MessageParameters:
    """Message Parameters (section "Message Parameters"); None means absent.

    Which parameters each message may carry is checked on encode (UsageError) and on
    decode (ProtocolViolation).
    """

    object_delivery_timeout: int | None = None
    """OBJECT_DELIVERY_TIMEOUT (0x02), varint, milliseconds."""
    authorization_tokens: tuple[AuthToken, ...] = ()
    """AUTHORIZATION_TOKEN (0x03), length-prefixed Token; may repeat."""
    rendezvous_timeout: int | None = None
    """RENDEZVOUS_TIMEOUT (0x04), varint, milliseconds."""
    subgroup_delivery_timeout: int | None = None
    """SUBGROUP_DELIVERY_TIMEOUT (0x06), varint, milliseconds."""
    expires: int | None = None
    """EXPIRES (0x08), varint, milliseconds."""
    largest_object: Location | None = None
    """LARGEST_OBJECT (0x09), Location."""
    fill_timeout: int | None = None
    """FILL_TIMEOUT (0x0A), varint, milliseconds."""
    forward: int | None = None
    """FORWARD (0x10), uint8, 0 or 1."""
    subscriber_priority: int | None = None
    """SUBSCRIBER_PRIORITY (0x20), uint8."""
    subscription_filter: SubscriptionFilter | None = None
    """SUBSCRIPTION_FILTER (0x21), length-prefixed Subscription Filter."""
    group_order: GroupOrder | None = None
    """GROUP_ORDER (0x22), uint8, 1 or 2."""
    new_group_request: int | None = None
    """NEW_GROUP_REQUEST (0x32), varint."""
    track_namespace_prefix: TrackNamespace | None = None
    """TRACK_NAMESPACE_PREFIX (0x34), Track Namespace encoding."""

    def present_types(self) -> frozenset[ParameterType]:
        """The parameter types this object carries."""
        present = {ptype for ptype, (name, _kind) in _PARAM_SPECS.items() if getattr(self, name) is not None}
        if not self.authorization_tokens:
            present.discard(ParameterType.AUTHORIZATION_TOKEN)
        return frozenset(present)


NO_PARAMETERS: Final = MessageParameters()

# Parameter type -> (field name, value encoding).
_PARAM_SPECS: Final[dict[ParameterType, tuple[str, str]]] = {
    ParameterType.OBJECT_DELIVERY_TIMEOUT: ("object_delivery_timeout", "varint"),
    ParameterType.AUTHORIZATION_TOKEN: ("authorization_tokens", "token"),
    ParameterType.RENDEZVOUS_TIMEOUT: ("rendezvous_timeout", "varint"),
    ParameterType.SUBGROUP_DELIVERY_TIMEOUT: ("subgroup_delivery_timeout", "varint"),
    ParameterType.EXPIRES: ("expires", "varint"),
    ParameterType.LARGEST_OBJECT: ("largest_object", "location"),
    ParameterType.FILL_TIMEOUT: ("fill_timeout", "varint"),
    ParameterType.FORWARD: ("forward", "uint8"),
    ParameterType.SUBSCRIBER_PRIORITY: ("subscriber_priority", "uint8"),
    ParameterType.SUBSCRIPTION_FILTER: ("subscription_filter", "filter"),
    ParameterType.GROUP_ORDER: ("group_order", "uint8"),
    ParameterType.NEW_GROUP_REQUEST: ("new_group_request", "varint"),
    ParameterType.TRACK_NAMESPACE_PREFIX: ("track_namespace_prefix", "namespace"),
}
# The same as plain ints (enum members cost more per access): in type order for the encoder's loop,
# and by wire type for the decoder's lookup.
_PARAM_FIELDS: Final = tuple((int(ptype), name, kind) for ptype, (name, kind) in _PARAM_SPECS.items())
_PARAM_SPECS_BY_INT: Final = {int(t): (t, name, kind) for t, (name, kind) in _PARAM_SPECS.items()}
_TOKEN_PARAM: Final = int(ParameterType.AUTHORIZATION_TOKEN)


# -- primitive codecs --------------------------------------------------------------------------


def validate_track_namespace(
    namespace: TrackNamespace, track_name: bytes = b"", error: type[Exception] = UsageError
) -> None:
    """Check the draft's Track Namespace / Full Track Name limits, raising ``error``."""
    if len(namespace) > MAX_NAMESPACE_FIELDS:
        raise error(f"track namespace has {len(namespace)} fields, more than {MAX_NAMESPACE_FIELDS}")
    total = len(track_name)
    for ns_field in namespace:
        if not ns_field:
            raise error("empty track namespace field")
        total += len(ns_field)
    if total > MAX_FULL_TRACK_NAME_LENGTH:
        raise error(f"full track name is {total} bytes, more than {MAX_FULL_TRACK_NAME_LENGTH}")


def push_track_namespace(buf: Buffer, namespace: TrackNamespace) -> None:
    """Write a Track Namespace (section "Track Naming"), first checked against the draft's limits: a
    message we send never breaks them (``UsageError``)."""
    validate_track_namespace(namespace)
    _push_namespace_fields(buf, namespace)


def _push_namespace_fields(buf: Buffer, namespace: TrackNamespace) -> None:
    buf.push_vi64(len(namespace))
    for ns_field in namespace:
        buf.push_vi64(len(ns_field))
        buf.push_bytes(ns_field)


def pull_track_namespace(buf: Buffer) -> TrackNamespace:
    """Read a Track Namespace, enforcing field count, empty field and total length rules."""
    count = buf.pull_vi64()
    if count > MAX_NAMESPACE_FIELDS:
        raise ProtocolViolation(f"track namespace has {count} fields, more than {MAX_NAMESPACE_FIELDS}")
    fields: list[bytes] = []
    total = 0
    for _ in range(count):
        length = buf.pull_vi64()
        if length == 0:
            raise ProtocolViolation("empty track namespace field")
        total += length
        if total > MAX_FULL_TRACK_NAME_LENGTH:
            raise ProtocolViolation("track namespace longer than 4096 bytes")
        fields.append(buf.pull_bytes(length))
    return tuple(fields)


def pull_full_track_name(buf: Buffer) -> tuple[TrackNamespace, bytes]:
    namespace = pull_track_namespace(buf)
    name_length = buf.pull_vi64()
    if name_length + sum(len(f) for f in namespace) > MAX_FULL_TRACK_NAME_LENGTH:
        raise ProtocolViolation("full track name longer than 4096 bytes")
    return namespace, buf.pull_bytes(name_length)


def push_full_track_name(buf: Buffer, namespace: TrackNamespace, name: bytes) -> None:
    validate_track_namespace(namespace, name)
    _push_namespace_fields(buf, namespace)
    buf.push_vi64(len(name))
    buf.push_bytes(name)


def push_location(buf: Buffer, location: Location) -> None:
    """Write a Location."""
    buf.push_vi64(location.group)
    buf.push_vi64(location.object)


def pull_location(buf: Buffer) -> Location:
    """Read a Location."""
    group = buf.pull_vi64()
    return Location(group, buf.pull_vi64())


def push_reason(buf: Buffer, reason: str) -> None:
    data = reason.encode("utf-8")
    if len(data) > MAX_REASON_PHRASE_LENGTH:
        raise UsageError(f"reason phrase longer than {MAX_REASON_PHRASE_LENGTH} bytes")
    buf.push_vi64(len(data))
    buf.push_bytes(data)


def pull_reason(buf: Buffer) -> str:
    length = buf.pull_vi64()
    if length > MAX_REASON_PHRASE_LENGTH:
        raise ProtocolViolation(f"reason phrase longer than {MAX_REASON_PHRASE_LENGTH} bytes")
    try:
        return buf.pull_bytes(length).decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolViolation("reason phrase is not UTF-8") from None


def push_key_value_pairs(buf: Buffer, pairs: Properties) -> None:
    """Write Key-Value-Pairs with delta-encoded types; types must be non-decreasing."""
    previous = 0
    for pair in pairs:
        if pair.type < previous:
            raise UsageError("key-value pairs must be in non-decreasing type order")
        buf.push_vi64(pair.type - previous)
        previous = pair.type
        if pair.type % 2 == 0:
            if not isinstance(pair.value, int):
                raise UsageError(f"key-value type {pair.type:#x} is even and needs an int value")
            buf.push_vi64(pair.value)
        else:
            if not isinstance(pair.value, bytes | bytearray | memoryview):
                raise UsageError(f"key-value type {pair.type:#x} is odd and needs a bytes value")
            if len(pair.value) > MAX_KEY_VALUE_LENGTH:
                raise UsageError("key-value value longer than 65535 bytes")
            buf.push_vi64(len(pair.value))
            buf.push_bytes(pair.value)


def pull_key_value_pairs(buf: Buffer, end: int) -> Properties:
    """Read Key-Value-Pairs from the cursor up to ``end`` (their bounding length)."""
    pairs: list[KeyValuePair] = []
    previous = 0
    while buf.tell() < end:
        ktype = previous + buf.pull_vi64()
        if ktype > VI64_MAX:
            raise ProtocolViolation("key-value type larger than 2^64-1")
        previous = ktype
        value: int | bytes
        if ktype % 2 == 0:
            value = buf.pull_vi64()
        else:
            length = buf.pull_vi64()
            if length > MAX_KEY_VALUE_LENGTH:
                raise ProtocolViolation("key-value length larger than 65535")
            value = buf.pull_bytes(length)
        pairs.append(KeyValuePair(ktype, value))
    if buf.tell() != end:
        raise ProtocolViolation("key-value pair runs past its bounding length")
    return tuple(pairs)


def encode_key_value_pairs(pairs: Properties) -> bytes:
    """Serialize Key-Value-Pairs (without any length prefix)."""
    buf = Buffer()
    try:
        push_key_value_pairs(buf, pairs)
    except BufferWriteError as exc:
        raise UsageError(str(exc)) from None
    return buf.data


def decode_key_value_pairs(data: bytes | memoryview) -> Properties:
    """Parse a whole byte string of Key-Value-Pairs, raising ProtocolViolation if malformed."""
    buf = Buffer(data)
    try:
        return pull_key_value_pairs(buf, len(data))
    except BufferReadError:
        raise ProtocolViolation("truncated key-value pair") from None


# -- token, filter, parameters -----------------------------------------------------------------


def encode_auth_token(token: AuthToken) -> bytes:
    buf = Buffer()
    buf.push_vi64(token.alias_type)
    has_alias = token.alias_type in (AliasType.DELETE, AliasType.REGISTER, AliasType.USE_ALIAS)
    has_value = token.alias_type in (AliasType.REGISTER, AliasType.USE_VALUE)
    name = token.alias_type.name
    if has_alias != (token.alias is not None):
        raise UsageError(f"token alias must {'' if has_alias else 'not '}be set for {name}")
    if has_value != (token.token_type is not None and token.value is not None):
        raise UsageError(f"token type and value must {'' if has_value else 'not '}be set for {name}")
    if token.alias is not None:
        buf.push_vi64(token.alias)
    if token.token_type is not None and token.value is not None:
        buf.push_vi64(token.token_type)
        buf.push_bytes(token.value)
    return buf.data


def decode_auth_token(data: bytes | memoryview) -> AuthToken:
    """Parse a Token structure; an undecodable one is KEY_VALUE_FORMATTING_ERROR (section
    "AUTHORIZATION TOKEN Parameter")."""
    buf = Buffer(data)
    try:
        raw_type = buf.pull_vi64()
        if raw_type > AliasType.USE_VALUE:
            raise KeyValueFormattingError(f"unknown token alias type {raw_type}")
        alias_type = AliasType(raw_type)
        alias = token_type = None
        value = None
        if alias_type != AliasType.USE_VALUE:
            alias = buf.pull_vi64()
        if alias_type in (AliasType.REGISTER, AliasType.USE_VALUE):
            token_type = buf.pull_vi64()
            value = buf.pull_bytes(buf.remaining())
    except BufferReadError:
        raise KeyValueFormattingError("truncated token") from None
    if not buf.eof():
        raise KeyValueFormattingError("trailing bytes after token")
    return AuthToken(alias_type, alias, token_type, value)


def _encode_filter(flt: SubscriptionFilter) -> bytes:
    buf = Buffer()
    buf.push_vi64(flt.filter_type)
    needs_start = flt.filter_type in (FilterType.ABSOLUTE_START, FilterType.ABSOLUTE_RANGE)
    needs_end = flt.filter_type == FilterType.ABSOLUTE_RANGE
    if needs_start != (flt.start is not None) or needs_end != (flt.end_group_delta is not None):
        raise UsageError(f"subscription filter fields do not match {flt.filter_type.name}")
    if flt.start is not None:
        push_location(buf, flt.start)
    if flt.end_group_delta is not None:
        buf.push_vi64(flt.end_group_delta)
    return buf.data


def _decode_filter(data: bytes) -> SubscriptionFilter:
    buf = Buffer(data)
    try:
        raw_type = buf.pull_vi64()
        if raw_type not in (1, 2, 3, 4):
            raise ProtocolViolation(f"unknown subscription filter type {raw_type}")
        ftype = FilterType(raw_type)
        start = end = None
        if ftype in (FilterType.ABSOLUTE_START, FilterType.ABSOLUTE_RANGE):
            start = pull_location(buf)
        if ftype == FilterType.ABSOLUTE_RANGE:
            end = buf.pull_vi64()
            assert start is not None
            if start.group + end > VI64_MAX:
                raise ProtocolViolation("subscription filter end group larger than 2^64-1")
    except BufferReadError:
        raise ProtocolViolation("truncated subscription filter") from None
    if not buf.eof():
        raise ProtocolViolation("trailing bytes after subscription filter")
    return SubscriptionFilter(ftype, start, end)


def push_parameters(buf: Buffer, params: MessageParameters, allowed: frozenset[ParameterType]) -> None:
    if params is NO_PARAMETERS:
        buf.push_vi64(0)  # most requests carry none: skip looking at every parameter type
        return
    entries: list[tuple[int, str, object]] = []
    for ptype, name, kind in _PARAM_FIELDS:  # ascending type order, as the delta encoding needs
        value = getattr(params, name)
        if value is None:
            continue
        if ptype == _TOKEN_PARAM:
            entries.extend((ptype, kind, token) for token in value)
        else:
            entries.append((ptype, kind, value))
    for ptype, _kind, _value in entries:
        if ptype not in allowed:
            raise UsageError(f"parameter {ParameterType(ptype).name} is not allowed in this message")
    buf.push_vi64(len(entries))
    previous = 0
    for ptype, kind, value in entries:
        buf.push_vi64(ptype - previous)
        previous = ptype
        if kind == "varint":
            assert isinstance(value, int)
            buf.push_vi64(value)
        elif kind == "uint8":
            assert isinstance(value, int)
            if ptype == ParameterType.FORWARD and value not in (0, 1):
                raise UsageError("FORWARD must be 0 or 1")
            if ptype == ParameterType.GROUP_ORDER and value not in (1, 2):
                raise UsageError("GROUP_ORDER must be 1 or 2")
            buf.push_uint8(value)
        elif kind == "location":
            assert isinstance(value, Location)
            push_location(buf, value)
        elif kind == "namespace":
            assert isinstance(value, tuple)
            push_track_namespace(buf, value)
        else:
            if kind == "token":
                assert isinstance(value, AuthToken)
                data = encode_auth_token(value)
            else:
                assert isinstance(value, SubscriptionFilter)
                data = _encode_filter(value)
            buf.push_vi64(len(data))
            buf.push_bytes(data)


def pull_parameters(buf: Buffer, allowed: frozenset[ParameterType]) -> MessageParameters:
    count = buf.pull_vi64()
    if count > buf.remaining():
        # Every parameter takes at least two bytes; refuse early instead of looping on garbage.
        raise ProtocolViolation("parameter count exceeds message length")
    values: dict[str, object] = {}
    tokens: list[AuthToken] = []
    ptype = 0
    for index in range(count):
        delta = buf.pull_vi64()
        if index and delta == 0 and ptype != ParameterType.AUTHORIZATION_TOKEN:
            raise ProtocolViolation(f"duplicate parameter {ptype:#x}")
        ptype += delta
        if ptype > VI64_MAX:
            raise ProtocolViolation("parameter type larger than 2^64-1")
        spec = _PARAM_SPECS_BY_INT.get(ptype)
        if spec is None:
            raise ProtocolViolation(f"unknown parameter type {ptype:#x}")
        known, name, kind = spec
        if known not in allowed:
            raise ProtocolViolation(f"parameter {known.name} is not allowed in this message")
        if kind == "varint":
            values[name] = buf.pull_vi64()
        elif kind == "uint8":
            raw = buf.pull_uint8()
            if known == ParameterType.FORWARD and raw not in (0, 1):
                raise ProtocolViolation(f"FORWARD value {raw} is not 0 or 1")
            if known == ParameterType.GROUP_ORDER:
                if raw not in (1, 2):
                    raise ProtocolViolation(f"GROUP_ORDER value {raw} is not 1 or 2")
                values[name] = GroupOrder(raw)
            else:
                values[name] = raw
        elif kind == "location":
            values[name] = pull_location(buf)
        elif kind == "namespace":
            values[name] = pull_track_namespace(buf)
        else:
            data = buf.pull_bytes(buf.pull_vi64())
            if kind == "token":
                tokens.append(decode_auth_token(data))
            else:
                values[name] = _decode_filter(data)
    return MessageParameters(authorization_tokens=tuple(tokens), **values)  # type: ignore[arg-type]
