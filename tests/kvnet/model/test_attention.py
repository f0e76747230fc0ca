"""Paged attention equals plain causal attention on contiguous tensors.

The reference is an explicit float64 softmax(QK^T / sqrt(D) + mask) V, independent of SDPA. Tolerances are
against that float64 result computed from the same (already rounded) inputs: float32 1e-5; bfloat16 and
float16 2e-2 (absolute and relative; 8 and 11 mantissa bits in the softmax/matmul intermediates).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from kvnet.cache.paged_cache import CacheSpec, PagedKVCache
from kvnet.model.attention import ContiguousAttention, PagedAttention, attend, causal_mask, paged_attention

CPU = torch.device("cpu")
TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}


def _float16_supported() -> bool:
    try:
        q = torch.ones(1, 1, 2, 4, dtype=torch.float16)
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    except RuntimeError:
        return False
    return True


DTYPES = [torch.float32, torch.bfloat16] + ([torch.float16] if _float16_supported() else [])


def reference_attention(q: Tensor, k: Tensor, v: Tensor, positions: Tensor) -> Tensor:
    """Plain causal attention in float64: q [T, H, D], k/v [S, H_kv, D] -> [T, H, D]."""
    group = q.shape[1] // k.shape[1]
    q64, k64, v64 = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("thd,shd->hts", q64, k64) / math.sqrt(q.shape[-1])
    allowed = torch.arange(k.shape[0])[None, :] <= positions[:, None]  # [T, S]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v64)


def fill_scrambled_cache(
    k: Tensor, v: Tensor, block_size: int, generator: torch.Generator
) -> tuple[PagedKVCache, Tensor]:
    """A one-layer cache holding k/v [S, H_kv, D] in randomly permuted physical blocks; returns its table."""
    num_tokens, num_kv_heads, head_dim = k.shape
    num_seq_blocks = -(-num_tokens // block_size)
    num_blocks = num_seq_blocks + 3  # spare blocks so the table is not a permutation of all of them
    cache = PagedKVCache(CacheSpec(1, num_kv_heads, head_dim, block_size, k.dtype), num_blocks, CPU)
    block_table = torch.randperm(num_blocks, generator=generator)[:num_seq_blocks]
    positions = torch.arange(num_tokens)
    slot_mapping = block_table[positions // block_size] * block_size + positions % block_size
    cache.write(0, slot_mapping, k, v)
    return cache, block_table


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (4, 2), (8, 1)])
def test_paged_equals_contiguous_causal(
    dtype: torch.dtype, block_size: int, num_heads: int, num_kv_heads: int
) -> None:
    generator = torch.Generator().manual_seed(block_size * 100 + num_heads * 10 + num_kv_heads)
    head_dim, num_context = 16, 37
    k = torch.randn(num_context, num_kv_heads, head_dim, generator=generator).to(dtype)
    v = torch.randn(num_context, num_kv_heads, head_dim, generator=generator).to(dtype)
    cache, block_table = fill_scrambled_cache(k, v, block_size, generator)
    tolerance = TOLERANCES[dtype]
    # Prefill with a cached prefix (queries p0..36), decode (one query at 36), and from scratch (0..36).
    for first_position in (11, num_context - 1, 0):
        positions = torch.arange(first_position, num_context)
        q = torch.randn(len(positions), num_heads, head_dim, generator=generator).to(dtype)
        expected = reference_attention(q, k, v, positions)
        paged = paged_attention(q, cache, 0, block_table, positions)
        assert paged.dtype == dtype and paged.shape == q.shape
        torch.testing.assert_close(paged.double(), expected, atol=tolerance, rtol=tolerance)
        # The contiguous path (the model's cache-free forward) is the same math.
        contiguous = attend(q, k, v, positions)
        torch.testing.assert_close(contiguous.double(), expected, atol=tolerance, rtol=tolerance)


def test_paged_attention_reads_only_num_tokens() -> None:
    # Keys beyond the context must not be read even if the table's last block holds other data.
    generator = torch.Generator().manual_seed(7)
    k = torch.randn(12, 2, 8, generator=generator)
    v = torch.randn(12, 2, 8, generator=generator)
    cache, block_table = fill_scrambled_cache(k, v, 4, generator)
    positions = torch.tensor([8])
    q = torch.randn(1, 2, 8, generator=generator)
    out = paged_attention(q, cache, 0, block_table, positions, num_tokens=9)
    expected = reference_attention(q, k[:9], v[:9], positions)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_paged_context_writes_then_attends() -> None:
    generator = torch.Generator().manual_seed(3)
    k = torch.randn(10, 2, 8, generator=generator)
    v = torch.randn(10, 2, 8, generator=generator)
    cache, block_table = fill_scrambled_cache(k[:6], v[:6], 4, generator)
    # The table only covers 6 tokens; extend it with a spare block for positions 8..9.
    used = set(block_table.tolist())
    spare = next(block for block in range(cache.num_blocks) if block not in used)
    block_table = torch.cat((block_table, torch.tensor([spare])))
    positions = torch.arange(6, 10)
    slot_mapping = block_table[positions // 4] * 4 + positions % 4
    q = torch.randn(4, 4, 8, generator=generator)
    context = PagedAttention(cache, block_table, slot_mapping, positions, num_tokens=10)
    out = context.attend(0, q, k[6:], v[6:])
    torch.testing.assert_close(out.double(), reference_attention(q, k, v, positions), atol=1e-5, rtol=1e-5)
    gathered_k, _ = cache.gather(0, block_table, 10)
    torch.testing.assert_close(gathered_k, k)
    full = ContiguousAttention(torch.arange(10)).attend(0, torch.randn(10, 4, 8), k, v)
    assert full.shape == (10, 4, 8)


def test_causal_mask_offsets() -> None:
    mask = causal_mask(torch.tensor([2, 3]), 4)
    assert mask.tolist() == [[True, True, True, False], [True, True, True, True]]


def test_head_count_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        attend(torch.randn(2, 3, 4), torch.randn(2, 2, 4), torch.randn(2, 2, 4), torch.arange(2))
