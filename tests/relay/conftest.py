"""Fixtures for relay tests: a dev CA and real ``python -m relay`` processes (tests/helpers/processes.py);
teardown always kills every relay a test started."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import pytest

from tests.helpers.processes import CertDir, RelayProcess, make_certificates, start_relay


@pytest.fixture(scope="session")
def cert_dir(tmp_path_factory: pytest.TempPathFactory) -> CertDir:
    return make_certificates(tmp_path_factory.mktemp("certs"))


class RelayFactory(Protocol):
    """``start_relay`` with the test's certificates and directory: ``relay_factory(*flags, name=...)``."""

    def __call__(self, *extra: str, name: str = "relay") -> RelayProcess: ...


@pytest.fixture
def relay_factory(cert_dir: CertDir, tmp_path: Path) -> Iterator[RelayFactory]:
    """Starts relays for a test; every one it started is stopped at teardown."""
    started: list[RelayProcess] = []

    def start(*extra: str, name: str = "relay") -> RelayProcess:
        rp = start_relay(cert_dir, tmp_path, *extra, name=name)
        started.append(rp)
        return rp

    yield start
    for rp in started:
        rp.stop()


@pytest.fixture
def relay(relay_factory: RelayFactory) -> RelayProcess:
    return relay_factory()
