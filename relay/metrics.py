"""Relay metrics and the Prometheus text endpoint.

Owns: labelled counters and gauges (plain dicts, one ``Metrics`` object per relay, created in ``serve``),
exposed through ``prometheus_client`` (``Metrics`` is a collector of its registry), and an HTTP/1.1
endpoint answering ``GET /metrics`` with that text exposition (0.0.4) on its own TCP port (``h11`` parses
and frames the HTTP; the relay stays one event loop with no web framework or thread). Gauges that
mirror other objects (cache bytes, open sessions) are read through callbacks at scrape time so they can
never drift.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import h11
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
        """The value of ``name`` with ``labels`` (0 before the first increment); ``KeyError`` for a family
        never declared, so a misspelt name is an error rather than a reading of 0."""
        fam = self._families.get(name)
        if fam is None:
            raise KeyError(f"no metric family {name!r} (without the {self._prefix!r} prefix)")
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
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_REQUEST_BYTES)
        try:
            async with asyncio.timeout(_READ_TIMEOUT):
                request = await _read_request(conn, reader)
            if request is None:
                return
            method, target = request.method, request.target.split(b"?", 1)[0]
            if method not in (b"GET", b"HEAD"):
                status, body = 405, "method not allowed\n"
            elif target not in (b"/metrics", b"/"):
                status, body = 404, "not found\n"
            else:
                status, body = 200, self._metrics.render()
            await _reply(conn, writer, status, body, head_only=method == b"HEAD")
        except h11.RemoteProtocolError as exc:
            if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                await _reply(conn, writer, exc.error_status_hint, "bad request\n")
        except (TimeoutError, ConnectionError, h11.LocalProtocolError):
            pass
        finally:
            writer.close()


async def _read_request(conn: h11.Connection, reader: asyncio.StreamReader) -> h11.Request | None:
    """The request's head, or None when the client went away first."""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await reader.read(4096))
            continue
        return event if isinstance(event, h11.Request) else None


async def _reply(
    conn: h11.Connection, writer: asyncio.StreamWriter, status: int, body: str, head_only: bool = False
) -> None:
    data = body.encode()
    headers = [
        ("Content-Type", "text/plain; version=0.0.4; charset=utf-8"),
        ("Content-Length", str(len(data))),
        ("Connection", "close"),
    ]
    out = conn.send(h11.Response(status_code=status, headers=headers)) or b""
    if not head_only:
        out += conn.send(h11.Data(data=data)) or b""
    out += conn.send(h11.EndOfMessage()) or b""
    writer.write(out)
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
