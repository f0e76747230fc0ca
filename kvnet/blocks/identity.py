"""Which block of which prompt: the identity a publisher signs into a manifest and a subscriber checks.

Owns ``BlockIdentity`` and ``prompt_blocks``, the one place that cuts a prompt's token ids into full
blocks and pairs each with its chained hash and its parent's. The hashes come from
``kvnet.cache.hashing`` (computed once per prompt by the caller); nothing here hashes or does I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockIdentity:
    """One full block of a prompt's hash chain."""

    block_hash: bytes
    """``hash_block(parent_hash, token_ids)``: the block's name in caches and track names."""
    parent_hash: bytes
    """Hash of the previous block, or the chain root for block 0."""
    token_ids: tuple[int, ...]
    """The block's ``block_size`` token ids."""
    block_index: int
    """Position of the block in the prompt (0 for the first)."""


def prompt_blocks(
    token_ids: Sequence[int], block_size: int, hashes: Sequence[bytes], root: bytes, start: int, stop: int
) -> list[BlockIdentity]:
    """Identities of blocks ``start..stop-1`` of a prompt whose chained block hashes are ``hashes``."""
    if not 0 <= start <= stop <= len(hashes):
        raise ValueError(f"blocks {start}..{stop} are outside the prompt's {len(hashes)} full blocks")
    return [
        BlockIdentity(
            block_hash=hashes[i],
            parent_hash=root if i == 0 else hashes[i - 1],
            token_ids=tuple(token_ids[i * block_size : (i + 1) * block_size]),
            block_index=i,
        )
        for i in range(start, stop)
    ]
