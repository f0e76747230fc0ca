"""Fetch and compute at once (``kvnet.node.overlap``) between real processes: a publisher, a relay behind a
link emulator, and a subscriber whose ABR splits the located prefix.

The ``small`` preset (4 KiB of fp32 KV per token, 16-token blocks: 64 KiB a block) and a throughput prior
near its prefill speed make the plan split the prefix; the emulator sets what the fetch really gets. The
output must be verified (``--verify``) as for every remote hit: the local-hit reference then holds the
head the node computed and the tail it fetched, exactly the blocks the request found in its cache.
"""

from __future__ import annotations

from typing import Any

from tests.nodes.cluster import SHARED_PREFIX, TEST_BLOCK_SIZE, Cluster

B = TEST_BLOCK_SIZE
BLOCK_BYTES = 4096 * B
"""Raw KV bytes of one block of the ``small`` preset (4 KiB of fp32 K and V per token)."""
PROMPT = (SHARED_PREFIX * 8)[:1900]
MODEL = ("--model", "small")
LINK_BPS = 5e7
"""The split test's link: the prefix (118 blocks, 7.7 MB) takes ~0.15 s to fetch, about what the ``small``
preset takes to prefill it on one core here (0.19 s in 208-token chunks). At 10 MB/s (0.77 s) fetching
lost to a head in such chunks by 4x, and the head computed every block; it took the 16-token chunks of a
calibration that found no fixed cost to slow the head down to the fetch's pace."""


def _publish_behind_link(c: Cluster, *link: str) -> int:
    """A relay holding ``PROMPT``'s blocks, reached through the link emulator shaped by ``link``: its port."""
    c.start_relay()
    c.publish_and_exit([PROMPT], *MODEL)
    return c.start_linkemu(*link)


def _split_subscriber(c: Cluster, port: int) -> dict[str, Any]:
    def subscribe(assumed_bps: float) -> dict[str, Any]:
        args = ("--verify", *MODEL, "--abr", "auto", "--assume-throughput", f"{assumed_bps:.6g}",
                "--max-tokens", "6")
        (report,) = c.subscribe([PROMPT + " and a question?"], *args, relay_port=port, timeout=180)
        return report

    report = subscribe(LINK_BPS)
    if report["abr"].get("compute_blocks", 0) == 0:
        # The plan splits only where fetching and computing the prefix take comparable time, and the node
        # measures its prefill speed at start (load decides it) and the fetch's fixed cost (a round trip and
        # the relay's first byte) at locate: assume the throughput that makes fetching the prefix cost what
        # computing it does by those measurements, so the split is the clear winner however fast or loaded
        # the machine is.
        inputs = report["abr"]["inputs"]
        tokens = report["located_blocks"] * B
        compute_s = tokens * inputs["prefill_per_token_s"] + inputs["prefill_overhead_s"]
        latency_s = inputs["rtt_s"] + inputs["first_byte_s"]
        assert latency_s < compute_s / 2, f"a round trip of {latency_s:.3f}s leaves no room to split {inputs}"
        report = subscribe(report["located_blocks"] * BLOCK_BYTES / (compute_s - latency_s))
    assert report["verified"] is True and report["kv_exact"] is True, report
    plan = report["abr"]
    assert 0 < plan["compute_blocks"] < plan["fetch_blocks"] == report["located_blocks"], plan
    usable = (len(PROMPT) + 1) // B
    assert report["located_blocks"] == usable
    return report


def _what_happened(report: dict[str, Any]) -> dict[str, Any]:
    """The parts of a report that say how a split went (pytest cuts a whole report short)."""
    keys = ("head_computed_blocks", "tail_fetched_blocks", "overlap", "fallback", "security_events",
            "bytes_fetched", "fetch_retries", "timings")
    return {k: report.get(k) for k in keys}


def test_head_is_computed_while_the_tail_is_fetched(kv_cluster: Cluster) -> None:
    # The fetch starts with the last block and the head with the first; the head's whole share is about a
    # tenth of a second of prefill, so on a loaded machine the node's event loop can be kept from the
    # fetch's first block for all of it and the head then computes every block (a lost race, not a
    # failure: the request is still served and verified). A fetch that reports an error is a failure at
    # once; a race lost with no error is run again, a fresh subscriber each time, a few times at most.
    port = _publish_behind_link(kv_cluster, "--delay-ms", "5", "--down-rate", f"{LINK_BPS:g}")
    tries = []
    for _ in range(3):
        report = _split_subscriber(kv_cluster, port)
        tries.append(_what_happened(report))
        assert not any("fetch of the tail stopped" in f for f in report["fallback"]), tries[-1]
        if report["tail_fetched_blocks"] > 0:
            break
    head, tail = report["head_computed_blocks"], report["tail_fetched_blocks"]
    assert head > 0 and tail > 0, tries
    assert report["overlap"]["head_blocks"] == head and report["overlap"]["fetched_blocks"] == tail
    # Between them the two sides covered the located prefix, unless the head stopped for a fetch that then
    # did not reach it in time (the request computed the blocks between, and says so); what the request
    # reused from the relay are fetched blocks only (the head is this node's own work, counted as computed).
    overlap = report["overlap"]
    if overlap["fetch_given_up"]:
        assert overlap["wait_s"] > 0
        assert any("did not reach the stopped head" in f for f in report["fallback"]), report["fallback"]
    else:
        assert head + tail >= report["located_blocks"], report
    assert 0 < report["remote_hit_tokens"] <= tail * B, report
    assert report["remote_hit_tokens"] + report["computed_tokens"] >= report["prompt_tokens"], report
    assert report["renditions"].get("lossless", 0) >= tail and report["bytes_fetched"] > 0


def test_a_stalled_fetch_leaves_the_rest_to_the_head(kv_cluster: Cluster) -> None:
    """The link trickles at 20 kB/s (a 56 kB block takes seconds): the head goes on past its planned
    share instead of waiting, and the fetch is cancelled once the head has reached what it delivered.

    The link's 16 kB burst lets the locate's answers through at once, as a shaped access link does: a
    1,200-byte packet at 20 kB/s alone takes 60 ms, which a fast machine's whole prefill of the prefix
    undercuts, and the plan would then rightly not split at all."""
    port = _publish_behind_link(kv_cluster, "--down-rate", "20000", "--burst", "16000")
    report = _split_subscriber(kv_cluster, port)
    assert report["head_computed_blocks"] > report["abr"]["compute_blocks"], report
    assert report["head_computed_blocks"] + report["tail_fetched_blocks"] >= report["located_blocks"]
    assert report["remote_hit_tokens"] <= report["tail_fetched_blocks"] * B
