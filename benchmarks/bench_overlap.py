"""TTFT of cold, fetch-only and fetch-and-compute over an emulated link, at several link rates.

Starts a real relay and a publisher (``benchmarks/bench_ttft.py``'s ``Bench``) that publishes a warm-up
prompt and a shared prefix, then for each rate puts ``kvnet linkemu`` (rate limit both ways, ``--rtt-ms``
round trip) in front of the relay and runs one-shot subscribers through it (separate processes, real QUIC):

* cold            — ``--abr recompute`` (no network; measured once per run, the link does not matter);
* fetch-only      — ``--abr fetch``: the whole located prefix is fetched, then the suffix prefilled;
* fetch+compute   — ``--abr auto``: the ABR may compute the head while fetching the tail
  (``kvnet.node.overlap``), or choose one side alone where that is faster.

With ``--kvtc`` the publisher also publishes the ``kvtc`` rendition (tables calibrated first with ``kvnet
kvtc calibrate`` on benchmarks/kvtc-calibration.txt), and two more subscribers run per rate:

* kvtc            — ``--abr fetch --accept kvtc``: the whole prefix fetched transform-coded (lossy);
* auto+kvtc       — ``--abr auto --accept lossless,kvtc``: the ABR picks the rendition, or recomputes.

Their output is lossy, so it is compared with cold's (``same`` counts runs whose tokens are equal), not
asserted equal. Each subscriber first answers the warm-up prompt (its blocks also on the relay), so its
kernels are warm, kvtc's tables are fetched and, in ``auto``, the ABR has measured the link before the
timed request, as a running node would have.
Medians over ``--runs``: ``f+c/min`` is fetch+compute's median over the faster of cold's and fetch-only's,
``paired`` the median over runs of that ratio taken within each run. The load average of the machine is
printed with each run (other work on the same cores moves these figures a lot):

    python benchmarks/bench_overlap.py --model small --prefix-tokens 2048 --rates 10,30,100,300 --runs 3
    python benchmarks/bench_overlap.py --model smollm2 --prefix-tokens 1024 --rates 2,5 --runs 3 --kvtc
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import common  # noqa: E402

MODES = ("cold", "fetch-only", "fetch+compute")
KVTC_RUNS = (("kvtc", "fetch", "kvtc"), ("auto+kvtc", "auto", "lossless,kvtc"))
"""``--kvtc``'s extra subscribers: (mode, --abr, --accept)."""
KVTC_MODES = tuple(mode for mode, _, _ in KVTC_RUNS)


def _plan_shape(report: dict) -> str:
    """What a subscriber's plan did: ``2c/1f`` (head computed, tail fetched), ``fetch``, ``no locate`` or
    ``recompute``."""
    plan = report["abr"]
    if plan.get("compute_blocks"):
        return f"{report['head_computed_blocks']}c/{report['tail_fetched_blocks']}f"
    if plan.get("fetch_blocks"):
        return "fetch"
    return "no locate" if plan.get("locate_skipped") else "recompute"


def _kvtc_tables(model: str, directory: Path) -> Path:
    """The model's kvtc tables, calibrated by ``kvnet kvtc calibrate`` on benchmarks/kvtc-calibration.txt
    (never the timed text): 4,096 tokens and 256 scored, as bench_codecs.py calibrates, enough to predict
    SmolLM2's layers from the layer before."""
    tables = directory / f"{model}.kvtc"
    text = REPO / "benchmarks" / "kvtc-calibration.txt"
    subprocess.run([sys.executable, "-m", "kvnet.cli", "kvtc", "calibrate", "--model", model, "--text",
                    str(text), "--tokens", "4352", "--out", str(tables)], cwd=REPO, check=True)
    return tables


def _linkemu(bench: Any, rate_mbps: float, rtt_ms: float) -> tuple[Any, int]:
    """Start ``kvnet linkemu`` in front of the bench's relay; (process, its port) once it forwards."""
    port = common.free_port()
    proc = bench.spawn(
        ["-m", "kvnet.cli", "linkemu", "--listen", f"127.0.0.1:{port}", "--target", f"127.0.0.1:{bench.port}",
         "--rate", str(rate_mbps * 1e6), "--delay-ms", str(rtt_ms / 2), "--queue-packets", "4000"],
        f"linkemu-{rate_mbps:g}",
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if b"forwarding" not in line:
        raise RuntimeError(f"linkemu did not start: {line!r}")
    return proc, port


def _timed(bench: Any, warm: str, prompts: list[str], port: int, *extra: str) -> dict[str, Any]:
    """The report of the last of ``prompts``, answered by a fresh subscriber after ``warm`` and the others
    (through ``port``): with several, the ABR has learned from the earlier ones, as a running node has."""
    relay = ["--relay", f"moqt://127.0.0.1:{port}"]
    *_, report = bench.subscribe([warm, *prompts], *relay, *extra)
    return dict(report)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--prefix-tokens", type=int, default=2048)
    ap.add_argument("--warm-tokens", type=int, default=512)
    ap.add_argument("--rates", default="10,30,100,300", help="link rates in MB/s, comma-separated")
    ap.add_argument("--rtt-ms", type=float, default=20.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per node: 1, a node's own default (``--threads``); 2 on a 2-core AMX "
                         "host made SmolLM2's prefill no faster and took the core the fetch runs on")
    ap.add_argument("--requests", type=int, default=1,
                    help="prompts each subscriber answers after the warm-up, each on a prefix of its own; "
                         "the last is timed (more than 1: the ABR plans from what the earlier ones measured)")
    ap.add_argument("--kvtc", action="store_true",
                    help="also publish kvtc; time a kvtc fetch and the ABR choosing lossless or kvtc")
    args = ap.parse_args()
    modes = MODES + (KVTC_MODES if args.kvtc else ())
    same: dict[tuple[str, float], int] = {}
    chosen: dict[float, list[str]] = {r: [] for r in [float(r) for r in args.rates.split(",")]}
    ttft = common.load_bench("bench_ttft")
    assert ttft is not None, "benchmarks/bench_ttft.py is needed (relay and publisher set-up)"
    rates = [float(r) for r in args.rates.split(",")]
    prefix = ttft._prefix(args.prefix_tokens, args.model)
    warm = "warm-up " + ttft._prefix(args.warm_tokens, args.model)[::-1]
    times: dict[tuple[str, float], list[float]] = {}
    splits: dict[float, list[str]] = {r: [] for r in rates}
    loads: list[str] = []
    n = str(args.max_tokens)
    with tempfile.TemporaryDirectory() as d:
        node_extra: list[str] = []
        if args.kvtc:
            print(f"calibrating kvtc tables for {args.model} ...", file=sys.stderr)
            tables = _kvtc_tables(args.model, Path(d))
            node_extra = ["--renditions", "lossless,kvtc", "--kvtc-tables", str(tables)]
        bench = ttft.Bench(Path(d), args.model, args.threads, node_extra)
        try:
            print(f"publishing {args.prefix_tokens} tokens on model {args.model} ...", file=sys.stderr)
            bench.start(prefix)
            # Each request after the first on a prefix of its own (a different first word changes every
            # block's chain hash), so no request hits what an earlier one loaded.
            prefixes = [prefix] + [f"v{j} {prefix}"[: len(prefix)] for j in range(1, args.requests)]
            publish_warm = ["-m", "publisher", *bench.node_args(), "--prompt", warm, "--exit-after-publish"]
            for extra_prefix in prefixes[1:]:
                publish_warm += ["--prompt", extra_prefix]
            pub = bench.spawn(publish_warm, "publisher-warm")
            if pub.wait(timeout=600) != 0:
                raise RuntimeError("publishing the warm-up prompt failed")
            for run in range(args.runs):
                prompts = [f"{p} Q{run}: why?" for p in prefixes[1:]] + [f"{prefix} Q{run}: why?"]
                cold = _timed(bench, warm, prompts, bench.port, "--abr", "recompute", "--max-tokens", n)
                reference = cold["output_token_ids"]
                for rate in rates:
                    emu, port = _linkemu(bench, rate, args.rtt_ms)
                    try:
                        fetch = _timed(bench, warm, prompts, port, "--abr", "fetch", "--max-tokens", n)
                        both = _timed(bench, warm, prompts, port, "--abr", "auto", "--max-tokens", n)
                        lossy = {}
                        for mode, abr, accept in KVTC_RUNS if args.kvtc else ():
                            lossy[mode] = _timed(bench, warm, prompts, port, "--abr", abr, "--accept", accept,
                                                 "--max-tokens", n)
                    finally:
                        emu.terminate()
                        emu.wait(timeout=10)
                    for mode, report in (("cold", cold), ("fetch-only", fetch), ("fetch+compute", both)):
                        assert report["output_token_ids"] == reference, f"{mode} changed the output"
                        times.setdefault((mode, rate), []).append(report["timings"]["ttft_s"])
                    for mode, report in lossy.items():
                        times.setdefault((mode, rate), []).append(report["timings"]["ttft_s"])
                        equal = report["output_token_ids"] == reference
                        same[(mode, rate)] = same.get((mode, rate), 0) + equal
                    if lossy:
                        auto = lossy["auto+kvtc"]
                        took = "+".join(sorted(auto.get("renditions") or {"recompute": 0}))
                        chosen[rate].append(f"{took}({_plan_shape(auto)})")
                        print(f"run {run + 1} {rate:g} MB/s: kvtc {lossy['kvtc']['timings']['ttft_s']:.3f}s "
                              f"auto+kvtc {lossy['auto+kvtc']['timings']['ttft_s']:.3f}s (took "
                              f"{chosen[rate][-1]})", file=sys.stderr)
                    plan = both["abr"]
                    skipped = plan.get("locate_skipped")
                    split = _plan_shape(both)
                    splits[rate].append(split)
                    inputs = plan.get("inputs", {})
                    why = (f"locate skipped: {skipped}" if skipped else
                           f"planned {plan.get('compute_blocks', 0)} computed of "
                           f"{plan.get('fetch_blocks', 0)}, estimated {plan.get('est_total_s', 0):.3f}s "
                           "against "
                           f"{plan.get('est_recompute_all_s', 0):.3f}s recomputing; locate "
                           f"{1000 * both['timings'].get('locate_s', 0):.0f} ms")
                    print(f"run {run + 1} {rate:g} MB/s: cold {cold['timings']['ttft_s']:.3f}s fetch-only "
                          f"{fetch['timings']['ttft_s']:.3f}s fetch+compute {both['timings']['ttft_s']:.3f}s "
                          f"({split}, {why}; from {inputs.get('throughput_bps', 0) / 1e6:.1f} MB/s and rtt "
                          f"{1000 * inputs.get('rtt_s', 0):.0f} ms) load {common.load_average()}",
                          file=sys.stderr)
                loads.append(common.load_average().split()[0])
        finally:
            bench.close()
    print(f"model={args.model} prefix_tokens={args.prefix_tokens} rtt={args.rtt_ms:g} ms runs={args.runs} "
          f"requests={args.requests} "
          f"(medians; load average after each run: {', '.join(loads)})")
    kvtc_head = f"{'kvtc s':>9}{'a+kvtc s':>9}{'same':>6}" if args.kvtc else ""
    print(f"{'MB/s':>6}{'cold s':>9}{'fetch s':>9}{'f+c s':>9}{'f+c/min':>9}{'paired':>8}{kvtc_head}  "
          f"head computed / tail fetched{'; auto+kvtc took' if args.kvtc else ''}")
    for rate in rates:
        med = {m: statistics.median(times[(m, rate)]) for m in modes}
        ratio = med["fetch+compute"] / min(med["cold"], med["fetch-only"])
        # The same ratio within each run (its subscribers ran back to back), then the median over runs:
        # the machine's drift between runs moves a run's three figures alike.
        runs = zip(*(times[(m, rate)] for m in MODES), strict=True)
        paired = statistics.median(both / min(cold, fetch) for cold, fetch, both in runs)
        kvtc_cols = (f"{med['kvtc']:>9.3f}{med['auto+kvtc']:>9.3f}{same[('kvtc', rate)]:>4}/{args.runs}"
                     if args.kvtc else "")
        took = f"; {' '.join(chosen[rate])}" if args.kvtc else ""
        print(f"{rate:>6g}{med['cold']:>9.3f}{med['fetch-only']:>9.3f}{med['fetch+compute']:>9.3f}"
              f"{ratio:>9.2f}{paired:>8.2f}{kvtc_cols}  {' '.join(splits[rate])}{took}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
