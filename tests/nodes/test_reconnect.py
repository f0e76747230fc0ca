"""Connection lifecycle of ``kvnet-node``: started before its relay, and the relay restarted under it.

Both times the nodes reconnect on their own (capped backoff, ``kvnet.net.reconnect``), ``/ready`` is 503
while they have no session, a request served meanwhile says so in its report, and the next request
after the reconnect reuses a prefix another node published through the new relay."""

from __future__ import annotations

import signal
import socket
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from kvnet.net.reconnect import DEFAULT_CAP_S
from tests.helpers.processes import free_port
from tests.helpers.waiting import wait_until
from tests.nodes.cluster import SHARED_PREFIX, TEST_BLOCK_SIZE, Cluster, http_json

B = TEST_BLOCK_SIZE
# Each wait allows the backoff bound plus process and handshake time on a loaded two-core machine.
RECONNECT_TIMEOUT = DEFAULT_CAP_S + 40.0


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def _metric(url: str, name: str) -> float:
    text: str = http_json(f"{url}/metrics")
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def _all_ready(*urls: str) -> bool:
    return all(_status(f"{u}/ready") == 200 for u in urls)


def _publish_then_fetch(url_a: str, url_b: str, prefix: str) -> dict[str, object]:
    """A computes and pushes ``prefix``; once the relay has it, B answers a prompt sharing it."""
    greedy = {"max_tokens": 2, "temperature": 0}
    pushed_before = _metric(url_a, "kvnet_publisher_pushed_tracks_total")
    first = http_json(f"{url_a}/v1/completions", {"prompt": prefix + "Q1?", **greedy})
    published = first["kvnet"]["published_blocks"]
    assert published > 0, first
    wait_until(lambda: _metric(url_a, "kvnet_publisher_pushed_tracks_total") >= pushed_before + published,
               "node A pushed its blocks to the relay")
    answer: dict[str, object] = http_json(f"{url_b}/v1/completions", {"prompt": prefix + "Q2?", **greedy})
    return answer


def test_node_started_before_relay_and_relay_restarted(kv_cluster: Cluster) -> None:
    kv_cluster.relay_port = free_port()
    kv_cluster.metrics_port = free_port(socket.SOCK_STREAM)
    node_a, url_a = kv_cluster.start_http_node()
    node_b, url_b = kv_cluster.start_http_node("--abr", "fetch")
    kv_cluster.wait_http_node(node_a)
    kv_cluster.wait_http_node(node_b)

    # No relay yet: alive but not ready, and a request served now says it had no relay.
    assert _status(f"{url_b}/health") == 200
    assert _status(f"{url_b}/ready") == 503
    offline = http_json(f"{url_b}/v1/completions", {"prompt": "offline " * 4, "max_tokens": 1})
    assert offline["kvnet"]["relay_connected"] is False, offline["kvnet"]
    assert any("relay not connected" in f for f in offline["kvnet"]["fallback"])

    relay = kv_cluster.start_relay()
    wait_until(lambda: _all_ready(url_a, url_b), "both nodes connected to the late relay",
               timeout=RECONNECT_TIMEOUT)
    shared = (len(SHARED_PREFIX) + 2) // B * B
    answer = _publish_then_fetch(url_a, url_b, SHARED_PREFIX)
    assert answer["usage"]["prompt_tokens_details"]["remote_cached_tokens"] == shared, answer  # type: ignore[index]

    # Restart the relay under the running nodes.
    kv_cluster.kill(relay, signal.SIGTERM)
    wait_until(lambda: _status(f"{url_b}/ready") == 503, "node B noticed the relay left", timeout=60)
    kv_cluster.start_relay()
    wait_until(lambda: _all_ready(url_a, url_b), "both nodes reconnected to the restarted relay",
               timeout=RECONNECT_TIMEOUT)
    prefix = "Second document after the relay restarted. " * 3
    again = _publish_then_fetch(url_a, url_b, prefix)
    details = again["usage"]["prompt_tokens_details"]  # type: ignore[index]
    assert details["remote_cached_tokens"] == (len(prefix) + 3) // B * B, again
    assert again["kvnet"]["relay_connected"] is True  # type: ignore[index]
    # At least the first session and the one after the restart (a draining relay may take a few more).
    assert _metric(url_b, "kvnet_relay_sessions_total") >= 2
