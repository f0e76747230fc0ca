"""The node's HTTP server under hostile or heavy load (``kvnet.node.httpguard`` and the API's admission queue
and body deadline): idle sockets past the cap, slow heads and bodies, a burst of 1,000 requests, clients
that leave mid-body, request targets that are not ASCII. A real node (tiny model) behind uvicorn on
loopback, driven by raw sockets and the official ``openai`` client."""

from __future__ import annotations

import asyncio
import collections
import json
import logging

import openai
import pytest

from kvnet.node.httpguard import HttpLimits
from kvnet.node.node import NodeConfig
from tests.helpers.waiting import async_wait_until
from tests.kvnet.node.test_httpapi import API_KEY, MODEL, _client, serving_all

CONFIG = NodeConfig(model="tiny", block_size=16, cache_blocks=256)
PATIENT = HttpLimits(idle_timeout_s=600, head_timeout_s=600)
"""Deadlines out of the way, so that only the connection cap decides."""


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _parse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def _request(method: str, path: str, body: bytes = b"") -> bytes:
    head = (f"{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nConnection: close\r\nContent-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


async def _exchange(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send one request on a new connection and read the answer up to the server's close."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        return _parse(await asyncio.wait_for(reader.read(), 120))
    finally:
        writer.close()


async def test_idle_sockets_past_the_cap_cannot_starve_probes_or_a_completion() -> None:
    async with serving_all(CONFIG, PATIENT) as served:
        port, stats = _port(served.url), served.server.guard.stats
        idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(70)]  # the cap is 64
        await async_wait_until(lambda: stats.open == 70, "the server holding the 70 idle sockets")
        for probe in ("/health", "/ready"):
            status, _, body = await _exchange(port, _request("GET", probe))
            assert status == 200, body
        done = await _client(served.url).completions.create(
            model=MODEL, prompt="Served despite idle sockets", max_tokens=4, temperature=0
        )
        assert done.choices[0].finish_reason in ("length", "stop")
        # The first request took the place of the served socket idle the longest (that one was answered 503
        # with Retry-After, as if it had asked, and closed); the place it left when it ended served the next.
        assert stats.evicted == 1
        status, headers, body = _parse(await asyncio.wait_for(idle[0][0].read(), 30))
        assert status == 503 and headers["retry-after"] == "1", body
        assert "idle connection" in json.loads(body)["error"]["message"]
        for _, writer in idle:
            writer.close()
        await async_wait_until(lambda: stats.open <= 1, "the idle sockets closed")


async def test_every_served_connection_busy_still_answers_probes_and_503s_the_rest() -> None:
    limits = HttpLimits(max_connections=2, idle_timeout_s=600, head_timeout_s=600)
    config = NodeConfig(model="tiny", block_size=16, cache_blocks=512, max_running_sequences=2)
    async with serving_all(config, limits) as served:
        client = _client(served.url)
        held = []
        for i in range(2):  # two long streams hold both served connections
            stream = await client.completions.create(
                model=MODEL, prompt=f"Hold the line {i}", max_tokens=1500, temperature=0, stream=True
            )
            await stream.__anext__()
            held.append(stream)
        port = _port(served.url)
        status, _, _ = await _exchange(port, _request("GET", "/health"))
        assert status == 200
        body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2}).encode()
        status, headers, answer = await _exchange(port, _request("POST", "/v1/completions", body))
        assert status == 503 and headers["retry-after"] == "1", answer
        assert "connections have a request in progress" in json.loads(answer)["error"]["message"]
        assert served.server.guard.stats.refused == 1
        for stream in held:
            await stream.close()


async def test_idle_slow_head_and_slow_body_are_closed_by_their_deadlines() -> None:
    limits = HttpLimits(idle_timeout_s=1, head_timeout_s=0.5)
    async with serving_all(CONFIG, limits, body_timeout_s=0.5) as served:
        port = _port(served.url)
        # A new connection that never sends anything is closed at the idle deadline.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(reader.read(), 30) == b""
        writer.close()
        # A head that never completes is answered 408 at the head deadline.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-")
        status, _, body = _parse(await asyncio.wait_for(reader.read(), 30))
        writer.close()
        assert status == 408 and "request head not complete" in json.loads(body)["error"]["message"]
        assert served.server.guard.stats.head_timeouts == 1
        # A body that never completes is answered 408 at the body deadline.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_request("POST", "/v1/completions", b"{" * 100)[:-90])
        status, _, body = _parse(await asyncio.wait_for(reader.read(), 30))
        writer.close()
        assert status == 408 and "request body not complete" in json.loads(body)["error"]["message"]


async def test_a_burst_of_1000_requests_is_served_up_to_capacity_and_the_rest_get_503_retry_after() -> None:
    config = NodeConfig(model="tiny", block_size=16, cache_blocks=256, max_running_sequences=4)
    queued = 16
    async with serving_all(config, max_queued_requests=queued, max_queue_wait_s=120) as served:
        body = json.dumps({"model": MODEL, "prompt": "A burst", "max_tokens": 1, "temperature": 0}).encode()
        request = _request("POST", "/v1/completions", body)
        port = _port(served.url)
        async with asyncio.timeout(300):
            answers = await asyncio.gather(*(_exchange(port, request) for _ in range(1000)))
        statuses = collections.Counter(status for status, _, _ in answers)
        assert set(statuses) <= {200, 503}, statuses
        for status, headers, answer in answers:
            if status == 503:
                assert headers["retry-after"] == "1" and json.loads(answer)["error"]["message"], answer
        # At least every request that found a running slot or a place in line was served.
        assert statuses[200] >= config.max_running_sequences + queued, statuses


async def test_a_busy_request_waits_in_line_and_is_served_when_room_frees() -> None:
    config = NodeConfig(model="tiny", block_size=16, cache_blocks=512, max_running_sequences=1)
    async with serving_all(config, max_queued_requests=1, max_queue_wait_s=120) as served:
        client = _client(served.url)
        held = await client.completions.create(
            model=MODEL, prompt="Hold the line", max_tokens=1500, temperature=0, stream=True
        )
        await held.__anext__()
        waiting = asyncio.ensure_future(
            client.completions.create(model=MODEL, prompt="In line", max_tokens=4, temperature=0)
        )
        await async_wait_until(lambda: served.api.queue.waiting == 1, "the second request in line")
        with pytest.raises(openai.APIStatusError) as refused:  # the line is full: refused at once
            await client.completions.create(model=MODEL, prompt="One too many", max_tokens=4)
        assert refused.value.status_code == 503
        assert refused.value.response.headers["retry-after"] == "1"
        assert "already waiting" in str(refused.value.body)
        assert not waiting.done()
        await held.close()  # its sequence ends, its admission is released: the one in line goes
        done = await asyncio.wait_for(waiting, 120)
        assert done.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"prompt": "\\ud800"}', "body.prompt: a string holds a lone UTF-16 surrogate"),
        (b'{"prompt": ["ok", "\\udc00x"]}', "body.prompt[1]: a string holds a lone UTF-16 surrogate"),
        (b'{"prompt": "\xff\xfe"}', "body is not JSON"),
    ],
)
async def test_invalid_unicode_in_a_body_is_400(body: bytes, message: str) -> None:
    async with serving_all(CONFIG) as served:
        status, _, answer = await _exchange(_port(served.url), _request("POST", "/v1/completions", body))
        assert status == 400, answer
        assert message in json.loads(answer)["error"]["message"]


async def test_a_request_target_that_is_not_ascii_is_400(caplog: pytest.LogCaptureFixture) -> None:
    async with serving_all(CONFIG) as served:
        status, _, _ = await _exchange(_port(served.url), b"GET /\xff HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 400
    assert not [r for r in caplog.records if r.exc_info and r.name.startswith(("uvicorn", "kvnet"))]


async def test_a_client_leaving_mid_body_is_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    async with serving_all(CONFIG) as served:
        _, writer = await asyncio.open_connection("127.0.0.1", _port(served.url))
        writer.write(_request("POST", "/v1/completions", b'{"prompt": "' + b"x" * 200)[:-100])
        await writer.drain()
        await async_wait_until(lambda: served.server.requests_in_progress == 1, "the body being read")
        writer.close()
        await async_wait_until(lambda: served.server.requests_in_progress == 0, "the request ended")
    left = [r for r in caplog.records if "client left" in r.getMessage()]
    assert len(left) == 1 and "\n" not in left[0].getMessage(), caplog.text
    assert "after 112 of 212 body bytes" in left[0].getMessage()
    server_logs = [r for r in caplog.records if r.name.startswith(("uvicorn", "kvnet"))]
    assert not [r for r in server_logs if r.exc_info or r.levelno >= logging.ERROR], caplog.text
