"""Reference model: configuration, determinism, fingerprint, RoPE, paged forward == full forward."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Any

import pytest
import torch

from kvnet.cache.paged_cache import CacheSpec, PagedKVCache
from kvnet.model.transformer import (
    ModelArgs,
    Transformer,
    apply_rope,
    rope_cos_sin,
    rope_inv_freq,
    transformer_configs,
)

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny() -> Transformer:
    return Transformer.from_name("tiny", device=CPU)


def test_from_name_is_exact() -> None:
    assert ModelArgs.from_name("tiny") is transformer_configs["tiny"]
    for name in ("Tiny", "tin", "tiny "):
        with pytest.raises(ValueError, match="unknown model preset"):
            ModelArgs.from_name(name)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"dim": 0}, "dim"),
        ({"n_heads": 3}, "dim"),
        ({"n_kv_heads": 3}, "n_heads"),
        ({"rope_theta": float("nan")}, "rope_theta"),
        ({"norm_eps": -1.0}, "norm_eps"),
        ({"rope_scaling": "yarn"}, "rope_scaling"),
        ({"dim": 24, "n_heads": 8}, "head_dim"),
    ],
)
def test_model_args_validation_names_the_field(change: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(transformer_configs["tiny"], **change)


@pytest.mark.parametrize("name", sorted(transformer_configs))
def test_presets_parameter_count(name: str) -> None:
    # The meta device builds even the bench preset without allocating its weights.
    model = Transformer.from_name(name, device=torch.device("meta"))
    assert sum(p.numel() for p in model.parameters()) == model.args.num_parameters
    assert model.args.head_dim * model.args.n_heads == model.args.dim


def test_bench_preset_is_benchmark_sized() -> None:
    args = ModelArgs.from_name("bench")
    assert 100e6 < args.num_parameters < 400e6
    assert args.max_seq_len >= 2048


def test_weights_are_deterministic_and_seeded(tiny: Transformer) -> None:
    again = Transformer.from_name("tiny", device=CPU)
    for (name, a), (_, b) in zip(tiny.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    other_seed = Transformer.from_name("tiny", device=CPU, seed=1)
    assert tiny.weights_digest() == again.weights_digest() != other_seed.weights_digest()


def test_fingerprint_covers_what_changes_kv(tiny: Transformer) -> None:
    base = tiny.fingerprint(16)
    assert len(base) == 32 and base == tiny.fingerprint(16)
    assert tiny.fingerprint(32) != base
    variants = [
        Transformer.from_name("tiny", device=CPU, dtype=torch.bfloat16),
        Transformer.from_name("tiny", device=CPU, seed=5),
        Transformer(dataclasses.replace(tiny.args, rope_theta=20000.0), device=CPU),
        Transformer(dataclasses.replace(tiny.args, norm_eps=1e-6), device=CPU),
        Transformer(dataclasses.replace(tiny.args, tokenizer_identity="other"), device=CPU),
    ]
    fingerprints = {variant.fingerprint(16) for variant in variants}
    assert base not in fingerprints and len(fingerprints) == len(variants)
    # The context limit does not change K/V values, so it does not split the cache.
    longer = Transformer(dataclasses.replace(tiny.args, max_seq_len=4096), device=CPU)
    assert longer.fingerprint(16) == base
    fields = tiny.fingerprint_fields()
    assert fields["model.dtype"] == "float32" and fields["model.tokenizer"] == tiny.args.tokenizer_identity


def test_fingerprint_is_identical_in_a_fresh_process(tiny: Transformer) -> None:
    code = (
        "import torch; from kvnet.model.transformer import Transformer; "
        "print(Transformer.from_name('tiny', device=torch.device('cpu')).fingerprint(16).hex())"
    )
    output = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert output.strip() == tiny.fingerprint(16).hex()


def test_rope_depends_only_on_relative_position() -> None:
    args = transformer_configs["tiny"]
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, args.head_dim, generator=generator)
    k = torch.randn(1, 1, args.head_dim, generator=generator)

    def score(query_position: int, key_position: int) -> float:
        cos_q, sin_q = rope_cos_sin(args, torch.tensor([query_position]))
        cos_k, sin_k = rope_cos_sin(args, torch.tensor([key_position]))
        return float((apply_rope(q, cos_q, sin_q) * apply_rope(k, cos_k, sin_k)).sum())

    assert score(10, 3) == pytest.approx(score(107, 100), abs=1e-4)
    assert score(10, 3) != pytest.approx(score(10, 4), abs=1e-3)
    # Position 0 is the identity rotation.
    cos, sin = rope_cos_sin(args, torch.tensor([0]))
    torch.testing.assert_close(apply_rope(q, cos, sin), q)


def test_llama3_rope_scaling_scales_only_low_frequencies() -> None:
    base = dataclasses.replace(transformer_configs["small"], rope_theta=500000.0)
    scaled = dataclasses.replace(
        base, rope_scaling="llama3", rope_scaling_factor=8.0, rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0, rope_original_max_seq_len=8192,
    )
    plain, adjusted = rope_inv_freq(base, CPU), rope_inv_freq(scaled, CPU)
    assert adjusted[0] == plain[0]  # the highest frequency is untouched
    torch.testing.assert_close(adjusted[-1], plain[-1] / 8.0)  # the lowest is divided by the factor
    assert bool((adjusted <= plain).all())


def _scrambled_cache(model: Transformer, num_blocks: int, block_size: int) -> PagedKVCache:
    args = model.args
    spec = CacheSpec(args.n_layers, args.n_kv_heads, args.head_dim, block_size, model.dtype)
    return PagedKVCache(spec, num_blocks, CPU)


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
def test_paged_forward_equals_full_forward(dtype: torch.dtype, tolerance: float) -> None:
    model = Transformer.from_name("tiny", device=CPU, dtype=dtype)
    token_ids = torch.randint(0, model.args.vocab_size, (45,), generator=torch.Generator().manual_seed(2))
    expected = model.forward_full(token_ids).float()
    block_size = 4
    cache = _scrambled_cache(model, num_blocks=40, block_size=block_size)
    # Interleave another sequence's allocations so seq 0's physical blocks are not contiguous.
    cache.add_sequence(0, token_ids.tolist(), [])
    cache.add_sequence(1, [0] * 60, [])
    chunks = [(0, 9), (9, 10), (10, 30), (30, 45)]  # prefill, a decode-sized step, more prefill
    logits = []
    for start, end in chunks:
        cache.append_slots(1, 7)
        slot_mapping = cache.append_slots(0, end - start)
        positions = torch.arange(start, end)
        logits.append(model(token_ids[start:end], positions, cache, cache.block_table(0), slot_mapping))
    table = cache.block_table(0).tolist()
    assert table != sorted(table) or table != list(range(table[0], table[0] + len(table)))
    with torch.no_grad():
        torch.testing.assert_close(torch.cat(logits).float(), expected, atol=tolerance, rtol=tolerance)


def test_forward_rejects_mismatched_shapes(tiny: Transformer) -> None:
    cache = _scrambled_cache(tiny, num_blocks=4, block_size=4)
    cache.add_sequence(0, [1, 2], [])
    slots = cache.append_slots(0, 2)
    with pytest.raises(ValueError, match="equal length"):
        tiny(torch.tensor([1, 2]), torch.tensor([0]), cache, cache.block_table(0), slots)
    with pytest.raises(ValueError, match="1-D"):
        tiny.forward_full(torch.tensor([[1, 2]]))


def test_tied_embeddings_share_one_tensor() -> None:
    args = dataclasses.replace(transformer_configs["tiny"], tie_embeddings=True)
    model = Transformer(args, device=CPU)
    assert model.output.weight is model.tok_embeddings.weight
    assert sum(p.numel() for p in model.parameters()) == args.num_parameters


def test_the_preset_names_commands_check_are_the_presets() -> None:
    # Commands check --model against kvnet.model.defaults (no torch) before they load this module.
    from kvnet.model.defaults import PRESET_NAMES

    assert tuple(transformer_configs) == PRESET_NAMES
