"""Cost of a relay's block admission check (``relay.admission``): what verifying before caching adds.

For blocks of a given shape (random payloads, a real Ed25519 signature by a trusted key), times
``BlockAdmission.refusal`` per block: one signature check of the manifest plus a digest (BLAKE3) per layer
object. Prints the median of ``--runs`` runs over ``--blocks`` blocks, per block and per MB, and the
load average, so the figure can be weighed against the time the block takes to cross the relay.
Run: ``python benchmarks/bench_admission.py [--layers 32 --block-size 16 --kv-heads 8 --head-dim 128]``.
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import time

from kvnet.security.signing import Signer, TrustStore
from proto.kvobject import BlockManifest, block_track
from relay.admission import BlockAdmission
from relay.cache import CachedObject


def make_block(
    signer: Signer, shape: tuple[int, int, int, int], fingerprint: bytes
) -> tuple[tuple[tuple[bytes, ...], bytes], list[CachedObject]]:
    layers, block_size, heads, dim = shape
    payloads = [secrets.token_bytes(2 * block_size * heads * dim * 2) for _ in range(layers)]  # fp16 K+V
    block_hash = secrets.token_bytes(32)
    manifest = BlockManifest.for_payloads(
        fingerprint=fingerprint,
        block_hash=block_hash,
        parent_hash=secrets.token_bytes(32),
        token_ids=list(range(block_size)),
        block_index=1,
        codec="lossless",
        dtype="float16",
        shape=shape,
        payloads=payloads,
        key_id=signer.key_id,
    )
    manifest = manifest.with_signature(signer.sign_manifest(manifest))
    objects = [CachedObject(0, 0, i, 0, 0, (), p) for i, p in enumerate([manifest.encode(), *payloads])]
    return block_track(fingerprint, "default", block_hash, "lossless"), objects


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--blocks", type=int, default=20)
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    shape = (args.layers, args.block_size, args.kv_heads, args.head_dim)
    signer = Signer.generate()
    trust = TrustStore()
    trust.add(signer.public_key)
    admission = BlockAdmission(trust)
    fingerprint = secrets.token_bytes(32)
    blocks = [make_block(signer, shape, fingerprint) for _ in range(args.blocks)]
    block_bytes = sum(len(o.payload) for o in blocks[0][1])
    per_block: list[float] = []
    for _ in range(args.runs):
        started = time.perf_counter()
        for key, objects in blocks:
            assert admission.refusal(key, objects) is None
        per_block.append((time.perf_counter() - started) / len(blocks))
    median = statistics.median(per_block)
    print(
        f"shape {shape} fp16, {block_bytes / 1e6:.3f} MB per block, {args.blocks} blocks x {args.runs} runs"
    )
    per_mb = median / (block_bytes / 1e6)
    print(f"admission check: median {median * 1e3:.3f} ms per block, {per_mb * 1e3:.3f} ms per MB")
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
