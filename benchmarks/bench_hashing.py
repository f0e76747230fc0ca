"""Block-hashing throughput: ns per token of ``kvnet.cache.hashing.block_hashes``.

Hashes a 100k-token prompt for block sizes 16, 64 and 256 and prints the median of 5 runs per size,
plus the time for the whole prompt. Run: ``python benchmarks/bench_hashing.py [--tokens N] [--runs R]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kvnet.cache.hashing import block_hashes, canonical_fingerprint, root_hash

BLOCK_SIZES = (16, 64, 256)


def time_block_hashes(token_ids: np.ndarray, block_size: int, root: bytes, runs: int) -> list[float]:
    """Wall-clock seconds of ``runs`` calls of ``block_hashes`` on the same prompt."""
    durations = []
    for _ in range(runs):
        start = time.perf_counter()
        block_hashes(token_ids, block_size, root)
        durations.append(time.perf_counter() - start)
    return durations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=100_000, help="prompt length in tokens")
    parser.add_argument("--runs", type=int, default=5, help="runs per block size (median reported)")
    args = parser.parse_args()

    root = root_hash(canonical_fingerprint({"model": "bench", "block_size": 0}))
    token_ids = np.random.default_rng(0).integers(0, 128_000, size=args.tokens, dtype=np.int64)
    as_list = token_ids.tolist()
    print(f"block_hashes over {args.tokens} tokens, median of {args.runs} runs")
    print(f"{'block_size':>10} {'input':>6} {'ns/token':>9} {'ms/prompt':>10}")
    for block_size in BLOCK_SIZES:
        for label, tokens in (("numpy", token_ids), ("list", as_list)):
            median = statistics.median(time_block_hashes(tokens, block_size, root, args.runs))
            print(f"{block_size:>10} {label:>6} {median * 1e9 / args.tokens:>9.1f} {median * 1e3:>10.2f}")


if __name__ == "__main__":
    main()
