"""The OpenAI-compatible API (``kvnet.node.httpapi``) over a real node (tiny model, no relay), served by
uvicorn on loopback and driven by the official ``openai`` client and raw HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvnet.model.generate import generate_reference
from kvnet.model.transformer import Transformer
from kvnet.node.httpapi import ApiConfig, HttpServer, OpenAiApi, TextStream, bind_http, json_depth_exceeds
from kvnet.node.httpguard import HttpLimits
from kvnet.node.node import Node, NodeConfig
from kvnet.node.serve import NodeBackend
from tests.helpers.waiting import async_wait_until

MODEL = "tiny-served"
API_KEY = "test-key"


@dataclass
class Served:
    """A node behind the API, as ``kvnet-node`` serves it."""

    url: str
    node: Node
    api: OpenAiApi
    server: HttpServer


@contextlib.asynccontextmanager
async def serving_all(
    config: NodeConfig, limits: HttpLimits | None = None, **api_config: Any
) -> AsyncIterator[Served]:
    """A tiny-model node behind the API on a free loopback port (``api_config`` go to ``ApiConfig``)."""
    node = Node(config, Transformer.from_name("tiny", device=torch.device("cpu")))
    backend = NodeBackend(node, publish=False)
    api = OpenAiApi(backend, ApiConfig(served_model_name=MODEL, api_key=API_KEY, **api_config))
    server = await HttpServer.start(api.app, bind_http("127.0.0.1", 0), limits=limits, access_log=False)
    backend.metrics.watch_http(server.guard.stats, api.queue)
    try:
        yield Served(f"http://127.0.0.1:{server.port}", node, api, server)
    finally:
        await server.stop()
        await node.close()


@contextlib.asynccontextmanager
async def serving(config: NodeConfig, **api_config: Any) -> AsyncIterator[tuple[str, Node]]:
    """``serving_all``'s (base URL, node)."""
    async with serving_all(config, **api_config) as served:
        yield served.url, served.node


@pytest.fixture
async def node_url() -> AsyncIterator[tuple[str, Node]]:
    async with serving(NodeConfig(model="tiny", block_size=16, cache_blocks=256)) as served:
        yield served


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _http(url: str, body: bytes | None = None, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """(status, parsed JSON body) of one request; errors are returned, not raised."""
    request = urllib.request.Request(url, data=body, headers={"Authorization": f"Bearer {API_KEY}",
                                                              "Content-Type": "application/json",
                                                              **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


async def test_completions_match_greedy_reference_streaming_or_not(node_url: tuple[str, Node]) -> None:
    url, node = node_url
    client = _client(url)
    prompt = "The quick brown fox jumps over the lazy dog. " * 2
    ids = node.tokenize_prompt(prompt)
    expected = generate_reference(node.model, ids, 8, stop_token_ids=(node.tokenizer.eos_id,))

    done = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert done.choices[0].text == node.tokenizer.detokenize(expected)
    assert done.usage is not None and done.usage.prompt_tokens == len(ids)
    assert done.usage.completion_tokens == len(expected)

    # The same prompt again: its full blocks come from the local cache, the answer is unchanged.
    chunks = [c async for c in await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == done.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == (len(ids) - 1) // 16 * 16

    # Token-id prompts give the same answer as the text they encode.
    by_ids = await client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == done.choices[0].text


async def test_sampling_seed_n_and_stop(node_url: tuple[str, Node]) -> None:
    url, _ = node_url
    client = _client(url)
    args: dict[str, Any] = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12,
                            "temperature": 1.5, "top_p": 0.9}
    first = await client.completions.create(seed=5, n=2, **args)
    again = await client.completions.create(seed=5, n=2, **args)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert [c.index for c in first.choices] == [0, 1]
    other = await client.completions.create(seed=6, n=1, **args)
    assert other.choices[0].text != first.choices[0].text or first.choices[0].text == ""

    greedy = await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12,
                                             temperature=0)
    text = greedy.choices[0].text
    stop = text[3:5]
    assert stop, text
    stopped = await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12,
                                              temperature=0, stop=[stop])
    assert stopped.choices[0].text == text[: text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    streamed = await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12,
                                               temperature=0, stop=stop, stream=True)
    assert "".join([c.choices[0].text async for c in streamed]) == stopped.choices[0].text

    # Streamed choices run together and interleave; each index reassembles to the non-streamed text.
    together = await client.completions.create(seed=5, n=2, stream=True, **args)
    texts = ["", ""]
    finished = [0, 0]
    async for c in together:
        for streamed_choice in c.choices:
            texts[streamed_choice.index] += streamed_choice.text
            finished[streamed_choice.index] += streamed_choice.finish_reason is not None
    assert texts == [c.text for c in first.choices] and finished == [1, 1]


async def test_unsupported_parameter_and_chat_without_template_are_400(node_url: tuple[str, Node]) -> None:
    url, _ = node_url
    client = _client(url)
    with pytest.raises(openai.BadRequestError, match="unsupported parameter 'logprobs'"):
        await client.completions.create(model=MODEL, prompt="hi", max_tokens=2, logprobs=2)
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="unsupported parameter 'tools'"):
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}],
            tools=[{"type": "function", "function": {"name": "f"}}],
        )
    with pytest.raises(openai.NotFoundError, match="not served here"):
        await client.completions.create(model="other", prompt="hi", max_tokens=2)
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b"[" * 100_000 + b"]" * 100_000, 400, "nested deeper than"),
        (b'{"prompt": "x", "max_tokens": ' + b"[" * 20 + b"]" * 20 + b"}", 400, "nested deeper than"),
        (b"not json", 400, "not JSON"),
        (b'"a string"', 400, "JSON object"),
        (b'{"prompt": "x", "max_tokens": 99999}', 400, "max_tokens must be <="),
        (b'{"prompt": "x", "max_tokens": "5"}', 400, "invalid max_tokens"),
        (b'{"prompt": [1, 2, 99999]}', 400, "outside the vocabulary"),
        (b'{"prompt": "x", "temperature": 3}', 400, "invalid temperature"),
        (b'{"prompt": "x", "n": 2, "stop": ["a", "b", "c", "d", "e"]}', 400, "at most 4"),
        (b'{"prompt": "' + b"x" * 5000 + b'", "max_tokens": 10}', 400, "exceeds the model's context"),
        (b'{"max_tokens": 1}', 400, "missing required parameter 'prompt'"),
    ],
)
async def test_bad_bodies_are_clear_4xx(
    node_url: tuple[str, Node], body: bytes, status: int, message: str
) -> None:
    url, _ = node_url
    got, answer = await asyncio.to_thread(_http, f"{url}/v1/completions", body)
    assert got == status, answer
    assert message in answer["error"]["message"]


async def test_api_key_probes_and_metrics(node_url: tuple[str, Node]) -> None:
    url, _ = node_url
    status, answer = await asyncio.to_thread(
        _http, f"{url}/v1/completions", b'{"prompt": "x"}', {"Authorization": "Bearer wrong"}
    )
    assert status == 401 and "API key" in answer["error"]["message"]
    assert (await asyncio.to_thread(_http, f"{url}/health"))[0] == 200
    assert await asyncio.to_thread(_http, f"{url}/ready") == (200, {"status": "ready"})
    status, answer = await asyncio.to_thread(_http, f"{url}/nowhere")
    assert status == 404 and answer["error"]["message"]


async def test_ready_while_the_engine_serves_and_503_once_it_stopped() -> None:
    # (relay state is not readiness: tests/nodes/test_reconnect.py has /ready 200 through a relay outage)
    async with serving(NodeConfig(model="tiny", block_size=16, cache_blocks=64)) as (url, node):
        assert await asyncio.to_thread(_http, f"{url}/ready") == (200, {"status": "ready"})
        await asyncio.to_thread(node.engine.close)
        status, answer = await asyncio.to_thread(_http, f"{url}/ready")
        assert (status, answer["reason"]) == (503, "the batching engine stopped")
        assert (await asyncio.to_thread(_http, f"{url}/health"))[0] == 200


async def test_metrics_parse_and_every_family_has_help_and_type(node_url: tuple[str, Node]) -> None:
    url, node = node_url
    await _client(url).completions.create(model=MODEL, prompt="metrics " * 8, max_tokens=2, temperature=0)
    with await asyncio.to_thread(urllib.request.urlopen, f"{url}/metrics", timeout=60) as resp:
        text = resp.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    helped = {line.split()[2] for line in text.splitlines() if line.startswith("# HELP ")}
    typed = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    for family in families.values():
        assert family.documentation and family.type != "unknown", family.name
        assert {family.name, f"{family.name}_total"} & helped & typed, family.name
    for phase in ("ttft", "prefill"):
        histogram = families[f"kvnet_{phase}_seconds"]
        assert histogram.type == "histogram"
        count = [s for s in histogram.samples if s.name.endswith("_count")]
        assert count[0].labels == {"model": node.model_name, "tenant": "default"} and count[0].value == 1
    requests = families["kvnet_requests"]
    assert requests.type == "counter" and requests.samples[0].value == 1
    assert families["kvnet_relay_connected"].samples[0].value == 0


def _histogram(url: str, name: str) -> tuple[float, float]:
    """(count, sum) of the histogram ``name`` (one model and tenant, so one series)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=60) as resp:
        text = resp.read().decode()
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == name]
    assert family.type == "histogram" and family.documentation, family
    values = {s.name.removeprefix(name): s.value for s in family.samples if not s.name.endswith("_bucket")}
    return values.get("_count", 0.0), values.get("_sum", 0.0)  # no series before the first observation


async def test_request_latency_queue_time_and_time_per_output_token_histograms_move(
    node_url: tuple[str, Node],
) -> None:
    url, _ = node_url
    names = ("kvnet_request_duration_seconds", "kvnet_request_queue_seconds",
             "kvnet_time_per_output_token_seconds")
    for name in names:
        assert await asyncio.to_thread(_histogram, url, name) == (0, 0), name
    client = _client(url)
    done = await client.completions.create(model=MODEL, prompt="Hold the line 0", max_tokens=8, temperature=0)
    assert done.usage is not None and done.usage.completion_tokens == 8  # no EOS on this prompt
    streamed = await client.completions.create(
        model=MODEL, prompt="Hold the line 1", max_tokens=8, temperature=0, stream=True
    )
    assert len([c async for c in streamed]) > 1
    latency, queue, per_token = [await asyncio.to_thread(_histogram, url, name) for name in names]
    assert latency[0] == 2 and latency[1] > 0  # streamed or not, each answered request counts once
    assert queue[0] == 2 and 0 <= queue[1] < latency[1]  # nobody waited long: the engine was free
    assert per_token[0] == 2 and per_token[1] > 0


async def test_oversized_body_is_413_before_it_is_read(node_url: tuple[str, Node]) -> None:
    url, _ = node_url
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer test-key\r\nContent-Length: 2097152\r\n\r\n")
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
    writer.close()
    assert head.startswith(b"HTTP/1.1 413"), head


def test_text_stream_holds_back_a_possible_stop_and_cuts_at_it() -> None:
    def decode(ids: Any) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    stream = TextStream(decode, ["END"])
    for ch in b"abcE":
        assert stream.push(ch)
    assert stream.take_delta() == "ab"  # "cE" could still start "END"
    assert stream.push(ord("N")) and not stream.push(ord("D"))
    assert stream.stopped and stream.text == "abc"
    assert stream.take_delta(final=True) == "c"

    multibyte = TextStream(decode, [])
    euro = "€".encode()
    multibyte.push(euro[0])
    assert multibyte.take_delta() == ""  # an incomplete UTF-8 sequence is not sent yet
    multibyte.push(euro[1])
    multibyte.push(euro[2])
    assert multibyte.take_delta() == "€"


def test_json_depth_ignores_brackets_in_strings() -> None:
    assert not json_depth_exceeds(b'{"a": "[[[[[[[[[[\\"[[["}', 2)
    assert json_depth_exceeds(b'{"a": [[1]]}', 2)
    assert not json_depth_exceeds(b'{"a": [1]}', 2)


@pytest.fixture
async def chat_node_url(smollm2_dir: Path) -> AsyncIterator[str]:
    """A node serving SmolLM2 (a model with a chat template); skipped where it is not installed."""
    config = NodeConfig(model="smollm2", block_size=16, cache_blocks=64)
    node = await asyncio.to_thread(Node.from_config, config)
    api = OpenAiApi(NodeBackend(node, publish=False), ApiConfig(served_model_name=MODEL, api_key=API_KEY))
    server = await HttpServer.start(api.app, bind_http("127.0.0.1", 0), access_log=False)
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        await server.stop()


async def test_chat_completions_with_the_models_template_streaming_or_not(chat_node_url: str) -> None:
    client = _client(chat_node_url)
    messages: list[Any] = [{"role": "system", "content": "You are brief."},
                           {"role": "user", "content": "Name a colour."}]
    done = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    choice = done.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("length", "stop")
    assert done.usage is not None and done.usage.completion_tokens <= 4
    chunks = [c async for c in await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0, stream=True,
    )]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason


LONG = 1500
"""max_tokens of a request held open while others are refused (greedy on this prompt: no EOS before it)."""


async def _hold_streams(client: openai.AsyncOpenAI, count: int, prompt: str) -> list[Any]:
    """``count`` long streaming completions, each returned once its first text chunk arrived."""
    streams: list[Any] = []
    for i in range(count):
        stream = await client.completions.create(
            model=MODEL, prompt=f"{prompt} {i}", max_tokens=LONG, temperature=0, stream=True
        )
        first = await stream.__anext__()
        assert first.choices[0].finish_reason is None
        streams.append(stream)
    return streams


def _assert_busy(status: int, body: Any, headers: Any, reason: str) -> None:
    assert status == 503, body
    assert headers["retry-after"] == "1"
    message = body["error"]["message"]
    assert reason in message and "\n" not in message, message
    assert body["error"]["type"] == "server_error"


async def test_full_running_set_is_503_with_retry_after_until_clients_leave() -> None:
    config = NodeConfig(model="tiny", block_size=16, cache_blocks=512, max_running_sequences=2)
    async with serving(config, max_queued_requests=0) as (url, node):  # refused at once, not queued
        client = _client(url)
        held = await _hold_streams(client, 2, "Hold the line")
        # The official client sees a 503 with Retry-After (max_retries=0, so it does not retry itself).
        with pytest.raises(openai.APIStatusError) as refused:
            await client.completions.create(model=MODEL, prompt="one more", max_tokens=4, temperature=0)
        assert refused.value.status_code == 503
        error = {"error": refused.value.body}  # the client keeps the "error" object as ``body``
        _assert_busy(503, error, refused.value.response.headers, "sequences in flight")
        # A streaming request is refused before any header is sent: a plain 503, not an in-band error.
        with pytest.raises(openai.APIStatusError) as refused_stream:
            await client.completions.create(model=MODEL, prompt="x", max_tokens=4, stream=True)
        assert refused_stream.value.status_code == 503
        # Raw HTTP: status, header and the one-line JSON error.
        body = json.dumps({"model": MODEL, "prompt": "raw", "max_tokens": 4}).encode()
        request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={
            "Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as raw:
            await asyncio.to_thread(urllib.request.urlopen, request, timeout=60)
        _assert_busy(raw.value.code, json.loads(raw.value.read()), raw.value.headers, "sequences in flight")
        # The clients go away mid-stream: their sequences are cancelled in the engine, admission frees up.
        for stream in held:
            await stream.close()
        admission = node.engine.admission
        await async_wait_until(lambda: admission.requests_in_flight == 0, "held streams cancelled")
        await async_wait_until(lambda: node.cache.stats().num_sequences == 0, "their sequences freed")
        done = await client.completions.create(model=MODEL, prompt="one more", max_tokens=4, temperature=0)
        assert done.choices[0].finish_reason in ("length", "stop")


async def test_full_kv_pool_is_503_and_a_request_larger_than_the_pool_is_400() -> None:
    # 16 blocks of 16 tokens: one held request reserves ceil((prompt + 200) / 16) of them.
    config = NodeConfig(model="tiny", block_size=16, cache_blocks=16, max_running_sequences=8)
    async with serving(config, max_queued_requests=0) as (url, node):
        client = _client(url)
        stream = await client.completions.create(
            model=MODEL, prompt="Hold the pool", max_tokens=200, temperature=0, stream=True
        )
        await stream.__anext__()
        # (in a thread: the server answers on this test's event loop)
        status, body = await asyncio.to_thread(_http, f"{url}/v1/completions", json.dumps(
            {"model": MODEL, "prompt": "a" * 40, "max_tokens": 40}).encode())
        assert status == 503 and "KV pool full" in body["error"]["message"], body
        status, body = await asyncio.to_thread(_http, f"{url}/v1/completions", json.dumps(
            {"model": MODEL, "prompt": "a" * 200, "max_tokens": 100}).encode())
        assert status == 400 and "the pool has 16" in body["error"]["message"], body
        await stream.close()
        await async_wait_until(lambda: node.engine.admission.reserved_blocks == 0, "held stream cancelled")


async def test_concurrent_clients_are_batched_and_equal_recompute(node_url: tuple[str, Node]) -> None:
    url, node = node_url
    client = _client(url)
    prefix = "A shared system prompt about relays and KV blocks. "
    prompts = [f"{prefix}Question {i}?" for i in range(6)]
    answers = await asyncio.gather(*(
        client.completions.create(model=MODEL, prompt=p, max_tokens=10, temperature=0) for p in prompts
    ))
    for prompt, answer in zip(prompts, answers, strict=True):
        ids = node.tokenize_prompt(prompt)
        expected = generate_reference(node.model, ids, 10, stop_token_ids=(node.tokenizer.eos_id,))
        assert answer.choices[0].text == node.tokenizer.detokenize(expected)


async def test_a_client_leaving_a_non_streaming_request_ends_its_generation() -> None:
    async with serving(NodeConfig(model="tiny", block_size=16, cache_blocks=512)) as (url, node):
        body = json.dumps({"model": MODEL, "prompt": "Hold the line 0", "max_tokens": LONG,
                           "temperature": 0}).encode()
        port = int(url.rsplit(":", 1)[1])
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
        )
        await writer.drain()
        await async_wait_until(lambda: node.engine.scheduler.num_running == 1, "the request generating")
        writer.close()  # the client goes away before its answer
        await writer.wait_closed()
        admission = node.engine.admission
        await async_wait_until(lambda: admission.requests_in_flight == 0, "its generation ended")
        assert node.counters.requests == 0  # cancelled, never answered
        # (the engine's worker frees the cancelled sequence on its next step, after the admission is released)
        await async_wait_until(lambda: node.cache.stats().num_sequences == 0, "its sequence freed")
