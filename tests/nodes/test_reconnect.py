"""Connection lifecycle of ``kvnet-node`` and edge relays: started before the relay, and the relay
restarted under them.

Every time the nodes (and an edge relay in front of the restarted origin) reconnect on their own (capped
backoff, ``kvnet.net.reconnect``), ``/health`` says when a node has no session while ``/ready`` stays 200
(the node still serves, by recompute), a request served meanwhile says so in its report, and the next
request after the reconnect reuses a prefix published through the new relay: one published after the
restart, or one published before it that the publishing node pushed again into the restarted, empty
relay."""

from __future__ import annotations

import signal
import urllib.error
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvnet.model.tokenizer import ByteTokenizer
from kvnet.net.reconnect import DEFAULT_CAP_S
from kvnet.security import certs
from tests.helpers.processes import RelayProcess, free_port, start_relay
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


def _connected(url: str) -> bool:
    return bool(http_json(f"{url}/health")["relay_connected"])


def _all_connected(*urls: str) -> bool:
    return all(_connected(u) for u in urls)


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


def test_a_subscriber_the_relay_cannot_serve_says_why_in_its_report(
    kv_cluster: Cluster, tmp_path: Path
) -> None:
    """A relay the subscriber cannot use (here: its certificate is not from the CA the subscriber was
    given) costs a recompute, not the answer, when the user asked for --best-effort; the report names why,
    not only a warning in the log. (Without --best-effort it is exit 1: docs/bad-input.md.)"""
    kv_cluster.start_relay()
    certs.create_ca(tmp_path / "other")
    (report,) = kv_cluster.subscribe(["a prompt for a node without a relay " * 2],
                                     "--ca", str(tmp_path / "other" / "ca.pem"), "--best-effort")
    assert report["relay_connected"] is False, report
    (why,) = [f for f in report["fallback"] if f.startswith("relay not connected")]
    assert f"cannot reach relay {kv_cluster.url()}: " in why, why
    assert report["computed_tokens"] == report["prompt_tokens"]


def test_node_started_before_relay_and_relay_restarted(kv_cluster: Cluster) -> None:
    kv_cluster.relay_port = free_port()
    kv_cluster.metrics_port = free_port()
    node_a, url_a = kv_cluster.start_http_node()
    # Node B stripes its fetches over two sessions: the fetch-only one goes with the relay and is opened
    # again, on the restarted relay, by the first fetch after it.
    node_b, url_b = kv_cluster.start_http_node("--abr", "fetch", "--fetch-connections", "2")
    kv_cluster.wait_http_node(node_a)
    kv_cluster.wait_http_node(node_b)

    # No relay yet: alive and ready (it serves by recompute); a request served now says it had no relay.
    assert _status(f"{url_b}/health") == 200 and not _connected(url_b)
    assert _status(f"{url_b}/ready") == 200
    assert _metric(url_b, "kvnet_relay_connected") == 0
    offline = http_json(f"{url_b}/v1/completions", {"prompt": "offline " * 4, "max_tokens": 1})
    assert offline["kvnet"]["relay_connected"] is False, offline["kvnet"]
    assert any("relay not connected" in f for f in offline["kvnet"]["fallback"])

    relay = kv_cluster.start_relay()
    wait_until(lambda: _all_connected(url_a, url_b), "both nodes connected to the late relay",
               timeout=RECONNECT_TIMEOUT)
    shared = (len(SHARED_PREFIX) + 2) // B * B
    answer = _publish_then_fetch(url_a, url_b, SHARED_PREFIX)
    assert answer["usage"]["prompt_tokens_details"]["remote_cached_tokens"] == shared, answer  # type: ignore[index]

    # Restart the relay under the running nodes.
    kv_cluster.kill(relay, signal.SIGTERM)
    wait_until(lambda: not _connected(url_b), "node B noticed the relay left", timeout=60)
    assert _status(f"{url_b}/ready") == 200  # a load balancer keeps the node through the relay outage
    assert _metric(url_b, "kvnet_relay_connected") == 0
    kv_cluster.start_relay()
    wait_until(lambda: _all_connected(url_a, url_b), "both nodes reconnected to the restarted relay",
               timeout=RECONNECT_TIMEOUT)
    prefix = "Second document after the relay restarted. " * 3
    again = _publish_then_fetch(url_a, url_b, prefix)
    details = again["usage"]["prompt_tokens_details"]  # type: ignore[index]
    assert details["remote_cached_tokens"] == (len(prefix) + 3) // B * B, again
    assert again["kvnet"]["relay_connected"] is True  # type: ignore[index]
    # The restarted relay saw both nodes' sessions and node B's fetch-only one.
    assert kv_cluster.relay_metrics()["kvnet_relay_sessions_total"] >= 3
    # At least the first session and the one after the restart (a draining relay may take a few more).
    assert _metric(url_b, "kvnet_relay_sessions_total") >= 2


def _shared_tokens(published: str, asked: str) -> int:
    """Prompt tokens of ``asked`` a remote hit can reuse from ``published``'s blocks (whole blocks of the
    common token prefix; the tiny model's byte tokenizer)."""
    a, b = ByteTokenizer().tokenize(published), ByteTokenizer().tokenize(asked)
    common = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return min(common // B, (len(b) - 1) // B) * B


def _edge_metric(edge: RelayProcess, name: str) -> float:
    return edge.metrics().get(name, 0.0)


def test_origin_restarted_under_a_node_and_an_edge(kv_cluster: Cluster) -> None:
    """Node A publishes on the origin relay, node B asks through an edge relay in front of it. The origin is
    restarted (SIGTERM: GOAWAY, drain, exit; then a fresh process with an empty cache): A and the edge
    reconnect on their own, A pushes again what it published before, and B's next request reuses a prefix
    A published before the restart (a remote hit through edge and new origin)."""
    c = kv_cluster
    c.relay_port = free_port()
    c.metrics_port = free_port()
    origin = c.start_relay()
    edge = start_relay(c.cert_dir, c.tmp, "--upstream", c.url(), "--upstream-idle-timeout", "2",
                       name="edge", log_level="info", env=c.env)
    try:
        node_a, url_a = c.start_http_node()
        node_b, url_b = c.start_http_node("--abr", "fetch", "--relay", edge.url)
        c.wait_http_node(node_a)
        c.wait_http_node(node_b)
        wait_until(lambda: _all_connected(url_a, url_b), "both nodes connected", timeout=RECONNECT_TIMEOUT)
        wait_until(lambda: _edge_metric(edge, "kvnet_relay_upstreams_connected") == 1, "edge connected")

        # Before the restart: a remote hit through edge and origin, and a second prefix B never asks for.
        answer = _publish_then_fetch(url_a, url_b, SHARED_PREFIX)
        details = answer["usage"]["prompt_tokens_details"]  # type: ignore[index]
        assert details["remote_cached_tokens"] == _shared_tokens(SHARED_PREFIX + "Q1?", SHARED_PREFIX + "Q2?")
        kept = "A document published before the relay restarted, asked for only after it. " * 3
        greedy = {"max_tokens": 2, "temperature": 0}
        pushed_before = _metric(url_a, "kvnet_publisher_pushed_tracks_total")
        first = http_json(f"{url_a}/v1/completions", {"prompt": kept + "Q1?", **greedy})
        wait_until(lambda: _metric(url_a, "kvnet_publisher_pushed_tracks_total")
                   >= pushed_before + first["kvnet"]["published_blocks"], "node A pushed the second prefix")

        c.kill(origin, signal.SIGTERM)
        wait_until(lambda: not _connected(url_a), "node A noticed the origin left", timeout=60)
        wait_until(lambda: _edge_metric(edge, "kvnet_relay_upstreams_connected") == 0,
                   "the edge noticed the origin left", timeout=60)
        # Served meanwhile: A says it had no relay; B (its edge is up) gets a prompt answer, not a hang.
        offline = http_json(f"{url_a}/v1/completions", {"prompt": "while the relay is away " * 3, **greedy})
        assert offline["kvnet"]["relay_connected"] is False, offline["kvnet"]
        assert any("relay not connected" in f for f in offline["kvnet"]["fallback"]), offline["kvnet"]
        assert _connected(url_b) and _status(f"{url_a}/ready") == 200
        during = http_json(f"{url_b}/v1/completions", {"prompt": "Nothing published: " * 4, **greedy})
        assert during["usage"]["prompt_tokens_details"]["remote_cached_tokens"] == 0, during
        # ... and its report says the edge could not ask upstream, not merely that nothing was found.
        failed = [f for f in during["kvnet"]["fallback"] if "probe(s) failed" in f]
        assert failed and all("not connected" in f for f in failed), during["kvnet"]

        sessions_before = _edge_metric(edge, "kvnet_relay_upstream_sessions_total")
        c.start_relay()  # same port, empty cache
        wait_until(lambda: _all_connected(url_a, url_b), "node A reconnected to the restarted origin",
                   timeout=RECONNECT_TIMEOUT)
        wait_until(lambda: _edge_metric(edge, "kvnet_relay_upstreams_connected") == 1
                   and _edge_metric(edge, "kvnet_relay_upstream_sessions_total") > sessions_before,
                   "the edge reconnected to the restarted origin", timeout=RECONNECT_TIMEOUT)
        # A pushes again what the empty origin lacks: both prefixes' blocks reach its cache.
        published = first["kvnet"]["published_blocks"]
        wait_until(lambda: _metric(url_a, "kvnet_republished_blocks_total") >= published,
                   "node A pushed its stored blocks into the restarted origin", timeout=RECONNECT_TIMEOUT)
        assert c.relay_metrics()["kvnet_relay_cache_tracks"] >= published

        again = http_json(f"{url_b}/v1/completions", {"prompt": kept + "Q2?", **greedy})
        assert again["kvnet"]["relay_connected"] is True, again["kvnet"]
        assert again["usage"]["prompt_tokens_details"]["remote_cached_tokens"] == _shared_tokens(
            kept + "Q1?", kept + "Q2?"
        ), again
        assert _metric(url_a, "kvnet_relay_sessions_total") >= 2
    finally:
        edge.stop()


def test_relay_killed_under_a_node_is_noticed_by_keepalive_loss(kv_cluster: Cluster) -> None:
    """SIGKILL: no GOAWAY, no close. The node notices the silent session after ``--relay-idle-timeout``
    (its keep-alive PINGs go unanswered), not QUIC's 15 s default, and reconnects to the restarted relay."""
    c = kv_cluster
    relay = c.start_relay()
    node, url = c.start_http_node("--relay-idle-timeout", "2")
    c.wait_http_node(node)
    wait_until(lambda: _all_connected(url), "node connected", timeout=RECONNECT_TIMEOUT)
    c.kill(relay, signal.SIGKILL)
    # Generous for a loaded machine, yet below the 15 s a default QUIC idle timeout alone would take.
    wait_until(lambda: not _connected(url), "node noticed the killed relay", timeout=10)
    c.start_relay()
    wait_until(lambda: _all_connected(url), "node reconnected", timeout=RECONNECT_TIMEOUT)
    assert _metric(url, "kvnet_relay_sessions_total") >= 2


def test_goaway_naming_another_relay_moves_node_and_edge_there_at_once(kv_cluster: Cluster) -> None:
    """A rolling restart: relay A is stopped with ``--goaway-uri`` naming a standby B and a drain timeout of
    10 minutes. The node and the edge relay on A follow the GOAWAY's New Session URI at once and close
    their sessions on A as soon as nothing is in flight on them (the draft's recommendation), so A's drain
    ends, and A exits, long before its timeout; the node stays ready. The node stripes fetches over two
    sessions: its fetch-only one leaves A with its main one and comes up on B beside it."""
    c = kv_cluster
    standby = start_relay(c.cert_dir, c.tmp, name="standby", log_level="info", env=c.env)
    c.relay_port = free_port()
    old = c.start_relay("--goaway-uri", standby.url, "--drain-timeout", "600")
    edge = start_relay(c.cert_dir, c.tmp, "--upstream", c.url(), name="edge", log_level="info", env=c.env)
    try:
        node, url = c.start_http_node("--fetch-connections", "2")
        c.wait_http_node(node)
        wait_until(lambda: _all_connected(url), "node connected", timeout=RECONNECT_TIMEOUT)
        wait_until(lambda: _edge_metric(edge, "kvnet_relay_upstreams_connected") == 1, "edge connected")
        wait_until(lambda: c.relay_metrics().get("kvnet_relay_sessions", 0) == 3,
                   "the node's two sessions and the edge's on relay A")
        assert standby.metrics().get("kvnet_relay_sessions", 0) == 0

        old.send_signal(signal.SIGTERM)
        wait_until(lambda: standby.metrics().get("kvnet_relay_sessions", 0) == 3,
                   "the node's two sessions and the edge's on the standby relay", timeout=RECONNECT_TIMEOUT)
        # A drains until its last session ends: it exits well inside its 600 s only if the edge and the
        # node closed theirs (a session held for the GOAWAY's whole timeout would keep it running).
        wait_until(lambda: old.poll() is not None, "relay A's drain ends with its last session",
                   timeout=RECONNECT_TIMEOUT)
        assert old.returncode == 0, c.log_of(old)
        assert _edge_metric(edge, "kvnet_relay_upstreams_connected") == 1
        assert _connected(url) and _status(f"{url}/ready") == 200
        assert "moving to " + standby.url in c.log_of(node)
    finally:
        edge.stop()
        standby.stop()
