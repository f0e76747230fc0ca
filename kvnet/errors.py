"""Typed errors of kvnet core: hashing, block pool, paged KV cache and the model.

This module owns the exception hierarchy only. It knows nothing about the network, the protocol or
the objects that raise these errors; every error carries a human-readable message naming the bad value.
Callers catch ``KVCacheError`` to handle any of them.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path


class KVCacheError(Exception):
    """Base class of every error raised by kvnet core."""


class CodecError(KVCacheError, ValueError):
    """A payload cannot be encoded or decoded: bad shapes, dtypes, unknown codec, or corrupt bytes (raised
    by kvnet.blocks, here so that kvtc's torch-free entropy processes raise the same type)."""


class PoolExhaustedError(KVCacheError):
    """The block pool has fewer free (or evictable) blocks than requested.

    The pool and the cache are left exactly as they were before the failing call.
    """

    def __init__(self, requested: int, available: int, num_blocks: int) -> None:
        super().__init__(
            f"block pool exhausted: requested {requested} block(s), {available} free or evictable "
            f"of {num_blocks}"
        )
        self.requested = requested
        """Blocks the failing call needed."""
        self.available = available
        """Blocks that were free (including cached-but-unreferenced ones) at the time."""
        self.num_blocks = num_blocks
        """Total size of the pool."""


class SequenceError(KVCacheError):
    """Unknown or duplicate sequence id."""


class BlockImportError(KVCacheError):
    """A block cannot be imported or exported: mismatched shapes, dtype or device, or unknown hash."""


class UnknownBlockError(BlockImportError):
    """No block is cached under the requested hash (export, or an incremental import never begun)."""


class BlockStateError(KVCacheError):
    """A block-pool call that breaks the block life cycle (double free, re-hashing a hashed block)."""


class CacheUsageError(KVCacheError, ValueError):
    """Malformed arguments to the paged cache: wrong shapes, dtypes, layer index or slot range."""


class InvalidTokenError(KVCacheError, ValueError):
    """Token ids are not integers, not one-dimensional, or outside the allowed range."""


class ContextLengthError(KVCacheError):
    """A sequence would grow past the model's maximum context length."""


def file_exists_error(path: Path | str) -> FileExistsError:
    """The error for a file a call would create that exists already (its caller did not ask to replace
    it): an ``OSError`` naming the file, which commands report as "PATH already exists"."""
    return FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path))
