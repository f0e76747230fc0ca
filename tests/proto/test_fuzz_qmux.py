"""Fuzz pass over the QMux record and frame parser, shared with the scripts/fuzz-qmux command."""

from __future__ import annotations

from types import ModuleType

import pytest

from tests.helpers.scripts import load_source


def load_fuzzer() -> ModuleType:
    return load_source("scripts/fuzz-qmux", "fuzz_qmux")


def test_fuzz_qmux_smoke() -> None:
    result = load_fuzzer().run_fuzz(2_000, seed=7, max_seconds=60)
    assert result.tried == 2_000
    assert not result.crashes, result.crashes[0]
    # Inputs must both pass and fail, or the mutator is not reaching the frame handlers.
    assert any(k.endswith(": open") for k in result.outcomes)
    for code in ("FRAME_ENCODING_ERROR", "PROTOCOL_VIOLATION", "TRANSPORT_PARAMETER_ERROR"):
        assert any(code in k for k in result.outcomes), code


@pytest.mark.slow
def test_fuzz_qmux_100k() -> None:
    result = load_fuzzer().run_fuzz(100_000, seed=1, max_seconds=300)
    print(f"fuzz inputs tried: {result.tried}; outcomes: {dict(result.outcomes)}")
    assert not result.crashes, result.crashes[0]
    assert result.tried == 100_000
