"""kvtc decoded where the KV lands: a block's layers entropy-decoded, then inverse-transformed on the device.

A ``kvtc`` payload is decoded in two stages (``TransformCodec.decode_block``): the rANS integers of every
layer of a block on the CPU (the coder, ``constriction``, holds Python's GIL, so one core per process),
then, layer by layer on the device the KV lands on, the coefficients rotated back out of the PCA basis and
added to what the layer before (as decoded there) predicts. This script measures both on a GPU host, side
by side with the same decode on the CPU, and checks that the device decodes what the CPU decodes.

The KV is synthetic (a decaying spectrum over the channels, as K/V have, each layer's factors carried on
from the layer before's as a residual stream carries them, K rotated by its positions as RoPE rotates it,
plus noise; no model is needed), in two geometries with CUDA: Llama-3-8B's for the speed (its layers
not predicted: ``FULL`` says why) and SmolLM2's, every layer after the first predicted, for the chain.
Tables are calibrated on one stretch of it and the blocks of another (4) are encoded, off the timed
part; each device then decodes every block ``--reps`` times (median; one warm-up pass first, which also
moves the tables to the device). The table gives, per device: raw KV MB, coded MB and the ratio, the
encode MB/s (CPU, once), decode MB/s of raw KV, the decoded KV's RMS error relative to the original's,
and how far it is from the CPU's decode. A GPU's float32 matmul may round a value's last bit otherwise,
and a layer predicted from a value one bf16 ulp off carries that on (the encoder corrects its own
quantization error, not another device's rounding), so the check is per layer: the RMS of the device's
difference from the CPU's decode within ``DRIFT_LIMIT`` of the codec's own error there (``drift``: the
worst layer's ratio). The script exits 1 if a device's decode is not.

The entropy stage runs on the host's cores, not the GPU, and its coder holds the GIL; a node runs it in
worker processes (``--kvtc-decode-processes``, kvnet.blocks.kvtc_entropy). A second table gives it alone
over the first geometry's blocks: in the calling thread, and on 1 and ``--processes`` processes (default:
a node's, one per core up to 8), each fed by a thread of its own, as a node's fetch feeds them.

    python benchmarks/device/bench_kvtc.py            # Llama-3-8B's and SmolLM2's geometries (with CUDA)
    python benchmarks/device/bench_kvtc.py --quick    # small, seconds on a CPU (the default without)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
for path in (REPO, REPO / "benchmarks", REPO / "benchmarks" / "device"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from bench_layouts import device_name, synchronize  # noqa: E402
from common import load_average  # noqa: E402

from kvnet.blocks.kvtc_entropy import MAX_DECODE_PROCESSES, EntropyProcesses  # noqa: E402
from kvnet.blocks.transform_codec import TransformCodec  # noqa: E402
from kvnet.blocks.transform_tables import TransformTables, calibrate  # noqa: E402
from kvnet.exchange.config import auto_kvtc_decode_processes  # noqa: E402
from kvnet.model.transformer import ModelArgs, apply_rope, rope_cos_sin, rope_inv_freq  # noqa: E402

REL_STEP = 0.12
"""``kvnet kvtc calibrate``'s default step."""
DRIFT_LIMIT = 0.1
"""Most RMS difference from the CPU's decode, per layer, as a fraction of the codec's own RMS error there:
SmolLM2's chain carried a one-ulp rounding difference in an eighth of layer 0's values to 0.8% of the
values' RMS by layer 29, against its coding error of 21% (it does not grow: each layer's own bf16 rounding
bounds it), a ratio of 0.04."""
ROPE_THETA = 500000.0
"""Llama-3's rotary base, for the synthetic K's rotation."""
FINGERPRINT = hashlib.sha256(b"kvnet bench_kvtc synthetic model").digest()


@dataclass(frozen=True)
class Geometry:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    block_tokens: int
    blocks: int
    calibration_tokens: int

    @property
    def model_args(self) -> ModelArgs:
        """The synthetic model's shape as the project's models describe theirs (one query head per KV head;
        Llama-3's rotary base), for the project's own RoPE."""
        return ModelArgs(dim=self.kv_heads * self.head_dim, n_layers=self.layers, n_heads=self.kv_heads,
                         n_kv_heads=self.kv_heads, intermediate_size=1, rope_theta=ROPE_THETA)


FULL = Geometry("Llama-3-8B", layers=32, kv_heads=8, head_dim=128, block_tokens=64, blocks=4,
                calibration_tokens=2048)
"""Llama-3-8B's KV: 8.4 MB of bf16 per 64-token block; 4 blocks, so that a GPU host's run fits its share
of ``run.py``'s budget. Its layers are not predicted: predictors for 2 x 1024 channels need 16,448
calibration tokens (here 700 CPU seconds and 13 GB, far past that share) and would be 537 MB, beyond a
tables object's bound; ``CHAIN`` checks the prediction chain on the device instead."""
CHAIN = Geometry("SmolLM2", layers=30, kv_heads=3, head_dim=64, block_tokens=64, blocks=4,
                 calibration_tokens=3136)
"""SmolLM2's KV, every layer after the first predicted from the one before (8 calibration tokens per
feature): the chain a device decodes in layer order, and how far its rounding carries."""
QUICK = Geometry("quick", layers=4, kv_heads=2, head_dim=64, block_tokens=64, blocks=4,
                 calibration_tokens=2112)
"""Seconds on a CPU; predicted like ``CHAIN``."""


@dataclass
class Row:
    geometry: str
    device: str
    blocks: int
    raw_mb: float
    coded_mb: float
    ratio: float
    encode_mb_s: float
    decode_mb_s: float
    rel_rms_error: float
    predicted: bool
    """The tables predict every layer after the first from the one before."""
    drift: float
    """Worst layer's RMS difference from the CPU's decode over the codec's own RMS error there."""
    same_as_cpu: bool
    decode_s: list[float]


@dataclass
class EntropyRow:
    geometry: str
    processes: int
    """0: in the calling thread; else that many processes, each fed by a thread."""
    mb_s: float
    """Raw KV of the blocks entropy-decoded per second (median)."""
    decode_s: list[float]


def synthetic_kv(geometry: Geometry, tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[L, tokens, H, D]`` (float32) of positions ``0 .. tokens - 1``: every channel a mix of
    latent factors whose strengths fall as 1/sqrt(rank) (the mixing fixed per layer, as a model's
    projections are), each layer's factors mostly the layer before's (a residual stream), plus noise, K
    rotated by its positions; proportioned so that at ``REL_STEP`` it codes about as small as SmolLM2's
    real blocks, since the entropy decode's speed goes with the bits."""
    c = geometry.kv_heads * geometry.head_dim
    factors = c // 2
    mix = torch.randn(geometry.layers, 2, factors, c, generator=torch.Generator().manual_seed(1))
    strength = torch.arange(1, factors + 1, dtype=torch.float32).rsqrt()
    g = torch.Generator().manual_seed(seed)
    latent = torch.randn(2, tokens, factors, generator=g)
    layers = []
    for layer in range(geometry.layers):
        latent = 0.8 * latent + 0.6 * torch.randn(2, tokens, factors, generator=g)
        layers.append((latent * strength) @ mix[layer] / factors ** 0.5 +
                      0.1 * torch.randn(2, tokens, c, generator=g))
    x = torch.stack(layers).view(geometry.layers, 2, tokens, geometry.kv_heads, geometry.head_dim)
    cos, sin = rope_cos_sin(geometry.model_args, torch.arange(tokens))
    k = torch.stack([apply_rope(x[layer, 0], cos, sin) for layer in range(geometry.layers)])
    return k, x[:, 1].contiguous()


def decode_all(codec: TransformCodec, payloads: Sequence[list[bytes]], shape: tuple[int, int, int],
               device: torch.device) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    out = [codec.decode_block(block, shape, torch.bfloat16, device) for block in payloads]
    synchronize(device)
    return out


def drift(decoded: torch.Tensor, reference: torch.Tensor, original: torch.Tensor) -> float:
    """The worst layer's RMS difference between two decodes ``[2, L, N, H, D]`` (float32), over the RMS
    of the reference's own error from the original there."""
    dims = (0, 2, 3, 4)
    apart = (decoded - reference).pow(2).mean(dims).sqrt()
    error = (reference - original).pow(2).mean(dims).sqrt().clamp(min=1e-12)
    return float((apart / error).max())


def measure(codec: TransformCodec, tables: TransformTables, k: torch.Tensor, v: torch.Tensor,
            geometry: Geometry, devices: Sequence[torch.device], reps: int
            ) -> tuple[list[Row], list[list[bytes]]]:
    t = geometry.block_tokens
    shape = (t, geometry.kv_heads, geometry.head_dim)
    kb, vb = k.to(torch.bfloat16), v.to(torch.bfloat16)
    started = time.perf_counter()
    payloads = [codec.encode_block(kb[:, i * t:(i + 1) * t], vb[:, i * t:(i + 1) * t], tables,
                                   sink_rows=1 if i == 0 else 0, first_position=i * t)
                for i in range(geometry.blocks)]
    encode_s = time.perf_counter() - started
    raw = 2 * kb.numel() * kb.element_size()
    coded = sum(len(p) for block in payloads for p in block)
    original = torch.stack((kb, vb)).float()
    rows: list[Row] = []
    reference: torch.Tensor | None = None
    for device in devices:
        decoded = decode_all(codec, payloads, shape, device)  # warm-up: tables onto the device
        times = []
        for _ in range(reps):
            started = time.perf_counter()
            decoded = decode_all(codec, payloads, shape, device)
            times.append(time.perf_counter() - started)
        result = torch.stack([torch.stack([torch.cat([block[layer][kind].cpu() for block in decoded])
                                           for layer in range(geometry.layers)])
                              for kind in range(2)]).float()
        if reference is None:  # the CPU's decode, the first device's: the others are checked against it
            reference = result
        apart = drift(result, reference, original)
        error = float((result - original).pow(2).mean().sqrt() / original.pow(2).mean().sqrt())
        seconds = statistics.median(times)
        rows.append(Row(geometry.name, device.type, geometry.blocks, raw / 1e6, coded / 1e6, raw / coded,
                        raw / encode_s / 1e6, raw / seconds / 1e6, error, all(tables.predicted_layers[1:]),
                        apart, apart <= DRIFT_LIMIT, times))
    return rows, payloads


def entropy_rates(tables: TransformTables, payloads: Sequence[list[bytes]], geometry: Geometry,
                  counts: Sequence[int], reps: int) -> list[EntropyRow]:
    """The entropy stage alone (``parse_layers`` of every block, all of them at once) per process count."""
    shape = (geometry.block_tokens, geometry.kv_heads, geometry.head_dim)
    raw = geometry.blocks * 2 * geometry.layers * geometry.block_tokens * geometry.kv_heads * \
        geometry.head_dim * 2
    rows = []
    for count in counts:
        entropy = EntropyProcesses(count) if count else None
        try:
            if entropy is not None:
                entropy.wait_started(timeout=120)
            codec = TransformCodec(FINGERPRINT, entropy=entropy)
            codec.install(tables)
            with ThreadPoolExecutor(max(count, 1)) as threads:
                _parse_all(threads, codec, payloads, shape)  # warm-up
                times = []
                for _ in range(reps):
                    started = time.perf_counter()
                    _parse_all(threads, codec, payloads, shape)
                    times.append(time.perf_counter() - started)
        finally:
            if entropy is not None:
                entropy.close()
        rows.append(EntropyRow(geometry.name, count, raw / statistics.median(times) / 1e6, times))
    return rows


def _parse_all(threads: ThreadPoolExecutor, codec: TransformCodec, payloads: Sequence[list[bytes]],
               shape: tuple[int, int, int]) -> None:
    list(threads.map(lambda block: codec.parse_layers(block, shape, torch.bfloat16), payloads))


def entropy_table(rows: Sequence[EntropyRow]) -> str:
    header = f"{'geometry':<10} {'entropy stage on':<28} {'MB/s of raw KV':>14} {'x thread':>8}"
    lines = [header, "-" * len(header)]
    for r in rows:
        where = "the calling thread" if r.processes == 0 else f"{r.processes} process(es), a thread each"
        lines.append(f"{r.geometry:<10} {where:<28} {r.mb_s:>14.1f} {r.mb_s / rows[0].mb_s:>8.2f}")
    return "\n".join(lines)


def table(rows: Sequence[Row]) -> str:
    header = f"{'geometry':<10} {'predicted':>9} {'decoded on':<10} {'blocks':>6} {'raw MB':>8} " \
             f"{'coded MB':>8} {'ratio':>6} {'encode MB/s':>11} {'decode MB/s':>11} {'rel RMS err':>11} " \
             f"{'drift':>7}  same as CPU"
    lines = [header, "-" * len(header)]
    for r in rows:
        same = "(reference)" if r.device == "cpu" else "yes" if r.same_as_cpu else "NO"
        lines.append(f"{r.geometry:<10} {'yes' if r.predicted else 'no':>9} {r.device:<10} {r.blocks:>6} "
                     f"{r.raw_mb:>8.1f} {r.coded_mb:>8.2f} {r.ratio:>6.2f} {r.encode_mb_s:>11.1f} "
                     f"{r.decode_mb_s:>11.1f} {r.rel_rms_error:>11.4f} {r.drift:>7.4f}  {same}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true",
                        help="a small geometry (4 layers, 2 KV heads of 64, 4 blocks); the default "
                             "without CUDA")
    parser.add_argument("--reps", type=int, default=3,
                        help="timed decodes of every block per device (median)")
    parser.add_argument("--cpu", action="store_true", help="decode on the CPU only, even with CUDA")
    parser.add_argument("--json", type=Path, help="also write the rows (every run's seconds) to this file")
    parser.add_argument("--processes", type=int, default=auto_kvtc_decode_processes(),
                        help="entropy processes of the second table's last row (default: a node's, one per "
                             "core up to 8)")
    args = parser.parse_args(argv)
    if args.reps < 3:
        parser.error(f"--reps must be at least 3, got {args.reps}")
    if not 1 <= args.processes <= MAX_DECODE_PROCESSES:
        parser.error(f"--processes must be in [1, {MAX_DECODE_PROCESSES}], got {args.processes}")
    devices = [torch.device("cpu")]
    if torch.cuda.is_available() and not args.cpu:
        devices.append(torch.device("cuda"))
    quick = args.quick or len(devices) == 1
    geometries = (QUICK,) if quick else (FULL, CHAIN)
    load_before = load_average()
    started = time.perf_counter()
    print(f"device: {device_name(devices[-1])}; torch {torch.__version__}; "
          f"CUDA {torch.version.cuda if devices[-1].type == 'cuda' else 'not used'}")
    rows: list[Row] = []
    entropy: list[EntropyRow] = []
    for geometry in geometries:
        print(f"geometry {geometry.name}: {geometry.layers} layers, {geometry.kv_heads} KV heads of "
              f"{geometry.head_dim}, {geometry.blocks} blocks of {geometry.block_tokens} tokens, bf16; "
              f"tables calibrated on {geometry.calibration_tokens} other tokens at rel step {REL_STEP}; "
              f"median of {args.reps} runs; load average {load_average()}", flush=True)
        tables = calibrate(*synthetic_kv(geometry, geometry.calibration_tokens, seed=2), FINGERPRINT,
                           REL_STEP, rope_inv_freq=rope_inv_freq(geometry.model_args, torch.device("cpu")),
                           cache_dtype=torch.bfloat16)
        if geometry is not FULL and not all(tables.predicted_layers[1:]):
            raise SystemExit(f"bench_kvtc: the {geometry.name} tables predict no layer (too few tokens)")
        codec = TransformCodec(FINGERPRINT)
        TransformCodec.prepare(tables)
        k, v = synthetic_kv(geometry, geometry.blocks * geometry.block_tokens, seed=3)
        measured, payloads = measure(codec, tables, k, v, geometry, devices, args.reps)
        rows += measured
        if not entropy:  # the first geometry's blocks: Llama-3-8B's with CUDA
            entropy = entropy_rates(tables, payloads, geometry, sorted({0, 1, args.processes}), args.reps)
    print(table(rows))
    print(entropy_table(entropy))
    print(f"load average {load_before} before, {load_average()} after; {time.perf_counter() - started:.1f} s")
    if args.json:
        args.json.write_text(json.dumps({
            "device": device_name(devices[-1]), "torch": torch.__version__,
            "geometries": [asdict(g) for g in geometries], "quick": quick, "reps": args.reps,
            "rel_step": REL_STEP, "load_before": load_before, "load_after": load_average(),
            "rows": [asdict(r) for r in rows], "entropy": [asdict(r) for r in entropy],
        }, indent=2))
    return 0 if all(r.same_as_cpu for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
