"""keep_freed_memory: memory a forward frees is reused without being faulted in again (in a child process,
since the setting is process-wide)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# Allocates and touches 8 MiB (bytearray zero-fills it), frees it, twice; the page faults of each round.
# 8 MiB is above glibc's first mmap threshold (128 KiB), so by default the first round maps fresh pages and
# the second takes fresh heap pages: both fault. Kept, the second round reuses the first's pages.
ROUNDS = """
import json, resource
from kvnet.model.host_memory import keep_freed_memory
taken = keep_freed_memory()
faults = []
for _ in range(2):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = bytearray(8 << 20)
    del block
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"taken": taken, "faults": faults}))
"""


def test_freed_memory_is_reused_without_faults() -> None:
    out = subprocess.run([sys.executable, "-c", ROUNDS], check=True, capture_output=True, text=True).stdout
    result = json.loads(out)
    if not result["taken"]:
        pytest.skip("this C library is not glibc: malloc keeps its own policy")
    first, second = result["faults"]
    assert first >= (8 << 20) // 4096 // 2, result  # the first round did touch fresh pages
    assert second < first // 8, result
