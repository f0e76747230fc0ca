"""kvnet's paged layer layout on every KV cache layout vLLM declares, with vLLM's own strides.

``vllm_kv_layouts.py`` runs in the vLLM environment without kvnet and records each member of vLLM's
``KVCacheLayout`` enum: its per-layer view order and the byte strides vLLM allocates a full-attention
cache with (bf16, fp16, fp8), and which layouts FlashAttention and Triton accept. Here a CPU buffer gets
exactly those strides, every layer is viewed as vLLM views it, and kvnet's ``PagedLayerLayout`` (given
the order as vLLM names it) must read each block as a reference gather at the flat offsets, write it back
to those offsets only, and refuse fp8 in one line.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from kvnet.integrations.cpu_layout import LayoutError
from kvnet.integrations.paged_layout import PagedLayerLayout
from tests.integrations.test_vllm import ENGINE_TIMEOUT, vllm_python

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
    assert described["backends"]["FLASH_ATTN"] == {"layouts": None}
    assert described["backends"]["TRITON_ATTN"] == {"layouts": None}


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
