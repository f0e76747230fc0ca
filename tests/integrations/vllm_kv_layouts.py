"""vLLM's own description of its GPU KV cache layouts: ``python vllm_kv_layouts.py OUT.json``.

Runs in the vLLM environment (``scripts/setup-vllm``) and imports nothing from kvnet. For every member of
``vllm.v1.kv_cache_layout.KVCacheLayout`` it records the stride order, the per-layer view order and,
for a full-attention layer spec in bf16, fp16 and fp8, the byte strides of ``[L, B, H, N, C]`` and the
per-layer logical shape in bytes that vLLM allocates with (``compute_layout_strides``,
``compute_layer_kv_cache_shape_bytes``). It also records which layouts the GPU backends that import on a
CPU build declare (``supported_kv_cache_layouts``: None means any) and their names (``get_name``), why
the others do not import, and the values vLLM takes for its platform (``PlatformEnum``) and KV cache dtype
(``CacheDType``).
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any, get_args

GEOMETRY = {"num_layers": 3, "num_blocks": 4, "num_kv_heads": 2, "block_size": 16, "head_size": 8}
BACKENDS = {
    "FLASH_ATTN": ("vllm.v1.attention.backends.flash_attn", "FlashAttentionBackend"),
    "TRITON_ATTN": ("vllm.v1.attention.backends.triton_attn", "TritonAttentionBackend"),
    "FLASHINFER": ("vllm.v1.attention.backends.flashinfer", "FlashInferBackend"),
}


def main(out: Path) -> None:
    import torch
    from vllm.config.cache import CacheDType
    from vllm.platforms.interface import PlatformEnum
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        compute_layer_kv_cache_shape_bytes,
        compute_layout_strides,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    g = GEOMETRY
    layouts: dict[str, Any] = {}
    for layout in KVCacheLayout:
        entry: dict[str, Any] = {
            "stride_order": list(layout.stride_order), "layer_view_order": list(layout.layer_view_order),
            "is_block_contiguous": layout.is_block_contiguous, "dtypes": {},
        }
        for name in ("bfloat16", "float16", "float8_e4m3fn"):
            spec = FullAttentionSpec(
                block_size=g["block_size"], num_kv_heads=g["num_kv_heads"], head_size=g["head_size"],
                dtype=getattr(torch, name),
            )
            entry["dtypes"][name] = {
                "byte_strides": list(compute_layout_strides(spec, g["num_blocks"], g["num_layers"], layout)),
                "shape_bytes": list(compute_layer_kv_cache_shape_bytes(spec, g["num_blocks"])),
            }
        layouts[layout.name] = entry
    backends: dict[str, Any] = {}
    for name, (module, cls) in BACKENDS.items():
        try:
            backend = getattr(importlib.import_module(module), cls)
        except Exception as exc:  # FlashInfer needs its own package, absent from the CPU build
            backends[name] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
            continue
        try:
            supported = backend.supported_kv_cache_layouts()
        except Exception as exc:  # some ask the (absent) GPU for its capability
            backends[name] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
            continue
        backends[name] = {
            "name": backend.get_name(),
            "layouts": None if supported is None else [layout.name for layout in supported],
        }
    described = {
        "geometry": g, "layouts": layouts, "backends": backends, "cache_dtypes": list(get_args(CacheDType)),
        "platforms": [platform.name.lower() for platform in PlatformEnum],
    }
    out.write_text(json.dumps(described, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
