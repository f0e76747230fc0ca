"""kvnet's publisher and subscriber through the third-party relay of aiomoqt, on the nodes' default flags.

That relay answers every TRACK_STATUS itself (DOES_NOT_EXIST) instead of forwarding it, and its QUIC stack
advertises a max_udp_payload_size of about 1.4 KB; kvnet still gets a verified remote hit through it.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.processes import free_port, wait_for_output
from tests.interop.conftest import Aiomoqt
from tests.nodes.cluster import SHARED_PREFIX, TEST_BLOCK_SIZE, Cluster, cluster


@pytest.fixture
def aiomoqt_relay_cluster(aiomoqt: Aiomoqt, tmp_path: Path) -> Iterator[Cluster]:
    """A node cluster whose relay is aiomoqt's interop relay (raw QUIC, the cluster's certificate)."""
    with cluster(tmp_path) as c:
        port = free_port()
        log = tmp_path / "aiomoqt-relay.log"
        with open(log, "wb") as out:
            relay = subprocess.Popen(
                [str(aiomoqt.python), "-m", "aiomoqt.tools.moq_interop_relay", "--bind", "127.0.0.1",
                 "--port", str(port), "--cert", str(c.cert_dir.cert), "--key", str(c.cert_dir.key), "--quic"],
                stdout=out, stderr=subprocess.STDOUT,
            )
        try:
            wait_for_output(relay, lambda: log.read_text(errors="replace"), "Listening on", "aiomoqt relay")
            c.relay_port = port
            yield c
        finally:
            relay.kill()
            relay.wait()


def test_remote_hit_through_aiomoqt_relay(aiomoqt_relay_cluster: Cluster) -> None:
    c = aiomoqt_relay_cluster
    published = SHARED_PREFIX + "Question: what is a KV block?"
    c.start_publisher([published])
    (report,) = c.subscribe([published], "--verify", "--max-tokens", "4")
    usable = (len(published) + 1 - 1) // TEST_BLOCK_SIZE  # BOS + bytes; the last token is always computed
    assert report["verified"] is True, report
    assert report["remote_hit_tokens"] == usable * TEST_BLOCK_SIZE > 0, report
