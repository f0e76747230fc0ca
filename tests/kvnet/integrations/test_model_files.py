"""Digests of a model directory for an engine's fingerprint (``kvnet.integrations.model_files``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvnet.integrations.model_files import ModelFilesError, tokenizer_digest, weights_digest


def model_dir(root: Path, weights: bytes = b"w" * 100, config: str = "{}") -> Path:
    root.mkdir()
    (root / "model.safetensors").write_bytes(weights)
    (root / "config.json").write_text(config)
    (root / "tokenizer.json").write_text('{"v": 1}')
    (root / "README.md").write_text("not part of either digest")
    return root


def test_weights_digest_covers_weights_and_config_only(tmp_path: Path) -> None:
    base = weights_digest(model_dir(tmp_path / "a"))
    assert weights_digest(model_dir(tmp_path / "b")) == base
    assert weights_digest(model_dir(tmp_path / "c", weights=b"w" * 99 + b"x")) != base
    assert weights_digest(model_dir(tmp_path / "d", config='{"rope_theta": 1}')) != base
    other = model_dir(tmp_path / "e")
    (other / "README.md").write_text("changed")
    (other / "tokenizer.json").write_text("changed")
    assert weights_digest(other) == base


def test_tokenizer_digest_covers_tokenizer_files(tmp_path: Path) -> None:
    a = model_dir(tmp_path / "a")
    before = tokenizer_digest(a)
    (a / "model.safetensors").write_bytes(b"other weights")
    assert tokenizer_digest(a) == before
    (a / "tokenizer.json").write_text('{"v": 2}')
    assert tokenizer_digest(a) != before


def test_a_directory_without_weights_or_tokenizer_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelFilesError, match="no weight files"):
        weights_digest(tmp_path)
    with pytest.raises(ModelFilesError, match="no tokenizer files"):
        tokenizer_digest(tmp_path)
