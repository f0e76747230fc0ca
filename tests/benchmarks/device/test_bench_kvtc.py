"""``benchmarks/device/bench_kvtc.py --quick`` runs as shipped: kvtc blocks encoded, decoded, checked.

The script is what a GPU host runs to decode kvtc where the KV lands; here (no CUDA) it decodes on the CPU
only. Its speeds are printed, never asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from tests.helpers.scripts import load_source
from tests.helpers.waiting import scaled

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "benchmarks" / "device" / "bench_kvtc.py"


def test_quick_run_decodes_every_block_as_the_cpu_does(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=scaled(120))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("device: ") and "load average" in done.stdout
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert rows[0]["device"] == "cpu" and all(r["same_as_cpu"] for r in rows)
    for r in rows:
        assert r["blocks"] == 4 and len(r["decode_s"]) == 3
        # A lossy rendition that is smaller than bf16 and close to the original: rel step 0.12 leaves
        # about a tenth of the KV's RMS as error (0.12 measured), far from noise (1.0) or exactness.
        assert r["ratio"] > 2.0 and 0.01 < r["rel_rms_error"] < 0.3
        assert r["raw_mb"] > r["coded_mb"] > 0
    line = next(x for x in done.stdout.splitlines() if x.startswith("cpu "))
    assert line.split()[-1] == "(reference)"


def test_a_device_decode_agrees_with_the_cpus_to_one_bf16_ulp() -> None:
    """The check a GPU row passes or fails (here it has no GPU row to check)."""
    bench = load_source("benchmarks/device/bench_kvtc.py", "bench_kvtc")
    a = torch.tensor([1.0, -2.5, 3.0e-3, 1000.0], dtype=torch.bfloat16)
    assert bench.agrees(a, a.clone())
    up = (a.view(torch.int16) + 1).view(torch.bfloat16)  # each value one ulp further from zero
    assert bench.agrees(a, up)
    two_up = (a.view(torch.int16) + 2).view(torch.bfloat16)
    assert not bench.agrees(a[:1], two_up[:1])
    assert not bench.agrees(a, torch.cat([two_up[:1], a[1:]]))
    zero = torch.tensor([0.0], dtype=torch.bfloat16)
    assert bench.agrees(zero, -zero)
    tiny = torch.tensor([1e-30], dtype=torch.bfloat16)
    assert not bench.agrees(tiny, -tiny)  # alone, a sign flip is a different value
    # Beside values of 1000, a value near zero may differ by far more than its own ulp, not by more
    # than 1000 * 2**-16.
    near_zero = torch.tensor([1000.0, 1e-4], dtype=torch.bfloat16)
    assert bench.agrees(near_zero, torch.tensor([1000.0, 5e-3], dtype=torch.bfloat16))
    assert not bench.agrees(near_zero, torch.tensor([1000.0, 0.05], dtype=torch.bfloat16))


def test_bad_flags_get_one_line_and_no_run() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--reps", "1"], cwd=REPO, capture_output=True,
                          text=True, timeout=scaled(60))
    assert done.returncode == 2 and not done.stdout
    assert done.stderr.strip().splitlines()[-1].endswith("--reps must be at least 3, got 1")
