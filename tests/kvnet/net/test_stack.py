"""Tests for kvnet.net.stack: TLS configuration rules on every stack, configuration following the
stack, a real handshake with the project's certificates."""

from __future__ import annotations

import logging
import socket
import ssl
import sys
from pathlib import Path
from typing import Any

import pytest
from aioquic.asyncio import connect, serve

from kvnet.net.config import (
    DATAGRAM_SIZE_QH3_LOOPBACK,
    TlsConfig,
    TransportConfig,
)
from kvnet.net.registry import client_configuration, get_stack, server_configuration
from kvnet.net.sockets import apply_socket_buffers
from kvnet.security import certs
from tests.helpers.processes import make_certificates


def test_tls_rules(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    certs.create_ca(tmp_path)
    certs.issue_cert(tmp_path, "server", ["localhost"])
    with pytest.raises(ValueError, match="ca_file"):
        client_configuration(TransportConfig(), TlsConfig())
    with pytest.raises(ValueError, match="together"):
        TlsConfig(cert_file=tmp_path / "server.pem")
    with pytest.raises(ValueError, match="does not exist"):
        TlsConfig(ca_file=tmp_path / "nope.pem")
    cfg = client_configuration(TransportConfig(), TlsConfig.from_dir(tmp_path, None), "h")
    assert cfg.verify_mode == ssl.CERT_REQUIRED and cfg.alpn_protocols == ["moqt-18"]
    with caplog.at_level(logging.WARNING):
        cfg = client_configuration(TransportConfig(), TlsConfig(insecure_skip_verify=True))
    assert cfg.verify_mode == ssl.CERT_NONE
    assert "VERIFICATION DISABLED" in caplog.text


async def test_handshake_with_project_certs(tmp_path: Path) -> None:
    make_certificates(tmp_path, "server")
    settings = TransportConfig()
    server = await serve(
        "127.0.0.1", 0,
        configuration=server_configuration(settings, TlsConfig.from_dir(tmp_path, "server")),
    )
    sock = server._transport.get_extra_info("socket")  # type: ignore[union-attr]
    apply_socket_buffers(sock, settings)
    assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) >= 4 << 20
    port = sock.getsockname()[1]
    cfg = client_configuration(settings, TlsConfig.from_dir(tmp_path, None), "localhost")
    async with connect("127.0.0.1", port, configuration=cfg) as client:
        await client.ping()
        assert client._quic.tls.alpn_negotiated == "moqt-18"
    server.close()


async def test_a_ca_held_in_memory_verifies_the_server_as_a_ca_file_does(tmp_path: Path) -> None:
    """``ca_pem``: the hub's CA of ``kvnet-relay --workers``, kept in memory once its file is gone."""
    make_certificates(tmp_path / "right", "server")
    certs.create_ca(tmp_path / "wrong")
    with pytest.raises(ValueError, match="not both"):
        TlsConfig(ca_file=tmp_path / "right" / "ca.pem", ca_pem=b"")
    # aiopquic verifies only against a file; where it cannot load, that is the one-line reason instead.
    refusal = "ca_file" if sys.version_info >= (3, 12) else "needs Python >= 3.12"
    with pytest.raises(ValueError, match=refusal):
        client_configuration(TransportConfig(stack="aiopquic"), TlsConfig(ca_pem=b""), "h")
    settings = TransportConfig()
    server_tls = TlsConfig.from_dir(tmp_path / "right", "server")
    server = await serve("127.0.0.1", 0, configuration=server_configuration(settings, server_tls))
    port = server._transport.get_extra_info("socket").getsockname()[1]  # type: ignore[union-attr]

    def client(ca: Path) -> Any:
        return client_configuration(settings, TlsConfig(ca_pem=ca.read_bytes()), "localhost")

    try:
        async with connect("127.0.0.1", port, configuration=client(tmp_path / "right" / "ca.pem")) as c:
            await c.ping()
        with pytest.raises(ConnectionError):
            async with connect("127.0.0.1", port, configuration=client(tmp_path / "wrong" / "ca.pem")):
                pass
    finally:
        server.close()


def stack_class(name: str) -> Any:
    """The stack's configuration class, typed Any so that its attributes can be read after a type check."""
    return get_stack(name).QuicConfiguration


def test_configuration_follows_the_stack(tmp_path: Path) -> None:
    certs.create_ca(tmp_path)
    tls = TlsConfig.from_dir(tmp_path, None)
    cfg: Any = client_configuration(TransportConfig(stack="aioquic"), tls, "h")
    assert type(cfg) is stack_class("aioquic")
    assert cfg.max_datagram_size == 16384 and cfg.congestion_control_algorithm == "kvnet-cubic"
    rtt_exit = TransportConfig(stack="aioquic", slow_start_rtt_exit=True, congestion_control="reno")
    assert client_configuration(rtt_exit, tls, "h").congestion_control_algorithm == "reno"
    # qh3 gets its own configuration class, with its path-MTU probing ceiling and no controller choice.
    cfg = client_configuration(TransportConfig(stack="qh3"), tls, "h")
    assert type(cfg) is stack_class("qh3")
    assert cfg.max_datagram_size == DATAGRAM_SIZE_QH3_LOOPBACK and cfg.alpn_protocols == ["moqt-18"]
    server_tls = TlsConfig(ca_file=tmp_path / "ca.pem", require_client_cert=True)
    with pytest.raises(ValueError, match="client certificates"):
        server_configuration(TransportConfig(stack="qh3"), server_tls)
