"""Causal attention over contiguous and paged K/V.

This module owns the attention math only: the causal mask for queries at arbitrary absolute positions,
grouped-query attention (GQA) and the paged read path. It reaches the KV cache solely through the narrow
`KVCacheSeam` protocol (`write` / `gather`), so it knows nothing about block pools, hashing or sequences.

A batch of sequences is one flat token dimension: each sequence owns a contiguous segment of it
(`BatchSegment`) and its own block table. The projections run over all tokens at once; attention runs per
segment over that sequence's pages (`BatchedPagedAttention`). A padded ``[B, S_max]`` gather with a mask
measured no faster on CPU for decode batches (benchmarks/bench_micro.py ``--only attention``,
docs/performance.md), and the per-segment loop computes exactly the unbatched attention of each sequence.

Masking rule, used by every path: the query at absolute position ``p`` attends to the keys at positions
``0..p``. So a prefill chunk at positions ``p0..p0+T-1`` over a cached prefix of ``p0`` tokens, a decode
step (``T == 1``) and a cache-free full forward (``p0 == 0``) are the same computation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor


class KVCacheSeam(Protocol):
    """The two calls the model makes on a KV cache (`kvnet.cache.paged_cache.PagedKVCache` satisfies it)."""

    def write(self, layer: int, slot_mapping: Tensor, k: Tensor, v: Tensor) -> None:
        """Store ``k, v: [T, H_kv, D]`` at flat slots ``slot_mapping: [T]`` (block_id*block_size+offset)."""
        ...

    def gather(self, layer: int, block_table: Tensor, num_tokens: int) -> tuple[Tensor, Tensor]:
        """K and V of the first ``num_tokens`` positions of a sequence, each ``[num_tokens, H_kv, D]``."""
        ...


def causal_mask(positions: Tensor, num_keys: int) -> Tensor:
    """Boolean mask ``[T, num_keys]``, true where the query at ``positions[t]`` may see key ``s``."""
    # positions: [T] absolute positions of the queries; key s sits at absolute position s.
    key_positions = torch.arange(num_keys, device=positions.device)
    return key_positions[None, :] <= positions[:, None]


def attend(q: Tensor, k: Tensor, v: Tensor, positions: Tensor) -> Tensor:
    """Causal attention of queries at ``positions`` over keys at positions ``0..S-1``.

    q: [T, H, D], k/v: [S, H_kv, D] with H a multiple of H_kv, positions: [T] (int64, on q's device).
    Returns [T, H, D] in q's dtype. Softmax scale is 1/sqrt(D).
    """
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of key/value heads ({num_kv_heads})")
    mask = causal_mask(positions, k.shape[0])  # [T, S]
    # SDPA wants [B, H, L, D]; the transposes are views, SDPA copies what it needs. GQA: query head h reads
    # kv head h // group (the Llama/HF grouping); enable_gqa does that without materialising repeated K/V
    # (measured bit-identical to repeat_interleave in float32 and bfloat16, and 2.5x cheaper per decode step).
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),  # [1, H, T, D]
        k.transpose(0, 1).unsqueeze(0),  # [1, H_kv, S, D]
        v.transpose(0, 1).unsqueeze(0),  # [1, H_kv, S, D]
        attn_mask=mask,
        enable_gqa=num_heads != num_kv_heads,
    )
    return out.squeeze(0).transpose(0, 1)  # [T, H, D]


def paged_attention(
    q: Tensor,
    cache: KVCacheSeam,
    layer: int,
    block_table: Tensor,
    positions: Tensor,
    num_tokens: int | None = None,
) -> Tensor:
    """Causal attention of ``q: [T, H, D]`` over the K/V a sequence has in ``cache`` (layer ``layer``).

    block_table: [num_blocks_of_sequence] physical block ids; positions: [T] ascending absolute positions,
    whose K/V must already be written. ``num_tokens`` is the number of context tokens to read (default
    ``positions[-1] + 1``; pass it to avoid a device-to-host sync). Returns [T, H, D].
    """
    if num_tokens is None:
        num_tokens = int(positions[-1].item()) + 1
    k, v = cache.gather(layer, block_table, num_tokens)  # [num_tokens, H_kv, D] each
    return attend(q, k, v, positions)


class AttentionContext(Protocol):
    """Where a layer's K/V come from: the model hands each layer's new q/k/v to `attend`."""

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Attention output ``[T, H, D]`` for ``q: [T, H, D]`` and the new ``k, v: [T, H_kv, D]``."""
        ...


@dataclass(frozen=True)
class ContiguousAttention:
    """Cache-free: the new K/V are the whole sequence (positions ``0..T-1``)."""

    positions: Tensor
    """[T] absolute positions of the queries (and keys)."""

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return attend(q, k, v, self.positions)


@dataclass(frozen=True)
class PagedAttention:
    """Through a paged cache: write the new K/V at their slots, then attend over the gathered sequence."""

    cache: KVCacheSeam
    """The only way to the stored K/V."""
    block_table: Tensor
    """[num_blocks_of_sequence] physical block ids of the sequence."""
    slot_mapping: Tensor
    """[T] flat slots (block_id * block_size + offset) for the new K/V."""
    positions: Tensor
    """[T] ascending absolute positions of the queries."""
    num_tokens: int
    """Context length to read: positions[-1] + 1."""

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.cache.write(layer, self.slot_mapping, k, v)
        return paged_attention(q, self.cache, layer, self.block_table, self.positions, self.num_tokens)


@dataclass(frozen=True)
class BatchSegment:
    """One sequence's share of a batched forward: a contiguous run of the flat token dimension."""

    start: int
    """Index of the segment's first token in the flat ``[T]`` batch."""
    length: int
    """Tokens of this sequence in the batch (a prefill chunk, or 1 for a decode step)."""
    block_table: Tensor
    """[num_blocks_of_sequence] physical block ids of the sequence."""
    num_tokens: int
    """Context length of the sequence after this step (its last position + 1)."""


@dataclass(frozen=True)
class BatchedPagedAttention:
    """Several sequences in one forward: write all new K/V at once, then attend per sequence (own pages)."""

    cache: KVCacheSeam
    """The only way to the stored K/V."""
    slot_mapping: Tensor
    """[T] flat slots of the new K/V of every segment, in batch order."""
    positions: Tensor
    """[T] absolute positions of the queries (ascending within each segment)."""
    segments: tuple[BatchSegment, ...]
    """The sequences, in batch order, covering ``0..T-1`` without gaps."""

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.cache.write(layer, self.slot_mapping, k, v)
        outputs = [
            paged_attention(
                q[s.start : s.start + s.length], self.cache, layer, s.block_table,
                self.positions[s.start : s.start + s.length], s.num_tokens,
            )
            for s in self.segments
        ]
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)  # [T, H, D]
