"""The connector's CUDA route, run on CPU tensors: ``python vllm_device_route.py HOME OUT.json``.

Runs in the vLLM environment with the checkout on ``PYTHONPATH``. For every ``KVCacheLayout`` of vLLM and
bf16 and fp16 it allocates a cache with the strides vLLM computes (``compute_layout_strides``), gives its
per-layer views to the connector as a CUDA worker would (``register_kv_caches``, with vLLM's resolved
layout), saves two blocks through ``wait_for_save`` and loads a fetched block through the fetch's
``CacheWriter`` calls, and compares both with a gather and a scatter at the flat offsets written here. It
also asks the connector's start-up check for vLLM's other platforms and for CUDA engines it must refuse,
and registers layers whose backend is not the one announced. Writes what it saw to OUT.json for the test.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

GEOMETRY = {"num_layers": 3, "num_blocks": 4, "num_kv_heads": 2, "block_size": 16, "head_size": 8}


def reference_offsets(strides: list[int], layer: int, block: int) -> tuple[Any, Any]:
    """Flat element offsets of K[n, h, d] and V[n, h, d] of one block, in canonical order."""
    import torch

    g = GEOMETRY
    s_l, s_b, s_h, s_n, s_c = strides
    n = torch.arange(g["block_size"]).view(-1, 1, 1)
    h = torch.arange(g["num_kv_heads"]).view(1, -1, 1)
    d = torch.arange(g["head_size"]).view(1, 1, -1)
    base = layer * s_l + block * s_b + h * s_h + n * s_n
    return (base + d * s_c).reshape(-1), (base + (g["head_size"] + d) * s_c).reshape(-1)


def connector_settings(home: Path) -> Any:
    """The worker's settings: a relay that never answers (saves are captured before publishing)."""
    from kvnet.integrations.config import ConnectorConfig
    from kvnet.security import certs

    ca = certs.create_ca(home / "ca", overwrite=True).cert
    return ConnectorConfig.from_extra_config(
        {"relay": "moqt://127.0.0.1:9", "ca": str(ca), "key_dir": str(home / "keys")}, str(home)
    )


def route(home: Path, layout_name: str, dtype_name: str) -> dict[str, Any]:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, compute_layout_strides
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from kvnet.blocks.identity import BlockIdentity
    from kvnet.integrations import vllm as connector
    g, dtype = GEOMETRY, getattr(torch, dtype_name)
    layout = KVCacheLayout[layout_name]
    spec = FullAttentionSpec(block_size=g["block_size"], num_kv_heads=g["num_kv_heads"],
                             head_size=g["head_size"], dtype=dtype)
    size = torch.tensor([], dtype=dtype).element_size()
    byte_strides = compute_layout_strides(spec, g["num_blocks"], g["num_layers"], layout)
    strides = [s // size for s in byte_strides[:4]] + [1]
    shape = (g["num_blocks"], g["num_kv_heads"], g["block_size"], 2 * g["head_size"])
    numel = g["num_layers"] * g["num_blocks"] * g["num_kv_heads"] * g["block_size"] * 2 * g["head_size"]
    flat = torch.randn(numel, generator=torch.Generator().manual_seed(7)).to(dtype)
    original = flat.clone()
    kv_caches = {
        f"model.layers.{i}.self_attn.attn": torch.as_strided(flat, shape, strides[1:], i * strides[0])
        for i in range(g["num_layers"])
    }

    settings = connector_settings(home)
    block_shape = (g["num_layers"], g["block_size"], g["num_kv_heads"], g["head_size"])
    identity = connector.EngineIdentity(
        b"f" * 32, b"r" * 32, "tenant", block_shape, dtype_name, "FLASH_ATTN",
        {"kv_layout": "cuda/FLASH_ATTN"}, "cuda",
    )
    worker = connector._WorkerSide(settings, identity, None)
    captured: list[tuple[Any, Any, BlockIdentity]] = []

    async def publish(copies: list[tuple[Any, Any, BlockIdentity]]) -> None:
        captured.extend((k.clone(), v.clone(), source) for k, v, source in copies)

    worker._publish = publish  # type: ignore[method-assign]
    # The connector as vLLM's worker holds it: its hooks, vLLM's resolved layout, the backend of its layers
    # (which needs a GPU to ask, so it is given here).
    hooks = object.__new__(connector.KvnetConnector)
    hooks._worker, hooks._scheduler = worker, None
    hooks._vllm_config = types.SimpleNamespace(
        cache_config=types.SimpleNamespace(get_resolved_kv_cache_layout=lambda: layout)
    )
    connector.attention_backend = lambda config: "FLASH_ATTN"  # type: ignore[assignment]
    try:
        hooks.register_kv_caches(kv_caches)
        routed = worker.save_pool is not None and worker.cache.staged is not None

        def ident(index: int) -> BlockIdentity:
            return BlockIdentity(bytes([index]) * 32, b"p" * 32, tuple(range(g["block_size"])), index)

        hooks.bind_connector_metadata(
            connector.KvnetConnectorMetadata(saves=[connector.SaveJob("r1", (3, 1), (ident(3), ident(1)))])
        )
        hooks.wait_for_save()
        for future in worker.backlog.pending():
            future.result(timeout=60)
        saved_ok = len(captured) == 2 and worker.save_pool is not None and worker.save_pool.in_use == 0
        for (k, v, source), block in zip(captured, (3, 1), strict=True):
            saved_ok &= source.block_index == block
            for layer in range(g["num_layers"]):
                keys, values = reference_offsets(strides, layer, block)
                saved_ok &= torch.equal(k[layer].reshape(-1), original[keys])
                saved_ok &= torch.equal(v[layer].reshape(-1), original[values])

        # A fetched block (here: the saved block 3) loaded into engine blocks 0 and 2, layer by layer.
        job = connector.LoadJob("r2", (0, 2), (ident(3), ident(3)), ("lossless", "lossless"))
        hashes = [identity.block_hash for identity in job.expected]
        worker.cache.register(hashes, job.block_ids)
        k3, v3, _ = captured[0]
        assert worker.cache.begin_import(ident(3).block_hash)
        for layer in range(g["num_layers"]):
            worker.cache.import_layer(ident(3).block_hash, layer, k3[layer], v3[layer])
        worker.cache.finish_import(ident(3).block_hash)
        assert worker.cache.staged is not None
        worker.cache.staged.wait(job.block_ids)
        worker.cache.unregister(hashes, job.block_ids)
        expected = original.clone()
        for layer in range(g["num_layers"]):
            keys, values = reference_offsets(strides, layer, 3)
            for target in (0, 2):
                to_keys, to_values = reference_offsets(strides, layer, target)
                expected[to_keys] = original[keys]
                expected[to_values] = original[values]
        loaded_ok = torch.equal(flat, expected) and worker.cache.staged.pool.in_use == 0
    finally:
        worker.loop.stop(worker.link.close(), timeout=5.0)
    return {"routed": routed, "saved": bool(saved_ok), "loaded": bool(loaded_ok)}


def backend_mismatch(home: Path) -> str:
    """What the worker says when its layers use another backend than the engine announced."""
    import torch

    from kvnet.integrations import vllm as connector
    from kvnet.integrations.config import ConfigError

    g = GEOMETRY
    block_shape = (g["num_layers"], g["block_size"], g["num_kv_heads"], g["head_size"])
    identity = connector.EngineIdentity(
        b"f" * 32, b"r" * 32, "tenant", block_shape, "bfloat16", "FLASH_ATTN",
        {"kv_layout": "cuda/FLASH_ATTN"}, "cuda",
    )
    worker = connector._WorkerSide(connector_settings(home), identity, None)
    hooks = object.__new__(connector.KvnetConnector)
    hooks._worker, hooks._scheduler, hooks._vllm_config = worker, None, None
    connector.attention_backend = lambda config: "TRITON_ATTN"  # type: ignore[assignment]
    try:
        hooks.register_kv_caches({"layer.0": torch.zeros(1)})
    except ConfigError as exc:
        return str(exc)
    finally:
        worker.loop.stop(worker.link.close(), timeout=5.0)
    return "accepted"


def refusals(home: Path) -> dict[str, str]:
    """The connector's start-up verdict on each of vLLM's platforms but cpu, and on CUDA engines it must
    refuse: an fp8 cache, tensor parallelism, MLA, a hybrid model, a backend it does not map."""
    import torch
    import vllm.platforms
    from vllm.platforms.interface import Platform, PlatformEnum

    from kvnet.integrations import vllm as connector
    from kvnet.integrations import vllm_identity
    from kvnet.integrations.config import ConfigError

    settings = connector_settings(home)
    # The backend vLLM would pick needs a GPU to ask; this one is not mapped by kvnet. The start-up
    # checks (``vllm_identity.engine_identity``) ask through their own module's name.
    vllm_identity.attention_backend = lambda config: "FLEX_ATTENTION"  # type: ignore[assignment]
    cases: list[tuple[str, Any, dict[str, Any]]] = [
        (p.name.lower(), p, {}) for p in PlatformEnum if p != PlatformEnum.CPU
    ] + [
        ("cuda/fp8", PlatformEnum.CUDA, {"cache_dtype": "fp8_e4m3"}),
        ("cuda/pp2", PlatformEnum.CUDA, {"pipeline_parallel_size": 2}),
        ("cuda/mla", PlatformEnum.CUDA, {"use_mla": True}),
        ("cuda/hybrid", PlatformEnum.CUDA, {"is_hybrid": True}),
    ]
    seen: dict[str, str] = {}
    for key, platform, overrides in cases:
        # vLLM's own Platform on that enum: the connector asks its public is_<name>() predicates.
        current = Platform()
        current._enum = platform
        current.device_name = current.device_type = platform.name.lower()
        vllm.platforms._current_platform = current
        model = types.SimpleNamespace(
            dtype=torch.bfloat16, use_mla=overrides.get("use_mla", False),
            is_hybrid=overrides.get("is_hybrid", False), is_attention_free=False, get_head_size=lambda: 64,
        )
        cache = types.SimpleNamespace(block_size=16, cache_dtype=overrides.get("cache_dtype", "auto"))
        parallel = types.SimpleNamespace(
            tensor_parallel_size=1, pipeline_parallel_size=overrides.get("pipeline_parallel_size", 1)
        )
        config = types.SimpleNamespace(model_config=model, cache_config=cache, parallel_config=parallel)
        try:
            connector.engine_identity(config, settings)
            seen[key] = "accepted"
        except ConfigError as exc:
            seen[key] = str(exc)
    return seen


def main(home: Path, out: Path) -> None:
    import logging

    logging.disable(logging.WARNING)  # the worker's relay is unreachable on purpose
    results = {f"{name}/{dtype}": route(home, name, dtype)
               for name in ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
               for dtype in ("bfloat16", "float16")}
    described = {"routes": results, "refusals": refusals(home), "backend_mismatch": backend_mismatch(home)}
    out.write_text(json.dumps(described, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
