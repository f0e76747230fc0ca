"""``benchmarks/device/run.py``: the one script a GPU host runs, sequencing the device benchmarks (each tested
on its own: ``test_bench_layouts.py``, ``test_bench_stripes.py``, ``test_bench_kvtc.py``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers.scripts import load_source
from tests.helpers.waiting import scaled

REPO = Path(__file__).resolve().parents[3]
RUN = REPO / "benchmarks" / "device" / "run.py"


def test_it_runs_every_device_benchmark_that_exists() -> None:
    run = load_source("benchmarks/device/run.py", "device_run")
    assert [name for name, _ in run.SCRIPTS] == ["bench_layouts.py", "bench_stripes.py", "bench_kvtc.py"]
    assert all((RUN.parent / name).is_file() for name, _ in run.SCRIPTS)
    assert abs(sum(share for _, share in run.SCRIPTS) - 1.0) < 1e-9


def test_a_bad_budget_gets_one_line_and_runs_nothing() -> None:
    done = subprocess.run([sys.executable, str(RUN), "--budget", "0"], cwd=REPO, capture_output=True,
                          text=True, timeout=scaled(60))
    assert done.returncode == 2 and "--budget must be positive, got 0.0" in done.stderr and not done.stdout
