"""Fetch problems cost time, never correctness: a relay killed mid-fetch means recompute."""

from __future__ import annotations

import json

from tests.nodes.cluster import SHARED_PREFIX, Cluster


def test_relay_killed_mid_fetch_falls_back_to_recompute(kv_cluster: Cluster) -> None:
    kv_cluster.start_relay()
    prefix = SHARED_PREFIX * 8  # ~2k tokens, ~2 MB of lossless KV on the tiny model
    kv_cluster.start_publisher([prefix[:1900]])
    # A 300 kB/s link between subscriber and relay makes the fetch take seconds. It holds at most 32
    # datagrams (512 kB at loopback's 16 KiB), so what the relay sent before it died cannot be the whole
    # prefix still on its way (the default 1000 would hold 16 MB).
    emu_port = kv_cluster.start_linkemu("--down-rate", "300000", "--queue-packets", "32")
    sub = kv_cluster.start_subscriber(
        [prefix[:1900] + "?"], "--verify", "--abr", "fetch", "--timeout", "3", relay_port=emu_port
    )
    # Killed once the subscriber has located the blocks and started fetching them: the slow link keeps
    # the fetch going for seconds after that, so the relay goes away in the middle of it.
    kv_cluster.wait_for_log(sub, "fetching", "subscriber")
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
