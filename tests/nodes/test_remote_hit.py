"""Remote hits through a real relay: output equals a full recompute (lossless, bit-exact tokens).

Byte tokenizer: one token per byte plus BOS, block size 16 (default). Shares are chosen to end inside
blocks, so the usable remote prefix is the floor of the shared tokens to a block boundary.
"""

from __future__ import annotations

from tests.nodes.cluster import SHARED_PREFIX, Cluster

B = 16


def _blocks_shared(a: str, b: str) -> int:
    n = 0
    ta, tb = [256, *a.encode()], [256, *b.encode()]
    while n < min(len(ta), len(tb)) and ta[n] == tb[n]:
        n += 1
    usable = (len(tb) - 1) // B
    return min(n // B, usable)


def test_remote_hit_is_bit_exact_for_zero_partial_and_full_shares(kv_cluster: Cluster) -> None:
    kv_cluster.start_relay()
    published = SHARED_PREFIX + "Question: what is a KV block?"
    kv_cluster.start_publisher([published])
    cases = {
        "none": "Completely unrelated prompt with no shared prefix at all, long enough for blocks.",
        "partial": SHARED_PREFIX[:150] + " -- then a different user part that diverges mid-block.",
        "full": published,
    }
    for name, prompt in cases.items():
        (report,) = kv_cluster.subscribe([prompt], "--verify", "--max-tokens", "8")
        expected_blocks = _blocks_shared(published, prompt)
        assert report["verified"] is True, (name, report)
        assert report["local_hit_tokens"] == 0
        assert report["remote_hit_tokens"] == expected_blocks * B, (name, report)
        assert report["computed_tokens"] == report["prompt_tokens"] - expected_blocks * B
        assert len(report["output_token_ids"]) == 8
        if expected_blocks:
            assert report["renditions"] == {"lossless": expected_blocks}
            assert report["bytes_fetched"] > 0
        else:
            assert report["bytes_fetched"] == 0
    assert _blocks_shared(published, cases["partial"]) == 150 // B  # the share ends inside block 9


def test_local_hit_after_remote_hit_in_one_process(kv_cluster: Cluster) -> None:
    kv_cluster.start_relay()
    kv_cluster.start_publisher([SHARED_PREFIX])
    first, second = kv_cluster.subscribe(
        [SHARED_PREFIX + "Q1: why?", SHARED_PREFIX + "Q2: how?"], "--verify", "--max-tokens", "4"
    )
    shared = (len(SHARED_PREFIX) + 1) // B * B
    assert first["remote_hit_tokens"] == shared and first["local_hit_tokens"] == 0
    assert second["local_hit_tokens"] == shared and second["remote_hit_tokens"] == 0
    assert second["bytes_fetched"] == 0
    assert first["verified"] and second["verified"]


def test_tenant_salt_isolates_blocks(kv_cluster: Cluster) -> None:
    kv_cluster.start_relay()
    kv_cluster.start_publisher([SHARED_PREFIX], "--salt", "tenant-a-secret")
    prompt = SHARED_PREFIX + "tenant question"
    (other,) = kv_cluster.subscribe([prompt], "--salt", "tenant-b-secret", "--verify")
    assert other["remote_hit_tokens"] == 0 and other["verified"]
    (unsalted,) = kv_cluster.subscribe([prompt], "--verify")
    assert unsalted["remote_hit_tokens"] == 0 and unsalted["verified"]
    (same,) = kv_cluster.subscribe([prompt], "--salt", "tenant-a-secret", "--verify")
    assert same["remote_hit_tokens"] == (len(SHARED_PREFIX) + 1) // B * B and same["verified"]


def test_untrusted_publisher_is_recomputed(kv_cluster: Cluster) -> None:
    kv_cluster.start_relay()
    stranger = kv_cluster.tmp / "stranger"
    from kvnet.signing import generate_keypair

    key = generate_keypair(stranger, "evil")
    kv_cluster.start_publisher([SHARED_PREFIX], "--signing-key", str(key.private))
    proc_reports = kv_cluster.subscribe([SHARED_PREFIX + "x"], "--verify")
    (report,) = proc_reports
    assert report["remote_hit_tokens"] == 0
    assert report["verified"] is True
    assert any("trusted" in f for f in report["fallback"]), report["fallback"]
