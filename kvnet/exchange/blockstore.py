"""Publisher-side store of encoded KV block objects, bounded in bytes, with its own eviction.

Owns: the encoded objects a publisher has produced (one entry per block hash and rendition) and which of
them to drop when the byte budget is exceeded. A publisher keeps answering SUBSCRIBE/FETCH/TRACK_STATUS
from here for as long as it runs, so a relay that evicted a block can ask again. It knows nothing about
the network, the protocol or torch: entries are opaque byte payloads plus an opaque manifest.

Eviction is LRU over entries, with one twist that matters for prefix chains: a block is useless when any
block before it is gone (locating stops at the first miss). So ``put_chain`` inserts a prompt's blocks
tail-first and ``touch_chain`` refreshes them tail-first, leaving the chain's head most recently used:
the budget then trims chains from their tails, never cutting a head off a long, still-useful chain.

With a persistent tier (``disk``, the node's ``--cache-dir``) every stored block is also written to disk
(``kvnet.storage.disk``: crash-safe, digest-checked, its own byte budget) and a memory miss is looked up
there, so a publisher restarted on the same directory still serves what it published before.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvnet.storage.disk import DiskTier, StoredObject, StoredTrack
from proto.kvobject import BlockManifest, KVObjectError, layer_object_id

DISK_NAMESPACE = (b"kvnet-block-store",)
"""Namespace of the store's files in its ``DiskTier`` (the track name is ``<block hash hex>.<rendition>``)."""


@dataclass(frozen=True, slots=True)
class StoredBlock:
    """One block in one rendition, ready to send."""

    block_hash: bytes
    rendition: str
    objects: tuple[bytes, ...]
    """Object payloads in object-id order (manifest first, then per-layer payloads)."""
    manifest: Any = None
    """The decoded manifest (for answering status queries without re-parsing)."""

    @property
    def nbytes(self) -> int:
        return sum(len(o) for o in self.objects)


@dataclass
class StoreStats:
    """Counters for /metrics and logs."""

    entries: int = 0
    bytes: int = 0
    inserted: int = 0
    evicted: int = 0
    hits: int = 0
    misses: int = 0
    disk_loads: int = 0
    """Blocks loaded back from the persistent tier on a memory miss."""


@dataclass
class BlockStore:
    """LRU store of ``StoredBlock`` keyed by ``(block_hash, rendition)``, at most ``max_bytes``."""

    max_bytes: int
    disk: DiskTier | None = None
    """Persistent tier: every stored block is written there and memory misses are looked up there."""
    _entries: OrderedDict[tuple[bytes, str], StoredBlock] = field(default_factory=OrderedDict)
    stats: StoreStats = field(default_factory=StoreStats)

    def __post_init__(self) -> None:
        if self.max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {self.max_bytes}")

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    @property
    def nbytes(self) -> int:
        return self.stats.bytes

    def put(self, block: StoredBlock) -> bool:
        """Insert (or refresh) one entry; False when it alone exceeds the budget and was not stored."""
        if self.disk is not None:
            name = _disk_name(block.block_hash, block.rendition)
            if (DISK_NAMESPACE, name) not in self.disk:
                objects: list[StoredObject] = [(0, 0, i, 0, 0, (), p) for i, p in enumerate(block.objects)]
                self.disk.write(StoredTrack(DISK_NAMESPACE, name, (0, len(objects)), (), objects))
        return self._put_in_memory(block)

    def _put_in_memory(self, block: StoredBlock) -> bool:
        if block.nbytes > self.max_bytes:
            return False
        key = (block.block_hash, block.rendition)
        old = self._entries.pop(key, None)
        if old is not None:
            self.stats.bytes -= old.nbytes
        else:
            self.stats.inserted += 1
        self._entries[key] = block
        self.stats.bytes += block.nbytes
        self._evict()
        self.stats.entries = len(self._entries)
        return key in self._entries

    def put_chain(self, blocks: Sequence[StoredBlock]) -> int:
        """Insert a prompt's blocks (given in chain order) tail-first; returns how many are stored."""
        stored = 0
        for b in reversed(blocks):
            stored += self.put(b)
        return stored

    def get(self, block_hash: bytes, rendition: str) -> StoredBlock | None:
        """The entry, refreshed as most recently used, or None."""
        key = (block_hash, rendition)
        block = self._entries.get(key) or self._from_disk(block_hash, rendition)
        if block is None:
            self.stats.misses += 1
            return None
        self._entries.move_to_end(key)
        self.stats.hits += 1
        return block

    def peek(self, block_hash: bytes, rendition: str) -> StoredBlock | None:
        """The entry without refreshing it (status queries must not keep junk alive)."""
        return self._entries.get((block_hash, rendition)) or self._from_disk(block_hash, rendition)

    def _from_disk(self, block_hash: bytes, rendition: str) -> StoredBlock | None:
        """A block from the persistent tier, kept in memory again; None when absent, damaged or not this
        block. A file that fails these checks is deleted (by the tier, counted in its ``dropped``), so a
        planted or stale file costs one read, not one per miss."""
        if self.disk is None:
            return None
        name = _disk_name(block_hash, rendition)
        track = self.disk.read(DISK_NAMESPACE, name)
        if track is None:
            return None
        objects = tuple(o[6] for o in track.objects)
        try:
            manifest = _verified_manifest(block_hash, objects)
        except KVObjectError as exc:
            self.disk.discard(DISK_NAMESPACE, name, str(exc))
            return None
        block = StoredBlock(block_hash, rendition, objects, manifest)
        self.stats.disk_loads += 1
        self._put_in_memory(block)
        return block

    def recent(self, max_bytes: int) -> list[StoredBlock]:
        """The most recently used blocks held in memory, newest first, at most ``max_bytes`` of them."""
        picked: list[StoredBlock] = []
        total = 0
        for block in reversed(self._entries.values()):
            if total + block.nbytes > max_bytes:
                break
            picked.append(block)
            total += block.nbytes
        return picked

    def renditions(self, block_hash: bytes) -> list[str]:
        return [r for (h, r) in self._entries if h == block_hash]

    def touch_chain(self, keys: Iterable[tuple[bytes, str]]) -> None:
        """Refresh entries given in chain order, tail-first, so the head ends most recently used."""
        for key in reversed(list(keys)):
            if key in self._entries:
                self._entries.move_to_end(key)

    def _evict(self) -> None:
        while self.stats.bytes > self.max_bytes and self._entries:
            _, victim = self._entries.popitem(last=False)
            self.stats.bytes -= victim.nbytes
            self.stats.evicted += 1


def _verified_manifest(block_hash: bytes, objects: Sequence[bytes]) -> BlockManifest:
    """The manifest of a block read back from disk, once it names ``block_hash`` and every payload matches
    its digest; ``KVObjectError`` otherwise."""
    if not objects:
        raise KVObjectError("no objects")
    manifest = BlockManifest.decode(objects[0])
    if manifest.block_hash != block_hash:
        named = manifest.block_hash.hex()[:16]
        raise KVObjectError(f"manifest of block {named}..., not {block_hash.hex()[:16]}...")
    payloads = objects[1:]
    if len(payloads) != manifest.num_layers:
        raise KVObjectError(f"{len(payloads)} layer objects, the manifest lists {manifest.num_layers}")
    for layer, payload in enumerate(payloads):
        if not manifest.verify_payload(layer_object_id(layer, manifest.num_layers), payload):
            raise KVObjectError(f"layer {layer} payload does not match its digest")
    return manifest


def _disk_name(block_hash: bytes, rendition: str) -> bytes:
    return block_hash.hex().encode("ascii") + b"." + rendition.encode("ascii")
