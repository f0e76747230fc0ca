"""Fuzz pass over every proto decoder, shared with the scripts/fuzz-proto command."""

from __future__ import annotations

from types import ModuleType

import pytest

from tests.helpers.scripts import load_source


def load_fuzzer() -> ModuleType:
    return load_source("scripts/fuzz-proto", "fuzz_proto")


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
