"""A model's ``kvtc`` tables (``kvnet.blocks.transform_tables``), calibrated on text as its nodes run it.

Owns: running the model's prefill over calibration text for every layer's K/V and each KV head's query
second moment (the metric K is coded in), and ``calibrate`` over them. ``kvnet kvtc calibrate`` writes the
result for ``kvnet-node --kvtc-tables``; benchmarks/bench_codecs.py calibrates through the same functions.
The tables are bound to the model's fingerprint, which includes the block size: calibrate with the block
size and dtype the nodes run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvnet.blocks.codecs import CodecError
from kvnet.blocks.transform_tables import TransformTables, calibrate
from kvnet.cache.paged_cache import PagedKVCache
from kvnet.model.generate import cache_spec_for, prefill, prefix_root
from kvnet.model.transformer import Attention, Transformer, TransformerBlock, apply_rope

__all__ = ["DEFAULT_REL_STEP", "calibrate_model_tables", "prefill_kv", "query_metric"]

DEFAULT_REL_STEP = 0.12
"""The quantizer step relative to each layer's RMS: on SmolLM2 bf16 5.85x smaller than raw at an output
KL of 9.7e-3 from lossless, 64-token blocks (docs/performance.md, "kvtc's coder scales")."""


@torch.no_grad()
def prefill_kv(model: Transformer, token_ids: Sequence[int], block_size: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V ``[L, N, H_kv, D]`` (model dtype, on the model's device) of ``token_ids`` computed by
    the model's prefill: in windows as long as the model's context allows (each a sequence of its own,
    from position 0), each cut to whole blocks."""
    window = (model.args.max_seq_len - 1) // block_size * block_size
    starts = range(0, len(token_ids) - block_size, window)
    if window < block_size or not starts:
        raise CodecError(f"calibration needs more than {block_size} tokens, got {len(token_ids)}")
    a = model.args
    ks: list[torch.Tensor] = []
    vs: list[torch.Tensor] = []
    for start in starts:
        blocks = min(window, len(token_ids) - 1 - start) // block_size
        ids = list(token_ids[start:start + blocks * block_size + 1])
        cache = PagedKVCache(cache_spec_for(model, block_size), blocks + 2, model.device)
        prefill(model, cache, 0, ids, root=prefix_root(model, block_size))
        table = cache.block_table(0)[:blocks].to(torch.long)
        shape = (blocks * block_size, a.n_kv_heads, a.head_dim)
        buffers = [cache.layer_buffers(layer) for layer in range(a.n_layers)]
        ks.append(torch.stack([k[table].reshape(shape) for k, _ in buffers]))
        vs.append(torch.stack([v[table].reshape(shape) for _, v in buffers]))
    return torch.cat(ks, dim=1), torch.cat(vs, dim=1)


@torch.no_grad()
def query_metric(model: Transformer, token_ids: Sequence[int], block_size: int) -> torch.Tensor:
    """Each KV head's query second moment ``[L, H_kv, D, D]`` over the prefill of ``token_ids`` (its query
    group's ``E[q q^T]``, after RoPE: the queries that meet the cached keys), for ``calibrate``'s key
    weight."""
    a = model.args
    group = a.n_heads // a.n_kv_heads
    total = torch.zeros(a.n_layers, a.n_kv_heads, a.head_dim, a.head_dim, dtype=torch.float64)
    rows = [0]

    def capture(layer: int) -> Callable[..., None]:
        def hook(module: Attention, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            x, cos, sin = inputs[:3]
            q = apply_rope(module.wq(x).view(x.shape[0], a.n_heads, a.head_dim), cos, sin).double().cpu()
            q = q.view(x.shape[0], a.n_kv_heads, group, a.head_dim)
            total[layer] += torch.einsum("tgqd,tgqe->gde", q, q)
            if layer == 0:
                rows[0] += x.shape[0]
        return hook

    blocks = [block for block in model.layers if isinstance(block, TransformerBlock)]
    handles = [block.attention.register_forward_hook(capture(i)) for i, block in enumerate(blocks)]
    try:
        prefill_kv(model, token_ids, block_size)
    finally:
        for handle in handles:
            handle.remove()
    return (total / max(rows[0], 1)).float()


def calibrate_model_tables(model: Transformer, token_ids: Sequence[int], block_size: int,
                           rel_step: float = DEFAULT_REL_STEP, key_metric: bool = True,
                           step_scale: torch.Tensor | None = None) -> TransformTables:
    """kvtc tables of ``model`` (as its nodes run it with ``block_size``) from the prefill of ``token_ids``:
    ordinary text of the kind the nodes will serve, never the text a quality measurement scores. K is
    coded in its queries' metric unless ``key_metric`` is false; ``step_scale`` as in ``calibrate``."""
    k, v = prefill_kv(model, token_ids, block_size)
    metric = query_metric(model, token_ids, block_size) if key_metric else None
    return calibrate(k.float().cpu(), v.float().cpu(), model.fingerprint(block_size), rel_step,
                     step_scale=step_scale, query_metric=metric)
