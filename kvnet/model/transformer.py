"""The reference decoder: a small Llama-style transformer in plain torch (gpt-fast shape).

This module owns the architecture (`ModelArgs`, presets, `Transformer` and its blocks), deterministic weight
initialisation and the model fingerprint. It reaches the KV cache only through the attention contexts of
`kvnet.model.attention` (write new K/V, then attend over gathered K/V), so it knows nothing about block pools,
hashing chains, codecs or the network. Checkpoint files are read by `kvnet.model.checkpoint`.

RoPE layout: the "rotate_half" (GPT-NeoX / Hugging Face) layout. Each head vector is split into two halves
``[x1, x2]`` and pair ``i`` is ``(x1[i], x2[i])``, rotated by ``position * inv_freq[i]``. Hugging Face Llama
checkpoints store q/k projection rows already permuted for this layout, so they load verbatim; Meta's original
(interleaved-pair) checkpoints must be converted with Hugging Face's script first.

Determinism: weights come from a seeded CPU `torch.Generator` (then cast and moved to the device), so every
process with the same torch build computes identical weights. The fingerprint includes a SHA-256 digest of
the weights, so nodes whose weights differ for any reason never share KV blocks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvnet.cache.hashing import canonical_fingerprint
from kvnet.model.attention import (
    AttentionContext,
    BatchedPagedAttention,
    BatchSegment,
    ContiguousAttention,
    KVCacheSeam,
    PagedAttention,
)
from kvnet.model.tokenizer import ByteTokenizer

MODEL_FAMILY = "kvnet-llama-v1"
"""Names the forward computation (norm placement, RoPE layout, attention). Bump it when the math changes."""

ROPE_LAYOUT = "rotate_half"
"""See the module docstring."""

ROPE_SCALING_TYPES = ("none", "llama3")
"""Supported `ModelArgs.rope_scaling` values."""

BYTE_TOKENIZER_IDENTITY = ByteTokenizer().identity()


@dataclass(frozen=True)
class ModelArgs:
    """Architecture of a `Transformer`. Validated on construction; derived sizes are properties."""

    dim: int
    """Width of the residual stream (Hugging Face ``hidden_size``)."""
    n_layers: int
    """Number of transformer blocks."""
    n_heads: int
    """Query heads per layer."""
    n_kv_heads: int
    """Key/value heads per layer (GQA when smaller than ``n_heads``); must divide ``n_heads``."""
    intermediate_size: int
    """Hidden width of the SwiGLU feed-forward."""
    vocab_size: int = ByteTokenizer.vocab_size
    """Token ids are ``0..vocab_size-1``."""
    max_seq_len: int = 2048
    """Longest sequence (prompt + generated tokens) the model accepts."""
    rope_theta: float = 10000.0
    """RoPE base."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_scaling: str = "none"
    """RoPE frequency scaling: ``"none"`` or ``"llama3"`` (Llama 3.1 style, parameters below)."""
    rope_scaling_factor: float = 1.0
    """llama3 scaling: divisor of the low frequencies."""
    rope_low_freq_factor: float = 1.0
    """llama3 scaling: wavelengths above ``original_max_seq_len / low_freq_factor`` are scaled fully."""
    rope_high_freq_factor: float = 4.0
    """llama3 scaling: wavelengths below ``original_max_seq_len / high_freq_factor`` are kept."""
    rope_original_max_seq_len: int = 8192
    """llama3 scaling: context length the frequencies were trained for."""
    tie_embeddings: bool = False
    """The output projection shares the token embedding matrix."""
    tokenizer_identity: str = BYTE_TOKENIZER_IDENTITY
    """`Tokenizer.identity()` of the tokenizer this model reads; part of the fingerprint."""

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "intermediate_size", "vocab_size",
                     "max_seq_len", "rope_original_max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelArgs.{name} must be a positive int, got {value!r}")
        if self.dim % self.n_heads != 0:
            raise ValueError(f"ModelArgs.dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"ModelArgs.n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"ModelArgs head_dim (dim / n_heads = {self.head_dim}) must be even for RoPE")
        for name in ("rope_theta", "norm_eps", "rope_scaling_factor"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"ModelArgs.{name} must be a positive finite number, got {value!r}")
        if self.rope_scaling not in ROPE_SCALING_TYPES:
            raise ValueError(
                f"ModelArgs.rope_scaling must be one of {ROPE_SCALING_TYPES}, got {self.rope_scaling!r}"
            )
        if self.rope_scaling == "llama3" and not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
            raise ValueError(
                "ModelArgs.rope_low_freq_factor must be positive and below rope_high_freq_factor, got "
                f"{self.rope_low_freq_factor} and {self.rope_high_freq_factor}"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.n_heads

    @property
    def group_size(self) -> int:
        """Query heads per key/value head."""
        return self.n_heads // self.n_kv_heads

    @property
    def num_parameters(self) -> int:
        """Parameter count (tied embeddings counted once)."""
        attention = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        feed_forward = 3 * self.dim * self.intermediate_size
        per_layer = attention + feed_forward + 2 * self.dim
        embeddings = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return self.n_layers * per_layer + embeddings + self.dim

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K plus V one token occupies across all layers."""
        element_size = torch.empty((), dtype=dtype).element_size()
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * element_size

    @classmethod
    def from_name(cls, name: str) -> ModelArgs:
        """The preset called exactly `name` (see `transformer_configs`)."""
        try:
            return transformer_configs[name]
        except KeyError:
            raise ValueError(f"unknown model preset {name!r}; known: {sorted(transformer_configs)}") from None

    def fingerprint_fields(self) -> dict[str, int | str | float | bytes | bool]:
        """Every architecture field that changes K/V values (``max_seq_len`` does not, so it is left out)."""
        fields: dict[str, int | str | float | bytes | bool] = {
            f"arch.{field.name}": getattr(self, field.name)
            for field in dataclasses.fields(self)
            if field.name != "max_seq_len"
        }
        fields["arch.model_family"] = MODEL_FAMILY
        fields["arch.rope_layout"] = ROPE_LAYOUT
        return fields


transformer_configs: dict[str, ModelArgs] = {
    # ~0.13 M parameters; tests and demos. KV: 512 B/token in float32.
    "tiny": ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=176, max_seq_len=2048),
    # ~3.1 M parameters; examples that want a less trivial model. KV: 4 KiB/token in float32.
    "small": ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, intermediate_size=704, max_seq_len=4096),
    # ~181 M parameters (724 MB float32, 362 MB bfloat16); prefill of 2k tokens is ~0.75 TFLOP, on the
    # order of 10 s on 2 CPU cores; building the seeded weights takes several seconds too. KV: 32 KiB/token
    # in float32, so a 2k-token prompt is ~64 MiB of KV.
    "bench": ModelArgs(
        dim=1024, n_layers=16, n_heads=16, n_kv_heads=4, intermediate_size=2816, max_seq_len=4096,
        rope_theta=500000.0,
    ),
}


def rope_inv_freq(args: ModelArgs, device: torch.device) -> Tensor:
    """Inverse frequencies ``[head_dim / 2]`` (float32), including llama3 scaling when configured."""
    # Same expression as Hugging Face's default RoPE init, so real checkpoints get identical angles.
    exponents = torch.arange(0, args.head_dim, 2, dtype=torch.int64, device=device).float() / args.head_dim
    inv_freq = 1.0 / (args.rope_theta**exponents)
    if args.rope_scaling == "llama3":
        low_freq_wavelen = args.rope_original_max_seq_len / args.rope_low_freq_factor
        high_freq_wavelen = args.rope_original_max_seq_len / args.rope_high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / args.rope_scaling_factor, inv_freq)
        smooth = (args.rope_original_max_seq_len / wavelen - args.rope_low_freq_factor) / (
            args.rope_high_freq_factor - args.rope_low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / args.rope_scaling_factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


def rope_cos_sin(args: ModelArgs, positions: Tensor) -> tuple[Tensor, Tensor]:
    """cos and sin tables ``[T, head_dim]`` (float32) for ``positions: [T]``, in the rotate_half layout."""
    inv_freq = rope_inv_freq(args, positions.device)  # [D/2]
    angles = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    angles = torch.cat((angles, angles), dim=-1)  # [T, D]: both halves of a pair share an angle
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x: [T, H, D]`` by ``cos, sin: [T, D]``; computed in float32, returned in x's dtype."""
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)
    rotated_half = torch.cat((-x2, x1), dim=-1)
    return (x32 * cos[:, None, :] + rotated_half * sin[:, None, :]).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in float32 (as Hugging Face Llama does) so half-precision runs keep the statistics exact.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int) -> None:
        super().__init__()
        self.args = args
        self.layer_id = layer_id
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, context: AttentionContext) -> Tensor:
        # x: [T, dim], cos/sin: [T, head_dim]
        num_tokens, head_dim = x.shape[0], self.args.head_dim
        q = self.wq(x).view(num_tokens, self.args.n_heads, head_dim)
        k = self.wk(x).view(num_tokens, self.args.n_kv_heads, head_dim)
        v = self.wv(x).view(num_tokens, self.args.n_kv_heads, head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = context.attend(self.layer_id, q, k, v)  # [T, n_heads, head_dim]
        return self.wo(out.reshape(num_tokens, self.args.n_heads * head_dim))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.intermediate_size, bias=False)  # gate
        self.w3 = nn.Linear(args.dim, args.intermediate_size, bias=False)  # up
        self.w2 = nn.Linear(args.intermediate_size, args.dim, bias=False)  # down

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args, layer_id)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, context: AttentionContext) -> Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, context)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Llama-style decoder over one sequence at a time (no batch dimension: ``token_ids: [T]``).

    Build with deterministic weights: ``Transformer(args, device=..., dtype=..., seed=0)`` or
    ``Transformer.from_name("tiny", device=...)``. ``device=torch.device("meta")`` builds without storage
    (for `kvnet.model.checkpoint`, which assigns real tensors).
    """

    def __init__(
        self,
        args: ModelArgs,
        *,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if not dtype.is_floating_point:
            raise ValueError(f"Transformer dtype must be a floating point dtype, got {dtype}")
        self.args = args
        # Modules are created on the meta device (no storage, no CPU init work), then materialised.
        with torch.device("meta"):
            self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
            self.layers = nn.ModuleList(TransformerBlock(args, layer_id) for layer_id in range(args.n_layers))
            self.norm = RMSNorm(args.dim, args.norm_eps)
            self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        if device.type != "meta":
            self._init_weights(seed, device, dtype)

    @classmethod
    def from_name(
        cls, name: str, *, device: torch.device, dtype: torch.dtype = torch.float32, seed: int = 0
    ) -> Transformer:
        return cls(ModelArgs.from_name(name), device=device, dtype=dtype, seed=seed)

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_embeddings.weight.dtype

    @torch.no_grad()
    def _init_weights(self, seed: int, device: torch.device, dtype: torch.dtype) -> None:
        # Draw every tensor from one CPU generator in parameter order, in float32, then cast and move:
        # the values do not depend on the target device. Scale 1/sqrt(fan_in) keeps activations O(1) so
        # attention, not only the last token, decides the logits (greedy outputs depend on the context).
        generator = torch.Generator(device="cpu").manual_seed(seed)
        self.to_empty(device=device)
        if self.args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight  # to_empty gave each module its own tensor
        for name, param in self.named_parameters():  # tied weights are yielded once
            if param.ndim == 1:
                values = torch.ones(param.shape)
            elif name == "tok_embeddings.weight":
                values = torch.randn(param.shape, generator=generator)
            else:
                values = torch.randn(param.shape, generator=generator) * param.shape[1] ** -0.5
            param.data = values.to(dtype=dtype, device=device)

    def _blocks(
        self, token_ids: Tensor, positions: Tensor, context: AttentionContext, rows: Tensor | None = None
    ) -> Tensor:
        x = self.tok_embeddings(token_ids)  # [T, dim]
        cos, sin = rope_cos_sin(self.args, positions)  # [T, head_dim] each
        for layer in self.layers:
            x = layer(x, cos, sin, context)
        if rows is not None:
            x = x.index_select(0, rows)  # [R, dim]: only the rows whose logits are wanted
        return self.output(self.norm(x))  # [T or R, vocab]

    def forward(
        self,
        token_ids: Tensor,
        positions: Tensor,
        cache: KVCacheSeam,
        block_table: Tensor,
        slot_mapping: Tensor,
        num_tokens: int | None = None,
    ) -> Tensor:
        """Logits ``[T, vocab]`` for ``token_ids: [T]`` at ``positions: [T]`` (ascending), over a paged cache.

        Each layer writes the new K/V at ``slot_mapping: [T]`` (flat slot ids from
        ``PagedKVCache.append_slots``), then attends over the sequence's K/V gathered through
        ``block_table``. ``num_tokens`` is the context length after this step (default
        ``positions[-1] + 1``; pass it to save a device-to-host sync).
        """
        if token_ids.ndim != 1 or positions.shape != token_ids.shape:
            raise ValueError(
                f"token_ids and positions must be 1-D of equal length, got {tuple(token_ids.shape)} "
                f"and {tuple(positions.shape)}"
            )
        if slot_mapping.shape != token_ids.shape:
            raise ValueError(f"slot_mapping shape {tuple(slot_mapping.shape)} != {tuple(token_ids.shape)}")
        if num_tokens is None:
            num_tokens = int(positions[-1].item()) + 1
        context = PagedAttention(cache, block_table, slot_mapping, positions, num_tokens)
        return self._blocks(token_ids, positions, context)

    def forward_batch(
        self,
        token_ids: Tensor,
        positions: Tensor,
        cache: KVCacheSeam,
        slot_mapping: Tensor,
        segments: Sequence[BatchSegment],
    ) -> Tensor:
        """Logits ``[len(segments), vocab]`` at each segment's last token: several sequences, one forward.

        ``token_ids, positions, slot_mapping: [T]`` are the segments' tokens back to back (a prefill chunk
        or one decode token each); every segment attends over its own sequence through its block table.
        """
        if token_ids.ndim != 1 or positions.shape != token_ids.shape or slot_mapping.shape != token_ids.shape:
            raise ValueError(
                f"token_ids, positions and slot_mapping must be 1-D of equal length, got "
                f"{tuple(token_ids.shape)}, {tuple(positions.shape)} and {tuple(slot_mapping.shape)}"
            )
        expected_start = 0
        for segment in segments:
            if segment.start != expected_start or segment.length <= 0:
                raise ValueError(
                    f"segments must tile the batch without gaps, got {segment.start}+{segment.length}"
                )
            expected_start += segment.length
        if not segments or expected_start != token_ids.shape[0]:
            raise ValueError(f"segments cover {expected_start} tokens, the batch has {token_ids.shape[0]}")
        context = BatchedPagedAttention(cache, slot_mapping, positions, tuple(segments))
        last_rows = torch.tensor([s.start + s.length - 1 for s in segments], device=token_ids.device)
        return self._blocks(token_ids, positions, context, last_rows)

    def forward_context(self, token_ids: Tensor, positions: Tensor, context: AttentionContext) -> None:
        """Run the layers over ``token_ids`` at ``positions`` through a caller's attention context, which
        decides where the K/V come from and go (``kvnet.model.importance.ProbeAttention`` writes nothing),
        for what the context keeps: no logits are computed."""
        no_rows = torch.empty(0, dtype=torch.int64, device=token_ids.device)
        self._blocks(token_ids, positions, context, no_rows)

    def forward_full(self, token_ids: Tensor) -> Tensor:
        """Cache-free reference: logits ``[T, vocab]`` of ``token_ids: [T]`` at positions ``0..T-1``."""
        if token_ids.ndim != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {tuple(token_ids.shape)}")
        positions = torch.arange(token_ids.shape[0], device=token_ids.device)
        return self._blocks(token_ids, positions, ContiguousAttention(positions))

    def weights_digest(self) -> bytes:
        """SHA-256 over all weights: sorted by name, each as (name, dtype, shape, raw little-endian bytes).

        Reads every weight (about a second per GB on CPU): compute it once per process.
        """
        if sys.byteorder != "little":
            raise RuntimeError("weights_digest is defined over little-endian bytes; this host is big-endian")
        digest = hashlib.sha256()
        for name, tensor in sorted(self.state_dict().items()):
            data = tensor.detach().to("cpu").contiguous().reshape(-1)
            for text in (name, str(data.dtype)):
                encoded = text.encode("utf-8")
                digest.update(struct.pack(">I", len(encoded)) + encoded)
            shape = b"".join(struct.pack(">Q", size) for size in tensor.shape)
            digest.update(struct.pack(">I", tensor.ndim) + shape)
            raw = data.view(torch.uint8).numpy()
            digest.update(struct.pack(">Q", raw.nbytes))
            digest.update(memoryview(raw))
        return digest.digest()

    def fingerprint_fields(self) -> dict[str, int | str | float | bytes | bool]:
        """`ModelArgs.fingerprint_fields` plus the dtype, the weights digest and the tokenizer identity."""
        fields = self.args.fingerprint_fields()
        fields["model.dtype"] = str(self.dtype).removeprefix("torch.")
        fields["model.weights_sha256"] = self.weights_digest()
        fields["model.tokenizer"] = self.args.tokenizer_identity
        return fields

    def fingerprint(self, block_size: int) -> bytes:
        """The 32-byte model fingerprint for KV blocks of `block_size` tokens (hashes all weights)."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        fields = self.fingerprint_fields()
        fields["cache.block_size"] = block_size
        return canonical_fingerprint(fields)

    def extra_repr(self) -> str:
        return f"params={self.args.num_parameters}, dtype={self.dtype}"
