"""The persistent tier of relay caches and publisher block stores: complete tracks kept as files in one
directory (``--cache-dir``).

Owns: ``DiskTier`` (file format, crash-safe writes, byte-bounded eviction, digest-checked reads). Memory
stays the serving path: the relay cache (``relay.cache.ObjectCache``) and a publisher's block store
(``kvnet.exchange.blockstore.BlockStore``) write what they hold here and, on a miss, load it back, so a
process restarted on the same directory serves what it had before. Knows nothing about the network or torch.

File format (one track per file, named by the SHA-256 of its Full Track Name)::

    magic "KVRT" | version u8 | body length u64 | body (msgpack) | SHA-256(body) (32 bytes)

where the body is ``[namespace fields, track name, end group, end object, track properties, objects]``.
A file is written to a temporary name in the same directory, fsynced, renamed over its final name and the
directory fsynced: after a crash a file is either complete or absent (temporary files are removed at
start-up). Reads check length and digest; a torn, truncated or altered file is deleted and reported as a
miss, never served.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgpack

from proto.messages import KeyValuePair, Properties

logger = logging.getLogger(__name__)

MAGIC = b"KVRT"
VERSION = 1
_HEADER = struct.Struct(">4sBQ")
_DIGEST_LEN = 32
SUFFIX = ".track"
TMP_SUFFIX = ".tmp"
MAX_FILE_BYTES = 1 << 32
"""Largest file read back (a track is bounded by ``CacheConfig.max_track_bytes`` long before this)."""

StoredObject = tuple[int, int | None, int, int, int, Properties, bytes]
"""(group, subgroup, object id, priority, status, properties, payload) of one cached object."""


@dataclass(frozen=True, slots=True)
class StoredTrack:
    """One complete track as read back from disk."""

    namespace: tuple[bytes, ...]
    name: bytes
    end: tuple[int, int]
    """Exclusive end of the track (it is final)."""
    properties: Properties
    objects: list[StoredObject]


class DiskTierError(Exception):
    """A file that cannot be served (torn, truncated, altered or not ours)."""


def track_file_name(namespace: Sequence[bytes], name: bytes) -> str:
    """File name of a track: SHA-256 over its length-prefixed namespace fields and name."""
    h = hashlib.sha256()
    for field in (*namespace, name):
        h.update(struct.pack(">I", len(field)))
        h.update(field)
    return h.hexdigest() + SUFFIX


def _properties_out(props: Properties) -> list[list[int | bytes]]:
    return [[p.type, p.value] for p in props]


def _properties_in(raw: object) -> Properties:
    if not isinstance(raw, list):
        raise DiskTierError("properties are not a list")
    out = []
    for item in raw:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], int)):
            raise DiskTierError("malformed property")
        if not isinstance(item[1], int | bytes):
            raise DiskTierError("malformed property value")
        out.append(KeyValuePair(item[0], item[1]))
    return tuple(out)


def encode_track(track: StoredTrack) -> bytes:
    body = msgpack.packb(
        [
            list(track.namespace),
            track.name,
            list(track.end),
            _properties_out(track.properties),
            [
                [g, sg, oid, prio, st, _properties_out(props), payload]
                for g, sg, oid, prio, st, props, payload in track.objects
            ],
        ],
        use_bin_type=True,
    )
    return _HEADER.pack(MAGIC, VERSION, len(body)) + body + hashlib.sha256(body).digest()


def decode_track(data: bytes) -> StoredTrack:
    """Parse and check one file's bytes; ``DiskTierError`` for anything not written whole by us."""
    if len(data) < _HEADER.size + _DIGEST_LEN:
        raise DiskTierError(f"truncated: {len(data)} bytes")
    magic, version, length = _HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise DiskTierError("not a relay cache file of this version")
    if len(data) != _HEADER.size + length + _DIGEST_LEN:
        raise DiskTierError(f"truncated or padded: {len(data)} bytes, header says {length} of body")
    body = data[_HEADER.size : _HEADER.size + length]
    if hashlib.sha256(body).digest() != data[-_DIGEST_LEN:]:
        raise DiskTierError("digest differs")
    try:
        ns, name, end, props, objects = msgpack.unpackb(body, raw=False, strict_map_key=True)
        track = StoredTrack(
            tuple(ns),
            name,
            (int(end[0]), int(end[1])),
            _properties_in(props),
            [
                (
                    int(g),
                    None if sg is None else int(sg),
                    int(oid),
                    int(prio),
                    int(st),
                    _properties_in(p),
                    payload,
                )
                for g, sg, oid, prio, st, p, payload in objects
            ],
        )
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise DiskTierError(f"malformed body: {exc}") from None
    if not all(isinstance(f, bytes) for f in track.namespace) or not isinstance(track.name, bytes):
        raise DiskTierError("malformed track name")
    if not all(isinstance(o[6], bytes) for o in track.objects):
        raise DiskTierError("malformed payload")
    return track


class DiskTier:
    """Complete tracks on disk, at most ``max_bytes`` of files, least recently used evicted first."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"cache directory bytes must be positive, got {max_bytes}")
        self.directory = directory
        self.max_bytes = max_bytes
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._files: OrderedDict[str, int] = OrderedDict()
        """File name -> size, least recently used first."""
        self.bytes = 0
        self.dropped = 0
        """Files found torn, truncated or altered and deleted."""
        self.evicted = 0
        self._scan()

    def _scan(self) -> None:
        """Index the files a previous run left (oldest first) and delete unfinished temporary files."""
        found: list[tuple[float, str, int]] = []
        for entry in os.scandir(self.directory):
            if entry.name.endswith(TMP_SUFFIX):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)  # a write that never reached its rename
                continue
            if entry.name.endswith(SUFFIX) and entry.is_file():
                st = entry.stat()
                found.append((st.st_mtime, entry.name, st.st_size))
        for _, name, size in sorted(found):
            self._files[name] = size
            self.bytes += size
        self._evict()

    def __len__(self) -> int:
        return len(self._files)

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, tuple) or len(key) != 2:
            return False
        return track_file_name(key[0], key[1]) in self._files

    def write(self, track: StoredTrack) -> None:
        """``write_file`` then ``record``, in the caller's thread."""
        self.record(*self.write_file(track))

    def write_file(self, track: StoredTrack) -> tuple[str, int]:
        """Store ``track`` crash-safely (temp file, fsync, rename, fsync of the directory); returns the
        file's name and size for ``record``. Touches no shared state, so it may run in a worker thread."""
        name = track_file_name(track.namespace, track.name)
        data = encode_track(track)
        final = self.directory / name
        tmp = self.directory / f"{name}.{secrets.token_hex(8)}{TMP_SUFFIX}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self._fsync_directory()
        return name, len(data)

    def record(self, name: str, size: int) -> None:
        """Index a file ``write_file`` put in place (most recently used) and evict down to the budget."""
        old = self._files.pop(name, None)
        if old is not None:
            self.bytes -= old
        self._files[name] = size
        self.bytes += size
        self._evict(keep=name if size <= self.max_bytes else None)

    def read(self, namespace: Sequence[bytes], track_name: bytes) -> StoredTrack | None:
        """The stored track, or None (absent, or found damaged: then the file is deleted and counted)."""
        name = track_file_name(namespace, track_name)
        if name not in self._files:
            return None
        path = self.directory / name
        try:
            if path.stat().st_size > MAX_FILE_BYTES:
                raise DiskTierError("file too large")
            track = decode_track(path.read_bytes())
            if track.namespace != tuple(namespace) or track.name != track_name:
                raise DiskTierError("file holds another track")
        except FileNotFoundError:
            self._forget(name)
            return None
        except (DiskTierError, OSError) as exc:
            logger.warning("dropping damaged cache file", extra={"file": name, "reason": str(exc)})
            self.dropped += 1
            self._delete(name)
            return None
        self._files.move_to_end(name)
        return track

    def discard(self, namespace: Sequence[bytes], track_name: bytes, reason: str) -> None:
        """Delete a stored track its reader found invalid (intact on disk, wrong inside), and count it as
        dropped, so it is not read and checked again on every miss."""
        name = track_file_name(namespace, track_name)
        if name in self._files:
            logger.warning("dropping invalid cache file", extra={"file": name, "reason": reason})
            self.dropped += 1
            self._delete(name)

    def _fsync_directory(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _forget(self, name: str) -> None:
        size = self._files.pop(name, None)
        if size is not None:
            self.bytes -= size

    def _delete(self, name: str) -> None:
        self._forget(name)
        with contextlib.suppress(OSError):
            os.unlink(self.directory / name)

    def _evict(self, keep: str | None = None) -> None:
        while self.bytes > self.max_bytes and self._files:
            victim = next((n for n in self._files if n != keep), None)
            if victim is None:
                break
            self._delete(victim)
            self.evicted += 1
