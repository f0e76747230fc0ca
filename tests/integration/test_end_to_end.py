"""The main job of kvnet, as ``scripts/demo`` runs it: relay, publisher and subscriber processes on
loopback talking real QUIC. A publisher computes a shared prefix and publishes it; a cold subscriber
recomputes everything; a fresh subscriber reuses the prefix through the relay (remote hit) and then from
its own cache (local hit). Every output must equal a full local recompute (``--verify``)."""

from __future__ import annotations

from pathlib import Path

from tests.nodes.cluster import SHARED_PREFIX, TEST_BLOCK_SIZE, cluster

B = TEST_BLOCK_SIZE


def test_cold_remote_hit_local_hit(tmp_path: Path) -> None:
    shared = (len(SHARED_PREFIX) + 1) // B * B  # full blocks of the prefix (+ BOS), byte tokenizer
    ask, again = SHARED_PREFIX + "User: how do relays evict?", SHARED_PREFIX + "User: and publishers?"
    with cluster(tmp_path) as c:
        c.start_relay()
        c.start_publisher([SHARED_PREFIX])
        (cold,) = c.subscribe([ask], "--abr", "recompute", "--verify", "--max-tokens", "8")
        remote, local = c.subscribe([ask, again], "--abr", "fetch", "--verify", "--max-tokens", "8")
        served = c.relay_metrics()
    assert cold["verified"] is True and remote["verified"] is True and local["verified"] is True
    assert cold["remote_hit_tokens"] == cold["local_hit_tokens"] == 0 and cold["bytes_fetched"] == 0
    assert cold["computed_tokens"] == cold["prompt_tokens"]
    assert remote["remote_hit_tokens"] == shared > 0 and remote["local_hit_tokens"] == 0
    assert remote["bytes_fetched"] > 0 and remote["renditions"] == {"lossless": shared // B}
    assert remote["computed_tokens"] == remote["prompt_tokens"] - shared
    assert remote["output_token_ids"] == cold["output_token_ids"]  # same prompt: same tokens
    # Its own cache holds the first prompt's blocks: the prefix, and more if the prompts share more.
    assert local["local_hit_tokens"] >= shared and local["remote_hit_tokens"] == 0
    assert local["bytes_fetched"] == 0
    assert remote["fallback"] == [] and remote["security_events"] == []
    # The fetched bytes really crossed the relay (its own count, not the subscriber's).
    assert served["kvnet_relay_bytes_out_total"] >= remote["bytes_fetched"], served
