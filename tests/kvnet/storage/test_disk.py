"""kvnet/storage/disk.py: crash-safe track files, digest-checked reads, byte-bounded eviction."""

from __future__ import annotations

import os
from pathlib import Path

from kvnet.storage.disk import DiskTier, StoredObject, StoredTrack, track_file_name
from proto.messages import KeyValuePair

NS = (b"kvnet", b"v2", b"f" * 64, b"default")


def track(name: bytes, size: int = 1000) -> StoredTrack:
    objects: list[StoredObject] = [
        (0, 0, i, 0, 0, (KeyValuePair(2, i),) if i == 0 else (), bytes([i]) * size) for i in range(3)
    ]
    return StoredTrack(NS, name, (0, 3), (), objects)


def test_round_trip_and_restart(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 20)
    disk.write(track(b"a"))
    assert (NS, b"a") in disk and disk.read(NS, b"b") is None
    again = DiskTier(tmp_path, 1 << 20)  # a new process on the same directory
    got = again.read(NS, b"a")
    assert got == track(b"a")


def test_truncated_altered_and_unfinished_files_are_never_served(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 20)
    for name in (b"cut", b"flip", b"ok"):
        disk.write(track(name))
    cut = tmp_path / track_file_name(NS, b"cut")
    os.truncate(cut, cut.stat().st_size - 1)
    flip = tmp_path / track_file_name(NS, b"flip")
    data = bytearray(flip.read_bytes())
    data[100] ^= 1
    flip.write_bytes(bytes(data))
    (tmp_path / "x.0123.tmp").write_bytes(b"half a write")
    disk = DiskTier(tmp_path, 1 << 20)
    assert not (tmp_path / "x.0123.tmp").exists()
    assert disk.read(NS, b"cut") is None and disk.read(NS, b"flip") is None
    assert disk.dropped == 2 and not cut.exists() and not flip.exists()
    assert disk.read(NS, b"ok") == track(b"ok")


def test_evicts_least_recently_used_to_its_budget(tmp_path: Path) -> None:
    probe = DiskTier(tmp_path / "probe", 1 << 20)
    probe.write(track(b"probe"))
    size = probe.bytes  # every test track has the same size
    disk = DiskTier(tmp_path / "tier", 2 * size + size // 2)
    disk.write(track(b"a"))
    disk.write(track(b"b"))
    assert disk.read(NS, b"a") is not None  # a is now more recently used than b
    disk.write(track(b"c"))
    assert (NS, b"b") not in disk and (NS, b"a") in disk and (NS, b"c") in disk
    assert disk.bytes <= disk.max_bytes and disk.evicted == 1
