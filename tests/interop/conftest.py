"""Fixtures for the interoperability tests: the third-party MoQT stack aiomoqt in its own Python 3.12 venv
(made and cached by ``scripts/setup-aiomoqt``), certificates and a kvnet-relay process on its defaults."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.processes import REPO, CertDir, RelayProcess, make_certificates, start_relay
from tests.helpers.waiting import scaled

SETUP_TIMEOUT = 1200.0
"""Seconds the first (uncached) set-up may take to download and install aiomoqt."""
NO_PYTHON_312 = 3
INSTALL_FAILED = 4
PEER_SCRIPT = Path(__file__).with_name("aiomoqt_peer.py")


@dataclass(frozen=True)
class Aiomoqt:
    """The aiomoqt venv: its interpreter and console scripts."""

    venv: Path

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def script(self, name: str) -> Path:
        return self.venv / "bin" / name


@pytest.fixture(scope="session")
def aiomoqt() -> Aiomoqt:
    """The aiomoqt venv; the tests using it skip only where no Python 3.12 exists or aiomoqt cannot be
    installed (no package index)."""
    try:
        done = subprocess.run([str(REPO / "scripts" / "setup-aiomoqt")], capture_output=True, text=True,
                              timeout=scaled(SETUP_TIMEOUT))
    except subprocess.TimeoutExpired:
        pytest.fail(f"scripts/setup-aiomoqt took more than {SETUP_TIMEOUT:g} s")
    reason = done.stderr.strip().splitlines()[-1:] or [""]
    if done.returncode == NO_PYTHON_312:
        pytest.skip(f"aiomoqt needs Python 3.12: {reason[0]}")
    if done.returncode == INSTALL_FAILED:
        pytest.skip(f"aiomoqt could not be installed: {reason[0]}")
    assert done.returncode == 0, done.stderr[-3000:]
    return Aiomoqt(Path(done.stdout.strip().splitlines()[-1]))


@pytest.fixture(scope="session")
def cert_dir(tmp_path_factory: pytest.TempPathFactory) -> CertDir:
    return make_certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture
def kvnet_relay(cert_dir: CertDir, tmp_path: Path) -> Iterator[RelayProcess]:
    """kvnet-relay on its default settings."""
    rp = start_relay(cert_dir, tmp_path, log_level="info")
    yield rp
    rp.stop()
