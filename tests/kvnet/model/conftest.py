"""Fixtures of the engine's tests (generate, batching, engine): the tiny random-weight model on the CPU and
the prefix root of its 16-token blocks. A module that needs another model defines its own ``model``."""

from __future__ import annotations

import pytest
import torch

from kvnet.model.generate import prefix_root
from kvnet.model.transformer import Transformer

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def model() -> Transformer:
    return Transformer.from_name("tiny", device=torch.device("cpu"))


@pytest.fixture(scope="module")
def root(model: Transformer) -> bytes:
    return prefix_root(model, BLOCK_SIZE)
