"""Decoder tables that a rendition names by digest (``kvtc``'s ``TransformTables``), fetched over MoQT.

Owns: ``TablesSource``, what a node's fetch sessions share to turn a tables digest named by a ``kvtc`` payload
into verified tables: kept in memory (and in a directory when given, ``TableStore``), else fetched once from
the relay's tables track (``proto.kvobject.tables_track``, KVOBJECT.md 2.3), joined, checked (digest of the
track name, signature under a trusted key, this node's model fingerprint) and installed in the model-bound
``kvtc`` codec the fetch sessions decode with. Concurrent requests for one digest share one FETCH; tables
that failed verification are remembered (a bounded set) so a bad publisher costs one fetch per digest.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from kvnet.blocks.codecs import CodecError
from kvnet.blocks.kvtc_entropy import EntropyProcesses
from kvnet.blocks.transform_codec import TransformCodec
from kvnet.blocks.transform_tables import (
    TableStore,
    TransformTables,
    sign_tables,
    verify_tables,
)
from kvnet.net.connection import MoqtConnection
from kvnet.net.errors import LimitError, MoqtConnectionError, RequestRejected, StreamResetError
from kvnet.security.signing import Signer, TrustStore
from proto.kvobject import (
    BLOCK_GROUP_ID,
    MAX_TABLES_BYTES,
    TABLES_SIGNATURE_LEN,
    KVObjectError,
    tables_body_length,
    tables_chunks,
    tables_track,
)
from proto.messages import Location

logger = logging.getLogger(__name__)

__all__ = ["TablesSource", "TablesStats"]

MAX_REFUSED_DIGESTS = 256
"""Digests whose tables failed verification, remembered so they are not fetched again (oldest dropped)."""
MAX_FETCHES_IN_FLIGHT = 2
"""Tables fetches at once: an honest publisher has one set per model, and a hostile one naming a new digest
in every block must not make a node buffer many table objects at a time."""


@dataclass
class TablesStats:
    """Counters for logs and tests."""

    fetched: int = 0
    """Table objects fetched from a relay and verified."""
    fetched_bytes: int = 0
    refused: int = 0
    """Table objects that failed verification (never installed)."""


class TablesSource:
    """Verified decoder tables of one model, by digest: memory, then ``directory``, then the relay."""

    def __init__(self, trust: TrustStore, fingerprint: bytes, namespace_id: str, *,
                 directory: Path | None = None, timeout: float = 30.0,
                 entropy: EntropyProcesses | None = None) -> None:
        self.trust = trust
        self.fingerprint = fingerprint
        self.namespace_id = namespace_id
        self.timeout = timeout
        self.codec = TransformCodec(fingerprint, entropy=entropy)
        """The ``kvtc`` codec this node decodes with: it holds only tables verified for ``fingerprint``, and
        entropy-decodes on ``entropy``'s processes where given."""
        self._store = TableStore(directory, trust, fingerprint) if directory is not None else None
        self.served: dict[bytes, tuple[bytes, ...]] = {}
        """The objects of the tables tracks this node serves (its own tables), by digest."""
        self._pending: dict[bytes, asyncio.Task[TransformTables]] = {}
        self._refused: OrderedDict[bytes, str] = OrderedDict()
        self.stats = TablesStats()

    def publish(self, tables: TransformTables, signer: Signer) -> None:
        """Tables this node codes its own blocks with: signed with its key (as its blocks are, so whoever
        trusts its blocks trusts them), decoded locally without a fetch, and served as a tables track
        (``served``, which the node's ``BlockServer`` answers from)."""
        if tables.fingerprint != self.fingerprint:
            raise CodecError(f"kvtc tables are bound to model {tables.fingerprint.hex()[:16]}, not "
                             f"{self.fingerprint.hex()[:16]}")
        self.codec.install(tables)
        self.served[tables.digest] = tables_chunks(sign_tables(tables, signer))

    def installed(self, digest: bytes) -> TransformTables | None:
        """The tables called ``digest`` if this node's codec holds them (no disk, no relay)."""
        try:
            return self.codec.tables(digest)
        except CodecError:
            return None

    async def resolve(self, conn: MoqtConnection, digest: bytes) -> TransformTables:
        """Verified tables called ``digest``, fetched over ``conn`` when this node lacks them (once, however
        many blocks ask at the same time); ``CodecError`` with one line when they cannot be had.

        The fetch is a task of its own: a request that gives up (its deadline passed, the ABR recomputes)
        stops waiting, and the tables still arrive for the next one, on a slow link too."""
        found = self.installed(digest)
        if found is not None:
            return found
        reason = self._refused.get(digest)
        if reason is not None:
            raise CodecError(reason)
        task = self._pending.get(digest)
        if task is None:
            if len(self._pending) >= MAX_FETCHES_IN_FLIGHT:
                busy = f"{len(self._pending)} other tables are being fetched"
                raise CodecError(f"kvtc tables {digest.hex()[:16]}: {busy}")
            task = asyncio.create_task(self._obtain(conn, digest), name=f"kvtc-tables-{digest.hex()[:8]}")
            self._pending[digest] = task
            task.add_done_callback(lambda done: self._fetched(digest, done))
        return await asyncio.shield(task)

    def _fetched(self, digest: bytes, task: asyncio.Task[TransformTables]) -> None:
        self._pending.pop(digest, None)
        if not task.cancelled():
            task.exception()  # retrieved: whoever awaited it has seen it, and nobody else must log it

    async def _obtain(self, conn: MoqtConnection, digest: bytes) -> TransformTables:
        """The tables from this node's directory, else from the relay; either way verified and prepared on
        a thread (10 MB hashed, parsed, inverted), not on the event loop. A stored copy that no longer
        verifies (altered on disk) is fetched again, and the good copy replaces it."""
        if self._store is not None:
            try:
                stored = await asyncio.to_thread(self._stored, digest)
            except CodecError as exc:
                logger.warning("kvtc tables %s in %s: %s; fetching them again", digest.hex()[:16],
                               self._store.directory, exc)
                stored = None
            if stored is not None:
                self.codec.install(stored)
                return stored
        return await self._fetch(conn, digest)

    def _stored(self, digest: bytes) -> TransformTables | None:
        assert self._store is not None
        tables = self._store.get(digest)
        if tables is not None:
            TransformCodec.prepare(tables)
        return tables

    async def _fetch(self, conn: MoqtConnection, digest: bytes) -> TransformTables:
        ns, name = tables_track(self.fingerprint, self.namespace_id, digest)
        handle = await conn.fetch(ns, name, Location(BLOCK_GROUP_ID, 0), Location(BLOCK_GROUP_ID + 1, 0))
        objects = aiter(handle)
        parts: list[bytes] = []
        size = limit = 0
        try:
            while True:
                # A bound on each wait, not on the whole: 10 MB of tables take seconds on a WAN link.
                try:
                    async with asyncio.timeout(self.timeout):
                        obj = await anext(objects)
                except StopAsyncIteration:
                    break
                if obj.status != 0:
                    continue  # END_OF_TRACK / END_OF_GROUP carry nothing
                if obj.group_id != BLOCK_GROUP_ID or obj.object_id != len(parts):
                    raise self._refuse(digest, f"unexpected object {obj.group_id}/{obj.object_id}")
                size += len(obj.payload)
                if not parts:  # the first piece holds the header, which fixes the size
                    try:
                        body = tables_body_length(obj.payload)
                        limit = min(MAX_TABLES_BYTES, body + 1 + 255 + TABLES_SIGNATURE_LEN)
                    except KVObjectError as exc:
                        raise self._refuse(digest, str(exc)) from None
                if size > limit:
                    raise self._refuse(digest, f"more than the {limit} bytes its header allows")
                parts.append(bytes(obj.payload))
        except TimeoutError:
            why = f"nothing arrived for {self.timeout:.0f}s after {size} bytes"
            raise CodecError(f"kvtc tables {digest.hex()[:16]}: {why}") from None
        except (MoqtConnectionError, RequestRejected, StreamResetError, LimitError) as exc:
            # Not the block's own failure: a block fetch would take a rejection as "not whole yet" and retry.
            raise CodecError(f"kvtc tables {digest.hex()[:16]}: fetch failed ({exc})") from None
        finally:
            handle.cancel()
        data = b"".join(parts)
        try:
            # Hashing, parsing and inverting 10 MB of tables is not the event loop's work.
            tables = await asyncio.to_thread(self._verified, data, digest)
        except CodecError as exc:
            raise self._refuse(digest, str(exc)) from None
        self.codec.install(tables)
        self.stats.fetched += 1
        self.stats.fetched_bytes += len(data)
        logger.info("kvtc tables %s fetched and verified (%.1f MB)", digest.hex()[:16], len(data) / 1e6)
        return tables

    def _verified(self, data: bytes, digest: bytes) -> TransformTables:
        tables = verify_tables(data, self.trust, self.fingerprint, digest)
        if self._store is not None:
            self._store.keep(data, tables)
        TransformCodec.prepare(tables)  # here, off the event loop, rather than in the first block's decode
        return tables

    def _refuse(self, digest: bytes, why: str) -> CodecError:
        reason = f"kvtc tables {digest.hex()[:16]} refused: {why}"
        self._refused[digest] = reason
        while len(self._refused) > MAX_REFUSED_DIGESTS:
            self._refused.popitem(last=False)
        self.stats.refused += 1
        logger.warning("%s", reason)
        return CodecError(reason)
