"""A short pass of ``scripts/fuzz-relay`` against a real relay process (the full run is >= 100k inputs).

The command starts its own relay, fuzzes it from concurrent raw QUIC sessions and checks a well-behaved
client during and after; it exits 0 only when the relay survived and every check passed.
"""

from __future__ import annotations

import re
import subprocess
import sys

from tests.helpers.processes import REPO
from tests.helpers.waiting import scaled


def test_fuzz_relay_short_pass() -> None:
    cmd = [
        sys.executable,
        str(REPO / "scripts" / "fuzz-relay"),
        "--inputs",
        "10000",
        "--sessions",
        "16",
        "--seconds",
        "30",
        "--seed",
        "3",
    ]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=scaled(120))
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-5000:]
    tried = int(re.search(r"inputs tried: (\d+)", text).group(1))  # type: ignore[union-attr]
    assert tried >= 10000, text
    assert "relay process: alive" in text
    checks = re.search(r"well-behaved checks: (\d+) ok, (\d+) failed", text)
    assert checks is not None and int(checks.group(1)) >= 2 and checks.group(2) == "0", text
    # The relay closed misbehaving sessions itself, with the draft's codes.
    assert re.search(r"^  PROTOCOL_VIOLATION +\d+", text, re.M), text
    peak = float(re.search(r"peak ([\d.]+) MiB", text).group(1))  # type: ignore[union-attr]
    assert peak < 400, text
