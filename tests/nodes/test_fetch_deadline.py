"""A fetch has one deadline from the ABR's own estimate, whatever pace the relay sets, and is re-planned by
the rate it measures before the deadline comes.

A link emulator in front of the relay trickles the relay's answers at 20 kB/s: every object still arrives
well within the per-object ``--timeout``, so only the deadline (or the re-plan that anticipates it) can
stop the fetch (finishing it would take minutes; recomputing takes about a second).
"""

from __future__ import annotations

import json
from typing import Any

from tests.helpers.processes import free_port
from tests.nodes.cluster import SHARED_PREFIX, TEST_BLOCK_SIZE, Cluster

MARGIN_S = 0.5
SLACK_S = 2.0
"""Scheduling allowance on a loaded 2-core machine on top of the deadline itself (timers fire late)."""


def _fetch_through_a_trickle(c: Cluster, margin_s: float) -> dict[str, Any]:
    """The report of a subscriber whose plan fetches ~7 MB through a 20 kB/s link, with ``margin_s``."""
    c.start_relay()
    # The small preset: its prefill (a fraction of a second for ~2k tokens) is slow enough that the plan
    # fetches whatever the locate round trip through the emulator measured; ~7 MB of lossless KV.
    prompt = (SHARED_PREFIX * 8)[:1900]
    model = ("--model", "small")
    c.publish_and_exit([prompt], *model)
    emu_port = free_port()
    emu = c._spawn(
        [
            "-m", "kvnet.cli", "linkemu", "--listen", f"127.0.0.1:{emu_port}",
            "--target", f"127.0.0.1:{c.relay_port}", "--down-rate", "20000",
        ],
        "linkemu",
    )
    assert emu.stdout is not None
    assert b"forwarding" in emu.stdout.readline(), c.log_of(emu)  # listening before the subscriber starts
    # The throughput prior makes the plan fetch; the per-object timeout is longer than any one trickled
    # object (a 16 KB layer at 20 kB/s) takes.
    args = ("--verify", *model, "--abr", "auto", "--assume-throughput", "1e12", "--timeout", "5")
    proc = c.start_subscriber([prompt + "?"], *args, "--fetch-margin", str(margin_s), relay_port=emu_port)
    out, _ = proc.communicate(timeout=120)
    log = c.log_of(proc)
    assert proc.returncode == 0, log[-3000:]
    report: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    assert report["verified"] is True, report
    assert report["abr"]["fetch_blocks"] > 0, report["abr"]  # the plan chose to fetch
    assert report["abandoned"] is not None, report
    assert any("abandoned at block" in f for f in report["fallback"]), report["fallback"]
    assert report["computed_tokens"] == report["prompt_tokens"] - report["remote_hit_tokens"]
    assert report["remote_hit_tokens"] < report["abr"]["fetch_blocks"] * TEST_BLOCK_SIZE
    return report


def test_trickling_relay_cannot_hold_a_fetch_past_its_deadline(kv_cluster: Cluster) -> None:
    report = _fetch_through_a_trickle(kv_cluster, MARGIN_S)
    # Ended by the deadline, or by the re-plan that saw it coming (which of the two depends on how soon
    # the first objects came): either way when the fetch stopped paying off, within the recompute time of
    # what it delivered plus the margin (and scheduling slack), far below what the relay's pace would cost.
    assert report["abandoned"].startswith(("deadline:", "re-planned")), report
    per_token = report["abr"]["inputs"]["prefill_per_token_s"]
    budget = MARGIN_S + report["remote_hit_tokens"] * per_token + SLACK_S
    assert report["timings"]["fetch_s"] <= budget, (report["timings"], budget)


def test_a_fetch_measured_too_slow_is_re_planned_before_its_deadline(kv_cluster: Cluster) -> None:
    # A margin far longer than the re-plan needs: the deadline would end the fetch after a minute, the
    # rate the fetch measures (20 kB/s, for ~7 MB) ends it at once, and the report says why.
    report = _fetch_through_a_trickle(kv_cluster, 60.0)
    assert report["abandoned"].startswith("re-planned"), report
    assert "MB/s this fetch measured" in report["abandoned"], report
