"""Session-wide fixtures shared by several test packages."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvnet.model.registry import ModelNotAvailableError, default_models_dir, resolve_model


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted SmolLM2 checkpoint, from the same cache the ``smollm2`` name resolves to (converted
    once per machine; scripts/setup installs the package that ships the GGUF)."""
    try:
        return resolve_model("smollm2", default_models_dir(os.environ))
    except ModelNotAvailableError as exc:
        pytest.skip(f"SmolLM2 is not installed: {exc}")
