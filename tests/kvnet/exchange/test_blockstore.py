"""Tests for kvnet/exchange/blockstore.py: byte budget, LRU eviction, chain-aware ordering."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvnet.exchange.blockstore import DISK_NAMESPACE, BlockStore, StoredBlock, _disk_name
from kvnet.storage.disk import DiskTier, StoredObject, StoredTrack
from tests.kvnet.exchange.conftest import Published


def _block(i: int, size: int = 100, rendition: str = "lossless") -> StoredBlock:
    payload = (b"m", b"x" * (size - 1))
    return StoredBlock(block_hash=i.to_bytes(32, "big"), rendition=rendition, objects=payload)


def test_put_get_and_byte_accounting() -> None:
    store = BlockStore(max_bytes=1000)
    assert store.put(_block(1))
    assert store.put(_block(1, rendition="int8"))
    assert store.nbytes == 200 and len(store) == 2
    got = store.get((1).to_bytes(32, "big"), "lossless")
    assert got is not None and got.nbytes == 100
    assert store.get((2).to_bytes(32, "big"), "lossless") is None
    assert sorted(store.renditions((1).to_bytes(32, "big"))) == ["int8", "lossless"]
    # Re-putting the same key replaces it without double counting.
    store.put(_block(1, size=50))
    assert store.nbytes == 150


def test_lru_eviction_respects_budget() -> None:
    store = BlockStore(max_bytes=300)
    for i in range(3):
        store.put(_block(i))
    store.get((0).to_bytes(32, "big"), "lossless")  # 0 becomes most recent; 1 is now the LRU
    store.put(_block(3))
    assert store.nbytes <= 300
    assert ((1).to_bytes(32, "big"), "lossless") not in store
    assert ((0).to_bytes(32, "big"), "lossless") in store
    assert store.stats.evicted == 1


def test_oversized_block_is_refused() -> None:
    store = BlockStore(max_bytes=50)
    assert not store.put(_block(1, size=100))
    assert len(store) == 0
    with pytest.raises(ValueError):
        BlockStore(max_bytes=0)


def test_chain_is_trimmed_from_the_tail() -> None:
    store = BlockStore(max_bytes=500)
    chain = [_block(i) for i in range(5)]
    assert store.put_chain(chain) == 5
    store.put(_block(99))  # over budget by one block: the tail (block 4) must go, not the head
    assert ((4).to_bytes(32, "big"), "lossless") not in store
    for i in range(4):
        assert ((i).to_bytes(32, "big"), "lossless") in store
    # Touching the chain keeps its head most recent.
    store.touch_chain([(b.block_hash, "lossless") for b in chain[:4]])
    store.put(_block(100))
    store.put(_block(101))
    assert ((0).to_bytes(32, "big"), "lossless") in store


def _plant(directory: Path, block: StoredBlock, objects: tuple[bytes, ...]) -> None:
    """A file of the persistent tier under ``block``'s name, intact on disk (right length and digest) but
    holding ``objects``: what another process, or a stale format, could leave there."""
    planted: list[StoredObject] = [(0, 0, i, 0, 0, (), p) for i, p in enumerate(objects)]
    DiskTier(directory, 1 << 24).write(StoredTrack(
        DISK_NAMESPACE, _disk_name(block.block_hash, block.rendition), (0, len(planted)), (), planted
    ))


@pytest.mark.parametrize("damage", ["not a manifest", "another block's manifest", "altered payload"])
def test_a_disk_file_that_fails_verification_is_removed_not_reread(
    published: Published, tmp_path: Path, damage: str
) -> None:
    block, other = published.blocks[0], published.blocks[1]
    objects = {
        "not a manifest": (b"\x00junk", *block.objects[1:]),
        "another block's manifest": (other.objects[0], *block.objects[1:]),
        "altered payload": (block.objects[0], block.objects[1][:-1] + bytes([block.objects[1][-1] ^ 1]),
                            *block.objects[2:]),
    }[damage]
    _plant(tmp_path, block, objects)
    disk = DiskTier(tmp_path, 1 << 24)  # a restarted node finds the file
    store = BlockStore(1 << 24, disk=disk)
    assert len(disk) == 1
    assert store.get(block.block_hash, block.rendition) is None
    assert len(disk) == 0 and disk.dropped == 1
    assert not list(tmp_path.glob("*.track"))  # deleted: the next miss does not read it again
    assert store.get(block.block_hash, block.rendition) is None and disk.dropped == 1


def test_a_verified_disk_file_is_served_after_a_restart(published: Published, tmp_path: Path) -> None:
    block = published.blocks[0]
    BlockStore(1 << 24, disk=DiskTier(tmp_path, 1 << 24)).put(block)
    again = BlockStore(1 << 24, disk=DiskTier(tmp_path, 1 << 24))
    loaded = again.get(block.block_hash, block.rendition)
    assert loaded is not None and loaded.objects == block.objects
    assert again.stats.disk_loads == 1
