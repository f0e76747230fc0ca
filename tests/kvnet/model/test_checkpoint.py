"""Loading Hugging Face Llama-layout checkpoints: round trip, RoPE convention, clear errors."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvnet.model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from kvnet.model.transformer import Transformer, apply_rope, rope_cos_sin, transformer_configs

CPU = torch.device("cpu")
TOKENS = torch.randint(0, 259, (40,), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def tiny() -> Transformer:
    return Transformer.from_name("tiny", device=CPU)


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"tie_embeddings": True},
        {"rope_scaling": "llama3", "rope_scaling_factor": 8.0, "rope_original_max_seq_len": 64},
    ],
)
def test_round_trip_gives_equal_logits(tmp_path: Path, changes: dict[str, Any]) -> None:
    model = Transformer(dataclasses.replace(transformer_configs["tiny"], **changes), device=CPU, seed=3)
    save_checkpoint(model, tmp_path)
    loaded = load_checkpoint(tmp_path, device=CPU)
    assert loaded.args == model.args and loaded.dtype == model.dtype
    with torch.no_grad():
        assert torch.equal(loaded.forward_full(TOKENS), model.forward_full(TOKENS))
    assert loaded.fingerprint(16) == model.fingerprint(16)
    if model.args.tie_embeddings:
        assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
        assert loaded.output.weight is loaded.tok_embeddings.weight


def test_load_casts_to_requested_dtype(tmp_path: Path, tiny: Transformer) -> None:
    save_checkpoint(tiny, tmp_path)
    loaded = load_checkpoint(tmp_path, device=CPU, dtype=torch.bfloat16)
    assert loaded.dtype == torch.bfloat16 and loaded.fingerprint(16) != tiny.fingerprint(16)


def _interleaved_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Meta's original RoPE: consecutive pairs (x[2i], x[2i+1]) as complex numbers. x: [T, H, D]."""
    head_dim = x.shape[-1]
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    rotation = torch.polar(torch.ones(len(positions), head_dim // 2), positions.float()[:, None] * freqs)
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], head_dim // 2, 2))
    return torch.view_as_real(pairs * rotation[:, None, :]).flatten(-2)


def test_hf_permuted_weights_match_meta_interleaved_rope() -> None:
    # Hugging Face's conversion permutes q/k rows of Meta weights so that rotate_half RoPE (ours) yields
    # the same attention scores as Meta's interleaved RoPE on the original rows.
    args = transformer_configs["tiny"]
    heads, head_dim, dim = args.n_heads, args.head_dim, args.dim
    generator = torch.Generator().manual_seed(1)
    meta_wq = torch.randn(heads * head_dim, dim, generator=generator)
    meta_wk = torch.randn(heads * head_dim, dim, generator=generator)

    def hf_permute(weight: torch.Tensor) -> torch.Tensor:  # from HF's convert_llama_weights_to_hf.py
        return weight.view(heads, head_dim // 2, 2, dim).transpose(1, 2).reshape(heads * head_dim, dim)

    x = torch.randn(7, dim, generator=generator)
    positions = torch.arange(3, 10)
    meta_q = _interleaved_rope((x @ meta_wq.T).view(7, heads, head_dim), positions, args.rope_theta)
    meta_k = _interleaved_rope((x @ meta_wk.T).view(7, heads, head_dim), positions, args.rope_theta)
    cos, sin = rope_cos_sin(args, positions)
    our_q = apply_rope((x @ hf_permute(meta_wq).T).view(7, heads, head_dim), cos, sin)
    our_k = apply_rope((x @ hf_permute(meta_wk).T).view(7, heads, head_dim), cos, sin)
    meta_scores = torch.einsum("thd,shd->hts", meta_q, meta_k) / math.sqrt(head_dim)
    our_scores = torch.einsum("thd,shd->hts", our_q, our_k) / math.sqrt(head_dim)
    torch.testing.assert_close(our_scores, meta_scores, atol=1e-3, rtol=1e-4)


def _edit_tensors(directory: Path, edit: dict[str, torch.Tensor | None]) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(path)
    for name, tensor in edit.items():
        if tensor is None:
            del tensors[name]
        else:
            tensors[name] = tensor
    save_file(tensors, path)


def _edit_config(directory: Path, **changes: object) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_missing_tensor(tmp_path: Path, tiny: Transformer) -> None:
    save_checkpoint(tiny, tmp_path)
    _edit_tensors(tmp_path, {"model.layers.1.mlp.up_proj.weight": None})
    with pytest.raises(CheckpointError, match=r"lacks 1 tensor\(s\): model.layers.1.mlp.up_proj.weight"):
        load_checkpoint(tmp_path, device=CPU)


def test_shape_mismatch(tmp_path: Path, tiny: Transformer) -> None:
    save_checkpoint(tiny, tmp_path)
    _edit_tensors(tmp_path, {"model.layers.0.self_attn.k_proj.weight": torch.zeros(64, 64)})
    with pytest.raises(CheckpointError, match=r"k_proj.weight' has shape \(64, 64\), expected \(32, 64\)"):
        load_checkpoint(tmp_path, device=CPU)


def test_unexpected_tensor_and_ignored_rotary_buffer(tmp_path: Path, tiny: Transformer) -> None:
    save_checkpoint(tiny, tmp_path)
    _edit_tensors(tmp_path, {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)})
    load_checkpoint(tmp_path, device=CPU)
    _edit_tensors(tmp_path, {"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)})
    with pytest.raises(CheckpointError, match=r"q_proj\.bias"):
        load_checkpoint(tmp_path, device=CPU)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"rope_scaling": {"rope_type": "llama3"}}, "invalid or incomplete"),
        ({"num_key_value_heads": 3}, "n_kv_heads"),
        ({"torch_dtype": "int8"}, "torch_dtype"),
    ],
)
def test_unsupported_or_bad_config(
    tmp_path: Path, tiny: Transformer, changes: dict[str, object], message: str
) -> None:
    save_checkpoint(tiny, tmp_path)
    _edit_config(tmp_path, **changes)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(tmp_path, device=CPU)


def test_missing_files_and_tokenizer_identity(tmp_path: Path, tiny: Transformer) -> None:
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        load_checkpoint(tmp_path, device=CPU)
    save_checkpoint(tiny, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["kvnet_tokenizer_identity"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="cannot identify the tokenizer"):
        load_checkpoint(tmp_path, device=CPU)
    given = load_checkpoint(tmp_path, device=CPU, tokenizer_identity="given")
    assert given.args.tokenizer_identity == "given"
    (tmp_path / "tokenizer.json").write_text('{"model": "bpe"}')
    identity = load_checkpoint(tmp_path, device=CPU).args.tokenizer_identity
    assert identity.startswith("hf-files-sha256:")
    (tmp_path / "tokenizer.json").write_text('{"model": "unigram"}')
    assert load_checkpoint(tmp_path, device=CPU).args.tokenizer_identity != identity
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        load_checkpoint(tmp_path, device=CPU)


def _transformers5_config(tiny: Transformer, **changes: object) -> dict[str, object]:
    """The config.json transformers >= 5 writes for `tiny` (``rope_parameters`` and ``dtype`` keys)."""
    args = tiny.args
    config: dict[str, object] = {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 1, "dtype": "bfloat16", "eos_token_id": 2, "head_dim": args.head_dim,
        "hidden_act": "silu", "hidden_size": args.dim, "initializer_range": 0.02,
        "intermediate_size": args.intermediate_size, "max_position_embeddings": args.max_seq_len,
        "mlp_bias": False, "model_type": "llama", "num_attention_heads": args.n_heads,
        "num_hidden_layers": args.n_layers, "num_key_value_heads": args.n_kv_heads, "pad_token_id": None,
        "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
        "tie_word_embeddings": False, "transformers_version": "5.23.0", "use_cache": True,
        "vocab_size": args.vocab_size, "kvnet_tokenizer_identity": args.tokenizer_identity,
    }
    config.update(changes)
    return config


def test_transformers5_config_gives_theta_and_dtype(tmp_path: Path, tiny: Transformer) -> None:
    save_checkpoint(tiny, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(_transformers5_config(tiny)))
    loaded = load_checkpoint(tmp_path, device=CPU)
    assert loaded.args.rope_theta == 100000.0 and loaded.dtype == torch.bfloat16
    llama3 = {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
    }
    (tmp_path / "config.json").write_text(json.dumps(_transformers5_config(tiny, rope_parameters=llama3)))
    args = load_checkpoint(tmp_path, device=CPU).args
    assert (args.rope_theta, args.rope_scaling, args.rope_scaling_factor) == (500000.0, "llama3", 8.0)
    assert args.rope_original_max_seq_len == 64


def test_config_written_by_transformers_loads(tmp_path: Path, tiny: Transformer) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is in the test extras")
    args = tiny.args
    config = transformers.LlamaConfig(
        hidden_size=args.dim, num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads, intermediate_size=args.intermediate_size,
        vocab_size=args.vocab_size, max_position_embeddings=args.max_seq_len, rms_norm_eps=args.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": 250000.0}, dtype=torch.bfloat16,
    )
    save_checkpoint(tiny, tmp_path)
    config.save_pretrained(tmp_path)
    loaded = load_checkpoint(tmp_path, device=CPU, tokenizer_identity=args.tokenizer_identity)
    assert loaded.args.rope_theta == 250000.0 and loaded.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"model_type": "qwen2"}, "model_type"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"sliding_window": 4096}, "sliding_window"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "rope_type 'yarn'"),
        ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}, "partial_rotary"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, "rope_theta": 5e5}, "rope_theta"),
        ({"torch_dtype": "float32"}, "torch_dtype"),
        ({"dtype": "float8"}, "dtype 'float8'"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ({"rope_interleaved": True}, "rope_interleaved"),
    ],
)
def test_unsupported_transformers5_keys_fail_naming_the_key(
    tmp_path: Path, tiny: Transformer, changes: dict[str, object], key: str
) -> None:
    save_checkpoint(tiny, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(_transformers5_config(tiny, **changes)))
    with pytest.raises(CheckpointError, match=key):
        load_checkpoint(tmp_path, device=CPU)


def test_tied_and_untied_heads_it_cannot_honour(tmp_path: Path, tiny: Transformer) -> None:
    save_checkpoint(tiny, tmp_path)
    _edit_tensors(tmp_path, {"lm_head.weight": None})
    with pytest.raises(CheckpointError, match="tie_word_embeddings is false"):
        load_checkpoint(tmp_path, device=CPU)
    _edit_tensors(tmp_path, {"lm_head.weight": torch.ones(259, 64)})
    _edit_config(tmp_path, tie_word_embeddings=True)
    with pytest.raises(CheckpointError, match=r"tie_word_embeddings is true but lm_head\.weight differs"):
        load_checkpoint(tmp_path, device=CPU)
