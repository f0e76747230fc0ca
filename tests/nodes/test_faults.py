"""Fetch problems cost time, never correctness: a relay killed mid-fetch means recompute."""

from __future__ import annotations

import json
import time

from tests.helpers.processes import free_port
from tests.nodes.cluster import SHARED_PREFIX, Cluster


def test_relay_killed_mid_fetch_falls_back_to_recompute(kv_cluster: Cluster) -> None:
    kv_cluster.start_relay()
    prefix = SHARED_PREFIX * 8  # ~2k tokens, ~2 MB of lossless KV on the tiny model
    kv_cluster.start_publisher([prefix[:1900]])
    # A 300 kB/s link between subscriber and relay makes the fetch take seconds.
    emu_port = free_port()
    kv_cluster._spawn(
        [
            "-m", "kvnet.cli", "linkemu", "--listen", f"127.0.0.1:{emu_port}",
            "--target", f"127.0.0.1:{kv_cluster.relay_port}", "--down-rate", "300000",
        ],
        "linkemu",
    )
    time.sleep(0.5)
    sub = kv_cluster.start_subscriber(
        [prefix[:1900] + "?"], "--verify", "--abr", "fetch", "--timeout", "3", relay_port=emu_port
    )
    deadline = time.monotonic() + 90
    while "fetching" not in kv_cluster.log_of(sub):
        assert sub.poll() is None, kv_cluster.log_of(sub)
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.5)
    assert kv_cluster.relay is not None
    kv_cluster.kill(kv_cluster.relay)
    out, _ = sub.communicate(timeout=120)
    report = json.loads(out.decode().strip().splitlines()[-1])
    log = kv_cluster.log_of(sub)
    assert sub.returncode == 0, log
    assert report["verified"] is True
    assert report["remote_hit_tokens"] < report["prompt_tokens"] - 16
    assert report["computed_tokens"] == report["prompt_tokens"] - report["remote_hit_tokens"]
    assert "recomputing" in log, log
    assert report["fallback"], report
