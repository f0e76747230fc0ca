"""How much attention a sequence's later queries give each of its cached tokens.

kvtc codes a token's K/V finer or coarser by this
(``kvnet.blocks.transform_codec.token_shifts_from_importance``): an error in a key or value reaches the
model's output in proportion to the attention its token gets, and most tokens get little. What later queries
will do is unknown when a block is published, but the sequence's own last queries predict it well (on
SmolLM2, the log attention mass the last 64 queries give each token correlates ~0.8 with what 256 tokens of
a continuation give it, per layer).

``token_importance`` runs the model over the sequence's last ``window`` tokens again, reading the rest of
the sequence from the paged cache and never writing to it (the published bytes stay what the prefill
computed), with attention computed explicitly so that its probabilities can be kept. It costs a forward of
``window`` tokens, off the serving path (where a node encodes its blocks).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from kvnet.model.attention import KVCacheSeam, causal_mask
from kvnet.model.transformer import Transformer

__all__ = ["IMPORTANCE_WINDOW", "ProbeAttention", "token_importance"]

IMPORTANCE_WINDOW = 64
"""The sequence's last tokens whose queries measure the importance (32-128 measured alike on SmolLM2)."""


class ProbeAttention:
    """An attention context over a sequence whose first ``prefix`` tokens are in ``cache``: the new tokens'
    K/V are appended for this forward only (nothing is written), and ``importance[layer]`` keeps the
    attention probability each of the ``prefix + T`` keys got, averaged over the new queries and heads."""

    def __init__(self, cache: KVCacheSeam, block_table: Tensor, positions: Tensor, prefix: int,
                 num_layers: int) -> None:
        self.cache = cache
        self.block_table = block_table
        self.prefix = prefix
        self.importance: list[Tensor | None] = [None] * num_layers
        # Every cached key is before every new query; among the new tokens, each sees those before it.
        self._hidden = ~causal_mask(positions, prefix + len(positions))[:, prefix:]  # [T, T]

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        cached_k, cached_v = self.cache.gather(layer, self.block_table, self.prefix)
        t, heads, dim = q.shape
        kv_heads = k.shape[1]
        grouped = q.float().view(t, kv_heads, heads // kv_heads, dim)  # query head h reads KV head h // group
        out = torch.empty_like(grouped)
        total = torch.zeros(self.prefix + t, device=q.device)
        # One KV head at a time: the float32 probabilities are [group, T, S], not [heads, T, S] (a long
        # prompt's whole set would take gigabytes).
        for head in range(kv_heads):
            keys = torch.cat([cached_k[:, head], k[:, head]]).float()  # [S, D]
            values = torch.cat([cached_v[:, head], v[:, head]]).float()
            logits = torch.einsum("tgd,sd->gts", grouped[:, head], keys).mul_(1.0 / math.sqrt(dim))
            logits[..., self.prefix:].masked_fill_(self._hidden, float("-inf"))
            probs = logits.softmax(-1)  # [group, T, S]
            total += probs.sum((0, 1))
            out[:, head] = torch.einsum("gts,sd->tgd", probs, values)
        self.importance[layer] = (total / (heads * t)).cpu()
        return out.reshape(t, heads, dim).to(q.dtype)


@torch.no_grad()
def token_importance(model: Transformer, cache: KVCacheSeam, block_table: Tensor, token_ids: Sequence[int],
                     window: int = IMPORTANCE_WINDOW) -> Tensor:
    """``[L, N]`` (float32, CPU): the mean attention probability each of the ``N = len(token_ids)`` tokens
    of a sequence held in ``cache`` (through ``block_table``) gets from its last ``window`` queries, per
    layer. Each of those queries sees the tokens before it only, as in the prefill."""
    n = len(token_ids)
    if n < 2:
        return torch.ones(model.args.n_layers, n)
    probes = min(window, n - 1)
    prefix = n - probes
    device = model.device
    positions = torch.arange(prefix, n, device=device)
    tokens = torch.tensor(list(token_ids[prefix:]), dtype=torch.int64, device=device)
    context = ProbeAttention(cache, block_table.to(device), positions, prefix, model.args.n_layers)
    model.forward_context(tokens, positions, context)
    return torch.stack([x for x in context.importance if x is not None])
