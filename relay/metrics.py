"""Relay metrics and the Prometheus text endpoint.

Owns: labelled counters and gauges (plain dicts, one ``Metrics`` object per relay, created in ``serve``),
exposed through ``prometheus_client`` (``Metrics`` is a collector of its registry), and a minimal HTTP/1.1
server answering ``GET /metrics`` with that text exposition (0.0.4) on its own TCP port. Gauges that
mirror other objects (cache bytes, open sessions) are read through callbacks at scrape time so they can
never drift.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

logger = logging.getLogger(__name__)

Labels = tuple[tuple[str, str], ...]
# A scrape request line plus headers; anything bigger is not a metrics scraper.
_MAX_REQUEST_BYTES = 8192
_READ_TIMEOUT = 5.0


@dataclass
class _Family:
    kind: str
    help: str
    values: dict[Labels, float] = field(default_factory=dict)
    callbacks: dict[Labels, Callable[[], float]] = field(default_factory=dict)


def _labels(labels: dict[str, str] | None) -> Labels:
    return tuple(sorted((labels or {}).items()))


class Metrics:
    """Named metric families; names follow Prometheus conventions (``kvnet_relay_*``, ``_total`` counters)."""

    def __init__(self, prefix: str = "kvnet_relay_") -> None:
        self._prefix = prefix
        self._families: dict[str, _Family] = {}
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(self)

    def _family(self, name: str, kind: str, help_text: str) -> _Family:
        fam = self._families.get(name)
        if fam is None:
            fam = _Family(kind, help_text)
            self._families[name] = fam
        return fam

    def counter(self, name: str, help_text: str) -> None:
        """Declare a counter so it is exported (as 0) before its first increment."""
        self._family(name, "counter", help_text)

    def inc(self, name: str, amount: float = 1.0, labels: dict[str, str] | None = None) -> None:
        fam = self._family(name, "counter", name)
        key = _labels(labels)
        fam.values[key] = fam.values.get(key, 0.0) + amount

    def gauge_fn(
        self, name: str, help_text: str, fn: Callable[[], float], labels: dict[str, str] | None = None
    ) -> None:
        self._family(name, "gauge", help_text).callbacks[_labels(labels)] = fn

    def counter_fn(
        self, name: str, help_text: str, fn: Callable[[], float], labels: dict[str, str] | None = None
    ) -> None:
        """A counter owned by another object (e.g. cache stats), read at scrape time."""
        self._family(name, "counter", help_text).callbacks[_labels(labels)] = fn

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        fam = self._families.get(name)
        if fam is None:
            return 0.0
        key = _labels(labels)
        if key in fam.callbacks:
            return float(fam.callbacks[key]())
        return fam.values.get(key, 0.0)

    def collect(self) -> Iterator[Metric]:
        """The families as ``prometheus_client`` metrics (the registry's collector protocol)."""
        for name, fam in sorted(self._families.items()):
            samples = dict(fam.values)
            for key, fn in fam.callbacks.items():
                try:
                    samples[key] = float(fn())
                except Exception:  # a broken callback must not break the whole scrape
                    logger.exception("metric callback failed name=%s", name)
            if not samples and not fam.callbacks:
                samples[()] = 0.0
            label_names = sorted({k for key in samples for k, _ in key})
            full = self._prefix + name
            family: CounterMetricFamily | GaugeMetricFamily
            if fam.kind == "counter":
                family = CounterMetricFamily(full.removesuffix("_total"), fam.help, labels=label_names)
            else:
                family = GaugeMetricFamily(full, fam.help, labels=label_names)
            for key, value in sorted(samples.items()):
                labels = dict(key)
                family.add_metric([labels.get(k, "") for k in label_names], value)
            yield family

    def render(self) -> str:
        """The Prometheus text exposition (``prometheus_client``: HELP and TYPE for every family)."""
        return generate_latest(self._registry).decode()


class MetricsServer:
    """``GET /metrics`` over plain HTTP/1.1 (one request per connection, then close)."""

    def __init__(self, metrics: Metrics, host: str, port: int) -> None:
        self._metrics = metrics
        self._host = host
        self._port = port
        self._server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        if self._server is None or not self._server.sockets:
            return self._port
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._handle, self._host, self._port, limit=_MAX_REQUEST_BYTES
        )

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _READ_TIMEOUT)
            request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
            parts = request_line.split(" ")
            if len(parts) != 3 or parts[0] not in ("GET", "HEAD"):
                await self._reply(writer, 405, "method not allowed\n")
            elif parts[1].split("?", 1)[0] not in ("/metrics", "/"):
                await self._reply(writer, 404, "not found\n")
            else:
                await self._reply(writer, 200, self._metrics.render(), head_only=parts[0] == "HEAD")
        except (
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            ValueError,
            TimeoutError,
            ConnectionError,
        ):
            pass
        finally:
            writer.close()

    async def _reply(
        self, writer: asyncio.StreamWriter, status: int, body: str, head_only: bool = False
    ) -> None:
        reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed"}[status]
        data = body.encode()
        header = (
            f"HTTP/1.1 {status} {reason}\r\n"
            "Content-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
        ).encode()
        writer.write(header if head_only else header + data)
        await writer.drain()


def parse_prometheus(text: str) -> dict[str, float]:
    """Samples of a Prometheus text page as {"name{labels}": value} (tests, benchmarks, scripts)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        out[name] = float(value)
    return out
