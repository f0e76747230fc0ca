"""The device check: every figure a GPU host gives kvnet, in one run of under ten minutes.

Runs, one after the other, with the host's own defaults (full sizes with CUDA, ``--quick`` without):

1. ``bench_layouts.py`` — save and load of 64 blocks per KV layout between a paged cache on the device and
   pinned host memory through kvnet's device path, GB/s per direction, bit-exact against the CPU path;
2. ``bench_stripes.py`` — a verified fetch from a relay's cache over QMux striped over 1, 2, 4 and 8
   sessions into a cache on the device, aggregate GB/s and CPU per MB;
3. ``bench_kvtc.py`` — ``kvtc`` blocks decoded on the device (entropy decode on the CPU, inverse transform
   on the GPU) beside the same decode on the CPU, MB/s of KV, and the device's decode checked against the
   CPU's; then the entropy stage alone on the host's cores (in one thread, on 1 and on a node's number of
   worker processes).

It prints the host (GPU, cores, torch and CUDA versions) once, then each script's table as it prints
it, and exits non-zero if any failed (a row not bit-exact, a fetch not verified, a decode unlike the
CPU's). Each script has a deadline (``--budget`` seconds in all, split between them); one that runs past
it is stopped and reported as such.

    python benchmarks/device/run.py            # on the GPU host
    python benchmarks/device/run.py --quick    # anywhere, small sizes (what the test runs)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = (("bench_layouts.py", 0.3), ("bench_stripes.py", 0.55), ("bench_kvtc.py", 0.15))
"""Each script and its share of the budget (the striped fetch starts relays and moves more bytes)."""


def describe_host() -> str:
    import torch  # here, so that --help answers without it

    lines = [f"cores {os.cpu_count()}, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
             f"torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}"]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"GPU {i}: {p.name}, {p.total_memory / 2**30:.0f} GiB")
    else:
        lines.append("no CUDA device: every script runs its --quick size on CPU tensors")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes on any host (each script's --quick)")
    ap.add_argument("--budget", type=float, default=540.0, help="seconds for all the scripts together")
    args = ap.parse_args(argv)
    if args.budget <= 0:
        ap.error(f"--budget must be positive, got {args.budget}")
    print(describe_host(), flush=True)
    failed: list[str] = []
    for script, share in SCRIPTS:
        cmd = [sys.executable, str(HERE / script), *(["--quick"] if args.quick else [])]
        print(f"\n== {script}{' --quick' if args.quick else ''}", flush=True)
        started = time.monotonic()
        try:
            done = subprocess.run(cmd, timeout=args.budget * share)
        except subprocess.TimeoutExpired:
            print(f"{script}: stopped after {args.budget * share:.0f} s (its share of --budget)", flush=True)
            failed.append(script)
            continue
        print(f"({script}: {time.monotonic() - started:.0f} s, exit {done.returncode})", flush=True)
        if done.returncode != 0:
            failed.append(script)
    if failed:
        print(f"\nfailed: {', '.join(failed)}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
