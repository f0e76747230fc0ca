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
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out), "--processes", "2"],
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
        assert r["drift"] <= 0.1 if r["device"] != "cpu" else r["drift"] == 0.0
        assert r["raw_mb"] > r["coded_mb"] > 0
    line = next(x for x in done.stdout.splitlines() if x.startswith("quick "))
    assert line.split()[1:3] == ["yes", "cpu"] and line.split()[-1] == "(reference)"  # predicted, on CPU
    assert all(r["predicted"] for r in rows)
    # The entropy stage alone, in the calling thread and on processes (a thread each), as a node runs it.
    entropy = report["entropy"]
    assert [r["processes"] for r in entropy] == [0, 1, 2]  # --processes 2
    assert all(r["mb_s"] > 0 and len(r["decode_s"]) == 3 for r in entropy)
    assert "2 process(es), a thread each" in done.stdout


def test_a_device_decode_is_checked_layer_by_layer_against_the_codecs_own_error() -> None:
    """The check a GPU row passes or fails (here it has no GPU row to check): a layer predicted from a
    value the device rounded otherwise carries the difference on, so each layer's difference from the
    CPU's decode is measured against the codec's own error in that layer, and the worst layer counts."""
    bench = load_source("benchmarks/device/bench_kvtc.py", "bench_kvtc")
    g = torch.Generator().manual_seed(0)
    original = torch.randn(2, 3, 8, 2, 4, generator=g)
    reference = original + 0.1 * torch.randn(original.shape, generator=g)  # the codec's error, ~0.1
    assert bench.drift(reference.clone(), reference, original) == 0.0
    off = reference.clone()
    off[:, 2] += 0.005 * torch.randn(off[:, 2].shape, generator=g)  # layer 2 off by ~5% of the error
    assert 0.02 < bench.drift(off, reference, original) < bench.DRIFT_LIMIT
    off[1, 1, 3, 0, 0] += 1.0  # one value of layer 1 far off: that layer fails the check alone
    assert bench.drift(off, reference, original) > bench.DRIFT_LIMIT


def test_bad_flags_get_one_line_and_no_run() -> None:
    for flags, message in ((["--reps", "1"], "--reps must be at least 3, got 1"),
                           (["--processes", "0"], "--processes must be in [1, 16], got 0")):
        done = subprocess.run([sys.executable, str(SCRIPT), *flags], cwd=REPO, capture_output=True,
                              text=True, timeout=scaled(60))
        assert done.returncode == 2 and not done.stdout
        assert done.stderr.strip().splitlines()[-1].endswith(message)
