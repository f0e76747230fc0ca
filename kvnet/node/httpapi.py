"""Minimal asyncio HTTP/1.1 front end of a kvnet node.

Owns: parsing requests (request line, headers, a Content-Length body; keep-alive), routing, and the
OpenAI-style JSON shapes:

- ``POST /v1/completions`` ``{"prompt": str, "max_tokens": int}`` -> ``{"id", "object": "text_completion",
  "created", "model", "choices": [{"index", "text", "token_ids", "finish_reason"}], "usage":
  {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details": {"cached_tokens",
  "local_cached_tokens", "remote_cached_tokens"}}, "kvnet": {...per-request report...}}``
- ``GET /health`` -> ``{"status": "ok", ...}``
- ``GET /metrics`` -> Prometheus text exposition.

It knows nothing about the model or the network beyond the ``CompletionBackend`` protocol, and has hard
limits (header and body size, header count) so one client cannot exhaust the node's memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

logger = logging.getLogger(__name__)

MAX_HEADER_BYTES = 16 * 1024
MAX_HEADERS = 64
MAX_BODY_BYTES = 1 << 20
MAX_PROMPT_CHARS = 1 << 20
KEEPALIVE_TIMEOUT_S = 30.0

_REASONS = {
    200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 408: "Request Timeout",
    411: "Length Required", 413: "Payload Too Large", 431: "Request Header Fields Too Large",
    500: "Internal Server Error", 503: "Service Unavailable",
}


class CompletionBackend(Protocol):
    """What the HTTP front end needs from a node."""

    model_name: str

    async def complete(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        """Run one request; returns ``{"text", "token_ids", "finish_reason", "prompt_tokens",
        "local_hit_tokens", "remote_hit_tokens", "report"}``."""
        ...

    def health(self) -> dict[str, Any]: ...

    def metrics(self) -> dict[str, float]: ...


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    body: bytes
    content_type: str = "application/json"


class HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def json_response(status: int, obj: Any) -> Response:
    return Response(status, json.dumps(obj, separators=(",", ":")).encode("utf-8"))


def _error(status: int, message: str) -> Response:
    return json_response(status, {"error": {"message": message, "code": status}})


async def read_request(reader: asyncio.StreamReader) -> Request | None:
    """Parse one request; None on a clean EOF before any byte. Raises HttpError on malformed input."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise HttpError(400, "truncated request head") from exc
    except asyncio.LimitOverrunError as exc:
        raise HttpError(431, "request head too large") from exc
    if len(head) > MAX_HEADER_BYTES:
        raise HttpError(431, "request head too large")
    lines = head[:-4].decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise HttpError(400, "malformed request line")
    method, target, _ = parts
    if len(lines) - 1 > MAX_HEADERS:
        raise HttpError(431, "too many headers")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise HttpError(400, "malformed header")
        headers[name.lower()] = value.strip()
    if "transfer-encoding" in headers:
        raise HttpError(411, "chunked bodies are not supported; send Content-Length")
    body = b""
    if "content-length" in headers:
        try:
            length = int(headers["content-length"])
        except ValueError as exc:
            raise HttpError(400, "bad Content-Length") from exc
        if length < 0:
            raise HttpError(400, "bad Content-Length")
        if length > MAX_BODY_BYTES:
            raise HttpError(413, f"body larger than {MAX_BODY_BYTES} bytes")
        try:
            body = await reader.readexactly(length)
        except asyncio.IncompleteReadError as exc:
            raise HttpError(400, "truncated body") from exc
    return Request(method=method, path=target.split("?", 1)[0], headers=headers, body=body)


def _render(response: Response, keep_alive: bool) -> bytes:
    reason = _REASONS.get(response.status, "Unknown")
    head = (
        f"HTTP/1.1 {response.status} {reason}\r\n"
        f"Content-Type: {response.content_type}\r\n"
        f"Content-Length: {len(response.body)}\r\n"
        f"Connection: {'keep-alive' if keep_alive else 'close'}\r\n\r\n"
    )
    return head.encode("latin-1") + response.body


def prometheus_text(metrics: dict[str, float], prefix: str = "kvnet_") -> str:
    lines = []
    for name in sorted(metrics):
        value = metrics[name]
        lines.append(f"{prefix}{name} {value:.9g}" if isinstance(value, float) else f"{prefix}{name} {value}")
    return "\n".join(lines) + "\n"


class HttpApi:
    """Routes of the node's HTTP API over a ``CompletionBackend``."""

    def __init__(self, backend: CompletionBackend) -> None:
        self.backend = backend
        self._routes: dict[tuple[str, str], Callable[[Request], Awaitable[Response]]] = {
            ("POST", "/v1/completions"): self._completions,
            ("GET", "/health"): self._health,
            ("GET", "/metrics"): self._metrics,
        }
        self._next_id = 0

    async def handle(self, request: Request) -> Response:
        handler = self._routes.get((request.method, request.path))
        if handler is None:
            if any(path == request.path for _, path in self._routes):
                return _error(405, f"{request.method} not allowed on {request.path}")
            return _error(404, f"no route {request.path}")
        try:
            return await handler(request)
        except HttpError as exc:
            return _error(exc.status, exc.message)

    async def _completions(self, request: Request) -> Response:
        try:
            payload = json.loads(request.body or b"null")
        except (ValueError, UnicodeDecodeError) as exc:
            raise HttpError(400, f"body is not JSON: {exc}") from exc
        if not isinstance(payload, dict):
            raise HttpError(400, "body must be a JSON object")
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]  # OpenAI accepts a batch; one prompt per request here
        if not isinstance(prompt, str) or not prompt:
            raise HttpError(400, "prompt must be a non-empty string")
        if len(prompt) > MAX_PROMPT_CHARS:
            raise HttpError(413, "prompt too long")
        max_tokens = payload.get("max_tokens", 16)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 0 <= max_tokens <= 4096:
            raise HttpError(400, "max_tokens must be an integer in 0..4096")
        try:
            result = await self.backend.complete(prompt, max_tokens)
        except ValueError as exc:  # e.g. the prompt does not fit the model's context
            raise HttpError(400, str(exc)) from exc
        self._next_id += 1
        completion_tokens = len(result["token_ids"])
        local, remote = int(result["local_hit_tokens"]), int(result["remote_hit_tokens"])
        return json_response(200, {
            "id": f"cmpl-{self._next_id}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.backend.model_name,
            "choices": [{
                "index": 0,
                "text": result["text"],
                "token_ids": result["token_ids"],
                "logprobs": None,
                "finish_reason": result["finish_reason"],
            }],
            "usage": {
                "prompt_tokens": result["prompt_tokens"],
                "completion_tokens": completion_tokens,
                "total_tokens": result["prompt_tokens"] + completion_tokens,
                "prompt_tokens_details": {
                    "cached_tokens": local + remote,
                    "local_cached_tokens": local,
                    "remote_cached_tokens": remote,
                },
            },
            "kvnet": result.get("report", {}),
        })

    async def _health(self, request: Request) -> Response:
        return json_response(200, {"status": "ok", **self.backend.health()})

    async def _metrics(self, request: Request) -> Response:
        return Response(200, prometheus_text(self.backend.metrics()).encode(), "text/plain; version=0.0.4")

    async def serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    request = await asyncio.wait_for(read_request(reader), KEEPALIVE_TIMEOUT_S)
                except HttpError as exc:
                    writer.write(_render(_error(exc.status, exc.message), keep_alive=False))
                    await writer.drain()
                    return
                except (TimeoutError, ConnectionError):
                    return
                if request is None:
                    return
                try:
                    response = await self.handle(request)
                except Exception:  # one failing request must not take the node down
                    logger.exception("request %s %s failed", request.method, request.path)
                    response = _error(500, "internal error")
                keep_alive = request.headers.get("connection", "").lower() != "close"
                writer.write(_render(response, keep_alive))
                await writer.drain()
                if not keep_alive:
                    return
        except ConnectionError:
            return
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


async def start_http(api: HttpApi, host: str, port: int) -> asyncio.Server:
    """Listen on ``host:port`` (port 0 picks a free one; see ``server.sockets``)."""
    return await asyncio.start_server(api.serve_connection, host, port, limit=MAX_HEADER_BYTES)
