"""vLLM's GPU paged KV layer views <-> kvnet's canonical block layout (``kvnet.integrations.paged_layout``).

Each case allocates the whole ``[L, B, H, N, C]`` cache in one buffer with the strides of one of vLLM's
``KVCacheLayout`` permutations (written out here; ``tests/integrations/test_vllm_paged_layout.py`` takes
them from vLLM itself) and views every layer as vLLM does, a strided ``[B, H, N, C]``. The reference reads
and writes elements at their flat offsets, one index per element, independently of the module.
"""

from __future__ import annotations

import pytest
import torch

from kvnet.integrations.cpu_layout import LayoutError
from kvnet.integrations.paged_layout import HND, NHD, PagedLayerLayout

LAYERS, BLOCKS, HEADS, BLOCK_SIZE, HEAD = 3, 4, 2, 16, 8
STRIDE_ORDERS = {
    # vLLM 0.32's KVCacheLayout values: physical order of the logical [L, B, H, N, C] axes.
    "LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4),
}


def layer_view_order(stride_order: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(axis - 1 for axis in stride_order if axis != 0)


def allocate(stride_order: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, list[int]]:
    """A zeroed buffer for the whole cache and the element strides of [L, B, H, N, C] in that order."""
    shape = (LAYERS, BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD)
    strides = [0] * 5
    step = 1
    for axis in reversed(stride_order):
        strides[axis] = step
        step *= shape[axis]
    return torch.zeros(step, dtype=dtype), strides


def layer_views(flat: torch.Tensor, strides: list[int]) -> list[torch.Tensor]:
    size = (BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD)
    return [torch.as_strided(flat, size, strides[1:], layer * strides[0]) for layer in range(LAYERS)]


def offsets(strides: list[int], layer: int, block: int) -> tuple[list[int], list[int]]:
    """Flat offsets of K[n, h, d] and V[n, h, d] of one block, in canonical order."""
    s_l, s_b, s_h, s_n, s_c = strides
    base = layer * s_l + block * s_b
    keys = [base + h * s_h + n * s_n + d * s_c
            for n in range(BLOCK_SIZE) for h in range(HEADS) for d in range(HEAD)]
    values = [base + h * s_h + n * s_n + (HEAD + d) * s_c
              for n in range(BLOCK_SIZE) for h in range(HEADS) for d in range(HEAD)]
    return keys, values


def random_block(seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (BLOCK_SIZE, HEADS, HEAD)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


CASES = [pytest.param(name, dtype, id=f"{name}-{str(dtype)[6:]}")
         for name in STRIDE_ORDERS for dtype in (torch.bfloat16, torch.float16)]


@pytest.mark.parametrize(("name", "dtype"), CASES)
def test_read_gathers_the_block_at_the_layouts_offsets(name: str, dtype: torch.dtype) -> None:
    order = STRIDE_ORDERS[name]
    flat, strides = allocate(order, dtype)
    flat.copy_(torch.randn(flat.numel(), generator=torch.Generator().manual_seed(1)).to(dtype))
    views = layer_views(flat, strides)
    layout = PagedLayerLayout.of(views[1], layer_view_order(order), HEAD)
    assert layout == PagedLayerLayout(HEADS, BLOCK_SIZE, HEAD, layer_view_order(order))  # type: ignore[arg-type]
    assert layout.heads_outer == (layer_view_order(order) in (HND, (1, 0, 2, 3)))
    keys, values = offsets(strides, 1, 2)
    k, v = layout.read(views[1], 2)
    assert torch.equal(k, flat[torch.tensor(keys)].view(BLOCK_SIZE, HEADS, HEAD))
    assert torch.equal(v, flat[torch.tensor(values)].view(BLOCK_SIZE, HEADS, HEAD))
    assert k.is_contiguous() and v.is_contiguous()


@pytest.mark.parametrize(("name", "dtype"), CASES)
def test_write_scatters_to_the_layouts_offsets_and_nowhere_else(name: str, dtype: torch.dtype) -> None:
    order = STRIDE_ORDERS[name]
    flat, strides = allocate(order, dtype)
    views = layer_views(flat, strides)
    k, v = random_block(2, dtype)
    PagedLayerLayout.of(views[2], layer_view_order(order), HEAD).write(views[2], 3, k, v)
    expected = torch.zeros_like(flat)
    keys, values = offsets(strides, 2, 3)
    expected[torch.tensor(keys)] = k.reshape(-1)
    expected[torch.tensor(values)] = v.reshape(-1)
    assert torch.equal(flat, expected)  # other layers and blocks untouched


def test_nhd_and_hnd_name_vllms_per_layer_orders() -> None:
    assert layer_view_order(STRIDE_ORDERS["LBNHC"]) == layer_view_order(STRIDE_ORDERS["BLNHC"]) == NHD
    assert layer_view_order(STRIDE_ORDERS["LBHNC"]) == layer_view_order(STRIDE_ORDERS["BLHNC"]) == HND


@pytest.mark.parametrize(
    ("dtype", "reason"),
    [(torch.float8_e4m3fn, "does not carry fp8 KV caches"), (torch.uint8, "does not carry fp8 KV caches"),
     (torch.float32, "bfloat16 or float16")],
)
def test_a_dtype_kvnet_does_not_carry_is_refused_in_one_line(dtype: torch.dtype, reason: str) -> None:
    layer = torch.zeros(BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD, dtype=dtype)
    with pytest.raises(LayoutError, match=reason) as caught:
        PagedLayerLayout.of(layer, HND, HEAD)
    assert "\n" not in str(caught.value)


def test_content_that_is_not_k_and_v_is_refused() -> None:
    padded = torch.zeros(BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD + 4, dtype=torch.bfloat16)
    with pytest.raises(LayoutError, match="not K and V of head size 8"):
        PagedLayerLayout.of(padded[..., : 2 * HEAD + 4], HND, HEAD)


def test_strides_that_contradict_the_declared_order_are_refused() -> None:
    nhd = torch.zeros(BLOCKS, BLOCK_SIZE, HEADS, 2 * HEAD, dtype=torch.bfloat16).permute(0, 2, 1, 3)
    assert PagedLayerLayout.of(nhd, NHD, HEAD).physical_order == NHD
    with pytest.raises(LayoutError, match="do not nest in the declared order"):
        PagedLayerLayout.of(nhd, HND, HEAD)
    with pytest.raises(LayoutError, match="permutes the 4 axes"):
        PagedLayerLayout.of(nhd, (0, 1, 1, 3), HEAD)


def test_rejects_a_block_of_another_shape() -> None:
    layer = torch.zeros(BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD, dtype=torch.bfloat16)
    k = torch.zeros(BLOCK_SIZE, HEADS + 1, HEAD, dtype=torch.bfloat16)
    with pytest.raises(LayoutError, match="does not fit"):
        PagedLayerLayout.of(layer, HND, HEAD).write(layer, 0, k, k)
