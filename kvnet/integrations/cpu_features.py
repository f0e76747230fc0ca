"""What the CPU kernels of an engine need from the operating system before they run: AMX tile state.

Linux (5.16 and later) lets a process execute AMX instructions only once it has asked for the tile data
state with ``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``; the first tile instruction of a
process that did not ask dies of SIGILL. vLLM's ``amx`` attention kernel runs tile instructions in its
worker process without asking, so an engine on an AMX CPU dies in its first forward unless something else
in the process asked first (most likely oneDNN, for the bf16 matmuls of models large enough to use AMX:
SmolLM2 ran, a small test model did not). The permission is per process and asking again is
harmless, so the connector asks when vLLM picked ``amx``.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

SYS_ARCH_PRCTL = 158
"""``arch_prctl``'s system call number on x86-64."""
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18
"""The AMX tile data state component (bit 18 of the XSAVE feature mask)."""


def _arch_prctl(code: int, arg: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    # Each argument as a C long: syscall() is variadic, and a pointer passed as a Python int would be
    # narrowed to a C int.
    rc: int = libc.syscall(ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_long(code), ctypes.c_long(arg))
    return rc


def _x86_64_linux() -> bool:
    return sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")


def request_amx_tiles() -> str | None:
    """Ask Linux for AMX tile state in this process: None once granted (or already), otherwise why not in
    a few words (not Linux on x86-64; the CPU or kernel has no AMX)."""
    if not _x86_64_linux():
        return "AMX tile state is asked for on Linux on x86-64 only"
    if _arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0:
        return f"Linux refused AMX tile state: {os.strerror(ctypes.get_errno())}"
    return None


def amx_tiles_permitted() -> bool:
    """Whether this process may execute AMX tile instructions now."""
    if not _x86_64_linux():
        return False
    mask = ctypes.c_uint64(0)
    if _arch_prctl(ARCH_GET_XCOMP_PERM, ctypes.addressof(mask)) != 0:
        return False
    return bool(mask.value >> XFEATURE_XTILEDATA & 1)
