"""TTFT of cold / remote-hit / local-hit requests, and fetch goodput vs a raw QUIC transfer, one run.

Starts a real relay, a publisher that publishes a shared prefix (2k tokens by default) on the ``bench``
model preset, then runs one-shot subscribers (separate processes, real QUIC on loopback):

* cold       — ``--abr recompute``: the whole prompt is prefilled locally;
* remote hit — a fresh subscriber fetches the shared prefix from the relay (``--abr fetch``);
* local hit  — the same process answers a second prompt sharing the prefix from its own cache.

Then it times a raw one-way QUIC transfer of the same number of bytes in the fetch's direction, from a
server with the relay's transport settings to a client with the nodes' (``benchmarks/bench_fetch.py``),
and prints medians side by side, with the load average of the machine at each run (other work on
the same cores moves these figures a lot):

    python benchmarks/bench_ttft.py --runs 3 --model bench --prefix-tokens 2048 [--block-size 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import common  # noqa: E402

from kvnet.model.registry import default_models_dir, is_registered, resolve_model  # noqa: E402
from kvnet.model.tokenizer import load_tokenizer  # noqa: E402
from kvnet.security import certs  # noqa: E402
from kvnet.security.signing import generate_keypair  # noqa: E402


def _prefix(tokens: int, model: str = "bench") -> str:
    """Deterministic text of ``tokens`` tokens (BOS included) under ``model``'s tokenizer: one token per
    byte on a preset (``bench``, ``small``: byte-level), the model's own count on a trained model (SmolLM2's
    BPE makes a word of this text one or two tokens, so counting characters would publish a quarter of the
    prefix the figures claim)."""
    words = ("kv", "cache", "block", "relay", "quic", "prefix", "token", "layer", "fetch", "publish")
    out: list[str] = []
    i = 0
    while sum(len(w) + 1 for w in out) < tokens:
        out.append(words[(i * 7 + i // 10) % len(words)])
        i += 1
    if not is_registered(model):
        return " ".join(out)[: tokens - 1]
    tokenizer = load_tokenizer(resolve_model(model, default_models_dir(os.environ)))
    while len(tokenizer.tokenize(" ".join(out))) < tokens:  # each word is at least one token
        out += out
    low, high = 0, len(out)  # the most words whose text is at most `tokens` tokens
    while low < high:
        mid = (low + high + 1) // 2
        if len(tokenizer.tokenize(" ".join(out[:mid]))) <= tokens:
            low = mid
        else:
            high = mid - 1
    return " ".join(out[:low])


class Bench:
    def __init__(self, tmp: Path, model: str, threads: int, node_extra: list[str]) -> None:
        self.tmp, self.model, self.threads, self.node_extra = tmp, model, threads, node_extra
        certs.create_ca(tmp / "certs")
        certs.issue_cert(tmp / "certs", "relay", ["127.0.0.1", "localhost"])
        certs.issue_cert(tmp / "certs", "server", ["127.0.0.1", "localhost"])
        generate_keypair(tmp / "home" / "keys", "publisher")
        self.env = {**os.environ, "KVNET_HOME": str(tmp / "home"), "PYTHONPATH": str(REPO)}
        self.port = common.free_port()
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, args: list[str], name: str) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"{name}.log", "ab")  # noqa: SIM115 (owned by the child)
        proc = subprocess.Popen([sys.executable, *args], cwd=REPO, env=self.env, stdout=subprocess.PIPE,
                                stderr=log)
        self.procs.append(proc)
        return proc

    def node_args(self) -> list[str]:
        return ["--relay", f"moqt://127.0.0.1:{self.port}", "--ca", str(self.tmp / "certs" / "ca.pem"),
                "--model", self.model, "--cache-blocks", "1024", "--threads", str(self.threads),
                *self.node_extra]

    def start(self, prefix: str) -> None:
        c = self.tmp / "certs"
        self.spawn(["-m", "relay", "--listen", f"127.0.0.1:{self.port}", "--cert", str(c / "relay.pem"),
                    "--key", str(c / "relay-key.pem"), "--metrics", "", "--cache-bytes", str(1 << 30),
                    "--trust-any"],
                   "relay")
        time.sleep(1.0)
        pub = self.spawn(["-m", "publisher", *self.node_args(), "--prompt", prefix], "publisher")
        log = self.tmp / "publisher.log"
        deadline = time.monotonic() + 600
        while "READY" not in log.read_text(errors="replace"):
            if pub.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"publisher failed: {log.read_text()[-2000:]}")
            time.sleep(0.2)

    def subscribe(self, prompts: list[str], *extra: str) -> list[dict[str, Any]]:
        args = ["-m", "subscriber", "--json", *self.node_args(), *extra]
        for p in prompts:
            args += ["--prompt", p]
        proc = self.spawn(args, "subscriber")
        out, _ = proc.communicate(timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"subscriber rc={proc.returncode}")
        return [json.loads(line) for line in out.decode().splitlines() if line.strip()]

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


def _raw_quic_mbps(certdir: Path, nbytes: int, node_stack: str | None) -> float:
    """MB/s of one raw one-way QUIC transfer of ``nbytes`` in the fetch's direction: from a server with
    the relay's transport settings to a client with the nodes' (``bench_fetch.raw_server_to_client``)."""
    mod = common.load_bench("bench_fetch")
    assert mod is not None, "benchmarks/bench_fetch.py is needed for the raw baseline"
    from kvnet.net.config import TransportConfig
    from kvnet.node.config import NodeConfig

    client = TransportConfig(stack=node_stack or NodeConfig.quic_stack)
    (rate,) = mod.raw_server_to_client(TransportConfig(), nbytes, 1, certdir, client)
    return float(rate)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bench")
    ap.add_argument("--prefix-tokens", type=int, default=2048)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2, help="torch threads per node (one node runs at a time)")
    ap.add_argument("--block-size", type=int, help="tokens per block (default: the nodes' default)")
    ap.add_argument("--quic-stack", choices=["qh3", "aioquic"], help="nodes' QUIC stack (default: theirs)")
    ap.add_argument("--fetch-window", help="subscriber fetch window, e.g. 4M (default: the nodes' default)")
    args = ap.parse_args()
    node_extra: list[str] = []
    for flag, value in (("--block-size", args.block_size), ("--quic-stack", args.quic_stack),
                        ("--fetch-window", args.fetch_window)):
        if value is not None:
            node_extra += [flag, str(value)]
    prefix = _prefix(args.prefix_tokens, args.model)
    rows: dict[str, list[float]] = {"cold": [], "remote": [], "local": []}
    goodput, raw, fetched, locate, loads = [], [], [], [], []
    with tempfile.TemporaryDirectory() as d:
        bench = Bench(Path(d), args.model, args.threads, node_extra)
        try:
            print(f"publishing {args.prefix_tokens} tokens on model {args.model} ...", file=sys.stderr)
            bench.start(prefix)
            for run in range(args.runs):
                q1, q2 = f"{prefix} Q{run}a: why?", f"{prefix} Q{run}b: how?"
                n = str(args.max_tokens)
                (cold,) = bench.subscribe([q1], "--abr", "recompute", "--max-tokens", n)
                remote, local = bench.subscribe([q1, q2], "--abr", "fetch", "--max-tokens", n)
                assert remote["output_token_ids"] == cold["output_token_ids"], "remote hit changed the output"
                rows["cold"].append(cold["timings"]["ttft_s"])
                rows["remote"].append(remote["timings"]["ttft_s"])
                rows["local"].append(local["timings"]["ttft_s"])
                nbytes = remote["bytes_fetched"]
                fetched.append(nbytes)
                goodput.append(nbytes / remote["timings"]["fetch_s"] / 1e6)
                locate.append(remote["timings"]["locate_s"])
                loads.append(common.load_average().split()[0])
                raw.append(_raw_quic_mbps(Path(d) / "certs", nbytes, args.quic_stack))
                print(f"run {run + 1}: cold {rows['cold'][-1]:.3f}s remote {rows['remote'][-1]:.3f}s "
                      f"local {rows['local'][-1]:.3f}s remote_hit={remote['remote_hit_tokens']} "
                      f"locate {locate[-1] * 1e3:.0f} ms goodput {goodput[-1]:.1f} MB/s "
                      f"raw {raw[-1]:.1f} MB/s "
                      f"load {loads[-1]}", file=sys.stderr)
        finally:
            bench.close()
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"model={args.model} prefix_tokens={args.prefix_tokens} runs={args.runs} {' '.join(node_extra)} "
          f"(medians; load average per run: {', '.join(loads)})")
    print(f"{'case':<12}{'TTFT s':>10}{'vs cold':>10}")
    for k in ("cold", "remote", "local"):
        print(f"{k:<12}{med[k]:>10.3f}{med['cold'] / med[k]:>9.1f}x")
    g, r = statistics.median(goodput), statistics.median(raw)
    print(f"fetch goodput {g:.1f} MB/s vs raw QUIC relay -> node {r:.1f} MB/s ({g / r:.2f}x) over "
          f"{statistics.median(fetched) / 1e6:.1f} MB; locate {statistics.median(locate) * 1e3:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
