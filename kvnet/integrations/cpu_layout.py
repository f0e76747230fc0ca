"""vLLM's CPU paged KV layout and kvnet's canonical block layout, converted at the edge.

vLLM's CPU attention backend keeps one tensor per attention layer, ``[num_blocks, num_kv_heads,
block_size, 2 * head_size]`` in the model dtype. Inside one (block, head) the keys come first, stored
transposed as ``[head_size, block_size]``, then the values as ``[block_size, head_size]``: the shape's last
two dimensions do not describe the bytes.

kvnet's blocks travel as ``k, v: [block_size, num_kv_heads, head_size]`` per layer (what
``kvnet.blocks.codecs`` encode and what a manifest's ``layer_shape`` names), so the verifier, the codecs and
the lossy renditions need nothing vLLM-specific. The conversion is two strided copies per layer.
This module only moves tensors: it knows nothing about vLLM's classes, the network or hashing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


class LayoutError(ValueError):
    """An engine KV tensor does not have the layout this module converts."""


@dataclass(frozen=True, slots=True)
class CpuBlockLayout:
    """Geometry of one layer's paged KV tensor on vLLM's CPU backend."""

    num_kv_heads: int
    block_size: int
    head_size: int

    @classmethod
    def of(cls, layer_cache: torch.Tensor) -> CpuBlockLayout:
        """The layout of ``layer_cache`` (``[num_blocks, num_kv_heads, block_size, 2 * head_size]``)."""
        if layer_cache.dim() != 4 or layer_cache.shape[3] % 2:
            raise LayoutError(
                "expected a CPU KV tensor [blocks, kv_heads, block_size, 2*head_size], got "
                f"{tuple(layer_cache.shape)}"
            )
        if not layer_cache.is_contiguous():
            raise LayoutError("the engine's KV tensor is not contiguous")
        _, heads, block_size, twice_head = layer_cache.shape
        return cls(int(heads), int(block_size), int(twice_head) // 2)

    @property
    def canonical_shape(self) -> tuple[int, int, int]:
        """``[block_size, num_kv_heads, head_size]``: one layer's K (or V) of one block in kvnet's layout."""
        return (self.block_size, self.num_kv_heads, self.head_size)

    def _regions(self, layer_cache: torch.Tensor, block_ids: Sequence[int] | int) -> tuple[torch.Tensor, ...]:
        ids = [block_ids] if isinstance(block_ids, int) else list(block_ids)
        return tuple(layer_cache[i].view(self.num_kv_heads, 2, self.block_size * self.head_size) for i in ids)

    def read(self, layer_cache: torch.Tensor, block_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ``block_id`` of one layer as canonical ``(k, v)``, each ``[block_size, kv_heads, head]``
        (fresh tensors: the engine may reuse the block as soon as this returns)."""
        (region,) = self._regions(layer_cache, block_id)
        h, b, d = self.num_kv_heads, self.block_size, self.head_size
        k = region[:, 0].view(h, d, b).permute(2, 0, 1).contiguous()
        v = region[:, 1].view(h, b, d).permute(1, 0, 2).contiguous()
        return k, v

    def write(self, layer_cache: torch.Tensor, block_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store canonical ``(k, v)`` of one layer into block ``block_id`` of the engine's tensor."""
        if tuple(k.shape) != self.canonical_shape or tuple(v.shape) != self.canonical_shape:
            raise LayoutError(
                f"block of shape {tuple(k.shape)}/{tuple(v.shape)} does not fit the engine's "
                f"{self.canonical_shape}"
            )
        (region,) = self._regions(layer_cache, block_id)
        h, b, d = self.num_kv_heads, self.block_size, self.head_size
        region[:, 0].view(h, d, b).copy_(k.permute(1, 2, 0))
        region[:, 1].view(h, b, d).copy_(v.permute(1, 0, 2))
