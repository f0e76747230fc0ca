"""kvnet.net.qmux_stack on a real TLS 1.3/TCP connection: what the stack sets up beyond what every stack's
connection tests (tests/kvnet/net/test_connection.py) check."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvnet.net.config import TlsConfig, TransportConfig
from kvnet.net.connection import MoqtConnection
from kvnet.net.endpoint import connect, serve
from kvnet.net.qmux_stack import _RECEIVE_BUFFER
from kvnet.security import certs
from tests.helpers.connections import client_config, client_limits


@pytest.fixture
def pki(tmp_path: Path) -> Path:
    certs.create_ca(tmp_path)
    certs.issue_cert(tmp_path, "server", ["localhost", "127.0.0.1"])
    return tmp_path


def _socket_read_size(conn: MoqtConnection) -> int:
    transport = conn._transport
    assert transport is not None
    size: int = transport._ssl_protocol.max_size  # type: ignore[attr-defined]
    return size


async def test_both_ends_read_the_socket_as_much_as_their_receive_buffer_holds(pki: Path) -> None:
    """asyncio's SSL protocol reads 256 KiB from the socket at a time unless told otherwise; the stack
    raises that to its receive buffer on each connection (a subscriber's CPU per MB fell 16%). Fails
    here, rather than slowing fetches silently, if a Python's asyncio stops honouring it."""
    served: asyncio.Future[MoqtConnection] = asyncio.get_running_loop().create_future()

    async def handler(conn: MoqtConnection) -> None:
        served.set_result(conn)
        await conn.wait_closed()

    server = await serve("127.0.0.1", 0, TransportConfig(), TlsConfig.from_dir(pki, "server"), handler,
                         stack="qmux")
    try:
        tls = TlsConfig(ca_file=pki / "ca.pem", server_name="localhost")
        async with connect(f"moqt+qmux://127.0.0.1:{server.address[1]}", client_config(), tls,
                           limits=client_limits()) as client:
            assert _socket_read_size(client) == _RECEIVE_BUFFER == 1 << 20
            assert _socket_read_size(await served) == _RECEIVE_BUFFER
    finally:
        await server.close()
