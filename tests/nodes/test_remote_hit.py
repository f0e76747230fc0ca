"""Remote hits through a real relay: lossless, the loaded K/V exactly the publisher's, the output verified.
The cluster's tiny model runs in float32, whose prefill rows do not depend on the batch shape, so the output
also equals a cold recompute (``equals_recompute``; docs/nodes.md, "What `verified` means").

Byte tokenizer: one token per byte plus BOS, 16-token blocks (the cluster's). Shares are chosen to end
inside blocks, so the usable remote prefix is the floor of the shared tokens to a block boundary.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvnet.security.signing import generate_keypair
from tests.helpers.processes import free_port, start_relay
from tests.helpers.waiting import wait_until
from tests.nodes.cluster import SHARED_PREFIX, TEST_BLOCK_SIZE, Cluster

B = TEST_BLOCK_SIZE


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
        assert report["verified"] is True and report["kv_exact"] is True, (name, report)
        assert report["equals_recompute"] is True, (name, report)
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


def test_a_hit_loaded_in_a_lossy_rendition_is_not_kv_exact_so_not_verified(kv_cluster: Cluster) -> None:
    """int8 K/V is the publisher's signed bytes but not its K/V: the report says so and ``--verify`` fails
    (exit 3), whatever the output."""
    kv_cluster.start_relay()
    kv_cluster.start_publisher([SHARED_PREFIX], "--renditions", "int8")
    proc = kv_cluster.start_subscriber([SHARED_PREFIX + "Q: lossy?"], "--accept", "int8", "--verify")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 3, kv_cluster.log_of(proc)[-3000:]
    (report,) = [json.loads(line) for line in out.decode().splitlines() if line.strip()]
    shared = (len(SHARED_PREFIX) + 1) // B
    assert report["remote_hit_tokens"] == shared * B and report["renditions"] == {"int8": shared}, report
    assert report["kv_exact"] is False and report["verified"] is False, report
    assert report["security_events"] == [], report


def test_a_kvtc_hit_loads_with_the_tables_the_publisher_serves(kv_cluster: Cluster, tmp_path: Path) -> None:
    """kvtc: the operator calibrates the model's tables (``kvnet kvtc calibrate``); the publisher signs them
    and pushes them with its blocks into a relay that admits only what the publisher's key signed
    (``--trust``), then exits; a subscriber that accepts kvtc fetches the tables from the relay's cache,
    verifies them, and loads every shared block (its layer 1 predicted from layer 0). The KV is the
    publisher's signed bytes but lossy, so the report says it is not exact and ``--verify`` fails (exit
    3)."""
    text = tmp_path / "calibration.txt"
    text.write_text("Relays cache named objects; nodes fetch the longest prefix they share. " * 60)
    tables = tmp_path / "tiny.kvtc"
    calibrated = subprocess.run(
        [sys.executable, "-m", "kvnet.cli", "kvtc", "calibrate", "--model", "tiny", "--block-size", str(B),
         "--text", str(text), "--out", str(tables)], capture_output=True, text=True, timeout=300)
    assert calibrated.returncode == 0 and "kvtc tables:" in calibrated.stdout, calibrated.stderr[-2000:]
    # Enough text that layer 1 is predicted from layer 0: the subscriber decodes the chain in order.
    assert "1 of 2 layers predicted from the layer before" in calibrated.stdout, calibrated.stdout
    keys = generate_keypair(tmp_path / "keys")
    kv_cluster.start_relay("--trust", str(keys.public))
    kv_cluster.publish_and_exit([SHARED_PREFIX], "--renditions", "kvtc", "--kvtc-tables", str(tables),
                                "--key-dir", str(keys.private.parent))
    shared = (len(SHARED_PREFIX) + 1) // B
    wait_until(lambda: kv_cluster.relay_metrics()["kvnet_relay_cache_tracks"] == shared + 1,
               "the relay to cache the pushed blocks and their tables")
    proc = kv_cluster.start_subscriber([SHARED_PREFIX + "Q: transform coded?"], "--accept", "kvtc",
                                       "--verify", "--trust", str(keys.public))
    out, _ = proc.communicate(timeout=120)
    log = kv_cluster.log_of(proc)
    assert proc.returncode == 3, log[-3000:]
    (report,) = [json.loads(line) for line in out.decode().splitlines() if line.strip()]
    assert report["remote_hit_tokens"] == shared * B and report["renditions"] == {"kvtc": shared}, report
    assert report["kv_exact"] is False and report["verified"] is False, report
    assert report["security_events"] == [], report
    assert log.count("fetched and verified") == 1, log[-3000:]
    # The relay checked the tables track like the blocks (signed by the key it trusts) before caching it.
    metrics = kv_cluster.relay_metrics()
    refused = {k: v for k, v in metrics.items() if k.startswith("kvnet_relay_blocks_refused")}
    assert not any(refused.values()), refused


def test_tenants_are_isolated_by_node_secret_salts(kv_cluster: Cluster) -> None:
    """Salts derive from the operator's node secret and the tenant id: tenants never hit each other's
    blocks, nodes sharing the secret share a tenant's blocks, and a raw salt is not accepted at all."""
    from kvnet.security.tenancy import NodeSecret

    secret, other_secret = kv_cluster.tmp / "node.secret", kv_cluster.tmp / "other.secret"
    NodeSecret.generate(secret)
    NodeSecret.generate(other_secret)
    kv_cluster.start_relay()
    tenant_a = ("--node-secret", str(secret), "--tenant", "tenant-a")
    kv_cluster.start_publisher([SHARED_PREFIX], *tenant_a)
    prompt = SHARED_PREFIX + "tenant question"
    tenant_b = ("--node-secret", str(secret), "--tenant", "tenant-b")
    (other,) = kv_cluster.subscribe([prompt], *tenant_b, "--verify")
    assert other["remote_hit_tokens"] == 0 and other["verified"]
    (default,) = kv_cluster.subscribe([prompt], "--verify")
    assert default["remote_hit_tokens"] == 0 and default["verified"]
    (foreign,) = kv_cluster.subscribe([prompt], "--node-secret", str(other_secret), "--tenant", "tenant-a")
    assert foreign["remote_hit_tokens"] == 0
    (same,) = kv_cluster.subscribe([prompt], *tenant_a, "--verify")
    assert same["remote_hit_tokens"] == (len(SHARED_PREFIX) + 1) // B * B and same["verified"]
    proc = kv_cluster.start_subscriber([prompt], "--salt", "chosen-by-a-client")
    proc.wait(timeout=60)
    assert proc.returncode == 2  # no such flag: salts are derived, never given


def test_plain_on_a_fast_link_lossless_on_a_slow_one_both_bit_exact(kv_cluster: Cluster) -> None:
    """A publisher of both exact renditions; the subscriber's ABR takes plain where it believes the link
    fast (zstd's decode costs more than the bytes it saves) and lossless where it believes it slow, and
    either way the output equals a full recompute."""
    kv_cluster.start_relay()
    kv_cluster.start_publisher([SHARED_PREFIX], "--renditions", "lossless,plain")
    prompt = SHARED_PREFIX + "which rendition?"
    shared = (len(SHARED_PREFIX) + 1) // B
    for assumed, rendition in (("1e11", "plain"), ("2e7", "lossless")):
        (report,) = kv_cluster.subscribe([prompt], "--accept", "lossless,plain", "--abr", "fetch",
                                         "--assume-throughput", assumed, "--verify", "--max-tokens", "4")
        assert report["verified"] is True, report
        assert report["remote_hit_tokens"] == shared * B
        assert report["renditions"] == {rendition: shared}, (assumed, report)


def test_a_node_fetches_over_qmux_through_an_edge_whose_upstream_is_quic(kv_cluster: Cluster) -> None:
    """The subscriber's relay session is QMux over TLS/TCP (``moqt+qmux://``) to an edge relay that serves
    both transports and reaches the origin (where the publisher published, over QUIC) over QUIC: the blocks
    cross both, verified, and the output is bit-exact."""
    kv_cluster.start_relay()
    kv_cluster.start_publisher([SHARED_PREFIX])
    qmux_port = free_port()
    edge = start_relay(
        kv_cluster.cert_dir, kv_cluster.tmp, "--upstream", kv_cluster.url(),
        "--listen-qmux", f"127.0.0.1:{qmux_port}", log_level=None, env=kv_cluster.env, name="edge",
    )
    kv_cluster.procs.append(edge.proc)
    (report,) = kv_cluster.subscribe(
        [SHARED_PREFIX + "Question over QMux?"], "--verify", "--max-tokens", "4",
        relay_url=f"moqt+qmux://127.0.0.1:{qmux_port}",
    )
    shared = (len(SHARED_PREFIX) + 1) // B * B
    assert report["verified"] is True and report["remote_hit_tokens"] == shared, report
    assert report["bytes_fetched"] > 0
    assert edge.metrics()['kvnet_relay_upstream_requests_total{type="fetch"}'] >= 1


@pytest.mark.parametrize("transport", ["qmux", "quic"])
def test_a_remote_hit_striped_over_three_sessions_is_verified(kv_cluster: Cluster, transport: str) -> None:
    """``--fetch-connections 3``: the subscriber fetches its blocks over its own session and two fetch-only
    ones to the same relay (three sessions the relay accepts), each verifying its share, and the output is
    bit-exact like the one-session case."""
    qmux_port = free_port()
    kv_cluster.start_relay("--listen-qmux", f"127.0.0.1:{qmux_port}")
    kv_cluster.start_publisher([SHARED_PREFIX])
    url = f"moqt+qmux://127.0.0.1:{qmux_port}" if transport == "qmux" else kv_cluster.url()
    sessions = kv_cluster.relay_metrics().get("kvnet_relay_sessions_total", 0.0)
    (report,) = kv_cluster.subscribe(
        [SHARED_PREFIX + "Question over three sessions?"], "--verify", "--max-tokens", "4",
        "--fetch-connections", "3", relay_url=url,
    )
    shared = (len(SHARED_PREFIX) + 1) // B
    assert report["verified"] is True and report["kv_exact"] is True, report
    assert report["remote_hit_tokens"] == shared * B, report
    assert report["renditions"] == {"lossless": shared}, report
    assert kv_cluster.relay_metrics()["kvnet_relay_sessions_total"] - sessions == 3
