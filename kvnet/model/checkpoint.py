"""Real weights for `kvnet.model.transformer.Transformer` from a local Hugging Face Llama-layout directory.

This module owns the translation between a checkpoint directory (``config.json`` plus ``*.safetensors``)
and the model: config keys to `ModelArgs`, tensor names to module names, and validation with clear errors
(`CheckpointError`) for missing, unexpected or mis-shaped tensors and unsupported architecture options. It
never downloads anything and knows nothing about the cache or the network.

RoPE: Hugging Face stores ``q_proj``/``k_proj`` rows permuted for the rotate_half layout, which is the layout
`kvnet.model.transformer` uses, so those weights load verbatim (no un-permuting). `save_checkpoint` writes
the same
layout, so a saved model loads back bit-exactly.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from kvnet.dtypes import DTYPE_BY_NAME
from kvnet.model.tokenizer import read_json_object, tokenizer_files_identity
from kvnet.model.transformer import ModelArgs, Transformer

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
"""File `save_checkpoint` writes (loading reads every ``*.safetensors`` in the directory)."""
TOKENIZER_IDENTITY_KEY = "kvnet_tokenizer_identity"
"""Extra ``config.json`` key carrying `Tokenizer.identity()` (written by `save_checkpoint`)."""
IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)
"""Derived buffers some older exports include; RoPE is recomputed from the config."""


# Hugging Face Llama name -> kvnet module name; "{i}" is the layer index.
_LAYER_NAMES = {
    "model.layers.{i}.self_attn.q_proj.weight": "layers.{i}.attention.wq.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "layers.{i}.attention.wk.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "layers.{i}.attention.wv.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "layers.{i}.attention.wo.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "layers.{i}.feed_forward.w1.weight",
    "model.layers.{i}.mlp.up_proj.weight": "layers.{i}.feed_forward.w3.weight",
    "model.layers.{i}.mlp.down_proj.weight": "layers.{i}.feed_forward.w2.weight",
    "model.layers.{i}.input_layernorm.weight": "layers.{i}.attention_norm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.ffn_norm.weight",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}


class CheckpointError(ValueError):
    """The checkpoint directory cannot be loaded as given; the message names the file, key or tensor."""


def hf_tensor_names(args: ModelArgs) -> dict[str, str]:
    """Hugging Face tensor name -> kvnet parameter name for every weight of a model with `args`."""
    tied_away = {"lm_head.weight"} if args.tie_embeddings else set()
    names = {hf: ours for hf, ours in _GLOBAL_NAMES.items() if hf not in tied_away}
    for layer in range(args.n_layers):
        names.update({hf.format(i=layer): ours.format(i=layer) for hf, ours in _LAYER_NAMES.items()})
    return names


SUPPORTED_MODEL_TYPES = ("llama", "mistral")
"""``model_type`` values whose math is the Llama layout (mistral only without a sliding window)."""
SUPPORTED_ROPE_TYPES = ("default", "llama3")
"""RoPE types `kvnet.model.transformer` implements (``rope_parameters``/``rope_scaling`` ``rope_type``)."""


def _rope_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """`ModelArgs` RoPE fields: ``rope_parameters`` (transformers >= 5) or ``rope_theta``/``rope_scaling``."""
    parameters = config.get("rope_parameters")
    scaling = config.get("rope_scaling")
    key = "rope_parameters" if parameters is not None else "rope_scaling"
    rope = parameters if parameters is not None else scaling
    if parameters is not None and scaling is not None and scaling != parameters:
        raise CheckpointError(f"{CONFIG_FILE}: rope_parameters and rope_scaling disagree; keep one of them")
    if rope is not None and not isinstance(rope, Mapping):
        raise CheckpointError(f"{CONFIG_FILE}: {key} must be an object, got {rope!r}")
    rope = rope or {}
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    if (
        "rope_theta" in rope
        and "rope_theta" in config
        and float(rope["rope_theta"]) != float(config["rope_theta"])
    ):
        raise CheckpointError(
            f"{CONFIG_FILE}: rope_theta {config['rope_theta']} disagrees with {key}.rope_theta"
        )
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"{CONFIG_FILE}: {key}.rope_type {rope_type!r} is not supported "
            f"(only {list(SUPPORTED_ROPE_TYPES)})"
        )
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0:
        raise CheckpointError(f"{CONFIG_FILE}: partial_rotary_factor {partial} is not supported (only 1.0)")
    fields: dict[str, Any] = {"rope_theta": float(theta)}
    if rope_type == "llama3":
        fields |= {
            "rope_scaling": "llama3",
            "rope_scaling_factor": float(rope["factor"]),
            "rope_low_freq_factor": float(rope["low_freq_factor"]),
            "rope_high_freq_factor": float(rope["high_freq_factor"]),
            "rope_original_max_seq_len": int(rope["original_max_position_embeddings"]),
        }
    return fields


def _reject_unsupported(config: Mapping[str, Any]) -> None:
    """`CheckpointError` naming the first key whose value asks for math kvnet does not implement."""
    model_type = config.get("model_type", "llama")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"{CONFIG_FILE}: model_type {model_type!r} is not supported (only {list(SUPPORTED_MODEL_TYPES)})"
        )
    hidden_act = config.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise CheckpointError(f"{CONFIG_FILE}: hidden_act {hidden_act!r} is not supported (only 'silu')")
    for flag in ("attention_bias", "mlp_bias", "use_sliding_window", "rope_interleaved"):
        if config.get(flag):
            raise CheckpointError(f"{CONFIG_FILE}: {flag}=true is not supported")
    for key in ("sliding_window", "quantization_config", "attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(key) is not None:
            raise CheckpointError(f"{CONFIG_FILE}: {key} is not supported (got {config[key]!r})")
    layer_types = config.get("layer_types")
    if layer_types is not None and any(kind != "full_attention" for kind in layer_types):
        raise CheckpointError(f"{CONFIG_FILE}: layer_types other than 'full_attention' are not supported")


def config_dtype(config: Mapping[str, Any]) -> torch.dtype:
    """The weights dtype a config names: ``dtype`` (``torch_dtype`` before transformers 5); else float32."""
    named = {
        key: str(config[key]).removeprefix("torch.") for key in ("dtype", "torch_dtype") if config.get(key)
    }
    if len(set(named.values())) > 1:
        raise CheckpointError(
            f"{CONFIG_FILE}: dtype {named['dtype']!r} and torch_dtype {named['torch_dtype']!r} disagree"
        )
    for key, name in named.items():
        if name not in DTYPE_BY_NAME:
            raise CheckpointError(f"{CONFIG_FILE}: {key} {name!r} not in {sorted(DTYPE_BY_NAME)}")
        return DTYPE_BY_NAME[name]
    return torch.float32


def model_args_from_hf_config(config: Mapping[str, Any], tokenizer_identity: str) -> ModelArgs:
    """`ModelArgs` from a Hugging Face Llama ``config.json``; `CheckpointError` for what kvnet cannot run."""

    def require(key: str) -> Any:
        if key not in config:
            raise CheckpointError(f"{CONFIG_FILE} lacks required key {key!r}")
        return config[key]

    _reject_unsupported(config)
    dim, n_heads = require("hidden_size"), require("num_attention_heads")
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim * n_heads != dim:
        raise CheckpointError(
            f"{CONFIG_FILE}: head_dim {head_dim} * num_attention_heads {n_heads} != hidden_size {dim}"
        )
    try:
        return ModelArgs(
            dim=dim,
            n_layers=require("num_hidden_layers"),
            n_heads=n_heads,
            n_kv_heads=config.get("num_key_value_heads") or n_heads,
            intermediate_size=require("intermediate_size"),
            vocab_size=require("vocab_size"),
            max_seq_len=require("max_position_embeddings"),
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            tokenizer_identity=tokenizer_identity,
            **_rope_fields(config),
        )
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{CONFIG_FILE}: invalid or incomplete value: {exc!r}") from exc


def _read_config(directory: Path) -> dict[str, Any]:
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"no {CONFIG_FILE} in {directory}")
    return read_json_object(path, CheckpointError)


def _read_tensors(directory: Path) -> dict[str, Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {directory}")
    tensors: dict[str, Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                if name in tensors:
                    raise CheckpointError(f"tensor {name!r} appears in more than one file ({path.name})")
                tensors[name] = handle.get_tensor(name)
    return tensors


def load_checkpoint(
    directory: str | Path,
    *,
    device: torch.device,
    dtype: torch.dtype | None = None,
    tokenizer_identity: str | None = None,
) -> Transformer:
    """A `Transformer` with the weights of a Hugging Face Llama-layout checkpoint directory.

    `dtype` defaults to the config's ``dtype``/``torch_dtype`` (float32 if absent). The tokenizer identity
    (part of the fingerprint) is, in order: the argument, ``config.json``'s ``kvnet_tokenizer_identity``, a
    digest of the tokenizer files in the directory; with none of these, `CheckpointError`.
    """
    directory = Path(directory)
    config = _read_config(directory)
    identity = tokenizer_identity or config.get(TOKENIZER_IDENTITY_KEY) or tokenizer_files_identity(directory)
    if not identity:
        raise CheckpointError(
            f"cannot identify the tokenizer of {directory}: no tokenizer files, no tokenizer_identity"
        )
    args = model_args_from_hf_config(config, identity)
    if dtype is None:
        dtype = config_dtype(config)

    model = Transformer(args, device=torch.device("meta"), dtype=dtype)
    expected_shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    tensors = _read_tensors(directory)
    names = hf_tensor_names(args)
    missing = sorted(hf for hf in names if hf not in tensors)
    if missing:
        untied = " (tie_word_embeddings is false)" if "lm_head.weight" in missing else ""
        raise CheckpointError(
            f"checkpoint {directory} lacks {len(missing)} tensor(s){untied}: {', '.join(missing[:8])}"
        )
    head = tensors.get("lm_head.weight")
    if (
        args.tie_embeddings
        and head is not None
        and not torch.equal(head, tensors["model.embed_tokens.weight"])
    ):
        # A tied model computes logits with the embeddings; a different head would be silently dropped.
        raise CheckpointError(
            f"{CONFIG_FILE}: tie_word_embeddings is true but lm_head.weight differs from the embeddings"
        )
    ignored = set(names) | ({"lm_head.weight"} if args.tie_embeddings else set())
    unexpected = sorted(
        name for name in tensors if name not in ignored and not name.endswith(IGNORED_TENSOR_SUFFIXES)
    )
    if unexpected:
        raise CheckpointError(
            f"checkpoint {directory} has {len(unexpected)} tensor(s) kvnet's Llama layout does not use: "
            f"{', '.join(unexpected[:8])}"
        )
    state: dict[str, Tensor] = {}
    for hf_name, our_name in names.items():
        tensor = tensors[hf_name]
        if tuple(tensor.shape) != expected_shapes[our_name]:
            raise CheckpointError(
                f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected {expected_shapes[our_name]}"
            )
        if not tensor.dtype.is_floating_point:
            raise CheckpointError(f"tensor {hf_name!r} has non-float dtype {tensor.dtype}")
        state[our_name] = tensor.to(device=device, dtype=dtype)
    if args.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight  # assign=True replaced the shared Parameter
    return model


def save_checkpoint(model: Transformer, directory: str | Path) -> None:
    """Write `model` as a Hugging Face Llama-layout directory (``config.json`` + ``model.safetensors``)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    args = model.args
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "intermediate_size": args.intermediate_size,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "rope_theta": args.rope_theta,
        "rms_norm_eps": args.norm_eps,
        "tie_word_embeddings": args.tie_embeddings,
        "torch_dtype": str(model.dtype).removeprefix("torch."),
        TOKENIZER_IDENTITY_KEY: args.tokenizer_identity,
    }
    if args.rope_scaling == "llama3":
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": args.rope_scaling_factor,
            "low_freq_factor": args.rope_low_freq_factor,
            "high_freq_factor": args.rope_high_freq_factor,
            "original_max_position_embeddings": args.rope_original_max_seq_len,
        }
    state = model.state_dict()
    tensors = {hf: state[ours].detach().to("cpu").contiguous() for hf, ours in hf_tensor_names(args).items()}
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    config_text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    (directory / CONFIG_FILE).write_text(config_text, encoding="utf-8")
