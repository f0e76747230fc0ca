"""A kvnet inference node: model + paged KV cache + block publishing + prefix fetching.

Owns ``Node``, used by all three processes (``kvnet-publisher``, ``kvnet-subscriber``, ``kvnet-node``), and
``start_node`` / ``build_model`` that make one from a ``NodeConfig`` (``kvnet.node.config``):

* ``Node.publish_prompt`` — prefill a prompt into the paged cache, encode and sign its full blocks in the
  configured renditions, keep them in the bounded ``BlockStore`` and (optionally) PUBLISH them into the
  relay's cache; the ``BlockServer`` keeps answering for them while the node runs.
* ``Node.complete`` — hash the prompt, take local cache hits first, locate the longest remote prefix
  (bounded fan-out search: two round trips up to 4096 blocks), let the KV ABR pick per block a rendition
  or recompute, fetch + verify + load the chosen blocks layer by layer, prefill only the remainder and
  generate. Returns a ``RequestReport`` (``kvnet.node.reports``).

The relay session is a ``RelayPeer`` (``kvnet.exchange.relay_peer``). Model work runs in the batching engine's
worker thread (``kvnet.model.engine``: continuous batching, torch releases the GIL), so the event loop keeps
serving the relay while prompts are computed. The paged cache is locked per operation, not per request: one
request's locate and fetch (on the event loop) overlap other requests' compute, and a request enters the
engine once its remote prefix is loaded. Every request is admitted first against the KV pool
(``EngineBusyError`` when full). Nothing here reads the command line or the environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from kvnet.blocks.identity import BlockIdentity, prompt_blocks
from kvnet.blocks.kvtc_entropy import EntropyProcesses
from kvnet.blocks.transform_codec import TransformCodec
from kvnet.blocks.transform_tables import load_tables
from kvnet.cache.hashing import block_hashes, root_hash
from kvnet.cache.paged_cache import PagedKVCache
from kvnet.dtypes import dtype_from_name, dtype_name
from kvnet.errors import ContextLengthError
from kvnet.exchange.abr import QUALITY_ORDER, AbrConfig, AbrPlan, KvAbr
from kvnet.exchange.blockstore import BlockStore
from kvnet.exchange.config import usable_cores
from kvnet.exchange.fetching import FetchOutcome
from kvnet.exchange.publishing import encode_blocks
from kvnet.exchange.relay_peer import RelayPeer
from kvnet.exchange.tables import TablesSource
from kvnet.model.batching import SchedulerConfig, SequenceFinished, SequenceRequest
from kvnet.model.checkpoint import load_checkpoint
from kvnet.model.engine import Admission, BatchEngine, RequestTooLargeError
from kvnet.model.generate import (
    GREEDY,
    SamplingParams,
    TokenCallback,
    cache_spec_for,
    check_context_length,
)
from kvnet.model.host_memory import keep_freed_memory
from kvnet.model.importance import token_importance
from kvnet.model.registry import default_models_dir, is_registered, resolve_model
from kvnet.model.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from kvnet.model.transformer import Transformer
from kvnet.net.endpoint import freeze_startup_objects
from kvnet.net.reconnect import STABLE_SESSION_S, Backoff
from kvnet.node.config import (
    DEFAULT_CACHE_BYTES,
    MAX_DEFAULT_CACHE_BLOCKS,
    NodeConfig,
    load_signer_and_trust,
    tenant_salt_and_namespace,
)
from kvnet.node.overlap import OverlapResult, fetch_and_compute
from kvnet.node.reports import NodeCounters, PublishReport, RequestReport
from kvnet.node.verification import PrefixBlock, Verification, kv_exact, run_alone, snapshot_prefix
from kvnet.security.signing import Signer, SigningError, TrustStore
from kvnet.security.tenancy import NodeSecret
from kvnet.storage.disk import DiskTier

logger = logging.getLogger(__name__)

CALIBRATION_MIN_RUN_S = 1.0
"""A calibration run at least this long is mostly the prefill's per-token work (``Node.calibrate``): on
SmolLM2 in bfloat16 on an AMX CPU a forward of 32-64 tokens cost 1.8 ms a token against 0.5 ms in one of
512 (small matrix products use the matrix units poorly), so a fit from runs of 0.1 s put a 1024-token
prefill at 2 s where it took 0.74; on the ``bench`` preset (float32) runs up to 128 tokens (0.35 s) put
its slope at 1.9 ms a token, 2.5 in runs of 256-512. A slow CPU still stops after a second."""
CALIBRATION_MAX_TOKENS = 512
"""The longest calibration run, the engine's default step (``DEFAULT_PREFILL_CHUNK``): on a fast CPU well
under a second of start-up."""


def build_model(config: NodeConfig, models_dir: Path) -> tuple[Transformer, Tokenizer]:
    """The model and the tokenizer it reads: a checkpoint directory (``--checkpoint``, or a named trained
    model resolved in `models_dir`) with its own tokenizer, else a built-in preset with the byte tokenizer."""
    device = torch.device(config.device)
    dtype = None if config.dtype is None else dtype_from_name(config.dtype)
    checkpoint = config.checkpoint
    if checkpoint is None and is_registered(config.model):
        checkpoint = resolve_model(config.model, models_dir, progress=logger.info)
    if checkpoint is not None:
        tokenizer = load_tokenizer(checkpoint)
        identity = tokenizer.identity()
        return load_checkpoint(checkpoint, device=device, dtype=dtype, tokenizer_identity=identity), tokenizer
    dtype = dtype or torch.float32
    return Transformer.from_name(config.model, device=device, dtype=dtype, seed=config.seed), ByteTokenizer()


class NodeStartError(ValueError):
    """The node cannot be built from its configuration (model, checkpoint, keys, cache directory); the
    message names what, for a command's one-line error."""


async def start_node(config: NodeConfig, *, calibrate: bool = True) -> Node:
    """Build the node (model load and fingerprint in a thread) and connect it to its relay, if any;
    `NodeStartError` when its configuration cannot be used."""
    logger.info("loading model %s ...", config.checkpoint or config.model)
    torch.set_num_threads(config.torch_threads)
    keep_freed_memory()  # before the model and the cache pool are allocated
    try:
        node = await asyncio.to_thread(Node.from_config, config)
    except (ValueError, OSError, SigningError) as exc:  # e.g. a checkpoint whose files are unusable
        raise NodeStartError(str(exc)) from None
    if calibrate:
        per_token = await asyncio.to_thread(node.calibrate)
        logger.info("model ready: fingerprint %s, prefill %.3f ms/token", node.fingerprint.hex()[:16],
                    per_token * 1e3)
    freeze_startup_objects()
    if config.relay_url is not None:
        await node.connect()
    return node


class Node:
    """Model, paged cache, block store, ABR and (when connected) the relay session of one process."""

    def __init__(
        self,
        config: NodeConfig,
        model: Transformer,
        *,
        tokenizer: Tokenizer | None = None,
        signer: Signer | None = None,
        trust: TrustStore | None = None,
        node_secret: NodeSecret | None = None,
    ) -> None:
        """``node_secret`` derives the tenant's salt and ``namespace_id``, the namespace-id field of our block
        namespace (``NodeConfig.node_secret``); without it that field is the tenant id itself."""
        self.config = config
        self.model = model.eval()
        self.tokenizer: Tokenizer = tokenizer or ByteTokenizer()
        self.device = torch.device(config.device)
        spec = cache_spec_for(model, config.block_size)
        block_bytes = model.args.kv_bytes_per_token(spec.dtype) * config.block_size
        fitting = min(MAX_DEFAULT_CACHE_BLOCKS, max(1, DEFAULT_CACHE_BYTES // block_bytes))
        num_blocks = config.cache_blocks or fitting
        self.cache = PagedKVCache(spec, num_blocks, self.device)
        # The fingerprint hashes every weight: once per process.
        self.fingerprint = model.fingerprint(config.block_size)
        salt, self.namespace_id = tenant_salt_and_namespace(config.tenant, node_secret)
        self.root = root_hash(self.fingerprint, salt)
        disk = None
        if config.cache_dir is not None:
            try:
                disk = DiskTier(config.cache_dir, config.cache_dir_bytes)
            except OSError as exc:
                raise ValueError(f"--cache-dir {config.cache_dir}: {exc.strerror or exc}") from None
        self.store = BlockStore(config.store_bytes, disk)
        self.signer = signer or Signer.generate()
        # Never "accept anything": without a trust store a node trusts only its own key, and accepting
        # other keys takes the explicit config.trust_any (logged loudly by the fetcher).
        self.trust = trust if trust is not None else TrustStore()
        if trust is None:
            self.trust.add(self.signer.public_key)
        self.kvtc_tables = (None if config.kvtc_tables is None
                            else load_tables(config.kvtc_tables, self.fingerprint))
        decoding_kvtc = "kvtc" in config.acceptable_renditions and config.kvtc_decode_processes > 0
        self.tables = TablesSource(
            self.trust, self.fingerprint, self.namespace_id, timeout=config.request_timeout,
            directory=config.cache_dir / "kvtc-tables" if config.cache_dir is not None else None,
            entropy=EntropyProcesses(config.kvtc_decode_processes) if decoding_kvtc else None,
        )
        """kvtc tables: this node's own (served beside its blocks) and those fetched for blocks it loads."""
        if self.kvtc_tables is not None:
            self.tables.publish(self.kvtc_tables, self.signer)
        acceptable = tuple(r for r in QUALITY_ORDER if r in config.acceptable_renditions)
        step_tokens = max(config.max_step_tokens, config.max_running_sequences)
        self.abr = KvAbr(
            AbrConfig(
                acceptable=acceptable,
                prior_throughput_bps=config.prior_throughput_bps,
                allow_recompute=config.abr_mode != "fetch",
                force_recompute=config.abr_mode == "recompute",
                deadline_margin_s=config.fetch_margin,
                kv_dtype=dtype_name(spec.dtype),
                overlap=config.abr_overlap,
                max_step_tokens=step_tokens,
                # Decoding runs on the verify threads, or the event loop's thread without them.
                decode_beside_compute=self.device.type == "cpu"
                and config.torch_threads + max(1, config.fetch_verify_workers) > usable_cores(),
            )
        )
        self.counters = NodeCounters()
        self.engine = BatchEngine(
            self.model, self.cache, root=self.root,
            config=SchedulerConfig(max_running_sequences=config.max_running_sequences,
                                   max_step_tokens=step_tokens),
        )
        """Continuous batching of every request's prefill and decode, with admission against the KV pool."""
        self.peer: RelayPeer | None = None
        """The relay session while it is up (None while disconnected or without a relay)."""
        self.relay_problem: str | None = None
        """Why there is no relay session, while there is none: the last attempt's error or why the last
        session ended. Reports and health say it, so a misconfigured relay (wrong CA, a refused token) is
        not visible only in warnings."""
        self._supervisor: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()

    @classmethod
    def from_config(cls, config: NodeConfig) -> Node:
        model, tokenizer = build_model(config, config.models_dir or default_models_dir({}))
        signer, trust = load_signer_and_trust(config)
        secret = NodeSecret.load(config.node_secret) if config.node_secret is not None else None
        return cls(config, model, tokenizer=tokenizer, signer=signer, trust=trust, node_secret=secret)

    # -- helpers ----------------------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def model_name(self) -> str:
        return self.config.model if self.config.checkpoint is None else self.config.checkpoint.name

    def tokenize_prompt(self, text: str) -> list[int]:
        return self.tokenizer.tokenize(text)

    def check_prompts(self, prompts: Sequence[str], max_new_tokens: int) -> None:
        """`ContextLengthError` or `RequestTooLargeError`, naming the prompt, for the first of ``prompts``
        that cannot run here with ``max_new_tokens`` generated: past the model's context or larger than the
        whole KV pool. One-shot commands check every prompt before any work, so a bad one fails at once."""
        for i, text in enumerate(prompts, 1):
            tokens = len(self.tokenize_prompt(text))
            where = f"prompt {i}/{len(prompts)}"
            try:
                check_context_length(self.model, tokens, max_new_tokens)
            except ContextLengthError as exc:
                raise ContextLengthError(f"{where}: {exc}") from None
            needed = self.engine.admission.blocks_needed(tokens, max_new_tokens)
            if needed > self.engine.admission.num_blocks:
                raise RequestTooLargeError(
                    f"{where}: {tokens} tokens plus {max_new_tokens} new tokens need {needed} KV blocks; "
                    f"the cache has {self.engine.admission.num_blocks} (--cache-blocks)"
                )

    def _background(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def calibrate(self, tokens: int = 64, min_run_s: float = CALIBRATION_MIN_RUN_S) -> float:
        """Warm the kernels and measure local prefill speed for the ABR; returns seconds per token.

        Runs of ``n / 8``, ``n / 2`` and ``n`` tokens (the faster of two of each) give the slope and the
        fixed cost, ``n`` doubled from ``tokens`` (up to ``CALIBRATION_MAX_TOKENS`` and the model's context)
        until one run takes ``min_run_s``: runs of a few milliseconds are mostly fixed cost and timer noise,
        and a slope fitted from two of them was off by 2-4x on a CPU with AMX, which then decided the first
        plans. The short run is there for the fixed cost: a forward's cost is not linear in its tokens
        (SmolLM2 bf16 on one AMX core: 16 tokens 55 ms, 64 75 ms, 256 143 ms, 512 264 ms), and a line
        through 256 and 512 alone puts it at ~20 ms, or at none when one run is slowed, which sizes a
        split's head chunks (``KvAbr.head_chunk_tokens``) at one block. A slow CPU stops at ``tokens``
        (its first run is long enough). Where ``n`` is the engine's step (a fast CPU), a run of ``2 n``
        tokens (two forwards, the second attending to the first's keys; the faster of two) gives the cost
        of attention to cached tokens (``PrefillEstimator.pairs``), which the suffix after a fetched
        prefix and every long prompt pay.

        The runs go through the engine, as requests do, and count its forwards' compute (what
        ``prefill_measured`` gets from requests); nothing is committed to the cache (each run's blocks are
        freed, never matched), and no run is longer than the cache's pool holds (a node started with a
        few blocks calibrates on what fits and answers what fits)."""
        pool_tokens = self.cache.num_blocks * self.block_size
        limit = min(CALIBRATION_MAX_TOKENS, self.model.args.max_seq_len - 1, pool_tokens)
        if limit < 2:  # no two sizes fit: the first requests' runs are the measurements
            return self.abr.prefill.per_token_s
        n = max(min(tokens, limit), 2)

        def run(count: int) -> float:
            ids = tuple((i * 7919) % 256 for i in range(count))
            handle = self.engine.submit(SequenceRequest(ids, 0, commit_prompt=False))
            return handle.future.result().prefill_compute_seconds

        run(n)  # the first run pays one-off kernel set-up
        while run(n) < min_run_s and 2 * n <= limit:
            n *= 2
        sizes = sorted({max(n // 8, 1), n // 2, n})
        room = min(self.model.args.max_seq_len - 1, pool_tokens)
        if 2 * n <= room and self.abr.prefill.forwards(2 * n) > self.abr.prefill.forwards(n):
            sizes.append(2 * n)
        for count in sizes:
            # The faster of two runs of each size: the sizes make the whole fit, and a node starting
            # beside other processes (a cluster's services, a test suite) has a run slowed now and then.
            self.abr.prefill_measured(count, min(run(count), run(count)), calibration=True)
        return self.abr.prefill.per_token_s

    async def _run_sequence(
        self, request: SequenceRequest, on_token: TokenCallback | None
    ) -> SequenceFinished:
        """Run one sequence in the engine; if this request is cancelled (its client went away) the sequence
        is ended too, and a sequence kept for publishing is freed once it ends."""
        handle = self.engine.submit(request, on_token)
        try:
            # Shielded: the engine always resolves the future, so a kept sequence is never lost.
            return await asyncio.shield(asyncio.wrap_future(handle.future))
        except asyncio.CancelledError:
            self.engine.cancel(handle.seq_id)
            if request.keep_sequence:
                handle.future.add_done_callback(lambda _: self._free_sequence(handle.seq_id))
            raise

    def _free_sequence(self, seq_id: int) -> None:
        if self.cache.has_sequence(seq_id):
            self.cache.free_sequence(seq_id)

    async def _encode_and_store(self, ids: list[int], hashes: list[bytes], seq_id: int
                                ) -> tuple[list[Any], float]:
        """Encode and store the blocks of ``hashes`` that the store does not hold yet (their sequence
        ``seq_id`` kept alive by the caller, so they cannot be evicted meanwhile). For kvtc, the attention
        the prompt's last queries give each of its tokens sets that token's steps
        (``kvnet.model.importance``)."""
        started = time.perf_counter()
        first = self.config.publish_renditions[0]
        all_sources = prompt_blocks(ids, self.block_size, hashes, self.root, 0, len(hashes))
        sources = [s for s in all_sources if self.store.peek(s.block_hash, first) is None]
        if not sources:
            # Still refresh the chain so a hot prefix stays in the store.
            self.store.touch_chain([(h, first) for h in hashes])
            return [], time.perf_counter() - started
        importance = None
        if self.kvtc_tables is not None and TransformCodec.name in self.config.publish_renditions:
            importance = await asyncio.to_thread(token_importance, self.model, self.cache,
                                                 self.cache.block_table(seq_id), ids)
        blocks = await asyncio.to_thread(
            encode_blocks,
            self.cache,
            sources,
            fingerprint=self.fingerprint,
            renditions=self.config.publish_renditions,
            signer=self.signer,
            tables=self.kvtc_tables,
            importance=importance,
            digest_algorithm=self.config.payload_digest,
        )
        self.store.put_chain(blocks)
        self.counters.published_blocks += len(sources)
        return blocks, time.perf_counter() - started

    # -- roles ------------------------------------------------------------------------------------

    async def publish_prompt(self, text: str) -> PublishReport:
        """Prefill ``text``, then encode, sign, store and (if connected and enabled) push its full blocks."""
        ids = self.tokenize_prompt(text)
        with self.engine.admit(len(ids), 0):
            started = time.perf_counter()
            request = SequenceRequest(tuple(ids), 0, keep_sequence=True)
            finished = await self._run_sequence(request, None)
            result = finished.result
            prefill_s = time.perf_counter() - started
            hashes = list(result.block_hashes)
            try:
                blocks, encode_s = await self._encode_and_store(ids, hashes, finished.seq_id)
            finally:
                self._free_sequence(finished.seq_id)
        push_s, pushed = 0.0, 0
        if self.peer is not None and self.config.push:
            t = time.perf_counter()
            pushed = await self.peer.push(blocks)
            push_s = time.perf_counter() - t
        return PublishReport(
            prompt_tokens=len(ids),
            computed_tokens=result.computed_tokens,
            blocks=len(hashes),
            objects_bytes=sum(b.nbytes for b in blocks),
            pushed=pushed,
            prefill_s=prefill_s,
            encode_s=encode_s,
            push_s=push_s,
        )

    async def complete(
        self,
        text: str,
        max_tokens: int | None = None,
        *,
        publish: bool = False,
        verify: bool = False,
        use_remote: bool = True,
        prompt_ids: list[int] | None = None,
        sampling: SamplingParams = GREEDY,
        on_token: TokenCallback | None = None,
        admission: Admission | None = None,
    ) -> RequestReport:
        """Answer one prompt reusing every prefix block it can find; see the module docstring.

        ``prompt_ids`` (token ids) replaces ``text`` when given; ``sampling`` and ``on_token`` go to the
        engine (``on_token`` runs in its worker thread). ``admission`` is a reservation the caller already
        holds (``self.engine.admit``, e.g. for several choices of one HTTP request); without one the request
        is admitted here, raising ``EngineBusyError`` when the KV pool is full."""
        max_new = self.config.max_new_tokens if max_tokens is None else max_tokens
        report = RequestReport()
        t0 = time.perf_counter()
        ids = self.tokenize_prompt(text) if prompt_ids is None else list(prompt_ids)
        report.prompt_tokens = len(ids)
        held = admission if admission is not None else self.engine.admit(len(ids), max_new)
        try:
            prefix = await self._complete(
                ids, max_new, report, t0, publish, use_remote, sampling, on_token, keep_prefix=verify
            )
        finally:
            if admission is None:
                held.release()
        if verify:
            found = await asyncio.to_thread(
                self.verify_output, ids, max_new, report.output_token_ids, prefix,
                sampling=sampling, kv_exact=report.kv_exact,
            )
            report.verified = found.verified
            report.equals_recompute = found.equals_recompute
        c = self.counters
        c.requests += 1
        c.prompt_tokens += report.prompt_tokens
        c.local_hit_tokens += report.local_hit_tokens
        c.remote_hit_tokens += report.remote_hit_tokens
        c.computed_tokens += report.computed_tokens
        c.bytes_fetched += report.bytes_fetched
        return report

    async def _complete(
        self, ids: list[int], max_new: int, report: RequestReport, t0: float, publish: bool, use_remote: bool,
        sampling: SamplingParams, on_token: TokenCallback | None, *, keep_prefix: bool = False,
    ) -> list[PrefixBlock]:
        """Serve one request into ``report``; with ``keep_prefix``, return copies of the cached blocks it
        reused (what ``verify_output`` holds in its local-hit reference), else []."""
        b = self.block_size
        hashes = block_hashes(ids, b, self.root)
        usable = max(len(ids) - 1, 0) // b  # the last prompt token is always computed (its logits)
        report.timings.hash_s = time.perf_counter() - t0
        local_blocks = self.cache.match_prefix(hashes[:usable])
        report.local_hit_tokens = local_blocks * b
        # A node told to always recompute has no use for a locate round trip.
        remote = use_remote and self.config.abr_mode != "recompute"
        if self.config.relay_url is not None:
            report.relay_connected = self.peer is not None and self.peer.connected
            if not report.relay_connected:
                why = f" ({self.relay_problem})" if self.relay_problem else ""
                report.fallback.append(f"relay not connected{why}: no remote prefix lookup")
        head: OverlapResult | None = None
        if remote and self.peer is not None and local_blocks < usable:
            skipped = self.abr.skip_locate(b, self.cache.spec.bytes_per_block, usable - local_blocks,
                                           len(ids) - local_blocks * b, context_tokens=local_blocks * b)
            if skipped is None:
                head = await self._remote_prefix(ids, hashes, local_blocks, usable, report)
            else:
                report.abr = skipped
                logger.info("ABR: %s", skipped["locate_skipped"])
        # A kept sequence holds its blocks, so the reused prefix (local hits, fetched blocks and a head
        # computed while the tail was fetched alike) cannot be evicted before it is copied.
        keep = publish or keep_prefix
        request = SequenceRequest(
            tuple(ids), max_new, sampling, frozenset((self.tokenizer.eos_id,)), keep_sequence=keep
        )
        finished = await self._run_sequence(request, on_token)
        gen_done = time.perf_counter()
        result = finished.result
        prefix: list[PrefixBlock] = []
        try:
            if keep_prefix:
                prefix = snapshot_prefix(self.cache, result.block_hashes[: result.cached_tokens // b])
            if result.computed_tokens > 0:
                # The model's cost of this prefill, not the wall time it shared with other sequences.
                self.abr.prefill_measured(result.computed_tokens, finished.prefill_compute_seconds,
                                          context=result.cached_tokens)
            # What the cache actually reused is the truth (a block evicted meanwhile is recomputed).
            hit_tokens = result.cached_tokens
            # A head computed while the tail was fetched is in the cache too, but it is this request's work.
            head_tokens = head_computed = 0
            if head is not None:
                head_tokens = max(min(head.head_end_tokens, hit_tokens) - local_blocks * b, 0)
                head_computed = head.head_computed_tokens
            report.remote_hit_tokens = max(hit_tokens - report.local_hit_tokens - head_tokens, 0)
            if hit_tokens < report.local_hit_tokens:
                report.local_hit_tokens = hit_tokens
            report.computed_tokens = result.computed_tokens + head_computed
            report.timings.prefill_s = result.prefill_seconds
            report.timings.decode_s = result.decode_seconds
            first_token = finished.first_token_time if finished.first_token_time is not None else gen_done
            report.timings.ttft_s = first_token - t0
            report.output_token_ids = list(result.token_ids)
            report.output_text = self.tokenizer.detokenize(result.token_ids)
            if result.token_ids and result.token_ids[-1] == self.tokenizer.eos_id:
                report.finish_reason = "stop"
            if publish:
                blocks, _ = await self._encode_and_store(ids, list(result.block_hashes), finished.seq_id)
                report.published_blocks = len({x.block_hash for x in blocks})
                # Blocks this request fetched came from the relay: pushing them back would only double
                # its ingress.
                fetched = set(hashes[local_blocks : local_blocks + report.remote_hit_tokens // b])
                to_push = [x for x in blocks if x.block_hash not in fetched]
                if to_push and self.peer is not None and self.config.push:
                    # Pushing is an optimisation: it must not delay this request's answer.
                    self._background(self.peer.push(to_push))
        finally:
            if keep:
                self._free_sequence(finished.seq_id)
        report.timings.total_s = gen_done - t0
        return prefix

    def verify_output(
        self, ids: list[int], max_new: int, output: list[int], prefix: Sequence[PrefixBlock] = (), *,
        sampling: SamplingParams = GREEDY, kv_exact: bool = True,
    ) -> Verification:
        """Compare ``output`` with this node's own output for ``ids`` with ``prefix`` (the blocks the request
        reused) held locally, and with a cold recompute; both run alone through this engine's scheduler
        settings in fresh caches (``kvnet.node.verification`` says what each means)."""

        def reference(held: Sequence[PrefixBlock]) -> list[int]:
            return run_alone(
                self.model, self.cache, root=self.root, config=self.engine.config, prompt_ids=ids,
                max_new_tokens=max_new, prefix=held, sampling=sampling,
                stop_token_ids=(self.tokenizer.eos_id,),
            )

        local_hit = reference(prefix)
        recompute = local_hit if not prefix else reference(())
        return Verification(kv_exact=kv_exact, equals_local_hit=output == local_hit,
                            equals_recompute=output == recompute)

    async def _remote_prefix(
        self, ids: list[int], hashes: list[bytes], start: int, usable: int, report: RequestReport
    ) -> OverlapResult | None:
        """Locate, plan and fetch blocks ``start..usable-1`` into the cache (others compute meanwhile); with
        a split plan, compute the head of them in the engine while fetching the tail, and return what that
        did (None without a split)."""
        peer = self.peer
        assert peer is not None
        renditions = list(self.abr.config.acceptable)
        t = time.perf_counter()
        try:
            found = await peer.locate(hashes[start:usable], renditions)
        except Exception as exc:  # the relay is gone or misbehaved: recompute, never fail the request
            logger.warning("locate failed (%r); recomputing the whole prompt", exc)
            report.fallback.append(f"locate failed: {exc!r}")
            report.timings.locate_s = time.perf_counter() - t
            return None
        report.timings.locate_s = time.perf_counter() - t
        located = found.available
        report.located_blocks = len(located)
        report.locate = found.to_json()
        for error, count in found.probe_errors.items():
            # Counted as misses (so recomputed), but not "nobody has it": the report says what failed.
            report.fallback.append(f"locate: {count} probe(s) failed: {error}")
        if not located:
            return None
        plan: AbrPlan = self.abr.plan(
            located, self.block_size, self.cache.spec.bytes_per_block, len(ids) - start * self.block_size,
            context_tokens=start * self.block_size,
        )
        report.abr = plan.to_json()
        if plan.declined_blocks:
            # Once per request, with the inputs: a node that keeps declining hits must be visible.
            probing = f"; probing: fetching {plan.fetch_blocks} to measure again" if plan.probe else ""
            logger.info("ABR %s%s", plan.describe_decline(), probing)
        elif plan.probe:
            logger.info("ABR: fetching all %d located blocks once, to measure the path alone (only split "
                        "tails measured so far, whose rate beside the head's forwards may be below it)",
                        plan.fetch_blocks)
        if plan.fetch_blocks == 0:
            return None
        expected = prompt_blocks(ids, self.block_size, hashes, self.root, start, start + plan.fetch_blocks)
        if plan.compute_blocks:
            return await self._fetch_and_compute(peer, plan, ids, hashes, start, expected, report)
        chosen = [plan.rendition_of(i) for i in range(plan.fetch_blocks)]
        logger.info(
            "located %d of %d missing blocks; fetching %d (%s)", len(located), usable - start,
            plan.fetch_blocks, ",".join(sorted(set(chosen))),
        )
        t = time.perf_counter()
        deadline = self.abr.deadline(asyncio.get_running_loop().time(), self.block_size)
        outcome = await peer.fetch(expected, chosen, deadline)
        report.abandoned = outcome.abandoned
        report.fetch_retries = outcome.retries
        self.counters.fetch_retries += outcome.retries
        report.timings.fetch_s = time.perf_counter() - t
        report.timings.load_s = outcome.load_s
        report.bytes_fetched = outcome.bytes
        report.renditions = dict(outcome.renditions)
        report.kv_exact = kv_exact(outcome.renditions, outcome.untrusted)
        if outcome.error is not None:
            self._fetch_failed(outcome, report)
            msg = (
                f"fetch stopped at block {start + outcome.loaded} of {start + plan.fetch_blocks}: "
                f"{outcome.error}; recomputing from there"
            )
            logger.warning(msg)
            report.fallback.append(msg)
        return None

    def _fetch_failed(self, outcome: FetchOutcome, report: RequestReport) -> None:
        """Count a fetch that ended early and record a refused block as a security event."""
        self.counters.fetch_fallbacks += 1
        if outcome.rejected:
            kind = outcome.rejected_kind or "content"
            self.counters.blocks_rejected += 1
            if kind == "signature":
                self.counters.security_signature_failures += 1
            else:
                self.counters.security_content_failures += 1
            report.security_events.append({"kind": kind, "detail": outcome.error or ""})
            logger.warning("SECURITY: fetched block refused (%s): %s", kind, outcome.error)

    async def _fetch_and_compute(
        self, peer: RelayPeer, plan: AbrPlan, ids: list[int], hashes: list[bytes], start: int,
        expected: list[BlockIdentity], report: RequestReport,
    ) -> OverlapResult:
        """Run a split plan (``kvnet.node.overlap``) and account for it in ``report``."""
        logger.info(
            "located %d blocks; computing the first %d while fetching the other %d (the split moves as "
            "both progress)", plan.fetch_blocks, plan.compute_blocks, plan.fetch_blocks - plan.compute_blocks,
        )

        def fetch(
            exp: list[BlockIdentity], renditions: list[str], out: FetchOutcome,
            on_loaded: Callable[[int], None],
        ) -> Awaitable[FetchOutcome]:
            return peer.fetch(exp, renditions, None, outcome=out, on_loaded=on_loaded,
                              beside_compute=True)

        t = time.perf_counter()
        done = await fetch_and_compute(
            engine=self.engine, fetch=fetch, cached_prefix=self.cache.match_prefix, abr=self.abr, plan=plan,
            ids=ids, hashes=hashes, start=start, expected=expected, block_size=self.block_size,
            block_raw_bytes=self.cache.spec.bytes_per_block,
        )
        if done.head_computed_tokens > 0 and done.head_compute_s > 0:
            self.abr.head_prefill.add(done.head_computed_tokens, done.head_compute_s,
                                      context=done.head_start_tokens)
        outcome = done.fetch
        report.timings.fetch_s = time.perf_counter() - t
        report.timings.load_s = outcome.load_s
        report.bytes_fetched = outcome.bytes
        report.renditions = dict(outcome.renditions)
        # Every block the tail loaded counts, also one the head then reached: which copy the cache kept is
        # not known here. The head's blocks are this node's own K/V.
        report.kv_exact = kv_exact(outcome.renditions, outcome.untrusted)
        report.fetch_retries = outcome.retries
        self.counters.fetch_retries += outcome.retries
        report.head_computed_blocks = done.head_blocks
        report.tail_fetched_blocks = done.fetched_blocks
        report.overlap = done.to_json()
        if outcome.error is not None:
            self._fetch_failed(outcome, report)
            report.fallback.append(f"fetch of the tail stopped: {outcome.error}; the head computed the rest")
        elif done.fetch_given_up:
            report.fallback.append(
                f"the tail did not reach the stopped head within {done.wait_s:.3f}s (what recomputing the "
                "blocks between takes); the request computed them"
            )
        return done

    async def connect(self) -> None:
        """Keep a session with the relay: returns after the first attempt, successful or not, and reconnects
        in the background (``kvnet.net.reconnect.Backoff``) whenever the session is lost or the relay
        sends GOAWAY. The node answers meanwhile, recomputing what it cannot find locally."""
        first_attempt = asyncio.Event()
        self._supervisor = asyncio.get_running_loop().create_task(self._keep_connected(first_attempt))
        await first_attempt.wait()

    async def _keep_connected(self, first_attempt: asyncio.Event) -> None:
        backoff = Backoff()
        redirect: str | None = None
        """Where the last GOAWAY sent us (its New Session URI); the next attempt goes there."""
        while not self._closing.is_set():
            url = redirect or self.config.relay_url
            try:
                peer = await self._open_peer(url)
            except Exception as exc:
                first_attempt.set()
                redirect = None  # a redirect target that cannot be reached: back to the configured relay
                delay = backoff.next_delay()
                self.relay_problem = f"cannot reach relay {url}: {str(exc) or type(exc).__name__}"
                logger.warning("%s; next attempt in %.2f s", self.relay_problem, delay)
                await self._wait_closing(delay)
                continue
            self.peer = peer
            self.relay_problem = None
            self.counters.relay_sessions += 1
            first_attempt.set()
            if self.config.push and self.config.republish_bytes and len(self.store):
                self._background(self._republish(peer))
            started = time.monotonic()
            why = await peer.conn.wait_leaving()
            if self._closing.is_set():
                return
            # Requests see the node as disconnected at once; the old session is let go in the background.
            self.peer = None
            self.relay_problem = f"relay {url}: {why}"
            self._background(peer.abandon())
            # Only a session that lasted resets the backoff: a relay that accepts and at once sends GOAWAY
            # (it is draining) must not be retried in a tight loop.
            lasted = time.monotonic() - started >= STABLE_SESSION_S
            if lasted:
                backoff.reset()
            came_by_redirect, redirect = redirect is not None, peer.redirect
            if redirect is not None and redirect != url and (lasted or not came_by_redirect):
                # Sent to another relay (a rolling restart): go at once; a chain of redirects that each
                # end at once is spaced by the backoff like any short session.
                logger.warning("relay %s: %s; moving to %s", url, why, redirect)
                continue
            delay = backoff.next_delay()
            logger.warning("relay %s: %s; reconnecting in %.2f s", url, why, delay)
            await self._wait_closing(delay)

    async def _open_peer(self, url: str | None) -> RelayPeer:
        """A session to the relay at ``url`` (the configured one, or where a GOAWAY sent us) serving this
        node's store and loading what it fetches into this node's cache."""
        spec = self.cache.spec
        return await RelayPeer.connect(
            self.config.relay_peer_config(url), self.store, self.cache, self.trust, self.abr,
            fingerprint=self.fingerprint, namespace_id=self.namespace_id, block_shape=spec.block_shape,
            dtype=dtype_name(spec.dtype), device=self.device, tables=self.tables,
        )

    async def _republish(self, peer: RelayPeer) -> None:
        """Push what the (maybe restarted, empty) relay of a new session lacks of our store, in the
        background: requests are served meanwhile, and a block asked for before it arrives is routed to
        us by our re-announced namespace."""
        checked, pushed = await peer.republish(self.config.republish_bytes)
        self.counters.republished_blocks += pushed
        logger.info("relay %s: pushed again %d of the %d most recent stored blocks (the rest it had)",
                    peer.url, pushed, checked)

    async def _wait_closing(self, seconds: float) -> None:
        """Sleep ``seconds``, or less if the node is closing."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._closing.wait()

    async def close(self) -> None:
        self._closing.set()
        await asyncio.to_thread(self.engine.close)
        if self._supervisor is not None:
            self._supervisor.cancel()
            await asyncio.gather(self._supervisor, return_exceptions=True)
        for task in list(self._tasks):
            await asyncio.gather(task, return_exceptions=True)
        if self.peer is not None:
            await self.peer.close()
            self.peer = None
        if self.tables.codec.entropy is not None:
            await asyncio.to_thread(self.tables.codec.entropy.close)

    # -- introspection ----------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        st = self.cache.stats()
        return {
            "model": self.model_name,
            "fingerprint": self.fingerprint.hex(),
            "block_size": self.block_size,
            "relay_connected": self.peer is not None and self.peer.connected,
            "relay_problem": self.relay_problem,
            "cache_blocks": st.num_blocks,
            "cached_blocks": st.cached_blocks,
            "store_entries": len(self.store),
        }
