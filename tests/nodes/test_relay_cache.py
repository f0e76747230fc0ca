"""Blocks live on in the relay: one cached copy for two publishers, hits after the publisher is gone."""

from __future__ import annotations

from tests.nodes.cluster import SHARED_PREFIX, TEST_BLOCK_SIZE, Cluster

B = TEST_BLOCK_SIZE


def test_publisher_killed_after_publishing_still_hits_from_relay_cache(kv_cluster: Cluster) -> None:
    kv_cluster.start_relay()
    kv_cluster.publish_and_exit([SHARED_PREFIX])  # pushes into the relay cache, then exits
    (report,) = kv_cluster.subscribe([SHARED_PREFIX + "after the publisher left"], "--verify")
    assert report["remote_hit_tokens"] == (len(SHARED_PREFIX) + 1) // B * B
    assert report["verified"] is True


def test_serving_publisher_killed_blocks_remain_cached(kv_cluster: Cluster) -> None:
    kv_cluster.start_relay()
    pub = kv_cluster.start_publisher([SHARED_PREFIX])
    kv_cluster.kill(pub)
    (report,) = kv_cluster.subscribe([SHARED_PREFIX + "killed"], "--verify")
    assert report["remote_hit_tokens"] == (len(SHARED_PREFIX) + 1) // B * B
    assert report["verified"] is True


def test_two_publishers_of_one_prefix_leave_one_cached_copy(kv_cluster: Cluster) -> None:
    kv_cluster.start_relay()
    kv_cluster.publish_and_exit([SHARED_PREFIX])
    one = kv_cluster.relay_metrics()
    kv_cluster.publish_and_exit([SHARED_PREFIX])
    two = kv_cluster.relay_metrics()
    blocks = (len(SHARED_PREFIX) + 1) // B
    assert one["kvnet_relay_cache_tracks"] == blocks, one
    assert one["kvnet_relay_cache_bytes"] > 0
    # Same track names, so the second publisher's copy is not stored next to the first's.
    assert two["kvnet_relay_cache_tracks"] == blocks, two
    assert abs(two["kvnet_relay_cache_bytes"] - one["kvnet_relay_cache_bytes"]) <= 0.05 * one[
        "kvnet_relay_cache_bytes"
    ], (one, two)
    (report,) = kv_cluster.subscribe([SHARED_PREFIX + "which copy?"], "--verify")
    assert report["remote_hit_tokens"] == (len(SHARED_PREFIX) + 1) // B * B and report["verified"]


def test_publish_and_exit_fails_when_nothing_reaches_the_relay_cache(kv_cluster: Cluster) -> None:
    # With --no-push the relay holds nothing once the publisher is gone, so exiting 0 would lie.
    kv_cluster.start_relay()
    args = kv_cluster.node_args([SHARED_PREFIX], ["--exit-after-publish", "--no-push"], None)
    proc = kv_cluster._spawn(["-m", "publisher", *args], "publisher")
    assert proc.wait(timeout=120) == 1
    assert "accepted none of" in kv_cluster.log_of(proc)
