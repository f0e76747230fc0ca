"""Blocks written by vLLM's own CPU cache-write op: ``python vllm_cache_write.py CASES.json OUT.pt``.

Runs in the vLLM environment (``scripts/setup-vllm``) and imports nothing from kvnet, so what it writes is
vLLM's layout and not kvnet's idea of it. CASES is a list of ``{"kernel", "block_size", "head_size",
"dtype"}``. For each case it fills random keys and values ``[tokens, kv_heads, head_size]`` into a zeroed
per-layer tensor ``[num_blocks, kv_heads, block_size, 2 * head_size]`` through
``ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slot_mapping, kernel)``, with the key and
value halves split exactly as vLLM's CPU attention backend splits them, and saves the inputs and the tensor
(or, when this CPU's build of vLLM cannot run that kernel's op, its one-line error).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

NUM_BLOCKS, KV_HEADS = 4, 3
BLOCK_ORDER = (2, 0, 3)
"""Engine blocks the tokens fill, in order (not ascending, so a block id mix-up shows); block 1 stays zero."""


def write_case(kernel: str, block_size: int, head_size: int, dtype_name: str, seed: int) -> dict[str, Any]:
    import torch
    from vllm import _custom_ops as ops

    dtype = getattr(torch, dtype_name)
    generator = torch.Generator().manual_seed(seed)
    tokens = len(BLOCK_ORDER) * block_size
    shape = (tokens, KV_HEADS, head_size)
    k = torch.randn(shape, generator=generator).to(dtype)
    v = torch.randn(shape, generator=generator).to(dtype)
    slots = [block * block_size + offset for block in BLOCK_ORDER for offset in range(block_size)]
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    cache = torch.zeros(NUM_BLOCKS, KV_HEADS, block_size, 2 * head_size, dtype=dtype)
    # As vLLM's CPU backend does: view [blocks, heads, 2 * block_size, head_size], halves along dim 2.
    key_cache, value_cache = cache.view(NUM_BLOCKS, KV_HEADS, 2 * block_size, head_size).chunk(2, dim=2)
    case: dict[str, Any] = {
        "kernel": kernel, "block_size": block_size, "head_size": head_size, "dtype": dtype_name,
    }
    try:
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slot_mapping, kernel)
    except RuntimeError as exc:
        case["error"] = str(exc).splitlines()[0]
        return case
    case.update(k=k, v=v, block_order=list(BLOCK_ORDER), cache=cache)
    return case


def main(cases_path: Path, out: Path) -> None:
    import torch
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # the build of vLLM's ops this CPU runs (AVX2 or AVX-512)
    cases = json.loads(cases_path.read_text())
    written = [
        write_case(case["kernel"], case["block_size"], case["head_size"], case["dtype"], seed)
        for seed, case in enumerate(cases, start=1)
    ]
    torch.save(written, out)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
