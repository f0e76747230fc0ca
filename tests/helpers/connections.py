"""Two real ``MoqtConnection``s (aioquic QUIC + TLS 1.3 + MoQT SETUP) wired to each other without sockets.

The shape of aioquic's ``client_and_server()`` + ``roundtrip``, one level up: each side's
``QuicConnectionProtocol`` gets an in-memory datagram transport whose ``sendto`` hands the datagram to
the other side's ``datagram_received`` on the next loop iteration. Everything above the socket is the
production code path (handshake with certificates the project makes, SETUP, request helpers, timers), so
role code that takes a ``MoqtConnection`` (the block server, the fetcher) can be tested without a relay,
a process or a port.

``client_config`` and ``client_limits`` are the ``TransportConfig`` and ``ConnectionLimits`` every test's
MoQT client connects with: the handshake and SETUP deadlines are the product's defaults scaled by the load
(``tests.helpers.waiting.scaled``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from kvnet.net.config import TlsConfig, TransportConfig
from kvnet.net.connection import MoqtConnection, protocol_class
from kvnet.net.limits import ConnectionLimits
from kvnet.net.registry import client_configuration, get_stack, server_configuration
from proto.session import SessionConfig
from tests.helpers.processes import CertDir
from tests.helpers.waiting import scaled

CLIENT_ADDRESS = ("127.0.0.1", 40001)
SERVER_ADDRESS = ("127.0.0.1", 40002)
"""Nominal addresses: nothing binds them, they only label the two ends for QUIC's path checks."""

MAX_HANDSHAKE_TIMEOUT_S = 600.0
"""The largest ``handshake_timeout`` ``TransportConfig`` accepts."""

__all__ = ["ConnectionPair", "MemoryDatagramTransport", "client_config", "client_limits", "connection_pair"]


def client_config(settings: TransportConfig | None = None) -> TransportConfig:
    """``settings`` (default: ``TransportConfig()``) for a test's client, its ``handshake_timeout`` scaled
    by the machine's load: a handshake under load is slow, not failed."""
    settings = settings or TransportConfig()
    timeout = min(MAX_HANDSHAKE_TIMEOUT_S, scaled(settings.handshake_timeout))
    return dataclasses.replace(settings, handshake_timeout=timeout)


def client_limits(limits: ConnectionLimits | None = None) -> ConnectionLimits:
    """``limits`` (default: ``ConnectionLimits()``) for a test's client, its ``setup_timeout`` (the wait for
    the peer's SETUP after the handshake) scaled by the machine's load."""
    limits = limits or ConnectionLimits()
    return dataclasses.replace(limits, setup_timeout=scaled(limits.setup_timeout))


class MemoryDatagramTransport(asyncio.DatagramTransport):
    """Delivers every datagram to ``peer`` (another protocol) from the event loop, never re-entrantly."""

    def __init__(self, local_address: tuple[str, int]) -> None:
        super().__init__()
        self.local_address = local_address
        self.peer: MoqtConnection | None = None
        self.datagrams_sent = 0
        self._closing = False

    def sendto(self, data: Any, addr: Any = None) -> None:
        if self._closing or self.peer is None:
            return
        self.datagrams_sent += 1
        # call_soon, like a socket: the sender finishes its own callback before the peer reacts.
        asyncio.get_running_loop().call_soon(self.peer.datagram_received, bytes(data), self.local_address)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.local_address if name == "sockname" else default

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        self._closing = True


@dataclass
class ConnectionPair:
    """A client and a server ``MoqtConnection`` whose SETUP exchange has completed."""

    client: MoqtConnection
    server: MoqtConnection


@contextlib.asynccontextmanager
async def connection_pair(
    certs: CertDir,
    *,
    client_session: SessionConfig | None = None,
    server_session: SessionConfig | None = None,
    settings: TransportConfig | None = None,
) -> AsyncIterator[ConnectionPair]:
    """Handshake a client (verifying the server's certificate against ``certs.ca``) with a server, in
    memory; yields once both sides completed SETUP and closes both sessions on exit."""
    settings = settings or TransportConfig(stack="aioquic")
    stack = get_stack(settings.stack)
    cls = protocol_class(settings.stack)
    client_tls = TlsConfig(ca_file=certs.ca)
    server_tls = TlsConfig(ca_file=certs.ca, cert_file=certs.cert, key_file=certs.key)
    client_quic = stack.QuicConnection(
        configuration=client_configuration(settings, client_tls, server_name="localhost")
    )
    # A server connection is made for the client's first Initial; aioquic's tests take the id the
    # client picked in the same way.
    server_quic = stack.QuicConnection(
        configuration=server_configuration(settings, server_tls),
        original_destination_connection_id=client_quic._original_destination_connection_id,
    )
    client = cls(client_quic, session_config=client_session or SessionConfig(is_client=True),
                 settings=settings)
    server = cls(server_quic, session_config=server_session or SessionConfig(is_client=False),
                 settings=settings)
    client_transport = MemoryDatagramTransport(CLIENT_ADDRESS)
    server_transport = MemoryDatagramTransport(SERVER_ADDRESS)
    client_transport.peer, server_transport.peer = server, client
    client.connection_made(client_transport)
    server.connection_made(server_transport)
    try:
        client.connect(SERVER_ADDRESS)
        async with asyncio.timeout(scaled(settings.handshake_timeout)):
            await client.wait_connected()
        await asyncio.gather(client.wait_setup(), server.wait_setup())
        yield ConnectionPair(client, server)
    finally:
        for conn in (client, server):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.close_session(), scaled(5))
        client_transport.close()
        server_transport.close()
