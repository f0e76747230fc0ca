"""The aioquic stack (pure Python QUIC): its configuration and every adaptation of aioquic's internals.

Owns: aioquic's configuration from ``TransportConfig`` (kvnet's congestion-control variants without
the RTT exit from slow start), the per-connection patches (stream limits, the datagram size chosen from
the path and the peer's ``max_udp_payload_size``, requesting and verifying client certificates),
counting unacknowledged bytes, and ``AioquicProtocol``: aioquic's protocol transmitting every few
received datagrams instead of after each, and sending with UDP GSO (``kvnet.net.gso``). The only stack
whose servers can require client certificates; the default (``kvnet.net.config.DEFAULT_STACK``).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, cast

import aioquic.asyncio as aioquic_asyncio
import aioquic.quic.events as aioquic_events
from aioquic.asyncio.server import QuicServer
from aioquic.buffer import Buffer
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.congestion import base as _cc_base
from aioquic.quic.congestion.cubic import CubicCongestionControl
from aioquic.quic.congestion.reno import RenoCongestionControl
from aioquic.quic.connection import QuicConnection
from aioquic.quic.packet import pull_quic_transport_parameters, push_quic_transport_parameters
from aioquic.tls import verify_certificate

from kvnet.net.config import (
    DATAGRAM_SIZE_ETHERNET,
    MAX_DATAGRAM_SIZE_LIMIT,
    TransportConfig,
    choose_datagram_size,
    path_is_loopback,
)
from kvnet.net.gso import DatagramReceiver, release, sender_for
from kvnet.net.stack import UdpStack, arm_timer

logger = logging.getLogger(__name__)

# Datagrams received between two transmits. aioquic's protocol transmits after every received datagram,
# each transmit walking every open stream (a node fetching 128 streams spent ~16% of its fetch there).
# ACKs and flow-control credit go out every few datagrams instead; the QUIC timer is re-armed after each
# datagram, so the ACK delay (1 ms) still ends a burst that stops between two.
_RECEIVE_TRANSMIT_BATCH = 4


# -------------------------------------------------------------------------------- configuration


class _NoRttExit:
    """Mixin: ignore the RTT-increase signal that makes aioquic's controllers leave slow start."""

    def on_rtt_measurement(self, *, now: float, rtt: float) -> None:
        return None


class _CubicNoRttExit(_NoRttExit, CubicCongestionControl):
    pass


class _RenoNoRttExit(_NoRttExit, RenoCongestionControl):
    pass


_NO_RTT_EXIT = {"cubic": ("kvnet-cubic", _CubicNoRttExit), "reno": ("kvnet-reno", _RenoNoRttExit)}


def congestion_control(settings: TransportConfig) -> str:
    """The aioquic congestion-control name for ``settings`` (registering kvnet's variants on first use)."""
    if settings.slow_start_rtt_exit:
        return settings.congestion_control
    name, factory = _NO_RTT_EXIT[settings.congestion_control]
    _cc_base.register_congestion_control(name, factory)  # type: ignore[arg-type]
    return name


# -------------------------------------------------------------------------------- per-connection patches


def limit_datagram_size(quic: Any, settings: TransportConfig) -> None:
    """Make a connection follow ``choose_datagram_size``, and advertise a configured
    ``max_datagram_size`` to the peer as our ``max_udp_payload_size``; the choice is logged once.

    aioquic sends its configured size from the first packet and ignores the peer's parameter. Until the
    peer's transport parameters arrive (handshake packets only) it sends at most
    ``DATAGRAM_SIZE_ETHERNET``; when they arrive (before a server sends its handshake flight) the size
    is fixed for the connection. (qh3 and aiopquic apply the peer's parameter and probe the path
    themselves.)
    """
    _set_datagram_size(quic, min(quic._max_datagram_size, DATAGRAM_SIZE_ETHERNET))
    original_parse = quic._parse_transport_parameters
    original_serialize = quic._serialize_transport_parameters

    def parse(data: bytes, from_session_ticket: bool = False) -> None:
        original_parse(data, from_session_ticket)
        if from_session_ticket:
            return
        peer_max = pull_quic_transport_parameters(Buffer(data=data)).max_udp_payload_size
        host = quic._network_paths[0].addr[0] if quic._network_paths else ""
        loopback = path_is_loopback(host)
        size = choose_datagram_size(settings, peer_max, loopback)
        _set_datagram_size(quic, size)
        logger.info(
            "QUIC datagram size",
            extra={"datagram_size": size, "configured": settings.max_datagram_size,
                   "peer_max_udp_payload_size": peer_max, "loopback": loopback},
        )

    def serialize() -> bytes:
        data: bytes = original_serialize()
        if settings.max_datagram_size is None:
            return data
        params = pull_quic_transport_parameters(Buffer(data=data))
        params.max_udp_payload_size = settings.max_datagram_size
        buf = Buffer(capacity=len(data) + 16)
        push_quic_transport_parameters(buf, params)
        return buf.data

    quic._parse_transport_parameters = parse
    quic._serialize_transport_parameters = serialize


def _set_datagram_size(quic: Any, size: int) -> None:
    # aioquic keeps the size in the connection (packet building) and copies it into loss recovery's
    # pacer and congestion controller (window arithmetic): all three follow.
    quic._max_datagram_size = size
    quic._loss._pacer._max_datagram_size = size
    quic._loss._cc._max_datagram_size = size


def raise_stream_limits(quic: Any, settings: TransportConfig) -> None:
    """Grant the peer ``settings.max_streams_*`` concurrent streams before the handshake announces them
    (aioquic has no setting and starts from 128 per direction; kvnet opens one bidirectional stream per
    request, thousands at once). The limits are plain attributes read at handshake time."""
    for attr, value in (("_local_max_streams_bidi", settings.max_streams_bidi),
                        ("_local_max_streams_uni", settings.max_streams_uni)):
        limit = getattr(quic, attr)
        limit.value = limit.sent = value


def request_client_certificate(quic: Any) -> None:
    """Make a server connection ask for a client certificate (checked after the handshake by
    ``AioquicStack.verify_client_certificate``). aioquic sets the flag on a TLS context that only exists
    once the first packet arrived, so the hook wraps ``_initialize``."""
    original = quic._initialize

    def initialize(peer_cid: bytes) -> None:
        original(peer_cid)
        quic.tls._request_client_certificate = True

    quic._initialize = initialize


def window_limited(quic: Any) -> bool:
    """Whether the congestion window has no room for another full datagram."""
    loss = quic._loss
    return bool(loss.bytes_in_flight + quic._max_datagram_size > loss.congestion_window)


# -------------------------------------------------------------------------------- the protocol


class AioquicProtocol(aioquic_asyncio.QuicConnectionProtocol):
    """aioquic's protocol, transmitting every ``_RECEIVE_TRANSMIT_BATCH`` received datagrams once the
    session is established (a sender held back by its congestion window still transmits at once: the
    datagram may carry the ACK that opens it), and sending each transmit with UDP GSO when
    ``udp_segmentation`` is on."""

    def __init__(self, quic: Any, stream_handler: Any = None) -> None:
        super().__init__(quic, stream_handler)
        self.udp_segmentation = False
        """Send each transmit's runs of equal-sized datagrams with one GSO ``sendmsg``
        (``TransportConfig.udp_segmentation``)."""
        self._received_untransmitted = 0

    @property
    def session_established(self) -> bool:
        """Received datagrams may share transmits (``MoqtConnection``: once its SETUP exchange ended).
        False here: used alone, this protocol transmits as aioquic's does."""
        return False

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        if not self.session_established or window_limited(self._quic):
            super().datagram_received(data, addr)
            return
        self._quic.receive_datagram(cast(bytes, data), addr, now=self._loop.time())
        self._process_events()
        self._received_untransmitted += 1
        if self._received_untransmitted >= _RECEIVE_TRANSMIT_BATCH:
            self.transmit()
        else:
            # No packets built, but the ACK-delay and loss timers must still fire when a burst ends
            # between two transmits.
            arm_timer(self)

    def transmit(self) -> None:
        self._received_untransmitted = 0  # whatever the reason, this one carries the pending ACKs
        if self.udp_segmentation and self._transport is not None:
            # aioquic's own transmit, with one GSO send per run of datagrams instead of one each.
            self._transmit_task = None
            sender_for(self._transport).send(self._quic.datagrams_to_send(now=self._loop.time()))
            arm_timer(self)
        else:
            super().transmit()


# -------------------------------------------------------------------------------- the stack


@dataclass(frozen=True, eq=False)
class AioquicStack(UdpStack):
    """aioquic behind ``kvnet.net.stack.Stack``."""

    def base_configuration(self, settings: TransportConfig, is_client: bool) -> Any:
        config = super().base_configuration(settings, is_client)
        config.congestion_control_algorithm = congestion_control(settings)
        return config

    def prepare_connection(self, protocol: Any, settings: TransportConfig, *, verify_client: bool) -> None:
        quic = protocol._quic
        raise_stream_limits(quic, settings)
        limit_datagram_size(quic, settings)
        if verify_client:
            request_client_certificate(quic)
        protocol.udp_segmentation = settings.udp_segmentation

    def verify_client_certificate(self, quic: Any, cafile: str) -> None:
        tls = quic.tls
        cert = getattr(tls, "_peer_certificate", None)
        if cert is None:
            raise ValueError("no client certificate")
        chain = getattr(tls, "_peer_certificate_chain", [])
        verify_certificate(certificate=cert, chain=chain, cafile=cafile)

    def unsent_bytes(self, quic: Any, stream_ids: Iterable[int]) -> dict[int, int]:
        # aioquic keeps every unacknowledged byte in the stream's sender buffer.
        streams = quic._streams
        result = {}
        for sid in stream_ids:
            stream = streams.get(sid)
            result[sid] = 0 if stream is None else len(stream.sender._buffer)
        return result

    def release_client_transport(self, transport: Any) -> None:
        release(transport)  # the GSO sender's and GRO receiver's duplicate sockets

    async def open_datagram_endpoint(
        self, sock: socket.socket, make_protocol: Callable[[], Any], settings: TransportConfig
    ) -> tuple[Any, Any]:
        transport, protocol = await super().open_datagram_endpoint(sock, make_protocol, settings)
        if settings.udp_receive_offload:
            DatagramReceiver.install(transport, protocol)
        return transport, protocol


STACK = AioquicStack(
    name="aioquic",
    QuicConfiguration=QuicConfiguration,
    QuicConnection=QuicConnection,
    QuicConnectionProtocol=AioquicProtocol,
    events=aioquic_events,
    connect=aioquic_asyncio.connect,
    serve=aioquic_asyncio.serve,
    max_datagram_size=MAX_DATAGRAM_SIZE_LIMIT,
    can_request_client_certificate=True,
    server_class=QuicServer,
)
