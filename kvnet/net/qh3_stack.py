"""The qh3 stack (aioquic's asyncio API over a Rust core): its configuration and every adaptation of
qh3's internals.

Owns: qh3's configuration from ``TransportConfig`` (no congestion-control choice: its core picks one;
``max_datagram_size`` is the ceiling of its path-MTU probing), the per-connection patches (stream limits
written into its native core and TLS bridge, sending the datagrams built before a packet it could not
build), counting unsent bytes, and its client transport (batched receive with GRO). Its servers cannot
request client certificates. Opt-in (``--quic-stack qh3``): faster client -> server, see
docs/performance.md.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import qh3.asyncio as qh3_asyncio
import qh3.quic.events as qh3_events
from qh3.asyncio._transport import create_optimized_datagram_transport
from qh3.asyncio.server import QuicServer
from qh3.quic import tls_bridge
from qh3.quic.configuration import QuicConfiguration
from qh3.quic.connection import QuicConnection, QuicConnectionError

from kvnet.net.config import MAX_DATAGRAM_SIZE_QH3, TransportConfig
from kvnet.net.stack import UdpStack

logger = logging.getLogger(__name__)

# Positions of local_max_streams_bidi / _uni among qh3's QuicConnectionCore arguments (qh3 2.x).
_CORE_MAX_STREAMS_BIDI = 21
_CORE_MAX_STREAMS_UNI = 22
_CORE = "QuicConnectionCore"
_PARAMS = "QuicTransportParameters"
_BUILD_CAPACITY = "packet builder capacity exhausted"


def _set(module: Any, name: str, value: Any) -> None:
    setattr(module, name, value)


def raise_stream_limits(quic: Any, settings: TransportConfig) -> None:
    """Grant the peer ``settings.max_streams_*`` concurrent streams before the handshake announces them.
    qh3 has no setting (100 bidirectional, 103 unidirectional) and hard-codes the limits twice, as
    literals: where it creates its native core (which enforces them) and where its TLS bridge builds the
    transport parameters (which announce them). Intercept those two constructions for this connection
    only and substitute ours."""
    core_module = sys.modules[type(quic).__module__]
    original_create_core = quic._create_core
    original_create_tls = quic._create_tls

    def create_core(*args: Any, **kwargs: Any) -> None:
        core_class = getattr(core_module, _CORE)

        def core(*core_args: Any) -> Any:
            values = list(core_args)
            values[_CORE_MAX_STREAMS_BIDI] = settings.max_streams_bidi
            values[_CORE_MAX_STREAMS_UNI] = settings.max_streams_uni
            return core_class(*values)

        _set(core_module, _CORE, core)
        try:
            original_create_core(*args, **kwargs)
        finally:
            _set(core_module, _CORE, core_class)

    def create_tls(*args: Any, **kwargs: Any) -> Any:
        params_class = getattr(tls_bridge, _PARAMS)

        def params(**fields: Any) -> Any:
            fields["initial_max_streams_bidi"] = settings.max_streams_bidi
            fields["initial_max_streams_uni"] = settings.max_streams_uni
            return params_class(**fields)

        # The bridge serialises its parameters while it is built and again later (e.g. after a retry).
        _set(tls_bridge, _PARAMS, params)
        try:
            bridge = original_create_tls(*args, **kwargs)
        finally:
            _set(tls_bridge, _PARAMS, params_class)
        original_serialize = bridge.serialize_transport_parameters

        def serialize() -> bytes:
            _set(tls_bridge, _PARAMS, params)
            try:
                data: bytes = original_serialize()
            finally:
                _set(tls_bridge, _PARAMS, params_class)
            return data

        bridge.serialize_transport_parameters = serialize
        return bridge

    quic._create_core = create_core
    quic._create_tls = create_tls


def send_datagrams_built_before_a_failed_build(quic: Any) -> None:
    """Make a connection send the datagrams it built before a packet it could not build.

    qh3 2.1 answering an aioquic client's first flights reports "packet builder capacity exhausted" for
    one of its packets (two to four times per handshake, at every datagram size), and its
    ``datagrams_to_send`` then raises, dropping the datagrams it had already built and counted as sent:
    the handshake waited ~1 s for their loss recovery, and each raise was an asyncio traceback in the
    log. Its builder is transactional (a failed build consumes no frame and no packet number), so what
    was built is sent and the rest waits for the next transmit: the handshake takes ~0.1 s."""

    def datagrams_to_send(now: float) -> list[tuple[bytes, Any]]:
        core = quic._core
        if core is None:
            return []
        datagrams: list[tuple[bytes, Any]] = []
        while True:
            try:
                transmit = quic._call_core(core.poll_transmit, now)
            except QuicConnectionError as exc:
                if exc.reason_phrase != _BUILD_CAPACITY:
                    raise
                logger.debug("qh3 could not build a packet (%s); sending the %d built before it",
                             exc.reason_phrase, len(datagrams))
                return datagrams
            if transmit is None:
                return datagrams
            quic._log_datagram("datagrams_sent", transmit[0])
            quic._log_packets("packet_sent", transmit[0])
            datagrams.append((transmit[0], transmit[1]))

    quic.datagrams_to_send = datagrams_to_send


@dataclass(frozen=True, eq=False)
class Qh3Stack(UdpStack):
    """qh3 behind ``kvnet.net.stack.Stack``."""

    def prepare_connection(self, protocol: Any, settings: TransportConfig, *, verify_client: bool) -> None:
        raise_stream_limits(protocol._quic, settings)
        send_datagrams_built_before_a_failed_build(protocol._quic)

    def unsent_bytes(self, quic: Any, stream_ids: Iterable[int]) -> dict[int, int]:
        # qh3 reports bytes not yet sent (only a transmit drains them).
        return {sid: int(quic.get_send_buffer_size(sid)) for sid in stream_ids}

    async def open_datagram_endpoint(
        self, sock: socket.socket, make_protocol: Callable[[], Any], settings: TransportConfig
    ) -> tuple[Any, Any]:
        # qh3's own client transport: batched reads with GRO (``datagrams_received``).
        loop = asyncio.get_running_loop()
        transport, protocol = await create_optimized_datagram_transport(loop, make_protocol, sock=sock)
        return transport, protocol


STACK = Qh3Stack(
    name="qh3",
    QuicConfiguration=QuicConfiguration,
    QuicConnection=QuicConnection,
    QuicConnectionProtocol=qh3_asyncio.QuicConnectionProtocol,
    events=qh3_events,
    connect=qh3_asyncio.connect,
    serve=qh3_asyncio.serve,
    max_datagram_size=MAX_DATAGRAM_SIZE_QH3,
    server_class=QuicServer,
)
