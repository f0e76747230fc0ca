"""vLLM's GPU paged KV layer views (FlashAttention, FlashInfer, Triton) and kvnet's canonical block layout.

vLLM's GPU attention backends hand each attention layer over as a logical ``[num_blocks, num_kv_heads,
block_size, 2 * head_size]`` tensor, K then V in the last dimension, whose *physical* order is one of
vLLM's ``KVCacheLayout`` stride permutations over ``[L, B, H, N, C]`` (layer, block, head, token,
content), chosen at start-up: NHD (``LBNHC``, vLLM's default preference), HND (``LBHNC``; FlashInfer on
the newest GPUs requires it) and block-outermost variants in which one layer is a strided view into an
allocation shared by all layers. vLLM describes the per-layer part with the layout's ``layer_view_order``:
the logical ``[B, H, N, C]`` axes from outermost to innermost in memory.

This module takes that order as plain data (a tuple), so it never imports vLLM: ``PagedLayerLayout.of``
checks that a layer tensor really has the strides the order declares and that its content is plain K‖V in
a dtype kvnet carries, and ``read`` / ``write`` move one block between the layer and kvnet's canonical
``k, v: [block_size, num_kv_heads, head_size]`` through strided copies.

fp8 caches are refused: vLLM keeps their per-tensor or per-head scales outside the block (or, on Triton,
pads per-token-head scales into the content), and a block's fp8 bytes without its scales do not decode
to the values the engine attends to. Carrying them needs the scales in the manifest first.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvnet.integrations.cpu_layout import LayoutError

NHD = (0, 2, 1, 3)
"""``layer_view_order`` of vLLM's ``LBNHC`` / ``BLNHC``: per block, tokens outermost, then heads."""
HND = (0, 1, 2, 3)
"""``layer_view_order`` of vLLM's ``LBHNC`` / ``BLHNC`` / ``BHLNC``: per block, heads outermost."""
PAGED_DTYPES = (torch.bfloat16, torch.float16)
"""KV dtypes kvnet carries from a GPU backend's paged cache."""


@dataclass(frozen=True, slots=True)
class PagedLayerLayout:
    """Geometry and physical order of one layer's paged KV view on a vLLM GPU backend."""

    num_kv_heads: int
    block_size: int
    head_size: int
    physical_order: tuple[int, int, int, int]
    """Logical ``[B, H, N, C]`` axes, outermost first in memory (vLLM's ``layer_view_order``)."""

    @classmethod
    def of(cls, layer: torch.Tensor, physical_order: Sequence[int], head_size: int) -> PagedLayerLayout:
        """The layout of ``layer`` (logical ``[blocks, kv_heads, block_size, 2 * head_size]``), whose
        memory order the backend declared as ``physical_order``; ``LayoutError`` (one line) if kvnet cannot
        carry it."""
        order = tuple(int(axis) for axis in physical_order)
        if sorted(order) != [0, 1, 2, 3]:
            raise LayoutError(f"a layer view order permutes the 4 axes [B, H, N, C], not {order}")
        if layer.dtype not in PAGED_DTYPES:
            if layer.element_size() == 1:  # float8_* or the uint8 view vLLM keeps fp8 caches in
                raise LayoutError(
                    f"kvnet does not carry fp8 KV caches ({layer.dtype}): their scales live outside the block"
                )
            raise LayoutError(f"kvnet carries bfloat16 or float16 paged KV caches, not {layer.dtype}")
        if layer.dim() != 4:
            raise LayoutError(f"expected a paged KV view [blocks, kv_heads, block_size, 2*head_size], got "
                              f"{tuple(layer.shape)}")
        _, heads, block_size, content = (int(n) for n in layer.shape)
        if content != 2 * head_size:
            raise LayoutError(
                f"the KV view's content is {content} elements, not K and V of head size {head_size} "
                "(a quantized or padded cache)"
            )
        _check_strides(layer, order)
        return cls(heads, block_size, head_size, (order[0], order[1], order[2], order[3]))

    @property
    def canonical_shape(self) -> tuple[int, int, int]:
        """``[block_size, num_kv_heads, head_size]``: one layer's K (or V) of one block in kvnet's layout."""
        return (self.block_size, self.num_kv_heads, self.head_size)

    @property
    def heads_outer(self) -> bool:
        """HND inside a block (heads outside tokens); NHD otherwise."""
        return self.physical_order.index(1) < self.physical_order.index(2)

    def read(self, layer: torch.Tensor, block_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ``block_id`` of one layer as canonical ``(k, v)`` (fresh contiguous tensors)."""
        block = layer[block_id]  # [H, N, C], whatever its strides
        d = self.head_size
        k = block[:, :, :d].permute(1, 0, 2).contiguous()
        v = block[:, :, d:].permute(1, 0, 2).contiguous()
        return k, v

    def read_into(self, layer: torch.Tensor, block_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Copy block ``block_id`` of one layer into canonical ``k, v`` the caller owns (a staging buffer;
        on any device, the copy runs on the current stream)."""
        self._check_canonical(k, v)
        block = layer[block_id]
        d = self.head_size
        k.copy_(block[:, :, :d].permute(1, 0, 2))
        v.copy_(block[:, :, d:].permute(1, 0, 2))

    def write(self, layer: torch.Tensor, block_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store canonical ``(k, v)`` of one layer into block ``block_id`` of the engine's view."""
        self._check_canonical(k, v)
        block = layer[block_id]
        d = self.head_size
        block[:, :, :d].copy_(k.permute(1, 0, 2))
        block[:, :, d:].copy_(v.permute(1, 0, 2))

    def _check_canonical(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if tuple(k.shape) != self.canonical_shape or tuple(v.shape) != self.canonical_shape:
            raise LayoutError(
                f"block of shape {tuple(k.shape)}/{tuple(v.shape)} does not fit the engine's "
                f"{self.canonical_shape}"
            )


def _check_strides(layer: torch.Tensor, order: tuple[int, ...]) -> None:
    """The strides must nest in ``order``: content innermost and dense, each outer axis stepping over at
    least the whole of the axis inside it (more where other layers' pages or padding sit in between)."""
    shape, strides = layer.shape, layer.stride()
    if strides[3] != 1:
        raise LayoutError(f"the KV view's content is not contiguous (strides {strides})")
    for outer, inner in itertools.pairwise(order):
        if shape[outer] > 1 and strides[outer] < strides[inner] * shape[inner]:
            raise LayoutError(
                f"the KV view's strides {strides} (shape {tuple(shape)}) do not nest in the declared order "
                f"{order}"
            )
