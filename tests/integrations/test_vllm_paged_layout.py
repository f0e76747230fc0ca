"""kvnet's paged layer layout on every KV cache layout vLLM declares, with vLLM's own strides.

``vllm_kv_layouts.py`` runs in the vLLM environment without kvnet and records each member of vLLM's
``KVCacheLayout`` enum: its per-layer view order and the byte strides vLLM allocates a full-attention
cache with (bf16, fp16, fp8), and which layouts FlashAttention and Triton accept. Here a CPU buffer gets
exactly those strides, every layer is viewed as vLLM views it, and kvnet's ``PagedLayerLayout`` (given
the order as vLLM names it) must read each block as a reference gather at the flat offsets, write it back
to those offsets only, and refuse fp8 in one line. The connector's whole device path (``save_blocks`` out
of one engine, ``StagedLoads`` into another) runs at those strides for every backend vLLM can import here,
and the connector's verdicts (``kvnet.integrations.platforms``) are checked against the platforms, backend
names and KV cache dtypes vLLM itself declares.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from kvnet.integrations.cpu_layout import LayoutError
from kvnet.integrations.device_path import PinnedPool, StagedLoads, host_block_shape, save_blocks
from kvnet.integrations.paged_layout import PagedLayerLayout
from kvnet.integrations.platforms import (
    GPU_BACKENDS,
    PLAIN_CACHE_DTYPES,
    cache_dtype_refusal,
    gpu_backend_refusal,
    platform_refusal,
)
from tests.integrations.test_vllm import ENGINE_TIMEOUT, REPO, vllm_python

pytestmark = pytest.mark.slow  # imports vLLM in its own environment: tens of seconds

LAYOUT_NAMES = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
"""vLLM 0.32's members; the first test fails if vLLM has others, so none goes untested."""


@pytest.fixture(scope="module")
def described(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    python = vllm_python()
    out = tmp_path_factory.mktemp("vllm-kv-layouts") / "layouts.json"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home())}  # no PYTHONPATH: kvnet is not importable
    proc = subprocess.run(
        [python, str(Path(__file__).with_name("vllm_kv_layouts.py")), str(out)],
        capture_output=True, text=True, timeout=ENGINE_TIMEOUT, cwd=out.parent, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result


Views = tuple[torch.Tensor, list[int], list[torch.Tensor]]


def layer_views(described: dict[str, Any], name: str, dtype: torch.dtype) -> Views:
    """A buffer with vLLM's strides for layout ``name``, its element strides, and its per-layer views."""
    g = described["geometry"]
    entry = described["layouts"][name]["dtypes"][str(dtype).removeprefix("torch.")]
    size = torch.tensor([], dtype=dtype).element_size()
    # vLLM counts the content axis in bytes (stride 1 byte); in elements it is dense too.
    assert entry["byte_strides"][4] == 1
    strides = [s // size for s in entry["byte_strides"][:4]] + [1]
    blocks, heads, tokens, content_bytes = entry["shape_bytes"]
    shape = (blocks, heads, tokens, content_bytes // size)
    numel = g["num_layers"] * blocks * heads * tokens * shape[3]
    flat = torch.randn(numel, generator=torch.Generator().manual_seed(3)).to(dtype)
    views = [torch.as_strided(flat, shape, strides[1:], n * strides[0]) for n in range(g["num_layers"])]
    return flat, strides, views


def reference_offsets(
    strides: list[int], layer: int, block: int, g: dict[str, int]
) -> tuple[list[int], list[int]]:
    """Flat offsets of K[n, h, d] and V[n, h, d] of one block, in canonical order."""
    s_l, s_b, s_h, s_n, s_c = strides
    base, d_max = layer * s_l + block * s_b, g["head_size"]
    tokens, heads = range(g["block_size"]), range(g["num_kv_heads"])
    cells = [(n, h, d) for n in tokens for h in heads for d in range(d_max)]
    keys = [base + h * s_h + n * s_n + d * s_c for n, h, d in cells]
    values = [base + h * s_h + n * s_n + (d_max + d) * s_c for n, h, d in cells]
    return keys, values


def test_vllm_declares_the_layouts_kvnet_is_tested_on(described: dict[str, Any]) -> None:
    assert tuple(described["layouts"]) == LAYOUT_NAMES
    # FlashAttention and Triton take any layout (None); FlashInfer does not import on vLLM's CPU build.
    assert described["backends"]["FLASH_ATTN"] == {"name": "FLASH_ATTN", "layouts": None}
    assert described["backends"]["TRITON_ATTN"] == {"name": "TRITON_ATTN", "layouts": None}
    # If FlashInfer ever imports here, its declared layouts join the round trip below.
    assert "flashinfer" in described["backends"]["FLASHINFER"]["error"]


def test_the_connector_serves_vllms_gpu_backends_by_their_names(described: dict[str, Any]) -> None:
    names = [entry["name"] for entry in described["backends"].values() if "name" in entry]
    assert names == ["FLASH_ATTN", "TRITON_ATTN"]
    assert all(name in GPU_BACKENDS and gpu_backend_refusal(name) is None for name in names)


def test_of_vllms_platforms_only_cpu_and_cuda_are_served(described: dict[str, Any]) -> None:
    served = [p for p in described["platforms"] if platform_refusal(p) is None]
    assert served == ["cuda", "cpu"]
    assert all("\n" not in (platform_refusal(p) or "") for p in described["platforms"])


def test_every_kv_cache_dtype_vllm_offers_is_carried_or_refused(described: dict[str, Any]) -> None:
    assert set(PLAIN_CACHE_DTYPES) <= set(described["cache_dtypes"])
    for cache_dtype in described["cache_dtypes"]:
        refusal = cache_dtype_refusal(cache_dtype)
        assert (refusal is None) == (cache_dtype in PLAIN_CACHE_DTYPES), cache_dtype
        assert refusal is None or ("\n" not in refusal and "scales" in refusal)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", LAYOUT_NAMES)
def test_kvnet_reads_and_writes_blocks_at_vllms_strides(
    described: dict[str, Any], name: str, dtype: torch.dtype
) -> None:
    g = described["geometry"]
    order = described["layouts"][name]["layer_view_order"]
    flat, strides, views = layer_views(described, name, dtype)
    canonical = (g["block_size"], g["num_kv_heads"], g["head_size"])
    for layer, view in enumerate(views):
        layout = PagedLayerLayout.of(view, order, g["head_size"])
        for block in range(g["num_blocks"]):
            keys, values = reference_offsets(strides, layer, block, g)
            k, v = layout.read(view, block)
            assert torch.equal(k, flat[torch.tensor(keys)].view(canonical)), (layer, block)
            assert torch.equal(v, flat[torch.tensor(values)].view(canonical)), (layer, block)
    # Writing: one block of one layer, into a zeroed buffer; nothing else may change.
    flat.zero_()
    k = torch.randn(canonical, generator=torch.Generator().manual_seed(4)).to(dtype)
    v = torch.randn(canonical, generator=torch.Generator().manual_seed(5)).to(dtype)
    PagedLayerLayout.of(views[1], order, g["head_size"]).write(views[1], 2, k, v)
    expected = torch.zeros_like(flat)
    keys, values = reference_offsets(strides, 1, 2, g)
    expected[torch.tensor(keys)] = k.reshape(-1)
    expected[torch.tensor(values)] = v.reshape(-1)
    assert torch.equal(flat, expected)


@pytest.mark.parametrize("name", LAYOUT_NAMES)
def test_an_fp8_cache_with_vllms_strides_is_refused_in_one_line(described: dict[str, Any], name: str) -> None:
    g = described["geometry"]
    _, _, views = layer_views(described, name, torch.float8_e4m3fn)
    with pytest.raises(LayoutError, match="does not carry fp8 KV caches") as caught:
        PagedLayerLayout.of(views[0], described["layouts"][name]["layer_view_order"], g["head_size"])
    assert "\n" not in str(caught.value)


def round_trip_cases() -> list[Any]:
    """(backend, layout, dtype) for every backend vLLM imports here and every layout it runs on (None:
    all of them)."""
    names = LAYOUT_NAMES  # FLASH_ATTN and TRITON_ATTN declare None (checked above)
    return [pytest.param(backend, name, dtype, id=f"{backend}-{name}-{str(dtype)[6:]}")
            for backend in ("FLASH_ATTN", "TRITON_ATTN") for name in names
            for dtype in (torch.bfloat16, torch.float16)]


@pytest.mark.parametrize(("backend", "name", "dtype"), round_trip_cases())
def test_the_connectors_device_path_moves_blocks_between_engines_at_vllms_strides(
    described: dict[str, Any], backend: str, name: str, dtype: torch.dtype
) -> None:
    declared = described["backends"][backend]["layouts"]
    assert declared is None or name in declared
    g = described["geometry"]
    order = described["layouts"][name]["layer_view_order"]
    canonical = (g["block_size"], g["num_kv_heads"], g["head_size"])
    source, strides, source_views = layer_views(described, name, dtype)
    target, _, target_views = layer_views(described, name, dtype)
    target.zero_()
    layout = PagedLayerLayout.of(source_views[0], order, g["head_size"])
    shape = host_block_shape(layout, g["num_layers"])
    saved, transfer = save_blocks(layout, source_views, [3, 0], PinnedPool(2, shape, dtype, pin=False))
    transfer.wait()
    staged = StagedLoads(layout, target_views, PinnedPool(2, shape, dtype, pin=False))
    for host, key, into in zip(saved, (b"3", b"0"), (1, 2), strict=True):
        staged.begin(key)
        for layer in range(g["num_layers"]):
            staged.layer(key, layer, host.k[layer], host.v[layer])
        staged.finish(key, [into])
    staged.wait([1, 2])
    expected = torch.zeros_like(target)
    for layer in range(g["num_layers"]):
        for source_block, into in ((3, 1), (0, 2)):
            keys, values = reference_offsets(strides, layer, source_block, g)
            to_keys, to_values = reference_offsets(strides, layer, into, g)
            expected[torch.tensor(to_keys)] = source[torch.tensor(keys)]
            expected[torch.tensor(to_values)] = source[torch.tensor(values)]
    assert torch.equal(target, expected)
    assert saved[0].k.shape[1:] == canonical


@pytest.fixture(scope="module")
def routed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What ``vllm_device_route.py`` saw driving the connector's worker on its CUDA route (CPU tensors)."""
    python = vllm_python()
    home = tmp_path_factory.mktemp("vllm-device-route")
    out = home / "route.json"
    env = dict(os.environ, PYTHONPATH=str(REPO), KVNET_HOME=str(home))
    proc = subprocess.run(
        [python, str(Path(__file__).with_name("vllm_device_route.py")), str(home), str(out)],
        capture_output=True, text=True, timeout=ENGINE_TIMEOUT, cwd=REPO, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", LAYOUT_NAMES)
def test_the_connectors_worker_saves_and_loads_through_the_device_path_on_every_layout(
    routed: dict[str, Any], name: str, dtype: str
) -> None:
    # routed: register took the layout's view order and set up the pinned pools and staged loads;
    # saved: wait_for_save's blocks reached publishing equal to a reference gather at vLLM's strides;
    # loaded: a fetched block handed over layer by layer landed in both engine blocks waiting for it.
    assert routed["routes"][f"{name}/{dtype}"] == {"routed": True, "saved": True, "loaded": True}


def test_the_connector_refuses_other_platforms_and_unsupported_cuda_engines_in_one_line(
    routed: dict[str, Any]
) -> None:
    refusals = routed["refusals"]
    head = "kvnet's vLLM connector"
    for platform in ("rocm", "xpu", "tpu", "oot"):
        assert refusals[platform] == f"{head} serves vLLM on cpu and cuda only, not on {platform}"
    # CUDA passes the platform check and reaches the backend vLLM chose (here one kvnet does not map).
    assert refusals["cuda"].endswith("attention backends, not FLEX_ATTENTION")
    assert "does not carry fp8 KV caches" in refusals["cuda/fp8"]
    assert "per-head scales" in refusals["cuda/fp8"]
    assert refusals["cuda/pp2"] == f"{head} supports pipeline parallel size 1 only"
    assert refusals["cuda/mla"] == f"{head} does not carry MLA latent KV caches"
    assert refusals["cuda/hybrid"] == f"{head} does not carry the recurrent state of hybrid models"
    assert all("\n" not in line for line in refusals.values())
    assert routed["backend_mismatch"] == (
        "kvnet: the layers use attention backend TRITON_ATTN, the engine announced FLASH_ATTN"
    )
