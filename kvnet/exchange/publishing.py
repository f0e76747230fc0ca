"""Publisher side of kvnet: turn cached KV blocks into signed block objects and serve them over MoQT.

Owns:

* ``encode_blocks`` — export full blocks from the paged cache, encode each layer in every configured
  rendition (``kvnet.blocks.codecs``), build and sign the manifest (``proto.kvobject``), and produce
  ``StoredBlock`` entries for the ``BlockStore``.
* ``BlockServer`` — on a ``kvnet.net.connection.MoqtConnection`` to a relay: PUBLISH_NAMESPACE for the block
  namespace, then answer SUBSCRIBE, FETCH and TRACK_STATUS for every track the store holds (a relay that
  evicted a block may ask again at any time), plus optional PUBLISH of new blocks into the relay's cache so
  they outlive us.

It knows nothing about the model or the subscriber; the node wires it up.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvnet.blocks.codecs import CodecError, get_codec
from kvnet.blocks.identity import BlockIdentity
from kvnet.blocks.transform_codec import TransformCodec, token_shifts_from_importance
from kvnet.blocks.transform_tables import TransformTables
from kvnet.cache.paged_cache import PagedKVCache
from kvnet.dtypes import dtype_name
from kvnet.exchange.blockstore import BlockStore, StoredBlock
from kvnet.net.connection import MoqtConnection
from kvnet.net.errors import ConnectionClosed, MoqtConnectionError, RequestRejected
from kvnet.net.handles import IncomingFetch, IncomingRequest, IncomingSubscribe, IncomingTrackStatus
from kvnet.security.signing import Signer
from proto.data import ObjectStatus
from proto.errors import PublishDoneCode, RequestErrorCode, UsageError
from proto.kvobject import (
    BLOCK_GROUP_ID,
    DEFAULT_DIGEST_ALGORITHM,
    BlockManifest,
    KVObjectError,
    block_namespace,
    block_track,
    parse_block_track,
    parse_tables_track,
    tables_track,
)
from proto.messages import Location, MessageParameters, TrackNamespace

logger = logging.getLogger(__name__)


def encode_blocks(
    cache: PagedKVCache,
    sources: Sequence[BlockIdentity],
    *,
    fingerprint: bytes,
    renditions: Sequence[str],
    signer: Signer,
    tables: TransformTables | None = None,
    importance: torch.Tensor | None = None,
    digest_algorithm: str = DEFAULT_DIGEST_ALGORITHM,
) -> list[StoredBlock]:
    """Encoded, signed objects of ``sources`` (blocks cached in ``cache``), one entry per rendition.

    Object payloads: object 0 is the manifest, object ``l + 1`` the codec payload of layer ``l``.
    Blocks that are no longer cached (evicted meanwhile) are skipped. ``tables``: the model's ``kvtc``
    tables, which that rendition needs; ``importance``: the attention each token of the sources' sequence
    gets (``[L, N]``, ``kvnet.model.importance.token_importance``), by which kvtc codes a token finer or
    coarser. ``digest_algorithm``: what the manifests' payload digests are computed with
    (``proto.kvobject.DIGEST_ALGORITHMS``).
    """
    shifts = None if importance is None else token_shifts_from_importance(importance)
    out: list[StoredBlock] = []
    for src in sources:
        if not cache.contains_block(src.block_hash):
            continue
        kv = cache.export_block(src.block_hash)
        rows = slice(src.block_index * kv.k.shape[1], (src.block_index + 1) * kv.k.shape[1])
        block_shifts = None if shifts is None or shifts.shape[1] < rows.stop else shifts[:, rows]
        out += encode_block(kv.k, kv.v, src, fingerprint=fingerprint, renditions=renditions, signer=signer,
                            tables=tables, token_shifts=block_shifts, digest_algorithm=digest_algorithm)
    return out


def encode_block(
    k: torch.Tensor,
    v: torch.Tensor,
    src: BlockIdentity,
    *,
    fingerprint: bytes,
    renditions: Sequence[str],
    signer: Signer,
    tables: TransformTables | None = None,
    token_shifts: np.ndarray | None = None,
    digest_algorithm: str = DEFAULT_DIGEST_ALGORITHM,
) -> list[StoredBlock]:
    """Encoded, signed objects of one block whose K and V over all layers are ``k, v: [L, B, H_kv, D]``,
    one entry per rendition (``encode_blocks`` for blocks held by another engine's cache); none for kvtc
    when the block holds values its tables cannot code (logged). ``token_shifts`` (``[L, B]``): kvtc's
    per-token steps (``TransformCodec.encode_block``)."""
    shape = (int(k.shape[0]), int(k.shape[1]), int(k.shape[2]), int(k.shape[3]))
    now_ms = int(time.time() * 1000)
    out: list[StoredBlock] = []
    for rendition in renditions:
        if rendition == TransformCodec.name:
            if tables is None:
                raise CodecError("the kvtc rendition needs the model's tables (--kvtc-tables)")
            # The sequence's first token is an attention sink: coded finer (kvnet.blocks.transform_codec).
            sinks = int(src.block_index == 0)
            try:
                payloads = TransformCodec(fingerprint).encode_block(
                    k, v, tables, sink_rows=sinks, token_shifts=token_shifts,
                    first_position=src.block_index * shape[1])
            except CodecError as exc:
                # Values far outside what the tables were calibrated on: the block's other renditions
                # still go out, and a subscriber that asks for kvtc finds this block missing, not wrong.
                logger.warning("block %d (%s): not published as kvtc: %s", src.block_index,
                               src.block_hash.hex()[:16], exc)
                continue
        else:
            codec = get_codec(rendition)
            payloads = [codec.encode(k[layer], v[layer]) for layer in range(shape[0])]
        manifest = BlockManifest.for_payloads(
            fingerprint=fingerprint,
            block_hash=src.block_hash,
            parent_hash=src.parent_hash,
            token_ids=src.token_ids,
            block_index=src.block_index,
            codec=rendition,
            dtype=dtype_name(k.dtype),
            shape=shape,
            payloads=payloads,
            key_id=signer.key_id,
            created_at_ms=now_ms,
            digest_algorithm=digest_algorithm,
        )
        manifest = manifest.with_signature(signer.sign_manifest(manifest))
        out.append(
            StoredBlock(
                block_hash=src.block_hash,
                rendition=rendition,
                objects=(manifest.encode(), *payloads),
                manifest=manifest,
            )
        )
    return out


@dataclass
class ServerStats:
    """Counters of what the publisher answered."""

    track_status_ok: int = 0
    track_status_missing: int = 0
    fetches_served: int = 0
    subscribes_served: int = 0
    objects_sent: int = 0
    bytes_sent: int = 0
    pushed_tracks: int = 0
    requests_refused: int = 0


class PushResult(enum.Enum):
    """What became of one block pushed into the relay's cache."""

    ACCEPTED = "accepted"
    """PUBLISH_OK came and the block's objects were sent."""
    REFUSED = "refused"
    """The relay answered PUBLISH with REQUEST_ERROR (it holds the block already, or takes no pushes)."""
    LOST = "lost"
    """The session ended before the block was sent."""


class BlockServer:
    """Answers block requests arriving on one ``MoqtConnection`` out of a ``BlockStore``.

    ``announce`` sends PUBLISH_NAMESPACE; ``serve`` answers the peer's TRACK_STATUS, FETCH and SUBSCRIBE
    until the session ends (each FETCH/SUBSCRIBE in its own task, so one large block waiting for
    flow control never delays a TRACK_STATUS); ``push`` PUBLISHes blocks into the relay's cache.
    """

    def __init__(
        self, conn: MoqtConnection, store: BlockStore, fingerprint: bytes, namespace_id: str, num_layers: int,
        tables: Mapping[bytes, tuple[bytes, ...]] | None = None,
    ) -> None:
        """``namespace_id`` is the namespace-id field of our block namespace (``NodeSecret.namespace_id``
        of the tenant, or the tenant id itself without a node secret). ``tables``: the objects of each
        tables track we serve (``proto.kvobject.tables_chunks`` of a signed table object), by digest."""
        self.conn = conn
        self.store = store
        self.fingerprint = fingerprint
        self.namespace_id = namespace_id
        self.num_layers = num_layers
        self.tables: Mapping[bytes, tuple[bytes, ...]] = tables if tables is not None else {}
        self.stats = ServerStats()
        self._next_alias = 1

    @property
    def namespace(self) -> TrackNamespace:
        return block_namespace(self.fingerprint, self.namespace_id)

    async def announce(self) -> None:
        """PUBLISH_NAMESPACE for our block namespace, so the relay routes requests for it to us."""
        await self.conn.publish_namespace(self.namespace)

    def _lookup(self, namespace: Sequence[bytes], name: bytes) -> tuple[bytes, ...] | None:
        """The objects of the block or tables track called ``name``, or None if we do not serve it."""
        try:
            track = parse_block_track(namespace, name)
        except KVObjectError:
            return self._lookup_tables(namespace, name)
        if track.fingerprint != self.fingerprint or track.namespace_id != self.namespace_id:
            return None
        block = self.store.get(track.block_hash, track.rendition)
        return None if block is None else block.objects

    def _lookup_tables(self, namespace: Sequence[bytes], name: bytes) -> tuple[bytes, ...] | None:
        try:
            track = parse_tables_track(namespace, name)
        except KVObjectError:
            return None
        if track.fingerprint != self.fingerprint or track.namespace_id != self.namespace_id:
            return None
        return self.tables.get(track.digest)

    @staticmethod
    def _largest(objects: tuple[bytes, ...]) -> Location:
        return Location(BLOCK_GROUP_ID, len(objects) - 1)

    async def serve(self) -> None:
        """Answer requests until the session ends."""
        async with asyncio.TaskGroup() as tasks:
            async for req in self.conn.incoming_requests():
                try:
                    if isinstance(req, IncomingTrackStatus):
                        self._answer_track_status(req)
                    elif isinstance(req, IncomingFetch):
                        tasks.create_task(self._guard(req, self._serve_fetch(req)))
                    elif isinstance(req, IncomingSubscribe):
                        tasks.create_task(self._guard(req, self._serve_subscribe(req)))
                    else:
                        self.stats.requests_refused += 1
                        req.reject(RequestErrorCode.NOT_SUPPORTED, "a kvnet publisher only serves blocks")
                except (UsageError, ConnectionClosed) as exc:
                    logger.debug("request %d ended early: %s", req.request_id, exc)

    async def _guard(self, req: IncomingRequest, work: Awaitable[None]) -> None:
        # One failed request must not end the session's other requests (the TaskGroup would cancel them).
        try:
            await work
        except (UsageError, ConnectionClosed) as exc:
            logger.debug("request %d ended early: %s", req.request_id, exc)

    def _answer_track_status(self, req: IncomingTrackStatus) -> None:
        ev = req.event
        objects = self._lookup(ev.track_namespace, ev.track_name)
        if objects is None:
            self.stats.track_status_missing += 1
            req.reject(RequestErrorCode.DOES_NOT_EXIST, "no such block")
            return
        self.stats.track_status_ok += 1
        req.respond(MessageParameters(largest_object=self._largest(objects)))

    async def _serve_fetch(self, req: IncomingFetch) -> None:
        ev = req.event
        if ev.track_namespace is None or ev.track_name is None:
            req.reject(RequestErrorCode.NOT_SUPPORTED, "joining fetch")
            return
        objects = self._lookup(ev.track_namespace, ev.track_name)
        if objects is None:
            req.reject(RequestErrorCode.DOES_NOT_EXIST, "no such block")
            return
        start = ev.start or Location(0, 0)
        end = ev.end or Location(0, 0)
        last = len(objects) - 1
        # End {g, 0} with g past the block's group means "everything"; otherwise objects up to end.object-1.
        stop = last if end.group > BLOCK_GROUP_ID or end.object == 0 else min(end.object - 1, last)
        first = start.object if start.group == BLOCK_GROUP_ID else last + 1
        if first > stop:
            # Draft-18 FETCH: a start past the largest object is INVALID_RANGE, not an empty success.
            why = f"objects {first}..{stop} of a {last + 1}-object block"
            req.reject(RequestErrorCode.INVALID_RANGE, why)
            return
        # FETCH_OK says exactly how far this response goes: End Of Track only when it reaches the block's
        # last object. A relay caches what FETCH_OK claims, so a probe of object 0 must not claim the block.
        req.accept_fetch(stop == last, Location(BLOCK_GROUP_ID, stop + 1))
        for object_id in range(first, stop + 1):
            if req.cancelled.is_set():
                return
            payload = objects[object_id]
            req.send_object(BLOCK_GROUP_ID, 0, object_id, payload)
            self.stats.objects_sent += 1
            self.stats.bytes_sent += len(payload)
            await req.drain()
        if not req.cancelled.is_set():
            req.finish()
            self.stats.fetches_served += 1

    async def _serve_subscribe(self, req: IncomingSubscribe) -> None:
        ev = req.event
        objects = self._lookup(ev.track_namespace, ev.track_name)
        if objects is None:
            req.reject(RequestErrorCode.DOES_NOT_EXIST, "no such block")
            return
        req.accept_subscribe(self._alias(), MessageParameters(largest_object=self._largest(objects)))
        stream_id = req.open_subgroup(BLOCK_GROUP_ID, 0, first_object=True)  # it starts at object 0
        for object_id, payload in enumerate(objects):
            if req.cancelled.is_set():
                return
            req.send_object(stream_id, object_id, payload)
            self.stats.objects_sent += 1
            self.stats.bytes_sent += len(payload)
            await req.drain()
        # END_OF_TRACK status object after the last layer, then FIN (KVOBJECT.md section 3).
        req.send_object(stream_id, len(objects), b"", True, status=ObjectStatus.END_OF_TRACK)
        req.publish_done(PublishDoneCode.TRACK_ENDED, "block complete")
        self.stats.subscribes_served += 1


    def _alias(self) -> int:
        alias = self._next_alias
        self._next_alias += 1
        return alias

    async def push(self, blocks: Sequence[StoredBlock], window: int = 64) -> int:
        """``push_each``, counted: how many blocks the relay accepted."""
        return sum(result is PushResult.ACCEPTED for result in await self.push_each(blocks, window))

    async def push_each(self, blocks: Sequence[StoredBlock], window: int = 64) -> list[PushResult]:
        """PUBLISH each block track, then its objects, into the relay's cache; one result per block.

        Objects follow PUBLISH_OK: a relay that already holds the block (or refuses pushes) answers with
        REQUEST_ERROR, and the block's bytes are then never sent (``REFUSED``). A block counts as
        ``ACCEPTED`` once PUBLISH_OK came and its stream's bytes were sent; ``LOST`` when the session
        ended first. Up to ``window`` PUBLISHes are in flight at once, so pushing a whole prompt costs about
        one round trip. PUBLISH_DONE (Stream Count 1) follows once the subgroup stream's bytes are
        acknowledged: the receiver waits for the stream only a bounded time after PUBLISH_DONE, and on a
        slow link (1452-byte datagrams) a block still queued here would outlast that wait and be dropped.
        A relay that refuses PUBLISH still reaches the blocks through PUBLISH_NAMESPACE routing while we run.
        """
        slots = asyncio.Semaphore(window)

        async def one(block: StoredBlock) -> PushResult:
            async with slots:
                ns, name = block_track(self.fingerprint, self.namespace_id, block.block_hash, block.rendition)
                return await self._push_track(ns, name, block.objects)

        return list(await asyncio.gather(*(one(b) for b in blocks)))

    async def push_tables(self) -> list[PushResult]:
        """PUBLISH every tables track we serve into the relay's cache (as ``push_each`` a block), so blocks
        that name them stay decodable from the relay after we left."""
        return [await self._push_track(*tables_track(self.fingerprint, self.namespace_id, digest), objects)
                for digest, objects in list(self.tables.items())]

    async def _push_track(self, ns: TrackNamespace, name: bytes, objects: tuple[bytes, ...]) -> PushResult:
        if self.conn.is_closed:
            return PushResult.LOST
        alias = self._alias()
        try:
            params = MessageParameters(largest_object=self._largest(objects))
            ok = await self.conn.publish(ns, name, alias, params)
        except RequestRejected as exc:
            self.stats.requests_refused += 1
            logger.debug("relay refused PUBLISH (%s): serving on request only", exc)
            return PushResult.REFUSED
        except (MoqtConnectionError, UsageError):
            return PushResult.LOST
        if self.conn.is_closed:
            return PushResult.LOST
        try:
            stream_id = self._send_pushed_track(alias, objects)
            await self.conn.wait_stream_sent(stream_id)
            if self.conn.is_closed:
                return PushResult.LOST
            self.conn.publish_done(ok.request_id, PublishDoneCode.TRACK_ENDED, "track complete")
            await self.conn.wait_writable()
        except (MoqtConnectionError, UsageError):
            return PushResult.LOST
        return PushResult.ACCEPTED

    def _send_pushed_track(self, alias: int, objects: tuple[bytes, ...]) -> int:
        """All objects of one pushed track, then END_OF_TRACK + FIN (KVOBJECT.md section 3); returns the
        subgroup stream's id."""
        stream_id = self.conn.open_subgroup(alias, BLOCK_GROUP_ID, 0, first_object=True)
        for object_id, payload in enumerate(objects):
            self.conn.send_subgroup_object(stream_id, object_id, payload)
            self.stats.objects_sent += 1
            self.stats.bytes_sent += len(payload)
        self.conn.send_subgroup_object(
            stream_id, len(objects), b"", (), ObjectStatus.END_OF_TRACK, end_stream=True
        )
        self.stats.pushed_tracks += 1
        return stream_id
