"""A node's Prometheus metrics (``prometheus_client``), served on the HTTP API's ``GET /metrics``.

Owns: the metric families, their HELP text, units (seconds, bytes) and labels (``model``, ``tenant``).
Latency histograms are observed from each request's report and, for the whole request and its wait for
admission, from the HTTP API; counters and gauges that other objects own (the node's counters, the cache,
the block store, the ABR estimates, the publisher's stats, the HTTP server's connections and admission queue)
are read at scrape time by collectors, so they can never drift from their source.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvnet.node.httpapi import AdmissionQueue
from kvnet.node.httpguard import ConnectionStats
from kvnet.node.node import Node
from kvnet.node.reports import RequestReport

LABELS = ("model", "tenant")

# Seconds: a locate is a round trip or two, a fetch and a prefill up to seconds on a CPU.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Seconds per output token: a decode step of a small model on a GPU to a large one on a CPU.
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)

_COUNTER_HELP = {
    "requests": ("requests", "Completions answered."),
    "prompt_tokens": ("prompt_tokens", "Prompt tokens received."),
    "local_hit_tokens": ("local_hit_tokens", "Prompt tokens reused from the node's own KV cache."),
    "remote_hit_tokens": ("remote_hit_tokens", "Prompt tokens reused from blocks fetched through the relay."),
    "computed_tokens": ("computed_tokens", "Prompt tokens prefilled by the model."),
    "bytes_fetched": ("fetched_bytes", "Encoded block bytes fetched from the relay."),
    "blocks_rejected": ("blocks_rejected", "Fetches stopped because a block failed verification."),
    "security_signature_failures": (
        "security_signature_failures", "Blocks refused: unsigned or signed by an untrusted key."),
    "security_content_failures": (
        "security_content_failures", "Signed blocks whose manifest or payload disagreed with the prompt."),
    "fetch_fallbacks": ("fetch_fallbacks", "Fetches that stopped early; the rest was recomputed."),
    "fetch_retries": (
        "fetch_retries", "FETCHes sent again for blocks the relay did not have whole yet."),
    "published_blocks": ("published_blocks", "Blocks encoded, signed and stored for publishing."),
    "relay_sessions": ("relay_sessions", "Relay sessions established (the first and every reconnect)."),
    "republished_blocks": (
        "republished_blocks", "Stored blocks pushed again on a new relay session (the relay lacked them)."),
}

_PUBLISHER_HELP = {
    "track_status_ok": "TRACK_STATUS requests answered with a block.",
    "track_status_missing": "TRACK_STATUS requests for blocks this node does not hold.",
    "fetches_served": "FETCH requests served from the block store.",
    "subscribes_served": "SUBSCRIBE requests served from the block store.",
    "objects_sent": "Objects sent to the relay.",
    "bytes_sent": "Object payload bytes sent to the relay.",
    "pushed_tracks": "Block tracks pushed into the relay's cache (PUBLISH).",
    "requests_refused": "Block requests refused (wrong namespace or malformed).",
}


class _NodeCollector(Collector):
    """Counters and gauges read from the node at scrape time."""

    def __init__(self, node: Node, label_values: list[str]) -> None:
        self._node = node
        self._labels = label_values

    def _counter(self, name: str, help_text: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, help_text, labels=LABELS)
        family.add_metric(self._labels, value)
        return family

    def _gauge(self, name: str, help_text: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, help_text, labels=LABELS)
        family.add_metric(self._labels, value)
        return family

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        node = self._node
        for field_name, (name, help_text) in _COUNTER_HELP.items():
            yield self._counter(f"kvnet_{name}", help_text, float(getattr(node.counters, field_name)))
        stats = node.cache.stats()
        yield self._gauge("kvnet_cache_blocks", "Physical blocks in the paged KV cache.", stats.num_blocks)
        yield self._gauge("kvnet_cache_used_blocks", "Cache blocks held by running sequences.",
                          stats.used_blocks)
        yield self._gauge("kvnet_cache_cached_blocks", "Cache blocks registered under a block hash.",
                          stats.cached_blocks)
        engine = node.engine
        yield self._gauge("kvnet_engine_running_sequences", "Sequences in the batching engine's running set.",
                          engine.scheduler.num_running)
        yield self._gauge("kvnet_engine_waiting_sequences", "Sequences queued for the running set.",
                          engine.scheduler.num_waiting)
        yield self._gauge("kvnet_engine_admitted_sequences", "Sequences admitted and not finished yet.",
                          engine.admission.requests_in_flight)
        yield self._gauge("kvnet_engine_reserved_blocks", "KV blocks reserved by admitted requests.",
                          engine.admission.reserved_blocks)
        yield self._counter("kvnet_engine_refused_requests", "Admission attempts refused as busy.",
                            engine.admission.refused)
        yield self._gauge("kvnet_store_bytes", "Encoded bytes in the publisher block store.",
                          node.store.nbytes)
        yield self._gauge("kvnet_store_entries", "Block renditions in the publisher block store.",
                          len(node.store))
        yield self._counter("kvnet_store_evicted", "Block renditions evicted from the block store.",
                            node.store.stats.evicted)
        yield self._gauge("kvnet_abr_throughput_bytes_per_second",
                          "ABR estimate of the fetch throughput, as a plan costs a whole fetch.",
                          node.abr.inputs()["throughput_bps"])
        yield self._gauge("kvnet_abr_rtt_seconds", "ABR estimate of the relay round-trip time.",
                          node.abr.rtt.estimate())
        yield self._gauge("kvnet_abr_first_byte_seconds",
                          "ABR estimate of how late the relay answers a FETCH beyond the round trip.",
                          node.abr.first_byte_s())
        yield self._gauge("kvnet_abr_prefill_seconds_per_token", "ABR estimate of prefill time per token.",
                          node.abr.prefill.per_token_s)
        yield self._counter("kvnet_abr_declined_hits", "Requests whose ABR plan recomputed located blocks.",
                            node.abr.declined_plans)
        yield self._counter("kvnet_abr_declined_blocks", "Located blocks the ABR chose to recompute.",
                            node.abr.declined_blocks)
        yield self._counter("kvnet_abr_probes",
                            "Plans that fetched to measure the path (declined blocks, or all not split).",
                            node.abr.probes)
        yield self._counter("kvnet_abr_skipped_locates",
                            "Requests that looked for no remote blocks: the measured path loses to compute.",
                            node.abr.skipped_locates)
        peer = node.peer
        connected = peer is not None and peer.connected
        yield self._gauge("kvnet_relay_connected", "1 while the node has a session with its relay.",
                          1.0 if connected else 0.0)
        stats_now = peer.server.stats.__dict__ if peer is not None else {}
        for key, help_text in _PUBLISHER_HELP.items():
            yield self._counter(f"kvnet_publisher_{key}", help_text, float(stats_now.get(key, 0)))


class _HttpCollector(Collector):
    """The HTTP server's connection counts and the API's admission queue, read at scrape time."""

    def __init__(self, stats: ConnectionStats, queue: AdmissionQueue, label_values: list[str]) -> None:
        self._stats = stats
        self._queue = queue
        self._labels = label_values

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        def family(kind: type[CounterMetricFamily | GaugeMetricFamily], name: str, help_text: str,
                   value: float) -> CounterMetricFamily | GaugeMetricFamily:
            metric = kind(name, help_text, labels=LABELS)
            metric.add_metric(self._labels, value)
            return metric

        s = self._stats
        yield family(GaugeMetricFamily, "kvnet_http_connections", "HTTP connections open.", s.open)
        yield family(CounterMetricFamily, "kvnet_http_evicted_connections",
                     "Idle HTTP connections closed (answered 503) to serve a request.", s.evicted)
        yield family(CounterMetricFamily, "kvnet_http_busy_connection_refusals",
                     "Requests answered 503 because every served HTTP connection was busy.", s.refused)
        yield family(CounterMetricFamily, "kvnet_http_turned_away_connections",
                     "HTTP connections answered 503 on arrival, unread: past both connection bounds.",
                     s.turned_away)
        yield family(CounterMetricFamily, "kvnet_http_reset_connections",
                     "HTTP connections reset on arrival: past both bounds, too many answers draining.",
                     s.reset)
        yield family(CounterMetricFamily, "kvnet_http_head_timeouts",
                     "HTTP connections closed (408) because a request head came too slowly.", s.head_timeouts)
        yield family(GaugeMetricFamily, "kvnet_http_queued_requests",
                     "Requests waiting for admission (a free KV reservation or sequence slot).",
                     self._queue.waiting)


class NodeMetrics:
    """The node's metric registry: request latency histograms plus the scrape-time collector."""

    def __init__(self, node: Node) -> None:
        self.registry = CollectorRegistry()
        self._labels = [node.model_name, node.config.tenant]

        def histogram(name: str, help_text: str) -> Histogram:
            return Histogram(name, help_text, LABELS, buckets=_LATENCY_BUCKETS, registry=self.registry)

        self.ttft = histogram("kvnet_ttft_seconds", "Time to first token: request start to first token.")
        self.locate = histogram("kvnet_locate_seconds", "Locating a prompt's prefix blocks at the relay.")
        self.fetch = histogram("kvnet_fetch_seconds", "Fetching, verifying and loading located blocks.")
        self.prefill = histogram("kvnet_prefill_seconds", "Prefilling the prompt tokens not reused.")
        self.request = histogram(
            "kvnet_request_duration_seconds",
            "End-to-end latency of an answered completion: request head received to last byte sent.")
        self.queue = histogram(
            "kvnet_request_queue_seconds", "Time an answered completion waited for admission to the engine.")
        self.per_token = Histogram(
            "kvnet_time_per_output_token_seconds",
            "Decode time per output token after the first ((last token - first token) / (tokens - 1)).",
            LABELS, buckets=_TOKEN_BUCKETS, registry=self.registry)
        self.registry.register(_NodeCollector(node, self._labels))

    def watch_http(self, stats: ConnectionStats, queue: AdmissionQueue) -> None:
        """Export the HTTP server's connection counts and the API's admission queue."""
        self.registry.register(_HttpCollector(stats, queue, self._labels))

    def observe_request(self, latency_s: float, queue_s: float) -> None:
        """One answered HTTP request: its whole latency and its wait for admission."""
        self.request.labels(*self._labels).observe(latency_s)
        self.queue.labels(*self._labels).observe(queue_s)

    def observe(self, report: RequestReport) -> None:
        """Record one answered request's phase times (locate and fetch only when they happened)."""
        t = report.timings
        self.ttft.labels(*self._labels).observe(t.ttft_s)
        self.prefill.labels(*self._labels).observe(t.prefill_s)
        tokens = len(report.output_token_ids)
        if tokens > 1:  # the first token's time is TTFT; the rest are decode steps
            self.per_token.labels(*self._labels).observe(max(t.total_s - t.ttft_s, 0.0) / (tokens - 1))
        if report.locate or t.locate_s > 0:
            self.locate.labels(*self._labels).observe(t.locate_s)
        if report.bytes_fetched > 0 or t.fetch_s > 0:
            self.fetch.labels(*self._labels).observe(t.fetch_s)

    def exposition(self) -> bytes:
        """The Prometheus text exposition of every family (HELP and TYPE included)."""
        return generate_latest(self.registry)
