"""Tests for kvnet.quic: settings validation, TLS configuration rules, URL parsing, a real handshake."""

from __future__ import annotations

import logging
import socket
import ssl
from pathlib import Path

import pytest
from aioquic.asyncio import connect, serve

from kvnet import certs, quic


def test_settings_defaults_and_validation() -> None:
    s = quic.TransportSettings()
    assert s.max_datagram_size == 16384 and s.socket_receive_buffer == 4 << 20
    assert quic.TransportSettings.for_ethernet().max_datagram_size == 1452
    with pytest.raises(ValueError, match="max_datagram_size"):
        quic.TransportSettings(max_datagram_size=16385)
    with pytest.raises(ValueError, match="max_datagram_size"):
        quic.TransportSettings(max_datagram_size=1000)
    with pytest.raises(ValueError, match="congestion_control"):
        quic.TransportSettings(congestion_control="bbr")
    with pytest.raises(ValueError, match="max_streams_bidi"):
        quic.TransportSettings(max_streams_bidi=0)


def test_parse_moqt_url() -> None:
    assert quic.parse_moqt_url("moqt://relay.example:4433/kv") == quic.MoqtUrl("relay.example", 4433, "/kv")
    assert quic.parse_moqt_url("moqt://[::1]:5") == quic.MoqtUrl("::1", 5, "")
    assert quic.parse_moqt_url("moqt://h").port == quic.DEFAULT_PORT
    for bad in ("https://h:1", "moqt://:1", "moqt://h:99999", "moqt://u@h:1", "moqt://h:1?x=1"):
        with pytest.raises(ValueError):
            quic.parse_moqt_url(bad)


def test_tls_rules(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    certs.create_ca(tmp_path)
    certs.issue_cert(tmp_path, "server", ["localhost"])
    with pytest.raises(ValueError, match="ca_file"):
        quic.client_configuration(quic.TransportSettings(), quic.TlsSettings())
    with pytest.raises(ValueError, match="together"):
        quic.TlsSettings(cert_file=tmp_path / "server.pem")
    with pytest.raises(ValueError, match="does not exist"):
        quic.TlsSettings(ca_file=tmp_path / "nope.pem")
    cfg = quic.client_configuration(quic.TransportSettings(), quic.TlsSettings.from_dir(tmp_path, None), "h")
    assert cfg.verify_mode == ssl.CERT_REQUIRED and cfg.alpn_protocols == ["moqt-18"]
    with caplog.at_level(logging.WARNING):
        cfg = quic.client_configuration(quic.TransportSettings(), quic.TlsSettings(insecure_skip_verify=True))
    assert cfg.verify_mode == ssl.CERT_NONE
    assert "VERIFICATION DISABLED" in caplog.text


async def test_handshake_with_project_certs(tmp_path: Path) -> None:
    certs.create_ca(tmp_path)
    certs.issue_cert(tmp_path, "server", ["localhost", "127.0.0.1"])
    settings = quic.TransportSettings()
    server = await serve(
        "127.0.0.1", 0,
        configuration=quic.server_configuration(settings, quic.TlsSettings.from_dir(tmp_path, "server")),
    )
    sock = server._transport.get_extra_info("socket")  # type: ignore[union-attr]
    quic.apply_socket_buffers(sock, settings)
    assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) >= 4 << 20
    port = sock.getsockname()[1]
    cfg = quic.client_configuration(settings, quic.TlsSettings.from_dir(tmp_path, None), "localhost")
    async with connect("127.0.0.1", port, configuration=cfg) as client:
        await client.ping()
        assert client._quic.tls.alpn_negotiated == "moqt-18"
    server.close()
