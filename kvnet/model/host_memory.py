"""How a process that runs CPU forwards keeps its freed memory: ``keep_freed_memory()``.

A forward allocates and frees the same activation tensors every step (hundreds of KB to tens of MB each).
glibc's malloc serves allocations above its mmap threshold (128 KiB at first, raised as such chunks are
freed) with fresh ``mmap`` pages and gives free memory at the top of a heap back to the kernel (above
``M_TRIM_THRESHOLD``), so a forward can fault in and zero the same memory again and again. On the virtual
machines measured here, memory the guest has not used lately is far dearer to fault in than the kernel's
zeroing alone (a node's start-up, which zeroes its cache pool, took 8-13 s instead of 2.7 s while another
process held 2 GB): SmolLM2's 1024-token prefill took 0.63-1.8 s in one process on an AMX VM, with 12-54% of
the process's CPU samples in the kernel's ``clear_page`` while it answered, and 0.62-0.91 s with the
settings below (docs/performance.md, "Prefill that faults in its memory").
"""

from __future__ import annotations

import ctypes
import logging
import platform

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""``mallopt`` parameters (glibc's malloc.h)."""

MMAP_THRESHOLD_BYTES = 32 << 20
"""Allocations up to this size come from the heap and are reused; it is the largest threshold glibc accepts
on 64-bit hosts (``DEFAULT_MMAP_THRESHOLD_MAX``). Larger ones are still mapped and unmapped each time."""
TRIM_THRESHOLD_BYTES = 1 << 30
"""Free memory a heap keeps before returning any of it: a node's resident size stays at its peak of
activations (hundreds of MB for the models here) instead of faulting it in again every forward."""


def keep_freed_memory() -> bool:
    """Make malloc keep freed memory for reuse (``mallopt`` on glibc); True when both settings took, False
    where the C library is not glibc or refused them (the process runs as before). Process-wide: call it
    once, before the model is loaded, in processes that run forwards."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    taken = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    if not taken:
        logger.debug("malloc refused the settings that keep freed memory")
    return taken
