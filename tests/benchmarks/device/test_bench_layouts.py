"""``benchmarks/device/bench_layouts.py --quick`` runs as shipped and every layout round-trips bit-exact.

The script is what a GPU host runs; here (no CUDA) it runs every layout on CPU tensors through the same
code. Its speeds are printed, never asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers.waiting import scaled

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "benchmarks" / "device" / "bench_layouts.py"
PAGED_ORDERS = {
    "LBNHC": "NHD", "LBHNC": "HND", "BLNHC": "NHD", "BLHNC": "HND", "BHLNC": "HND", "LHBNC": "HND",
}
EXPECTED_ROWS = [
    *[(f"paged {kind} {order}", dtype)
      for order, kind in PAGED_ORDERS.items() for dtype in ("bfloat16", "float16")],
    ("cpu vec", "bfloat16"), ("cpu vec", "float16"), ("cpu vec", "float32"), ("cpu amx", "bfloat16"),
]


def test_quick_run_prints_every_layout_bit_exact(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=scaled(120),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("device: ") and "torch " in done.stdout and "load average" in done.stdout
    table = [line.split() for line in done.stdout.splitlines()]
    for layout, dtype in EXPECTED_ROWS:
        words = layout.split()
        rows = [line for line in table if line[: len(words)] == words and dtype in line]
        assert len(rows) == 1, f"no single row for {layout} {dtype} in\n{done.stdout}"
        assert rows[0][-1] == "yes", f"{layout} {dtype} is not bit-exact:\n{done.stdout}"
        assert rows[0][len(words) + 3] == "64"  # blocks
    report = json.loads(out.read_text())
    assert [(r["layout"], r["dtype"]) for r in report["rows"]] == EXPECTED_ROWS
    assert all(r["bit_exact"] and len(r["save_s"]) == len(r["load_s"]) == 5 for r in report["rows"])


def test_bad_flags_get_one_line_and_no_run() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--reps", "2"], cwd=REPO, capture_output=True, text=True,
        timeout=scaled(60),
    )
    assert done.returncode == 2 and "--reps must be at least 5" in done.stderr and not done.stdout
