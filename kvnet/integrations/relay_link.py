"""An engine's session to its kvnet relay that comes and goes with the relay.

Owns ``RelayLink``: a ``RelayPeer`` (``kvnet.exchange.relay_peer``, the relay session nodes use too: block
server + verified fetcher) opened on first use and reopened after the relay went away or sent GOAWAY,
failed attempts spaced by the reconnect policy of nodes and edges (``kvnet.net.reconnect.Backoff``), so a
dead relay costs a request one failed attempt, not a connect timeout each. It also owns the engine's
publisher-side ``BlockStore`` (what the relay may ask us for), the side's ``KvAbr`` (``connector_abr``:
the scheduler's plans which located blocks to load, the worker's keeps what its fetches measure) and
``ConnectorCounters``, which every locate, plan, fetch and publish here counts into. The session runs
on one event loop (``BackgroundLoop``); the scheduler plans on the engine's thread, reading estimates
that locates on that loop also feed (single float updates). Nothing here knows the engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import torch

from kvnet.blocks.identity import BlockIdentity
from kvnet.exchange.abr import AbrConfig, KvAbr, quality_rank
from kvnet.exchange.blockstore import BlockStore, StoredBlock
from kvnet.exchange.fetching import CacheWriter, FetchOutcome, raw_bytes
from kvnet.exchange.locate import Located
from kvnet.exchange.publishing import PushResult
from kvnet.exchange.relay_peer import RelayPeer
from kvnet.integrations.config import ConnectorConfig
from kvnet.net.reconnect import Backoff
from kvnet.security.signing import TrustStore

logger = logging.getLogger(__name__)



def connector_abr(settings: ConnectorConfig, dtype: str, *, plans: bool) -> KvAbr:
    """The ABR of one side of an engine connector. The scheduler's ``plans``: it decides, per request, which
    located blocks to load and which to compute (the ``abr`` key: ``auto``; ``fetch`` loads them all;
    under ``recompute`` the scheduler never locates). Prefix loads only, as vLLM's API has them. The
    worker's loads what was planned, gives up the rest of a load that falls behind computing it (``auto``
    only: the fetch deadline and its mid-fetch re-plan, ``KvAbr.deadline``; the engine then computes
    those blocks) and keeps what it measures (``KvAbr.keep_samples``) for the scheduler's estimates."""
    node = settings.node
    acceptable = tuple(sorted(node.acceptable_renditions, key=quality_rank))
    abr = KvAbr(AbrConfig(
        acceptable=acceptable, prior_throughput_bps=node.prior_throughput_bps, kv_dtype=dtype, overlap=False,
        allow_recompute=node.abr_mode != "fetch", deadline_margin_s=node.fetch_margin,
    ))
    if not plans:
        abr.keep_samples()
    return abr


class RelayUnavailable(ConnectionError):
    """No session to the relay right now (it refused, timed out, or failed within the retry interval)."""


@dataclass
class ConnectorCounters:
    """What the connector did, cumulative (``to_json`` for files and logs, deltas for the engine's stats)."""

    locates: int = 0
    locate_failures: int = 0
    """Locates that got no answer (relay down, session lost, timeout)."""
    locate_deadline_misses: int = 0
    """Requests that went ahead with what was local because their locate was still pending."""
    locate_seconds: float = 0.0
    blocks_located: int = 0
    tokens_located: int = 0
    loads: int = 0
    blocks_loaded: int = 0
    tokens_loaded: int = 0
    bytes_fetched: int = 0
    blocks_fetched: int = 0
    """Blocks fetched and imported whole: one per block hash in flight, however many loads wanted it."""
    blocks_shared: int = 0
    """Engine blocks beyond the first that one fetched block filled (concurrent loads of a prefix)."""
    fetch_seconds: float = 0.0
    blocks_load_failed: int = 0
    """Blocks the worker did not load (vLLM recomputes them)."""
    tokens_load_failed: int = 0
    """(Scheduler) tokens offered to vLLM whose load failed: recomputed, and taken out of the request's
    cached-token count."""
    load_failures_signature: int = 0
    """Blocks refused because no trusted key signed them."""
    load_failures_content: int = 0
    """Signed blocks whose manifest or payload disagreed with the prompt (poisoning or corruption)."""
    load_failures_transfer: int = 0
    """Fetches that failed for the network (relay down, timeout, block gone)."""
    loads_abandoned: int = 0
    """Fetches given up part way because the blocks still to come would arrive later than computing them
    (``abr: auto``: the fetch deadline or its mid-fetch re-plan); vLLM computes those blocks."""
    blocks_published: int = 0
    """Blocks encoded, signed and kept in the store (served to the relay on request)."""
    tokens_published: int = 0
    blocks_pushed: int = 0
    """Block tracks (one per rendition) the relay accepted: PUBLISH_OK came and their objects were sent."""
    push_failures_refused: int = 0
    """Block tracks the relay refused (REQUEST_ERROR to PUBLISH: it holds them already, or takes none)."""
    push_failures_transfer: int = 0
    """Block tracks not pushed for the network (no session to the relay, or it ended mid-push)."""
    blocks_save_dropped: int = 0
    """Computed blocks neither published nor pushed: the publish backlog was full when they were saved."""
    publish_failures: int = 0
    """Saves whose encoding, signing or storing failed (their blocks are neither published nor pushed)."""
    locates_skipped: int = 0
    """(Scheduler) requests that did not look for remote blocks: measured, no fetch could beat computing
    them (``KvAbr.skip_locate``)."""
    hits_declined: int = 0
    """(Scheduler) located prefixes the ABR declined in part or in whole: computing was estimated faster."""
    blocks_declined: int = 0
    """(Scheduler) located blocks not loaded because computing them was estimated faster."""
    probes: int = 0
    """(Scheduler) loads of blocks the estimates declined, made to measure the path again."""
    forwards_timed: int = 0
    """(Worker, tensor-parallel rank 0 only) forwards timed as prefill samples for the scheduler's plans."""

    def to_json(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def count_load_failure(self, outcome: FetchOutcome) -> str:
        """Count a fetch that stopped early; returns the reason counted."""
        if outcome.rejected:
            reason = "signature" if outcome.rejected_kind == "signature" else "content"
        else:
            reason = "transfer"
        setattr(self, f"load_failures_{reason}", getattr(self, f"load_failures_{reason}") + 1)
        return reason


@dataclass
class RelayLink:
    """The engine's relay session, its block store and its counters (used on one event loop only)."""

    settings: ConnectorConfig
    fingerprint: bytes
    namespace_id: str
    block_shape: tuple[int, int, int, int]
    """``(num_layers, block_size, num_kv_heads, head_size)`` of one block."""
    dtype: str
    trust: TrustStore
    cache: CacheWriter
    """Where fetched blocks go (the engine's paged KV)."""
    announce: bool
    """Serve our store to the relay (the worker does; a scheduler that only locates does not)."""
    abr: KvAbr
    """The estimates: the scheduler's plans (``connector_abr``), the worker's fetches feed."""
    locate_fingerprints: tuple[bytes, ...] = ()
    """Whose tracks a located block must be under: every tensor-parallel rank's (the scheduler's link);
    empty: ``fingerprint``'s alone."""
    backoff: Backoff = field(default_factory=Backoff)
    """Spaces failed connect attempts (reset by a successful one)."""
    counters: ConnectorCounters = field(default_factory=ConnectorCounters)
    blocks_loaded_by_rendition: Counter[str] = field(default_factory=Counter)
    """Loaded blocks by the rendition they came in (the worker's metrics file)."""
    store: BlockStore = field(init=False)
    block_raw_bytes: int = field(init=False)
    """Bytes of one block's K and V in the engine's dtype (``block_shape``)."""
    _peer: RelayPeer | None = field(default=None, init=False)
    _retry_at: float = field(default=0.0, init=False)
    _connecting: asyncio.Task[RelayPeer] | None = field(default=None, init=False)
    _attempt_started: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        self.store = BlockStore(self.settings.node.store_bytes)
        self.block_raw_bytes = raw_bytes(self.block_shape, self.dtype)

    @property
    def acceptable(self) -> tuple[str, ...]:
        return self.abr.config.acceptable

    async def peer(self, *, since: float | None = None) -> RelayPeer:
        """The open session, opening it when there is none; ``RelayUnavailable`` when that fails.

        The attempt runs as its own task: a caller that gives up (a request past its locate deadline) does
        not cancel it, and every caller meanwhile waits for the same attempt. ``since`` (a
        ``time.monotonic()`` stamp) is for callers that know the relay was reachable then (a fetch of blocks
        the scheduler has just located): when the attempt they joined had begun before it and fails, one
        new attempt is made at once, backoff or not. An attempt begun while the relay was down can outlive
        its coming back (QUIC's handshake retransmits back off) and says nothing about it now.
        """
        try:
            return await self._join_attempt()
        except RelayUnavailable:
            if since is None or self._attempt_started >= since:
                raise
            self._retry_at = 0.0
            return await self._join_attempt()

    async def _join_attempt(self) -> RelayPeer:
        if self._peer is not None and self._peer.connected:
            return self._peer
        if self._connecting is None or self._connecting.done():
            if time.monotonic() < self._retry_at:
                raise RelayUnavailable(f"relay {self.settings.node.relay_url} is unreachable")
            self._attempt_started = time.monotonic()
            self._connecting = asyncio.get_running_loop().create_task(self._connect())
        return await asyncio.shield(self._connecting)

    async def _connect(self) -> RelayPeer:
        if self._peer is not None:
            await self._peer.abandon()  # a session the relay ended or is taking away (GOAWAY)
            self._peer = None
        node = self.settings.node
        try:
            self._peer = await RelayPeer.connect(
                node.relay_peer_config(), self.store, self.cache, self.trust, self.abr,
                fingerprint=self.fingerprint, namespace_id=self.namespace_id, block_shape=self.block_shape,
                dtype=self.dtype, device=torch.device("cpu"), announce=self.announce,
                locate_fingerprints=self.locate_fingerprints,
            )
        except Exception as exc:  # any failure to connect means: no relay for now
            self._retry_at = time.monotonic() + self.backoff.next_delay()
            logger.warning("kvnet: cannot reach relay %s (%s)", node.relay_url, exc)
            raise RelayUnavailable(f"relay {node.relay_url} is unreachable: {exc}") from None
        self.backoff.reset()
        return self._peer

    async def locate(self, hashes: Sequence[bytes]) -> Located:
        """The leading run of ``hashes`` available in an acceptable rendition (counted)."""
        started = time.perf_counter()
        self.counters.locates += 1
        try:
            peer = await self.peer()
            found = await peer.locate(list(hashes), list(self.acceptable))
        except Exception:
            self.counters.locate_failures += 1
            raise
        finally:
            self.counters.locate_seconds += time.perf_counter() - started
        self.counters.blocks_located += len(found.available)
        self.counters.tokens_located += len(found.available) * self.block_shape[1]
        return found

    def skip_locate(self, req_id: str, blocks: int, total_tokens: int, context_tokens: int = 0) -> bool:
        """Whether a request missing ``blocks`` full blocks (``total_tokens`` to prefill without them, after
        ``context_tokens`` cached) need not look for them: measured, no fetch could beat computing them
        (``KvAbr.skip_locate``; counted, logged with its inputs)."""
        block_size = self.block_shape[1]
        skipped = self.abr.skip_locate(block_size, self.block_raw_bytes, blocks, total_tokens, context_tokens)
        if skipped is None:
            return False
        self.counters.locates_skipped += 1
        logger.info("kvnet: %s: %s", req_id, skipped["locate_skipped"])
        return True

    def plan(self, req_id: str, located: Located, total_tokens: int, context_tokens: int = 0) -> list[str]:
        """The renditions to load for the leading located blocks that beat computing them (``KvAbr.plan``;
        ``total_tokens``: what prefill processes with nothing loaded, after ``context_tokens`` cached). A
        plan that declines blocks is counted and logged once with its inputs."""
        plan = self.abr.plan(located.available, self.block_shape[1], self.block_raw_bytes, total_tokens,
                             context_tokens=context_tokens)
        if plan.declined_blocks:
            self.counters.hits_declined += 1
            self.counters.blocks_declined += plan.declined_blocks
            probing = f"; probing: loading {plan.fetch_blocks} to measure again" if plan.probe else ""
            logger.info("kvnet: %s: ABR %s%s", req_id, plan.describe_decline(), probing)
        self.counters.probes += plan.probe
        return [plan.rendition_of(i) for i in range(plan.fetch_blocks)]

    def estimates(self) -> dict[str, float]:
        """What the plans are made from now, and from how many samples (the scheduler's metrics file)."""
        abr = self.abr
        return {
            **abr.inputs(), "first_byte_s": abr.first_byte_s(),
            "throughput_samples": abr.throughput.samples, "prefill_samples": len(abr.prefill.samples),
        }

    async def fetch(self, expected: Sequence[BlockIdentity], renditions: Sequence[str]) -> FetchOutcome:
        """Fetch, verify and load ``expected`` in chain order into ``cache`` (counted)."""
        started = time.perf_counter()
        self.counters.loads += 1
        try:
            peer = await self.peer(since=time.monotonic())  # the scheduler located these a moment ago
            deadline = self.abr.deadline(asyncio.get_running_loop().time(), self.block_shape[1])
            outcome = await peer.fetch(list(expected), list(renditions), deadline)
        except RelayUnavailable as exc:
            outcome = FetchOutcome(error=str(exc))
        self.counters.fetch_seconds += time.perf_counter() - started
        self.counters.blocks_loaded += outcome.loaded
        self.blocks_loaded_by_rendition.update(outcome.renditions)
        self.counters.tokens_loaded += outcome.loaded * self.block_shape[1]
        self.counters.bytes_fetched += outcome.bytes
        if outcome.abandoned is not None:
            self.counters.loads_abandoned += 1
            self.counters.blocks_load_failed += len(expected) - outcome.loaded
            logger.info("kvnet: load of %d blocks given up after %d: %s", len(expected), outcome.loaded,
                        outcome.abandoned)
        elif outcome.error is not None:
            reason = self.counters.count_load_failure(outcome)
            self.counters.blocks_load_failed += len(expected) - outcome.loaded
            logger.warning("kvnet: %s load failure: %s; recomputing from there", reason, outcome.error)
        return outcome

    async def publish(self, blocks: Sequence[StoredBlock], tokens: int) -> None:
        """Keep ``blocks`` in the store (served on request) and push them into the relay's cache."""
        self.store.put_chain(list(blocks))
        self.counters.blocks_published += len({b.block_hash for b in blocks})
        self.counters.tokens_published += tokens
        if not self.settings.node.push or not blocks:
            return
        try:
            peer = await self.peer()
        except RelayUnavailable:
            self.counters.push_failures_transfer += len(blocks)
            return
        results = await peer.server.push_each(list(blocks)) if peer.connected else []
        accepted = sum(result is PushResult.ACCEPTED for result in results)
        refused = sum(result is PushResult.REFUSED for result in results)
        lost = len(blocks) - accepted - refused
        self.counters.blocks_pushed += accepted
        self.counters.push_failures_refused += refused
        self.counters.push_failures_transfer += lost
        if lost:
            logger.warning("kvnet: %d of %d block tracks not pushed: the relay session ended", lost,
                           len(blocks))

    async def close(self) -> None:
        """Wait for what was sent to be acknowledged (bounded by the caller), then end the session."""
        if self._peer is not None:
            await self._peer.close()
            self._peer = None

