"""vLLM's CPU paged KV layouts and kvnet's canonical block layout, converted at the edge.

vLLM's CPU attention backend keeps one tensor per attention layer, ``[num_blocks, num_kv_heads,
block_size, 2 * head_size]`` in the model dtype. Each (block, head) is a region of ``2 * block_size *
head_size`` elements: the keys' ``block_size * head_size`` first, then the values'. How the elements sit
inside each half depends on the CPU attention kernel vLLM picks (its ``cpu_attn_reshape_and_cache`` op
writes them), so the shape's last two dimensions do not describe the bytes:

* ``vec`` and ``vec16``: K transposed ``[head_size, block_size]``, V ``[block_size, head_size]``.
* ``amx`` (bf16 on CPUs with AMX): laid out for AMX tiles of 16 rows of 64 bytes, in pairs of bf16
  elements (one 32-bit lane). K is ``[block_size / 16, head_size / 2, 16, 2]``: per group of 16 tokens,
  per pair of dims, the 16 tokens' pairs. V is ``[head_size / 16, block_size / 2, 16, 2]``: per group of
  16 dims, per pair of tokens, the 16 dims' token pairs.
* ``CPU_MLA`` (MLA models, e.g. DeepSeek-V2/V3): ``[num_blocks, 1, block_size, latent]``, one latent row
  per token and no K/V halves (``MlaLatentLayout``).

kvnet's blocks travel as ``k, v: [block_size, num_kv_heads, head_size]`` per layer (what
``kvnet.blocks.codecs`` encode and what a manifest's ``layer_shape`` names), so the verifier, the codecs and
the lossy renditions need nothing vLLM-specific. Each layout is a pair of strided views (engine side and
canonical side, same shape), so a conversion is two strided copies per layer.
This module only moves tensors: it knows nothing about vLLM's classes, the network or hashing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch


class LayoutError(ValueError):
    """An engine KV tensor does not have the layout this module converts."""


@dataclass(frozen=True, slots=True)
class CpuBlockLayout(ABC):
    """Geometry and element order of one layer's paged KV tensor for one vLLM CPU attention kernel."""

    num_kv_heads: int
    block_size: int
    head_size: int

    kernels: ClassVar[tuple[str, ...]]
    """vLLM kernel names (``_get_attn_isa``) that write this layout."""

    def __post_init__(self) -> None:
        problem = self.unsupported(self.block_size, self.head_size)
        if problem is not None:
            raise LayoutError(problem)

    @classmethod
    def unsupported(cls, block_size: int, head_size: int) -> str | None:
        """Why this layout cannot describe blocks of this geometry, or None."""
        return None

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

    @abstractmethod
    def _key_views(self, engine: torch.Tensor, canonical: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of one block's K, equal in shape and element for element the same key value: ``engine``
        is ``[heads, block_size * head_size]`` (the K halves of the block's regions), ``canonical`` is
        ``[block_size, heads, head_size]``."""

    @abstractmethod
    def _value_views(
        self, engine: torch.Tensor, canonical: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``_key_views``, for V."""

    def _halves(self, layer_cache: torch.Tensor, block_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        region = layer_cache[block_id].view(self.num_kv_heads, 2, self.block_size * self.head_size)
        return region[:, 0], region[:, 1]

    def read(self, layer_cache: torch.Tensor, block_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ``block_id`` of one layer as canonical ``(k, v)``, each ``[block_size, kv_heads, head]``
        (fresh tensors: the engine may reuse the block as soon as this returns)."""
        k = torch.empty(self.canonical_shape, dtype=layer_cache.dtype, device=layer_cache.device)
        v = torch.empty_like(k)
        self.read_into(layer_cache, block_id, k, v)
        return k, v

    def read_into(self, layer_cache: torch.Tensor, block_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Copy block ``block_id`` of one layer into canonical ``k, v`` the caller owns (a host buffer)."""
        self._check_canonical(k, v)
        engine_k, engine_v = self._halves(layer_cache, block_id)
        source, target = self._key_views(engine_k, k)
        target.copy_(source)
        source, target = self._value_views(engine_v, v)
        target.copy_(source)

    def write(self, layer_cache: torch.Tensor, block_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store canonical ``(k, v)`` of one layer into block ``block_id`` of the engine's tensor."""
        self._check_canonical(k, v)
        engine_k, engine_v = self._halves(layer_cache, block_id)
        target, source = self._key_views(engine_k, k)
        target.copy_(source)
        target, source = self._value_views(engine_v, v)
        target.copy_(source)

    def _check_canonical(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if tuple(k.shape) != self.canonical_shape or tuple(v.shape) != self.canonical_shape:
            raise LayoutError(
                f"block of shape {tuple(k.shape)}/{tuple(v.shape)} does not fit the engine's "
                f"{self.canonical_shape}"
            )


class VecLayout(CpuBlockLayout):
    """``vec`` / ``vec16``: per (block, head) K transposed ``[head_size, block_size]``, then V
    ``[block_size, head_size]``."""

    kernels = ("vec", "vec16")

    def _key_views(self, engine: torch.Tensor, canonical: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, b, d = self.num_kv_heads, self.block_size, self.head_size
        return engine.view(h, d, b), canonical.permute(1, 2, 0)

    def _value_views(
        self, engine: torch.Tensor, canonical: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, b, d = self.num_kv_heads, self.block_size, self.head_size
        return engine.view(h, b, d), canonical.permute(1, 0, 2)


AMX_TILE_ROWS = 16
"""Rows of an AMX tile: K is stored in groups of this many tokens, V in groups of this many dims."""
AMX_PAIR = 2
"""bf16 elements per 32-bit lane of an AMX tile row: K pairs dims, V pairs tokens."""
AMX_BLOCK_MULTIPLE = 32
"""vLLM's amx cache write needs ``block_size`` to be a multiple of one tile row in bf16 (64 bytes)."""


class AmxLayout(CpuBlockLayout):
    """``amx``: tiles of 16 rows of 32-bit lanes, each lane a pair of bf16 elements.

    Per (block, head), K is ``[block_size / 16, head_size / 2, 16, 2]`` indexed ``[g, j, t, e]`` =
    ``k[16 g + t, 2 j + e]``; V is ``[head_size / 16, block_size / 2, 16, 2]`` indexed ``[i, s, j, e]`` =
    ``v[2 s + e, 16 i + j]``.
    """

    kernels = ("amx",)

    @classmethod
    def unsupported(cls, block_size: int, head_size: int) -> str | None:
        if block_size % AMX_BLOCK_MULTIPLE:
            return f"the amx KV layout needs a block size multiple of {AMX_BLOCK_MULTIPLE}, not {block_size}"
        if head_size % AMX_TILE_ROWS:
            return f"the amx KV layout needs a head size multiple of {AMX_TILE_ROWS}, not {head_size}"
        return None

    @classmethod
    def of(cls, layer_cache: torch.Tensor) -> CpuBlockLayout:
        # The pairs are 32-bit lanes of bf16 elements; vLLM picks amx for bf16 only.
        if layer_cache.dtype != torch.bfloat16:
            raise LayoutError(f"the amx KV layout holds bfloat16, not {layer_cache.dtype}")
        return super().of(layer_cache)

    def _key_views(self, engine: torch.Tensor, canonical: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, b, d, rows, pair = self.num_kv_heads, self.block_size, self.head_size, AMX_TILE_ROWS, AMX_PAIR
        if canonical.is_contiguous():
            # K's pairs are adjacent dims on both sides, so each 32-bit lane moves whole: a 4-d permute of
            # int32 copies ~3x faster than the 5-d one of bf16 whose innermost run is two elements.
            lanes = canonical.view(torch.int32).view(b // rows, rows, h, d // pair)  # [(g, t), h, j]
            return engine.view(torch.int32).view(h, b // rows, d // pair, rows), lanes.permute(2, 0, 3, 1)
        engine_view = engine.view(h, b // rows, d // pair, rows, pair)  # [h, g, j, t, e]
        # canonical [token, head, dim] = [(g, t), h, (j, e)] -> [h, g, j, t, e]
        canonical_view = canonical.view(b // rows, rows, h, d // pair, pair).permute(2, 0, 3, 1, 4)
        return engine_view, canonical_view

    def _value_views(
        self, engine: torch.Tensor, canonical: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, b, d, rows, pair = self.num_kv_heads, self.block_size, self.head_size, AMX_TILE_ROWS, AMX_PAIR
        engine_view = engine.view(h, d // rows, b // pair, rows, pair)  # [h, i, s, j, e]
        # canonical [token, head, dim] = [(s, e), h, (i, j)] -> [h, i, s, j, e]
        canonical_view = canonical.view(b // pair, pair, h, d // rows, rows).permute(2, 3, 0, 4, 1)
        return engine_view, canonical_view


class MlaLatentLayout(CpuBlockLayout):
    """``CPU_MLA`` (vLLM's MLA backend for any CPU, DeepSeek-V2/V3-style models): one tensor per layer,
    ``[num_blocks, 1, block_size, latent]``, each token's compressed KV (``kv_lora_rank`` elements)
    followed by its rotary key part, written row by row (``CPUMLAImpl.do_kv_cache_update``). There is no V
    and no head axis to split: every tensor-parallel rank holds the whole latent.

    On the wire a latent block is a block of one KV head whose K is the first half of each token's latent
    and V the second half (``head_size = latent / 2``), so the block format, its verifier and its codecs
    carry it unchanged; the fingerprint's ``kv_kind`` says the block is a latent. (``AMX_MLA`` writes
    another order through its own op and is not mapped.)"""

    kernels = ("CPU_MLA",)

    @classmethod
    def of(cls, layer_cache: torch.Tensor) -> CpuBlockLayout:
        """The layout of ``layer_cache``: ``[num_blocks, block_size, latent]`` (``latent`` even), or with a
        head axis of size 1 after the blocks, as vLLM's CPU model runner allocates it."""
        shape = tuple(layer_cache.shape)
        rows = shape[1:] if len(shape) == 3 else shape[2:] if len(shape) == 4 and shape[1] == 1 else ()
        if not rows or rows[1] % 2:
            raise LayoutError(f"expected a CPU MLA KV tensor [blocks, (1,) block_size, latent], got {shape}")
        if not layer_cache.is_contiguous():
            raise LayoutError("the engine's KV tensor is not contiguous")
        block_size, latent = rows
        return cls(1, int(block_size), int(latent) // 2)

    def _halves(self, layer_cache: torch.Tensor, block_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        latent = layer_cache[block_id].view(self.block_size, 2 * self.head_size)
        return latent[:, : self.head_size], latent[:, self.head_size :]

    def _key_views(self, engine: torch.Tensor, canonical: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return engine, canonical[:, 0]  # the one head

    _value_views = _key_views  # both halves are rows of the latent alike


CPU_LAYOUTS: Mapping[str, type[CpuBlockLayout]] = {
    kernel: layout for layout in (VecLayout, AmxLayout, MlaLatentLayout) for kernel in layout.kernels
}
"""The layout class of each vLLM CPU attention kernel kvnet maps, by kernel name."""


def cpu_layout_refusal(kernel: str, block_size: int, head_size: int) -> str | None:
    """Why kvnet cannot map vLLM's CPU kernel ``kernel`` at this geometry (one line), or None."""
    layout = CPU_LAYOUTS.get(kernel)
    if layout is None:
        return f"kvnet does not know the KV layout of vLLM's CPU kernel {kernel!r}"
    return layout.unsupported(block_size, head_size)


def cpu_layout(kernel: str, layer_cache: torch.Tensor) -> CpuBlockLayout:
    """The layout of ``layer_cache`` as written by vLLM's CPU kernel ``kernel``; ``LayoutError`` if kvnet
    does not map that kernel or the tensor does not fit it."""
    layout = CPU_LAYOUTS.get(kernel)
    if layout is None:
        raise LayoutError(f"kvnet does not know the KV layout of vLLM's CPU kernel {kernel!r}")
    return layout.of(layer_cache)
