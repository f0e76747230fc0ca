"""``kvnet.integrations.cpu_features``: AMX tile state asked of Linux, on every CPU of the machine kind.

On an AMX CPU the request is granted and the process may then run tile instructions (what vLLM's ``amx``
kernel needs); on a CPU without AMX it is refused with a reason, and nothing is granted."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

from kvnet.integrations.cpu_features import amx_tiles_permitted, request_amx_tiles

REPO = Path(__file__).resolve().parents[3]


def _cpu_has_amx() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " amx_tile" in flags


@pytest.mark.skipif(sys.platform != "linux" or platform.machine() != "x86_64", reason="x86-64 Linux only")
def test_amx_tile_state_is_granted_exactly_where_the_cpu_has_amx() -> None:
    # In a fresh interpreter: the permission is per process and this one may have asked already.
    probe = ("from kvnet.integrations.cpu_features import amx_tiles_permitted, request_amx_tiles\n"
             "before = amx_tiles_permitted(); why = request_amx_tiles(); print(before, why is None, "
             "amx_tiles_permitted(), why)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    before, granted, after, _ = out.stdout.split(maxsplit=3)
    if _cpu_has_amx():
        assert (granted, after) == ("True", "True"), out.stdout
    else:
        assert (before, granted, after) == ("False", "False", "False"), out.stdout
        assert "refused AMX tile state" in out.stdout


def test_asking_twice_is_harmless() -> None:
    first = request_amx_tiles()
    assert request_amx_tiles() == first
    assert amx_tiles_permitted() == (first is None)
