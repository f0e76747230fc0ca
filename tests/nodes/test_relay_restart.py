"""The relay's persistent tier (``--cache-dir``): a relay killed with SIGKILL in the middle of traffic and
restarted on the same directory serves the blocks it had cached, with no publisher left; a block file
truncated on disk is detected, dropped and never served.

Everything is real: relay, publisher and subscriber processes over QUIC on loopback.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

from kvnet.cache.hashing import block_hashes
from kvnet.exchange.blockstore import DISK_NAMESPACE
from kvnet.node.config import NodeConfig
from kvnet.node.node import Node
from kvnet.storage.disk import track_file_name
from proto.kvobject import block_track
from tests.helpers.processes import start_relay
from tests.helpers.waiting import wait_until
from tests.nodes.cluster import SHARED_PREFIX, TEST_BLOCK_SIZE, Cluster

PROMPT = SHARED_PREFIX + "Question: what survives a relay restart?"
OTHER = SHARED_PREFIX * 4 + "Question: and what was in flight?"
UNRELATED = "Nothing in common with the other prompts: " * 4


def metric(c: Cluster, name: str) -> float:
    return sum(v for k, v in c.relay_metrics().items() if k == name or k.startswith(name + "{"))


def subscribe(c: Cluster) -> dict[str, Any]:
    proc = c.start_subscriber([PROMPT], "--verify", "--timeout", "5")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, c.log_of(proc)[-3000:]
    report = json.loads(out.decode().strip().splitlines()[-1])
    assert report["verified"] is True, report
    return dict(report)


def block_file(cache_dir: Path, index: int) -> Path:
    """The persistent tier's file of block ``index`` of PROMPT (the nodes' model, lossless)."""
    node = Node.from_config(NodeConfig(model="tiny", block_size=TEST_BLOCK_SIZE))
    hashes = block_hashes(node.tokenize_prompt(PROMPT), TEST_BLOCK_SIZE, node.root)
    ns, name = block_track(node.fingerprint, "default", hashes[index], "lossless")
    return cache_dir / track_file_name(ns, name)


def test_relay_killed_mid_traffic_serves_its_disk_cache_after_restart(
    kv_cluster: Cluster, tmp_path: Path
) -> None:
    c = kv_cluster
    cache_dir = tmp_path / "relay-cache"
    c.start_relay("--cache-dir", str(cache_dir))
    c.publish_and_exit([PROMPT])  # pushes every block into the relay's cache, then exits
    wait_until(
        lambda: metric(c, "kvnet_relay_cache_disk_tracks") >= metric(c, "kvnet_relay_cache_tracks") > 0,
        "every cached block written to disk",
    )
    written = int(metric(c, "kvnet_relay_cache_disk_tracks"))

    # Mid-traffic: another publisher is pushing a longer prompt when the relay is killed.
    bytes_before = metric(c, "kvnet_relay_bytes_in_total")
    pusher = c.start_publisher([OTHER], "--exit-after-publish", wait=False)
    wait_until(lambda: metric(c, "kvnet_relay_bytes_in_total") > bytes_before, "second push under way")
    assert c.relay is not None
    c.kill(c.relay, signal.SIGKILL)
    c.kill(pusher)
    assert len(list(cache_dir.glob("*.track"))) >= written

    # Restarted on the same directory, with no publisher anywhere: the whole prefix is a remote hit.
    c.start_relay("--cache-dir", str(cache_dir))
    assert not list(cache_dir.glob("*.tmp")), "unfinished writes are removed at start-up"
    report = subscribe(c)
    usable = (report["prompt_tokens"] - 1) // TEST_BLOCK_SIZE
    assert report["remote_hit_tokens"] == usable * TEST_BLOCK_SIZE, report
    assert metric(c, "kvnet_relay_cache_disk_loads") >= usable
    assert metric(c, "kvnet_relay_cache_disk_dropped") == 0

    # A block file truncated while the relay is down is dropped on read: blocks before it are served, the
    # rest is recomputed, and the output is still verified.
    c.kill(c.relay, signal.SIGKILL)
    damaged = block_file(cache_dir, 2)
    assert damaged.exists()
    os.truncate(damaged, damaged.stat().st_size // 2)
    c.start_relay("--cache-dir", str(cache_dir))
    report = subscribe(c)
    assert report["remote_hit_tokens"] == 2 * TEST_BLOCK_SIZE, report
    assert report["security_events"] == [], report  # never served: the subscriber saw no bad block
    assert metric(c, "kvnet_relay_cache_disk_dropped") == 1
    assert not damaged.exists()


def test_edge_notices_a_killed_origin_within_seconds_and_uses_the_restarted_one(
    kv_cluster: Cluster, tmp_path: Path
) -> None:
    """An edge relay in front of an origin with ``--cache-dir``: the origin is killed with SIGKILL and
    restarted on its directory. The edge notices the dead upstream session within a few seconds (its
    upstream sessions time out after ``--upstream-idle-timeout``, not the 15 s QUIC default) and the next
    miss reaches the restarted origin, which serves the blocks from disk: no publisher is left."""
    c = kv_cluster
    c.start_relay("--cache-dir", str(tmp_path / "origin-cache"))
    edge = start_relay(
        c.cert_dir,
        c.tmp,
        "--upstream",
        c.url(),
        "--upstream-idle-timeout",
        "2",
        name="edge",
        log_level="info",
        env=c.env,
    )
    try:
        c.publish_and_exit([PROMPT])
        wait_until(
            lambda: metric(c, "kvnet_relay_cache_disk_tracks") >= metric(c, "kvnet_relay_cache_tracks") > 0,
            "origin wrote its blocks to disk",
        )
        # A miss through the edge opens its upstream session (this prompt shares no block with PROMPT).
        proc = c.start_subscriber([UNRELATED], "--timeout", "5", relay_port=edge.port)
        proc.communicate(timeout=120)
        assert proc.returncode == 0, c.log_of(proc)[-3000:]
        assert "connected to upstream relay" in edge.log()

        assert c.relay is not None
        c.kill(c.relay, signal.SIGKILL)
        # Generous for a loaded machine, yet below the 15 s a QUIC idle timeout alone would take.
        wait_until(lambda: "upstream session ended" in edge.log(), "edge noticed the dead origin", timeout=10)
        c.start_relay("--cache-dir", str(tmp_path / "origin-cache"))
        proc = c.start_subscriber([PROMPT], "--verify", "--timeout", "5", relay_port=edge.port)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, c.log_of(proc)[-3000:]
        report = json.loads(out.decode().strip().splitlines()[-1])
        usable = (report["prompt_tokens"] - 1) // TEST_BLOCK_SIZE
        assert report["verified"] is True and report["remote_hit_tokens"] == usable * TEST_BLOCK_SIZE, report
        assert metric(c, "kvnet_relay_cache_disk_loads") >= usable
    finally:
        edge.stop()


def test_publisher_restarted_on_its_cache_dir_serves_what_it_published(
    kv_cluster: Cluster, tmp_path: Path
) -> None:
    """A publisher with ``--cache-dir`` publishes and is killed (nothing pushed into the relay's cache); a new
    publisher process on the same directory, started for another prompt, serves the first prompt's
    blocks from disk; a block file truncated on disk is dropped and never served."""
    c = kv_cluster
    store_dir = tmp_path / "publisher-cache"
    c.start_relay()
    node_args = ("--no-push", "--cache-dir", str(store_dir))
    first = c.start_publisher([PROMPT], *node_args)  # READY once every block is stored
    c.kill(first, signal.SIGKILL)
    server = c.start_publisher([UNRELATED], *node_args)  # computes nothing of PROMPT
    report = subscribe(c)
    usable = (report["prompt_tokens"] - 1) // TEST_BLOCK_SIZE
    assert report["remote_hit_tokens"] == usable * TEST_BLOCK_SIZE, report

    c.kill(server)
    assert c.relay is not None
    c.kill(c.relay)  # the relay cached what it fetched: a fresh one must ask the publisher again
    c.start_relay()
    damaged = store_file(store_dir, 2)
    assert damaged.exists()
    os.truncate(damaged, damaged.stat().st_size - 7)
    c.start_publisher([UNRELATED], *node_args)
    report = subscribe(c)
    assert report["remote_hit_tokens"] == 2 * TEST_BLOCK_SIZE, report
    assert report["security_events"] == [], report  # dropped by the store, never sent
    assert not damaged.exists()


def store_file(store_dir: Path, index: int) -> Path:
    """The block store's file of block ``index`` of PROMPT (lossless)."""
    node = Node.from_config(NodeConfig(model="tiny", block_size=TEST_BLOCK_SIZE))
    hashes = block_hashes(node.tokenize_prompt(PROMPT), TEST_BLOCK_SIZE, node.root)
    return store_dir / track_file_name(DISK_NAMESPACE, hashes[index].hex().encode() + b".lossless")
