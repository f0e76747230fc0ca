"""A relay inside the test's own process: ``relay.server.serve`` on the test's event loop, real QUIC (and QMux
with ``--listen-qmux``) on loopback, real certificates, no subprocess.

Configured from the same flags as ``python -m relay`` (``relay.__main__``'s parser, no environment), so a
test reads like its process twin; its metrics are read straight from the relay's ``Metrics``. Tests of what
a process adds (signals, exit codes, the log, ``--workers``) keep starting processes
(``tests.helpers.processes.start_relay``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from relay.__main__ import build_parser, config_from_args, parse_args
from relay.metrics import Metrics
from relay.server import serve
from tests.helpers.processes import START_TIMEOUT, CertDir
from tests.helpers.waiting import DEFAULT_TIMEOUT, async_wait_until, scaled

__all__ = ["InProcessRelay", "relay_in_process"]


@dataclass(frozen=True)
class InProcessRelay:
    """A running in-process relay: where to connect, its metrics and its serving task."""

    url: str
    metrics: Metrics
    serving: asyncio.Future[None]

    @property
    def running(self) -> bool:
        """Whether it still serves (the in-process twin of a relay process not having exited)."""
        return not self.serving.done()

    @property
    def port(self) -> int:
        """The UDP port it listens on (for what connects by address, e.g. a link emulator in front)."""
        return int(self.url.rsplit(":", 1)[1])

    def value(self, name: str, **labels: str) -> float:
        """The current value of metric ``name`` (without the ``kvnet_relay_`` prefix) with ``labels``."""
        return self.metrics.value(name, labels or None)

    async def wait_value(
        self, name: str, at_least: float, *, timeout: float = DEFAULT_TIMEOUT, **labels: str
    ) -> float:
        """Wait until metric ``name`` with ``labels`` reaches ``at_least`` (the relay runs meanwhile: the
        wait polls on the shared event loop); its value then."""
        what = f"relay metric {name} reaching {at_least:g}"
        await async_wait_until(lambda: self.value(name, **labels) >= at_least, what, timeout)
        return self.value(name, **labels)


@contextlib.asynccontextmanager
async def relay_in_process(cert_dir: CertDir, *flags: str) -> AsyncIterator[InProcessRelay]:
    """Serve a relay on a free loopback port with ``cert_dir``'s certificate and ``flags`` (``--trust-any``
    unless the flags name a trust); stopped (GOAWAY, drain, close) when the block ends."""
    argv = [
        "--listen", "127.0.0.1:0", "--metrics", "",
        "--cert", str(cert_dir.cert), "--key", str(cert_dir.key), "--ca", str(cert_dir.ca),
        "--drain-timeout", "1",
        *([] if {"--trust", "--trust-any"} & set(flags) else ["--trust-any"]),
        *flags,
    ]
    config = config_from_args(parse_args(build_parser(), argv, env={}))
    metrics = Metrics()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    listening: asyncio.Future[tuple[str, int]] = loop.create_future()
    task: asyncio.Future[None] = asyncio.ensure_future(serve(
        config, stop, metrics=metrics, signals=False,
        on_listening=lambda address, _metrics_port: listening.set_result(address),
    ))
    try:
        started: set[asyncio.Future[object]] = {listening, task}  # type: ignore[arg-type]
        await asyncio.wait(started, timeout=scaled(START_TIMEOUT), return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()  # raises why it did not start
            raise RuntimeError("the in-process relay stopped before it listened")
        if not listening.done():
            raise TimeoutError("the in-process relay did not listen in time")
        host, port = listening.result()
        yield InProcessRelay(f"moqt://{host}:{port}", metrics, task)
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, scaled(30))
