"""Fixtures for relay tests: a dev CA, relays in the test's own process (tests/relay/inprocess.py) and real
``python -m relay`` processes (tests/helpers/processes.py); teardown always stops every relay a test
started."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Protocol

import pytest

from tests.helpers.processes import CertDir, RelayProcess, make_certificates, start_relay
from tests.relay.inprocess import InProcessRelay, relay_in_process


@pytest.fixture(scope="session")
def cert_dir(tmp_path_factory: pytest.TempPathFactory) -> CertDir:
    return make_certificates(tmp_path_factory.mktemp("certs"))


class InProcessRelays(Protocol):
    """``relay_in_process`` with the test's certificates: ``await in_process_relays(*flags)``."""

    async def __call__(self, *flags: str) -> InProcessRelay: ...


@pytest.fixture
async def in_process_relays(cert_dir: CertDir) -> AsyncIterator[InProcessRelays]:
    """Starts relays on the test's event loop; every one it started is stopped at teardown, the last
    started first (an edge before its upstream)."""
    async with contextlib.AsyncExitStack() as started:

        async def start(*flags: str) -> InProcessRelay:
            return await started.enter_async_context(relay_in_process(cert_dir, *flags))

        yield start


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
