"""Tests for kvnet/node/abr.py: estimators and the fetch-or-recompute decision."""

from __future__ import annotations

import pytest

from kvnet.node.abr import RECOMPUTE, AbrConfig, KvAbr, PrefillEstimator, ThroughputEstimator

BLOCK = 16
RAW = 1_000_000  # raw bytes per block


def _abr(per_token_s: float, bps: float, acceptable: tuple[str, ...] = ("lossless",)) -> KvAbr:
    abr = KvAbr(AbrConfig(acceptable=acceptable, prior_throughput_bps=bps, prior_rtt_s=0.001, safety=1.0))
    abr.prefill.add(100, 100 * per_token_s)
    return abr


def test_fast_network_fetches_everything() -> None:
    abr = _abr(per_token_s=1e-3, bps=1e9)  # fetch ~1 ms + decode vs recompute 16 ms per block
    plan = abr.plan([["lossless"]] * 8, BLOCK, RAW, total_tokens=8 * BLOCK + 5)
    assert plan.fetch_blocks == 8
    assert all(c.action == "lossless" for c in plan.choices)
    assert plan.est_total_s < plan.est_recompute_all_s


def test_slow_network_recomputes() -> None:
    abr = _abr(per_token_s=1e-5, bps=1e6)  # fetch ~1 s per block vs recompute 0.16 ms
    plan = abr.plan([["lossless"]] * 8, BLOCK, RAW, total_tokens=8 * BLOCK + 5)
    assert plan.fetch_blocks == 0
    assert all(c.action == RECOMPUTE for c in plan.choices)


def test_quantized_rendition_only_when_acceptable() -> None:
    # At 20 MB/s a lossless block (~0.95 MB) costs ~48 ms, int4 ~8 ms; recompute costs 32 ms.
    slow_lossless = _abr(per_token_s=2e-3, bps=20e6)
    plan = slow_lossless.plan([["lossless", "int8", "int4"]] * 4, BLOCK, RAW, total_tokens=70)
    assert plan.fetch_blocks == 0
    lossy = _abr(per_token_s=2e-3, bps=20e6, acceptable=("lossless", "int8", "int4"))
    plan = lossy.plan([["lossless", "int8", "int4"]] * 4, BLOCK, RAW, total_tokens=70)
    assert plan.fetch_blocks == 4
    assert {c.action for c in plan.choices} == {"int4"}
    # A rendition that is not available is never chosen.
    plan = lossy.plan([["lossless", "int8"]] * 4, BLOCK, RAW, total_tokens=70)
    assert {c.action for c in plan.choices} == {"int8"}


def test_block_without_acceptable_rendition_ends_the_fetched_prefix() -> None:
    abr = _abr(per_token_s=1e-3, bps=1e9)
    plan = abr.plan([["lossless"], ["lossless"], ["int8"], ["lossless"]], BLOCK, RAW, total_tokens=70)
    assert plan.fetch_blocks == 2
    assert [c.action for c in plan.choices] == ["lossless", "lossless", RECOMPUTE, RECOMPUTE]


def test_force_and_forbid_recompute() -> None:
    cfg = AbrConfig(prior_throughput_bps=1e3, allow_recompute=False)
    abr = KvAbr(cfg)
    abr.prefill.add(100, 1e-3)
    assert abr.plan([["lossless"]] * 3, BLOCK, RAW, total_tokens=50).fetch_blocks == 3
    abr = KvAbr(AbrConfig(prior_throughput_bps=1e12, force_recompute=True))
    assert abr.plan([["lossless"]] * 3, BLOCK, RAW, total_tokens=50).fetch_blocks == 0


def test_measurements_move_the_decision() -> None:
    abr = _abr(per_token_s=2e-4, bps=1e9)  # prior says fetch (~2 ms < 3.2 ms)
    assert abr.plan([["lossless"]] * 4, BLOCK, RAW, total_tokens=70).fetch_blocks == 4
    for _ in range(20):
        abr.throughput.add(1_000_000, 1.0)  # measured 1 MB/s
    assert abr.plan([["lossless"]] * 4, BLOCK, RAW, total_tokens=70).fetch_blocks == 0
    assert abr.should_abandon(RAW, "lossless", BLOCK)


def test_throughput_estimator_reacts_to_drops() -> None:
    est = ThroughputEstimator(prior_bps=5.0)
    assert est.estimate() == 5.0
    est.add(10_000_000, 0.1)  # 100 MB/s
    assert est.estimate() == pytest.approx(1e8, rel=1e-6)
    est.add(1_000_000, 0.1)  # then 10 MB/s: the fast average pulls the min down
    assert est.estimate() < 6e7


def test_prefill_estimator_fits_overhead_and_slope() -> None:
    est = PrefillEstimator()
    for n in (16, 64, 256):
        est.add(n, 0.01 + n * 1e-4)
    assert est.per_token_s == pytest.approx(1e-4, rel=1e-6)
    assert est.overhead_s == pytest.approx(0.01, rel=1e-6)
    assert est.estimate(0) == 0.0


def test_plan_reports_inputs() -> None:
    abr = _abr(per_token_s=1e-3, bps=1e9)
    report = abr.plan([["lossless"]] * 2, BLOCK, RAW, total_tokens=40).to_json()
    assert report["fetch_blocks"] == 2
    assert report["actions"] == {"lossless": 2}
    assert set(report["inputs"]) == {"throughput_bps", "rtt_s", "prefill_per_token_s", "prefill_overhead_s"}


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="acceptable"):
        AbrConfig(acceptable=())
    with pytest.raises(ValueError, match="safety"):
        AbrConfig(safety=0)


def test_fetch_deadline_grows_with_the_recompute_time_of_delivered_blocks() -> None:
    abr = KvAbr(AbrConfig(deadline_margin_s=0.5))
    abr.prefill.add(100, 0.1)  # 1 ms per token
    deadline = abr.deadline(started=10.0, block_size=16)
    assert deadline is not None
    # Nothing delivered yet: the margin plus what the first block saves (a WAN round trip and a block's
    # bytes must fit, or no fetch over a real link would ever start).
    assert deadline.due(0) == pytest.approx(10.5 + 0.016)
    assert deadline.due(3) == pytest.approx(10.5 + 4 * 0.016)
    assert "0.600s spent with 3 block(s) delivered" in deadline.describe(3, 10.6)
    # A fetch that must deliver every located block has no deadline.
    assert KvAbr(AbrConfig(allow_recompute=False)).deadline(10.0, 16) is None


def test_size_priors_follow_the_kv_dtype() -> None:
    # Before any block is measured, int8 saves half as much on bf16 as on fp32 (one byte of two vs of four),
    # while lossless saves more on bf16: the prior must not be fp32's for a bf16 model.
    fp32 = KvAbr(AbrConfig(kv_dtype="float32")).renditions
    bf16 = KvAbr(AbrConfig(kv_dtype="bfloat16")).renditions
    assert bf16.size_ratio("int8") == 2 * fp32.size_ratio("int8")
    assert bf16.size_ratio("lossless") < fp32.size_ratio("lossless")
    # A measurement replaces the prior whatever the dtype.
    bf16.add("int8", raw_bytes=1000, encoded_bytes=400, decode_s=0.001)
    assert abs(bf16.size_ratio("int8") - 0.4) < 1e-9
