"""scripts/install-torch against a real pip and a local package index built here: a machine without an
NVIDIA GPU never gets a CUDA build of torch; what pip would take decides, and a refusal says what to set.

The index holds stand-in wheels named torch 2.13.0 (a "CUDA" one that depends on an nvidia-* package, and a
"+cpu" one), so the test needs no network and installs nothing heavy; the script and pip are the real ones.
"""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from tests.helpers.processes import REPO

SCRIPT = REPO / "scripts" / "install-torch"


def _wheel(directory: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> None:
    """A minimal valid wheel: METADATA, WHEEL and RECORD, one module."""
    dist = f"{name}-{version}".replace("-", "_", name.count("-"))
    dist_info = f"{dist}.dist-info"
    files = {
        f"{name.replace('-', '_')}_stub.py": b"",
        f"{dist_info}/METADATA": (
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
            + "".join(f"Requires-Dist: {r}\n" for r in requires)
        ).encode(),
        f"{dist_info}/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = "".join(
        f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
        f"{len(data)}\n"
        for path, data in files.items()
    ) + f"{dist_info}/RECORD,,\n"
    files[f"{dist_info}/RECORD"] = record.encode()
    with zipfile.ZipFile(directory / f"{dist}-py3-none-any.whl", "w") as whl:
        for path, data in files.items():
            whl.writestr(path, data)


@pytest.fixture(scope="module")
def python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    env_dir = tmp_path_factory.mktemp("venv")
    venv.create(env_dir, with_pip=True)
    return env_dir / "bin" / "python"


def _run(python: Path, index: Path, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "TORCH_", "KVNET_"))}
    # Only the local index: no configured index, no network.
    clean.update(
        PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(index),
        PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_OUTPUT="-q", PATH=f"{tmp_path}:{clean.get('PATH', '')}",
    )
    clean.update(env)
    return subprocess.run(
        [str(SCRIPT), str(python)], env=clean, capture_output=True, text=True, timeout=300, check=False
    )


def _installed_torch(python: Path) -> str:
    out = subprocess.run(
        [str(python), "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True, check=True
    )
    return next((line for line in out.stdout.splitlines() if line.lower().startswith("torch==")), "")


def test_no_gpu_and_a_cuda_build_on_offer_is_refused(python: Path, tmp_path: Path) -> None:
    index = tmp_path / "index"
    index.mkdir()
    _wheel(index, "torch", "2.13.0", ("nvidia-cuda-runtime-cu12==12.9.1",))
    _wheel(index, "nvidia-cuda-runtime-cu12", "12.9.1")
    result = _run(python, index, tmp_path, KVNET_TORCH="cpu")
    assert result.returncode == 2, result.stderr
    assert "would install the CUDA build of torch" in result.stderr and "TORCH_INDEX_URL" in result.stderr
    assert "Traceback" not in result.stderr
    assert _installed_torch(python) == ""


def test_no_gpu_and_a_cpu_build_on_offer_is_installed(python: Path, tmp_path: Path) -> None:
    index = tmp_path / "index"
    index.mkdir()
    _wheel(index, "torch", "2.13.0+cpu")
    # No nvidia-smi on PATH at all: the GPU check itself finds none.
    result = _run(python, index, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "gives a CPU build of torch, installing it" in result.stderr
    assert _installed_torch(python) == "torch==2.13.0+cpu"


def test_a_gpu_takes_the_index_choice(python: Path, tmp_path: Path) -> None:
    index = tmp_path / "index"
    index.mkdir()
    _wheel(index, "torch", "2.13.0", ("nvidia-cuda-runtime-cu12==12.9.1",))
    _wheel(index, "nvidia-cuda-runtime-cu12", "12.9.1")
    fake_smi = tmp_path / "nvidia-smi"  # what the driver's tool prints with one GPU
    fake_smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-0)'\n")
    fake_smi.chmod(0o755)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", "torch"], check=False)
    result = _run(python, index, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "NVIDIA GPU found" in result.stderr
    assert _installed_torch(python) == "torch==2.13.0"


def test_torch_index_url_is_used_as_given(python: Path, tmp_path: Path) -> None:
    # A simple (PEP 503) index holding only a CUDA-tagged build: the operator's explicit choice wins.
    index = tmp_path / "simple"
    (index / "torch").mkdir(parents=True)
    _wheel(index / "torch", "torch", "2.13.0+cu126")
    (index / "torch" / "index.html").write_text(
        "".join(f'<a href="{w.name}">{w.name}</a>\n' for w in (index / "torch").glob("*.whl"))
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", "torch"], check=False)
    chosen = {"TORCH_INDEX_URL": index.as_uri(), "PIP_NO_INDEX": "0", "KVNET_TORCH": "cpu"}
    result = _run(python, empty, tmp_path, **chosen)
    assert result.returncode == 0, result.stderr
    assert f"torch from TORCH_INDEX_URL={index.as_uri()}" in result.stderr
    assert _installed_torch(python) == "torch==2.13.0+cu126"


if sys.platform != "linux":  # the script is bash for Linux and macOS; the fake nvidia-smi is POSIX sh
    pytestmark = pytest.mark.skip(reason="scripts/install-torch is tested on Linux")
