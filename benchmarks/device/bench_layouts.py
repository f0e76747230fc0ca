"""Save and load of KV blocks between an engine's paged cache and pinned host memory, per KV layout.

For every layout kvnet maps, a paged KV cache is built with exactly that layout's strides (vLLM's six
``KVCacheLayout`` orders for its GPU backends, in bf16 and fp16; the ``vec`` and ``amx`` element orders of
its CPU kernels), filled with random values, and 64 blocks at scattered slots go through kvnet's own
device path (``kvnet.integrations.device_path``):

* save: ``save_blocks`` gathers every layer of each block into pooled host buffers (pinned, through a side
  CUDA stream and an event, when the cache is on a GPU);
* load: ``load_blocks`` writes those host blocks into 64 other slots (a dedicated stream, event-completed).

Each direction is timed over ``--reps`` runs (median; one warm-up run first, which also pins the pool's
buffers) and reported as GB/s of KV moved. ``bit-exact`` says yes only if the loaded slots equal the
source slots in the engine's own view for every layer and, for a cache on a GPU, the host blocks equal
what the same code saves from a CPU copy of the cache and the GPU cache after the load equals the CPU
copy after the same load (every byte, so nothing else was written). The script exits 1 if any row is not
bit-exact.

It needs PyTorch and this checkout, nothing else (no vLLM): ``python benchmarks/device/bench_layouts.py``.
By default the geometry is Llama-3-8B's (32 layers, 8 KV heads of 128; 16-token blocks for the GPU
layouts; 32-token blocks for the CPU kernels' layouts, the smallest ``amx`` takes: vLLM's CPU backend uses
128, but at 128 these host-only rows would take minutes of a GPU host's budget); ``--quick`` (the default
without CUDA) uses a small one so that it runs in seconds on a CPU. Without CUDA the GPU layouts run on
CPU tensors: same code, no streams, and the GB/s are a CPU's.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from kvnet.integrations.cpu_layout import AmxLayout, CpuBlockLayout, VecLayout  # noqa: E402
from kvnet.integrations.device_path import (  # noqa: E402
    BlockLayout,
    HostBlock,
    PinnedPool,
    host_block_shape,
    load_blocks,
    save_blocks,
)
from kvnet.integrations.paged_layout import PagedLayerLayout  # noqa: E402

STRIDE_ORDERS: dict[str, tuple[int, ...]] = {
    # vLLM 0.32's KVCacheLayout: physical order of the logical [L, B, H, N, C] axes; inside a block,
    # tokens before heads is NHD, heads before tokens HND. The B-first ones share one allocation per block.
    "LBNHC": (0, 1, 3, 2, 4), "LBHNC": (0, 1, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4),
    "BLHNC": (1, 0, 2, 3, 4), "BHLNC": (1, 2, 0, 3, 4), "LHBNC": (0, 2, 1, 3, 4),
}
PAGED_DTYPES = (torch.bfloat16, torch.float16)
CPU_KERNELS: tuple[tuple[str, type[CpuBlockLayout], torch.dtype], ...] = (
    ("vec", VecLayout, torch.bfloat16), ("vec", VecLayout, torch.float16), ("vec", VecLayout, torch.float32),
    ("amx", AmxLayout, torch.bfloat16),
)


@dataclass(frozen=True)
class Geometry:
    layers: int
    kv_heads: int
    head_size: int
    gpu_block_size: int
    cpu_block_size: int


FULL = Geometry(layers=32, kv_heads=8, head_size=128, gpu_block_size=16, cpu_block_size=32)  # Llama-3-8B
QUICK = Geometry(layers=4, kv_heads=2, head_size=64, gpu_block_size=16, cpu_block_size=32)


@dataclass
class Row:
    layout: str
    dtype: str
    device: str
    pinned: bool
    blocks: int
    mb: float
    save_gbps: float
    load_gbps: float
    bit_exact: bool
    save_s: list[float]
    load_s: list[float]


@dataclass
class Case:
    """One layout's cache: a backing allocation and the per-layer views the engine would hand over."""

    label: str
    dtype: torch.dtype
    layout: BlockLayout
    backing: torch.Tensor
    layers: list[torch.Tensor]
    views_of: Callable[[torch.Tensor], list[torch.Tensor]]
    """The same per-layer views over another copy of ``backing`` (the CPU reference)."""


def paged_case(name: str, dtype: torch.dtype, geometry: Geometry, num_blocks: int, device: torch.device,
               generator: torch.Generator) -> Case:
    """A whole-model cache in one allocation with ``name``'s strides, each layer a strided
    ``[blocks, heads, block_size, 2 * head_size]`` view, as vLLM allocates and views it."""
    order = STRIDE_ORDERS[name]
    shape = (geometry.layers, num_blocks, geometry.kv_heads, geometry.gpu_block_size, 2 * geometry.head_size)
    strides = [0] * 5
    step = 1
    for axis in reversed(order):
        strides[axis] = step
        step *= shape[axis]
    backing = torch.randn(step, generator=generator).to(dtype).to(device)

    def views_of(flat: torch.Tensor) -> list[torch.Tensor]:
        return [torch.as_strided(flat, shape[1:], strides[1:], layer * strides[0])
                for layer in range(shape[0])]

    layers = views_of(backing)
    view_order = tuple(axis - 1 for axis in order if axis != 0)
    layout = PagedLayerLayout.of(layers[0], view_order, geometry.head_size)
    kind = "NHD" if view_order.index(2) < view_order.index(1) else "HND"
    return Case(f"paged {kind} {name}", dtype, layout, backing, layers, views_of)


def cpu_case(kernel: str, layout_class: type[CpuBlockLayout], dtype: torch.dtype, geometry: Geometry,
             num_blocks: int, generator: torch.Generator) -> Case:
    """One contiguous ``[blocks, heads, block_size, 2 * head_size]`` tensor per layer, as vLLM's CPU backend
    allocates it (in one backing tensor here, so that it can be compared whole)."""
    per_layer = (num_blocks, geometry.kv_heads, geometry.cpu_block_size, 2 * geometry.head_size)
    backing = torch.randn(geometry.layers, *per_layer, generator=generator).to(dtype)

    def views_of(flat: torch.Tensor) -> list[torch.Tensor]:
        return list(flat.unbind(0))

    layers = views_of(backing)
    return Case(f"cpu {kernel}", dtype, layout_class.of(layers[0]), backing, layers, views_of)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(case: Case, blocks: int, reps: int, generator: torch.Generator) -> Row:
    device = case.backing.device
    num_blocks = int(case.layers[0].shape[0])
    slots = torch.randperm(num_blocks, generator=generator).tolist()
    # Scattered pages, as in an engine that has run for a while.
    sources, targets = slots[:blocks], slots[blocks : 2 * blocks]
    shape = host_block_shape(case.layout, len(case.layers))
    pool = PinnedPool(blocks, shape, case.dtype, pin=device.type == "cuda")
    save_times: list[float] = []
    load_times: list[float] = []
    held: list[HostBlock] = []
    for rep in range(reps + 1):  # rep 0 warms up (and pins the pool's buffers)
        for block in held:
            block.release()
        synchronize(device)
        start = time.perf_counter()
        held, saved = save_blocks(case.layout, case.layers, sources, pool)
        saved.wait()
        middle = time.perf_counter()
        load_blocks(case.layout, case.layers, targets, [h.tensor for h in held]).wait()
        end = time.perf_counter()
        if rep:
            save_times.append(middle - start)
            load_times.append(end - middle)
    exact = all(torch.equal(layer[target], layer[source])
                for layer in case.layers for source, target in zip(sources, targets, strict=True))
    if device.type != "cpu":
        exact = exact and matches_cpu_path(case, sources, targets, [h.tensor for h in held])
    for block in held:
        block.release()
    moved = blocks * torch.Size(shape).numel() * case.layers[0].element_size()
    save_s, load_s = statistics.median(save_times), statistics.median(load_times)
    return Row(case.label, str(case.dtype).removeprefix("torch."), device.type, pool.pinned, blocks,
               moved / 1e6, moved / save_s / 1e9, moved / load_s / 1e9, exact, save_times, load_times)


def matches_cpu_path(case: Case, sources: Sequence[int], targets: Sequence[int],
                     device_saved: Sequence[torch.Tensor]) -> bool:
    """The device's saved bytes and its cache after the load equal the CPU path's on a copy of the cache
    (taken after the runs: the load only copied source slots onto target slots, so the copy holds the
    state both paths start from, and repeating the load on it is idempotent)."""
    flat = case.backing.cpu()
    layers = case.views_of(flat)
    pool = PinnedPool(len(sources), host_block_shape(case.layout, len(layers)), case.dtype, pin=False)
    held, saved = save_blocks(case.layout, layers, sources, pool)
    saved.wait()
    same_save = all(torch.equal(a, b.tensor) for a, b in zip(device_saved, held, strict=True))
    load_blocks(case.layout, layers, targets, [h.tensor for h in held]).wait()
    return same_save and torch.equal(flat, case.backing.cpu())


def cases(geometry: Geometry, blocks: int, device: torch.device) -> list[Callable[[torch.Generator], Case]]:
    spare = 2 * blocks + blocks // 4  # slots neither saved from nor loaded into
    makers: list[Callable[[torch.Generator], Case]] = [
        functools.partial(paged_case, name, dtype, geometry, spare, device)
        for name in STRIDE_ORDERS for dtype in PAGED_DTYPES
    ]
    makers += [functools.partial(cpu_case, kernel, layout_class, dtype, geometry, spare)
               for kernel, layout_class, dtype in CPU_KERNELS]
    return makers


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({os.cpu_count()} cores, no CUDA)"


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def table(rows: Sequence[Row]) -> str:
    header = f"{'layout':<18} {'dtype':<9} {'device':<6} {'pinned':<6} {'blocks':>6} {'MB':>8} " \
             f"{'save GB/s':>9} {'load GB/s':>9}  bit-exact"
    lines = [header, "-" * len(header)]
    for r in rows:
        pinned, exact = "yes" if r.pinned else "no", "yes" if r.bit_exact else "NO"
        lines.append(f"{r.layout:<18} {r.dtype:<9} {r.device:<6} {pinned:<6} {r.blocks:>6} "
                     f"{r.mb:>8.1f} {r.save_gbps:>9.2f} {r.load_gbps:>9.2f}  {exact}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true",
                        help="a small geometry (4 layers, 2 KV heads of 64); the default without CUDA")
    parser.add_argument("--reps", type=int, default=5, help="timed runs per direction (at least 5; median)")
    parser.add_argument("--blocks", type=int, default=64, help="blocks saved and loaded per run")
    parser.add_argument("--cpu", action="store_true",
                        help="keep the GPU layouts on CPU tensors even with CUDA")
    parser.add_argument("--json", type=Path, help="also write the rows (every run's seconds) to this file")
    args = parser.parse_args(argv)
    if args.reps < 5:
        parser.error("--reps must be at least 5")
    if args.blocks < 1:
        parser.error("--blocks must be at least 1")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    quick = args.quick or device.type != "cuda"
    geometry = QUICK if quick else FULL
    started, load_before = time.perf_counter(), load_average()
    print(f"device: {device_name(device)}; torch {torch.__version__}; "
          f"CUDA {torch.version.cuda if device.type == 'cuda' else 'not used'}")
    print(f"geometry: {geometry.layers} layers, {geometry.kv_heads} KV heads of {geometry.head_size}, "
          f"blocks of {geometry.gpu_block_size} tokens (paged) / {geometry.cpu_block_size} (cpu kernels)"
          f"{' [--quick]' if quick else ' [Llama-3-8B]'}; {args.blocks} blocks per direction; "
          f"median of {args.reps} runs; load average {load_before}", flush=True)
    rows = []
    generator = torch.Generator().manual_seed(0)
    for make in cases(geometry, args.blocks, device):
        case = make(generator)
        rows.append(measure(case, args.blocks, args.reps, generator))
        del case
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(table(rows))
    print(f"load average {load_before} before, {load_average()} after; {time.perf_counter() - started:.1f} s")
    if args.json:
        args.json.write_text(json.dumps({
            "device": device_name(device), "torch": torch.__version__, "geometry": asdict(geometry),
            "quick": quick, "reps": args.reps, "load_before": load_before, "load_after": load_average(),
            "rows": [asdict(r) for r in rows],
        }, indent=2))
    return 0 if all(r.bit_exact for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
