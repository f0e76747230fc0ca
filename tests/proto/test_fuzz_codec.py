"""Fuzz pass over every proto decoder, shared with the scripts/fuzz-proto command."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "fuzz-proto"


def load_fuzzer() -> ModuleType:
    loader = importlib.machinery.SourceFileLoader("fuzz_proto", str(SCRIPT))
    spec = importlib.util.spec_from_loader("fuzz_proto", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["fuzz_proto"] = module  # dataclasses look their module up while decorating
    loader.exec_module(module)
    return module


def test_fuzz_smoke() -> None:
    result = load_fuzzer().run_fuzz(2_000, seed=7, max_seconds=60)
    assert result.tried == 2_000
    assert not result.crashes, result.crashes[0]
    # Both successes and rejections must occur, or the mutator is not exercising the decoders.
    assert any(k.endswith("decoded") for k in result.outcomes)
    assert any("PROTOCOL_VIOLATION" in k for k in result.outcomes)


@pytest.mark.slow
def test_fuzz_100k() -> None:
    result = load_fuzzer().run_fuzz(100_000, seed=1, max_seconds=300)
    print(f"fuzz inputs tried: {result.tried}; outcomes: {dict(result.outcomes)}")
    assert not result.crashes, result.crashes[0]
    assert result.tried == 100_000
