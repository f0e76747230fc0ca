"""``relay.fanout``: a live track that ends upstream reaches every subscriber whole.

The relay forwards a track's objects into each subscriber's subgroup streams; over a slow link those bytes
trail far behind. A subscriber waits for the trailing streams only ``publish_done_timeout`` without any of
their bytes after PUBLISH_DONE, so a relay that sends PUBLISH_DONE as soon as the upstream track ends
(objects still queued behind it) cuts the track short. A relay in the test's own process
(``tests.relay.inprocess``), real QUIC through the link emulator.
"""

from __future__ import annotations

import asyncio

from kvnet.net.config import TlsConfig
from kvnet.net.endpoint import connect
from kvnet.net.handles import Subscription
from kvnet.net.limits import ConnectionLimits
from kvnet.tools.linkemu import EmulatorConfig, LinkEmulator, LinkParams
from tests.helpers.connections import client_config, client_limits
from tests.helpers.processes import CertDir
from tests.helpers.waiting import scaled
from tests.relay.inprocess import InProcessRelay, relay_in_process
from tests.relay.peers import NS, Publisher, connect_client, track_objects

OBJECTS = 3
OBJECT_BYTES = 300_000
LINK_BPS = 150_000
"""Each object needs about 2 s to cross toward the subscriber: twice the subscriber's wait below."""
DONE_WAIT_S = 1.0


async def _payloads(handle: Subscription) -> list[bytes]:
    return [o.payload async for o in handle if o.payload]


async def test_a_live_track_ending_upstream_reaches_a_slow_subscriber_whole(cert_dir: CertDir) -> None:
    async with relay_in_process(cert_dir) as relay:
        await _slow_subscriber_gets_the_whole_track(relay, cert_dir)


async def _slow_subscriber_gets_the_whole_track(relay: InProcessRelay, cert_dir: CertDir) -> None:
    objs = track_objects(b"slow-live", OBJECTS, OBJECT_BYTES)
    pub = await Publisher(await connect_client(relay.url, str(cert_dir.ca)), {b"slow-live": objs}).start()
    link = EmulatorConfig(
        listen=("127.0.0.1", 0),
        target=("127.0.0.1", relay.port),
        downstream=LinkParams(rate_bps=LINK_BPS, queue_packets=4096),
    )
    try:
        async with (
            LinkEmulator(link) as emu,
            connect(
                f"moqt://127.0.0.1:{emu.listen_address[1]}",
                client_config(),
                TlsConfig(ca_file=cert_dir.ca),
                limits=client_limits(ConnectionLimits(publish_done_timeout=DONE_WAIT_S)),
            ) as sub,
        ):
            handle = await sub.subscribe(NS, b"slow-live")
            pub.live.set()  # the publisher sends the whole track and its PUBLISH_DONE at once
            got = await asyncio.wait_for(_payloads(handle), scaled(120))
            assert got == objs
            assert handle.done is not None and handle.done.status_code == 0x2  # TRACK_ENDED
    finally:
        await pub.stop()
