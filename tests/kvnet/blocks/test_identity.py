"""Tests for kvnet.blocks.identity: a prompt's blocks paired with their chained hashes."""

from __future__ import annotations

import pytest

from kvnet.blocks.identity import BlockIdentity, prompt_blocks
from kvnet.cache.hashing import block_hashes, hash_block, root_hash

ROOT = root_hash(b"\x01" * 32, b"")
TOKENS = list(range(100, 111))  # two full blocks of 4 and three tokens left over
HASHES = block_hashes(TOKENS, 4, ROOT)


def test_blocks_chain_from_the_root() -> None:
    blocks = prompt_blocks(TOKENS, 4, HASHES, ROOT, 0, len(HASHES))
    assert blocks == [
        BlockIdentity(HASHES[0], ROOT, (100, 101, 102, 103), 0),
        BlockIdentity(HASHES[1], HASHES[0], (104, 105, 106, 107), 1),
    ]
    for block in blocks:
        assert hash_block(block.parent_hash, block.token_ids) == block.block_hash


def test_a_later_range_keeps_its_parents() -> None:
    (second,) = prompt_blocks(TOKENS, 4, HASHES, ROOT, 1, 2)
    assert (second.parent_hash, second.block_index) == (HASHES[0], 1)
    assert prompt_blocks(TOKENS, 4, HASHES, ROOT, 2, 2) == []


@pytest.mark.parametrize(("start", "stop"), [(-1, 1), (1, 0), (0, 3)])
def test_ranges_outside_the_prompt_are_refused(start: int, stop: int) -> None:
    with pytest.raises(ValueError, match="outside the prompt's 2 full blocks"):
        prompt_blocks(TOKENS, 4, HASHES, ROOT, start, stop)
