"""Subscriber side of kvnet: locate the longest cached prefix, fetch it, verify it, load it.

Owns:

* ``verify_manifest`` — every check a block must pass before any of its bytes touch the cache: canonical
  manifest, signature by a trusted key, fingerprint, block hash, parent hash, chain rule
  ``block_hash == hash_block(parent, tokens)``, token ids equal to the subscriber's own prompt slice, and
  the shape/dtype/codec it expects. Payload digests are checked per layer object as it arrives.
* ``BlockFetcher`` — over a ``MoqtConnection``: ``locate`` sends one TRACK_STATUS per candidate block all
  at once (one round trip whatever the prompt length; TRACK_STATUS moves no payload, so nothing past the
  first miss is pulled) and ``fetch`` pipelines FETCHes of the chosen prefix with a bounded window,
  decoding and importing each layer into the paged cache as it arrives.

Any failure (timeout, reset, error reply, failed check) ends the usable prefix at that block; the caller
recomputes the rest. A fetch problem costs time, never correctness.
"""

from __future__ import annotations

import asyncio
import contextlib
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


class BlockRejected(Exception):
    """A fetched block failed verification; the message says which check."""


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
    trust: TrustStore | None,
) -> BlockManifest:
    """Decode and check a manifest object; raises ``BlockRejected`` naming the failed check.

    ``trust`` None accepts any valid signature (development mode, chosen explicitly by the operator).
    """
    try:
        m = BlockManifest.decode(data)
    except KVObjectError as exc:
        raise BlockRejected(f"malformed manifest: {exc}") from exc
    if trust is not None:
        if not trust.verify_manifest(m, m.key_id, m.signature):
            raise BlockRejected(f"signature not from a trusted key (key id {m.key_id.hex()[:16]})")
    elif not m.signature:
        raise BlockRejected("unsigned manifest")
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


class BlockSink(Protocol):
    """Where verified layers go: the node's paged cache (``begin/import/finish/abort`` import protocol)."""

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
        trust: TrustStore | None,
        abr: KvAbr,
        *,
        timeout: float = 10.0,
        window: int = 64,
        straggler_grace: float = 0.5,
        device: torch.device | None = None,
    ) -> None:
        self.conn = conn
        self.fingerprint = fingerprint
        self.tenant = tenant
        self.shape = shape
        self.dtype = dtype
        self.trust = trust
        self.abr = abr
        self.timeout = timeout
        self.window = window
        self.straggler_grace = straggler_grace
        """Seconds (at least; 4x the first answer's delay if longer) a locate waits for late answers."""
        self.device = device or torch.device("cpu")

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
        """Fetch, verify and import blocks in order with up to ``window`` FETCHes in flight.

        All FETCHes of the window go out at once (pipelined); objects are consumed in block order, so
        the blocks load in chain order while later ones are still on the wire.
        """
        out = FetchOutcome()
        end = Location(BLOCK_GROUP_ID, self.shape[0] + 1)
        handles: dict[int, FetchHandle] = {}
        next_issue = 0
        started = time.perf_counter()
        try:
            for index, exp in enumerate(expected):
                while next_issue < len(expected) and next_issue < index + self.window:
                    e, r = expected[next_issue], renditions[next_issue]
                    ns, name = block_track(self.fingerprint, self.tenant, e.block_hash, r)
                    handles[next_issue] = await self.conn.fetch(ns, name, Location(BLOCK_GROUP_ID, 0), end)
                    next_issue += 1
                handle = handles.pop(index)
                try:
                    await self._load_block(handle, exp, renditions[index], sink, out)
                except BlockRejected as exc:
                    out.error, out.rejected = f"block {exp.block_index} rejected: {exc}", True
                    break
                except TimeoutError:
                    out.error = f"timed out after {self.timeout:.1f}s waiting for block {exp.block_index}"
                    break
                except (MoqtConnectionError, RequestRejected, StreamResetError, LimitError, CodecError,
                        KVCacheError) as exc:
                    out.error = f"block {exp.block_index}: {exc}"
                    break
                finally:
                    handle.cancel()
                out.loaded = index + 1
        except MoqtConnectionError as exc:  # the session died while issuing
            out.error = f"fetch failed: {exc}"
        finally:
            for h in handles.values():
                h.cancel()
        elapsed = time.perf_counter() - started
        if out.bytes and elapsed > 0:
            self.abr.throughput.add(out.bytes, elapsed)
        return out

    async def _load_block(
        self, handle: FetchHandle, exp: ExpectedBlock, rendition: str, sink: BlockSink, out: FetchOutcome
    ) -> None:
        """Consume one FETCH: verify the manifest, then verify, decode and import each layer as it arrives."""
        num_layers = self.shape[0]
        manifest: BlockManifest | None = None
        importing = False
        next_object = MANIFEST_OBJECT_ID
        nbytes = 0
        objects = aiter(handle)
        try:
            while next_object <= num_layers:
                try:
                    obj = await asyncio.wait_for(anext(objects), self.timeout)
                except StopAsyncIteration:
                    raise MoqtConnectionError(
                        f"fetch ended after {next_object} of {num_layers + 1} objects"
                    ) from None
                started = time.perf_counter()
                if obj.status != 0:
                    continue  # END_OF_TRACK / END_OF_GROUP markers carry nothing
                if obj.group_id != BLOCK_GROUP_ID or obj.object_id != next_object:
                    raise BlockRejected(f"unexpected object {obj.group_id}/{obj.object_id}")
                payload = obj.payload
                nbytes += len(payload)
                out.bytes += len(payload)
                if obj.object_id == MANIFEST_OBJECT_ID:
                    manifest = verify_manifest(
                        payload, exp, fingerprint=self.fingerprint, rendition=rendition, shape=self.shape,
                        dtype=self.dtype, trust=self.trust,
                    )
                    importing = sink.begin_import(exp.block_hash)
                    if not importing:
                        # Already cached (imported meanwhile by another request): nothing to load.
                        return
                else:
                    assert manifest is not None
                    if not manifest.verify_payload(obj.object_id, payload):
                        raise BlockRejected(f"payload digest of layer {obj.object_id - 1} differs")
                    codec = get_codec(rendition)
                    dtype = DTYPE_BY_NAME[manifest.dtype]
                    k, v = codec.decode(payload, manifest.layer_shape, dtype, self.device)
                    sink.import_layer(exp.block_hash, obj.object_id - 1, k, v)
                out.load_s += time.perf_counter() - started
                next_object += 1
            sink.finish_import(exp.block_hash)
            importing = False
        finally:
            if importing:
                sink.abort_import(exp.block_hash)
        out.renditions[rendition] = out.renditions.get(rendition, 0) + 1
        assert manifest is not None
        self.abr.renditions.add(rendition, raw_bytes(self.shape, manifest.dtype), nbytes, 0.0)


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
