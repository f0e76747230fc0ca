"""The one entry point for kvnet's benchmarks: runs the suites, prints each figure as it is measured, and
writes ``results.json`` (every run of every figure, load averages, machine) and ``results.md`` (a table)
to ``--out``.

    python benchmarks/run.py                          # every suite, full size (tens of minutes)
    python benchmarks/run.py --quick                  # every suite, small sizes (a few minutes)
    python benchmarks/run.py --suite fetch --suite locate --out bench-results

Suites (each calls the functions of the ``bench_*.py`` module named; a suite whose module or process is
missing, or that fails, is recorded as skipped with the reason and the others still run):

  raw      bulk one-way QUIC (aioquic and qh3, kvnet's tuned settings) and TLS 1.3 over TCP
           (bench_transport.measure)
  fetch    MoQT FETCH goodput publisher -> subscriber, plain and compressed, next to raw QUIC in both
           directions in the same run (bench_fetch.fetch_goodput); through a relay: relay -> subscriber
           (cached) and publisher -> relay -> subscriber (bench_relay.run_relay_scenarios, N=1)
  ttft     time to first token vs shared-prefix length: cold, remote hit, local hit (bench_ttft.Bench)
  fanout   one publisher, 1/2/4/8 subscribers through a relay: FETCH cold and warm, SUBSCRIBE; and 1/2/4/8
           subscriber processes making verified fetches of one prompt from a relay's cache at once:
           aggregate and per-subscriber MB/s and tokens/s, relay CPU ms/MB, the relay on 1 and 2 worker
           processes (bench_datapath --fanout --relay-workers 1,2)
           (bench_relay.run_relay_scenarios)
  locate   locate latency in round trips for 16..4096 blocks through the link emulator at 20 and
           120 ms RTT, direct and through a relay, with the blocks pushed into its cache and with a cold
           cache (bench_locate.locate_round_trips)
  micro    hashing ns/token, codec MB/s and ratio, paged-cache import vs torch copy, sans-I/O session
           data path (bench_micro.run)
  datapath the data path in one interleaved run: verified fetch from a relay's cache and raw QUIC
           server -> client per stack at each link preset (ethernet 1452, jumbo 8952, loopback), TLS 1.3
           over TCP and HTTPS moving the same bytes; MB/s, tokens/s, CPU ms/MB per side (bench_datapath)
  scale    relay memory and CPU per 1k idle sessions and per 100k cached objects (bench_scale)
  lifecycle an origin relay restarted (SIGTERM, SIGKILL) under a kvnet-node and an edge relay: time to
           leave the dead session and to be back on the restarted one (bench_reconnect.measure)
  quality  codec quality on real KV: SmolLM2 over the documents in benchmarks/documents, per rendition
           size vs raw, mean KL to lossless, delta log-loss and top-1 agreement on held-out tokens
           (bench_codecs.real_kv_quality; float32, and bfloat16 unless --quick)

No plots: plotting would need a library kvnet does not depend on; results.json has every run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

from kvnet.net.config import DEFAULT_STACK, LINK_PRESETS, STACKS, TransportConfig


def _need(name: str) -> Any:
    mod = common.load_bench(name)
    if mod is None:
        raise ModuleNotFoundError(f"benchmarks/{name}.py is not there")
    return mod


# ---------------------------------------------------------------- suites


def suite_raw(res: common.SuiteResult, quick: bool) -> None:
    bt = _need("bench_transport")
    size = (32 if quick else 128) << 20
    runs = 3
    with common.test_certificates() as certdir:
        figures = {}
        for mode in ("aioquic-tuned", "qh3-tuned", "tcp-tls"):
            rates = bt.measure(mode, size, runs, certdir)
            figures[mode] = common.median(rates)
            res.add(f"raw {mode}", rates, "MB/s", f"{size >> 20} MiB one-way, client -> server")
        for mode, v in figures.items():
            res.add(f"ratio {mode} / aioquic-tuned", [v / figures["aioquic-tuned"]], "x")


def _relay_scenarios(size: int, ns: list[int], runs: int, stack: str) -> dict[str, float]:
    br = _need("bench_relay")
    with common.test_certificates() as certdir:
        # Budget for every track the run creates, so warm fetches really are cache hits.
        proc, port = br.start_relay(certdir, cache_bytes=size * (3 * runs * len(ns) + 2))
        try:
            result: dict[str, float] = asyncio.run(
                br.run_relay_scenarios(f"moqt://127.0.0.1:{port}", certdir / "ca.pem", size, ns, runs))
            return result
        finally:
            proc.terminate()
            proc.wait(timeout=15)


def suite_fetch(res: common.SuiteResult, quick: bool) -> None:
    bf = _need("bench_fetch")
    objects = 16 if quick else 64
    runs = 3 if quick else 5
    cases = [("aioquic", None), ("aioquic", "lossless"), ("aioquic", "int8"), ("qh3", None),
             ("qh3", "lossless"), ("qh3", "int8")]
    if quick:
        cases = [("aioquic", None), ("aioquic", "lossless"), ("qh3", None)]
    with common.test_certificates() as certdir:
        for stack, codec in cases:
            settings = TransportConfig(stack=stack)
            out = bf.fetch_goodput(settings, objects, 1 << 20, runs, codec, certdir)
            tag = f"{stack} {codec or 'plain'}"
            good = common.median(out["fetch"])
            note = (f"{objects} objects, {out['wire_bytes'] / 1e6:.1f} MB on the wire, "
                    f"ratio {out['ratio']:.2f}")
            res.add(f"fetch {tag} goodput (decoded)", out["fetch"], "MB/s", note)
            res.add(f"fetch {tag} wire", out["fetch_wire"], "MB/s", note)
            s2c, c2s = common.median(out["raw_s2c"]), common.median(out["raw_c2s"])
            res.add(f"raw {stack} server->client (same bytes)", out["raw_s2c"], "MB/s", f"with {tag}")
            res.add(f"raw {stack} client->server (same bytes)", out["raw_c2s"], "MB/s", f"with {tag}")
            res.add(f"fetch {tag} / raw same direction", [good / s2c], "x", "target >= 0.9 (plain)")
            res.add(f"fetch {tag} / raw client->server", [good / c2s], "x")
    size = (16 if quick else 64) << 20
    relay = _relay_scenarios(size, [1], 3, DEFAULT_STACK)
    note = f"{size >> 20} MiB track of 1 MiB objects via kvnet-relay, no compression"
    res.add("relay -> subscriber (cached, fetch-warm)", [relay["fetch-warm N=1"]], "MB/s", note)
    res.add("publisher -> relay -> subscriber (fetch-cold)", [relay["fetch-cold N=1"]], "MB/s", note)


def suite_fanout(res: common.SuiteResult, quick: bool) -> None:
    size = (8 if quick else 32) << 20
    ns = [1, 2, 4, 8]
    relay = _relay_scenarios(size, ns, 1 if quick else 3, DEFAULT_STACK)
    for key, value in relay.items():
        res.add(f"fanout {key}", [value], "MB/s",
                f"{size >> 20} MiB track, aggregate payload delivered to all subscribers")
    bd = _need("bench_datapath")
    tokens, runs = (512, 3) if quick else (2048, 5)
    prompt, figures = bd.fanout(tokens, runs, ns, relay_workers=(1, 2))
    mb = prompt.wire_bytes / 1e6
    note = (f"verified fetches of {prompt.tokens} tokens ({mb:.1f} MB lossless bf16) from one relay's cache, "
            f"{DEFAULT_STACK}, loopback, interleaved with the relay on 1 and 2 worker processes")
    for fig in figures:
        name = f"fanout verified {fig.subscribers} subscribers"
        if fig.relay_workers > 1:
            name += f", {fig.relay_workers} relay workers"
        if fig.failures:
            res.skip(f"{name}: {len(fig.failures)} of {runs} runs failed, first: {fig.failures[0]}")
        if not fig.aggregate_mbps:
            continue
        res.add(f"{name} aggregate", fig.aggregate_mbps, "MB/s", note)
        res.add(f"{name} aggregate tokens/s", [x / mb * prompt.tokens for x in fig.aggregate_mbps], "tok/s")
        res.add(f"{name} per subscriber", fig.per_subscriber_mbps, "MB/s")
        res.add(f"{name} per subscriber tokens/s", [x / mb * prompt.tokens for x in fig.per_subscriber_mbps],
                "tok/s")
        res.add(f"{name} relay CPU", fig.relay_ms_per_mb, "ms/MB")
        res.add(f"{name} relay busiest process", fig.relay_busiest_core, "cores")


def suite_ttft(res: common.SuiteResult, quick: bool) -> None:
    import tempfile

    bt = _need("bench_ttft")
    model = "small" if quick else "bench"
    lengths = (256, 1024) if quick else (512, 1024, 2048)
    runs = 1 if quick else 2
    for length in lengths:
        prefix = bt._prefix(length)
        rows: dict[str, list[float]] = {"cold": [], "remote": [], "local": []}
        with tempfile.TemporaryDirectory() as d:
            bench = bt.Bench(Path(d), model, 2, [])
            try:
                bench.start(prefix)
                for run in range(runs):
                    q1, q2 = f"{prefix} Q{run}a: why?", f"{prefix} Q{run}b: how?"
                    (cold,) = bench.subscribe([q1], "--abr", "recompute", "--max-tokens", "2")
                    remote, local = bench.subscribe([q1, q2], "--abr", "fetch", "--max-tokens", "2")
                    if remote["output_token_ids"] != cold["output_token_ids"]:
                        raise RuntimeError("a remote hit changed the output")
                    rows["cold"].append(cold["timings"]["ttft_s"])
                    rows["remote"].append(remote["timings"]["ttft_s"])
                    rows["local"].append(local["timings"]["ttft_s"])
            finally:
                bench.close()
        cold = common.median(rows["cold"])
        for case, times in rows.items():
            speedup = cold / common.median(times)
            res.add(f"ttft {case} prefix={length}", times, "s", f"model {model}, {speedup:.1f}x vs cold")


def suite_locate(res: common.SuiteResult, quick: bool) -> None:
    bl = _need("bench_locate")
    blocks = [16, 256, 1024] if quick else [16, 64, 256, 1024, 4096]
    runs = 3
    settings = TransportConfig()
    # direct; relay with the blocks pushed into its cache (the nodes' default); relay with a cold cache
    for path, relay, push in (("direct", False, False), ("relay", True, True), ("relay-cold", True, False)):
        try:
            out = bl.locate_round_trips(settings, blocks, runs, (20.0, 120.0), relay, push=push)
        except Exception as exc:  # the relay paths are optional; record why they did not run
            if not relay:
                raise
            res.skip(f"locate through the relay ({path}): {type(exc).__name__}: {exc}")
            continue
        for n, row in out["per_n"].items():
            res.add(f"locate {path} N={n} @20ms", row["seconds"]["20.0"], "s",
                    f"{row['rtts_at']['20.0']:.2f} RTTs of 20 ms")
            res.add(f"locate {path} N={n} RTTs (slope 20->120 ms)", [row["slope_rtts"]], "RTT",
                    f"@120 ms: {row['rtts_at']['120.0']:.2f} RTTs; target <= 3")


def suite_micro(res: common.SuiteResult, quick: bool) -> None:
    bm = _need("bench_micro")
    sub = bm.run(quick)
    res.rows.extend(sub.rows)


def suite_datapath(res: common.SuiteResult, quick: bool) -> None:
    bd = _need("bench_datapath")
    tokens, runs = (512, 3) if quick else (2048, 5)
    prompt, figures = bd.run(tokens, runs, list(STACKS), list(LINK_PRESETS))
    note = (f"{prompt.tokens} tokens of the bench model's bf16 KV, {prompt.wire_bytes / 1e6:.1f} MB lossless "
            f"on the wire, median of {runs}, interleaved")
    rates = {}
    for fig in figures:
        if fig.failures:
            res.skip(f"{fig.name}: {len(fig.failures)} of {runs} runs failed, first: {fig.failures[0]}")
        if not fig.mbps:
            continue
        rates[fig.name] = common.median(fig.mbps)
        res.add(f"{fig.name} MB/s", fig.mbps, "MB/s", note)
        big_model = rates[fig.name] * 1e6 / bd.LLAMA3_8B_BF16_BYTES_PER_TOKEN
        res.add(f"{fig.name} tokens/s", fig.tokens_per_s, "tok/s",
                f"at this MB/s an 8B Llama-3 (bf16) would get {big_model:.0f} tok/s")
        res.add(f"{fig.name} server CPU", fig.server_ms_per_mb, "ms/MB")
        res.add(f"{fig.name} client CPU", fig.client_ms_per_mb, "ms/MB")
    tls = rates.get(bd.TLS_TCP_CASE)
    best = max((v for k, v in rates.items() if k.startswith("verified fetch")), default=None)
    if tls and best:
        res.add("best verified fetch / TLS 1.3 over TCP", [best / tls], "x", "target >= 0.5")


def suite_scale(res: common.SuiteResult, quick: bool) -> None:
    bs = _need("bench_scale")
    sessions, objects = (200, 20_000) if quick else (1000, 100_000)
    out = bs.relay_scale(sessions, objects, 256, 5.0 if quick else 10.0)
    s, o = out["sessions"], out["objects"]
    note = f"measured with {s['sessions']} sessions ({s['alive']} alive at the end), scaled"
    res.add("relay RSS per 1k idle sessions", [s["rss_per_1k_mib"]], "MiB", note)
    res.add("relay CPU to set up 1k sessions", [s["setup_cpu_s_per_1k"]], "CPU s", note)
    res.add("relay CPU per 1k idle sessions", [s["idle_cpu_pct_per_1k"]], "% core", note)
    note = f"measured with {o['objects']} objects of {o['object_bytes']} B, scaled"
    res.add("relay RSS per 100k cached objects", [o["rss_per_100k_mib"]], "MiB",
            f"{note}; payload alone {o['payload_per_100k_mib']:.1f} MiB")
    res.add("relay overhead per cached object", [o["overhead_bytes_per_object"]], "B", note)


def suite_lifecycle(res: common.SuiteResult, quick: bool) -> None:
    br = _need("bench_reconnect")
    from tests.helpers.processes import make_certificates

    runs = 2 if quick else 5
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        certs = make_certificates(work / "certs")
        for way in ("sigterm", "sigkill"):
            times = br.measure(runs, way, work, certs)
            res.add(f"origin {way}: node and edge off the dead session", times["noticed"], "s",
                    "signal -> node /health relay_connected false and edge upstreams_connected 0")
            res.add(f"origin {way}: node and edge back on the restarted origin", times["back"], "s",
                    "origin listening -> node /health relay_connected and edge upstreams_connected 1 "
                    "(backoff cap 5 s)")


def suite_quality(res: common.SuiteResult, quick: bool) -> None:
    bc = _need("bench_codecs")
    held_out = 128 if quick else 256
    for dtype_name in ("float32",) if quick else ("float32", "bfloat16"):
        model, tokenizer = bc.load_trained("smollm2", dtype_name)
        scorer = bc.load_trained("smollm2", "float32")[0]  # bf16 arithmetic has a KL floor (bench_codecs)
        for name, ratio, kl, delta, agree, n, _, _ in bc.real_kv_quality(model, tokenizer, 64, held_out, 1,
                                                                          scorer=scorer):
            note = (f"smollm2 {dtype_name} KV scored in float32, 64-token blocks, {n} held-out positions "
                    "over 3 documents")
            res.add(f"{name} {dtype_name} real KV: size vs raw", [ratio], "x", note)
            res.add(f"{name} {dtype_name} real KV: mean KL vs lossless", [kl], "nats", note)
            res.add(f"{name} {dtype_name} real KV: delta log-loss", [delta], "nats/token", note)
            res.add(f"{name} {dtype_name} real KV: top-1 agreement", [agree], "", note)


SUITES: dict[str, Callable[[common.SuiteResult, bool], None]] = {
    "raw": suite_raw,
    "fetch": suite_fetch,
    "ttft": suite_ttft,
    "fanout": suite_fanout,
    "locate": suite_locate,
    "micro": suite_micro,
    "scale": suite_scale,
    "quality": suite_quality,
    "datapath": suite_datapath,
    "lifecycle": suite_lifecycle,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", action="append", choices=list(SUITES), help="repeatable; default: all")
    ap.add_argument("--quick", action="store_true", help="small sizes and fewer runs")
    ap.add_argument("--out", type=Path, default=Path("bench-results"), help="directory for the results")
    args = ap.parse_args(argv)
    names = args.suite or list(SUITES)
    argv_used = ["benchmarks/run.py", *(sys.argv[1:] if argv is None else argv)]
    print(f"kvnet benchmarks: {', '.join(names)}{' (quick)' if args.quick else ''}; cores={os.cpu_count()}, "
          f"load {common.load_average()}", flush=True)
    results = []
    for name in names:
        cmd = f"python benchmarks/run.py --suite {name}" + (" --quick" if args.quick else "")
        res = common.SuiteResult(name, cmd)
        print(f"\n== {name} ==", flush=True)
        t0 = time.perf_counter()
        try:
            SUITES[name](res, args.quick)
        except Exception as exc:  # one failing suite is reported; the others still run
            traceback.print_exc()
            res.skip(f"suite failed: {type(exc).__name__}: {exc}")
        res.seconds = time.perf_counter() - t0
        results.append(res)
        common.write_results(args.out, results, argv_used)  # partial results survive a later crash
    jpath, mpath = common.write_results(args.out, results, argv_used)
    print(f"\n{common.table(results)}\n\nwrote {jpath} and {mpath}; load {common.load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
