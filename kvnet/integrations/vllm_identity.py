"""What names a vLLM engine's blocks on kvnet, and whether kvnet can serve it at all.

``engine_identity`` checks the engine vLLM configured (platform, parallelism, MLA or hybrid models, the
attention kernel and KV cache dtype, through ``kvnet.integrations.platforms`` and the layout modules) and
derives its ``EngineIdentity``: the fingerprint (engine and version, weight and tokenizer digests, dtype, KV
layout, wire layout, tensor-parallel size and rank), the chain root salted by the tenant, the namespace id
and the block geometry. Scheduler and worker compute it separately and must agree.
``kvnet.integrations.vllm`` is the connector that uses it; this module only asks vLLM about its
configuration.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import vllm

from kvnet.cache.hashing import canonical_fingerprint, root_hash
from kvnet.dtypes import dtype_name
from kvnet.integrations.config import ConfigError, ConnectorConfig
from kvnet.integrations.cpu_layout import CPU_LAYOUTS, cpu_layout_refusal
from kvnet.integrations.model_files import ModelFilesError, tokenizer_digest, weights_digest
from kvnet.integrations.paged_layout import PAGED_DTYPES
from kvnet.integrations.platforms import (
    cache_dtype_refusal,
    gpu_backend_refusal,
    platform_name,
    platform_refusal,
)
from kvnet.node.config import tenant_salt_and_namespace
from kvnet.security.tenancy import NodeSecret

SUPPORTED_CPU_KERNELS = tuple(CPU_LAYOUTS)
"""vLLM CPU attention kernels whose KV layout kvnet maps (``kvnet.integrations.cpu_layout``)."""
WIRE_LAYOUT = "kvnet-canonical/v1"
"""Name of the layout blocks travel in (part of the fingerprint)."""
MLA_KV_KIND = "mla_latent"
"""The fingerprint's ``kv_kind`` of an MLA model's blocks: latents, not K/V (``MlaLatentLayout``)."""


@dataclass(frozen=True)
class EngineIdentity:
    """What names this engine's blocks on the network."""

    fingerprint: bytes
    root: bytes
    namespace_id: str
    """The tenant field of the block namespace."""
    block_shape: tuple[int, int, int, int]
    """``(num_layers, block_size, num_kv_heads, head_size)``."""
    dtype: str
    kernel: str
    """vLLM's CPU attention kernel, or on CUDA its attention backend (``FLASH_ATTN``, ...): what decides
    the element order inside its KV tensors."""
    fields: dict[str, str | int]
    platform: str = "cpu"
    """vLLM's platform (``cpu`` or ``cuda``): which layout module and copy path the worker uses."""
    rank_fingerprints: tuple[bytes, ...] = ()
    """The fingerprint of every tensor-parallel rank (``fingerprint`` is this rank's): a prefix is there to
    load only when every rank's slice of its blocks is (the scheduler locates them all). An MLA model's
    ranks share one fingerprint."""
    tp_rank: int = 0

    @property
    def publishes(self) -> bool:
        """This rank publishes the blocks it computes. MLA: rank 0 only, as every rank holds the same
        latent; every rank loads rank 0's blocks."""
        return self.tp_rank == 0 or self.fields.get("kv_kind") != MLA_KV_KIND

    @property
    def block_size(self) -> int:
        return self.block_shape[1]


def _local_dir(name: str, revision: str | None, what: str) -> Path:
    path = Path(name)
    if path.is_dir():
        return path
    try:  # a hub name that is already downloaded: its snapshot directory, without any network access
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=name, revision=revision, local_files_only=True))
    except Exception as exc:
        raise ConfigError(f"kvnet needs the {what} files on disk to fingerprint them: {name}: {exc}") \
            from None


@functools.cache
def _file_digests(model_dir: Path, tokenizer_dir: Path) -> tuple[str, str]:
    # Scheduler and worker usually share a process: read the weights once.
    try:
        return weights_digest(model_dir), tokenizer_digest(tokenizer_dir)
    except (ModelFilesError, OSError) as exc:
        raise ConfigError(f"kvnet: {exc}") from None


def cpu_kernel_support(
    dtype: torch.dtype, block_size: int, head_size: int, cache_dtype: str
) -> tuple[str | None, str | None]:
    """The CPU attention kernel vLLM picks on this machine for this geometry, and why kvnet cannot map it
    (one line) or None. The kernel is None when vLLM itself refuses the configuration."""
    from vllm.utils.torch_utils import is_quantized_kv_cache
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    if is_quantized_kv_cache(str(cache_dtype)):
        # Quantized caches carry scales next to the values: not a layout kvnet converts.
        reason = f"kvnet's vLLM connector does not carry quantized KV caches (kv_cache_dtype {cache_dtype!r})"
        return None, reason
    try:
        kernel = _get_attn_isa(dtype, block_size, head_size, cache_dtype)
    except NotImplementedError as exc:
        return None, f"vLLM has no CPU attention kernel for this configuration: {exc}"
    return kernel, cpu_layout_refusal(kernel, block_size, head_size)


def attention_backend(vllm_config: Any) -> str:
    """The attention backend vLLM chose for this model's layers (as NixlConnector asks for it), on any
    platform; one backend for every layer, or ``ConfigError``."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

    names = sorted({backend.get_name() for backend in get_current_attn_backends(vllm_config)})
    if len(names) != 1:
        raise ConfigError(f"kvnet's vLLM connector needs one attention backend for all layers, not {names}")
    return names[0]


def cpu_mla_support(vllm_config: Any) -> tuple[str | None, str | None]:
    """The MLA attention backend vLLM picked on the CPU, and why kvnet cannot map its latent cache (one
    line) or None."""
    refusal = cache_dtype_refusal(str(vllm_config.cache_config.cache_dtype))
    if refusal is not None:
        return None, refusal
    backend = attention_backend(vllm_config)
    refusal = cpu_layout_refusal(backend, int(vllm_config.cache_config.block_size), 0)
    if refusal is not None and backend == "AMX_MLA":
        refusal += " (start vLLM with --attention-backend CPU_MLA)"
    return backend, refusal


def gpu_kernel_support(vllm_config: Any) -> tuple[str, str | None]:
    """The attention backend vLLM picked on CUDA, and why kvnet cannot map its KV (one line) or None."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    if model.dtype not in PAGED_DTYPES:
        return "", f"kvnet's vLLM connector carries bfloat16 or float16 KV on CUDA, not {model.dtype}"
    refusal = cache_dtype_refusal(str(cache.cache_dtype))  # before asking which backend reads fp8
    if refusal is not None:
        return "", refusal
    backend = attention_backend(vllm_config)
    return backend, gpu_backend_refusal(backend)


def engine_identity(vllm_config: Any, settings: ConnectorConfig) -> EngineIdentity:
    """Fingerprint, chain root, namespace and block geometry of this engine; ``ConfigError`` if kvnet
    cannot serve it (another platform, kernel or parallelism than the ones whose layout it knows)."""
    from vllm.platforms import current_platform

    model, cache, parallel = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    platform = platform_name(current_platform)
    refused = platform_refusal(platform)
    if refused is not None:
        raise ConfigError(refused)
    if parallel.pipeline_parallel_size != 1:
        raise ConfigError("kvnet's vLLM connector supports pipeline parallel size 1 only")
    tp_size = int(parallel.tensor_parallel_size)
    # vLLM sets the rank in each worker before it makes the worker's connector; the scheduler's is rank 0.
    # With pipeline parallel size 1 (and one engine per data-parallel rank) it is the tensor-parallel rank.
    tp_rank = int(getattr(parallel, "rank", 0)) % tp_size
    mla = bool(getattr(model, "use_mla", False))
    if mla and platform != "cpu":
        raise ConfigError("kvnet's vLLM connector does not carry MLA latent KV caches")
    if getattr(model, "is_hybrid", False) or getattr(model, "is_attention_free", False):
        # Restoring attention KV without the recurrent (Mamba / linear attention) state garbles the output.
        raise ConfigError("kvnet's vLLM connector does not carry the recurrent state of hybrid models")
    block_size = int(cache.block_size)
    head_size = int(model.get_head_size())
    if mla:
        kernel, refusal = cpu_mla_support(vllm_config)
        kv_layout = f"cpu_attn/{kernel}"
    elif platform == "cpu":
        kernel, refusal = cpu_kernel_support(model.dtype, block_size, head_size, cache.cache_dtype)
        kv_layout = f"cpu_attn/{kernel}"
    else:
        kernel, refusal = gpu_kernel_support(vllm_config)
        kv_layout = f"{platform}/{kernel}"
    if refusal is not None or not kernel:
        raise ConfigError(refusal or "kvnet: vLLM picked no attention kernel")
    model_dir = _local_dir(model.model, model.revision, "model")
    tokenizer_dir = _local_dir(model.tokenizer, model.tokenizer_revision, "tokenizer")
    weights, tokenizer = _file_digests(model_dir, tokenizer_dir)
    num_layers = int(model.get_num_layers(parallel))
    # A latent travels as one head whose K and V are its two halves (``MlaLatentLayout``).
    shape = (num_layers, block_size, 1, head_size // 2) if mla else (
        num_layers, block_size, int(model.get_num_kv_heads(parallel)), head_size
    )
    dtype = dtype_name(model.dtype)
    fields: dict[str, str | int] = {
        "engine": "vllm",
        "engine_version": vllm.__version__,
        "weights": weights,
        "tokenizer": tokenizer,
        "dtype": dtype,
        "kv_cache_dtype": str(cache.cache_dtype),
        "block_size": block_size,
        "kv_layout": kv_layout,
        "wire_layout": WIRE_LAYOUT,
    }
    if mla:
        # Every rank holds the whole latent: one fingerprint whatever the parallelism, published by rank 0.
        fields["kv_kind"] = MLA_KV_KIND
        rank_fingerprints = (canonical_fingerprint(fields),) * tp_size
    else:
        # Each rank holds its slice of the KV heads and publishes it as tracks of its own fingerprint; the
        # block chain is rank 0's, so every rank (and the scheduler) names a prompt's blocks alike.
        fields.update(tp_size=tp_size, tp_rank=tp_rank)
        rank_fingerprints = tuple(canonical_fingerprint({**fields, "tp_rank": r}) for r in range(tp_size))
    node = settings.node
    secret = NodeSecret.load(node.node_secret) if node.node_secret is not None else None
    salt, namespace = tenant_salt_and_namespace(node.tenant, secret)
    return EngineIdentity(
        rank_fingerprints[tp_rank], root_hash(rank_fingerprints[0], salt), namespace, shape, dtype, kernel,
        fields, platform, tuple(dict.fromkeys(rank_fingerprints)), tp_rank,
    )
