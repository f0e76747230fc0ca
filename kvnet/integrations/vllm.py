"""kvnet as a vLLM KV connector: a vLLM fleet shares prompt prefixes through kvnet relays.

Configure vLLM with::

    kv_transfer_config={"kv_connector": "KvnetConnector",
                        "kv_connector_module_path": "kvnet.integrations.vllm", "kv_role": "kv_both",
                        "kv_connector_extra_config": {"relay": "moqt://HOST:PORT", "ca": "CA.pem", ...}}

(``kvnet.integrations.settings`` lists every extra key; keys default to ``$KVNET_HOME/keys`` as for
kvnet's node commands). vLLM creates one ``KvnetConnector`` in its scheduler and one in each worker; they
talk only through ``KvnetConnectorMetadata``, which travels with every engine step.

Scheduler side (never waits on the network): for a new request it hashes the prompt's full blocks with
kvnet's chain (``kvnet.cache.hashing``, rooted in the engine fingerprint and tenant salt) and starts a
locate on a background event loop that owns its relay session. Until the locate answers,
``get_num_new_matched_tokens`` says "ask again later" (None), so only that request waits; after
``locate_deadline`` seconds it proceeds with what is local. A located run becomes an asynchronous load:
vLLM allocates the blocks and parks the request until the worker reports the load finished.

Worker side: each load is fetched on the worker's own event loop and relay session, verified exactly as
kvnet's nodes verify (``kvnet.node.fetching``: trusted signature, fingerprint, chain hash, token ids,
payload digests), decoded and written into vLLM's paged KV tensors in the layout of the CPU attention kernel
vLLM picked (``kvnet.integrations.cpu_layout``: ``vec``, ``vec16``, ``amx``).
Blocks from the first failure on are reported through ``get_block_ids_with_load_errors`` and recomputed
by vLLM, never used (the connector runs vLLM with ``kv_load_failure_policy="recompute"``). After each
forward, the prompt's newly completed full blocks are copied out at once (so vLLM may reuse them) and
encoded, signed, stored and pushed to the relay in the background; a clean shutdown drains that work,
bounded by ``drain_timeout``.

The wire carries kvnet's canonical per-layer layout, not vLLM's block bytes (docs/vllm.md says why and
what the fingerprint separates). Supported: vLLM's CPU backend, tensor and pipeline parallel size 1, text
prompts without LoRA, multimodal inputs or cache salt (other requests simply do not use kvnet).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import json
import logging
import os
import re
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvnet.blocks.identity import BlockIdentity, prompt_blocks
from kvnet.blocks.signing import TrustStore
from kvnet.cache.hashing import block_hashes, canonical_fingerprint, root_hash
from kvnet.dtypes import dtype_name
from kvnet.integrations.background import BackgroundLoop
from kvnet.integrations.cpu_layout import (
    CPU_LAYOUTS,
    CpuBlockLayout,
    LayoutError,
    cpu_layout,
    cpu_layout_refusal,
)
from kvnet.integrations.model_files import ModelFilesError, tokenizer_digest, weights_digest
from kvnet.integrations.relay_link import ConnectorCounters, RelayLink
from kvnet.integrations.settings import ConnectorSettings, SettingsError
from kvnet.node.config import load_signer_and_trust, tenant_salt_and_namespace
from kvnet.node.publishing import encode_block
from kvnet.security.tenancy import NodeSecret

logger = logging.getLogger(__name__)

SUPPORTED_CPU_KERNELS = tuple(CPU_LAYOUTS)
"""vLLM CPU attention kernels whose KV layout kvnet maps (``kvnet.integrations.cpu_layout``)."""
WIRE_LAYOUT = "kvnet-canonical/v1"
"""Name of the layout blocks travel in (part of the fingerprint)."""
MAX_REMEMBERED_PUBLISHED = 1 << 16
"""Block hashes the scheduler remembers as already published (not published again)."""


# -- engine identity ------------------------------------------------------------------------------


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
    """vLLM's CPU attention kernel, which decides the element order inside its KV tensors."""
    fields: dict[str, str | int]

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
        raise SettingsError(f"kvnet needs the {what} files on disk to fingerprint them: {name}: {exc}") \
            from None


@functools.cache
def _file_digests(model_dir: Path, tokenizer_dir: Path) -> tuple[str, str]:
    # Scheduler and worker usually share a process: read the weights once.
    try:
        return weights_digest(model_dir), tokenizer_digest(tokenizer_dir)
    except (ModelFilesError, OSError) as exc:
        raise SettingsError(f"kvnet: {exc}") from None


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


def engine_identity(vllm_config: Any, settings: ConnectorSettings) -> EngineIdentity:
    """Fingerprint, chain root, namespace and block geometry of this engine; ``SettingsError`` if kvnet
    cannot serve it (another platform, kernel or parallelism than the ones whose layout it knows)."""
    from vllm.platforms import current_platform

    model, cache, parallel = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    if not current_platform.is_cpu():
        raise SettingsError("kvnet's vLLM connector knows the KV layout of vLLM's CPU backend only")
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        raise SettingsError("kvnet's vLLM connector supports tensor and pipeline parallel size 1 only")
    if getattr(model, "use_mla", False):
        raise SettingsError("kvnet's vLLM connector does not carry MLA latent KV caches")
    if getattr(model, "is_hybrid", False) or getattr(model, "is_attention_free", False):
        # Restoring attention KV without the recurrent (Mamba / linear attention) state garbles the output.
        raise SettingsError("kvnet's vLLM connector does not carry the recurrent state of hybrid models")
    block_size = int(cache.block_size)
    head_size = int(model.get_head_size())
    kernel, refusal = cpu_kernel_support(model.dtype, block_size, head_size, cache.cache_dtype)
    if refusal is not None or kernel is None:
        raise SettingsError(refusal or "kvnet: vLLM picked no CPU attention kernel")
    model_dir = _local_dir(model.model, model.revision, "model")
    tokenizer_dir = _local_dir(model.tokenizer, model.tokenizer_revision, "tokenizer")
    weights, tokenizer = _file_digests(model_dir, tokenizer_dir)
    shape = (
        int(model.get_num_layers(parallel)), block_size, int(model.get_num_kv_heads(parallel)), head_size
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
        "kv_layout": f"cpu_attn/{kernel}",
        "wire_layout": WIRE_LAYOUT,
        "tp_size": 1,
        "tp_rank": 0,
    }
    fingerprint = canonical_fingerprint(fields)
    node = settings.node
    secret = NodeSecret.load(node.node_secret) if node.node_secret is not None else None
    salt, namespace = tenant_salt_and_namespace(node.tenant, secret)
    return EngineIdentity(fingerprint, root_hash(fingerprint, salt), namespace, shape, dtype, kernel, fields)


# -- metadata (scheduler -> worker, every step) ------------------------------------------------------


@dataclass(frozen=True)
class LoadJob:
    """Blocks of one request to fetch into the engine blocks vLLM allocated for them, in chain order."""

    req_id: str
    block_ids: tuple[int, ...]
    expected: tuple[BlockIdentity, ...]
    renditions: tuple[str, ...]


@dataclass(frozen=True)
class SaveJob:
    """Full prompt blocks of one request that this step completed: engine block ids and their names."""

    req_id: str
    block_ids: tuple[int, ...]
    sources: tuple[BlockIdentity, ...]


@dataclass
class KvnetConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)


# -- stats through vLLM's connector stats hooks ----------------------------------------------------------


@dataclass
class KvnetConnectorStats(KVConnectorStats):
    """kvnet's counters over one interval (sums of ``ConnectorCounters`` deltas)."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KvnetConnectorStats:
        merged = dict(self.data)
        for key, value in other.data.items():
            merged[key] = merged.get(key, 0) + value
        return KvnetConnectorStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in self.data.items()}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class _CounterReport:
    """Deltas of a ``ConnectorCounters`` for vLLM's stats, and its totals in ``metrics_dir`` (with what
    names this engine's blocks: fingerprint, namespace id, block shape and dtype)."""

    def __init__(self, counters: ConnectorCounters, path: Path | None, identity: EngineIdentity) -> None:
        self.counters = counters
        self.path = path
        self._last = counters.to_json()
        self._identity = {
            "fingerprint": identity.fingerprint.hex(), "namespace_id": identity.namespace_id,
            "block_shape": list(identity.block_shape), "dtype": identity.dtype,
            "kv_layout": identity.fields["kv_layout"],
        }

    def delta(self) -> KvnetConnectorStats | None:
        now = self.counters.to_json()
        changed = {k: v - self._last[k] for k, v in now.items() if v != self._last[k]}
        self._last = now
        return KvnetConnectorStats(data=changed) if changed else None

    def write(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**self._identity, **self.counters.to_json()}, sort_keys=True))
        tmp.replace(self.path)


# -- scheduler side -----------------------------------------------------------------------------------


@dataclass
class _Locate:
    first_block: int
    deadline: float
    future: concurrent.futures.Future[Any]
    decided: list[str] | None = None
    """Once decided: the rendition to fetch for each located block from ``first_block`` on."""


@dataclass
class _Tracked:
    """A request whose computed prompt blocks the connector publishes."""

    prompt: list[int]
    block_ids: list[int]
    saved_blocks: int


class _SchedulerSide:
    def __init__(
        self, settings: ConnectorSettings, identity: EngineIdentity, metrics_dir: Path | None
    ) -> None:
        self.settings = settings
        self.identity = identity
        self.block_size = identity.block_size
        self.loop = BackgroundLoop("kvnet-scheduler")
        self.link = RelayLink(
            settings, identity.fingerprint, identity.namespace_id, identity.block_shape, identity.dtype,
            TrustStore(), _NoCache(), announce=False,
        )
        path = metrics_dir / "scheduler.json" if metrics_dir else None
        self.report = _CounterReport(self.link.counters, path, identity)
        self.hashes: dict[str, list[bytes]] = {}
        self.locates: dict[str, _Locate] = {}
        self.planned: dict[str, tuple[int, list[str]]] = {}
        self.pending_loads: list[LoadJob] = []
        self.loading: set[str] = set()
        self.tracked: dict[str, _Tracked] = {}
        self.published: OrderedDict[bytes, None] = OrderedDict()
        self.eligible_reqs: set[str] = set()
        """Requests kvnet serves (checked in ``matched_tokens``); only their blocks are published."""
        self.loaded_reqs: set[str] = set()
        """Requests that had their one load. vLLM asks again after a failed load (its computed tokens
        went back to 0): offering the same blocks again would fetch and reject them forever."""

    @staticmethod
    def eligible(request: Any) -> bool:
        return (
            request.prompt_token_ids is not None
            and getattr(request, "prompt_embeds", None) is None
            and request.lora_request is None
            and not request.mm_features
            and request.cache_salt is None
        )

    def _hashes(self, req_id: str, prompt: Sequence[int]) -> list[bytes]:
        hashes = self.hashes.get(req_id)
        if hashes is None:
            hashes = self.hashes[req_id] = block_hashes(prompt, self.block_size, self.identity.root)
        return hashes

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.eligible(request):
            return 0, False
        req_id, prompt = request.request_id, request.prompt_token_ids
        self.eligible_reqs.add(req_id)
        if getattr(request, "skip_reading_prefix_cache", False) or req_id in self.loaded_reqs:
            return 0, False
        b = self.block_size
        usable = (len(prompt) - 1) // b  # the last prompt token is always computed (its logits)
        first = num_computed_tokens // b
        if first >= usable:
            return 0, False
        hashes = self._hashes(req_id, prompt)
        locate = self.locates.get(req_id)
        if locate is None:
            future = self.loop.submit(self.link.locate(hashes[first:usable]))
            deadline = time.monotonic() + self.settings.locate_deadline
            self.locates[req_id] = _Locate(first, deadline, future)
            return None, False
        if locate.decided is None:
            if not locate.future.done():
                if time.monotonic() < locate.deadline:
                    return None, False
                locate.future.cancel()
                self.link.counters.locate_deadline_misses += 1
                logger.info("kvnet: locate for %s still pending at its deadline; computing locally", req_id)
                locate.decided = []
            elif locate.future.cancelled() or locate.future.exception() is not None:
                locate.decided = []
            else:
                located = locate.future.result()
                locate.decided = [self.link.best_rendition(r) for r in located.available]
            self.report.write()
        # The local cache may have grown meanwhile; the located run counts from the locate's first block.
        skip = first - locate.first_block
        if skip < 0 or skip >= len(locate.decided):
            return 0, False
        renditions = locate.decided[skip:]
        self.planned[req_id] = (first, renditions)
        return len(renditions) * b, True

    def after_alloc(self, request: Any, block_ids: Sequence[int], num_external_tokens: int) -> None:
        plan = self.planned.pop(request.request_id, None)
        if plan is None or num_external_tokens <= 0:
            return
        first, renditions = plan
        count = min(num_external_tokens // self.block_size, len(renditions))
        stop = first + count
        hashes = self._hashes(request.request_id, request.prompt_token_ids)
        prompt, root = request.prompt_token_ids, self.identity.root
        expected = prompt_blocks(prompt, self.block_size, hashes, root, first, stop)
        job = LoadJob(
            request.request_id, tuple(block_ids[first:stop]), tuple(expected), tuple(renditions[:count])
        )
        self.pending_loads.append(job)

    def build_meta(self, scheduler_output: Any) -> KvnetConnectorMetadata:
        meta = KvnetConnectorMetadata(loads=self.pending_loads)
        self.pending_loads = []
        self.loading.update(job.req_id for job in meta.loads)
        self.loaded_reqs.update(job.req_id for job in meta.loads)
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self.eligible_reqs and new.prompt_token_ids is not None:
                computed, b = new.num_computed_tokens, self.block_size
                track = _Tracked(list(new.prompt_token_ids), list(new.block_ids[0]), computed // b)
                self.tracked[new.req_id] = track
                self._save_due(meta, new.req_id, track, computed + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self.tracked.get(req_id)
            if tracked is None:
                continue
            track = tracked
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                track.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                track.block_ids.extend(new_ids[0])
            self._save_due(meta, req_id, track, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        return meta

    def _save_due(self, meta: KvnetConnectorMetadata, req_id: str, track: _Tracked, computed: int) -> None:
        """Add the prompt blocks that are full once this step's tokens are computed."""
        full = min(computed, len(track.prompt)) // self.block_size
        if full <= track.saved_blocks:
            return
        hashes = self._hashes(req_id, track.prompt)
        b = self.block_size
        ids: list[int] = []
        sources: list[BlockIdentity] = []
        for i in range(track.saved_blocks, min(full, len(track.block_ids))):
            if hashes[i] in self.published:
                self.published.move_to_end(hashes[i])
                continue
            self.published[hashes[i]] = None
            ids.append(track.block_ids[i])
            parent = self.identity.root if i == 0 else hashes[i - 1]
            sources.append(BlockIdentity(hashes[i], parent, tuple(track.prompt[i * b : (i + 1) * b]), i))
        while len(self.published) > MAX_REMEMBERED_PUBLISHED:
            self.published.popitem(last=False)
        track.saved_blocks = full
        if ids:
            meta.saves.append(SaveJob(req_id, tuple(ids), tuple(sources)))

    def finished_transfers(self, finished_recving: Iterable[str]) -> None:
        self.loading.difference_update(finished_recving)

    def request_finished(self, req_id: str) -> bool:
        """Whether vLLM must keep the request's blocks until the worker says its load ended (an abort
        while loading: vLLM frees them when the load is reported finished)."""
        self.hashes.pop(req_id, None)
        self.eligible_reqs.discard(req_id)
        self.loaded_reqs.discard(req_id)
        self.planned.pop(req_id, None)
        self.tracked.pop(req_id, None)
        locate = self.locates.pop(req_id, None)
        if locate is not None and not locate.future.done():
            locate.future.cancel()
        return req_id in self.loading

    def shutdown(self) -> None:
        self.report.write()
        self.loop.stop(self.link.close(), timeout=5.0)


# -- worker side ----------------------------------------------------------------------------------------


class _NoCache:
    """``CacheWriter`` of a side that never fetches (the scheduler only locates)."""

    def begin_import(self, block_hash: bytes) -> bool:
        raise RuntimeError("the scheduler's relay session does not fetch blocks")

    def import_layer(self, block_hash: bytes, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        raise RuntimeError("the scheduler's relay session does not fetch blocks")

    def finish_import(self, block_hash: bytes) -> None:
        pass

    def abort_import(self, block_hash: bytes) -> None:
        pass


class _EngineCache:
    """``CacheWriter`` writing verified layers straight into vLLM's paged KV tensors.

    Each load registers the engine blocks vLLM allocated for its hashes while it runs. Two requests
    loading the same prefix at once get different engine blocks; a verified layer is written into every
    block registered for its hash, which is right for both (the bytes are the block's, checked).
    """

    def __init__(self) -> None:
        self.layout: CpuBlockLayout | None = None
        self.layers: Sequence[torch.Tensor] = ()
        self.targets: dict[bytes, list[int]] = {}

    def register(self, job: LoadJob) -> None:
        for identity, block_id in zip(job.expected, job.block_ids, strict=True):
            self.targets.setdefault(identity.block_hash, []).append(block_id)

    def unregister(self, job: LoadJob) -> None:
        for identity, block_id in zip(job.expected, job.block_ids, strict=True):
            blocks = self.targets.get(identity.block_hash, [])
            if block_id in blocks:
                blocks.remove(block_id)
            if not blocks:
                self.targets.pop(identity.block_hash, None)

    def begin_import(self, block_hash: bytes) -> bool:
        return bool(self.targets.get(block_hash))

    def import_layer(self, block_hash: bytes, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        assert self.layout is not None
        for block_id in self.targets.get(block_hash, ()):
            self.layout.write(self.layers[layer], block_id, k, v)

    def finish_import(self, block_hash: bytes) -> None:
        pass

    def abort_import(self, block_hash: bytes) -> None:
        pass  # reported as a load error: vLLM recomputes the block


def _layer_order(name: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", name))


class _WorkerSide:
    def __init__(
        self, settings: ConnectorSettings, identity: EngineIdentity, metrics_dir: Path | None
    ) -> None:
        self.settings = settings
        self.identity = identity
        signer, self.trust = load_signer_and_trust(settings.node)
        if signer is None:
            raise SettingsError("kvnet: no signing key (give signing_key or key_dir)")
        self.signer = signer
        self.loop = BackgroundLoop("kvnet-worker")
        self.cache = _EngineCache()
        self.link = RelayLink(
            settings, identity.fingerprint, identity.namespace_id, identity.block_shape, identity.dtype,
            self.trust, self.cache, announce=True,
        )
        path = metrics_dir / "worker.json" if metrics_dir else None
        self.report = _CounterReport(self.link.counters, path, identity)
        self.layers: list[torch.Tensor] = []
        self.layout: CpuBlockLayout | None = None
        self.loads: dict[str, concurrent.futures.Future[set[int]]] = {}
        self.load_errors: set[int] = set()
        self.publishing: set[concurrent.futures.Future[None]] = set()

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.layers = [kv_caches[name] for name in sorted(kv_caches, key=_layer_order)]
        num_layers, block_size, heads, head_size = self.identity.block_shape
        kernel = self.identity.kernel
        try:
            layout = cpu_layout(kernel, self.layers[0])
        except LayoutError as exc:
            raise SettingsError(f"kvnet: {exc}") from None
        if len(self.layers) != num_layers or layout != CPU_LAYOUTS[kernel](heads, block_size, head_size):
            raise SettingsError(
                f"kvnet: vLLM's KV tensors ({len(self.layers)} x {tuple(self.layers[0].shape)}) do not match "
                f"the model's geometry {self.identity.block_shape}"
            )
        self.layout = self.cache.layout = layout
        self.cache.layers = self.layers
        self.loop.submit(self._connect())

    async def _connect(self) -> None:
        with contextlib.suppress(ConnectionError):  # connected (and serving) before the first block is due
            await self.link.peer()

    def start_loads(self, jobs: Sequence[LoadJob]) -> None:
        for job in jobs:
            self.loads[job.req_id] = self.loop.submit(self._load(job))

    async def _load(self, job: LoadJob) -> set[int]:
        """Fetch one request's blocks; returns the engine block ids that did not load."""
        assert self.layout is not None
        try:
            self.cache.register(job)
            outcome = await self.link.fetch(job.expected, job.renditions)
            return set(job.block_ids[outcome.loaded :])
        except Exception:
            logger.exception("kvnet: loading blocks for %s failed; recomputing them", job.req_id)
            self.link.counters.blocks_load_failed += len(job.block_ids)
            return set(job.block_ids)
        finally:
            self.cache.unregister(job)
            self.report.write()

    def finished(self) -> set[str] | None:
        """Requests whose load ended (loaded or not): vLLM schedules them, or frees the blocks of those
        that finished meanwhile (the scheduler kept them allocated for the load)."""
        recving: set[str] = set()
        for req_id, future in list(self.loads.items()):
            if future.done():
                del self.loads[req_id]
                self.load_errors |= future.result()
                recving.add(req_id)
        return recving or None

    def take_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors

    def save(self, jobs: Sequence[SaveJob]) -> None:
        """Copy the jobs' blocks out now (vLLM may reuse them after this step) and publish them later."""
        assert self.layout is not None
        layout = self.layout
        for job in jobs:
            copies = []
            for block_id, source in zip(job.block_ids, job.sources, strict=True):
                per_layer = [layout.read(layer, block_id) for layer in self.layers]
                k = torch.stack([kv[0] for kv in per_layer])
                v = torch.stack([kv[1] for kv in per_layer])
                copies.append((k, v, source))
            future = self.loop.submit(self._publish(copies))
            self.publishing.add(future)
            future.add_done_callback(self.publishing.discard)

    async def _publish(self, copies: list[tuple[torch.Tensor, torch.Tensor, BlockIdentity]]) -> None:
        node = self.settings.node

        def encode() -> list[Any]:
            return [
                stored
                for k, v, source in copies
                for stored in encode_block(
                    k, v, source, fingerprint=self.identity.fingerprint, renditions=node.publish_renditions,
                    signer=self.signer,
                )
            ]

        try:
            blocks = await asyncio.to_thread(encode)  # the loop keeps serving the relay meanwhile
            await self.link.publish(blocks, len(copies) * self.identity.block_size)
        except Exception as exc:
            self.link.counters.publish_failures += 1
            logger.warning("kvnet: publishing %d blocks failed: %r", len(copies), exc)
        finally:
            self.report.write()

    async def _drain(self) -> None:
        pending = [asyncio.wrap_future(f) for f in list(self.publishing)]
        if pending:
            logger.info("kvnet: draining %d pending publishes before shutdown", len(pending))
            await asyncio.gather(*pending, return_exceptions=True)
        await self.link.close()

    def stats(self) -> KvnetConnectorStats | None:
        return self.report.delta()

    def shutdown(self) -> None:
        self.loop.stop(self._drain(), timeout=self.settings.drain_timeout)
        self.report.write()
        logger.info("kvnet: connector counters %s", json.dumps(self.link.counters.to_json()))


# -- the connector ---------------------------------------------------------------------------------------


def _log_like_vllm() -> None:
    """Send kvnet's records to vLLM's log handlers (vLLM configures only its own loggers), so an engine's
    log shows kvnet's connects, load failures and shutdown drain."""
    kvnet_logger = logging.getLogger("kvnet")
    vllm_handlers = logging.getLogger("vllm").handlers
    if kvnet_logger.handlers or not vllm_handlers:
        return
    for handler in vllm_handlers:
        kvnet_logger.addHandler(handler)
    kvnet_logger.setLevel(logging.INFO)
    kvnet_logger.propagate = False


class KvnetConnector(KVConnectorBase_V1):
    """vLLM KV connector sharing prompt-prefix KV blocks through kvnet relays (see the module docstring)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _log_like_vllm()
        transfer = vllm_config.kv_transfer_config
        extra = dict(transfer.kv_connector_extra_config or {})
        kvnet_home = os.environ.get("KVNET_HOME")
        is_worker = role == KVConnectorRole.WORKER
        # Only the worker signs and verifies: the scheduler never touches key files.
        settings = ConnectorSettings.from_extra_config(extra, kvnet_home, resolve_key_files=is_worker)
        identity = engine_identity(vllm_config, settings)
        directory = settings.metrics_dir
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
        self._scheduler: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        if is_worker:
            self._worker = _WorkerSide(settings, identity, directory)
        else:
            if transfer.kv_load_failure_policy != "recompute":
                # A block kvnet could not load or verify is a miss, never a reason to fail a request.
                logger.info("kvnet: using kv_load_failure_policy='recompute'")
                transfer.kv_load_failure_policy = "recompute"
            self._scheduler = _SchedulerSide(settings, identity, directory)
        logger.info(
            "kvnet connector (%s): relay %s, fingerprint %s, block %s", role.name, settings.node.relay_url,
            identity.fingerprint.hex()[:16], identity.block_shape,
        )

    # -- worker -----------------------------------------------------------------------------------

    def _worker_side(self) -> _WorkerSide:
        assert self._worker is not None, "worker-side call on the scheduler's connector"
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker_side().register(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, KvnetConnectorMetadata) and meta.loads:
            self._worker_side().start_loads(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: a request runs only after its whole load ended

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # blocks are copied once per step, in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, KvnetConnectorMetadata) and meta.saves:
            self._worker_side().save(meta.saves)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, self._worker_side().finished()  # saves copy out synchronously: nothing to send

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_side().take_load_errors()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        side = self._worker or self._scheduler
        return side.report.delta() if side is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KvnetConnectorStats(data=dict(data or {}))

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # -- scheduler --------------------------------------------------------------------------------

    def _scheduler_side(self) -> _SchedulerSide:
        assert self._scheduler is not None, "scheduler-side call on a worker's connector"
        return self._scheduler

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler_side().matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            self._scheduler_side().after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._scheduler_side().build_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler_side().finished_transfers(connector_output.finished_recving or ())

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_side().request_finished(request.request_id), None
