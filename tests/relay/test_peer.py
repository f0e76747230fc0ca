"""``relay.peer``: one session's request dispatch through its host's handler table, on a relay running in
the test's own process (``tests.relay.inprocess``), real QUIC and QMux on loopback."""

from __future__ import annotations

import pytest

from kvnet.net.errors import RequestRejected
from proto.errors import RequestErrorCode
from relay.__main__ import build_parser, config_from_args, parse_args
from relay.metrics import Metrics
from relay.peer import REQUEST_KINDS, request_kind
from relay.relay import Relay
from tests.helpers.processes import CertDir, free_port
from tests.relay.inprocess import relay_in_process
from tests.relay.peers import Publisher, connect_client, fetch_track, track_objects


async def test_every_request_kind_but_request_update_has_a_handler(cert_dir: CertDir) -> None:
    argv = ["--cert", str(cert_dir.cert), "--key", str(cert_dir.key), "--trust-any", "--metrics", ""]
    relay = Relay(config_from_args(parse_args(build_parser(), argv, env={})), Metrics())
    # REQUEST_UPDATE changes a request the relay already serves; it has no handler of its own and is
    # refused as NOT_SUPPORTED like any kind the table lacks.
    assert set(relay.handlers) == set(REQUEST_KINDS.values()) - {"request_update"}
    assert request_kind(object()) == "other"  # type: ignore[arg-type]


@pytest.mark.parametrize("transport", ["quic", "qmux"])
async def test_fetch_through_an_in_process_relay_then_from_its_cache(
    cert_dir: CertDir, transport: str
) -> None:
    flags: tuple[str, ...] = ()
    qmux_port = 0
    if transport == "qmux":
        qmux_port = free_port()
        flags = ("--listen-qmux", f"127.0.0.1:{qmux_port}")
    objs = track_objects(b"block-a", 5)
    async with relay_in_process(cert_dir, *flags) as relay:
        url = relay.url if transport == "quic" else f"moqt+qmux://127.0.0.1:{qmux_port}"
        pub = await Publisher(await connect_client(url, str(cert_dir.ca)), {b"block-a": objs}).start()
        sub = await connect_client(url, str(cert_dir.ca))
        try:
            assert await fetch_track(sub, b"block-a", 5) == objs
            await pub.stop()
            assert await fetch_track(sub, b"block-a", 5) == objs  # the publisher is gone: from the cache
            with pytest.raises(RequestRejected) as refused:
                await sub.track_status((b"not", b"routed"), b"x")
            assert refused.value.code == RequestErrorCode.DOES_NOT_EXIST
        finally:
            await sub.close_session()
        assert pub.counts["fetch"] == 1
        assert relay.value("requests_total", outcome="cache_hit", type="fetch") == 1
        assert relay.value("requests_total", outcome="does_not_exist", type="track_status") == 1
        assert relay.value("cache_objects") == 5
