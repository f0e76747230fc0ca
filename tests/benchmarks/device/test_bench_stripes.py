"""benchmarks/device/bench_stripes.py runs here too, at its small size: a real relay, real QMux sessions,
every fetch verified; the table has a row per rendition and session count and no run failed."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.helpers.processes import REPO
from tests.helpers.waiting import scaled

SCRIPT = REPO / "benchmarks" / "device" / "bench_stripes.py"


@pytest.mark.slow
def test_bench_stripes_prints_a_row_per_session_count_all_fetches_verified() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--device", "cpu", "--tokens", "256", "--runs", "1"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=scaled(180),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert out.startswith("device: cpu"), out
    for rendition in ("lossless", "plain"):
        for sessions in (1, 2, 4, 8):
            pattern = rf"^\s+{rendition}\s+{sessions}\s+([\d.]+)\s+([\d.]+)\s+(\d+)\s"
            row = re.search(pattern, out, re.MULTILINE)
            assert row is not None and float(row[1]) > 0, (rendition, sessions, out)
    assert re.search(r"^8 fetches complete and verified .*, 0 failed;", out, re.MULTILINE), out
