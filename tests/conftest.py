"""Session-wide fixtures shared by several test packages."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvnet.model.registry import ModelNotAvailableError, default_models_dir, resolve_model
from tests.helpers.waiting import load_factor


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted SmolLM2 checkpoint, from the same cache the ``smollm2`` name resolves to (converted
    once per machine; scripts/setup installs the package that ships the GGUF)."""
    try:
        return resolve_model("smollm2", default_models_dir(os.environ))
    except ModelNotAvailableError as exc:
        pytest.skip(f"SmolLM2 is not installed: {exc}")


def pytest_report_header() -> str:
    """The factor test deadlines are scaled by at the start (``tests.helpers.waiting``: it is read again at
    every wait, so it follows the load as the run goes on)."""
    return f"test deadlines: x{load_factor():.2f} for the load (1-minute average {os.getloadavg()[0]:.2f})"
