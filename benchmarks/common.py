"""Shared benchmark helpers: timing, medians, load average, free ports, test certificates, loading the
sibling benchmark modules, and JSON / plain-text table output.

Every figure a kvnet benchmark reports is a median of several runs with the machine's load average next to
it: the benchmark machines have few cores shared with other work, so absolute figures move with the load,
and only ratios measured in the same run are comparable. Plots are not produced (no plotting library is a
dependency); the JSON files hold every run for whoever wants to plot them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BENCH_DIR = REPO / "benchmarks"
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# Ports, certificates and the relay launcher are the test suite's, so both start processes one way.
from tests.helpers.processes import (  # noqa: E402
    NativeQuicUnavailable,
    free_port,
    make_certificates,
    native_quic_python,
)


def load_average() -> str:
    """The 1/5/15-minute load average as text ("2.31 2.10 1.95")."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())


def load1() -> float:
    """The 1-minute load average."""
    return float(load_average().split()[0])


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    return {
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load": load_average(),
    }


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def timed(fn: Callable[[], object], runs: int, warmup: int = 1) -> list[float]:
    """Wall-clock seconds of ``runs`` calls of ``fn`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


@contextmanager
def test_certificates() -> Iterator[Path]:
    """A temporary directory with a development CA (``ca.pem``) and a ``server`` certificate for
    localhost / 127.0.0.1."""
    with tempfile.TemporaryDirectory() as tmp:
        yield make_certificates(Path(tmp), "server").dir


def load_bench(name: str) -> ModuleType | None:
    """The sibling benchmark module ``benchmarks/<name>.py``, or None when it does not exist. Loaded by
    path (the benchmarks directory is not a package), once per process."""
    key = f"kvnet_bench_{name}"
    if key in sys.modules:
        return sys.modules[key]
    path = BENCH_DIR / f"{name}.py"
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location(key, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[key] = mod
    spec.loader.exec_module(mod)
    return mod


@dataclasses.dataclass
class Row:
    """One figure: a name, its median, the unit, every run, the load while it was measured, and notes
    (parameters, ratios)."""

    name: str
    value: float
    unit: str
    runs: list[float] = dataclasses.field(default_factory=list)
    load: str = ""
    notes: str = ""


@dataclasses.dataclass
class SuiteResult:
    """A suite's rows plus what it ran and what it skipped (and why)."""

    suite: str
    command: str
    rows: list[Row] = dataclasses.field(default_factory=list)
    skipped: list[str] = dataclasses.field(default_factory=list)
    machine: dict[str, Any] = dataclasses.field(default_factory=machine)
    seconds: float = 0.0

    def add(self, name: str, runs: Sequence[float], unit: str, notes: str = "",
            value: float | None = None) -> Row:
        """Record a figure: the median of ``runs`` (or ``value``) with the current load; prints it."""
        row = Row(name, median(runs) if value is None else value, unit, [float(r) for r in runs],
                  load_average(), notes)
        self.rows.append(row)
        print(format_row(row), flush=True)
        return row

    def skip(self, what: str) -> None:
        self.skipped.append(what)
        print(f"  skipped: {what}", flush=True)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _fmt(x: float) -> str:
    if x == 0:
        return "0"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    if abs(x) >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def format_row(row: Row) -> str:
    runs = " ".join(_fmt(r) for r in row.runs) if len(row.runs) > 1 else ""
    runs = f" (runs {runs})" if runs else ""
    notes = f"  {row.notes}" if row.notes else ""
    return f"  {row.name:<44} {_fmt(row.value):>10} {row.unit:<10}{runs}  load {row.load}{notes}"


def table(results: Sequence[SuiteResult]) -> str:
    """A readable plain-text (Markdown) table of every row of every suite."""
    lines = ["| suite | figure | median | unit | runs | load (1/5/15) | notes |",
             "|---|---|---|---|---|---|---|"]
    for res in results:
        for row in res.rows:
            runs = " ".join(_fmt(r) for r in row.runs)
            lines.append(f"| {res.suite} | {row.name} | {_fmt(row.value)} | {row.unit} | {runs} | "
                         f"{row.load} | {row.notes} |")
        for what in res.skipped:
            lines.append(f"| {res.suite} | skipped: {what} | | | | | |")
    return "\n".join(lines)


def write_results(out_dir: Path, results: Sequence[SuiteResult], argv: Sequence[str]) -> tuple[Path, Path]:
    """``results.json`` (every run of every figure) and ``results.md`` (the table) in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    doc = {"when": stamp, "argv": list(argv), "machine": machine(),
           "suites": [r.to_json() for r in results]}
    jpath = out_dir / "results.json"
    jpath.write_text(json.dumps(doc, indent=2) + "\n")
    mpath = out_dir / "results.md"
    header = (f"# kvnet benchmark results\n\n{stamp}, `{' '.join(argv)}`, {os.cpu_count()} cores, "
              f"load at the end {load_average()}\n\n")
    mpath.write_text(header + table(results) + "\n")
    return jpath, mpath


__all__ = [
    "REPO",
    "NativeQuicUnavailable",
    "Row",
    "SuiteResult",
    "format_row",
    "free_port",
    "load1",
    "load_average",
    "load_bench",
    "machine",
    "median",
    "native_quic_python",
    "table",
    "test_certificates",
    "timed",
    "write_results",
]
