"""The QUIC stack behind kvnet: aioquic (pure Python) or qh3 (the same asyncio API over a Rust core).

Owns: choosing the stack named by ``TransportSettings.stack`` and everything that differs between the two,
so that ``kvnet.net.connection`` has one code path: the configuration class and how it is filled, the protocol
base class and event classes, how a client endpoint and a server are opened, unsent-byte accounting,
peer stream limits, and client-certificate checks. Knows nothing about MoQT.

Differences handled here (aioquic 1.7 / qh3 2.x):

- Configuration: qh3 has no ``congestion_control_algorithm`` (its core picks one), and
  ``max_datagram_size`` is an upper bound that it reaches by path-MTU probing from 1280 bytes, while
  aioquic uses it from the first packet and silently stalls above 16384.
- Receive path: qh3's client transport reads batches with GRO and calls ``datagrams_received(list)``,
  never ``datagram_received``; a protocol must hook both.
- Transmits: aioquic's protocol transmits after every received datagram (a walk over all open
  streams each time); ``arm_timer`` lets ``kvnet.net.connection`` transmit every few datagrams instead.
- Send buffer: aioquic keeps every unacknowledged byte in the stream's sender buffer; qh3 reports bytes
  not yet sent once (``get_send_buffer_size``). Both work as a back-pressure measure.
- Stream limits: neither has a setting (aioquic grants 128 concurrent peer streams, qh3 100), so we raise
  them before the handshake announces them.
- TLS: qh3 servers cannot request a client certificate, so ``require_client_cert`` needs aioquic there.
"""

from __future__ import annotations

import asyncio
import functools
import socket
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from kvnet.net import quic as kq

STACKS = kq.STACKS


@dataclass(frozen=True, slots=True)
class QuicStack:
    """The symbols of one QUIC stack that kvnet uses (both stacks expose aioquic's names)."""

    name: str
    QuicConfiguration: type
    QuicConnection: type
    QuicConnectionProtocol: type
    events: ModuleType
    """Module with ``StreamDataReceived``, ``StreamReset``, ``HandshakeCompleted``, ... classes."""
    connect: Callable[..., Any]
    serve: Callable[..., Any]
    max_datagram_size: int
    """Largest datagram size the stack handles correctly."""
    can_request_client_certificate: bool
    transmits_after_each_datagram: bool
    """Its protocol transmits after every received datagram (aioquic); ``kvnet.net.connection`` batches those
    with ``arm_timer`` and ``window_limited``."""


@functools.cache
def get_stack(name: str) -> QuicStack:
    """The stack called ``name`` ("aioquic" or "qh3"), imported on first use."""
    if name == "aioquic":
        import aioquic.asyncio as aa
        import aioquic.quic.configuration as ac
        import aioquic.quic.connection as an
        import aioquic.quic.events as ae

        return QuicStack("aioquic", ac.QuicConfiguration, an.QuicConnection, aa.QuicConnectionProtocol, ae,
                         aa.connect, aa.serve, kq.MAX_DATAGRAM_SIZE_LIMIT, True, True)
    if name == "qh3":
        import qh3.asyncio as qa
        import qh3.quic.configuration as qc
        import qh3.quic.connection as qn
        import qh3.quic.events as qv

        return QuicStack("qh3", qc.QuicConfiguration, qn.QuicConnection, qa.QuicConnectionProtocol, qv,
                         qa.connect, qa.serve, kq.MAX_DATAGRAM_SIZE_QH3, False, False)
    raise ValueError(f"unknown QUIC stack {name!r}; choose from {STACKS}")


def _base_configuration(settings: kq.TransportSettings, is_client: bool) -> Any:
    stack = get_stack(settings.stack)
    config = stack.QuicConfiguration(
        is_client=is_client,
        alpn_protocols=[kq.ALPN_MOQT],
        max_datagram_size=settings.datagram_size,
        max_data=settings.max_data,
        max_stream_data=settings.max_stream_data,
        idle_timeout=settings.idle_timeout,
    )
    if stack.name == "aioquic":
        config.congestion_control_algorithm = kq.aioquic_congestion_control(settings)
    return config


def client_configuration(
    settings: kq.TransportSettings, tls: kq.TlsSettings, server_name: str | None = None
) -> Any:
    """Client configuration for ``settings.stack``: ALPN moqt-18, TLS 1.3, server verification on."""
    if settings.stack == "aioquic":
        return kq.client_configuration(settings, tls, server_name)
    config = _base_configuration(settings, is_client=True)
    config.server_name = tls.server_name or server_name
    kq.apply_client_verification(config, tls)
    if tls.cert_file is not None:
        config.load_cert_chain(tls.cert_file, tls.key_file)
    return config


def server_configuration(settings: kq.TransportSettings, tls: kq.TlsSettings) -> Any:
    """Server configuration for ``settings.stack``. Raises ``ValueError`` when the stack cannot do what
    ``tls`` asks (qh3 cannot request client certificates)."""
    if tls.require_client_cert and not get_stack(settings.stack).can_request_client_certificate:
        raise ValueError(
            f"require_client_cert needs a stack that requests client certificates; {settings.stack} "
            "cannot, use stack='aioquic' for this server"
        )
    if settings.stack == "aioquic":
        return kq.server_configuration(settings, tls)
    if tls.cert_file is None:
        raise ValueError("a server needs cert_file and key_file")
    config = _base_configuration(settings, is_client=False)
    config.load_cert_chain(tls.cert_file, tls.key_file)
    if tls.ca_file is not None:
        config.load_verify_locations(cafile=str(tls.ca_file))
    return config


async def open_client_endpoint(
    settings: kq.TransportSettings, sock: socket.socket, protocol_factory: Callable[[], Any]
) -> tuple[asyncio.DatagramTransport, Any]:
    """Wrap a bound UDP socket in the stack's datagram transport (qh3: batched receive with GRO)."""
    loop = asyncio.get_running_loop()
    if settings.stack == "qh3":
        from qh3.asyncio._transport import create_optimized_datagram_transport

        transport, protocol = await create_optimized_datagram_transport(loop, protocol_factory, sock=sock)
        return transport, protocol
    transport, protocol = await loop.create_datagram_endpoint(protocol_factory, sock=sock)
    return transport, protocol


def unsent_bytes(quic: Any, stream_ids: Iterable[int]) -> dict[int, int]:
    """Bytes still held by the stack per stream: aioquic counts unacknowledged bytes, qh3 unsent ones."""
    get = getattr(quic, "get_send_buffer_size", None)
    if get is not None:
        return {sid: int(get(sid)) for sid in stream_ids}
    streams = quic._streams
    result = {}
    for sid in stream_ids:
        stream = streams.get(sid)
        result[sid] = 0 if stream is None else len(stream.sender._buffer)
    return result


# Positions of local_max_streams_bidi / _uni among qh3's QuicConnectionCore arguments (qh3 2.x).
_QH3_CORE_MAX_STREAMS_BIDI = 21
_QH3_CORE_MAX_STREAMS_UNI = 22
_CORE = "QuicConnectionCore"
_PARAMS = "QuicTransportParameters"


def window_limited(quic: Any) -> bool:
    """aioquic: whether the congestion window has no room for another full datagram."""
    loss = quic._loss
    return bool(loss.bytes_in_flight + quic._max_datagram_size > loss.congestion_window)


def arm_timer(protocol: Any) -> None:
    """aioquic: re-arm a protocol's QUIC timer as its ``transmit()`` does, without building packets, for
    a receiver that transmits only every few datagrams (``kvnet.net.connection``): the ACK-delay and loss
    timers must still fire when a burst ends between two transmits."""
    timer_at = protocol._quic.get_timer()
    if protocol._timer is not None and protocol._timer_at != timer_at:
        protocol._timer.cancel()
        protocol._timer = None
    if protocol._timer is None and timer_at is not None:
        protocol._timer = protocol._loop.call_at(timer_at, protocol._handle_timer)
    protocol._timer_at = timer_at


def _set(module: Any, name: str, value: Any) -> None:
    setattr(module, name, value)


def raise_stream_limits(quic: Any, settings: kq.TransportSettings) -> None:
    """Grant the peer ``settings.max_streams_*`` concurrent streams before the handshake announces them.
    Neither stack has a setting: aioquic starts from 128 per direction, qh3 from 100 bidirectional and
    103 unidirectional; kvnet opens one bidirectional stream per request, thousands at once."""
    if hasattr(quic, "_local_max_streams_bidi"):  # aioquic: plain attributes read at handshake time
        for attr, value in (("_local_max_streams_bidi", settings.max_streams_bidi),
                            ("_local_max_streams_uni", settings.max_streams_uni)):
            limit = getattr(quic, attr)
            limit.value = limit.sent = value
        return
    # qh3 hard-codes the limits twice, as literals: where it creates its native core (which enforces
    # them) and where its TLS bridge builds the transport parameters (which announce them). Intercept
    # those two constructions for this connection only and substitute ours.
    core_module = sys.modules[type(quic).__module__]
    original_create_core = quic._create_core
    original_create_tls = quic._create_tls

    def create_core(*args: Any, **kwargs: Any) -> None:
        core_class = getattr(core_module, _CORE)

        def core(*core_args: Any) -> Any:
            values = list(core_args)
            values[_QH3_CORE_MAX_STREAMS_BIDI] = settings.max_streams_bidi
            values[_QH3_CORE_MAX_STREAMS_UNI] = settings.max_streams_uni
            return core_class(*values)

        _set(core_module, _CORE, core)
        try:
            original_create_core(*args, **kwargs)
        finally:
            _set(core_module, _CORE, core_class)

    def create_tls(*args: Any, **kwargs: Any) -> Any:
        import qh3.quic.tls_bridge as bridge_module

        params_class = getattr(bridge_module, _PARAMS)

        def params(**fields: Any) -> Any:
            fields["initial_max_streams_bidi"] = settings.max_streams_bidi
            fields["initial_max_streams_uni"] = settings.max_streams_uni
            return params_class(**fields)

        # The bridge serialises its parameters while it is built and again later (e.g. after a retry).
        _set(bridge_module, _PARAMS, params)
        try:
            bridge = original_create_tls(*args, **kwargs)
        finally:
            _set(bridge_module, _PARAMS, params_class)
        original_serialize = bridge.serialize_transport_parameters

        def serialize() -> bytes:
            _set(bridge_module, _PARAMS, params)
            try:
                data: bytes = original_serialize()
            finally:
                _set(bridge_module, _PARAMS, params_class)
            return data

        bridge.serialize_transport_parameters = serialize
        return bridge

    quic._create_core = create_core
    quic._create_tls = create_tls


def request_client_certificate(quic: Any) -> None:
    """Make an aioquic server connection ask for a client certificate (checked after the handshake by
    ``verify_client_certificate``). aioquic sets the flag on a TLS context that only exists once the
    first packet arrived, so the hook wraps ``_initialize``."""
    original = quic._initialize

    def initialize(peer_cid: bytes) -> None:
        original(peer_cid)
        quic.tls._request_client_certificate = True

    quic._initialize = initialize


def verify_client_certificate(quic: Any, cafile: str) -> None:
    """Check the client's certificate chain against ``cafile``; raises on any failure."""
    from aioquic.tls import verify_certificate

    tls = quic.tls
    cert = getattr(tls, "_peer_certificate", None)
    if cert is None:
        raise ValueError("no client certificate")
    chain = getattr(tls, "_peer_certificate_chain", [])
    verify_certificate(certificate=cert, chain=chain, cafile=cafile)


__all__ = [
    "STACKS",
    "QuicStack",
    "client_configuration",
    "get_stack",
    "open_client_endpoint",
    "raise_stream_limits",
    "request_client_certificate",
    "server_configuration",
    "unsent_bytes",
    "verify_client_certificate",
]
