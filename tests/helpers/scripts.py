"""Repository files that are not importable by name (``scripts/fuzz-proto``, ``benchmarks/device/run.py``)
loaded as modules, so a test drives what they define in its own process."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from types import ModuleType

from tests.helpers.processes import REPO


def load_source(relative_path: str, name: str) -> ModuleType:
    """The file at ``relative_path`` (from the repository root, any name ending) executed as module
    ``name``, registered in ``sys.modules`` first: dataclasses look their module up while decorating."""
    loader = importlib.machinery.SourceFileLoader(name, str(REPO / relative_path))
    spec = importlib.util.spec_from_loader(name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    loader.exec_module(module)
    return module

