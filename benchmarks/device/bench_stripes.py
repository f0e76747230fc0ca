"""Striped verified fetch into a device's cache: 1, 2, 4, 8 sessions over QMux, aggregate GB/s, CPU per MB.

For a host with many cores and a GPU, in under five minutes, with no network beyond loopback. A
``kvnet-relay`` (QMux on TLS 1.3/TCP, ``--workers`` sized to the cores) holds a signed prompt's KV in its
cache, once per rendition (``lossless``, ``plain``); a verified fetch striped over N sessions, as a node
with ``--fetch-connections N`` makes it (``kvnet.exchange.striping``: each session its own fetcher, checks and
verify pool), loads the prompt into a paged cache on the GPU when CUDA is available, each layer staged
through pinned host memory (``PagedKVCache.import_layer_with``, as ``kvnet-node --device cuda``), else into
a CPU cache. The sessions are set up before the timed part; the counts and renditions are interleaved,
medians of ``--runs``; the load is printed before and after. The table: wire MB/s, decoded KV GB/s into
the cache, prompt tokens/s, and CPU ms per wire MB of the relay (all its processes) and of the fetching
process.

    python benchmarks/device/bench_stripes.py            # sized for a big host (default with CUDA)
    python benchmarks/device/bench_stripes.py --quick    # small: about a minute on 2 cores (default without)

The machinery (relay, prompt, fetch, figures) is ``benchmarks/bench_datapath.py``'s ``--fetch-connections``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_datapath
import common
import torch

from kvnet.exchange.config import DEFAULT_VERIFY_WORKERS, MAX_FETCH_CONNECTIONS

STRIPES = (1, 2, 4, 8)
@dataclass(frozen=True)
class Size:
    tokens: int
    runs: int
    kv_shape: str


BIG = Size(tokens=2048, runs=5, kv_shape="llama3-8b")
"""A big host's run: 32 blocks of an 8B Llama-3's KV (~0.27 GB of bf16 per fetch, 256 KiB per layer object,
as a fleet's node moves it; 2 renditions x 4 counts x 5 runs); no round starts past ``BUDGET_S``, so the
whole stays under five minutes."""
BUDGET_S = 180.0
"""Seconds of fetch rounds (after the relays are filled, which a big host does in well under a minute
at the rates measured on 2 cores)."""
QUICK = Size(tokens=1024, runs=5, kv_shape="bench")
"""Small enough for 2 busy cores in about a minute (the test runs it)."""
MAX_RELAY_WORKERS = 8


def relay_workers_for(cores: int, stripes: int) -> int:
    """Relay processes: one per stripe of the largest count, leaving half the cores to the fetching side,
    at most ``MAX_RELAY_WORKERS``; 1 on small hosts."""
    return max(1, min(stripes, cores // 2, MAX_RELAY_WORKERS))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help=f"small sizes ({QUICK.tokens} tokens; the default where CUDA is not available)")
    ap.add_argument("--tokens", type=int, help="prompt length in tokens (whole 64-token blocks)")
    ap.add_argument("--runs", type=int, help="runs per (rendition, stripes); the medians are of these")
    ap.add_argument("--stripes", default=",".join(map(str, STRIPES)), metavar="N,N,...",
                    help=f"session counts, each in [1, {MAX_FETCH_CONNECTIONS}]")
    ap.add_argument("--renditions", default="lossless,plain", metavar="R,R,...")
    ap.add_argument("--kv-shape", choices=sorted(bench_datapath.KV_SHAPES),
                    help="the KV moved (default: llama3-8b on a big host, bench with --quick)")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                    help="where the fetching cache lives (auto: cuda when available)")
    ap.add_argument("--relay-workers", type=int, help="the relay's --workers (default: by cores)")
    ap.add_argument("--verify-workers", type=int, default=DEFAULT_VERIFY_WORKERS,
                    help=f"verify threads per session (default: the node's, {DEFAULT_VERIFY_WORKERS} here)")
    args = ap.parse_args(argv)
    try:
        stripes = [int(n) for n in args.stripes.split(",") if n]
    except ValueError:
        ap.error(f"--stripes takes comma-separated integers, got {args.stripes!r}")
    if not stripes or not 1 <= min(stripes) <= max(stripes) <= MAX_FETCH_CONNECTIONS:
        ap.error(f"--stripes needs session counts in [1, {MAX_FETCH_CONNECTIONS}]")
    renditions = [r for r in args.renditions.split(",") if r]
    cuda = torch.cuda.is_available()
    if args.device == "cuda" and not cuda:
        ap.error("--device cuda: CUDA is not available here")
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and cuda) else "cpu")
    size = QUICK if args.quick or not cuda else BIG
    tokens, runs = args.tokens or size.tokens, args.runs or size.runs
    bench_datapath.kv_shape = args.kv_shape or size.kv_shape
    if tokens < bench_datapath.BLOCK_SIZE or runs < 1:
        ap.error(f"--tokens must be at least {bench_datapath.BLOCK_SIZE} and --runs at least 1")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    relay_workers = args.relay_workers or relay_workers_for(cores, max(stripes))
    where = f"{device.type} ({torch.cuda.get_device_name(device)}; pinned staging)" if device.type == "cuda" \
        else "cpu (the cache's own memory)"
    print(f"device: {where}; cores {cores}; KV shape {bench_datapath.kv_shape}; relay workers "
          f"{relay_workers}; verify workers per session {args.verify_workers}; load {common.load_average()}",
          flush=True)
    started = time.perf_counter()
    figures = bench_datapath.stripes(tokens, runs, stripes, renditions, relay_workers, device,
                                     args.verify_workers, BUDGET_S)
    bench_datapath.print_stripes(figures, runs)
    done, failed = sum(len(f.samples) for f in figures), sum(len(f.failures) for f in figures)
    print(f"{done} fetches complete and verified (signature, chain, token ids, per-layer digests), "
          f"{failed} failed; {time.perf_counter() - started:.0f} s in all")
    return 0 if all(f.samples for f in figures) else 1


if __name__ == "__main__":
    sys.exit(main())
