"""Tests for kvnet.net.aioquic_stack: the datagram size aioquic sends follows the peer's limit."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvnet.net.config import (
    DATAGRAM_SIZE_ETHERNET,
    DATAGRAM_SIZE_LOOPBACK,
    TlsConfig,
    TransportConfig,
)
from kvnet.net.endpoint import connect as connect_moqt
from kvnet.tools import linkemu
from proto.errors import PublishDoneCode
from tests.helpers.connections import client_config as scaled_client_config
from tests.helpers.connections import client_limits
from tests.helpers.processes import make_certificates, start_relay
from tests.helpers.waiting import async_wait_until


@pytest.mark.parametrize("relay_datagram_size", [1452, None])
async def test_peer_max_udp_payload_size_caps_what_we_send(
    tmp_path: Path, relay_datagram_size: int | None
) -> None:
    """A relay configured for 1452-byte datagrams advertises max_udp_payload_size 1452; a client configured
    for 16384 then sends nothing larger (counted by the link emulator between them). Without that
    advertisement the same client does send 16384-byte datagrams (the count can see them)."""
    cert_dir = make_certificates(tmp_path / "certs")
    extra = [] if relay_datagram_size is None else ["--max-datagram-size", str(relay_datagram_size)]
    relay = start_relay(cert_dir, tmp_path, *extra)
    config = linkemu.EmulatorConfig(listen=("127.0.0.1", 0), target=("127.0.0.1", relay.port))
    try:
        async with linkemu.LinkEmulator(config) as link:
            host, port = link.listen_address
            client_config = scaled_client_config(
                TransportConfig(max_datagram_size=DATAGRAM_SIZE_LOOPBACK)
            )
            tls = TlsConfig(ca_file=cert_dir.ca)
            conn = await connect_moqt(f"moqt://{host}:{port}", client_config, tls, limits=client_limits())
            try:
                payloads = [bytes([i]) * 60_000 for i in range(8)]
                ok = await conn.publish((b"kvnet", b"dgram"), b"big", 1)
                sid = conn.open_subgroup(1, 0, 0)
                for i, payload in enumerate(payloads):
                    conn.send_subgroup_object(sid, i, payload)
                conn.close_subgroup(sid)

                async def relay_got_all() -> bool:
                    return (await relay.ametrics()).get("kvnet_relay_bytes_in_total", 0) >= 8 * 60_000

                await async_wait_until(relay_got_all, "the relay received every object")
                conn.publish_done(ok.request_id, PublishDoneCode.TRACK_ENDED, "done")
            finally:
                await conn.close_session()
            sent = link.stats()["upstream"]
            if relay_datagram_size is None:
                assert sent.largest > DATAGRAM_SIZE_ETHERNET
            else:
                assert sent.largest <= relay_datagram_size
                assert link.stats()["downstream"].largest <= relay_datagram_size
    finally:
        relay.stop()
