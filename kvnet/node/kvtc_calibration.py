"""A model's ``kvtc`` tables (``kvnet.blocks.transform_tables``), calibrated on text as its nodes run it.

Owns: running the model's prefill over calibration text for every layer's K/V and each KV head's query
second moment (the metric K is coded in), the steps' allocation across layers by the model's measured
sensitivity (``measure_step_scale``), and ``calibrate`` over them. ``kvnet kvtc calibrate`` writes the
result for ``kvnet-node --kvtc-tables``; benchmarks/bench_codecs.py calibrates through the same functions.
The tables are bound to the model's fingerprint, which includes the block size: calibrate with the block
size and dtype the nodes run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvnet.blocks.codecs import CodecError
from kvnet.blocks.transform_tables import TransformTables, calibrate, predictor_tokens
from kvnet.cache.paged_cache import PagedKVCache
from kvnet.model.generate import cache_spec_for, prefill, prefix_root
from kvnet.model.importance import token_importance
from kvnet.model.transformer import Attention, Transformer, TransformerBlock, apply_rope, rope_inv_freq

__all__ = ["DEFAULT_LAYER_GROUP", "DEFAULT_REL_STEP", "HELD_OUT_TOKENS", "calibrate_model_tables",
           "measure_step_scale", "prefill_kv", "prefill_kv_and_query_metric", "prefill_positions",
           "prefix_cache", "scored_log_probs", "tokens_to_predict"]

DEFAULT_REL_STEP = 0.12
"""The quantizer step relative to each layer's RMS: on SmolLM2 bf16 8.3x smaller than raw at an output
KL of 1.5e-3 from lossless, each layer predicted from the one before and the steps allocated by layer
group and per token (64-token blocks, scored in float32; docs/performance.md, "kvtc predicted from the
layer before")."""
DEFAULT_LAYER_GROUP = 5
"""Layers whose steps are scaled together by ``measure_step_scale`` (0: one relative step everywhere)."""
HELD_OUT_TOKENS = 256
"""The most tokens at the end of the calibration text that the allocation scores instead of coding."""


def _windows(model: Transformer, tokens: int, block_size: int) -> list[tuple[int, int]]:
    """Where ``prefill_kv`` cuts ``tokens`` of text: (first token, whole blocks) of each window."""
    window = (model.args.max_seq_len - 1) // block_size * block_size
    starts = range(0, tokens - block_size, window)
    if window < block_size or not starts:
        raise CodecError(f"calibration needs more than {block_size} tokens, got {tokens}")
    return [(start, min(window, tokens - 1 - start) // block_size) for start in starts]


def prefill_positions(model: Transformer, tokens: int, block_size: int) -> torch.Tensor:
    """Each row of ``prefill_kv``'s K/V: its position in its window's sequence ``[N]``."""
    return torch.cat([torch.arange(blocks * block_size) for _, blocks in _windows(model, tokens, block_size)])


@torch.no_grad()
def prefill_kv(model: Transformer, token_ids: Sequence[int], block_size: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V ``[L, N, H_kv, D]`` (model dtype, on the model's device) of ``token_ids`` computed by
    the model's prefill: in windows as long as the model's context allows (each a sequence of its own,
    from position 0), each cut to whole blocks."""
    a = model.args
    ks: list[torch.Tensor] = []
    vs: list[torch.Tensor] = []
    for start, blocks in _windows(model, len(token_ids), block_size):
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
def prefill_kv_and_query_metric(model: Transformer, token_ids: Sequence[int], block_size: int
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``prefill_kv``'s K and V, and each KV head's query second moment ``[L, H_kv, D, D]`` over the same
    prefill (its query group's ``E[q q^T]``, after RoPE: the queries that meet the cached keys), for
    ``calibrate``'s key weight: one pass over the text for both."""
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
        k, v = prefill_kv(model, token_ids, block_size)
    finally:
        for handle in handles:
            handle.remove()
    return k, v, (total / max(rows[0], 1)).float()


def tokens_to_predict(tables: TransformTables) -> int:
    """Tokens of text ``calibrate_model_tables`` needs (the scored ones included) for its tables to predict
    each layer from the one before (``transform_tables.predictor_tokens``)."""
    return predictor_tokens(tables.channels) + HELD_OUT_TOKENS


def calibrate_model_tables(model: Transformer, token_ids: Sequence[int], block_size: int,
                           rel_step: float = DEFAULT_REL_STEP, key_metric: bool = True,
                           layer_group: int = 0, scorer: Transformer | None = None,
                           held_out: int = HELD_OUT_TOKENS) -> TransformTables:
    """kvtc tables of ``model`` (as its nodes run it with ``block_size``) from the prefill of ``token_ids``:
    ordinary text of the kind the nodes will serve, never the text a quality measurement scores. K is
    coded in its queries' metric unless ``key_metric`` is false.

    With ``layer_group``, the last tokens (at most ``held_out``, a fifth of the text at most) are scored
    instead of calibrated on, and the steps are allocated by ``measure_step_scale`` with ``scorer`` (the
    same model in float32: ``model`` itself when None)."""
    held = min(held_out, len(token_ids) // 5) if layer_group else 0
    calibration, scored = list(token_ids[:len(token_ids) - held]), list(token_ids[len(token_ids) - held:])
    if layer_group and len(scored) < 2:
        raise CodecError(f"allocating kvtc's steps needs more text: {len(token_ids)} tokens")
    if key_metric:
        k, v, metric = prefill_kv_and_query_metric(model, calibration, block_size)
    else:
        (k, v), metric = prefill_kv(model, calibration, block_size), None

    def tables_with(step_scale: torch.Tensor | None) -> TransformTables:
        return calibrate(k.float().cpu(), v.float().cpu(), model.fingerprint(block_size), rel_step,
                         step_scale=step_scale, query_metric=metric, positions=positions,
                         rope_inv_freq=rope_inv_freq(model.args, torch.device("cpu")), cache_dtype=k.dtype)

    positions = prefill_positions(model, len(calibration), block_size)
    tables = tables_with(None)
    if not layer_group:
        return tables
    scale = measure_step_scale(model, scorer or model, k, v, scored, block_size, tables, layer_group,
                               prefix_ids=calibration)
    return tables_with(scale)


@torch.no_grad()
def measure_step_scale(model: Transformer, scorer: Transformer, k: torch.Tensor, v: torch.Tensor,
                       scored: Sequence[int], block_size: int, tables: TransformTables, group: int,
                       prefix_ids: Sequence[int] | None = None) -> torch.Tensor:
    """Per (layer, K/V) step factors ``[L, 2]`` from the model's measured sensitivity (``calibrate``'s
    ``step_scale``).

    The prefix (the blocks of ``k, v``, ``prefill_kv``'s of the text before ``scored``, that fit the
    model's context before it: its first window) goes through kvtc with ``tables`` (equal relative
    steps); then, for each group of ``group`` consecutive layers and K or V apart, only that group's
    decoded K (or V) replaces the exact one, and ``scorer`` measures the mean KL of the ``scored`` tokens'
    next-token distributions from the exact prefix's. ``scorer`` should run in float32: in bfloat16
    arithmetic any change to the KV at all costs about int8's KL, a floor that drowns the differences
    measured here. With a group's KL ~ a_g step_g**2 and its rate ~ -log2 step_g per component, the least
    total KL at a fixed rate has every a_g step_g**2 equal (reverse water-filling across groups): step_g
    scales by (KL_g / geometric mean)**-1/2, which keeps the mean log step, hence the rate, about where it
    was. Factors are kept within [1/4, 4]. With ``prefix_ids`` (the prefix's tokens), each token is coded
    finer or coarser by the attention it gets, as a node codes it (``kvnet.model.importance``)."""
    # transform_tables imports the codec lazily too
    from kvnet.blocks.transform_codec import TransformCodec, token_shifts_from_importance

    window = (model.args.max_seq_len - len(scored)) // block_size
    blocks = min(int(k.shape[1]) // block_size, window)
    if blocks < 1:
        raise CodecError(f"allocating kvtc's steps needs a whole block of {block_size} tokens before the "
                         f"{len(scored)} scored")
    n = blocks * block_size
    k, v = k[:, :n], v[:, :n]
    codec = TransformCodec()
    shape = (block_size, model.args.n_kv_heads, model.args.head_dim)
    decoded_k, decoded_v = torch.empty_like(k), torch.empty_like(v)
    shifts = None
    if prefix_ids is not None:
        cache = prefix_cache(model, k, v, block_size, 0)
        shifts = token_shifts_from_importance(
            token_importance(model, cache, cache.block_table(0), list(prefix_ids[:n])))
    for b in range(blocks):
        rows = slice(b * block_size, (b + 1) * block_size)
        payloads = codec.encode_block(k[:, rows], v[:, rows], tables, sink_rows=int(b == 0),
                                      token_shifts=None if shifts is None else shifts[:, rows],
                                      first_position=b * block_size)
        for layer, (kd, vd) in enumerate(codec.decode_block(payloads, shape, k.dtype, k.device)):
            decoded_k[layer, rows], decoded_v[layer, rows] = kd, vd
    reference = scored_log_probs(scorer, k, v, scored, block_size)
    num_layers = model.args.n_layers
    kl = torch.empty(num_layers, 2)
    for start in range(0, num_layers, group):
        members = slice(start, min(start + group, num_layers))
        for kind, (exact, decoded) in enumerate(((k, decoded_k), (v, decoded_v))):
            mixed = exact.clone()
            mixed[members] = decoded[members]
            pair = (mixed, v) if kind == 0 else (k, mixed)
            log_probs = scored_log_probs(scorer, *pair, scored, block_size)
            kl[members, kind] = float((reference.exp() * (reference - log_probs)).sum(-1).mean())
    kl = kl.clamp(min=1e-12)
    return (kl / kl.log().mean().exp()).pow(-0.5).clamp(0.25, 4.0)


@torch.no_grad()
def scored_log_probs(scorer: Transformer, k: torch.Tensor, v: torch.Tensor, scored: Sequence[int],
                     block_size: int) -> torch.Tensor:
    """Log-probabilities ``[len(scored) - 1, vocab]`` of the tokens after each scored one, with a prefix's
    K/V (``[L, N, H_kv, D]``, N whole blocks, cast to the scorer's dtype: a float32 scorer reads a bf16
    cache exactly) in the cache instead of computed."""
    n = int(k.shape[1])
    cache = prefix_cache(scorer, k, v, block_size, len(scored))
    slots = cache.append_slots(0, len(scored))
    positions = torch.arange(n, n + len(scored), device=scorer.device)
    tokens = torch.tensor(list(scored), dtype=torch.int64, device=scorer.device)
    logits = scorer(tokens, positions, cache, cache.block_table(0), slots, n + len(scored))
    return torch.log_softmax(logits[:-1].float(), dim=-1)


def prefix_cache(model: Transformer, k: torch.Tensor, v: torch.Tensor, block_size: int, room: int
                  ) -> PagedKVCache:
    """A cache in ``model``'s dtype whose sequence 0 holds the given K/V ``[L, N, H_kv, D]`` (cast), with
    room for ``room`` tokens more."""
    n = int(k.shape[1])
    cache = PagedKVCache(cache_spec_for(model, block_size), (n + room) // block_size + 2, model.device)
    cache.add_sequence(0, [0] * n, [])  # the cache reads only the prefix's length; its K/V are given
    slots = cache.append_slots(0, n)
    for layer in range(model.args.n_layers):
        cache.write(layer, slots, k[layer].to(model.device, model.dtype),
                    v[layer].to(model.device, model.dtype))
    return cache
