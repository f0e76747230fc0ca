"""vLLM's CPU KV layout <-> kvnet's canonical block layout (``kvnet.integrations.cpu_layout``)."""

from __future__ import annotations

import pytest
import torch

from kvnet.integrations.cpu_layout import CpuBlockLayout, LayoutError

BLOCKS, HEADS, BLOCK_SIZE, HEAD = 5, 3, 32, 8


def engine_tensor() -> torch.Tensor:
    return torch.zeros(BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD, dtype=torch.bfloat16)


def place_by_offsets(cache: torch.Tensor, block: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write k, v ([token, head, dim]) at the flat offsets the CPU kernel uses, element by element:
    per (block, head) K transposed [dim, token], then V [token, dim]."""
    flat = cache.view(-1)
    region = BLOCK_SIZE * 2 * HEAD
    for h in range(HEADS):
        base = (block * HEADS + h) * region
        for t in range(BLOCK_SIZE):
            for d in range(HEAD):
                flat[base + d * BLOCK_SIZE + t] = k[t, h, d]
                flat[base + BLOCK_SIZE * HEAD + t * HEAD + d] = v[t, h, d]


def random_block(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (BLOCK_SIZE, HEADS, HEAD)
    return torch.randn(shape, generator=g).bfloat16(), torch.randn(shape, generator=g).bfloat16()


def test_read_follows_the_kernels_offsets() -> None:
    cache = engine_tensor()
    k, v = random_block(1)
    place_by_offsets(cache, 3, k, v)
    layout = CpuBlockLayout.of(cache)
    assert layout == CpuBlockLayout(HEADS, BLOCK_SIZE, HEAD)
    got_k, got_v = layout.read(cache, 3)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    assert got_k.is_contiguous() and got_v.is_contiguous()


def test_write_places_at_the_kernels_offsets_and_touches_no_other_block() -> None:
    k, v = random_block(2)
    expected = engine_tensor()
    place_by_offsets(expected, 1, k, v)
    cache = engine_tensor()
    CpuBlockLayout.of(cache).write(cache, 1, k, v)
    assert torch.equal(cache, expected)


def test_read_returns_a_copy() -> None:
    cache = engine_tensor()
    layout = CpuBlockLayout.of(cache)
    k, v = random_block(3)
    layout.write(cache, 0, k, v)
    got_k, _ = layout.read(cache, 0)
    cache.zero_()
    assert torch.equal(got_k, k)


@pytest.mark.parametrize("shape", [(4, 2, 32), (4, 2, 32, 15)])
def test_rejects_other_layouts(shape: tuple[int, ...]) -> None:
    with pytest.raises(LayoutError):
        CpuBlockLayout.of(torch.zeros(shape))


def test_rejects_a_block_of_another_shape() -> None:
    cache = engine_tensor()
    k = torch.zeros(BLOCK_SIZE, HEADS + 1, HEAD, dtype=torch.bfloat16)
    with pytest.raises(LayoutError, match="does not fit"):
        CpuBlockLayout.of(cache).write(cache, 0, k, k)
