"""Subscriber side of kvnet: locate the longest cached prefix, fetch it, verify it, load it.

Owns:

* ``verify_manifest`` — every check a block must pass before any of its bytes touch the cache: canonical
  manifest, signature by a trusted key, fingerprint, block hash, parent hash, chain rule
  ``block_hash == hash_block(parent, tokens)``, token ids equal to the subscriber's own prompt slice, and
  the shape/dtype/codec it expects. Payload digests are checked per layer object as it arrives.
* ``BlockFetcher`` — over a ``MoqtConnection``: ``locate`` sends one TRACK_STATUS per candidate block all
  at once (one round trip whatever the prompt length; TRACK_STATUS moves no payload, so nothing past the
  first miss is pulled) and ``fetch`` pipelines FETCHes of the chosen prefix with a window bounded in
  bytes, verifying, decoding and importing each layer into the paged cache as it arrives.

Where the time goes (profiled on the bench preset): the transport's per-packet work dominates, so the
event loop only receives. The per-layer work (SHA-256 of the payload, zstd + numpy decode, one copy into
the cache) runs in one worker thread, in arrival order, overlapped with the loop receiving the next
objects: hashlib, zstd, numpy and torch's copy release the GIL on buffers of this size. Payload bytes are
never copied on the way: the decoder reads them through views. The window is in bytes rather than
blocks because QUIC interleaves concurrent streams: a deep window of large blocks delivers every block
late (round robin) and multiplies the sender's per-packet frame work, while a window of a few MB keeps
the link busy and blocks arriving in chain order.

Any failure (timeout, reset, error reply, failed check) ends the usable prefix at that block; the caller
recomputes the rest. A fetch problem costs time, never correctness. Verification failures carry a kind
(``BlockRejected.kind``: ``signature`` or ``content``) so the node can count them as security events.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kvnet.abr import KvAbr
from kvnet.codecs import CodecError, get_codec
from kvnet.connection import (
    FetchHandle,
    LimitError,
    MoqtConnection,
    MoqtConnectionError,
    RequestRejected,
    StreamResetError,
)
from kvnet.errors import KVCacheError
from kvnet.hashing import hash_block
from kvnet.signing import TrustStore
from proto.kvobject import BLOCK_GROUP_ID, MANIFEST_OBJECT_ID, BlockManifest, KVObjectError, block_track
from proto.messages import Location

logger = logging.getLogger(__name__)

DEFAULT_WINDOW_BYTES = 4 << 20
"""Raw block bytes a fetch keeps requested ahead of the block being loaded (see the module docstring)."""


class BlockRejected(Exception):
    """A fetched block failed verification; the message says which check.

    ``kind`` is ``signature`` (unsigned, or not signed by a trusted key) or ``content`` (the signed
    manifest or a payload disagrees with what the subscriber computed: a poisoning attempt or corruption).
    """

    def __init__(self, reason: str, kind: str = "content") -> None:
        super().__init__(reason)
        self.kind = kind


@dataclass(frozen=True, slots=True)
class ExpectedBlock:
    """What the subscriber knows a block must be, from its own prompt."""

    block_hash: bytes
    parent_hash: bytes
    token_ids: tuple[int, ...]
    block_index: int


def verify_manifest(
    data: bytes,
    expected: ExpectedBlock,
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


def expected_blocks(
    token_ids: Sequence[int], block_size: int, hashes: Sequence[bytes], root: bytes, start: int, stop: int
) -> list[ExpectedBlock]:
    """``ExpectedBlock`` for blocks ``start..stop-1`` of a prompt whose chained hashes are ``hashes``."""
    out = []
    for i in range(start, stop):
        parent = root if i == 0 else hashes[i - 1]
        toks = tuple(token_ids[i * block_size : (i + 1) * block_size])
        out.append(ExpectedBlock(block_hash=hashes[i], parent_hash=parent, token_ids=toks, block_index=i))
    return out


@dataclass
class FetchOutcome:
    """What ``BlockFetcher.fetch`` achieved."""

    loaded: int = 0
    """Leading blocks verified and imported (the usable prefix)."""
    bytes: int = 0
    renditions: dict[str, int] = field(default_factory=dict)
    load_s: float = 0.0
    """Seconds spent verifying, decoding and importing (overlapped with the transfer)."""
    error: str | None = None
    rejected: bool = False
    """The fetch stopped because a block failed verification (``rejected_kind`` says which check)."""
    rejected_kind: str | None = None


class BlockSink(Protocol):
    """Where verified layers go: the node's paged cache (``begin/import/finish/abort`` import protocol).

    ``import_layer`` is called from the fetcher's worker thread, possibly while the event loop calls
    ``begin_import`` for a later block; it must touch only the storage of the block it names. Every
    import still running has ended before ``finish_import`` or ``abort_import`` is called for its block.
    """

    def begin_import(self, block_hash: bytes) -> bool: ...

    def import_layer(self, block_hash: bytes, layer: int, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def finish_import(self, block_hash: bytes) -> None: ...

    def abort_import(self, block_hash: bytes) -> None: ...


class BlockFetcher:
    """Locate and fetch block tracks over one ``MoqtConnection`` (its request helpers do the I/O)."""

    def __init__(
        self,
        conn: MoqtConnection,
        fingerprint: bytes,
        tenant: str,
        shape: tuple[int, int, int, int],
        dtype: str,
        trust: TrustStore,
        abr: KvAbr,
        *,
        trust_any: bool = False,
        timeout: float = 10.0,
        window_bytes: int = DEFAULT_WINDOW_BYTES,
        straggler_grace: float = 0.5,
        device: torch.device | None = None,
    ) -> None:
        if window_bytes <= 0:
            raise ValueError(f"window_bytes must be positive, got {window_bytes}")
        self.conn = conn
        self.fingerprint = fingerprint
        self.tenant = tenant
        self.shape = shape
        self.dtype = dtype
        self.trust = trust
        self.trust_any = trust_any
        self.abr = abr
        self.timeout = timeout
        self.window_bytes = window_bytes
        self.straggler_grace = straggler_grace
        """Seconds (at least; 4x the first answer's delay if longer) a locate waits for late answers."""
        self.device = device or torch.device("cpu")
        # One thread: layers are decoded in arrival order, and a second one would only fight the event
        # loop for the GIL on a small machine.
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvnet-load")
        if trust_any:
            logger.warning("trust-any: blocks signed by ANY key are accepted; anyone who can publish to the "
                           "relay decides what this node computes")

    @property
    def window_blocks(self) -> int:
        """FETCHes in flight: ``window_bytes`` of raw blocks, at least two (one loading, one arriving)."""
        return max(2, -(-self.window_bytes // raw_bytes(self.shape, self.dtype)))

    def close(self) -> None:
        """Stop the worker thread (waits for a layer being decoded, if any)."""
        self._worker.shutdown(wait=True, cancel_futures=True)

    # -- locate -----------------------------------------------------------------------------------

    async def locate(self, hashes: Sequence[bytes], renditions: Sequence[str]) -> list[list[str]]:
        """Renditions available for each block of the longest leading run that has any (one round trip).

        Every TRACK_STATUS goes out before any answer is awaited. The answer is settled as soon as the
        leading run is known (all blocks before the first miss answered). Answers that straggle (a relay
        forwarding to a publisher that died without closing its session waits for its own timeout) are
        not waited for past a grace period after the first answer: the run then ends at the first block
        without a positive answer, which costs reuse, never correctness.
        Raises ``TimeoutError`` when no answer at all arrives within ``timeout``.
        """
        loop = asyncio.get_running_loop()
        asks: list[tuple[int, str, asyncio.Task[Any]]] = []
        for i, block_hash in enumerate(hashes):
            for r in renditions:
                ns, name = block_track(self.fingerprint, self.tenant, block_hash, r)
                asks.append((i, r, loop.create_task(self.conn.track_status(ns, name))))
        started = time.perf_counter()
        deadline = started + self.timeout
        first_answer: float | None = None
        per_block: list[list[asyncio.Task[Any]]] = [[] for _ in hashes]
        answered = asyncio.Event()
        for i, _, task in asks:
            per_block[i].append(task)
            # One callback per task (not asyncio.wait over the pending set on every wake-up, which is
            # quadratic in the number of blocks); many answers arrive per loop iteration anyway.
            task.add_done_callback(lambda _t: answered.set())
        try:
            while (run := _settled_run(per_block)) is None:
                now = time.perf_counter()
                if first_answer is None and answered.is_set():
                    first_answer = now - started
                    self.abr.rtt.add(first_answer)
                    deadline = min(deadline, now + max(self.straggler_grace, 4 * first_answer))
                if now >= deadline:
                    if first_answer is None:
                        raise TimeoutError(f"no TRACK_STATUS answer within {self.timeout:.1f}s")
                    run = _answered_run(per_block)
                    break
                answered.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(answered.wait(), deadline - now)
        finally:
            for _, _, task in asks:
                task.cancel()
            await asyncio.gather(*(t for _, _, t in asks), return_exceptions=True)
        available: list[list[str]] = [[] for _ in range(run)]
        for i, r, task in asks:
            if i < run and _answered_ok(task):
                available[i].append(r)
        return available

    # -- fetch ------------------------------------------------------------------------------------

    async def fetch(
        self, expected: Sequence[ExpectedBlock], renditions: Sequence[str], sink: BlockSink
    ) -> FetchOutcome:
        """Fetch, verify and import blocks in chain order with ``window_blocks`` FETCHes in flight.

        The event loop receives objects and checks each manifest (small) before anything of its block is
        touched; the worker thread verifies, decodes and imports each layer as it arrives; a block is
        finished (made visible in the cache) once all its layers are in, while later blocks arrive.
        """
        out = FetchOutcome()
        end = Location(BLOCK_GROUP_ID, self.shape[0] + 1)
        handles: dict[int, FetchHandle] = {}
        loading: list[_LoadingBlock] = []  # received (or being received), not finished, in chain order
        window = self.window_blocks
        next_issue = 0
        failed: tuple[ExpectedBlock, BaseException] | None = None
        started = time.perf_counter()
        try:
            for index, exp in enumerate(expected):
                block = _LoadingBlock(index, exp, renditions[index])
                try:
                    while next_issue < len(expected) and next_issue < index + window:
                        e, r = expected[next_issue], renditions[next_issue]
                        ns, name = block_track(self.fingerprint, self.tenant, e.block_hash, r)
                        start = Location(BLOCK_GROUP_ID, 0)
                        handles[next_issue] = await self.conn.fetch(ns, name, start, end)
                        next_issue += 1
                    handle = handles.pop(index)
                    try:
                        await self._receive_block(handle, block, sink, out)
                    finally:
                        handle.cancel()
                except _FETCH_ERRORS as exc:
                    failed = (exp, exc)
                    await self._abort([block], sink)
                    break
                loading.append(block)
                # Finish what the worker has completed (in chain order) without waiting for it.
                failed = await self._finish_blocks(loading, sink, out, wait=False)
                if failed is not None:
                    break
            if failed is None or loading:
                # Blocks before a failure may still be good: finish them in order.
                failed = await self._finish_blocks(loading, sink, out, wait=True) or failed
        finally:
            for h in handles.values():
                h.cancel()
            await self._abort(loading, sink)
        if failed is not None:
            self._describe_failure(out, *failed)
        elapsed = time.perf_counter() - started
        if out.bytes and elapsed > 0:
            self.abr.throughput.add(out.bytes, elapsed)
        return out

    def _describe_failure(self, out: FetchOutcome, exp: ExpectedBlock, exc: BaseException) -> None:
        if isinstance(exc, BlockRejected):
            out.error = f"block {exp.block_index} rejected: {exc}"
            out.rejected, out.rejected_kind = True, exc.kind
        elif isinstance(exc, TimeoutError):
            out.error = f"timed out after {self.timeout:.1f}s waiting for block {exp.block_index}"
        else:
            out.error = f"block {exp.block_index}: {exc}"

    async def _receive_block(
        self, handle: FetchHandle, block: _LoadingBlock, sink: BlockSink, out: FetchOutcome
    ) -> None:
        """Consume one FETCH: check the manifest, then hand each layer to the worker as it arrives."""
        num_layers = self.shape[0]
        exp, rendition = block.exp, block.rendition
        next_object = MANIFEST_OBJECT_ID
        objects = aiter(handle)
        while next_object <= num_layers:
            try:
                async with asyncio.timeout(self.timeout):
                    obj = await anext(objects)
            except StopAsyncIteration:
                got = f"{next_object} of {num_layers + 1}"
                raise MoqtConnectionError(f"fetch ended after {got} objects") from None
            if obj.status != 0:
                continue  # END_OF_TRACK / END_OF_GROUP markers carry nothing
            if obj.group_id != BLOCK_GROUP_ID or obj.object_id != next_object:
                raise BlockRejected(f"unexpected object {obj.group_id}/{obj.object_id}")
            payload = obj.payload
            block.nbytes += len(payload)
            out.bytes += len(payload)
            if obj.object_id == MANIFEST_OBJECT_ID:
                t = time.perf_counter()
                block.manifest = verify_manifest(
                    payload, exp, fingerprint=self.fingerprint, rendition=rendition, shape=self.shape,
                    dtype=self.dtype, trust=self.trust, trust_any=self.trust_any,
                )
                block.importing = sink.begin_import(exp.block_hash)
                out.load_s += time.perf_counter() - t
                if not block.importing:
                    return  # already cached (imported meanwhile by another request): nothing to load
            else:
                assert block.manifest is not None
                block.jobs.append(self._worker.submit(
                    _load_layer, sink, block.manifest, exp.block_hash, rendition, obj.object_id, payload,
                    self.device,
                ))
            next_object += 1

    async def _finish_blocks(
        self, loading: list[_LoadingBlock], sink: BlockSink, out: FetchOutcome, *, wait: bool
    ) -> tuple[ExpectedBlock, BaseException] | None:
        """Make loaded blocks visible in the cache in chain order (all of them with ``wait``, else only
        those whose layers are all in); the failing block and its error, if one fails."""
        while loading and (wait or loading[0].ready()):
            block = loading[0]
            try:
                await self._finish_block(block, sink, out)
            except _FETCH_ERRORS as exc:
                return block.exp, exc
            loading.pop(0)
        return None

    async def _finish_block(self, block: _LoadingBlock, sink: BlockSink, out: FetchOutcome) -> None:
        if block.jobs:
            # Every job must end before the block can be finished or aborted, even when one failed.
            results = await asyncio.gather(*map(asyncio.wrap_future, block.jobs), return_exceptions=True)
            for r in results:
                if isinstance(r, BaseException):
                    raise r
                out.load_s += r
        if block.importing:
            sink.finish_import(block.exp.block_hash)
            block.importing = False
        out.loaded = block.index + 1
        out.renditions[block.rendition] = out.renditions.get(block.rendition, 0) + 1
        assert block.manifest is not None
        raw = raw_bytes(self.shape, block.manifest.dtype)
        self.abr.renditions.add(block.rendition, raw, block.nbytes, 0.0)

    async def _abort(self, loading: list[_LoadingBlock], sink: BlockSink) -> None:
        """Undo the imports of blocks that were not finished, once their layer jobs have ended."""
        # A queued job is cancelled and never starts; a running one cannot be, so wait for it to end
        # (on the worker's own future: an asyncio wrapper would report "cancelled" at once).
        running = [j for b in loading for j in b.jobs if not j.cancel()]
        if running:
            await asyncio.wait(map(asyncio.wrap_future, running))
        for block in loading:
            if block.importing:
                sink.abort_import(block.exp.block_hash)
                block.importing = False
        loading.clear()


@dataclass
class _LoadingBlock:
    """A block whose FETCH is being consumed or whose layers the worker is still loading."""

    index: int
    exp: ExpectedBlock
    rendition: str
    manifest: BlockManifest | None = None
    importing: bool = False
    nbytes: int = 0
    jobs: list[concurrent.futures.Future[float]] = field(default_factory=list)
    """The worker's layer jobs (seconds each took), in layer order."""

    def ready(self) -> bool:
        return all(j.done() for j in self.jobs)


def _load_layer(
    sink: BlockSink, manifest: BlockManifest, block_hash: bytes, rendition: str, object_id: int,
    payload: bytes, device: torch.device,
) -> float:
    """Worker thread: check one layer's digest, decode it and write it into the cache; seconds spent."""
    started = time.perf_counter()
    if not manifest.verify_payload(object_id, payload):
        raise BlockRejected(f"payload digest of layer {object_id - 1} differs")
    k, v = get_codec(rendition).decode(payload, manifest.layer_shape, DTYPE_BY_NAME[manifest.dtype], device)
    sink.import_layer(block_hash, object_id - 1, k, v)
    return time.perf_counter() - started


_FETCH_ERRORS = (
    BlockRejected, TimeoutError, MoqtConnectionError, RequestRejected, StreamResetError, LimitError,
    CodecError, KVCacheError,
)
"""What ends the usable prefix at a block (anything else is a bug and propagates)."""


def _answered_ok(task: asyncio.Task[Any]) -> bool:
    return task.done() and not task.cancelled() and task.exception() is None


def _answered_run(per_block: Sequence[Sequence[asyncio.Task[Any]]]) -> int:
    """Length of the leading run of blocks with a positive answer so far."""
    run = 0
    while run < len(per_block) and any(_answered_ok(t) for t in per_block[run]):
        run += 1
    return run


def _settled_run(per_block: Sequence[Sequence[asyncio.Task[Any]]]) -> int | None:
    """Length of the leading run of located blocks, or None while answers that decide it are missing.

    Block i counts once any rendition answered OK; it is a miss once every rendition answered with an
    error. Answers for blocks after the first miss do not matter.
    """
    for i, tasks in enumerate(per_block):
        if any(_answered_ok(t) for t in tasks):
            continue
        if all(t.done() for t in tasks):
            return i
        return None
    return len(per_block)


DTYPE_BY_NAME = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                 "float64": torch.float64}


def raw_bytes(shape: tuple[int, int, int, int], dtype: str) -> int:
    n = 2
    for d in shape:
        n *= d
    return n * torch.empty((), dtype=DTYPE_BY_NAME[dtype]).element_size()
