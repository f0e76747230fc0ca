"""GGUF conversion and the model registry: digest checks, clear errors, the RoPE row order."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvnet.cli import main as kvnet_main
from kvnet.model.gguf import GGUFError, convert_gguf, unpermute_rope_rows
from kvnet.model.registry import (
    MODELS,
    ModelNotAvailableError,
    RegisteredModel,
    packaged_file,
    resolve_model,
)


def test_unpermute_undoes_llama_cpp_permutation() -> None:
    n_heads, head_dim, cols = 3, 8, 5
    weight = np.arange(n_heads * head_dim * cols, dtype=np.float32).reshape(n_heads * head_dim, cols)
    # llama.cpp's convert script: interleave the two rotate-half halves of each head.
    permuted = (
        weight.reshape(n_heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(n_heads * head_dim, cols)
    )
    assert np.array_equal(unpermute_rope_rows(permuted, n_heads), weight)


def test_registry_resolves_smollm2_to_the_converted_checkpoint(smollm2_dir: Path) -> None:
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["kvnet_source"]["sha256"] == MODELS["smollm2"].sha256
    assert config["dtype"] == "bfloat16" and config["tie_word_embeddings"] is True
    assert config["rope_parameters"]["rope_theta"] == 100000.0
    assert resolve_model("smollm2", smollm2_dir.parent) == smollm2_dir  # reused, not converted again
    with pytest.raises(ModelNotAvailableError, match="unknown model 'nope'"):
        resolve_model("nope", smollm2_dir.parent)
    missing = RegisteredModel("x", "kvnet_no_such_package", "x.gguf", "00", "pip install x", "")
    with pytest.raises(ModelNotAvailableError, match="pip install x"):
        packaged_file(missing)


def test_convert_refuses_bad_input(
    smollm2_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gguf_file = packaged_file(MODELS["smollm2"])
    with pytest.raises(GGUFError, match="does not match the expected"):
        convert_gguf(gguf_file, tmp_path / "out", expected_sha256="0" * 64)
    assert not (tmp_path / "out").exists()
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    with pytest.raises(GGUFError, match="not a readable GGUF file"):
        convert_gguf(garbage, tmp_path / "out")
    (tmp_path / "exists").mkdir()
    with pytest.raises(FileExistsError):
        convert_gguf(garbage, tmp_path / "exists")
    # The command prints one line and exits 2, no traceback.
    assert kvnet_main(["model", "convert", str(garbage), str(tmp_path / "cli")]) == 2
    err = capsys.readouterr().err
    assert "kvnet: error: garbage.gguf is not a readable GGUF file" in err and "Traceback" not in err
