"""Two long-running ``kvnet-node`` processes behind one relay: the second reuses the first's prefix.

Both nodes publish what they compute and fetch what they miss; requests go through the OpenAI-style HTTP
API, so this covers ``kvnet.node.httpapi`` + ``kvnet.node.serve`` + the relay end to end.
"""

from __future__ import annotations

import asyncio

import openai
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvnet.model.generate import generate_reference
from kvnet.model.tokenizer import ByteTokenizer
from kvnet.model.transformer import Transformer
from tests.helpers.waiting import wait_until
from tests.nodes.cluster import SHARED_PREFIX, TEST_BLOCK_SIZE, Cluster, http_json

B = TEST_BLOCK_SIZE


def _metric(url: str, name: str) -> float:
    """The sample ``name`` (one model and tenant per node, so one series)."""
    text: str = http_json(f"{url}/metrics")
    (value,) = [s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]
    return float(value)


def test_second_node_reuses_first_nodes_prefix_over_http(kv_cluster: Cluster) -> None:
    kv_cluster.start_relay()
    node_a, url_a = kv_cluster.start_http_node()
    node_b, url_b = kv_cluster.start_http_node("--abr", "fetch")
    kv_cluster.wait_http_node(node_a)
    kv_cluster.wait_http_node(node_b)
    shared = (len(SHARED_PREFIX) + 1) // B * B

    greedy = {"max_tokens": 6, "temperature": 0}  # outputs are compared across nodes
    first = http_json(f"{url_a}/v1/completions", {"prompt": SHARED_PREFIX + "Q1: what?", **greedy})
    assert first["object"] == "text_completion"
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert len(first["choices"][0]["token_ids"]) == 6
    # A answers before its background push reaches the relay, and the relay still remembers the misses of
    # A's own locate for its negative TTL (0.25 s): wait for the push, as a second node would see it a
    # moment later in a fleet.
    published = first["kvnet"]["published_blocks"]
    assert published >= shared // B
    wait_until(
        lambda: _metric(url_a, "kvnet_publisher_pushed_tracks_total") >= published,
        "node A pushing its blocks to the relay",
    )

    # A long generation keeps B's engine busy; the remote-hit request below is located, fetched, loaded and
    # answered while it runs (no lock is held across a request).
    model_id = http_json(f"{url_b}/v1/models")["data"][0]["id"]
    long_client = openai.OpenAI(base_url=f"{url_b}/v1", api_key="unused", max_retries=0, timeout=120)
    long_stream = long_client.completions.create(
        model=model_id, prompt="Hold the line 0", max_tokens=1500, temperature=0, stream=True
    )
    assert next(iter(long_stream)).choices[0].finish_reason is None

    prompt = SHARED_PREFIX + "Q2: and how?"
    remote = http_json(f"{url_b}/v1/completions", {"prompt": prompt, **greedy})
    details = remote["usage"]["prompt_tokens_details"]
    assert details["remote_cached_tokens"] == shared, str(remote["kvnet"])  # str: printed whole
    assert _metric(url_b, "kvnet_engine_running_sequences") == 1  # the long one, still generating
    # B's fetch measured how late the relay answers a FETCH: exported, and never past the fetch timeout.
    assert 0.0 <= _metric(url_b, "kvnet_abr_first_byte_seconds") <= 10.0
    long_stream.close()  # its client leaves: the engine ends its sequence
    wait_until(lambda: _metric(url_b, "kvnet_engine_admitted_sequences") == 0, "B's long stream ended")
    assert details["local_cached_tokens"] == 0
    assert remote["kvnet"]["renditions"] == {"lossless": shared // B}
    # B pushes the blocks it computed, never the ones it just fetched from the relay.
    own_blocks = remote["kvnet"]["published_blocks"] - shared // B
    assert own_blocks > 0, remote["kvnet"]
    pushed = "kvnet_publisher_pushed_tracks_total"
    wait_until(lambda: _metric(url_b, pushed) >= own_blocks, "B pushed its own blocks")
    assert _metric(url_b, pushed) == own_blocks  # one push call: nothing more is coming from it
    # Node A answers the same prompt from its own cache: same tokens as B's answer built on A's blocks.
    local = http_json(f"{url_a}/v1/completions", {"prompt": prompt, **greedy})
    assert local["usage"]["prompt_tokens_details"]["local_cached_tokens"] == shared
    assert local["choices"][0]["token_ids"] == remote["choices"][0]["token_ids"]

    again = http_json(f"{url_b}/v1/completions", {"prompt": prompt + " More?", "max_tokens": 2})
    assert again["usage"]["prompt_tokens_details"]["local_cached_tokens"] >= shared
    assert again["usage"]["prompt_tokens_details"]["remote_cached_tokens"] == 0

    health = http_json(f"{url_b}/health")
    assert health["status"] == "ok" and health["relay_connected"] is True
    assert _metric(url_b, "kvnet_remote_hit_tokens_total") == shared
    assert _metric(url_b, "kvnet_requests_total") == 2
    assert _metric(url_b, "kvnet_security_signature_failures_total") == 0
    assert _metric(url_b, "kvnet_security_content_failures_total") == 0


def test_concurrent_clients_refused_when_full_retried_and_equal_recompute(kv_cluster: Cluster) -> None:
    """One node process, more concurrent clients than it runs at once (its bound set through the environment):
    the ones past it get 503 + Retry-After, the official client retries them, and every answer equals a
    greedy recompute of its prompt."""
    kv_cluster.start_relay()
    kv_cluster.env["KVNET_MAX_RUNNING_SEQUENCES"] = "3"
    node, url = kv_cluster.start_http_node()
    kv_cluster.wait_http_node(node)
    model_id = http_json(f"{url}/v1/models")["data"][0]["id"]
    prompts = [f"{SHARED_PREFIX}Q{i}: what does a relay keep?" for i in range(8)]

    async def ask_all() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=50, timeout=120)
        answers = await asyncio.gather(*(
            client.completions.create(model=model_id, prompt=p, max_tokens=8, temperature=0) for p in prompts
        ))
        return [a.choices[0].text for a in answers]

    texts = asyncio.run(ask_all())
    model = Transformer.from_name("tiny", device=torch.device("cpu"))
    tokenizer = ByteTokenizer()
    for prompt, text in zip(prompts, texts, strict=True):
        expected = generate_reference(
            model, tokenizer.tokenize(prompt), 8, stop_token_ids=(tokenizer.eos_id,)
        )
        assert text == tokenizer.detokenize(expected), prompt
    assert _metric(url, "kvnet_engine_refused_requests_total") >= 1  # 8 at once, 3 admitted
    assert _metric(url, "kvnet_engine_admitted_sequences") == 0


def test_second_node_reuses_what_the_first_just_computed_every_time(kv_cluster: Cluster) -> None:
    """Five different prompts back to back, each answered by node A and at once by node B: B reuses all of
    A's prefix blocks every time, although A's push of them is still under way when B asks (the relay
    waits for a block's remaining objects instead of serving part of it as if it were whole)."""
    kv_cluster.start_relay()
    # The small preset's blocks (64 KiB at 16 tokens) and 2k-token prompts make A's push of a prompt take
    # long enough that B asks for blocks whose objects are still on their way to the relay.
    node_a, url_a = kv_cluster.start_http_node("--model", "small")
    node_b, url_b = kv_cluster.start_http_node("--model", "small", "--abr", "fetch")
    kv_cluster.wait_http_node(node_a)
    kv_cluster.wait_http_node(node_b)
    greedy = {"max_tokens": 4, "temperature": 0}
    for i in range(5):
        prompt = f"Prompt {i}: " + SHARED_PREFIX * 8 + f"Question {i}: what does a relay cache?"
        usable = (len(prompt) - 1) // B * B  # byte tokenizer: one token per byte; the last is computed
        first = http_json(f"{url_a}/v1/completions", {"prompt": prompt, **greedy})
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, first["kvnet"]
        second = http_json(f"{url_b}/v1/completions", {"prompt": prompt, **greedy})
        details = second["usage"]["prompt_tokens_details"]
        assert details["remote_cached_tokens"] == usable, f"prompt {i}: {second['kvnet']}"
        assert second["kvnet"]["fallback"] == [], second["kvnet"]
        assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    assert _metric(url_b, "kvnet_remote_hit_tokens_total") >= 5 * B
    assert _metric(url_b, "kvnet_fetch_fallbacks_total") == 0
