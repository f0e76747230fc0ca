"""Tests for kvnet/exchange/abr.py: estimators and the fetch-or-recompute decision."""

from __future__ import annotations

import pickle

import pytest

from kvnet.exchange.abr import (
    MAX_RELAYS_TRACKED,
    PREFILL_SAMPLE_STEP,
    RECOMPUTE,
    AbrConfig,
    AbrPlan,
    AbrSample,
    Ewma,
    FirstByteEstimator,
    KvAbr,
    MeasuredRate,
    PrefillEstimator,
    ThroughputEstimator,
    best_split,
)

BLOCK = 16
RAW = 1_000_000  # raw bytes per block


def _abr(per_token_s: float, bps: float, acceptable: tuple[str, ...] = ("lossless",)) -> KvAbr:
    """An ABR choosing between fetching a prefix and recomputing (the split has its own tests below)."""
    abr = KvAbr(AbrConfig(acceptable=acceptable, prior_throughput_bps=bps, prior_rtt_s=0.001, safety=1.0,
                          overlap=False))
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
    assert set(report["inputs"]) == {
        "throughput_bps", "rtt_s", "first_byte_s", "prefill_per_token_s", "prefill_overhead_s",
        "prefill_pair_s",
    }


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


def test_a_fetch_is_re_planned_by_the_rate_it_measures() -> None:
    abr = KvAbr(AbrConfig(deadline_margin_s=1.0))
    abr.prefill.add(1000, 0.5)  # 0.5 ms per token: 8 ms per 16-token block
    deadline = abr.deadline(started=0.0, block_size=16)
    assert deadline is not None
    # 10 blocks of 1 MB to come at 1 MB/s: 10 s of waiting, past the last block's due time (1.08 s),
    # against 80 ms of recompute: given up at once, with the reason.
    why = deadline.overtaken(0.3, 9, 10, 10e6, 1e6)
    assert why is not None and "1.00 MB/s" in why and "10 block(s)" in why
    # The same blocks at 100 MB/s land by 0.4 s: the fetch goes on.
    assert deadline.overtaken(0.3, 9, 10, 10e6, 100e6) is None
    # Slower than the deadline but still faster than recomputing (a slow CPU): the deadline's to judge
    # block by block, not the re-plan's.
    slow_cpu = KvAbr(AbrConfig(deadline_margin_s=1.0))
    slow_cpu.prefill.add(100, 5.0)  # 50 ms per token: 0.8 s per block
    late = slow_cpu.deadline(started=0.0, block_size=16)
    assert late is not None and late.overtaken(0.3, 9, 10, 10e6, 2e6) is None
    # Within the slack in the fetch's favour: 1.2x too slow for the deadline is not enough.
    assert deadline.overtaken(0.0, 9, 10, 10e6, 10e6 / (1.08 * 1.2)) is None
    # Nothing left, or no rate: nothing to re-plan.
    assert deadline.overtaken(0.3, 9, 0, 0.0, 1e3) is None
    assert deadline.overtaken(0.3, 9, 10, 10e6, 0.0) is None


def test_measured_rate_waits_for_bytes_and_takes_the_faster_of_average_and_recent() -> None:
    rate = MeasuredRate(window_s=0.1, min_observed_s=0.1)
    assert rate.observe(0.00, 0) is None  # nothing yet: a silent relay is not a rate of zero
    assert rate.observe(0.05, 1000) is None  # first bytes: the clock starts here
    assert rate.observe(0.10, 2000) is None  # not observed for long enough
    # A congestion window opening: the rate of the last 0.1 s or more outruns the average.
    assert rate.observe(0.17, 5000) == pytest.approx(4000 / 0.12)
    assert rate.observe(0.25, 9000) == pytest.approx(7000 / 0.15)
    assert rate.observe(0.31, 21000) == pytest.approx(16000 / 0.14)
    # A receiver paused by its host: the recent window is empty, the average still stands.
    assert rate.observe(0.60, 21000) == pytest.approx(20000 / 0.55)


def test_a_path_measured_slower_than_compute_skips_the_locate_and_still_probes() -> None:
    abr = _abr(per_token_s=1e-3, bps=1e9)  # 16 ms per block to recompute
    # Before any measurement the prior is not trusted to skip anything.
    assert abr.skip_locate(BLOCK, RAW, 8, 8 * BLOCK + 5) is None
    abr.fetch_measured(1_000_000, 1.0)  # 1 MB/s: ~0.7 s per lossless block
    skipped = abr.skip_locate(BLOCK, RAW, 8, 8 * BLOCK + 5)
    assert skipped is not None and skipped["fetch_blocks"] == 0 and "no locate" in skipped["locate_skipped"]
    assert skipped["inputs"]["throughput_bps"] == pytest.approx(1e6)
    assert abr.skipped_locates == 1
    # Skips count as declining plans: after probe_after of them the locate happens and the plan probes.
    for _ in range(abr.config.probe_after - 1):
        assert abr.skip_locate(BLOCK, RAW, 8, 8 * BLOCK + 5) is not None
    assert abr.skip_locate(BLOCK, RAW, 8, 8 * BLOCK + 5) is None
    assert abr.plan([["lossless"]] * 8, BLOCK, RAW, total_tokens=8 * BLOCK + 5).probe
    # A path faster than compute is always looked at; so is one where only a split could win.
    fast = _abr(per_token_s=1e-3, bps=1e9)
    fast.fetch_measured(100_000_000, 1.0)
    assert fast.skip_locate(BLOCK, RAW, 8, 8 * BLOCK + 5) is None
    split = KvAbr(AbrConfig(prior_throughput_bps=1e9, prior_rtt_s=0.001, safety=1.0))
    split.prefill.add(1000, 1.0)  # 16 ms per block; a lossless block at 30 MB/s takes ~23 ms
    split.fetch_measured(30_000_000, 1.0)
    assert split.skip_locate(BLOCK, RAW, 32, 32 * BLOCK + 5) is None
    assert split.plan([["lossless"]] * 32, BLOCK, RAW, total_tokens=32 * BLOCK + 5).compute_blocks > 0


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


class FakeClock:
    """Injected time for the estimators (no test sleeps)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_older_samples_weigh_less_as_time_passes() -> None:
    clock = FakeClock()
    fresh, aged = ThroughputEstimator(1e6, clock), ThroughputEstimator(1e6, clock)
    for est in (fresh, aged):
        for _ in range(10):
            est.add(1_000_000, 1.0)  # a long slow period: 1 MB/s
    clock.now += 300.0  # five minutes later (five half-lives) on `aged` only
    fresh.clock = lambda: 1000.0
    fresh.add(1_000_000, 0.01)  # then one transfer at 100 MB/s
    aged.add(1_000_000, 0.01)
    assert aged.estimate() > 2 * fresh.estimate()
    assert aged.estimate() > 5e7  # the old period hardly counts any more


def test_each_sample_takes_a_share_however_small() -> None:
    est = ThroughputEstimator(1e6)
    for _ in range(50):
        est.add(100_000_000, 100.0)  # 5 GB of history at 1 MB/s
    est.add(100_000, 0.001)  # one small transfer at 100 MB/s
    assert est.estimate() >= 1e6 + 0.25 * (1e8 - 1e6) * 0.99


def test_prefill_estimate_follows_the_latest_runs() -> None:
    est = PrefillEstimator()
    for n in (100, 200) * 10:
        est.add(n, n * 1e-3)  # a loaded machine: 1 ms per token
    for n in (100, 200) * 5:
        est.add(n, n * 1e-4)  # load gone: 0.1 ms per token
    assert est.per_token_s < 2.5e-4  # an unweighted fit of the window would say 7e-4


def _calibrate_smollm2(est: PrefillEstimator, overhead_s: float = 0.15, per_token_s: float = 4e-4) -> None:
    """Calibration's three runs (64, 256 and 512 tokens, one forward each) at SmolLM2 bf16's cost on an AMX
    CPU (by default): ~0.15 s a forward besides 0.4 ms a token."""
    for n in (64, 256, 512):
        est.add(n, est.forwards(n) * overhead_s + n * per_token_s, whole=True)


def test_prefill_estimator_pays_the_fixed_cost_once_per_forward() -> None:
    """SmolLM2 in bfloat16 on an AMX CPU: ~0.15 s a forward besides 0.4 ms a token, 512 tokens a forward.
    576 tokens take two forwards; a fit that counted one put them at half their cost."""
    est = PrefillEstimator(max_step_tokens=512)
    for n in (256, 512, 1024, 25):
        est.add(n, est.forwards(n) * 0.15 + n * 4e-4)
    assert est.overhead_s == pytest.approx(0.15, rel=1e-6)
    assert est.per_token_s == pytest.approx(4e-4, rel=1e-6)
    assert est.forwards(576) == 2 and est.estimate(576) == pytest.approx(0.3 + 576 * 4e-4)
    # Without the step budget every run is one forward, as vLLM's connector times them.
    assert PrefillEstimator().forwards(10_000) == 1
    assert KvAbr(AbrConfig(max_step_tokens=256)).prefill.forwards(257) == 2


def test_a_heads_chunk_weighs_a_forwards_fixed_cost_against_overshooting() -> None:
    """``sqrt(2 * overhead * head / per_token)`` in whole blocks, within one block and the step budget."""
    def chunk(overhead_s: float, per_token_s: float, head_blocks: int, step: int | None = 512) -> int:
        abr = KvAbr(AbrConfig(max_step_tokens=step))
        _calibrate_smollm2(abr.prefill, overhead_s, per_token_s)
        return abr.head_chunk_tokens(64, head_blocks)

    assert chunk(0.004, 1.7e-4, 8) == 128  # the small preset: sqrt(2 * 4 ms * 512 / 0.17 ms) ~ 155
    assert chunk(0.15, 4e-4, 4) == 448  # SmolLM2 bf16 on AMX: ~438 tokens, 7 blocks
    assert chunk(0.15, 4e-4, 12) == 512  # ~760 tokens: the step budget
    assert chunk(0.15, 4e-4, 12, step=None) == 768
    assert chunk(1e-6, 1e-3, 1) == 64  # next to no fixed cost: one block


def test_a_new_head_pays_a_forward_per_chunk_and_the_cores_a_fetch_takes() -> None:
    """Before any split was measured: each chunk's fixed cost, and ``shared_cores_head_slowdown`` on a node
    whose fetch takes its forwards' cores (a head ran 1.75-2.2x slower beside its tail on 2 AMX cores).
    Once a split was measured, its own fit, slowdown included."""
    def head_cost(shared: bool, blocks: int, chunk_tokens: int | None = None) -> float:
        abr = KvAbr(AbrConfig(max_step_tokens=512, decode_beside_compute=shared))
        _calibrate_smollm2(abr.prefill)
        return abr.head_cost(64, chunk_tokens)(blocks)

    assert head_cost(False, 4) == pytest.approx(0.15 + 256 * 4e-4)  # one forward: a 448-token chunk
    assert head_cost(False, 4, chunk_tokens=128) == pytest.approx(2 * 0.15 + 256 * 4e-4)
    assert head_cost(True, 4) == pytest.approx(2.0 * (0.15 + 256 * 4e-4))
    assert head_cost(False, 0) == head_cost(True, 0) == 0.0
    abr = KvAbr(AbrConfig(max_step_tokens=512, decode_beside_compute=True))
    abr.head_prefill.add(256, 0.5)
    assert abr.head_cost(64)(4) == pytest.approx(0.5)


def test_one_slow_run_moves_the_prefill_fit_a_step_and_two_move_it_whole() -> None:
    """SmolLM2 bf16 on 2 AMX cores: one recompute took 2.02 s where the same request took 0.82 s in the next
    run; taken whole, the next plan put a 1028-token recompute at 1.8 s and split against it."""
    def calibrated() -> PrefillEstimator:
        est = PrefillEstimator(max_step_tokens=512)
        _calibrate_smollm2(est)
        return est

    before = calibrated().estimate(1031)
    est = calibrated()
    est.add(1031, 2.02)
    assert est.estimate(1031) <= PREFILL_SAMPLE_STEP * before * 1.0001
    est.add(1031, before)  # the next run as usual: the outlier's step still weighs, less each run
    assert est.estimate(1031) < 1.25 * before
    # A machine that became 2.5x slower: the first run is a step, the second is taken whole.
    est = calibrated()
    est.add(1031, 2.5 * before)
    est.add(1031, 2.5 * before)
    est.add(1031, 2.5 * before)
    assert est.estimate(1031) > 2 * before
    # Faster alike.
    est = calibrated()
    for _ in range(3):
        est.add(1031, before / 3)
    assert est.estimate(1031) < before / 2


def test_calibration_runs_are_taken_whole() -> None:
    # Calibration's sizes are chosen to pin the fit down: its third run is not clipped to the first two's
    # line (a forward's cost is concave in its tokens, so the short run lies far above that line).
    est = PrefillEstimator(max_step_tokens=512)
    est.add(256, 0.143, whole=True)
    est.add(512, 0.264, whole=True)
    est.add(16, 0.055, whole=True)  # the line through the first two says 0.030 s
    assert est.samples[-1] == (16, 0, 0.055)
    clipped = PrefillEstimator(max_step_tokens=512)
    clipped.add(256, 0.143)
    clipped.add(512, 0.264)
    clipped.add(16, 0.055)
    assert clipped.samples[-1][2] < 0.055


def test_attention_pairs_count_each_forwards_tokens_against_the_keys_cached_before_it() -> None:
    est = PrefillEstimator(max_step_tokens=512)
    assert est.pairs(512) == 0  # one forward from the start: its attention is in its per-token cost
    assert est.pairs(1024) == 512 * 512
    assert est.pairs(1100) == 512 * 512 + 76 * 1024
    assert est.pairs(64, context=1984) == 64 * 1984
    assert PrefillEstimator().pairs(2048, context=10) == 2048 * 10  # no step budget: one forward


def _bench_preset_run(est: PrefillEstimator, tokens: int, context: int = 0) -> float:
    """The ``bench`` preset on one AMX core (float32), roughly: 50 ms a forward, 2.4 ms a token and 0.35 us
    a cached-key pair (512 tokens here 1.28 s from the start and 1.55 s after 1,536 cached tokens;
    measured 1.31 and 1.74)."""
    return est.forwards(tokens) * 0.05 + tokens * 2.4e-3 + est.pairs(tokens, context) * 3.5e-7


def test_calibrations_run_of_two_forwards_prices_attention_to_cached_keys() -> None:
    est = PrefillEstimator(max_step_tokens=512)
    for n in (64, 256, 512):
        est.add(n, _bench_preset_run(est, n), whole=True)
    assert est.pair_s == 0.0  # single forwards from the start say nothing of it
    est.add(1024, _bench_preset_run(est, 1024), whole=True)
    assert est.pair_s == pytest.approx(3.5e-7, rel=1e-6)
    assert est.overhead_s == pytest.approx(0.05, rel=1e-6)
    assert est.per_token_s == pytest.approx(2.4e-3, rel=1e-6)
    # The same 512 tokens after 1,536 cached ones cost a fifth more, and the fit says so.
    assert est.estimate(512, context=1536) == pytest.approx(_bench_preset_run(est, 512, 1536))
    assert est.estimate(512, context=1536) > 1.2 * est.estimate(512)


def test_requests_runs_do_not_move_the_price_of_attention() -> None:
    # One request slowed after a long context, fitted freely, would have made a pair five times dearer.
    est = PrefillEstimator(max_step_tokens=512)
    for n in (64, 256, 512, 1024):
        est.add(n, _bench_preset_run(est, n), whole=True)
    est.add(575, 2 * _bench_preset_run(est, 575, context=1024), context=1024)
    assert est.pair_s == pytest.approx(3.5e-7, rel=1e-6)
    assert est.estimate(1024) < 1.5 * _bench_preset_run(est, 1024)


def test_a_plan_prices_the_suffix_at_its_context() -> None:
    # The prefill after fetched blocks attends to them: fetching saves their tokens, not the suffix's
    # attention. With the local hits before them as context too.
    abr = KvAbr(AbrConfig(max_step_tokens=512, prior_throughput_bps=1e9, prior_rtt_s=0.001, overlap=False))
    for n in (64, 256, 512, 1024):
        abr.prefill.add(n, _bench_preset_run(abr.prefill, n), whole=True)
    plan = abr.plan([["lossless"]] * 16, 64, RAW, total_tokens=16 * 64 + 40, context_tokens=256)
    assert plan.fetch_blocks == 16
    prefill = abr.prefill
    assert plan.est_recompute_all_s == pytest.approx(prefill.estimate(16 * 64 + 40, context=256))
    fetched = plan.est_total_s - prefill.estimate(40, context=256 + 16 * 64)
    assert fetched == pytest.approx(abr.fetch_latency_s() + sum(c.fetch_s for c in plan.choices))


def test_a_fit_spoiled_by_one_slowed_run_keeps_the_fixed_cost() -> None:
    est = PrefillEstimator()
    est.add(256, 0.075 + 256 * 5e-4)  # calibration: 0.5 ms per token plus 75 ms
    est.add(512, 0.075 + 512 * 5e-4)
    assert est.overhead_s == pytest.approx(0.075)
    # A run of a close size, slowed 2x by other work on the host: the least-squares intercept goes
    # negative. The fixed cost stays; the per-token cost takes the rest, not the whole.
    est.add(575, 2 * (0.075 + 575 * 5e-4))
    assert est.overhead_s == pytest.approx(0.075)
    assert 5e-4 < est.per_token_s < 9e-4


def test_declined_hits_are_counted_with_their_inputs() -> None:
    abr = _abr(per_token_s=1e-5, bps=1e6)  # recompute is far cheaper: every located block is declined
    plan = abr.plan([["lossless"]] * 5, BLOCK, RAW, total_tokens=5 * BLOCK + 3)
    assert (plan.fetch_blocks, plan.declined_blocks, plan.probe) == (0, 5, False)
    assert (abr.declined_plans, abr.declined_blocks) == (1, 5)
    assert plan.to_json()["declined_blocks"] == 5
    line = plan.describe_decline()
    assert "declined 5 located block(s)" in line and "throughput_bps=1000000.0" in line
    # Blocks without an acceptable rendition are not a decision of the estimates: not declined.
    plan = abr.plan([["int8"]] * 3, BLOCK, RAW, total_tokens=3 * BLOCK + 3)
    assert plan.declined_blocks == 0 and abr.declined_plans == 1
    # A node that fetches what it found declines nothing.
    fetching = _abr(per_token_s=1e-3, bps=1e9)
    assert fetching.plan([["lossless"]] * 5, BLOCK, RAW, total_tokens=90).declined_blocks == 0
    assert fetching.declined_plans == 0


def test_a_wrong_pessimistic_estimate_recovers_within_a_bounded_number_of_requests() -> None:
    """The path is fast (1 GB/s: a block in ~1 ms against 16 ms to recompute it), but a slow period left the
    estimate at 1 MB/s, so every hit is declined and nothing is fetched that could correct it. Probes do:
    after ``probe_after`` declined requests one block is fetched, its measurement replaces the estimate,
    and the next requests fetch everything."""
    abr = _abr(per_token_s=1e-3, bps=1e9)
    for _ in range(20):
        abr.fetch_measured(1_000_000, 1.0)  # the slow period
    true_bps = 1e9
    fetched_all_at = None
    for request in range(1, 11):
        plan = abr.plan([["lossless"]] * 8, BLOCK, RAW, total_tokens=8 * BLOCK + 5)
        if plan.fetch_blocks:
            blocks = plan.fetch_blocks
            abr.fetch_measured(blocks * RAW, blocks * RAW / true_bps)
        if plan.fetch_blocks == 8:
            fetched_all_at = request
            break
    assert abr.probes == 1
    assert fetched_all_at is not None and fetched_all_at <= abr.config.probe_after + 2
    assert abr.declined_plans == abr.config.probe_after + 1  # the declines, then the probe's own


def test_samples_taken_in_one_abr_move_another_as_if_measured_there() -> None:
    """vLLM's worker fetches and runs the forwards; its scheduler plans. The worker's ABR keeps what it
    measures, the samples cross the process boundary as they are, and the scheduler's estimators end up
    where the worker's are."""
    worker = KvAbr(AbrConfig(allow_recompute=False))
    worker.keep_samples()
    scheduler = KvAbr(AbrConfig())
    worker.fetch_measured(4_000_000, 0.5)
    worker.rtt_measured(0.02)
    worker.first_byte_measured("moqt://relay:4443", 5.0, 0.3)
    worker.rendition_measured("lossless", RAW, 690_000, 0.002)
    worker.prefill_measured(128, 0.064)
    worker.prefill_measured(512, 0.200)
    samples = worker.take_samples()
    assert [s.kind for s in samples] == ["throughput", "rtt", "first_byte", "rendition", "prefill", "prefill"]
    assert worker.take_samples() == ()  # taken once
    scheduler.absorb(pickle.loads(pickle.dumps(samples)))
    assert scheduler.throughput.estimate() == worker.throughput.estimate() == 8e6
    assert scheduler.rtt.estimate() == pytest.approx(0.02)
    assert scheduler.first_byte_s("moqt://relay:4443") == pytest.approx(0.3)
    assert scheduler.first_byte["moqt://relay:4443"].cap_s == 5.0
    assert scheduler.renditions.size_ratio("lossless") == pytest.approx(0.69)
    assert (scheduler.prefill.per_token_s, scheduler.prefill.overhead_s) == pytest.approx(
        (worker.prefill.per_token_s, worker.prefill.overhead_s))
    assert KvAbr().take_samples() == ()  # an ABR keeps nothing unless asked


def test_a_probe_planned_in_one_abr_is_measured_by_the_samples_of_another() -> None:
    """The scheduler plans the probe, the worker fetches it: the worker's sample replaces the scheduler's
    estimate as a probe's own measurement would."""
    scheduler = _abr(per_token_s=1e-3, bps=1e9)
    for _ in range(20):
        scheduler.fetch_measured(1_000_000, 1.0)  # a slow period: every hit declined
    worker = KvAbr(AbrConfig(allow_recompute=False))
    worker.keep_samples()
    while not (plan := scheduler.plan([["lossless"]] * 8, BLOCK, RAW, total_tokens=8 * BLOCK + 5)).probe:
        assert plan.fetch_blocks == 0
    worker.fetch_measured(plan.fetch_blocks * RAW, plan.fetch_blocks * RAW / 1e9)
    scheduler.absorb(worker.take_samples())
    assert scheduler.throughput.estimate() == pytest.approx(1e9)
    assert scheduler.plan([["lossless"]] * 8, BLOCK, RAW, total_tokens=8 * BLOCK + 5).fetch_blocks == 8


def test_samples_that_cannot_be_taken_are_dropped_and_kept_ones_are_bounded() -> None:
    abr = KvAbr()
    abr.absorb([AbrSample("throughput", ("many", 1.0)), AbrSample("bogus", (1,)),  # type: ignore[arg-type]
                AbrSample("rtt", ()), AbrSample("rtt", (0.05,))])
    assert abr.throughput.samples == 0 and abr.rtt.estimate() == 0.05
    abr.keep_samples(limit=3)
    for i in range(5):
        abr.rtt_measured(0.01 * i)
    assert [s.values for s in abr.take_samples()] == [(0.02,), (0.03,), (0.04,)]  # the newest


def test_a_stale_estimate_is_probed_after_a_while_without_samples() -> None:
    clock = FakeClock()
    abr = KvAbr(AbrConfig(prior_throughput_bps=1e9, prior_rtt_s=0.001, safety=1.0, probe_after=0,
                          probe_after_s=30.0), clock=clock)
    abr.prefill.add(100, 100 * 1e-5)
    abr.fetch_measured(1_000_000, 1.0)
    assert not abr.plan([["lossless"]] * 4, BLOCK, RAW, total_tokens=70).probe
    clock.now += 31.0
    plan = abr.plan([["lossless"]] * 4, BLOCK, RAW, total_tokens=70)
    assert plan.probe and plan.fetch_blocks == abr.config.probe_blocks


# -- fetch and compute at once ----------------------------------------------------------------------------

def _split_plan(
    per_token_s: float, bps: float, blocks: int = 8, *, overlap: bool = True, allow_recompute: bool = True,
    force_recompute: bool = False,
) -> AbrPlan:
    abr = KvAbr(AbrConfig(prior_throughput_bps=bps, prior_rtt_s=0.001, safety=1.0, overlap=overlap,
                          allow_recompute=allow_recompute, force_recompute=force_recompute))
    abr.prefill.add(100, 100 * per_token_s)
    return abr.plan([["lossless"]] * blocks, BLOCK, RAW, total_tokens=blocks * BLOCK + 5)


def test_split_balances_computing_the_head_with_fetching_the_tail() -> None:
    # A lossless block: 0.85 MB at 100 MB/s + 1 ms decode = 9.5 ms; its prefill: 16 x 0.6 ms = 9.6 ms.
    # Fetching all (~81 ms) and recomputing all (~80 ms) cost the same; computing 4 while fetching 4 ~42 ms.
    plan = _split_plan(per_token_s=6e-4, bps=1e8)
    assert (plan.compute_blocks, plan.fetch_blocks) == (4, 8)
    assert [c.action for c in plan.choices] == [RECOMPUTE] * 4 + ["lossless"] * 4
    assert plan.est_total_s < 0.6 * plan.est_recompute_all_s
    assert plan.to_json()["compute_blocks"] == 4 and plan.declined_blocks == 0


def test_split_follows_the_rates() -> None:
    base = _split_plan(per_token_s=6e-4, bps=1e8, blocks=32).compute_blocks
    faster_compute = _split_plan(per_token_s=3e-4, bps=1e8, blocks=32).compute_blocks
    faster_network = _split_plan(per_token_s=6e-4, bps=3e8, blocks=32).compute_blocks
    assert 0 < faster_network < base < faster_compute < 32
    # Far apart, one side alone wins: no split.
    fast_net = _split_plan(per_token_s=1e-2, bps=1e10)
    assert (fast_net.compute_blocks, fast_net.fetch_blocks) == (0, 8)
    slow_net = _split_plan(per_token_s=1e-5, bps=1e6)
    assert (slow_net.compute_blocks, slow_net.fetch_blocks) == (0, 0)


def test_a_head_measured_slower_beside_its_fetch_moves_the_split_and_leaves_recomputes_alone() -> None:
    abr = KvAbr(AbrConfig(prior_throughput_bps=1e8, prior_rtt_s=0.001, safety=1.0))
    abr.prefill.add(100, 100 * 6e-4)
    located = [["lossless"]] * 32
    before = abr.plan(located, BLOCK, RAW, total_tokens=32 * BLOCK + 5)
    # The last split's head ran at a third of the speed measured alone (the fetch shared its cores).
    abr.head_prefill.add(10 * BLOCK, 10 * BLOCK * 18e-4)
    after = abr.plan(located, BLOCK, RAW, total_tokens=32 * BLOCK + 5)
    assert 0 < after.compute_blocks < before.compute_blocks
    assert after.est_recompute_all_s == before.est_recompute_all_s  # a plain recompute is not slower
    # Three times slower still: computing any of the head beside the fetch no longer pays.
    abr.head_prefill.add(10 * BLOCK, 10 * BLOCK * 1e-2)
    assert abr.plan(located, BLOCK, RAW, total_tokens=32 * BLOCK + 5).compute_blocks == 0


def test_a_tail_measured_slower_beside_its_head_ends_the_split_and_leaves_fetches_alone() -> None:
    abr = KvAbr(AbrConfig(prior_throughput_bps=1e8, prior_rtt_s=0.001, safety=1.0))
    abr.prefill.add(100, 100 * 8e-4)  # a block's prefill 12.8 ms, its fetch 9.5 ms
    located = [["lossless"]] * 8
    before = abr.plan(located, BLOCK, RAW, total_tokens=8 * BLOCK + 5)
    assert 0 < before.compute_blocks < 8
    # The last split's tail came at a tenth of the path's rate (the head's forwards took its cores), and
    # the path alone was measured at its rate.
    abr.fetch_measured(10_000_000, 1.0, beside_compute=True)
    abr.fetch_measured(100_000_000, 1.0)
    assert abr.throughput.estimate() == 1e8 and abr.tail_throughput.estimate() < 2e7
    after = abr.plan(located, BLOCK, RAW, total_tokens=8 * BLOCK + 5)
    assert (after.compute_blocks, after.fetch_blocks) == (0, 8)  # fetching alone, at the path's rate
    no_split = KvAbr(AbrConfig(prior_throughput_bps=1e8, prior_rtt_s=0.001, safety=1.0, overlap=False))
    no_split.prefill.add(100, 100 * 8e-4)
    assert after.est_total_s == pytest.approx(
        no_split.plan(located, BLOCK, RAW, total_tokens=8 * BLOCK + 5).est_total_s
    )
    # The sample crosses a process boundary like the others (vLLM's worker -> scheduler).
    other = KvAbr(AbrConfig(prior_throughput_bps=1e8))
    abr.keep_samples()
    abr.fetch_measured(5_000_000, 1.0, beside_compute=True)
    other.absorb(abr.take_samples())
    assert other.tail_throughput.samples == 1 and other.throughput.samples == 0


def test_a_node_that_measured_only_a_split_tail_costs_a_whole_fetch_at_its_rate_not_the_prior() -> None:
    """The WAN demo on a fast CPU: the first request split, its tail came at 4 MB/s; the second must not
    plan a whole fetch at the 100 MB/s prior (it took 2.1x recomputing). Until the path alone is
    measured, the tail's rate is the best evidence; once it is, the path's own estimate rules again."""
    abr = KvAbr(AbrConfig(prior_throughput_bps=1e8, prior_rtt_s=0.001, safety=1.0))
    abr.prefill.add(100, 100 * 2e-4)  # a block's prefill 3.2 ms, its fetch at the prior 10 ms
    located = [["lossless"]] * 8
    abr.fetch_measured(4_000_000, 1.0, beside_compute=True)
    plan = abr.plan(located, BLOCK, RAW, total_tokens=8 * BLOCK + 5)
    assert plan.fetch_blocks == 0 and plan.throughput_bps == pytest.approx(4e6)
    assert abr.inputs()["throughput_bps"] == pytest.approx(4e6)
    # Measured, so trusted to skip the locate of a request no plan could fetch for (not so the prior).
    skipped = abr.skip_locate(BLOCK, RAW, 8, 8 * BLOCK + 5)
    assert skipped is not None and skipped["inputs"]["throughput_bps"] == pytest.approx(4e6)
    abr.fetch_measured(1_000_000_000, 1.0)  # a probe measured the path alone at 1 GB/s
    plan = abr.plan(located, BLOCK, RAW, total_tokens=8 * BLOCK + 5)
    assert plan.throughput_bps == pytest.approx(1e9) and plan.fetch_blocks == 8


def test_a_node_that_measured_only_split_tails_fetches_whole_once_where_the_split_gains_little() -> None:
    """SmolLM2 on 2 AMX cores over a 300 MB/s link: every request split, its tails came at 57-73 MB/s beside
    the head's forwards while a whole fetch ran at 84-97, and the splits, planned against a whole fetch
    costed at the tails' rate, took 1.03x fetching everything. A split whose estimated gain over that whole
    fetch is under ``WHOLE_PROBE_GAIN`` fetches everything once instead, which measures the path alone;
    a split that gains more does not wait for that measurement."""
    located = [["lossless"]] * 8

    def node(tail_bps: float) -> KvAbr:
        abr = KvAbr(AbrConfig(prior_throughput_bps=1e8, prior_rtt_s=0.001, safety=1.0))
        abr.prefill.add(100, 100 * 8e-4)
        abr.fetch_measured(int(tail_bps), 1.0, beside_compute=True)
        return abr

    far = node(1e8).plan(located, BLOCK, RAW, total_tokens=8 * BLOCK + 5)
    assert far.compute_blocks > 0 and not far.probe  # the split gains over 20%: no probe needed
    abr = node(3e8)
    probe = abr.plan(located, BLOCK, RAW, total_tokens=8 * BLOCK + 5)
    assert (probe.compute_blocks, probe.fetch_blocks, probe.probe, abr.probes) == (0, 8, True, 1)
    assert probe.to_json()["probe"] is True
    # Measured alone 1.4x as fast as beside the head: fetching everything is the plan from now on.
    faster = node(3e8)
    faster.plan(located, BLOCK, RAW, total_tokens=8 * BLOCK + 5)
    faster.fetch_measured(420_000_000, 1.0)
    after = faster.plan(located, BLOCK, RAW, total_tokens=8 * BLOCK + 5)
    assert (after.compute_blocks, after.fetch_blocks, after.probe) == (0, 8, False)
    # Measured alone no faster: the split's gain was real, and it splits again, probing no more.
    abr.fetch_measured(300_000_000, 1.0)
    again = abr.plan(located, BLOCK, RAW, total_tokens=8 * BLOCK + 5)
    assert again.compute_blocks > 0 and not again.probe and abr.probes == 1


def test_a_tail_measured_faster_than_the_whole_fetches_raises_their_estimate() -> None:
    """The ``bench`` preset over a 300 MB/s link: the node's only whole fetch was its first, on a fresh
    connection (62-67 MB/s); its splits' tails came faster, yet every plan costed a whole fetch at the
    first rate and split again (1.11x fetching everything). A tail's rate is at most the path's."""
    abr = KvAbr(AbrConfig(prior_throughput_bps=1e8, prior_rtt_s=0.001, safety=1.0))
    abr.fetch_measured(60_000_000, 1.0)
    abr.fetch_measured(90_000_000, 1.0, beside_compute=True)
    assert abr.inputs()["throughput_bps"] == pytest.approx(9e7)
    assert abr.fetch_cost(RAW, ["lossless"]) == pytest.approx(abr.fetch_cost(RAW, ["lossless"], True))
    abr.fetch_measured(300_000_000, 1.0)  # measured alone, faster again: the path's own estimate rules
    assert abr.inputs()["throughput_bps"] > 9e7


def test_no_split_when_overlap_is_off_or_the_mode_forbids_it() -> None:
    assert _split_plan(per_token_s=6e-4, bps=1e8, overlap=False).compute_blocks == 0
    fetch_all = _split_plan(per_token_s=6e-4, bps=1e8, allow_recompute=False)
    assert (fetch_all.compute_blocks, fetch_all.fetch_blocks) == (0, 8)
    assert _split_plan(per_token_s=6e-4, bps=1e8, force_recompute=True).fetch_blocks == 0


def test_best_split_is_the_exact_argmin() -> None:
    costs = [0.010, 0.010, 0.030, 0.010, 0.010]
    k, t = best_split(costs, 0.005, lambda n: 0.012 * n)
    brute = min(
        (max(0.012 * j, (0.005 + sum(costs[j:])) if j < len(costs) else 0.0), j)
        for j in range(len(costs) + 1)
    )
    assert (k, t) == (brute[1], pytest.approx(brute[0]))
    assert best_split([], 0.005, lambda n: 0.0) == (0, 0.0)


def test_a_tail_decoded_on_the_heads_cores_costs_the_head_its_decoding() -> None:
    """Measured on SmolLM2 bf16, 2 cores, a 2 MB/s link (docs/performance.md, "kvtc over the network"): a
    split whose kvtc tail decoded beside the head took 2.07 s where fetching all three blocks in kvtc took
    0.97 s. With ``decode_beside_compute`` the head pays for the tail's decoding, so the plan fetches
    everything; lossless, whose decode costs next to nothing, still splits as before. (kvtc decoded at 8
    MB/s then; its coder is faster now, so that rate is given as measured.)"""
    def plan(accept: tuple[str, ...], shared: bool) -> AbrPlan:
        # The head's slowdown beside a fetch has its own test: here the decoding alone.
        abr = KvAbr(AbrConfig(acceptable=accept, prior_throughput_bps=2e6, prior_rtt_s=0.02, safety=1.0,
                              kv_dtype="bfloat16", decode_beside_compute=shared,
                              shared_cores_head_slowdown=1.0))
        abr.prefill.add(64, 64 * 0.0136)  # a 64-token block: 0.87 s; its KV 1.47 MB
        abr.rendition_measured("kvtc", 1_470_000, 352_800, 1_470_000 / 8e6)
        return abr.plan([list(accept)] * 3, 64, 1_470_000, total_tokens=3 * 64 + 6)

    apart, shared = plan(("lossless", "kvtc"), False), plan(("lossless", "kvtc"), True)
    assert [c.action for c in apart.choices] == [RECOMPUTE, "kvtc", "kvtc"]
    assert [c.action for c in shared.choices] == ["kvtc"] * 3 and shared.compute_blocks == 0
    assert plan(("lossless",), True).compute_blocks == plan(("lossless",), False).compute_blocks == 1


def test_best_split_charges_the_head_what_the_tail_takes_from_its_cores() -> None:
    costs, extra = [0.010, 0.010, 0.030, 0.010], [0.004, 0.004, 0.004, 0.004]
    k, t = best_split(costs, 0.005, lambda n: 0.012 * n, extra)
    brute = min(
        (max(0.012 * j + sum(extra[j:]), (0.005 + sum(costs[j:])) if j < len(costs) else 0.0), j)
        for j in range(len(costs) + 1)
    )
    assert (k, t) == (brute[1], pytest.approx(brute[0]))


def test_no_split_for_a_near_tie() -> None:
    # 64 blocks: fetching one costs ~1.1 ms (mostly decode), computing one 60 ms. Computing the first
    # block while the other 63 arrive would save ~1 ms of ~89: not worth a second prefill.
    plan = _split_plan(per_token_s=3.75e-3, bps=1e10, blocks=64)
    assert (plan.compute_blocks, plan.fetch_blocks) == (0, 64)


def _exact(bps: float, kv_dtype: str = "bfloat16") -> KvAbr:
    abr = KvAbr(AbrConfig(acceptable=("lossless", "plain"), prior_throughput_bps=bps, prior_rtt_s=0.001,
                          safety=1.0, kv_dtype=kv_dtype))
    abr.prefill.add(100, 100 * 1e-2)  # recompute is far slower than either: only the rendition is at stake
    return abr


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float32"])
def test_fast_links_take_plain_and_slow_links_keep_lossless(kv_dtype: str) -> None:
    both = [["lossless", "plain"]] * 4
    fast = _exact(bps=5e9, kv_dtype=kv_dtype).plan(both, BLOCK, RAW, total_tokens=70)
    assert fast.fetch_blocks == 4 and {c.action for c in fast.choices} == {"plain"}
    slow = _exact(bps=100e6, kv_dtype=kv_dtype).plan(both, BLOCK, RAW, total_tokens=70)
    assert slow.fetch_blocks == 4 and {c.action for c in slow.choices} == {"lossless"}
    # The cost weighed is bytes over the link plus verify + decode: plain saves the decode, lossless bytes.
    abr = _exact(bps=1e9, kv_dtype=kv_dtype)
    ratio = abr.renditions.size_ratio("lossless")
    for r, size in (("plain", 1.0), ("lossless", ratio)):
        want = RAW * size / 1e9 + RAW / abr.renditions.decode_bps(r)
        assert abr.fetch_cost(RAW, [r])[1] == pytest.approx(want)


def test_plain_only_where_accepted_and_offered() -> None:
    lossless_only = _abr(per_token_s=1e-2, bps=5e9)
    plan = lossless_only.plan([["lossless", "plain"]] * 2, BLOCK, RAW, 40)
    assert {c.action for c in plan.choices} == {"lossless"}
    plan = _exact(bps=5e9).plan([["lossless"]] * 2, BLOCK, RAW, 40)
    assert {c.action for c in plan.choices} == {"lossless"}
    # Exact renditions tie on quality: equal costs go to lossless, the smaller payload.
    abr = _exact(bps=1e9)
    abr.renditions.ratio["lossless"] = Ewma(half_life=8.0)
    abr.renditions.ratio["lossless"].add(1.0, 1.0)
    abr.renditions.decode["lossless"] = Ewma(half_life=8.0)
    abr.renditions.decode["lossless"].add(1.0, abr.renditions.decode_bps("plain"))
    assert abr.fetch_cost(RAW, ["plain", "lossless"])[0] == "lossless"


def test_measured_decode_speed_moves_the_crossover() -> None:
    """The node's own decodes replace the priors: a host whose lossless decode is fast (or whose digest
    of plain's extra bytes is slow) keeps lossless on a link where the priors said plain, and back."""
    abr = _exact(bps=2e9)
    both = [["lossless", "plain"]] * 2
    assert {c.action for c in abr.plan(both, BLOCK, RAW, 40).choices} == {"plain"}
    for _ in range(30):
        abr.renditions.add("lossless", RAW, int(0.69 * RAW), RAW / 8e9)  # lossless decodes at 8 GB/s
        abr.renditions.add("plain", RAW, RAW, RAW / 1e9)  # plain's digest + copy at 1 GB/s
    assert abr.renditions.decode_bps("lossless") == pytest.approx(8e9, rel=1e-6)
    assert {c.action for c in abr.plan(both, BLOCK, RAW, 40).choices} == {"lossless"}
    for _ in range(30):  # the host got busy decompressing: recent samples decide
        abr.renditions.add("lossless", RAW, int(0.69 * RAW), RAW / 3e8)
        abr.renditions.add("plain", RAW, RAW, RAW / 4e9)
    assert {c.action for c in abr.plan(both, BLOCK, RAW, 40).choices} == {"plain"}


def test_decode_speed_ages_with_time() -> None:
    clock = FakeClock()
    abr = KvAbr(AbrConfig(acceptable=("lossless", "plain")), clock=clock)
    for _ in range(30):
        abr.renditions.add("plain", RAW, RAW, RAW / 4e9)
    clock.now += 300.0  # five half-lives: what was learned then weighs ~3% against a new sample
    abr.renditions.add("plain", RAW, RAW, RAW / 1e9)
    assert abr.renditions.decode_bps("plain") < 1.2e9


def test_first_byte_delay_is_nothing_until_measured_and_never_negative() -> None:
    est = FirstByteEstimator(cap_s=10.0)
    assert est.estimate() == 0.0
    est.add(-0.003)  # the first object came within the smoothed RTT
    est.add(float("nan"))  # no measurement at all: ignored
    assert est.estimate() == 0.0 and est.samples == 1


def test_first_byte_delay_believes_a_rise_at_once_and_a_fall_once_it_holds() -> None:
    est = FirstByteEstimator(cap_s=10.0)
    for _ in range(20):
        est.add(0.01)
    est.add(2.0)  # the relay now pulls each block from upstream before it answers
    assert est.estimate() >= 1.0  # one late answer already weighs half (the fast average)
    est.add(0.01)
    assert est.estimate() >= 0.2  # one quick answer does not undo it (the slow average remembers)
    for _ in range(60):
        est.add(0.01)
    assert est.estimate() < 0.05  # a fall that holds is believed


def test_first_byte_delay_is_capped_per_sample_and_in_total() -> None:
    est = FirstByteEstimator(cap_s=3.0)
    est.add(1e9)  # a relay that never answered: one sample cannot ask for more than the cap
    assert est.estimate() == 3.0
    for _ in range(100):
        est.add(50.0)
    assert est.estimate() == 3.0


def test_first_byte_delay_ages_with_time() -> None:
    clock = FakeClock()
    fresh, aged = FirstByteEstimator(clock=clock), FirstByteEstimator(clock=clock)
    for est in (fresh, aged):
        for _ in range(20):
            est.add(2.0)
    clock.now += 300.0  # five minutes (five half-lives) pass for `aged` only
    fresh.clock = lambda: 1000.0
    fresh.add(0.0)
    aged.add(0.0)
    assert aged.estimate() < fresh.estimate() / 2


def test_first_byte_delay_is_learned_per_relay_and_bounded_in_relays() -> None:
    abr = KvAbr()
    late = abr.first_byte_of("moqt://late:4443", cap_s=5.0)
    assert abr.first_byte_of("moqt://late:4443") is late  # one estimator per relay, kept
    late.add(1.5)
    abr.first_byte_of("moqt://quick:4443").add(0.0)
    assert abr.first_byte_s("moqt://late:4443") == pytest.approx(1.5)
    assert abr.first_byte_s("moqt://quick:4443") == 0.0
    assert abr.first_byte_s("moqt://never-seen:4443") == 0.0
    assert abr.first_byte_s() == 0.0  # no relay named: the newest session's (quick)
    abr.first_byte_of("moqt://late:4443")  # a new session with the late relay
    assert abr.first_byte_s() == pytest.approx(1.5)
    assert abr.fetch_latency_s("moqt://late:4443") == pytest.approx(abr.rtt.estimate() + 1.5)
    for i in range(2 * MAX_RELAYS_TRACKED):
        abr.first_byte_of(f"moqt://relay-{i}:4443")
    assert len(abr.first_byte) == MAX_RELAYS_TRACKED


def test_fetch_deadline_allows_the_relays_first_byte_delay_once() -> None:
    abr = KvAbr(AbrConfig(deadline_margin_s=0.5))
    abr.prefill.add(100, 0.1)  # 1 ms per token: a 16-token block recomputes in 16 ms
    abr.first_byte_of("moqt://late:4443").add(2.0)
    deadline = abr.deadline(started=10.0, block_size=16, relay="moqt://late:4443")
    assert deadline is not None and deadline.first_byte_s == pytest.approx(2.0)
    # A fixed cost of the request, not of each block: every block may come 2 s later, no more.
    assert deadline.due(0) == pytest.approx(10.0 + 0.5 + 2.0 + 0.016)
    assert deadline.due(9) == pytest.approx(10.0 + 0.5 + 2.0 + 10 * 0.016)
    assert "2.000s first-byte delay" in deadline.describe(0, 12.6)
    # Another relay's delay is not this one's.
    quick = abr.deadline(started=10.0, block_size=16, relay="moqt://quick:4443")
    assert quick is not None and quick.due(0) == pytest.approx(10.0 + 0.5 + 0.016)


def test_the_plan_charges_the_first_byte_delay_once_per_fetch() -> None:
    # A relay that answers 2 s late but then delivers at 1 GB/s: worth waiting for with a long prefix to
    # fetch (64 blocks recompute in ~10 s), not with a short one (4 blocks: 0.64 s).
    abr = _abr(per_token_s=1e-2, bps=1e9)  # a block recomputes in 160 ms, fetches in ~1 ms + decode
    relay = "moqt://late:4443"
    abr.first_byte_of(relay).add(2.0)
    long = abr.plan([["lossless"]] * 64, BLOCK, RAW, total_tokens=64 * BLOCK + 5, relay=relay)
    assert long.fetch_blocks == 64 and long.first_byte_s == pytest.approx(2.0)
    assert long.to_json()["inputs"]["first_byte_s"] == pytest.approx(2.0)
    assert long.est_total_s == pytest.approx(
        abr.rtt.estimate() + 2.0 + sum(c.fetch_s for c in long.choices) + abr.prefill.estimate(5)
    )
    short = abr.plan([["lossless"]] * 4, BLOCK, RAW, total_tokens=4 * BLOCK + 5, relay=relay)
    assert short.fetch_blocks == 0 and short.declined_blocks == 4  # 0.64 s of recompute beats 2 s of waiting
    quick = abr.plan([["lossless"]] * 4, BLOCK, RAW, total_tokens=4 * BLOCK + 5, relay="moqt://quick:4443")
    assert quick.fetch_blocks == 4


def test_a_relay_that_never_answers_costs_at_most_the_cap_per_fetch() -> None:
    """Each fetch abandoned before any object teaches a lower bound (what it waited, less the RTT): the
    deadline grows fetch by fetch up to margin + cap + recompute, never past it, and once the learned delay
    outweighs what fetching saves the plan recomputes instead of waiting."""
    abr = _abr(per_token_s=1e-3, bps=1e9)  # a 16-token block recomputes in 16 ms
    relay, cap = "moqt://silent:4443", 4.0
    silent = abr.first_byte_of(relay, cap_s=cap)
    waits = []
    for _ in range(30):
        deadline = abr.deadline(started=0.0, block_size=BLOCK, relay=relay)
        assert deadline is not None
        waits.append(deadline.due(0))
        silent.add(deadline.due(0) - abr.rtt.estimate())  # abandoned at due(0) with nothing delivered
    assert waits == sorted(waits) and waits[-1] > waits[0]
    assert max(waits) <= 1.0 + cap + BLOCK * 1e-3 + 1e-9
    assert silent.estimate() == pytest.approx(cap)
    plan = abr.plan([["lossless"]] * 8, BLOCK, RAW, total_tokens=8 * BLOCK + 5, relay=relay)
    assert plan.fetch_blocks == 0  # 8 x 16 ms of recompute beats 4 s of waiting
