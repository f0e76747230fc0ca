"""Converting a Llama-architecture GGUF file (llama.cpp's format) into a checkpoint directory kvnet loads.

This module owns the translation from GGUF to the Hugging Face Llama layout that `kvnet.model.checkpoint`
reads: metadata to ``config.json``, tensors (dequantized with the ``gguf`` package, so the values are
exactly llama.cpp's) to ``model.safetensors``, and the GGUF's byte-level BPE vocabulary, merges, special
tokens and chat template to ``tokenizer.json`` + ``tokenizer_config.json`` (built with ``tokenizers``).
Anything it cannot translate faithfully is a `GGUFError` naming the metadata key or tensor.

Two GGUF conventions are undone here: llama.cpp stores the ``attn_q``/``attn_k`` rows of each head
permuted for interleaved-pair RoPE (kvnet and Hugging Face use the rotate-half layout), and a GGUF without
``output.weight`` ties the output head to the token embeddings.

Weights are written in float32 (the dequantized values, bit-exact); ``config.json``'s ``dtype`` names the
dtype the model runs in by default, which is what `load_checkpoint` casts to.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from kvnet.dtypes import DTYPE_BY_NAME
from kvnet.errors import file_exists_error
from kvnet.model.checkpoint import CONFIG_FILE, WEIGHTS_FILE

CONVERTER = "kvnet-gguf-v1"
"""Names this conversion (recorded in ``config.json``); bump it when the output for a given input changes."""
SOURCE_KEY = "kvnet_source"
"""``config.json`` key recording the input file's name and SHA-256 and the converter."""

# GGUF tensor name -> Hugging Face Llama name; "{i}" is the layer index.
_LAYER_TENSORS = {
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# tokenizer.ggml.pre -> whether the pre-tokenizer splits digits one by one before byte-level BPE.
_PRE_TOKENIZERS = {"smollm": True, "gpt-2": False, "gpt2": False, "default": False}
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


class GGUFError(ValueError):
    """The GGUF file cannot be converted faithfully; the message names the key, tensor or digest."""


@dataclass(frozen=True)
class ConversionResult:
    """What `convert_gguf` wrote."""

    directory: Path
    sha256: str
    """SHA-256 of the input file (hex)."""
    num_tensors: int


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _field(reader: Any, key: str, default: Any = ...) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise GGUFError(f"GGUF metadata lacks {key!r}")
        return default
    return field.contents()


def unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's interleaved-pair row order of a q/k projection back to the rotate-half order, per head."""
    rows, cols = weight.shape
    return weight.reshape(n_heads, rows // n_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _llama_config(reader: Any, run_dtype: str) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise GGUFError(f"general.architecture {arch!r} is not supported (only 'llama')")
    for key in ("llama.rope.scaling.type", "llama.attention.sliding_window", "llama.expert_count"):
        value = _field(reader, key, None)
        if value not in (None, "none", 0):
            raise GGUFError(f"GGUF metadata {key} = {value!r} is not supported")
    dim = int(_field(reader, "llama.embedding_length"))
    n_heads = int(_field(reader, "llama.attention.head_count"))
    rope_dims = int(_field(reader, "llama.rope.dimension_count", dim // n_heads))
    if rope_dims != dim // n_heads:
        raise GGUFError(f"llama.rope.dimension_count {rope_dims} != head dim {dim // n_heads} (partial RoPE)")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": dim,
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(_field(reader, "llama.attention.head_count_kv", n_heads)),
        "head_dim": dim // n_heads,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "vocab_size": int(_field(reader, "llama.vocab_size", len(tokens))),
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        },
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id", None),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id", None),
        "dtype": run_dtype,
    }


def _tensors(reader: Any, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    from gguf.quants import dequantize

    names = dict(_GLOBAL_TENSORS)
    for layer in range(config["num_hidden_layers"]):
        names.update({g.format(i=layer): hf.format(i=layer) for g, hf in _LAYER_TENSORS.items()})
    tensors: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        hf_name = names.get(tensor.name)
        if hf_name is None:
            raise GGUFError(f"GGUF tensor {tensor.name!r} has no place in the Llama layout")
        values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        expected = tuple(int(size) for size in reversed(tensor.shape))  # GGUF lists the fastest axis first
        values = values.reshape(expected)
        if tensor.name.endswith("attn_q.weight"):
            values = unpermute_rope_rows(values, config["num_attention_heads"])
        elif tensor.name.endswith("attn_k.weight"):
            values = unpermute_rope_rows(values, config["num_key_value_heads"])
        tensors[hf_name] = torch.from_numpy(np.array(values, order="C", copy=True))  # memmaps are read-only
    missing = sorted(set(names.values()) - set(tensors) - {"lm_head.weight"})
    if missing:
        raise GGUFError(f"GGUF file lacks {len(missing)} Llama-layout tensor(s): {', '.join(missing[:4])}")
    config["tie_word_embeddings"] = "lm_head.weight" not in tensors
    return tensors


def _tokenizer_files(reader: Any, config: dict[str, Any]) -> dict[str, str]:
    """``tokenizer.json`` and ``tokenizer_config.json`` texts rebuilt from the GGUF's tokenizer metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(f"tokenizer.ggml.model {kind!r} is not supported (only byte-level BPE, 'gpt2')")
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise GGUFError(f"tokenizer.ggml.pre {pre!r} is not supported (known: {sorted(_PRE_TOKENIZERS)})")
    tokens: list[str] = list(_field(reader, "tokenizer.ggml.tokens"))
    token_types: list[int] = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(merge.split(" ", 1)) for merge in _field(reader, "tokenizer.ggml.merges")]
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFError("tokenizer.ggml.tokens holds duplicate tokens")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if _PRE_TOKENIZERS[pre]:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [
        AddedToken(token, special=kind == _TOKEN_TYPE_CONTROL, normalized=False)
        for token, kind in zip(tokens, token_types, strict=True)
        if kind in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)
    ]
    tokenizer.add_special_tokens([t for t in specials if t.special])
    tokenizer.add_tokens([t for t in specials if not t.special])

    def token_named(key: str) -> str | None:
        index = _field(reader, key, None)
        return tokens[int(index)] if index is not None else None

    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "bos_token": token_named("tokenizer.ggml.bos_token_id"),
        "eos_token": token_named("tokenizer.ggml.eos_token_id"),
        "pad_token": token_named("tokenizer.ggml.padding_token_id"),
        "unk_token": token_named("tokenizer.ggml.unknown_token_id"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    template = _field(reader, "tokenizer.chat_template", None)
    if template is not None:
        tokenizer_config["chat_template"] = template
    return {
        "tokenizer.json": tokenizer.to_str(pretty=False),
        "tokenizer_config.json": json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n",
    }


def convert_gguf(
    gguf_file: str | Path,
    directory: str | Path,
    *,
    expected_sha256: str | None = None,
    run_dtype: str = "bfloat16",
    overwrite: bool = False,
    progress: Callable[[str], None] = lambda message: None,
) -> ConversionResult:
    """Write a checkpoint directory (config.json, model.safetensors, tokenizer files) from a GGUF file.

    `expected_sha256` (hex), when given, must match the input's digest, checked before anything is parsed.
    The directory appears complete or not at all (written next to it, then renamed into place).
    """
    gguf_file, directory = Path(gguf_file), Path(directory)
    # The converted config names its dtype for load_checkpoint, which accepts the one dtype table's names.
    if run_dtype not in DTYPE_BY_NAME:
        raise GGUFError(f"dtype {run_dtype!r} not in {sorted(DTYPE_BY_NAME)}")
    if not gguf_file.is_file():
        raise GGUFError(f"no GGUF file at {gguf_file}")
    if directory.exists() and not overwrite:
        raise file_exists_error(directory)
    progress(f"hashing {gguf_file.name}")
    sha256 = file_sha256(gguf_file)
    if expected_sha256 is not None and sha256 != expected_sha256.lower():
        raise GGUFError(f"{gguf_file.name}: SHA-256 {sha256} does not match the expected {expected_sha256}")
    from gguf import GGUFReader

    try:
        reader = GGUFReader(gguf_file)
    except (ValueError, OSError, IndexError, KeyError, struct.error) as exc:
        raise GGUFError(f"{gguf_file.name} is not a readable GGUF file: {exc}") from exc
    config = _llama_config(reader, run_dtype)
    progress(f"dequantizing {len(reader.tensors)} tensors")
    tensors = _tensors(reader, config)
    tokenizer_files = _tokenizer_files(reader, config)
    config[SOURCE_KEY] = {"file": gguf_file.name, "sha256": sha256, "converter": CONVERTER}

    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        save_file(tensors, str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
        for name, text in tokenizer_files.items():
            (staging / name).write_text(text, encoding="utf-8")
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", "utf-8")
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    progress(f"wrote {directory}")
    return ConversionResult(directory=directory, sha256=sha256, num_tensors=len(tensors))
