"""MoQT draft-18 control messages: one frozen dataclass per message, their codec and a reader.

Owns the wire format of everything sent on the control stream and on bidirectional
request streams (draft-18 section "Control Messages"): which parameters each message may
carry, each message's fields and their order, framing (type + length) and the incremental
reader. The structures messages are built from (Track Namespace, Location, Key-Value-Pair,
Reason Phrase, Message Parameters, AUTHORIZATION TOKEN) and their codecs are in
``proto.structures``; the public ones are re-exported here, so ``proto.messages`` stays the
one import for message users. It does not know about sessions, request state or roles: a decoder
checks everything that can be checked from the bytes of one message, the session
checks the rest (parity of Request IDs, which message may come when, ...).

Encoding a value that cannot be represented raises ``UsageError``. Decoding peer
bytes raises only ``ProtocolError`` subclasses, or returns None for "need more data"
(``ControlMessageReader.next_message``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Final, Self

from .buffer import Buffer, BufferReadError, BufferWriteError, vi64_decode, vi64_encode
from .errors import (
    LimitExceeded,
    MalformedAuthority,
    MalformedPath,
    ProtocolError,
    ProtocolViolation,
    RequestErrorCode,
    UsageError,
)
from .structures import (
    MAX_FULL_TRACK_NAME_LENGTH,
    MAX_KEY_VALUE_LENGTH,
    MAX_MESSAGE_LENGTH,
    MAX_NAMESPACE_FIELDS,
    MAX_NEW_SESSION_URI_LENGTH,
    MAX_REASON_PHRASE_LENGTH,
    NO_PARAMETERS,
    AliasType,
    AuthToken,
    FetchType,
    FilterType,
    GroupOrder,
    KeyValuePair,
    Location,
    MessageParameters,
    ParameterType,
    Properties,
    PropertyType,
    SetupOptionType,
    SubscriptionFilter,
    TrackNamespace,
    decode_auth_token,
    decode_key_value_pairs,
    encode_auth_token,
    encode_key_value_pairs,
    pull_full_track_name,
    pull_key_value_pairs,
    pull_location,
    pull_parameters,
    pull_reason,
    pull_track_namespace,
    push_full_track_name,
    push_key_value_pairs,
    push_location,
    push_parameters,
    push_reason,
    push_track_namespace,
    validate_track_namespace,
)

__all__ = [
    "MAX_FULL_TRACK_NAME_LENGTH",
    "MAX_KEY_VALUE_LENGTH",
    "MAX_MESSAGE_LENGTH",
    "MAX_NAMESPACE_FIELDS",
    "MAX_NEW_SESSION_URI_LENGTH",
    "MAX_REASON_PHRASE_LENGTH",
    "MESSAGE_TYPES",
    "AliasType",
    "AuthToken",
    "ControlMessage",
    "ControlMessageReader",
    "Fetch",
    "FetchOk",
    "FetchType",
    "FilterType",
    "Goaway",
    "GroupOrder",
    "JoiningFetch",
    "KeyValuePair",
    "Location",
    "MessageParameters",
    "Namespace",
    "NamespaceDone",
    "ParameterType",
    "Properties",
    "PropertyType",
    "Publish",
    "PublishBlocked",
    "PublishDone",
    "PublishNamespace",
    "PublishOk",
    "Redirect",
    "RequestError",
    "RequestOk",
    "RequestUpdate",
    "Setup",
    "SetupOptionType",
    "StandaloneFetch",
    "Subscribe",
    "SubscribeNamespace",
    "SubscribeOk",
    "SubscribeTracks",
    "SubscriptionFilter",
    "TrackNamespace",
    "TrackStatus",
    "decode_key_value_pairs",
    "decode_message_payload",
    "encode_key_value_pairs",
    "encode_message",
    "pull_key_value_pairs",
    "pull_location",
    "pull_track_namespace",
    "push_key_value_pairs",
    "push_location",
    "push_track_namespace",
    "validate_track_namespace",
]

def _allowed(*types: ParameterType) -> frozenset[ParameterType]:
    return frozenset(types)


_P = ParameterType
_AUTH = _P.AUTHORIZATION_TOKEN
# Which parameters each message may carry, from each parameter's definition (section "Message
# Parameters" and the sub-sections after it).
_PUBLISH_OK_PARAMS: Final = _allowed(
    _P.SUBGROUP_DELIVERY_TIMEOUT, _P.OBJECT_DELIVERY_TIMEOUT, _P.SUBSCRIBER_PRIORITY, _P.GROUP_ORDER,
    _P.SUBSCRIPTION_FILTER, _P.EXPIRES, _P.FORWARD, _P.NEW_GROUP_REQUEST,
)  # fmt: skip


# -- messages ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ControlMessage:
    """Base of all control messages; ``TYPE`` is the Message Type (section "Control Messages")."""

    TYPE: ClassVar[int]
    ALLOWED_PARAMETERS: ClassVar[frozenset[ParameterType]] = frozenset()

    def _push_payload(self, buf: Buffer) -> None:
        raise UsageError(f"{type(self).__name__} is not a concrete control message")

    @classmethod
    def _pull_payload(cls, buf: Buffer) -> Self:
        raise UsageError(f"{cls.__name__} is not a concrete control message")


@dataclass(frozen=True, slots=True)
class Setup(ControlMessage):
    """SETUP (section "SETUP"): Setup Options as Key-Value-Pairs spanning the payload.

    Unknown options are kept (in order, duplicates allowed) so they can be inspected;
    the draft says to ignore them.
    """

    TYPE: ClassVar[int] = 0x2F00
    path: str | None = None
    """PATH (0x01): path-abempty [ "?" query ] of the MoQT URI; client only, native QUIC."""
    authority: str | None = None
    """AUTHORITY (0x05): authority of the MoQT URI; client only, native QUIC."""
    max_auth_token_cache_size: int | None = None
    """MAX_AUTH_TOKEN_CACHE_SIZE (0x04): bytes of registered tokens the sender will store (default 0)."""
    authorization_tokens: tuple[AuthToken, ...] = ()
    """AUTHORIZATION TOKEN (0x03) options, in order; may repeat."""
    implementation: bytes | None = None
    """MOQT_IMPLEMENTATION (0x07): implementation name and version (SHOULD be UTF-8)."""
    unknown_options: Properties = ()
    """Options this implementation does not know, as received."""

    def _push_payload(self, buf: Buffer) -> None:
        options: list[KeyValuePair] = list(self.unknown_options)
        if self.path is not None:
            options.append(KeyValuePair(SetupOptionType.PATH, self.path.encode("utf-8")))
        for token in self.authorization_tokens:
            options.append(KeyValuePair(SetupOptionType.AUTHORIZATION_TOKEN, encode_auth_token(token)))
        if self.max_auth_token_cache_size is not None:
            size = self.max_auth_token_cache_size
            options.append(KeyValuePair(SetupOptionType.MAX_AUTH_TOKEN_CACHE_SIZE, size))
        if self.authority is not None:
            options.append(KeyValuePair(SetupOptionType.AUTHORITY, self.authority.encode("utf-8")))
        if self.implementation is not None:
            options.append(KeyValuePair(SetupOptionType.MOQT_IMPLEMENTATION, self.implementation))
        for option in self.unknown_options:
            if option.type in _SETUP_OPTION_INTS:
                raise UsageError(f"setup option {option.type:#x} is known; use its field")
        options.sort(key=lambda kv: kv.type)  # stable: keeps the order of repeated types
        push_key_value_pairs(buf, tuple(options))

    @classmethod
    def _pull_payload(cls, buf: Buffer) -> Self:
        options = pull_key_value_pairs(buf, buf.capacity)
        path = authority = None
        cache_size = None
        implementation = None
        tokens: list[AuthToken] = []
        unknown: list[KeyValuePair] = []
        seen: set[int] = set()
        for option in options:
            otype = option.type
            if otype in _SETUP_OPTION_INTS and otype != SetupOptionType.AUTHORIZATION_TOKEN:
                if otype in seen:
                    raise ProtocolViolation(f"duplicate setup option {otype:#x}")
                seen.add(otype)
            value = option.value
            if otype == SetupOptionType.PATH:
                assert isinstance(value, bytes)
                path = _decode_ascii(value, MalformedPath, "PATH")
            elif otype == SetupOptionType.AUTHORITY:
                assert isinstance(value, bytes)
                authority = _decode_ascii(value, MalformedAuthority, "AUTHORITY")
            elif otype == SetupOptionType.MAX_AUTH_TOKEN_CACHE_SIZE:
                assert isinstance(value, int)
                cache_size = value
            elif otype == SetupOptionType.AUTHORIZATION_TOKEN:
                assert isinstance(value, bytes)
                tokens.append(decode_auth_token(value))
            elif otype == SetupOptionType.MOQT_IMPLEMENTATION:
                assert isinstance(value, bytes)
                implementation = value
            else:
                unknown.append(option)
        return cls(path, authority, cache_size, tuple(tokens), implementation, tuple(unknown))


_SETUP_OPTION_INTS: Final = frozenset(int(t) for t in SetupOptionType)


def _decode_ascii(value: bytes, error: type[ProtocolError], what: str) -> str:
    # URI components are ASCII (RFC 3986); anything else cannot conform.
    try:
        return value.decode("ascii")
    except UnicodeDecodeError:
        raise error(f"{what} is not an RFC 3986 string") from None


@dataclass(frozen=True, slots=True)
class Goaway(ControlMessage):
    """GOAWAY (section "GOAWAY"); ``request_id`` is present only on the control stream."""

    TYPE: ClassVar[int] = 0x10
    new_session_uri: bytes = b""
    timeout: int = 0
    """Milliseconds the sender waits for graceful closure (0: no specific timeout)."""
    request_id: int | None = None

    def _push_payload(self, buf: Buffer) -> None:
        if len(self.new_session_uri) > MAX_NEW_SESSION_URI_LENGTH:
            raise UsageError("New Session URI longer than 8192 bytes")
        buf.push_vi64(len(self.new_session_uri))
        buf.push_bytes(self.new_session_uri)
        buf.push_vi64(self.timeout)
        if self.request_id is not None:
            buf.push_vi64(self.request_id)

    @classmethod
    def _pull_payload(cls, buf: Buffer) -> Self:
        length = buf.pull_vi64()
        if length > MAX_NEW_SESSION_URI_LENGTH:
            raise ProtocolViolation("New Session URI longer than 8192 bytes")
        uri = buf.pull_bytes(length)
        timeout = buf.pull_vi64()
        request_id = None if buf.eof() else buf.pull_vi64()
        return cls(uri, timeout, request_id)


@dataclass(frozen=True, slots=True)
class _TrackRequest(ControlMessage):
    """The layout SUBSCRIBE and TRACK_STATUS share: Request ID, Full Track Name, Message Parameters.
    Not a message itself; each subclass is one (never an instance of the other)."""

    request_id: int
    track_namespace: TrackNamespace
    track_name: bytes
    parameters: MessageParameters = NO_PARAMETERS

    def _push_payload(self, buf: Buffer) -> None:
        buf.push_vi64(self.request_id)
        push_full_track_name(buf, self.track_namespace, self.track_name)
        push_parameters(buf, self.parameters, self.ALLOWED_PARAMETERS)

    @classmethod
    def _pull_payload(cls, buf: Buffer) -> Self:
        request_id = buf.pull_vi64()
        namespace, name = pull_full_track_name(buf)
        return cls(request_id, namespace, name, pull_parameters(buf, cls.ALLOWED_PARAMETERS))


@dataclass(frozen=True, slots=True)
class Subscribe(_TrackRequest):
    """SUBSCRIBE (section "SUBSCRIBE"), first message of a request stream."""

    TYPE: ClassVar[int] = 0x3
    ALLOWED_PARAMETERS: ClassVar[frozenset[ParameterType]] = _allowed(
        _AUTH, _P.SUBGROUP_DELIVERY_TIMEOUT, _P.OBJECT_DELIVERY_TIMEOUT, _P.RENDEZVOUS_TIMEOUT,
        _P.SUBSCRIBER_PRIORITY, _P.GROUP_ORDER, _P.SUBSCRIPTION_FILTER, _P.FORWARD, _P.NEW_GROUP_REQUEST,
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class SubscribeOk(ControlMessage):
    """SUBSCRIBE_OK (section "SUBSCRIBE_OK")."""

    TYPE: ClassVar[int] = 0x4
    ALLOWED_PARAMETERS: ClassVar[frozenset[ParameterType]] = _allowed(_P.EXPIRES, _P.LARGEST_OBJECT)
    track_alias: int
    parameters: MessageParameters = NO_PARAMETERS
    track_properties: Properties = ()

    def _push_payload(self, buf: Buffer) -> None:
        buf.push_vi64(self.track_alias)
        push_parameters(buf, self.parameters, self.ALLOWED_PARAMETERS)
        push_key_value_pairs(buf, self.track_properties)

    @classmethod
    def _pull_payload(cls, buf: Buffer) -> Self:
        alias = buf.pull_vi64()
        params = pull_parameters(buf, cls.ALLOWED_PARAMETERS)
        return cls(alias, params, pull_key_value_pairs(buf, buf.capacity))


@dataclass(frozen=True, slots=True)
class Publish(ControlMessage):
    """PUBLISH (section "PUBLISH"), first message of a request stream opened by a publisher."""

    TYPE: ClassVar[int] = 0x1D
    ALLOWED_PARAMETERS: ClassVar[frozenset[ParameterType]] = _allowed(
        _AUTH, _P.EXPIRES, _P.LARGEST_OBJECT, _P.FORWARD
    )
    request_id: int
    track_namespace: TrackNamespace
    track_name: bytes
    track_alias: int
    parameters: MessageParameters = NO_PARAMETERS
    track_properties: Properties = ()

    def _push_payload(self, buf: Buffer) -> None:
        buf.push_vi64(self.request_id)
        push_full_track_name(buf, self.track_namespace, self.track_name)
        buf.push_vi64(self.track_alias)
        push_parameters(buf, self.parameters, self.ALLOWED_PARAMETERS)
        push_key_value_pairs(buf, self.track_properties)

    @classmethod
    def _pull_payload(cls, buf: Buffer) -> Self:
        request_id = buf.pull_vi64()
        namespace, name = pull_full_track_name(buf)
        alias = buf.pull_vi64()
        params = pull_parameters(buf, cls.ALLOWED_PARAMETERS)
        return cls(request_id, namespace, name, alias, params, pull_key_value_pairs(buf, buf.capacity))


@dataclass(frozen=True, slots=True)
class RequestOk(ControlMessage):
    """REQUEST_OK (section "REQUEST_OK"), also called PUBLISH_OK, REQUEST_UPDATE_OK,
    TRACK_STATUS_OK, SUBSCRIBE_NAMESPACE_OK and PUBLISH_NAMESPACE_OK by the draft.

    Track Properties are only populated in TRACK_STATUS_OK; the session, which knows
    the request, rejects them elsewhere. The decoder accepts the union of the
    parameters allowed in any of those responses for the same reason.
    """

    TYPE: ClassVar[int] = 0x7
    ALLOWED_PARAMETERS: ClassVar[frozenset[ParameterType]] = _PUBLISH_OK_PARAMS | _allowed(_P.LARGEST_OBJECT)
    parameters: MessageParameters = NO_PARAMETERS
    track_properties: Properties = ()

    def _push_payload(self, buf: Buffer) -> None:
        push_parameters(buf, self.parameters, self.ALLOWED_PARAMETERS)
        push_key_value_pairs(buf, self.track_properties)

    @classmethod
    def _pull_payload(cls, buf: Buffer) -> Self:
        params = pull_parameters(buf, cls.ALLOWED_PARAMETERS)
        return cls(params, pull_key_value_pairs(buf, buf.capacity))


@dataclass(frozen=True, slots=True)
class PublishOk(ControlMessage):
    """PUBLISH_OK, Message Type 0x1E in the draft's message table, laid out as REQUEST_OK.

    Track Properties are always empty in PUBLISH_OK (section "REQUEST_OK"), so they are
    not a field; receiving any is a PROTOCOL_VIOLATION.
    """

    TYPE: ClassVar[int] = 0x1E
    ALLOWED_PARAMETERS: ClassVar[frozenset[ParameterType]] = _PUBLISH_OK_PARAMS
    parameters: MessageParameters = NO_PARAMETERS

    def _push_payload(self, buf: Buffer) -> None:
        push_parameters(buf, self.parameters, self.ALLOWED_PARAMETERS)

    @classmethod
    def _pull_payload(cls, buf: Buffer) -> Self:
        params = pull_parameters(buf, cls.ALLOWED_PARAMETERS)
        if not buf.eof():
            raise ProtocolViolation("PUBLISH_OK carries track properties")
        return cls(params)


@dataclass(frozen=True, slots=True)
class PublishDone(ControlMessage):
    """PUBLISH_DONE (section "PUBLISH_DONE"); ``status_code`` is a PublishDoneCode value."""

    TYPE: ClassVar[int] = 0xB
    status_code: int
    stream_count: int
    reason: str = ""

    def _push_payload(self, buf: Buffer) -> None:
        buf.push_vi64(self.status_code)
        buf.push_vi64(self.stream_count)
        push_reason(buf, self.reason)

    @classmethod
    def _pull_payload(cls, buf: Buffer) -> Self:
        code = buf.pull_vi64()
        count = buf.pull_vi64()
        return cls(code, count, pull_reason(buf))


@dataclass(frozen=True, slots=True)
class StandaloneFetch:
    """Standalone Fetch structure (section "Standalone Fetch"); ``end`` is the last Object plus 1,
    or {G, 0} for all of group G."""

    track_namespace: TrackNamespace
    track_name: bytes
    start: Location
    end: Location


@dataclass(frozen=True, slots=True)
class JoiningFetch:
    """Joining Fetch structure (section "Joining Fetches")."""

    joining_request_id: int
    joining_start: int


@dataclass(frozen=True, slots=True)
class Fetch(ControlMessage):
    """FETCH (section "FETCH"): ``standalone`` for type 0x1, ``joining`` for types 0x2 and 0x3."""

    TYPE: ClassVar[int] = 0x16
    ALLOWED_PARAMETERS: ClassVar[frozenset[ParameterType]] = _allowed(
        _AUTH, _P.FILL_TIMEOUT, _P.SUBSCRIBER_PRIORITY, _P.GROUP_ORDER
    )
    request_id: int
    fetch_type: FetchType
    standalone: StandaloneFetch | None = None
    joining: JoiningFetch | None = None
    parameters: MessageParameters = NO_PARAMETERS

    def _push_payload(self, buf: Buffer) -> None:
        buf.push_vi64(self.request_id)
        buf.push_vi64(self.fetch_type)
        if self.fetch_type == FetchType.STANDALONE:
            if self.standalone is None or self.joining is not None:
                raise UsageError("a standalone FETCH carries exactly the standalone structure")
            push_full_track_name(buf, self.standalone.track_namespace, self.standalone.track_name)
            push_location(buf, self.standalone.start)
            push_location(buf, self.standalone.end)
        else:
            if self.joining is None or self.standalone is not None:
                raise UsageError("a joining FETCH carries exactly the joining structure")
            buf.push_vi64(self.joining.joining_request_id)
            buf.push_vi64(self.joining.joining_start)
        push_parameters(buf, self.parameters, self.ALLOWED_PARAMETERS)

    @classmethod
    def _pull_payload(cls, buf: Buffer) -> Self:
        request_id = buf.pull_vi64()
        raw_type = buf.pull_vi64()
        if raw_type not in (1, 2, 3):
            raise ProtocolViolation(f"unknown fetch type {raw_type}")
        fetch_type = FetchType(raw_type)
        standalone = joining = None
        if fetch_type == FetchType.STANDALONE:
            namespace, name = pull_full_track_name(buf)
            start = pull_location(buf)
            standalone = StandaloneFetch(namespace, name, start, pull_location(buf))
        else:
            joining_id = buf.pull_vi64()
            joining = JoiningFetch(joining_id, buf.pull_vi64())
        return cls(request_id, fetch_type, standalone, joining, pull_parameters(buf, cls.ALLOWED_PARAMETERS))


@dataclass(frozen=True, slots=True)
class FetchOk(ControlMessage):
    """FETCH_OK (section "FETCH_OK"); no parameter of draft-18 may appear in it."""

    TYPE: ClassVar[int] = 0x18
    end_of_track: bool
    end_location: Location
    parameters: MessageParameters = NO_PARAMETERS
    track_properties: Properties = ()

    def _push_payload(self, buf: Buffer) -> None:
        buf.push_uint8(1 if self.end_of_track else 0)
        push_location(buf, self.end_location)
        push_parameters(buf, self.parameters, self.ALLOWED_PARAMETERS)
        push_key_value_pairs(buf, self.track_properties)

    @classmethod
    def _pull_payload(cls, buf: Buffer) -> Self:
        end_of_track = buf.pull_uint8()
        if end_of_track > 1:
            raise ProtocolViolation(f"End Of Track value {end_of_track} is not 0 or 1")
        end = pull_location(buf)
        params = pull_parameters(buf, cls.ALLOWED_PARAMETERS)
        return cls(bool(end_of_track), end, params, pull_key_value_pairs(buf, buf.capacity))


@dataclass(frozen=True, slots=True)
class TrackStatus(_TrackRequest):
    """TRACK_STATUS (section "TRACK_STATUS"): laid out as SUBSCRIBE; answered by REQUEST_OK
    (TRACK_STATUS_OK) or REQUEST_ERROR."""

    TYPE: ClassVar[int] = 0xD
    ALLOWED_PARAMETERS: ClassVar[frozenset[ParameterType]] = _allowed(_AUTH)


@dataclass(frozen=True, slots=True)
class PublishNamespace(ControlMessage):
    """PUBLISH_NAMESPACE (section "PUBLISH_NAMESPACE")."""

    TYPE: ClassVar[int] = 0x6
    ALLOWED_PARAMETERS: ClassVar[frozenset[ParameterType]] = _allowed(_AUTH)
    request_id: int
    track_namespace: TrackNamespace
    parameters: MessageParameters = NO_PARAMETERS

    def _push_payload(self, buf: Buffer) -> None:
        buf.push_vi64(self.request_id)
        push_track_namespace(buf, self.track_namespace)
        push_parameters(buf, self.parameters, self.ALLOWED_PARAMETERS)

    @classmethod
    def _pull_payload(cls, buf: Buffer) -> Self:
        request_id = buf.pull_vi64()
        namespace = pull_track_namespace(buf)
        return cls(request_id, namespace, pull_parameters(buf, cls.ALLOWED_PARAMETERS))


@dataclass(frozen=True, slots=True)
class _PrefixRequest(ControlMessage):
    """The layout SUBSCRIBE_NAMESPACE and SUBSCRIBE_TRACKS share: Request ID, Track Namespace Prefix,
    Message Parameters. Not a message itself; each subclass is one (never an instance of the other)."""

    request_id: int
    track_namespace_prefix: TrackNamespace
    parameters: MessageParameters = NO_PARAMETERS

    def _push_payload(self, buf: Buffer) -> None:
        buf.push_vi64(self.request_id)
        push_track_namespace(buf, self.track_namespace_prefix)
        push_parameters(buf, self.parameters, self.ALLOWED_PARAMETERS)

    @classmethod
    def _pull_payload(cls, buf: Buffer) -> Self:
        request_id = buf.pull_vi64()
        prefix = pull_track_namespace(buf)
        return cls(request_id, prefix, pull_parameters(buf, cls.ALLOWED_PARAMETERS))


@dataclass(frozen=True, slots=True)
class SubscribeNamespace(_PrefixRequest):
    """SUBSCRIBE_NAMESPACE (section "SUBSCRIBE_NAMESPACE")."""

    TYPE: ClassVar[int] = 0x50
    ALLOWED_PARAMETERS: ClassVar[frozenset[ParameterType]] = _allowed(_AUTH)


@dataclass(frozen=True, slots=True)
class SubscribeTracks(_PrefixRequest):
    """SUBSCRIBE_TRACKS (section "SUBSCRIBE_TRACKS")."""

    TYPE: ClassVar[int] = 0x51
    ALLOWED_PARAMETERS: ClassVar[frozenset[ParameterType]] = _allowed(_AUTH, _P.FORWARD)


@dataclass(frozen=True, slots=True)
class _SuffixMessage(ControlMessage):
    """The layout NAMESPACE and NAMESPACE_DONE share: one Track Namespace Suffix. Not a message itself;
    each subclass is one (never an instance of the other)."""

    track_namespace_suffix: TrackNamespace

    def _push_payload(self, buf: Buffer) -> None:
        push_track_namespace(buf, self.track_namespace_suffix)

    @classmethod
    def _pull_payload(cls, buf: Buffer) -> Self:
        return cls(pull_track_namespace(buf))


@dataclass(frozen=True, slots=True)
class Namespace(_SuffixMessage):
    """NAMESPACE (section "NAMESPACE"): a namespace suffix after the subscribed prefix."""

    TYPE: ClassVar[int] = 0x8


@dataclass(frozen=True, slots=True)
class NamespaceDone(_SuffixMessage):
    """NAMESPACE_DONE (section "NAMESPACE_DONE")."""

    TYPE: ClassVar[int] = 0xE


@dataclass(frozen=True, slots=True)
class PublishBlocked(ControlMessage):
    """PUBLISH_BLOCKED (section "PUBLISH_BLOCKED")."""

    TYPE: ClassVar[int] = 0xF
    track_namespace_suffix: TrackNamespace
    track_name: bytes

    def _push_payload(self, buf: Buffer) -> None:
        push_full_track_name(buf, self.track_namespace_suffix, self.track_name)

    @classmethod
    def _pull_payload(cls, buf: Buffer) -> Self:
        namespace, name = pull_full_track_name(buf)
        return cls(namespace, name)


@dataclass(frozen=True, slots=True)
class RequestUpdate(ControlMessage):
    """REQUEST_UPDATE (section "REQUEST_UPDATE")."""

    TYPE: ClassVar[int] = 0x2
    ALLOWED_PARAMETERS: ClassVar[frozenset[ParameterType]] = _allowed(
        _AUTH, _P.SUBGROUP_DELIVERY_TIMEOUT, _P.OBJECT_DELIVERY_TIMEOUT, _P.SUBSCRIBER_PRIORITY,
        _P.SUBSCRIPTION_FILTER, _P.FORWARD, _P.NEW_GROUP_REQUEST, _P.TRACK_NAMESPACE_PREFIX,
    )  # fmt: skip
    request_id: int
    parameters: MessageParameters = NO_PARAMETERS

    def _push_payload(self, buf: Buffer) -> None:
        buf.push_vi64(self.request_id)
        push_parameters(buf, self.parameters, self.ALLOWED_PARAMETERS)

    @classmethod
    def _pull_payload(cls, buf: Buffer) -> Self:
        request_id = buf.pull_vi64()
        return cls(request_id, pull_parameters(buf, cls.ALLOWED_PARAMETERS))


@dataclass(frozen=True, slots=True)
class Redirect:
    """Redirect structure (section "Redirect Structure"); empty fields mean "same as before"."""

    connect_uri: bytes = b""
    track_namespace: TrackNamespace = ()
    track_name: bytes = b""


@dataclass(frozen=True, slots=True)
class RequestError(ControlMessage):
    """REQUEST_ERROR (section "REQUEST_ERROR"); ``redirect`` is present iff the code is REDIRECT.

    ``error_code`` is a RequestErrorCode value (kept as int so unknown codes survive).
    """

    TYPE: ClassVar[int] = 0x5
    error_code: int
    retry_interval: int = 0
    """Minimum milliseconds before retrying, plus one; 0 means do not retry."""
    reason: str = ""
    redirect: Redirect | None = None

    def _push_payload(self, buf: Buffer) -> None:
        if (self.error_code == RequestErrorCode.REDIRECT) != (self.redirect is not None):
            raise UsageError("a Redirect is present exactly when the error code is REDIRECT")
        buf.push_vi64(self.error_code)
        buf.push_vi64(self.retry_interval)
        push_reason(buf, self.reason)
        if self.redirect is not None:
            buf.push_vi64(len(self.redirect.connect_uri))
            buf.push_bytes(self.redirect.connect_uri)
            push_full_track_name(buf, self.redirect.track_namespace, self.redirect.track_name)

    @classmethod
    def _pull_payload(cls, buf: Buffer) -> Self:
        code = buf.pull_vi64()
        retry = buf.pull_vi64()
        reason = pull_reason(buf)
        redirect = None
        if code == RequestErrorCode.REDIRECT:
            uri = buf.pull_bytes(buf.pull_vi64())
            namespace, name = pull_full_track_name(buf)
            redirect = Redirect(uri, namespace, name)
        return cls(code, retry, reason, redirect)


MESSAGE_TYPES: Final[dict[int, type[ControlMessage]]] = {
    cls.TYPE: cls
    for cls in (
        Setup, Goaway, Subscribe, SubscribeOk, Publish, PublishOk, PublishDone, Fetch, FetchOk,
        TrackStatus, PublishNamespace, SubscribeNamespace, SubscribeTracks, Namespace, NamespaceDone,
        PublishBlocked, RequestUpdate, RequestOk, RequestError,
    )
}  # fmt: skip
"""Message Type -> message class, the draft's message table (section "Control Messages")."""


# -- framing -----------------------------------------------------------------------------------


def encode_message(msg: ControlMessage) -> bytes:
    """Frame a message: Type (vi64), Length (16), Payload. Raises UsageError if it cannot be encoded
    (a value out of range, a disallowed parameter, a payload over 65535 bytes)."""
    if type(msg) not in _CONCRETE:
        raise UsageError(f"{type(msg).__name__} is not a control message")
    buf = Buffer()
    try:
        msg._push_payload(buf)
    except BufferWriteError as exc:
        raise UsageError(f"cannot encode {type(msg).__name__}: {exc}") from None
    payload = buf.data
    if len(payload) > MAX_MESSAGE_LENGTH:
        raise UsageError(f"{type(msg).__name__} payload is {len(payload)} bytes, more than 65535")
    return vi64_encode(msg.TYPE) + len(payload).to_bytes(2, "big") + payload


_CONCRETE: Final = frozenset(MESSAGE_TYPES.values())


def decode_message_payload(msg_type: int, payload: bytes | memoryview) -> ControlMessage:
    """Decode one message payload of the given type; the payload must be consumed exactly.

    Raises ProtocolViolation for unknown types, truncated or over-long payloads, and the
    more specific ProtocolError subclasses where the draft names another code.
    """
    cls = MESSAGE_TYPES.get(msg_type)
    if cls is None:
        raise ProtocolViolation(f"unknown control message type {msg_type:#x}")
    if len(payload) > MAX_MESSAGE_LENGTH:
        raise ProtocolViolation("control message payload longer than 65535 bytes")
    buf = Buffer(payload)
    try:
        msg = cls._pull_payload(buf)
    except BufferReadError:
        raise ProtocolViolation(f"{cls.__name__} shorter than its fields") from None
    if not buf.eof():
        raise ProtocolViolation(f"{cls.__name__} has {buf.remaining()} bytes after its fields")
    return msg


class ControlMessageReader:
    """Incremental framing of a control or request stream.

    ``feed`` only buffers; ``next_message`` returns the next complete message, or None
    when more bytes are needed. Any exception other than ProtocolError is a bug. The
    bytes held and not yet consumed are limited to ``max_buffer`` (LimitExceeded), so
    callers drain with ``next_message`` after each ``feed``.
    """

    def __init__(self, max_buffer: int | None = 1 << 20, max_message_size: int = MAX_MESSAGE_LENGTH) -> None:
        # max_buffer=None leaves the bound on unconsumed bytes to the caller (the session bounds
        # each stream itself); max_message_size is checked from the Length field, before the
        # payload is buffered.
        if max_buffer is not None and max_buffer < 3 + MAX_MESSAGE_LENGTH + 9:
            raise UsageError("max_buffer must hold at least one maximum-size message")
        if not 0 <= max_message_size <= MAX_MESSAGE_LENGTH:
            raise UsageError(f"max_message_size must be within 0..{MAX_MESSAGE_LENGTH}")
        self._max_buffer = max_buffer
        self._max_message_size = max_message_size
        self._buf = bytearray()
        self._pos = 0

    @property
    def buffered(self) -> int:
        """Bytes received and not yet returned as messages."""
        return len(self._buf) - self._pos

    def at_boundary(self) -> bool:
        """True when no partial message is buffered (FIN here is clean)."""
        return self.buffered == 0

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Append stream bytes."""
        if self._max_buffer is not None and self.buffered + len(data) > self._max_buffer:
            raise LimitExceeded(f"control stream buffer over {self._max_buffer} bytes")
        if self._pos and self._pos == len(self._buf):
            self._buf.clear()
            self._pos = 0
        elif self._pos > 65536 and self._pos * 2 > len(self._buf):
            del self._buf[: self._pos]  # compact occasionally, keeping appends amortized O(1)
            self._pos = 0
        self._buf += data

    def has_message(self) -> bool:
        """A whole message is buffered: its type, its length and that many payload bytes (framing only,
        nothing is decoded or consumed)."""
        header = vi64_decode(self._buf, self._pos)
        if header is None:
            return False
        pos = header[1]
        if pos + 2 > len(self._buf):
            return False
        return pos + 2 + int.from_bytes(self._buf[pos : pos + 2], "big") <= len(self._buf)

    def next_message(self) -> ControlMessage | None:
        """Decode and return the next complete message, or None if more bytes are needed."""
        header = vi64_decode(self._buf, self._pos)
        if header is None:
            return None
        msg_type, pos = header
        if msg_type not in MESSAGE_TYPES:
            raise ProtocolViolation(f"unknown control message type {msg_type:#x}")
        if pos + 2 > len(self._buf):
            return None
        length = int.from_bytes(self._buf[pos : pos + 2], "big")
        if length > self._max_message_size:
            raise LimitExceeded(
                f"control message of {length} bytes exceeds the limit of {self._max_message_size}"
            )
        start = pos + 2
        if start + length > len(self._buf):
            return None
        payload = bytes(self._buf[start : start + length])
        self._pos = start + length
        return decode_message_payload(msg_type, payload)

