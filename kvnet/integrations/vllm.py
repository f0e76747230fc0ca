"""kvnet as a vLLM KV connector: a vLLM fleet shares prompt prefixes through kvnet relays.

Configure vLLM with::

    kv_transfer_config={"kv_connector": "KvnetConnector",
                        "kv_connector_module_path": "kvnet.integrations.vllm", "kv_role": "kv_both",
                        "kv_connector_extra_config": {"relay": "moqt://HOST:PORT", "ca": "CA.pem", ...}}

(``kvnet.integrations.config`` lists every extra key; keys default to ``$KVNET_HOME/keys`` as for
kvnet's node commands). vLLM creates one ``KvnetConnector`` in its scheduler and one in each worker; they
talk only through ``KvnetConnectorMetadata``, which travels with every engine step.

Scheduler side (never waits on the network): for a new request it hashes the prompt's full blocks with
kvnet's chain (``kvnet.cache.hashing``, rooted in the engine fingerprint and tenant salt) and starts a
locate on a background event loop that owns its relay session. Until the locate answers,
``get_num_new_matched_tokens`` says "ask again later" (None), so only that request waits; after
``locate_deadline`` seconds it proceeds with what is local. The located run is loaded as far as loading
beats computing it (kvnet's ABR, ``RelayLink.plan``: ``abr`` ``auto``; ``fetch`` loads it all), judged by
what the worker measured: its fetches and its forwards (``_ForwardTimer``), sent with each step's output
as ``KvnetWorkerMetadata``. The part loaded becomes an asynchronous load: vLLM allocates the blocks and
parks the request until the worker reports the load finished.

Worker side: each load is fetched on the worker's own event loop and relay session, verified exactly as
kvnet's nodes verify (``kvnet.exchange.fetching``: trusted signature, fingerprint, chain hash, token ids,
payload digests), decoded and written into vLLM's paged KV tensors in the layout vLLM picked: on its CPU
backend the CPU attention kernel's (``kvnet.integrations.cpu_layout``: ``vec``, ``vec16``, ``amx``), on
CUDA the FlashAttention, FlashInfer or Triton per-layer view in the KV cache layout vLLM resolved
(``kvnet.integrations.paged_layout``: NHD or HND, bf16 or fp16), through pinned host buffers on side CUDA
streams (``kvnet.integrations.device_path``), finished when the copies' events fire. Each block hash is
fetched once however many requests load it at once: the others wait for that fetch and get the block in
their own engine blocks (``kvnet.integrations.engine_cache``).
Blocks from the first failure on are reported through ``get_block_ids_with_load_errors`` and recomputed
by vLLM, never used (the connector runs vLLM with ``kv_load_failure_policy="recompute"``). After each
forward, the prompt's newly completed full blocks are copied out at once (so vLLM may reuse them) and
encoded, signed, stored and pushed to the relay in the background, at most ``publish_backlog_bytes`` of
copies at a time (beyond it a save is dropped and counted, never waited for); a clean shutdown drains
that work, bounded by ``drain_timeout``. A load that failed part way has the tokens it did not load taken
out of the request's cached-token count, which vLLM fixed when the load was planned.

The wire carries kvnet's canonical per-layer layout, not vLLM's block bytes (docs/vllm.md says why and
what the fingerprint separates). Supported: vLLM's CPU and CUDA platforms (``kvnet.integrations.platforms``
says which backends and dtypes), any tensor-parallel size (each rank publishes and loads its slice of the
KV heads under its own fingerprint; a prefix is offered only where every rank's slice is located),
pipeline parallel size 1, text prompts without LoRA, multimodal inputs or cache salt (other requests
simply do not use kvnet).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvnet.blocks.identity import BlockIdentity, prompt_blocks
from kvnet.cache.hashing import block_hashes
from kvnet.exchange.abr import AbrSample
from kvnet.exchange.publishing import encode_block
from kvnet.integrations.background import BackgroundLoop, BoundedBacklog
from kvnet.integrations.config import ConfigError, ConnectorConfig
from kvnet.integrations.cpu_features import request_amx_tiles
from kvnet.integrations.cpu_layout import (
    CPU_LAYOUTS,
    CpuBlockLayout,
    LayoutError,
    cpu_layout,
)
from kvnet.integrations.device_path import (
    HostBlock,
    PinnedPool,
    PoolTimeoutError,
    StagedLoads,
    Transfer,
    host_block_shape,
    save_blocks,
)
from kvnet.integrations.engine_cache import EngineCache
from kvnet.integrations.paged_layout import PagedLayerLayout
from kvnet.integrations.relay_link import ConnectorCounters, RelayLink, connector_abr
from kvnet.integrations.vllm_identity import SUPPORTED_CPU_KERNELS as SUPPORTED_CPU_KERNELS
from kvnet.integrations.vllm_identity import WIRE_LAYOUT as WIRE_LAYOUT
from kvnet.integrations.vllm_identity import EngineIdentity, attention_backend, engine_identity
from kvnet.integrations.vllm_identity import cpu_kernel_support as cpu_kernel_support
from kvnet.node.config import load_signer_and_trust
from kvnet.security.signing import TrustStore

logger = logging.getLogger(__name__)

MAX_REMEMBERED_PUBLISHED = 1 << 16
"""Block hashes the scheduler remembers as already published (not published again)."""
LOAD_STAGING_BYTES = 256 << 20
"""Pinned host memory (at least 4 blocks) a CUDA worker assembles verified blocks in before loading them."""


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
    scheduled_tokens: int = 0
    """Tokens this step's forward computes (what the worker times it against for the prefill estimate)."""


# -- metadata (worker -> scheduler, every step) ------------------------------------------------------


@dataclass
class KvnetWorkerMetadata(KVConnectorWorkerMetadata):
    """What the worker measured since the last step, for the scheduler's plans: its fetches' throughput,
    round trips, first-byte delays and decode speeds, and its forwards' prefill times."""

    samples: tuple[AbrSample, ...] = ()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KvnetWorkerMetadata:
        extra = other.samples if isinstance(other, KvnetWorkerMetadata) else ()
        return KvnetWorkerMetadata(self.samples + extra)


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

    def __init__(
        self, counters: ConnectorCounters, path: Path | None, identity: EngineIdentity,
        sections: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.counters = counters
        self.path = path
        self._sections = sections
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
        report: dict[str, Any] = {**self._identity, **self.counters.to_json()}
        if self._sections is not None:
            report.update(self._sections())
        tmp.write_text(json.dumps(report, sort_keys=True))
        tmp.replace(self.path)


# -- scheduler side -----------------------------------------------------------------------------------


@dataclass
class _Locate:
    first_block: int
    deadline: float
    future: concurrent.futures.Future[Any] | None
    """The locate running (None: skipped, ``decided`` is empty)."""
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
        self, settings: ConnectorConfig, identity: EngineIdentity, metrics_dir: Path | None
    ) -> None:
        self.settings = settings
        self.identity = identity
        self.block_size = identity.block_size
        self.loop = BackgroundLoop("kvnet-scheduler")
        self.link = RelayLink(
            settings, identity.fingerprint, identity.namespace_id, identity.block_shape, identity.dtype,
            TrustStore(), _NoCache(), announce=False,
            abr=connector_abr(settings, identity.dtype, plans=True),
            locate_fingerprints=identity.rank_fingerprints,
        )
        path = metrics_dir / "scheduler.json" if metrics_dir else None
        self.report = _CounterReport(
            self.link.counters, path, identity, sections=lambda: {"abr": self.link.estimates()}
        )
        self.hashes: dict[str, list[bytes]] = {}
        self.locates: dict[str, _Locate] = {}
        self.planned: dict[str, tuple[int, list[str]]] = {}
        self.pending_loads: list[LoadJob] = []
        self.loading: set[str] = set()
        self.load_requests: dict[str, tuple[Any, LoadJob]] = {}
        """vLLM's request and its load, until the worker reports the load ended."""
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
        if self.settings.node.abr_mode == "recompute":
            return 0, False  # publish only
        b = self.block_size
        usable = (len(prompt) - 1) // b  # the last prompt token is always computed (its logits)
        first = num_computed_tokens // b
        if first >= usable:
            return 0, False
        hashes = self._hashes(req_id, prompt)
        locate = self.locates.get(req_id)
        if locate is None:
            if self.link.skip_locate(req_id, usable - first, len(prompt) - first * b, first * b):
                self.locates[req_id] = _Locate(first, 0.0, None, decided=[])
                self.report.write()
                return 0, False
            future = self.loop.submit(self.link.locate(hashes[first:usable]))
            deadline = time.monotonic() + self.settings.locate_deadline
            self.locates[req_id] = _Locate(first, deadline, future)
            return None, False
        if locate.decided is None:
            assert locate.future is not None
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
                first_token = locate.first_block * b
                locate.decided = self.link.plan(req_id, located, len(prompt) - first_token, first_token)
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
        self.load_requests[request.request_id] = (request, job)

    def build_meta(self, scheduler_output: Any) -> KvnetConnectorMetadata:
        meta = KvnetConnectorMetadata(
            loads=self.pending_loads, scheduled_tokens=scheduler_output.total_num_scheduled_tokens
        )
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

    def measured(self, samples: Sequence[AbrSample]) -> None:
        """The worker's measurements of one step, taken into the estimates the plans use."""
        if samples:
            self.link.abr.absorb(samples)
            self.report.write()

    def finished_transfers(self, finished_recving: Iterable[str], invalid_block_ids: set[int]) -> None:
        """Loads that ended; a load that failed from some block on has the tokens it did not load taken
        out of the request's cached-token count.

        vLLM recomputes from the first failed block (``kv_load_failure_policy="recompute"``), but the
        count it reports (the request's ``num_cached_tokens``, the OpenAI usage's ``cached_tokens``) was
        fixed when the load was planned, and is set again only when no token was left computed."""
        for req_id in finished_recving:
            self.loading.discard(req_id)
            request, job = self.load_requests.pop(req_id, (None, None))
            if job is None or not invalid_block_ids:
                continue
            failed = [i for i, block_id in enumerate(job.block_ids) if block_id in invalid_block_ids]
            if failed:
                self._uncount_failed_tokens(request, job, failed[0] * self.block_size)

    def _uncount_failed_tokens(self, request: Any, job: LoadJob, loaded_tokens: int) -> None:
        failed_tokens = len(job.block_ids) * self.block_size - loaded_tokens
        self.link.counters.tokens_load_failed += failed_tokens
        self.report.write()
        stats = getattr(request, "prefill_stats", None)  # None once vLLM reported the request's first output
        if stats is None:
            return
        stats.set(
            num_prompt_tokens=stats.num_prompt_tokens,
            num_local_cached_tokens=stats.num_local_cached_tokens,
            num_external_cached_tokens=max(0, stats.num_external_cached_tokens - failed_tokens),
        )

    def request_finished(self, req_id: str) -> bool:
        """Whether vLLM must keep the request's blocks until the worker says its load ended (an abort
        while loading: vLLM frees them when the load is reported finished)."""
        self.hashes.pop(req_id, None)
        self.eligible_reqs.discard(req_id)
        self.loaded_reqs.discard(req_id)
        self.planned.pop(req_id, None)
        self.tracked.pop(req_id, None)
        if req_id not in self.loading:
            self.load_requests.pop(req_id, None)
        locate = self.locates.pop(req_id, None)
        if locate is not None and locate.future is not None and not locate.future.done():
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


class _ForwardTimer:
    """Times the engine's forwards against the tokens each computes: the prefill samples the scheduler
    weighs loading a located prefix against computing it with (``KvAbr.prefill_measured``).

    A forward runs from ``bind_connector_metadata`` (vLLM binds the step's metadata just before it) to
    ``wait_for_save`` (just after). Only forwards of at least ``min_tokens`` (a block: a prefill chunk
    is in them) are samples; a step of a few decodes would pull the fitted per-token cost towards a
    decode's. On CUDA the forward's kernels are only queued when ``wait_for_save`` comes, so each end is
    a timing event on the compute stream, read once it has fired (a later step)."""

    MAX_PENDING = 64
    """CUDA forwards whose end has not fired yet kept at once (more: the oldest are dropped)."""

    def __init__(self, min_tokens: int) -> None:
        self.min_tokens = min_tokens
        self._started: tuple[int, float | torch.cuda.Event] | None = None
        self._done: list[tuple[int, float]] = []
        self._pending: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []

    def start(self, tokens: int, stream: torch.cuda.Stream | None) -> None:
        self._started = None
        if tokens < self.min_tokens:
            return
        if stream is None:
            self._started = (tokens, time.perf_counter())
        else:
            event = torch.cuda.Event(enable_timing=True)
            event.record(stream)
            self._started = (tokens, event)

    def stop(self, stream: torch.cuda.Stream | None) -> None:
        started, self._started = self._started, None
        if started is None:
            return
        tokens, begin = started
        if isinstance(begin, float):
            self._done.append((tokens, time.perf_counter() - begin))
            return
        assert stream is not None
        end = torch.cuda.Event(enable_timing=True)
        end.record(stream)
        self._pending.append((tokens, begin, end))
        del self._pending[: -self.MAX_PENDING]

    def take(self) -> list[tuple[int, float]]:
        """Forwards timed since the last call: ``(tokens, seconds)``."""
        while self._pending and self._pending[0][2].query():
            tokens, begin, end = self._pending.pop(0)
            self._done.append((tokens, begin.elapsed_time(end) / 1e3))
        done, self._done = self._done, []
        return done


def _layer_order(name: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", name))


class _WorkerSide:
    def __init__(
        self, settings: ConnectorConfig, identity: EngineIdentity, metrics_dir: Path | None
    ) -> None:
        self.settings = settings
        self.identity = identity
        # vLLM's amx kernel runs AMX tile instructions in this process without asking Linux first.
        amx = identity.platform == "cpu" and identity.kernel == "amx"
        if amx and (why := request_amx_tiles()) is not None:
            logger.warning("kvnet: %s; vLLM's amx attention kernel will die of SIGILL", why)
        signer, self.trust = load_signer_and_trust(settings.node)
        if signer is None:
            raise ConfigError("kvnet: no signing key (give signing_key or key_dir)")
        self.signer = signer
        self.loop = BackgroundLoop("kvnet-worker")
        counters = ConnectorCounters()
        self.cache = EngineCache(counters)
        self.link = RelayLink(
            settings, identity.fingerprint, identity.namespace_id, identity.block_shape, identity.dtype,
            self.trust, self.cache, announce=identity.publishes, counters=counters,
            abr=connector_abr(settings, identity.dtype, plans=False),
        )
        self.forwards = _ForwardTimer(min_tokens=identity.block_size)
        # With tensor parallelism every rank runs the same forward: rank 0's timings are the step's, and
        # every rank's would count each step once per rank in the scheduler's prefill estimate.
        self.times_forwards = identity.tp_rank == 0
        # One file per tensor-parallel rank: worker.json (rank 0), worker-1.json, ...
        name = "worker.json" if identity.tp_rank == 0 else f"worker-{identity.tp_rank}.json"
        path = metrics_dir / name if metrics_dir else None
        self.report = _CounterReport(
            self.link.counters, path, identity,
            sections=lambda: {"blocks_loaded_by_rendition": dict(self.link.blocks_loaded_by_rendition)},
        )
        self.layers: list[torch.Tensor] = []
        self.layout: CpuBlockLayout | PagedLayerLayout | None = None
        self.save_pool: PinnedPool | None = None
        """On CUDA: the pinned host buffers saves are copied into (None: copies on the CPU path)."""
        self.compute_stream: torch.cuda.Stream | None = None
        """On CUDA: the stream vLLM's forward runs on, which loads and saves are ordered after."""
        self.loads: dict[str, concurrent.futures.Future[set[int]]] = {}
        self.claims: dict[bytes, asyncio.Future[None]] = {}
        """Block hashes some running load is fetching, done when its fetch ended: a load that wants one
        waits for it (the block is then copied into its own engine block) instead of fetching it again."""
        self.load_errors: set[int] = set()
        self.backlog = BoundedBacklog(self.loop, settings.publish_backlog_bytes, "kvnet publish backlog")

    def register(
        self, kv_caches: dict[str, torch.Tensor], layer_view_order: Sequence[int] | None = None
    ) -> None:
        """Take vLLM's per-layer KV tensors; on CUDA ``layer_view_order`` is the memory order of their
        logical ``[B, H, N, C]`` axes in the KV cache layout vLLM resolved."""
        self.layers = [kv_caches[name] for name in sorted(kv_caches, key=_layer_order)]
        num_layers, block_size, heads, head_size = self.identity.block_shape
        layout: CpuBlockLayout | PagedLayerLayout
        try:
            if layer_view_order is None:
                layout = cpu_layout(self.identity.kernel, self.layers[0])
                expected: object = CPU_LAYOUTS[self.identity.kernel](heads, block_size, head_size)
            else:
                # Every layer is checked: in block-outermost layouts each is its own strided view.
                paged = {PagedLayerLayout.of(layer, layer_view_order, head_size) for layer in self.layers}
                if len(paged) != 1:
                    raise LayoutError("vLLM's KV layers do not all share one layout")
                layout = paged.pop()
                if layout.block_size != block_size:
                    raise LayoutError(
                        f"vLLM splits each {block_size}-token block into kernel blocks of "
                        f"{layout.block_size} tokens, which kvnet does not map (set the block size to "
                        f"{layout.block_size})"
                    )
                expected = PagedLayerLayout(heads, block_size, head_size, layout.physical_order)
        except LayoutError as exc:
            raise ConfigError(f"kvnet: {exc}") from None
        if len(self.layers) != num_layers or layout != expected:
            raise ConfigError(
                f"kvnet: vLLM's KV tensors ({len(self.layers)} x {tuple(self.layers[0].shape)}) do not match "
                f"the model's geometry {self.identity.block_shape}"
            )
        self.layout = self.cache.layout = layout
        self.cache.layers = self.layers
        if isinstance(layout, PagedLayerLayout):
            self._use_device_path(layout)
        self.loop.submit(self._connect())

    def _use_device_path(self, layout: PagedLayerLayout) -> None:
        """Route loads and saves through pinned host buffers and side streams (``device_path``)."""
        shape = host_block_shape(layout, len(self.layers))
        dtype = self.layers[0].dtype
        self.on_forward_thread()
        saves = max(1, self.settings.publish_backlog_bytes // self.block_bytes())
        self.save_pool = PinnedPool(saves, shape, dtype)
        loads = PinnedPool(max(4, LOAD_STAGING_BYTES // self.block_bytes()), shape, dtype)
        self.cache.staged = StagedLoads(layout, self.layers, loads, after=lambda: self.compute_stream)

    def on_forward_thread(self) -> None:
        """Called from vLLM's forward thread each step: remember the stream it computes on."""
        device = self.layers[0].device if self.layers else None
        if device is not None and device.type == "cuda":  # CPU tensors (tests): plain copies, no stream
            self.compute_stream = torch.cuda.current_stream(device)

    async def _connect(self) -> None:
        with contextlib.suppress(ConnectionError):  # connected (and serving) before the first block is due
            await self.link.peer()

    def start_loads(self, jobs: Sequence[LoadJob]) -> None:
        for job in jobs:
            self.loads[job.req_id] = self.loop.submit(self._load(job))

    async def _load(self, job: LoadJob) -> set[int]:
        """Fetch one request's blocks; returns the engine block ids that did not load.

        Each block hash is fetched by one load at a time: the blocks another load is fetching are waited
        for and shared into this request's engine blocks (``EngineCache.share``); any that did not come
        that way (the other fetch failed there) are then fetched here."""
        assert self.layout is not None
        hashes = [identity.block_hash for identity in job.expected]
        loop = asyncio.get_running_loop()
        mine = [i for i, h in enumerate(hashes) if h not in self.claims]
        waits = [self.claims[h] for h in hashes if h in self.claims]
        for i in mine:
            self.claims[hashes[i]] = loop.create_future()
        try:
            self.cache.register(hashes, job.block_ids)
            try:
                if mine:
                    await self._fetch(job, mine)
            finally:
                for i in mine:
                    self.cache.share(hashes[i])
                    self.claims.pop(hashes[i]).set_result(None)
            fetched = set(mine)  # counted by the fetch
            if waits:
                await asyncio.gather(*waits)
                missing = [i for i, h in enumerate(hashes) if not self.cache.holds(h, job.block_ids[i])]
                if missing:
                    await self._fetch(job, missing)
                fetched.update(missing)
            loaded = next(
                (i for i, h in enumerate(hashes) if not self.cache.holds(h, job.block_ids[i])), len(hashes)
            )
            shared = sum(1 for i in range(loaded) if i not in fetched)
            self.link.counters.blocks_loaded += shared
            self.link.counters.tokens_loaded += shared * self.identity.block_size
            return set(job.block_ids[loaded:])
        except Exception:
            logger.exception("kvnet: loading blocks for %s failed; recomputing them", job.req_id)
            self.link.counters.blocks_load_failed += len(job.block_ids)
            return set(job.block_ids)
        finally:
            staged = self.cache.staged
            if staged is not None:
                # The request is reported done (and may run, or recompute its failed blocks) only once
                # every copy into its blocks has landed.
                await asyncio.to_thread(staged.wait, job.block_ids)
            self.cache.unregister(hashes, job.block_ids)
            self.report.write()

    async def _fetch(self, job: LoadJob, indices: Sequence[int]) -> None:
        """Fetch the job's blocks at ``indices`` (in chain order) into its engine blocks."""
        await self.link.fetch([job.expected[i] for i in indices], [job.renditions[i] for i in indices])

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

    def block_bytes(self) -> int:
        """Bytes of one block's K and V copied out of the engine (what the publish backlog holds)."""
        return self.link.block_raw_bytes

    def save(self, jobs: Sequence[SaveJob]) -> None:
        """Copy the jobs' blocks out now (vLLM may reuse them after this step) and publish them later.

        A job that does not fit in the publish backlog is dropped (counted) before anything is copied:
        the forward pass never waits for the relay. A rank that does not publish (MLA, ranks > 0: rank 0
        publishes the same latent) copies nothing."""
        assert self.layout is not None
        if not self.identity.publishes:
            return
        if self.save_pool is not None:
            self._save_staged(jobs, self.save_pool)
            return
        layout = self.layout
        for job in jobs:

            def copy_out(job: SaveJob = job) -> Coroutine[Any, Any, None]:
                copies = []
                for block_id, source in zip(job.block_ids, job.sources, strict=True):
                    per_layer = [layout.read(layer, block_id) for layer in self.layers]
                    k = torch.stack([kv[0] for kv in per_layer])
                    v = torch.stack([kv[1] for kv in per_layer])
                    copies.append((k, v, source))
                return self._publish(copies)

            if self.backlog.offer(len(job.block_ids) * self.block_bytes(), copy_out) is None:
                self.link.counters.blocks_save_dropped += len(job.block_ids)
                self.report.write()

    def _save_staged(self, jobs: Sequence[SaveJob], pool: PinnedPool) -> None:
        """The CUDA save: each job's blocks gathered on the save stream into pinned host buffers, read
        (encoded) once the copy's event fired, then given back."""
        assert self.layout is not None
        layout = self.layout
        for job in jobs:

            def copy_out(job: SaveJob = job) -> Coroutine[Any, Any, None]:
                held, transfer = save_blocks(
                    layout, self.layers, list(job.block_ids), pool, timeout=0, after=self.compute_stream
                )
                # vLLM may reuse the blocks from the next step on: its writes queue behind the copy out.
                transfer.before(self.compute_stream)
                return self._publish_host(held, transfer, job.sources)

            try:
                offered = self.backlog.offer(len(job.block_ids) * self.block_bytes(), copy_out)
            except PoolTimeoutError:
                offered = None
            if offered is None:
                self.link.counters.blocks_save_dropped += len(job.block_ids)
                self.report.write()

    async def _publish_host(
        self, held: list[HostBlock], transfer: Transfer, sources: Sequence[BlockIdentity]
    ) -> None:
        try:
            await asyncio.to_thread(transfer.wait)
            await self._publish([(h.k, h.v, source) for h, source in zip(held, sources, strict=True)])
        finally:
            if held:
                held[0].pool.release(held)

    async def _publish(self, copies: list[tuple[torch.Tensor, torch.Tensor, BlockIdentity]]) -> None:
        node = self.settings.node

        def encode() -> list[Any]:
            return [
                stored
                for k, v, source in copies
                for stored in encode_block(
                    k, v, source, fingerprint=self.identity.fingerprint, renditions=node.publish_renditions,
                    signer=self.signer, digest_algorithm=node.payload_digest,
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
        pending = [asyncio.wrap_future(f) for f in self.backlog.pending()]
        if pending:
            logger.info("kvnet: draining %d pending publishes before shutdown", len(pending))
            await asyncio.gather(*pending, return_exceptions=True)
        await self.link.close()

    def stats(self) -> KvnetConnectorStats | None:
        return self.report.delta()

    def measurements(self) -> KvnetWorkerMetadata | None:
        """What was measured since the last step, for the scheduler (forwards timed, fetches sampled)."""
        timed = self.forwards.take()
        if self.times_forwards:
            for tokens, seconds in timed:
                self.link.abr.prefill_measured(tokens, seconds)
            self.link.counters.forwards_timed += len(timed)
        samples = self.link.abr.take_samples()
        return KvnetWorkerMetadata(samples) if samples else None

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
        settings = ConnectorConfig.from_extra_config(extra, kvnet_home, resolve_key_files=is_worker)
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
        worker = self._worker_side()
        if worker.identity.platform == "cpu":
            worker.register(kv_caches)
            return
        backend = attention_backend(self._vllm_config)
        if backend != worker.identity.kernel:
            raise ConfigError(f"kvnet: the layers use attention backend {backend}, the engine announced "
                              f"{worker.identity.kernel}")
        layout = self._vllm_config.cache_config.get_resolved_kv_cache_layout()
        worker.register(kv_caches, layout.layer_view_order)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KvnetConnectorMetadata):
            self._worker.on_forward_thread()
            self._worker.forwards.start(connector_metadata.scheduled_tokens, self._worker.compute_stream)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker_side().on_forward_thread()
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
        worker = self._worker_side()
        worker.on_forward_thread()
        worker.forwards.stop(worker.compute_stream)
        meta = self._get_connector_metadata()
        if isinstance(meta, KvnetConnectorMetadata) and meta.saves:
            self._worker_side().save(meta.saves)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, self._worker_side().finished()  # saves copy out synchronously: nothing to send

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_side().take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker_side().measurements()

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
        measured = connector_output.kv_connector_worker_meta
        if isinstance(measured, KvnetWorkerMetadata):
            self._scheduler_side().measured(measured.samples)
        self._scheduler_side().finished_transfers(
            connector_output.finished_recving or (), set(connector_output.invalid_block_ids or ())
        )

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_side().request_finished(request.request_id), None
