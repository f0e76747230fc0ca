"""The WAN demo's comparison (``kvnet.tools.cluster.smoke.WanDemo``) on reports shaped like the
subscriber's ``--json`` lines; the demo itself runs in tests/integration/test_cluster.py."""

from __future__ import annotations

from typing import Any

from kvnet.tools.cluster.smoke import WanDemo, choice_of, median_ttft


def report(ttft_s: float, *, fetch_blocks: int = 0, compute_blocks: int = 0, hit: int = 0) -> dict[str, Any]:
    abr: dict[str, Any] = {"fetch_blocks": fetch_blocks, "compute_blocks": compute_blocks}
    if not fetch_blocks:
        abr["locate_skipped"] = "fetching a block would take 300.0 ms against 30.0 ms computing it"
        abr["inputs"] = {"throughput_bps": 3e6}
    return {
        "timings": {"ttft_s": ttft_s}, "abr": abr, "remote_hit_tokens": hit, "prompt_tokens": 700,
        "bytes_fetched": 10_200_000 if hit else 0, "abandoned": None, "equals_recompute": True,
    }


def test_one_slow_request_does_not_decide_the_verdict() -> None:
    # A single request would read 0.64 / 0.47 = 1.36x; the medians read 0.61 / 0.55.
    chosen = [report(0.61), report(0.46), report(0.64)]
    recomputed = [report(0.61), report(0.55), report(0.47)]
    fetched = [report(t, fetch_blocks=10, hit=640) for t in (5.4, 3.6, 3.4)]
    demo = WanDemo(chosen, fetched, recomputed, first_contact=report(1.0))
    assert median_ttft(chosen) == 0.61
    assert abs(demo.against_best - 0.61 / 0.55) < 1e-9
    assert abs(demo.speedup - 0.55 / 3.6) < 1e-9
    assert demo.choices == ["recompute"] * 3
    summary = demo.summary()
    assert "chose to recompute all 3 times" in summary
    assert "median 0.61 s (0.61/0.46/0.64)" in summary
    assert "1.11x the faster rung (NOT within 10%)" in summary


def test_each_request_keeps_its_own_choice() -> None:
    assert choice_of(report(1.0, fetch_blocks=10, compute_blocks=2)) == "fetch and compute"
    assert choice_of(report(1.0, fetch_blocks=10)) == "fetch"
    assert choice_of(report(1.0)) == "recompute"
    chosen = [report(0.5), report(4.0, fetch_blocks=10, hit=640), report(0.5)]
    demo = WanDemo(chosen, [report(4.0, fetch_blocks=10, hit=640)] * 3, [report(0.5)] * 3, report(1.0))
    assert "chose to recompute, fetch, recompute" in demo.summary()
    assert "(within 10%)" in demo.summary()


def test_one_timed_copy_reads_as_one() -> None:
    # The suite's run of the demo times one copy (tests/integration/test_cluster.py).
    fetched = [report(7.4, fetch_blocks=10, hit=640)]
    demo = WanDemo(fetched, fetched, [report(23.9)], first_contact=report(4.7, fetch_blocks=8, hit=512))
    summary = demo.summary()
    assert "over one copy of the shared request, the ABR chose to fetch (first:" in summary
    assert "median 7.40 s (7.40)" in summary and "1.00x the faster rung (within 10%)" in summary
