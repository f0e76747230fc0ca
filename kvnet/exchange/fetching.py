"""Subscriber side of kvnet: locate the longest cached prefix, fetch it, verify it, load it.

Owns:

* ``verify_manifest`` — every check a block must pass before any of its bytes touch the cache: canonical
  manifest, signature by a trusted key, fingerprint, block hash, parent hash, chain rule
  ``block_hash == hash_block(parent, tokens)``, token ids equal to the subscriber's own prompt slice, and
  the shape/dtype/codec it expects. Payload digests are checked per layer object as it arrives.
* ``BlockFetcher`` — over a ``MoqtConnection``: ``locate`` runs the bounded fan-out search of
  ``kvnet.exchange.locate`` with TRACK_STATUS probes (TRACK_STATUS moves no payload, so nothing past the first
  miss is pulled) and ``fetch`` pipelines FETCHes of the chosen prefix with a window bounded in bytes,
  verifying, decoding and importing each layer as it arrives. A hole the search could not see (a block
  evicted below a probed hit) fails its FETCH, which ends the usable prefix there like any other fetch
  failure.

One request over several sessions (``--fetch-connections``) is ``kvnet.exchange.striping``: each session's
``BlockFetcher`` fetches its share exactly as below, and the fetchers of one cache share their coalescing.

Where the time goes (profiled on the bench preset, 2 cores): the transport's per-packet work dominates,
and the per-layer work (the payload's digest and the decode: ~2.5 ms per raw MB for ``lossless``'s zstd
and plane join, ~1.5 for ``plain``'s copy with SHA-256 digests, ~0.4 less with BLAKE3's, on one core here)
runs either on the event loop as each layer arrives (``verify_workers=0``) or on a bounded pool of
``verify_workers`` threads (blake3, hashlib, zstd and numpy release the GIL inside their calls), a block's
layers per task, while the loop keeps reading the network. A ``kvtc`` layer is predicted from the block's
layer before as decoded (kvnet.blocks.transform_tables): a task entropy-decodes its layers first (on the
codec's entropy processes where it has them, kvnet.blocks.kvtc_entropy: the coder holds the GIL, so a
fetch that may get kvtc has a thread per process even where it decodes other renditions on the loop),
then waits for the task before it in the block to hand over its last layer, and rebuilds its own in order.
The default pool is sized to the host's cores (``auto_verify_workers``: none on 2 cores, where it
measured no faster and cost 5-12% more CPU per MB; docs/performance.md, "Verify and decode off the event
loop"). A cache that lends its slots on the CPU (``PagedKVCache``) has each layer decoded straight into
them, by whichever thread checks it; otherwise the decoded layers are written into the cache on the event
loop, in object order. Either way a block becomes visible only once the event loop saw all its layers
in, and a layer that fails its digest or decode ends the fetch at its block. Payload bytes are never
copied on the way: the decoder reads them through views. The window is in bytes rather than blocks
because QUIC interleaves concurrent streams: a deep window of large blocks delivers every block late
(round robin) and multiplies the sender's per-packet frame work, while a window of a few MB keeps the
link busy and blocks arriving in chain order.

A block the relay does not have whole yet (a FETCH that ends before all its objects, or TIMEOUT: the
publisher is still pushing it) is asked for again, with a short backoff, within the block's deadline.
Any other failure (timeout, reset, error reply, failed check) ends the usable prefix at that block; the
caller recomputes the rest. Only blocks loaded before any retry or failure make the throughput sample
(``_SampleClock``): waiting for a publisher is not the path's speed. The wait for a fetch's first object
is the relay's first-byte delay instead, one sample per fetch (``_FirstByteWait``), which the ABR charges
once per fetch. A fetch problem costs time, never correctness. Verification failures carry a kind
(``BlockRejected.kind``: ``signature`` or ``content``) so the node can count them as security events.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from kvnet.blocks.codecs import Codec, CodecError, get_codec
from kvnet.blocks.identity import BlockIdentity
from kvnet.blocks.transform_codec import CodedLayer, TransformCodec
from kvnet.cache.hashing import hash_block
from kvnet.dtypes import dtype_from_name
from kvnet.errors import KVCacheError
from kvnet.exchange.abr import AbrConfig, KvAbr, MeasuredRate
from kvnet.exchange.config import DEFAULT_VERIFY_WORKERS, DEFAULT_WINDOW_BYTES, MAX_VERIFY_WORKERS
from kvnet.exchange.locate import DEFAULT_LOCATE_FAN_OUT, DEFAULT_STRAGGLER_GRACE, Located, locate_prefix
from kvnet.exchange.tables import TablesSource
from kvnet.net.connection import MoqtConnection
from kvnet.net.errors import LimitError, MoqtConnectionError, RequestRejected, StreamResetError
from kvnet.net.handles import FetchHandle
from kvnet.security.signing import TrustStore
from proto.errors import RequestErrorCode
from proto.kvobject import BLOCK_GROUP_ID, MANIFEST_OBJECT_ID, BlockManifest, KVObjectError, block_track
from proto.messages import Location

logger = logging.getLogger(__name__)
# DEFAULT_WINDOW_BYTES, DEFAULT_VERIFY_WORKERS and MAX_VERIFY_WORKERS live in kvnet.exchange.config, which
# the commands' flags read before torch loads.

MAX_FETCHES_IN_FLIGHT = 128
"""FETCHes a fetch keeps open at most, however small the blocks: peers refuse more than
``SessionConfig.max_requests_in_flight`` (256 by default) unanswered requests of one session."""
LAYERS_PER_TASK = 16
"""Layers of one block handed to a worker together: each hand-off to a thread costs the event loop a
GIL switch (8% of its profile with one layer per task); 16 measured better than 1, 4 and 8."""
TASKS_QUEUED_PER_WORKER = 2
"""Tasks a fetch hands to the pool ahead of the one it imports next, per worker: enough to keep every
worker busy, few enough that decoded layers waiting for their turn stay a few MB."""


RETRY_FIRST_DELAY_S = 0.02
"""Wait before asking again for a block the relay did not have whole yet (doubled per try)."""
RETRY_MAX_DELAY_S = 0.25
"""Longest wait between two tries of one block."""


class BlockIncomplete(MoqtConnectionError):
    """A FETCH of a block ended (FIN) before all its objects: the relay answered with part of a block
    whose objects were still arriving from the publisher. "Not yet", not "no such block": asked again."""


class BlockRejected(Exception):
    """A fetched block failed verification; the message says which check.

    ``kind`` is ``signature`` (unsigned, or not signed by a trusted key) or ``content`` (the signed
    manifest or a payload disagrees with what the subscriber computed: a poisoning attempt or corruption).
    """

    def __init__(self, reason: str, kind: str = "content") -> None:
        super().__init__(reason)
        self.kind = kind


def verify_manifest(
    data: bytes,
    expected: BlockIdentity,
    *,
    fingerprint: bytes,
    rendition: str,
    shape: tuple[int, int, int, int],
    dtype: str,
    trust: TrustStore,
    trust_any: bool = False,
) -> BlockManifest:
    """Decode and check a manifest object; raises ``BlockRejected`` naming the failed check.

    The signature must verify under a key of ``trust``. ``trust_any`` (development only, chosen
    explicitly by the operator) also accepts a manifest signed by a key that is not trusted, which cannot
    be checked at all: anyone able to publish could then decide what this subscriber computes.
    """
    try:
        m = BlockManifest.decode(data)
    except KVObjectError as exc:
        raise BlockRejected(f"malformed manifest: {exc}") from exc
    if not m.signature:
        raise BlockRejected("unsigned manifest", "signature")
    if not trust.verify_manifest(m, m.key_id, m.signature) and not (trust_any and m.key_id not in trust):
        # Under trust_any a *trusted* key id with a bad signature is still a forgery.
        raise BlockRejected(f"signature not from a trusted key (key id {m.key_id.hex()[:16]})", "signature")
    if m.fingerprint != fingerprint:
        raise BlockRejected("model fingerprint differs")
    if m.block_hash != expected.block_hash:
        raise BlockRejected("block hash differs from the requested track")
    if m.parent_hash != expected.parent_hash:
        raise BlockRejected("parent hash differs from the prompt's chain")
    if not m.verify_tokens(expected.token_ids):
        raise BlockRejected("token ids differ from the prompt")
    if hash_block(m.parent_hash, m.token_ids) != m.block_hash:
        raise BlockRejected("chain hash does not match parent and tokens")
    if m.codec != rendition:
        raise BlockRejected(f"codec {m.codec} is not the requested rendition {rendition}")
    if m.shape != shape or m.dtype != dtype:
        raise BlockRejected(f"shape/dtype {m.shape}/{m.dtype} differ from the cache's {shape}/{dtype}")
    return m


@dataclass
class FetchOutcome:
    """What ``BlockFetcher.fetch`` achieved."""

    loaded: int = 0
    """Leading blocks verified and imported (the usable prefix)."""
    bytes: int = 0
    renditions: dict[str, int] = field(default_factory=dict)
    load_s: float = 0.0
    """Seconds spent verifying, decoding and importing (between arrivals, while later FETCHes arrive)."""
    error: str | None = None
    rejected: bool = False
    """The fetch stopped because a block failed verification (``rejected_kind`` says which check)."""
    rejected_kind: str | None = None
    abandoned: str | None = None
    """Why the fetch was abandoned at its deadline (``FetchDeadline.describe``); None if it was not."""
    retries: int = 0
    """FETCHes sent again for blocks the relay did not have whole yet (``BlockIncomplete``, or TIMEOUT
    for a block the locate found)."""
    sample_bytes: int = 0
    """Bytes of the blocks that make up the throughput sample (see ``BlockFetcher.fetch``); 0: no sample."""
    sample_s: float = 0.0
    untrusted: int = 0
    """Loaded blocks signed by a key outside the trust store (accepted only under ``trust_any``): their K/V
    is their signer's, but no trusted publisher's."""


class CacheWriter(Protocol):
    """Where verified layers go: a paged KV cache (``PagedKVCache`` is one) with its import protocol.

    All four are called on the event loop, one block at a time: ``begin_import`` (False when the block is
    already cached or being imported: nothing to load), its layers in order, then ``finish_import`` or
    (on any failure) ``abort_import``.
    """

    def begin_import(self, block_hash: bytes) -> bool: ...

    def import_layer(self, block_hash: bytes, layer: int, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def finish_import(self, block_hash: bytes) -> object: ...

    def abort_import(self, block_hash: bytes) -> None: ...


@runtime_checkable
class SlotCacheWriter(CacheWriter, Protocol):
    """A ``CacheWriter`` that owns its slots (``PagedKVCache``): ``import_layer_with`` hands a writer the
    reserved block's layer to fill in place, so a fetched layer is decoded straight into the cache."""

    def import_layer_with(
        self, block_hash: bytes, layer: int, write: Callable[[torch.Tensor, torch.Tensor], None]
    ) -> None: ...


@runtime_checkable
class BlockLookup(Protocol):
    """A cache that says whether it holds a block (``PagedKVCache`` does)."""

    def contains_block(self, block_hash: bytes) -> bool: ...


@dataclass
class FetcherStats:
    """Counters of one fetcher (one relay session)."""

    fetches: int = 0
    """Block FETCHes sent (first tries; retries are counted per request in ``FetchOutcome.retries``)."""
    coalesced: int = 0
    """Blocks a request waited for because another request of this session was already fetching them."""


class Deadline(Protocol):
    """When each block of a fetch is due (``kvnet.exchange.abr.FetchDeadline`` is one; a stripe of a striped
    fetch sees the request's through ``kvnet.exchange.striping``)."""

    def due(self, loaded_blocks: int) -> float: ...

    def describe(self, loaded_blocks: int, now: float) -> str: ...

    def overtaken(
        self, now: float, last_block: int, remaining_blocks: int, remaining_bytes: float, rate_bps: float
    ) -> str | None: ...


REPLAN_INTERVAL_S = 0.05
"""How often a fetch with a deadline reads its own rate and re-plans (``Deadline.overtaken``)."""
REPLAN_MIN_OBSERVED_S = 0.1
"""Seconds of arriving bytes (and at least ``REPLAN_MIN_OBSERVED_RTTS`` round trips) before a fetch's rate is
trusted to re-plan it."""
REPLAN_MIN_OBSERVED_RTTS = 8
"""Round trips of arriving bytes before a fetch's rate is trusted. A fresh connection's congestion window
starts near 12 KB and doubles each round trip, so for its first few round trips the rate measures the
window, not the path: over a 83 ms WAN a fetch read 0.18 MB/s after 3.5 round trips on a path that carried
3.2 MB/s, was abandoned, and the sample made the next request decline most of its hit. Eight doublings
reach 3 MB per round trip; the recent window (two round trips) then reads the path."""

MIN_SAMPLE_S = 0.001
"""Shortest time a throughput sample is taken over: objects read in one burst (a loopback relay's answer in
one receive) would otherwise read as an unbounded rate."""

InflightBlocks = dict[bytes, "asyncio.Future[_Loaded | None]"]
"""Blocks being loaded by some fetch, by hash (``BlockFetcher``'s coalescing; shared by the fetchers of
one cache's sessions)."""


BlockProbe = Callable[[Sequence[bytes], int, str], Coroutine[Any, Any, Any]]
"""Ask whether block ``i`` of a chain of hashes exists in a rendition: returns if so, raises if not."""


class BlockFetcher:
    """Locate and fetch block tracks over one ``MoqtConnection`` (its request helpers do the I/O), writing
    verified layers straight into ``cache``.

    ``namespace_id`` is the namespace's namespace-id field (``NodeSecret.namespace_id`` of the tenant, or the
    tenant id itself without a node secret); ``shape`` and ``dtype`` are the cache's block shape
    ``[L, block_size, H_kv, D]`` and dtype name, which every manifest must match. ``abr`` receives the
    throughput, RTT and rendition measurements (a fresh ``KvAbr`` when none is given).
    """

    def __init__(
        self,
        conn: MoqtConnection,
        cache: CacheWriter,
        trust: TrustStore,
        *,
        fingerprint: bytes,
        namespace_id: str,
        shape: tuple[int, int, int, int],
        dtype: str,
        abr: KvAbr | None = None,
        trust_any: bool = False,
        timeout: float = 10.0,
        window_bytes: int = DEFAULT_WINDOW_BYTES,
        straggler_grace: float = DEFAULT_STRAGGLER_GRACE,
        locate_fan_out: int = DEFAULT_LOCATE_FAN_OUT,
        device: torch.device | None = None,
        verify_workers: int = DEFAULT_VERIFY_WORKERS,
        inflight: InflightBlocks | None = None,
        relay: str = "",
        locate_fingerprints: Sequence[bytes] = (),
        tables: TablesSource | None = None,
    ) -> None:
        if window_bytes <= 0:
            raise ValueError(f"window_bytes must be positive, got {window_bytes}")
        if not 0 <= verify_workers <= MAX_VERIFY_WORKERS:
            raise ValueError(f"verify_workers must be in [0, {MAX_VERIFY_WORKERS}], got {verify_workers}")
        self.verify_workers = verify_workers
        self.conn = conn
        self.cache = cache
        self.fingerprint = fingerprint
        self.locate_fingerprints = tuple(locate_fingerprints) or (fingerprint,)
        """Whose tracks a locate probes: a block counts as there only when each of them has it (the slices of
        a tensor-parallel engine's ranks, each under its own fingerprint); by default this fetcher's own."""
        self.namespace_id = namespace_id
        self.shape = shape
        self.dtype = dtype
        self.trust = trust
        self.trust_any = trust_any
        self.abr = abr if abr is not None else KvAbr(AbrConfig())
        self.timeout = timeout
        self.relay = relay
        """The relay's URL: whose first-byte delay this session's fetches measure."""
        self.first_byte = self.abr.first_byte_of(relay, cap_s=timeout)
        """How late ``relay`` answers a FETCH (``KvAbr.first_byte_of``; capped at ``timeout``, after which a
        FETCH that brought nothing failed anyway): learned by ``fetch``, used by the plan and deadline."""
        self.window_bytes = window_bytes
        self.straggler_grace = straggler_grace
        """Seconds (at least; 4x the first answer's delay if longer) a locate round waits for late answers."""
        if locate_fan_out < 2:
            raise ValueError(f"locate_fan_out must be at least 2, got {locate_fan_out}")
        self.locate_fan_out = locate_fan_out
        self.locate_probe: str | None = None
        """How this session's locates probe: "track_status", "fetch" (of the manifest object, for relays
        that do not forward TRACK_STATUS), or None while undecided (see ``locate``)."""
        self._probe_reads: set[asyncio.Task[None]] = set()
        """Manifest probes being read to their end (``_probe_manifest``)."""
        self.device = device or torch.device("cpu")
        self._slot_cache = cache if isinstance(cache, SlotCacheWriter) else None
        """The cache again where it takes decoded layers in place (see ``_load_layer``)."""
        self._lookup = cache if isinstance(cache, BlockLookup) else None
        """The cache again where it says which blocks it holds: a block loaded meanwhile is not fetched."""
        self._inflight: InflightBlocks = inflight if inflight is not None else {}
        """Blocks some fetch of this session (or of the other sessions given the same ``inflight``) is
        loading, by hash: concurrent requests that need the same block wait for that one FETCH instead of
        sending their own (resolved once it is in, with how it came)."""
        self.stats = FetcherStats()
        self.tables = tables if tables is not None else TablesSource(trust, fingerprint, namespace_id,
                                                                     timeout=timeout)
        """Decoder tables that ``kvtc`` blocks name (shared by a node's sessions: each is fetched once)."""
        self._pool_slots = self._slot_cache if self.device.type == "cpu" else None
        """The cache where verify workers decode straight into its slots: a CPU cache's slots are its own
        memory, while an accelerator's cache stages each layer in one host buffer (one writer at a time)."""
        if trust_any:
            logger.warning("trust-any: blocks signed by ANY key are accepted; anyone who can publish to the "
                           "relay decides what this node computes")

    @property
    def inflight(self) -> InflightBlocks:
        """The blocks being loaded that this fetcher coalesces on (give it to the fetchers of the same
        cache's other sessions)."""
        return self._inflight

    @property
    def window_blocks(self) -> int:
        """FETCHes in flight: ``window_bytes`` of raw blocks, at least two (one loading, one arriving) and
        at most ``MAX_FETCHES_IN_FLIGHT``."""
        return min(MAX_FETCHES_IN_FLIGHT, max(2, -(-self.window_bytes // raw_bytes(self.shape, self.dtype))))

    # -- locate -----------------------------------------------------------------------------------

    async def locate(self, hashes: Sequence[bytes], renditions: Sequence[str]) -> Located:
        """Renditions available for each block of the longest leading run that has any, found with
        ``locate_prefix`` (at most ``fan_out`` probes per rendition and round trip, two round trips up to
        ``fan_out ** 2`` blocks). Raises ``TimeoutError`` when no answer at all arrives within ``timeout``.

        A probe is a TRACK_STATUS, which moves no payload. Relays need not forward TRACK_STATUS to the
        publisher (some answer DOES_NOT_EXIST for anything they do not hold as a whole track), so until
        this session has seen TRACK_STATUS find a block, a locate that finds nothing also FETCHes block
        0's manifest, in the same round trip as its first round. If that FETCH finds the block, the
        session's relay is one that does not forward TRACK_STATUS, and this locate and every later one
        on the session probe with FETCHes of the manifest object instead, which every relay routes or
        serves from its cache. Either way nothing past the manifests of the probed blocks is pulled.
        """
        if self.locate_probe == "fetch":
            return await self._locate_with(hashes, renditions, self._probe_manifest)
        check = None
        if self.locate_probe is None and hashes:
            check = asyncio.ensure_future(self._probe_manifest(hashes, 0, renditions[0]))
        try:
            located = await self._locate_with(hashes, renditions, self._probe_track_status)
        except BaseException:
            if check is not None:
                check.cancel()
            raise
        if check is None:
            return located
        if located.available:
            check.cancel()
            self.locate_probe = "track_status"
            return located
        try:
            async with asyncio.timeout(self.timeout):  # not wait_for: see locate._probe_round
                await check
        except (TimeoutError, MoqtConnectionError, RequestRejected, StreamResetError, LimitError):
            return located  # nothing anywhere as far as either probe can tell: still undecided
        logger.warning(
            "the relay does not answer TRACK_STATUS for blocks it can serve; locating with FETCH of "
            "manifests on this session"
        )
        self.locate_probe = "fetch"
        again = await self._locate_with(hashes, renditions, self._probe_manifest)
        return dataclasses.replace(again, probes=again.probes + located.probes + 1,
                                   rounds=again.rounds + located.rounds)

    async def _locate_with(
        self, hashes: Sequence[bytes], renditions: Sequence[str], probe: BlockProbe
    ) -> Located:
        return await locate_prefix(
            len(hashes), renditions, lambda i, r: probe(hashes, i, r), fan_out=self.locate_fan_out,
            timeout=self.timeout, straggler_grace=self.straggler_grace, on_first_answer=self.abr.rtt_measured,
            is_miss=_is_plain_miss,
        )

    def _probe_track_status(
        self, hashes: Sequence[bytes], i: int, rendition: str
    ) -> Coroutine[Any, Any, Any]:
        probes = [self.conn.track_status(*block_track(fp, self.namespace_id, hashes[i], rendition))
                  for fp in self.locate_fingerprints]
        return _every(probes)

    def _probe_manifest(self, hashes: Sequence[bytes], i: int, rendition: str) -> Coroutine[Any, Any, Any]:
        """Returns when block ``i`` exists in ``rendition`` under every locate fingerprint
        (``_probe_manifest_of`` each); raises otherwise."""
        probes = [self._probe_manifest_of(fp, hashes[i], rendition) for fp in self.locate_fingerprints]
        return _every(probes)

    async def _probe_manifest_of(self, fingerprint: bytes, block_hash: bytes, rendition: str) -> None:
        """Returns when the block exists in ``rendition``: FETCH_OK for its manifest object (object 0
        only). Raises otherwise.

        The FETCH is not cancelled after FETCH_OK (nor when the locate no longer needs the answer): its
        range is the manifest alone, so reading it to its end costs one small object, while a cancel
        reaches a relay that may serve the FETCH by pulling the block upstream, and leaves it with a
        cut-short block the next full FETCH waits for. The rest is read in the background, cancelled only
        after ``timeout`` (a relay that does not finish it by then is not harmed by the cancel any more)."""
        ns, name = block_track(fingerprint, self.namespace_id, block_hash, rendition)
        start = Location(BLOCK_GROUP_ID, MANIFEST_OBJECT_ID)
        handle = await self.conn.fetch(ns, name, start, Location(BLOCK_GROUP_ID, MANIFEST_OBJECT_ID + 1))
        try:
            await handle.ok()  # shielded: a cancelled probe leaves the answer to the background read
        finally:
            self._read_to_end(handle)

    def _read_to_end(self, handle: FetchHandle) -> None:
        """Read a FETCH to its end (FIN, reset or refusal) in the background, for at most ``timeout``."""

        async def read() -> None:
            try:
                async with asyncio.timeout(self.timeout):
                    await handle.read_all()
            except (TimeoutError, MoqtConnectionError, RequestRejected, StreamResetError, LimitError):
                handle.cancel()  # a no-op once it ended

        task = asyncio.ensure_future(read())
        self._probe_reads.add(task)
        task.add_done_callback(self._probe_reads.discard)

    # -- fetch ------------------------------------------------------------------------------------

    async def fetch(
        self,
        expected: Sequence[BlockIdentity],
        renditions: Sequence[str],
        deadline: Deadline | None = None,
        *,
        outcome: FetchOutcome | None = None,
        on_loaded: Callable[[int], None] | None = None,
        measure: bool = True,
    ) -> FetchOutcome:
        """Fetch, verify and import blocks in the order of ``expected`` (chain order, or any other: each
        block is checked against its own identity) with ``window_blocks`` FETCHes in flight.

        Each object is handled as it arrives: the manifest is checked before anything of its block is
        touched, each layer is verified, decoded and written into the block reserved for it, and the block
        becomes visible in the cache once all its layers are in, while the next FETCHes keep arriving.
        Each block must be in by ``deadline.due(index)`` (clock: the event loop's) besides the per-object
        ``timeout``; the first block past it ends the fetch (``FetchOutcome.abandoned`` says why).

        ``on_loaded(i)`` is called as ``expected[i]`` is in the cache (in list order). ``outcome`` is
        filled in place when given, so a caller that cancels the fetch (it no longer needs the rest) keeps
        what it achieved, the throughput sample of its clean blocks included. With ``measure`` the sample
        goes to the ABR; a striped fetch (``kvnet.exchange.striping``) gives it the stripes' samples as one.
        """
        out = outcome if outcome is not None else FetchOutcome()
        loop = asyncio.get_running_loop()
        handles: dict[int, FetchHandle] = {}
        joined: dict[int, asyncio.Future[_Loaded | None]] = {}
        """Blocks another fetch of this session is loading: waited for, not fetched again."""
        owned: dict[int, asyncio.Future[_Loaded | None]] = {}
        """Our entries in ``self._inflight``, resolved when the block is in (how it came) or given up
        (None)."""
        window = self.window_blocks
        next_issue = 0
        workers = max(self.verify_workers, self._entropy_threads(renditions))
        pool = _LayerPool(workers, self._pool_slots) if workers else None
        clock = _SampleClock(decode_inline=pool is None)
        first_byte_wait = _FirstByteWait()
        waiting: asyncio.Timeout | None = None
        """The deadline of the block being waited for, while it is (what the re-plan cuts short)."""
        at_block = 0
        replanned: str | None = None

        async def replan() -> None:
            """Read this fetch's own rate every ``REPLAN_INTERVAL_S`` and give up the rest as soon as the
            deadline says it should (``Deadline.overtaken``): the block being waited for times out now."""
            nonlocal replanned
            assert deadline is not None
            raw = raw_bytes(self.shape, self.dtype)
            total = sum(raw * self.abr.renditions.size_ratio(r) for r in renditions)
            rtt = self.abr.rtt.estimate()
            rate = MeasuredRate(window_s=max(REPLAN_MIN_OBSERVED_S, 2 * rtt),
                                min_observed_s=max(REPLAN_MIN_OBSERVED_S, REPLAN_MIN_OBSERVED_RTTS * rtt))
            base = out.bytes
            while True:
                await asyncio.sleep(REPLAN_INTERVAL_S)
                now = loop.time()
                # Read or queued: the window's later blocks share the link with the one awaited.
                arrived = out.bytes - base + sum(h.queued_bytes for h in handles.values())
                bps = rate.observe(now, arrived)
                if bps is None or waiting is None:
                    continue
                remaining = max(total - arrived, 0.0)
                why = deadline.overtaken(now, len(expected) - 1, len(expected) - at_block, remaining, bps)
                if why is not None:
                    replanned = why
                    waiting.reschedule(now)
                    return

        watch = None if deadline is None else asyncio.ensure_future(replan())

        async def issue(i: int) -> None:
            exp_i = expected[i]
            if self._lookup is not None and self._lookup.contains_block(exp_i.block_hash):
                return  # loaded meanwhile (by an earlier request): nothing to fetch or wait for
            other = self._inflight.get(exp_i.block_hash)
            if other is not None:
                joined[i] = other
                self.stats.coalesced += 1
                return
            handles[i] = await self._send_fetch(exp_i, renditions[i])
            if i == 0:
                first_byte_wait.sent = time.perf_counter()
            owned[i] = self._inflight[exp_i.block_hash] = loop.create_future()
            self.stats.fetches += 1

        def settle(i: int, loaded: _Loaded | None) -> None:
            fut = owned.pop(i, None)
            if fut is None:
                return
            fut.set_result(loaded)
            if self._inflight.get(expected[i].block_hash) is fut:
                del self._inflight[expected[i].block_hash]

        try:
            for index, exp in enumerate(expected):
                block = _LoadingBlock(index, exp, renditions[index])
                due = None if deadline is None else deadline.due(index)
                loaded: _Loaded | None = None
                at_block = index
                try:
                    async with asyncio.timeout_at(due) as waiting:
                        while next_issue < len(expected) and next_issue < index + window:
                            await issue(next_issue)
                            next_issue += 1
                        for _ in range(2):
                            other = joined.pop(index, None)
                            if other is None:
                                break  # ours to fetch, or already cached
                            block.by_other = await asyncio.shield(other)
                            if block.by_other is not None:
                                break  # loaded by the other fetch
                            await issue(index)  # the other fetch gave up on it: try it ourselves
                        if index in joined:
                            raise MoqtConnectionError("the other fetches of this block gave up on it")
                        ours = index in handles
                        if ours:
                            await self._receive_with_retries(handles.pop(index), block, out, pool, clock)
                    waiting = None
                    loaded = self._finish_block(block, out)
                    if ours:
                        clock.block_done(block, out)
                    if on_loaded is not None:
                        on_loaded(index)
                except _FETCH_ERRORS as exc:
                    waiting = None
                    first_byte_wait.timed_out = isinstance(exc, TimeoutError)
                    now = loop.time()
                    if deadline is not None and isinstance(exc, TimeoutError) and (
                        replanned is not None or now >= deadline.due(index)
                    ):
                        out.abandoned = replanned or deadline.describe(index, now)
                        out.error = f"abandoned at block {exp.block_index}: {out.abandoned}"
                    else:
                        # A dead relay, a stall past the object timeout, a refused block: the time it took
                        # says nothing of the link, so no partial block is measured after it.
                        clock.disturbed = True
                        self._describe_failure(out, exp, exc)
                    break
                finally:
                    if block.importing:  # failed or interrupted: give the reserved block back
                        block.importing = False
                        self.cache.abort_import(exp.block_hash)
                    settle(index, loaded)
        finally:
            waiting = None
            if watch is not None:
                watch.cancel()
            for i in list(owned):
                settle(i, None)
            unread = sum(h.queued_bytes for h in handles.values())  # before cancelling drops them
            for h in handles.values():
                h.cancel()
            if pool is not None:
                pool.close()
            waited = first_byte_wait.sample(clock, self.abr.rtt.estimate())
            if waited is not None:
                self.abr.first_byte_measured(self.relay, self.timeout, waited)
            # Also when cancelled: the blocks loaded cleanly before that are a measurement like any other.
            out.sample_bytes, out.sample_s = clock.sample(unread)
            if out.sample_bytes and measure:
                self.abr.fetch_measured(out.sample_bytes, out.sample_s)
        return out

    def _entropy_threads(self, renditions: Sequence[str]) -> int:
        """Threads a fetch that may get ``kvtc`` needs to keep its entropy processes busy: one per process,
        each waiting without the GIL while its process decodes a task's layers, so the loop goes on
        reading the network (on 2 cores, where ``verify_workers`` is 0, the fetch has threads only for
        kvtc's sake); 0 without processes."""
        entropy = self.tables.codec.entropy
        return entropy.processes if entropy is not None and TransformCodec.name in renditions else 0

    async def _send_fetch(self, exp: BlockIdentity, rendition: str) -> FetchHandle:
        ns, name = block_track(self.fingerprint, self.namespace_id, exp.block_hash, rendition)
        return await self.conn.fetch(ns, name, Location(BLOCK_GROUP_ID, 0),
                                     Location(BLOCK_GROUP_ID, self.shape[0] + 1))

    async def _receive_with_retries(
        self, handle: FetchHandle, block: _LoadingBlock, out: FetchOutcome, pool: _LayerPool | None,
        clock: _SampleClock,
    ) -> None:
        """``_receive_block``, asking again while the relay does not have the block whole yet (see
        ``_is_not_yet``): within the caller's deadline for the block, or ``timeout`` without one."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.timeout
        delay = RETRY_FIRST_DELAY_S
        while True:
            try:
                await self._receive_block(handle, block, out, pool, clock)
                return
            except (MoqtConnectionError, RequestRejected) as exc:
                if not _is_not_yet(exc) or loop.time() + delay >= give_up:
                    raise
                clock.disturbed = True  # the time spent waiting for the publisher is not the network's
                out.retries += 1
                logger.info("block %d not whole at the relay yet (%s); asking again in %.0f ms",
                            block.exp.block_index, exc, delay * 1e3)
            finally:
                handle.cancel()
            if block.importing:
                block.importing = False
                self.cache.abort_import(block.exp.block_hash)
            block.manifest, block.nbytes, block.decode_s, block.previous = None, 0, 0.0, None
            await asyncio.sleep(delay)
            delay = min(2 * delay, RETRY_MAX_DELAY_S)
            handle = await self._send_fetch(block.exp, block.rendition)

    def _describe_failure(self, out: FetchOutcome, exp: BlockIdentity, exc: BaseException) -> None:
        if isinstance(exc, BlockRejected):
            out.error = f"block {exp.block_index} rejected: {exc}"
            out.rejected, out.rejected_kind = True, exc.kind
        elif isinstance(exc, TimeoutError):
            out.error = f"timed out after {self.timeout:.1f}s waiting for block {exp.block_index}"
        else:
            out.error = f"block {exp.block_index}: {exc}"

    async def _receive_block(
        self, handle: FetchHandle, block: _LoadingBlock, out: FetchOutcome, pool: _LayerPool | None,
        clock: _SampleClock,
    ) -> None:
        """Consume one FETCH: check the manifest, then verify, decode and import each layer as it arrives
        (on ``pool`` when given: the loop goes on reading while layers verify, and imports them in order)."""
        num_layers = self.shape[0]
        exp, rendition = block.exp, block.rendition
        next_object = MANIFEST_OBJECT_ID
        objects = aiter(handle)
        decoding: deque[asyncio.Future[list[_DecodedLayer]]] = deque()
        batch: list[_LayerPayload] = []
        try:
            while next_object <= num_layers:
                # A timer only for a wait: arming and cancelling one per object cost ~3% of the loop.
                obj = handle.next_queued()
                if obj is None:
                    try:
                        async with asyncio.timeout(self.timeout):
                            obj = await anext(objects)
                    except StopAsyncIteration:
                        got = f"{next_object} of {num_layers + 1}"
                        raise BlockIncomplete(f"fetch ended after {got} objects") from None
                if obj.status != 0:
                    continue  # END_OF_TRACK / END_OF_GROUP markers carry nothing
                if obj.group_id != BLOCK_GROUP_ID or obj.object_id != next_object:
                    raise BlockRejected(f"unexpected object {obj.group_id}/{obj.object_id}")
                payload = obj.payload
                clock.object_arrived(len(payload))
                block.nbytes += len(payload)
                out.bytes += len(payload)
                if obj.object_id == MANIFEST_OBJECT_ID:
                    t = time.perf_counter()
                    block.manifest = verify_manifest(
                        payload, exp, fingerprint=self.fingerprint, rendition=rendition, shape=self.shape,
                        dtype=self.dtype, trust=self.trust, trust_any=self.trust_any,
                    )
                    block.importing = self.cache.begin_import(exp.block_hash)
                    out.load_s += time.perf_counter() - t
                    if not block.importing:
                        return  # already cached (imported meanwhile by another request): nothing to load
                else:
                    assert block.manifest is not None
                    checked = obj.object_id == 1 and rendition == TransformCodec.name
                    if checked:
                        await self._resolve_tables(block.manifest, payload, clock)
                    layer = _LayerPayload(block.manifest, self._codec(rendition), obj.object_id, payload,
                                          self.device, digest_checked=checked)
                    if pool is None:
                        block.decode_s += self._load_layer(exp.block_hash, layer, block, out)
                    else:
                        batch.append(layer)
                        if len(batch) >= LAYERS_PER_TASK or obj.object_id == num_layers:
                            # A task after the block's first decodes from the layer the task before
                            # ends with (kvtc predicts a layer from the one before: _decode_layers).
                            decoding.append(pool.submit(exp.block_hash, batch, first=obj.object_id ==
                                                        len(batch)))
                            batch = []
                        if len(decoding) >= pool.queued_max:
                            block.decode_s += self._import(exp.block_hash, await decoding.popleft(), out)
                next_object += 1
            while decoding:
                block.decode_s += self._import(exp.block_hash, await decoding.popleft(), out)
        finally:
            for pending in decoding:  # the block failed: whatever the workers still make is dropped
                if pending.done() and not pending.cancelled():
                    pending.exception()  # retrieved, so that asyncio does not log it as lost
                pending.cancel()
            if decoding and pool is not None:
                # Workers may be writing this block's reserved slots; the caller gives the block back
                # (abort_import) only after they stopped, or a late write could land in a reused block.
                pool.wait_idle()

    def _codec(self, rendition: str) -> Codec:
        """What decodes ``rendition``: ``kvtc`` with the tables verified for this model only."""
        return self.tables.codec if rendition == TransformCodec.name else get_codec(rendition)

    async def _resolve_tables(self, manifest: BlockManifest, payload: bytes, clock: _SampleClock) -> None:
        """Make sure the tables a ``kvtc`` payload names are installed (``CodecError`` if they cannot be had):
        fetched once per digest; a block that waited for them is not a sample of the path's rate. The
        payload's digest is checked first (only a signed payload decides what is fetched), and not again
        before it is decoded (``_LayerPayload.digest_checked``)."""
        if not manifest.verify_payload(1, payload):
            raise BlockRejected("payload digest of layer 0 differs")
        digest = TransformCodec.tables_digest(payload)
        if self.tables.installed(digest) is None:
            clock.disturbed = True
            await self.tables.resolve(self.conn, digest)

    def _load_layer(self, block_hash: bytes, layer: _LayerPayload, block: _LoadingBlock, out: FetchOutcome
                    ) -> float:
        """Check one layer's digest, then decode it into the block reserved for it: in place where the cache
        offers its slots (no intermediate tensor, no copy; a payload that fails to decode leaves bytes
        only in the reserved block, which the failed fetch gives back unseen), else through ``_import``.
        Returns the seconds the digest and decode took."""
        (decoded,) = _decode_layers(self._slot_cache, block_hash, [layer], lambda: block.previous)
        block.previous = decoded.kept
        if self._slot_cache is None:
            return self._import(block_hash, [decoded], out)
        out.load_s += decoded.seconds
        return decoded.seconds

    def _import(self, block_hash: bytes, layers: list[_DecodedLayer], out: FetchOutcome) -> float:
        """Write decoded layers into the cache in order (those decoded in place are in already); returns
        the seconds their digests and decodes took."""
        t = time.perf_counter()
        decode_s = 0.0
        for layer in layers:
            if layer.k is not None and layer.v is not None:
                self.cache.import_layer(block_hash, layer.index, layer.k, layer.v)
            decode_s += layer.seconds
        out.load_s += decode_s + time.perf_counter() - t
        return decode_s

    def _finish_block(self, block: _LoadingBlock, out: FetchOutcome) -> _Loaded:
        """Make a block whose layers are all in visible in the cache and account for it; returns how it
        came, for the other fetches of this session that waited for it."""
        imported = block.importing
        if block.importing:
            self.cache.finish_import(block.exp.block_hash)
            block.importing = False
        out.loaded = block.index + 1
        if block.by_other is not None:
            # The cache holds what the other fetch loaded: its rendition and signer, not the ones asked for.
            loaded = block.by_other
        else:
            signer = block.manifest.key_id if imported and block.manifest is not None else None
            loaded = _Loaded(block.rendition, untrusted=signer is not None and signer not in self.trust)
        out.renditions[loaded.rendition] = out.renditions.get(loaded.rendition, 0) + 1
        out.untrusted += loaded.untrusted
        if block.manifest is None or not imported:
            # Loaded by another fetch of this session, or cached meanwhile (only its manifest came, which
            # is no size or decode sample): nothing measured here.
            return loaded
        raw = raw_bytes(self.shape, block.manifest.dtype)
        self.abr.rendition_measured(block.rendition, raw, block.nbytes, block.decode_s)
        return loaded


@dataclass
class _SampleClock:
    """What of a fetch makes a throughput sample: the bytes of the blocks loaded before anything went
    wrong, over the time from the first object's arrival to the last of those blocks (at least
    ``MIN_SAMPLE_S``). That is the inverse of the plan's model, which charges a fetch its latency (one
    round trip and the relay's first-byte delay, learned apart) and then bytes over throughput: a sample
    that also counted the round trip charged it twice, and behind a 20 ms link a fetch of a few blocks
    read as 10-15 MB/s on a 300 MB/s path, after which the node stopped fetching. Time before the first
    object (the relay asking the publisher, or waiting for a block still being pushed) and any block that
    needed a second FETCH or failed are left out: they measure the publisher, not the path.

    For the same reason the time the event loop spent verifying and decoding those blocks itself (no
    verify pool: nothing is read meanwhile) is left out too: the plan charges each rendition its own
    measured decode rate on top of bytes over throughput, and a sample that also held the decode charged
    it twice. Behind a fast link the receiver's decode is most of a fetch, so a sample taken with zstd's
    ``lossless`` made ``plain`` (more bytes, a copy to decode) look slower than it is, and every fetch
    look slower than computing.

    A fetch stopped before any block came whole (cancelled once a head computing the prefix reached it, or
    abandoned at its deadline) is measured too, by the objects that had arrived by then over the time
    until then: a link too slow to deliver one block in that time must not leave the estimate where it
    was, or the next plan makes the same mistake. One that failed (the relay gone, a stall, a refused
    block) is not: its time measures the failure."""

    decode_inline: bool = True
    """Blocks are verified and decoded on the event loop (``verify_workers`` 0)."""
    now: Callable[[], float] = time.perf_counter
    first_object: float | None = None
    last_clean: float | None = None
    clean_bytes: int = 0
    clean_decode_s: float = 0.0
    """Seconds the loop spent verifying and decoding the clean blocks (inline decoding only)."""
    arrived_bytes: int = 0
    """Payload bytes of the objects read before anything went wrong, whole blocks or not."""
    disturbed: bool = False
    """A retry or failure happened: blocks after it are not part of the sample."""

    first_object_clean: bool = False
    """The first object came before any retry (its wait is the relay's answer, not a backoff)."""

    def object_arrived(self, nbytes: int) -> None:
        if self.first_object is None:
            self.first_object = self.now()
            self.first_object_clean = not self.disturbed
        if not self.disturbed:
            self.arrived_bytes += nbytes

    def block_done(self, block: _LoadingBlock, out: FetchOutcome) -> None:
        if not self.disturbed:
            self.clean_bytes += block.nbytes
            self.last_clean = self.now()
            if self.decode_inline:
                self.clean_decode_s += block.decode_s

    def sample(self, unread_bytes: int = 0) -> tuple[int, float]:
        """(bytes, seconds) of the sample; (0, 0.0) when there is none. ``unread_bytes``: objects of later
        blocks that had arrived, counted only when no block came whole (they shared the link)."""
        if self.first_object is None:
            return 0, 0.0
        if self.clean_bytes > 0 and self.last_clean is not None:
            elapsed = self.last_clean - self.first_object - self.clean_decode_s
            return self.clean_bytes, max(elapsed, MIN_SAMPLE_S)
        if self.disturbed or self.arrived_bytes + unread_bytes <= 0:
            return 0, 0.0
        return self.arrived_bytes + unread_bytes, max(self.now() - self.first_object, MIN_SAMPLE_S)


@dataclass
class _FirstByteWait:
    """One first-byte sample per fetch: from sending the FETCH of its first block (when this fetch sent it,
    so nothing queued before it) to the first object, less one RTT. A fetch that timed out (its deadline or
    the per-object timeout) before any object came is a lower bound, learned as such: the next deadline
    allows that much more, so a late relay is learned within a few requests, up to the estimator's cap."""

    sent: float | None = None
    timed_out: bool = False

    def sample(self, clock: _SampleClock, rtt_s: float) -> float | None:
        """Seconds beyond ``rtt_s`` the first object took (None: nothing to learn from this fetch)."""
        if self.sent is None:
            return None
        if clock.first_object is not None:
            return clock.first_object - self.sent - rtt_s if clock.first_object_clean else None
        return time.perf_counter() - self.sent - rtt_s if self.timed_out else None


@dataclass(frozen=True)
class _Loaded:
    """How a block came into the cache, as far as this session's fetches know: what ``kv_exact`` of every
    request that used it depends on (``FetchOutcome.renditions`` and ``untrusted``)."""

    rendition: str
    untrusted: bool
    """Signed by a key outside the trust store (accepted only under ``trust_any``)."""


@dataclass
class _LoadingBlock:
    """A block whose FETCH is being consumed."""

    index: int
    exp: BlockIdentity
    rendition: str
    manifest: BlockManifest | None = None
    importing: bool = False
    """``begin_import`` reserved a cache block that is neither finished nor aborted yet."""
    nbytes: int = 0
    decode_s: float = 0.0
    """Seconds this node spent checking the layers' digests and decoding them (on whichever thread): the
    ABR's measure of the rendition's verify + decode speed."""
    by_other: _Loaded | None = None
    """Set when another fetch of this session loaded the block and this one waited for it."""
    previous: tuple[torch.Tensor, torch.Tensor] | None = None
    """The last layer decoded on the event loop, as decoded: what a kvtc layer after it is predicted from."""


@dataclass
class _DecodedLayer:
    """A layer whose digest matched, decoded and ready to be written into the cache (``k`` and ``v``), or
    decoded into the cache's slots already (both None)."""

    index: int
    k: torch.Tensor | None
    v: torch.Tensor | None
    seconds: float
    """Time the digest check and decode took (on whichever thread ran them)."""
    kept: tuple[torch.Tensor, torch.Tensor] | None = None
    """A kvtc layer's K and V as decoded, which the block's next layer is predicted from."""


@dataclass
class _LayerPayload:
    """A layer object as it arrived, with what checking and decoding it needs."""

    manifest: BlockManifest
    codec: Codec
    object_id: int
    payload: bytes
    device: torch.device
    digest_checked: bool = False
    """Its digest was checked already (a kvtc block's first layer, before its tables were resolved)."""


def _decode_layers(
    cache: SlotCacheWriter | None, block_hash: bytes, layers: list[_LayerPayload],
    previous: Callable[[], tuple[torch.Tensor, torch.Tensor] | None],
) -> list[_DecodedLayer]:
    """Check consecutive layers of one block and decode them, in place into the slots ``cache`` reserved
    (any thread may run it for a CPU cache: each layer has slots of its own), else into new tensors.
    A kvtc layer is predicted from the one before it (kvnet.blocks.transform_tables): every layer's digest
    and entropy decode first, since they need no other layer, then the layers in order, the first from
    ``previous()`` (which may wait for another task to decode it)."""
    t = time.perf_counter()
    codec = layers[0].codec
    manifest = layers[0].manifest
    shape, dtype = manifest.layer_shape, dtype_from_name(manifest.dtype)
    for layer in layers:
        _check_digest(layer)
    coded = codec.parse_layers([layer.payload for layer in layers], shape, dtype) \
        if isinstance(codec, TransformCodec) else []
    for layer, entropy_decoded in zip(layers, coded, strict=False):  # coded: none but for kvtc
        if entropy_decoded.layer != layer.object_id - 1 or \
                entropy_decoded.first_position != coded[0].first_position:
            raise CodecError(f"kvtc payload of object {layer.object_id} is layer {entropy_decoded.layer} at "
                             f"position {entropy_decoded.first_position}, not its block's layer")
    out: list[_DecodedLayer] = []
    if not coded:
        for layer in layers:
            payload = layer.payload
            if cache is None:
                k, v = codec.decode(payload, shape, dtype, layer.device)
                out.append(_DecodedLayer(layer.object_id - 1, k, v, 0.0))
            else:
                cache.import_layer_with(block_hash, layer.object_id - 1,
                                        functools.partial(codec.decode_into, payload))
                out.append(_DecodedLayer(layer.object_id - 1, None, None, 0.0))
        out[-1].seconds = time.perf_counter() - t
        return out
    assert isinstance(codec, TransformCodec)
    busy = time.perf_counter() - t
    before = previous() if coded[0].needs_previous else None
    t = time.perf_counter()
    for layer, entropy_decoded in zip(layers, coded, strict=True):
        if cache is None:
            k, v = codec.reconstruct(entropy_decoded, layer.device, before)
            out.append(_DecodedLayer(layer.object_id - 1, k, v, 0.0, (k, v)))
        else:
            write = _ReconstructInto(codec, entropy_decoded, before)
            cache.import_layer_with(block_hash, layer.object_id - 1, write)
            out.append(_DecodedLayer(layer.object_id - 1, None, None, 0.0, write.made))
        before = out[-1].kept
    out[-1].seconds = busy + time.perf_counter() - t
    return out


@dataclass
class _ReconstructInto:
    """Writes a parsed kvtc layer into the slots it is called with, and keeps what it wrote apart from them
    (``made``): on an accelerator the slots are staging that the next layer reuses."""

    codec: TransformCodec
    coded: CodedLayer
    previous: tuple[torch.Tensor, torch.Tensor] | None
    made: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        k, v = self.codec.reconstruct(self.coded, k_out.device, self.previous)
        k_out.copy_(k)
        v_out.copy_(v)
        self.made = (k, v)


def _check_digest(layer: _LayerPayload) -> None:
    if not layer.digest_checked and not layer.manifest.verify_payload(layer.object_id, layer.payload):
        raise BlockRejected(f"payload digest of layer {layer.object_id - 1} differs")


class _LayerPool:
    """The threads of one fetch that check and decode layers, a task of up to ``LAYERS_PER_TASK`` layers of
    one block at a time: into the cache's slots where ``slots`` is given, else into new tensors that the
    event loop writes into the cache in order. The caller bounds what it queues by ``queued_max`` tasks
    (one is imported before more are handed over). A block's task after its first waits, once its own
    entropy decoding is done, for the task before it to hand over its last layer (kvtc's prediction)."""

    def __init__(self, workers: int, slots: SlotCacheWriter | None = None) -> None:
        self.queued_max = workers * TASKS_QUEUED_PER_WORKER
        self._slots = slots
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="kvnet-verify")
        self._tasks: set[concurrent.futures.Future[list[_DecodedLayer]]] = set()
        self._last: concurrent.futures.Future[list[_DecodedLayer]] | None = None

    def submit(self, block_hash: bytes, layers: list[_LayerPayload], first: bool
               ) -> asyncio.Future[list[_DecodedLayer]]:
        """Decode ``layers`` (the block's ``first`` task, or the one after the last submitted)."""
        after = None if first else self._last
        task = self._executor.submit(_decode_layers, self._slots, block_hash, layers,
                                     lambda: _last_layer_of(after))
        self._last = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return asyncio.wrap_future(task)

    def wait_idle(self) -> None:
        """Drop the tasks that have not started and wait (blocking: at most one task per worker, a few
        ms) for those that have, so nothing writes a block's slots after its import was given up."""
        for task in list(self._tasks):
            task.cancel()
        concurrent.futures.wait(list(self._tasks))

    def close(self) -> None:
        # Nothing of a finished block is still running (its tasks were awaited, or ``wait_idle`` ran).
        self._executor.shutdown(wait=False, cancel_futures=True)


def _last_layer_of(task: concurrent.futures.Future[list[_DecodedLayer]] | None
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The last layer ``task`` decoded, once it has (the task was submitted, hence started, before the one
    that waits: the pool's queue is first in, first out)."""
    if task is None:
        return None
    try:
        return task.result()[-1].kept
    except concurrent.futures.CancelledError:
        # The block was given up; this task's error is dropped with it (never a CancelledError, which
        # would read as the fetch itself being cancelled).
        raise CodecError("kvtc: the block's layers before were not decoded") from None


_FETCH_ERRORS = (
    BlockRejected, TimeoutError, MoqtConnectionError, RequestRejected, StreamResetError, LimitError,
    CodecError, KVCacheError,
)
"""What ends the usable prefix at a block (anything else is a bug and propagates)."""


def raw_bytes(shape: tuple[int, int, int, int], dtype: str) -> int:
    """Uncompressed bytes of one block's K and V: ``shape`` is ``[L, block_size, H_kv, D]``."""
    n = 2
    for d in shape:
        n *= d
    return n * torch.empty((), dtype=dtype_from_name(dtype)).element_size()


def _is_not_yet(exc: BaseException) -> bool:
    """A block the locate found is not whole at the relay yet: its FETCH ended short (a relay that serves
    part of a block still being pushed), or the relay answered TIMEOUT (its wait for the rest, or for an
    upstream, ran out). Worth asking again within the deadline. DOES_NOT_EXIST is not: a block evicted
    below a probed hit ends the usable prefix at once."""
    if isinstance(exc, BlockIncomplete):
        return True
    return isinstance(exc, RequestRejected) and exc.code == RequestErrorCode.TIMEOUT


def _every(probes: Sequence[Coroutine[Any, Any, Any]]) -> Coroutine[Any, Any, Any]:
    """One probe that returns when every probe did and raises the first probe's failure (the others still
    end on their own). A lone probe is returned as it is: no gather task for the common single-rank case."""
    if len(probes) == 1:
        return probes[0]

    async def every() -> None:
        await asyncio.gather(*probes)

    return every()


def _is_plain_miss(exc: BaseException) -> bool:
    """A probe's answer "no such block" (anything else, e.g. an edge whose upstream is down, is a failure
    the request's report names)."""
    return isinstance(exc, RequestRejected) and exc.code == RequestErrorCode.DOES_NOT_EXIST
