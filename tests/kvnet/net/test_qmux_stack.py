"""kvnet.net.qmux_stack on a real TLS 1.3/TCP connection: what the stack sets up beyond what every stack's
connection tests (tests/kvnet/net/test_connection.py) check."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, cast

from kvnet.net.config import TlsConfig, TransportConfig
from kvnet.net.connection import MoqtConnection
from kvnet.net.endpoint import connect, serve
from kvnet.net.qmux_stack import _RECEIVE_BUFFER, _RECEIVE_BUFFER_SMALL
from proto.buffer import vi64_encode
from proto.data import STREAM_TYPE_PADDING
from tests.helpers.connections import client_config, client_limits
from tests.helpers.processes import make_certificates
from tests.helpers.waiting import async_wait_until, scaled


def _buffer_size(conn: MoqtConnection) -> int:
    """The QMux protocol's own receive buffer (``MoqtConnection`` is built on the stack's protocol)."""
    return len(cast(Any, conn)._receive_buffer)


def _socket_read_size(conn: MoqtConnection) -> int:
    transport = conn._transport
    assert transport is not None
    size: int = transport._ssl_protocol.max_size  # type: ignore[attr-defined]
    return size


async def test_a_connection_that_receives_bulk_data_reads_the_socket_in_large_pieces(tmp_path: Path) -> None:
    """asyncio's SSL protocol reads 256 KiB from the socket at a time unless told otherwise. A connection
    starts there with a 256 KiB buffer of its own (an idle or control session holds little memory) and,
    at its first large read, reads up to 1 MiB per pass into a 1 MiB buffer (a subscriber's CPU per MB
    fell 16%). Fails here, rather than slowing fetches silently, if a Python's asyncio stops honouring
    it."""
    pki = make_certificates(tmp_path, "server").dir
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
            peer = await served
            for conn in (client, peer):  # SETUP and its answer: small reads
                assert _socket_read_size(conn) == 256 << 10
                assert _buffer_size(conn) == _RECEIVE_BUFFER_SMALL == 256 << 10
            # 8 MiB on a padding stream (draft-18: discarded by the receiver as it arrives).
            quic = client._quic
            stream_id = quic.get_next_available_stream_id(is_unidirectional=True)
            quic.send_stream_data(stream_id, vi64_encode(STREAM_TYPE_PADDING) + bytes(8 << 20), True)
            client.transmit()
            await async_wait_until(lambda: _socket_read_size(peer) == _RECEIVE_BUFFER,
                                   "the receiver reads 1 MiB at a time", timeout=scaled(30))
            assert _buffer_size(peer) == _RECEIVE_BUFFER == 1 << 20
            assert _socket_read_size(client) == 256 << 10  # it only sent
            assert not peer.is_closed and not client.is_closed
    finally:
        await server.close()
