"""Digests of a model directory's files, for the fingerprint of an engine that loads the model itself.

Owns ``weights_digest`` (weights and the architecture config: every byte that changes the KV an engine
computes) and ``tokenizer_digest`` (the files that map text to token ids). Each is SHA-256 over the
sorted relative file names, their sizes and their contents, so renaming, adding or changing a file
changes it and nothing else does. Reading multi-GB weights takes seconds: it happens once per process.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf", "config.json")
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
    "special_tokens_map.json", "added_tokens.json",
)
_CHUNK = 8 << 20


class ModelFilesError(ValueError):
    """The model directory has none of the files a digest needs."""


def _digest(root: Path, files: Iterable[Path]) -> str:
    digest = hashlib.sha256(b"kvnet/model-files/v1\0")
    for path in sorted(set(files)):
        name = path.relative_to(root).as_posix().encode()
        digest.update(len(name).to_bytes(4, "big") + name + path.stat().st_size.to_bytes(8, "big"))
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def weights_digest(model_dir: Path) -> str:
    """Digest of the weight files and ``config.json`` of ``model_dir`` (hex)."""
    files = [p for pattern in WEIGHT_PATTERNS for p in model_dir.rglob(pattern) if p.is_file()]
    if not any(p.name != "config.json" for p in files):
        raise ModelFilesError(f"{model_dir}: no weight files ({', '.join(WEIGHT_PATTERNS[:-1])})")
    return _digest(model_dir, files)


def tokenizer_digest(tokenizer_dir: Path) -> str:
    """Digest of the tokenizer files of ``tokenizer_dir`` (hex)."""
    files = [tokenizer_dir / name for name in TOKENIZER_FILES if (tokenizer_dir / name).is_file()]
    if not files:
        raise ModelFilesError(f"{tokenizer_dir}: no tokenizer files ({', '.join(TOKENIZER_FILES)})")
    return _digest(tokenizer_dir, files)
