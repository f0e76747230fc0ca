"""Locating a 256-block prefix costs O(1) round trips, measured through the userspace link emulator.

A locate also costs CPU time (one TRACK_STATUS per block, each encoded, relayed and answered in Python),
which on a busy 2-core machine is of the order of an RTT by itself and does not depend on the RTT. So the
number of round trips is measured as the slope of locate time over added RTT: the same locate through a
20 ms and a 120 ms link. A per-block (sequential) probe would cost 258 RTTs, a binary search about 9.
"""

from __future__ import annotations

import time

from tests.nodes.cluster import Cluster, free_port

BLOCK = 4
RTTS_S = (0.020, 0.120)


def _locate_through_link(cluster: Cluster, text: str, rtt_s: float) -> dict[str, float]:
    emu_port = free_port()
    cluster._spawn(
        [
            "-m", "kvnet.cli", "linkemu", "--listen", f"127.0.0.1:{emu_port}",
            "--target", f"127.0.0.1:{cluster.relay_port}", "--delay-ms", str(rtt_s * 1e3 / 2),
        ],
        "linkemu",
    )
    time.sleep(0.3)
    (report,) = cluster.subscribe(
        [text], "--block-size", str(BLOCK), "--max-tokens", "1", "--abr", "fetch", relay_port=emu_port
    )
    assert report["located_blocks"] >= 256, report
    assert report["remote_hit_tokens"] >= 256 * BLOCK
    timings: dict[str, float] = report["timings"]
    return timings


def test_locate_of_256_blocks_takes_under_three_rtts(kv_cluster: Cluster) -> None:
    kv_cluster.start_relay()
    text = "".join(chr(97 + (i * 7) % 26) for i in range(256 * BLOCK + 8))
    kv_cluster.start_publisher([text], "--block-size", str(BLOCK))
    near, far = (_locate_through_link(kv_cluster, text, rtt) for rtt in RTTS_S)
    round_trips = (far["locate_s"] - near["locate_s"]) / (RTTS_S[1] - RTTS_S[0])
    assert round_trips < 3.0, (near, far)
