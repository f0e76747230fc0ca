"""The attention importance kvtc codes by: the probe forward attends as the model does, keeps the
probabilities, and leaves the paged cache exactly as the prefill wrote it."""

from __future__ import annotations

import torch

from kvnet.cache.paged_cache import CacheSpec, PagedKVCache
from kvnet.model.generate import prefill
from kvnet.model.importance import ProbeAttention, token_importance
from kvnet.model.transformer import Transformer
from tests.kvnet.model.conftest import BLOCK_SIZE
from tests.kvnet.model.test_attention import fill_scrambled_cache, reference_attention

CPU = torch.device("cpu")


def test_probe_attention_attends_causally_over_cache_and_new_tokens_and_writes_nothing() -> None:
    g = torch.Generator().manual_seed(3)
    prefix, new, heads, kv_heads, dim = 37, 5, 4, 2, 16
    k_all, v_all = (torch.randn(prefix + new, kv_heads, dim, generator=g) for _ in range(2))
    q = torch.randn(new, heads, dim, generator=g)
    cache, table = fill_scrambled_cache(k_all[:prefix], v_all[:prefix], 8, g)
    before = [t.clone() for t in cache.layer_buffers(0)]
    positions = torch.arange(prefix, prefix + new)
    probe = ProbeAttention(cache, table, positions, prefix, num_layers=1)
    out = probe.attend(0, q, k_all[prefix:], v_all[prefix:])
    expected = reference_attention(q, k_all, v_all, positions)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(before, cache.layer_buffers(0), strict=True))
    importance = probe.importance[0]
    assert importance is not None and importance.shape == (prefix + new,)
    assert abs(float(importance.sum()) - 1.0) < 1e-5  # each query's probabilities sum to 1
    # The last new token is seen by the last query only, the first cached one by every query.
    assert float(importance[-1]) > 0 and float(importance[0]) > 0


def test_token_importance_of_a_prefilled_sequence_reads_the_cache_without_changing_it(
    model: Transformer, root: bytes
) -> None:
    a = model.args
    ids = [(7 * i) % 200 + 1 for i in range(3 * BLOCK_SIZE + 5)]
    cache = PagedKVCache(CacheSpec(a.n_layers, a.n_kv_heads, a.head_dim, BLOCK_SIZE, model.dtype), 8, CPU)
    prefill(model, cache, 0, ids, root=root)
    before = [t.clone() for layer in range(a.n_layers) for t in cache.layer_buffers(layer)]
    importance = token_importance(model, cache, cache.block_table(0), ids, window=8)
    after = [t for layer in range(a.n_layers) for t in cache.layer_buffers(layer)]
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
    assert importance.shape == (a.n_layers, len(ids)) and importance.dtype == torch.float32
    torch.testing.assert_close(importance.sum(1), torch.ones(a.n_layers))
    assert bool((importance > 0).all())
    # A one-token sequence has no earlier token to measure: every token counts alike.
    alone = token_importance(model, cache, cache.block_table(0), ids[:1])
    assert torch.equal(alone, torch.ones(a.n_layers, 1))
