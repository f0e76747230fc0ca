"""How long every command takes to answer ``--help``: what a user waits for a flag mistake to be reported.

Runs ``python -m <module> --help`` of each command (``kvnet-node``, ``kvnet-publisher``,
``kvnet-subscriber``, ``kvnet-relay``, ``kvnet``) ``--runs`` times, interleaved so that load drifts weigh on
every command alike, and prints the median and range of each with the load average before and after, next
to the time of a bare interpreter and of ``import torch`` (what a command that imported it first would add).
Not asserted anywhere (tests/integration/test_cli_startup.py checks that no command imports torch first).
Run: ``python benchmarks/bench_cli.py [--runs 7]``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from benchmarks.common import load_average

COMMANDS = {
    "kvnet-node": ["-m", "kvnet.node.serve", "--help"],
    "kvnet-publisher": ["-m", "publisher", "--help"],
    "kvnet-subscriber": ["-m", "subscriber", "--help"],
    "kvnet-relay": ["-m", "relay", "--help"],
    "kvnet": ["-m", "kvnet.cli", "--help"],
    "(python -c pass)": ["-c", "pass"],
    "(import torch)": ["-c", "import torch"],
}


def time_once(args: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, *args], check=True, stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=7, help="runs per command (interleaved)")
    args = ap.parse_args(argv)
    load_before = load_average()
    for command_args in COMMANDS.values():  # warm the file cache once
        time_once(command_args)
    runs: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(args.runs):
        for name, command_args in COMMANDS.items():
            runs[name].append(time_once(command_args))
    print(f"--help time, median of {args.runs} (min-max), load {load_before} -> {load_average()}")
    for name, times in runs.items():
        print(f"  {name:20s} {statistics.median(times) * 1e3:7.0f} ms ({min(times) * 1e3:.0f}-"
              f"{max(times) * 1e3:.0f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
