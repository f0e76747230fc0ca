"""OpenAI-compatible HTTP API of a kvnet node, on FastAPI (served by uvicorn, see ``serve_http``).

Owns: request validation and limits, the OpenAI JSON and SSE shapes, stop strings, API-key checks and the
probe routes. Routes:

- ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream``, ``max_tokens``, ``temperature``,
  ``top_p``, ``seed``, ``stop``, ``n``; text or token-id prompts; any other parameter is a 400). Besides
  the OpenAI fields, ``usage.prompt_tokens_details`` carries ``cached_tokens`` split into
  ``local_cached_tokens`` and ``remote_cached_tokens``, and ``kvnet`` holds each choice's request report.
- ``GET /v1/models``; ``GET /health`` (liveness: the process answers); ``GET /ready`` (readiness: the
  node serves requests; the backend says why not); ``GET /metrics`` (Prometheus text exposition).

It knows nothing about the model or the network beyond the ``CompletionBackend`` protocol. Every bad request
is a 4xx with a one-line message, never a 500: bodies are size-capped, must arrive within a deadline, their
JSON nesting depth is checked before parsing and their strings must be valid Unicode (no lone surrogates).
Every request is admitted by the backend before anything is generated or any header is sent: when its KV
pool (or its bound on sequences in flight) is full, the request waits in a bounded FIFO queue
(``AdmissionQueue``) for a release; past the queue's length or its wait the answer is a 503 with
``Retry-After`` and the usual one-line JSON error, streaming or not. A client that leaves, streaming or not,
ends its generation; one that leaves while sending its body is one log line. Connection limits and head
deadlines are the server's (``kvnet.node.httpguard``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import hmac
import json
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from kvnet.logs import ACCESS_LOGGER
from kvnet.model.engine import EngineBusyError, RequestTooLargeError
from kvnet.model.generate import SamplingParams, TokenCallback
from kvnet.node.httpguard import ConnectionGuard, HttpLimits, guarded_protocol

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20
MAX_JSON_DEPTH = 16
MAX_TOKENS_LIMIT = 4096
MAX_CHOICES = 16
"""Cap on prompts x n of one request (each choice is a full generation)."""
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
DEFAULT_MAX_TOKENS = 16
BODY_TIMEOUT_S = 30.0
MAX_QUEUED_REQUESTS = 64
MAX_QUEUE_WAIT_S = 10.0
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ApiError(Exception):
    """A request the API refuses; becomes ``{"error": {...}}`` with ``status``."""

    def __init__(
        self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers


class ChatUnsupportedError(ValueError):
    """The model's tokenizer has no chat template."""


@dataclass
class GenerationOutcome:
    """What the backend did for one choice."""

    token_ids: list[int]
    prompt_tokens: int
    local_hit_tokens: int
    remote_hit_tokens: int
    finish_reason: str
    """``stop`` (EOS) or ``length``; the API turns a matched stop string into ``stop`` itself."""
    report: dict[str, Any] = field(default_factory=dict)


class AdmissionTicket(Protocol):
    """A request's reservation in the backend (`kvnet.model.engine.Admission`); released exactly when done."""

    def release(self) -> None: ...


class CompletionBackend(Protocol):
    """What the HTTP API needs from a node."""

    model_name: str
    max_context_tokens: int

    def tokenize(self, text: str) -> list[int]: ...

    def tokenize_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a chat rendered with the model's template; ``ChatUnsupportedError`` without one."""
        ...

    def detokenize(self, token_ids: Sequence[int]) -> str: ...

    def validate_token_ids(self, token_ids: Sequence[int]) -> None:
        """``ValueError`` naming the first id outside the vocabulary."""
        ...

    def admit(self, prompt_tokens: int, max_tokens: int, sequences: int) -> AdmissionTicket:
        """Reserve room for ``sequences`` generations of at most ``prompt_tokens + max_tokens`` tokens;
        ``EngineBusyError`` when full now, ``RequestTooLargeError`` when it could never fit."""
        ...

    async def generate(
        self, prompt_ids: list[int], max_tokens: int, sampling: SamplingParams, on_token: TokenCallback,
        admission: AdmissionTicket,
    ) -> GenerationOutcome: ...

    def health(self) -> dict[str, Any]: ...

    def readiness(self) -> tuple[bool, str]:
        """(ready, why not)."""
        ...

    def metrics_exposition(self) -> bytes: ...

    def observe_request(self, latency_s: float, queue_s: float) -> None:
        """One answered request: seconds from its head to its last byte, and of those, waiting to be
        admitted."""
        ...


@dataclass(frozen=True)
class ApiConfig:
    """Limits and identity of the HTTP API."""

    served_model_name: str | None = None
    """Name clients use in ``model``; the backend's model name when None."""
    api_key: str | None = None
    """When set, ``/v1/*`` requires ``Authorization: Bearer <api_key>``."""
    max_body_bytes: int = MAX_BODY_BYTES
    max_json_depth: int = MAX_JSON_DEPTH
    max_tokens_limit: int = MAX_TOKENS_LIMIT
    body_timeout_s: float = BODY_TIMEOUT_S
    """From a request's head to its complete body (408 past it)."""
    max_queued_requests: int = MAX_QUEUED_REQUESTS
    """Requests waiting for admission at once; past it a request is answered 503 at once."""
    max_queue_wait_s: float = MAX_QUEUE_WAIT_S
    """The longest a request waits for admission before its 503."""

    def __post_init__(self) -> None:
        # An empty key (an unset variable expanded into --api-key "$KEY") would silently open the API.
        if self.api_key == "":
            raise ValueError("--api-key is empty: give a key, or leave it out to serve without one")
        if self.served_model_name == "":
            raise ValueError("--served-model-name is empty: give a name, or leave it out for the model's")


# -- request bodies ---------------------------------------------------------------------------------


_BodyT = TypeVar("_BodyT", bound=BaseModel)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float | int = Field(default=1.0, ge=0, le=2)
    top_p: float | int = Field(default=1.0, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None


class CompletionBody(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessageBody(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None


class ChatBody(_SamplingFields):
    messages: list[ChatMessageBody] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=0)


def json_depth_exceeds(raw: bytes, limit: int) -> bool:
    """True when arrays/objects in ``raw`` nest deeper than ``limit`` (checked before parsing, so a
    deeply nested body costs a linear scan, never a recursion)."""
    depth = 0
    in_string = escaped = False
    for byte in raw:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > limit:
                return True
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return False


def lone_surrogate_path(value: Any, path: str = "body") -> str | None:
    """Where a string of parsed JSON holds a lone surrogate (``"\\ud800"`` parses, but is not text), or None.
    Recursion is bounded: the body's nesting depth was checked before parsing."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            found = lone_surrogate_path(key, path) or lone_surrogate_path(item, f"{path}.{key}")
            if found:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = lone_surrogate_path(item, f"{path}[{index}]")
            if found:
                return found
    return None


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith(("function-", "list[", "str", "int")))
    param = str(err["loc"][0]) if err["loc"] else None
    if err["type"] == "extra_forbidden":
        return f"unsupported parameter {loc!r}", param
    if err["type"] == "missing":
        return f"missing required parameter {loc!r}", param
    return f"invalid {loc or 'body'}: {err['msg']}", param


def _sampling(body: _SamplingFields, choice: int) -> SamplingParams:
    seed = None if body.seed is None else body.seed + choice
    return SamplingParams(temperature=float(body.temperature), top_p=float(body.top_p), seed=seed)


def _stop_strings(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise ApiError(400, f"stop: at most {MAX_STOP_STRINGS} strings", "stop")
    if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise ApiError(400, f"stop: each string needs 1..{MAX_STOP_CHARS} characters", "stop")
    return stops


class TextStream:
    """The text of one choice as tokens arrive: detects stop strings and says what is safe to emit.

    Text is held back while it could still be the start of a stop string, or while it ends in an
    incomplete UTF-8 sequence (decoded as U+FFFD), so a streamed delta never has to be taken back.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str]) -> None:
        self._decode = decode
        self._stop = list(stop)
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""
        self.stopped = False
        self._emitted = 0

    def push(self, token_id: int) -> bool:
        """Add a token; False once a stop string appeared (the text then ends before it)."""
        self.token_ids.append(token_id)
        text = self._decode(self.token_ids)
        if self._stop:
            start = max(self._emitted - self._hold, 0)
            hits = [i for i in (text.find(s, start) for s in self._stop) if i >= 0]
            if hits:
                text, self.stopped = text[: min(hits)], True
        self.text = text
        return not self.stopped

    def take_delta(self, final: bool = False) -> str:
        """New text that can be sent now (everything left when ``final``)."""
        end = len(self.text)
        if not final and not self.stopped:
            end -= self._hold
            while end > self._emitted and self.text[end - 1] == "\ufffd":
                end -= 1
        if end <= self._emitted:
            return ""
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta


# -- the application ----------------------------------------------------------------------------------


@dataclass
class _Job:
    """One choice to generate: its prompt, sampling and place in the response."""

    index: int
    prompt_ids: list[int]
    sampling: SamplingParams


def _usage(outcomes: Sequence[GenerationOutcome], prompt_tokens: int) -> dict[str, Any]:
    local = sum(o.local_hit_tokens for o in outcomes)
    remote = sum(o.remote_hit_tokens for o in outcomes)
    completion = sum(len(o.token_ids) for o in outcomes)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {
            "cached_tokens": local + remote,
            "local_cached_tokens": local,
            "remote_cached_tokens": remote,
        },
    }


def _error_response(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}, status_code=status,
        headers=headers,
    )


class AdmissionQueue:
    """Requests the backend cannot admit yet wait here in arrival order (at most ``max_waiting`` of them, each
    at most ``max_wait_s``); the first in line tries again whenever a ticket is released."""

    def __init__(self, max_waiting: int, max_wait_s: float) -> None:
        self.max_waiting = max_waiting
        self.max_wait_s = max_wait_s
        self._line: collections.deque[asyncio.Event] = collections.deque()
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def waiting(self) -> int:
        return len(self._line)

    async def admit(self, try_admit: Callable[[], AdmissionTicket]) -> QueuedTicket:
        """``try_admit()`` now if nobody is waiting, else in turn; ``EngineBusyError`` when the line is full
        or the wait too long. The ticket returned wakes the line when it is released."""
        self._loop = asyncio.get_running_loop()
        why = "busy"
        if not self._line:
            try:
                return QueuedTicket(try_admit(), self)
            except EngineBusyError as exc:
                if self.max_waiting == 0:
                    raise
                why = str(exc)
        if len(self._line) >= self.max_waiting:
            raise EngineBusyError(
                f"busy: {len(self._line)} requests already waiting (limit {self.max_waiting}); retry later"
            )
        turn = asyncio.Event()
        self._line.append(turn)
        try:
            async with asyncio.timeout(self.max_wait_s):
                while True:
                    await turn.wait()
                    turn.clear()
                    try:
                        return QueuedTicket(try_admit(), self)
                    except EngineBusyError as exc:
                        why = str(exc)
        except TimeoutError:
            raise EngineBusyError(
                f"{why.removesuffix('; retry later')}, still after waiting {self.max_wait_s:g} s; retry later"
            ) from None
        finally:
            first = self._line[0] is turn
            self._line.remove(turn)
            if first and self._line:
                self._line[0].set()  # one release may make room for several: the next in line tries now

    def released(self) -> None:
        """A ticket was released (from any thread): the first in line tries again."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake_first)

    def _wake_first(self) -> None:
        if self._line:
            self._line[0].set()


class QueuedTicket:
    """A backend's ticket (``ticket``, what ``generate`` takes) that wakes the admission queue once
    released."""

    def __init__(self, ticket: AdmissionTicket, queue: AdmissionQueue) -> None:
        self.ticket = ticket
        self._queue = queue
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.ticket.release()
            self._queue.released()


class OpenAiApi:
    """Routes of the node's HTTP API over a ``CompletionBackend``; ``app`` is the ASGI application."""

    def __init__(self, backend: CompletionBackend, settings: ApiConfig | None = None) -> None:
        self.backend = backend
        self.settings = settings or ApiConfig()
        self.model_name = self.settings.served_model_name or backend.model_name
        self.created = int(time.time())
        self.queue = AdmissionQueue(self.settings.max_queued_requests, self.settings.max_queue_wait_s)
        app = FastAPI(title="kvnet node", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_exception_handler(ApiError, self._on_api_error)  # type: ignore[arg-type]
        app.add_exception_handler(StarletteHTTPException, self._on_http_error)  # type: ignore[arg-type]
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/ready", self.ready, methods=["GET"])
        app.add_api_route("/metrics", self.metrics, methods=["GET"])
        self.app = app

    @staticmethod
    async def _on_api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error_response(exc.status, exc.message, exc.param, exc.headers)

    @staticmethod
    async def _on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error_response(exc.status_code, str(exc.detail))

    # -- probes ---------------------------------------------------------------------------------------

    async def health(self) -> dict[str, Any]:
        return {"status": "ok", **self.backend.health()}

    async def ready(self) -> JSONResponse:
        ok, why = self.backend.readiness()
        if ok:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "not ready", "reason": why}, status_code=503)

    async def metrics(self) -> Response:
        return Response(self.backend.metrics_exposition(), media_type=METRICS_CONTENT_TYPE)

    async def models(self, request: Request) -> dict[str, Any]:
        self._authorize(request)
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "kvnet",
            "max_model_len": self.backend.max_context_tokens,
        }]}

    # -- request handling ----------------------------------------------------------------------------

    def _authorize(self, request: Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer <key>)")

    async def _read_json(self, request: Request) -> Any:
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            raise ApiError(413, f"request body larger than {limit} bytes")
        chunks: list[bytes] = []
        size = 0
        deadline = self.settings.body_timeout_s
        try:
            async with asyncio.timeout(deadline):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise ApiError(413, f"request body larger than {limit} bytes")
                    chunks.append(chunk)
        except TimeoutError:
            raise ApiError(408, f"request body not complete within {deadline:g} s",
                           headers={"Connection": "close"}) from None
        except ClientDisconnect:
            client = request.client
            logger.info("http %s: client left after %d of %s body bytes", _peer(client), size,
                        declared if declared is not None else "?")
            raise ApiError(499, "client left while sending the body") from None
        raw = b"".join(chunks)
        if json_depth_exceeds(raw, self.settings.max_json_depth):
            raise ApiError(400, f"JSON nested deeper than {self.settings.max_json_depth} levels")
        try:
            payload = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"body is not JSON: {exc}") from None
        where = lone_surrogate_path(payload)
        if where is not None:
            raise ApiError(400, f"{where}: a string holds a lone UTF-16 surrogate (not valid Unicode)")
        return payload

    def _parse(self, model: type[_BodyT], payload: Any) -> _BodyT:
        if not isinstance(payload, dict):
            raise ApiError(400, "body must be a JSON object")
        try:
            body = model.model_validate(payload)
        except ValidationError as exc:
            message, param = _validation_message(exc)
            raise ApiError(400, message, param) from None
        requested = getattr(body, "model", None)
        if requested is not None and requested != self.model_name:
            raise ApiError(
                404, f"model {requested!r} is not served here (serving {self.model_name!r})", "model"
            )
        return body

    def _max_tokens(self, value: int | None) -> int:
        max_tokens = DEFAULT_MAX_TOKENS if value is None else value
        if max_tokens > self.settings.max_tokens_limit:
            raise ApiError(400, f"max_tokens must be <= {self.settings.max_tokens_limit}", "max_tokens")
        return max_tokens

    def _check_prompt(self, ids: list[int], max_tokens: int) -> list[int]:
        if not ids:
            raise ApiError(400, "prompt must not be empty", "prompt")
        try:
            self.backend.validate_token_ids(ids)
        except ValueError as exc:
            raise ApiError(400, f"prompt: {exc}", "prompt") from None
        limit = self.backend.max_context_tokens
        if len(ids) + max_tokens > limit:
            raise ApiError(
                400, f"prompt of {len(ids)} tokens plus max_tokens {max_tokens} exceeds the model's context "
                f"of {limit} tokens", "prompt",
            )
        return ids

    def _prompts(self, prompt: str | list[int] | list[str] | list[list[int]]) -> list[list[int]]:
        if isinstance(prompt, str):
            return [self.backend.tokenize(prompt)]
        if not prompt:
            raise ApiError(400, "prompt must not be empty", "prompt")
        out: list[list[int]] = []
        if all(isinstance(p, int) for p in prompt):
            return [[p for p in prompt if isinstance(p, int)]]
        for p in prompt:
            if isinstance(p, str):
                out.append(self.backend.tokenize(p))
            elif isinstance(p, list):
                out.append(list(p))
        return out

    async def completions(self, request: Request) -> Response:
        started = time.perf_counter()
        self._authorize(request)
        body = self._parse(CompletionBody, await self._read_json(request))
        max_tokens = self._max_tokens(body.max_tokens)
        prompts = [self._check_prompt(ids, max_tokens) for ids in self._prompts(body.prompt)]
        if len(prompts) * body.n > MAX_CHOICES:
            raise ApiError(400, f"prompts x n must be <= {MAX_CHOICES}", "n")
        jobs = [
            _Job(p * body.n + i, ids, _sampling(body, i))
            for p, ids in enumerate(prompts)
            for i in range(body.n)
        ]
        return await self._respond(request, body, jobs, max_tokens, started, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        started = time.perf_counter()
        self._authorize(request)
        body = self._parse(ChatBody, await self._read_json(request))
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            raise ApiError(400, "give max_tokens or max_completion_tokens, not both", "max_tokens")
        max_tokens = self._max_tokens(
            body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        )
        messages = [
            {"role": m.role, "content": m.content if isinstance(m.content, str)
             else "".join(part.text for part in m.content)}
            for m in body.messages
        ]
        try:
            ids = self.backend.tokenize_chat(messages)
        except ChatUnsupportedError as exc:
            raise ApiError(
                400, f"chat is not available for model {self.model_name!r}: {exc}", "messages"
            ) from None
        except ValueError as exc:  # the template refused these messages
            raise ApiError(400, str(exc), "messages") from None
        ids = self._check_prompt(ids, max_tokens)
        jobs = [_Job(i, ids, _sampling(body, i)) for i in range(body.n)]
        return await self._respond(request, body, jobs, max_tokens, started, chat=True)

    async def _admit(self, jobs: list[_Job], max_tokens: int) -> QueuedTicket:
        longest = max(len(job.prompt_ids) for job in jobs)
        try:
            admit = functools.partial(self.backend.admit, longest, max_tokens, len(jobs))
            return await self.queue.admit(admit)
        except EngineBusyError as exc:
            raise ApiError(503, str(exc), headers={"Retry-After": str(exc.retry_after_s)}) from None
        except RequestTooLargeError as exc:
            raise ApiError(400, str(exc), "max_tokens") from None

    async def _run(
        self, job: _Job, max_tokens: int, stop: list[str], admission: QueuedTicket,
        on_delta: Callable[[str], None] | None = None,
    ) -> tuple[GenerationOutcome, TextStream]:
        """Generate one choice; ``on_delta`` gets text as it becomes final (called on the event loop)."""
        stream = TextStream(self.backend.detokenize, stop)
        loop = asyncio.get_running_loop()

        def on_token(token_id: int) -> bool:  # runs in the model's worker thread
            more = stream.push(token_id)
            if on_delta is not None:
                delta = stream.take_delta()
                if delta:
                    loop.call_soon_threadsafe(on_delta, delta)
            return more

        try:
            outcome = await self.backend.generate(
                job.prompt_ids, max_tokens, job.sampling, on_token, admission.ticket
            )
        except ValueError as exc:  # e.g. the prompt does not fit the model's context
            raise ApiError(400, str(exc)) from None
        if stream.stopped:
            outcome.finish_reason = "stop"
            outcome.token_ids = list(stream.token_ids)
        return outcome, stream

    @staticmethod
    async def _until_disconnected(request: Request) -> None:
        """Returns once the client has gone (the body is read already, so the next ASGI message is the
        disconnect)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def _run_all(
        self, jobs: list[_Job], max_tokens: int, stop: list[str], admission: QueuedTicket
    ) -> list[tuple[GenerationOutcome, TextStream]]:
        try:
            async with asyncio.TaskGroup() as group:  # the choices run together in the batching engine
                tasks = [group.create_task(self._run(job, max_tokens, stop, admission)) for job in jobs]
        except ExceptionGroup as failed:  # the others were cancelled; answer with the first error
            raise failed.exceptions[0] from None
        return [task.result() for task in tasks]

    async def _respond(
        self, request: Request, body: _SamplingFields, jobs: list[_Job], max_tokens: int, started: float, *,
        chat: bool,
    ) -> Response:
        stop = _stop_strings(body.stop)
        prefix = "chatcmpl" if chat else "cmpl"
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        created = int(time.time())
        if not body.stream and body.stream_options is not None:
            raise ApiError(400, "stream_options needs stream: true", "stream_options")
        queued = time.perf_counter()
        admission = await self._admit(jobs, max_tokens)
        queue_s = time.perf_counter() - queued
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            events = self._stream(
                request_id, created, jobs, max_tokens, stop, admission, chat=chat, usage=include_usage,
                timing=(started, queue_s),
            )
            # The generator releases the admission when it ends; the background task covers a client that
            # left before the body was started.
            return StreamingResponse(
                events, media_type="text/event-stream", background=BackgroundTask(admission.release)
            )
        generating = asyncio.ensure_future(self._run_all(jobs, max_tokens, stop, admission))
        disconnected = asyncio.ensure_future(self._until_disconnected(request))
        try:
            await asyncio.wait({generating, disconnected}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnected.cancel()
            if not generating.done():  # the client left (or this handler was cancelled): stop generating
                generating.cancel()
                await asyncio.gather(generating, return_exceptions=True)
            admission.release()
        if generating.cancelled():
            return Response(status_code=499)  # nobody is listening any more
        results = generating.result()
        choices: list[dict[str, Any]] = []
        for job, (outcome, text) in zip(jobs, results, strict=True):
            if chat:
                choices.append({
                    "index": job.index, "message": {"role": "assistant", "content": text.text},
                    "logprobs": None, "finish_reason": outcome.finish_reason,
                })
            else:
                choices.append({
                    "index": job.index, "text": text.text, "token_ids": outcome.token_ids, "logprobs": None,
                    "finish_reason": outcome.finish_reason,
                })
        outcomes = [o for o, _ in results]
        prompt_tokens = sum(len(j.prompt_ids) for j in jobs[:: body.n])
        out: dict[str, Any] = {
            "id": request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": self.model_name,
            "choices": choices,
            "usage": _usage(outcomes, prompt_tokens),
            # The first choice's report (the one that could reuse remote blocks) as ``kvnet``; all of them
            # under ``kvnet_choices`` when there are several.
            "kvnet": outcomes[0].report,
        }
        if len(outcomes) > 1:
            out["kvnet_choices"] = [o.report for o in outcomes]
        response = JSONResponse(out)
        self.backend.observe_request(time.perf_counter() - started, queue_s)
        return response

    async def _stream(
        self, request_id: str, created: int, jobs: list[_Job], max_tokens: int, stop: list[str],
        admission: QueuedTicket, *, chat: bool, usage: bool, timing: tuple[float, float],
    ) -> AsyncIterator[str]:
        """The SSE events of a streamed answer; ``timing`` is (when the request started, seconds queued)."""
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
            obj = {"id": request_id, "object": kind, "created": created, "model": self.model_name,
                   "choices": choices, **extra}
            return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

        def choice(index: int, text: str | None, finish: str | None, first: bool = False) -> dict[str, Any]:
            if chat:
                delta: dict[str, str] = {"role": "assistant"} if first else {}
                if text is not None:
                    delta["content"] = text
                return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}

        outcomes: list[GenerationOutcome] = []
        deltas: asyncio.Queue[tuple[int, str]] = asyncio.Queue()
        # Every choice runs at once in the batching engine; their deltas interleave, each tagged by index.
        running: dict[asyncio.Future[tuple[GenerationOutcome, TextStream]], _Job] = {}
        try:
            for job in jobs:
                if chat:
                    yield chunk([choice(job.index, "", None, first=True)])
                on_delta = functools.partial(_put_tagged, deltas, job.index)
                running[asyncio.ensure_future(self._run(job, max_tokens, stop, admission, on_delta))] = job
            while running:
                getter = asyncio.ensure_future(deltas.get())
                try:
                    waiting: set[asyncio.Future[Any]] = {getter, *running}
                    done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    if not getter.done():
                        getter.cancel()
                if getter.done() and not getter.cancelled():
                    index, text = getter.result()
                    yield chunk([choice(index, text, None)])
                for task in [t for t in running if t in done]:
                    job = running.pop(task)
                    outcome, stream = task.result()
                    # Deltas the worker thread queued before the task finished are in the queue: send them
                    # first, then the rest of this choice's text with its finish reason.
                    while not deltas.empty():
                        index, text = deltas.get_nowait()
                        yield chunk([choice(index, text, None)])
                    rest = stream.take_delta(final=True) or (None if chat else "")
                    yield chunk([choice(job.index, rest, outcome.finish_reason)])
                    outcomes.append(outcome)
        except ApiError as exc:
            # Headers are gone: report in-band as OpenAI does, then end the stream.
            for task in running:
                task.cancel()
            yield f"data: {json.dumps({'error': {'message': exc.message, 'code': exc.status}})}\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            # The client went away: end its generation in the engine, not only the response.
            for task in running:
                task.cancel()
            raise
        else:
            if usage:
                prompt_tokens = sum(len(j.prompt_ids) for j in jobs if j.index % max(len(jobs), 1) == 0)
                yield chunk([], usage=_usage(outcomes, prompt_tokens))
            started, queue_s = timing
            self.backend.observe_request(time.perf_counter() - started, queue_s)
        finally:
            admission.release()
        yield "data: [DONE]\n\n"


def _peer(client: Any) -> str:
    return f"{client.host}:{client.port}" if client else "?"


def _put_tagged(queue: asyncio.Queue[tuple[int, str]], index: int, text: str) -> None:
    queue.put_nowait((index, text))


def bind_http(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0 picks one); ``OSError`` (e.g. port busy) is the
    caller's to report."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)  # a burst waits in the kernel's queue rather than in SYN retries
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class HttpServer:
    """uvicorn serving an ASGI app on a bound socket inside the running event loop."""

    def __init__(
        self, server: uvicorn.Server, task: asyncio.Task[None], sock: socket.socket, guard: ConnectionGuard
    ) -> None:
        self._server = server
        self._task = task
        self.guard = guard
        self.host, self.port = sock.getsockname()[:2]

    @classmethod
    async def start(
        cls, app: Any, sock: socket.socket, *, limits: HttpLimits | None = None, access_log: bool = True,
    ) -> HttpServer:
        """Serve ``app`` on ``sock``; returns once it listens. ``limits`` bound connections and how long a
        client may take (``kvnet.node.httpguard``); ``guard.stats`` counts what they did."""
        limits = limits or HttpLimits()
        guard = ConnectionGuard(limits)
        config = uvicorn.Config(
            app, log_config=None, access_log=access_log, http=guarded_protocol(guard),
            timeout_keep_alive=limits.idle_timeout_s, h11_max_incomplete_event_size=16 * 1024, lifespan="off",
        )
        if access_log:
            # uvicorn's access_log=False turns the access logger's propagation off for the whole process,
            # and access_log=True never turns it back on: a server started after one without an access
            # log would log nothing.
            logging.getLogger(ACCESS_LOGGER).propagate = True
        server = uvicorn.Server(config)
        task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
        while not server.started:  # uvicorn offers no start event; it sets this flag once listening
            if task.done():
                task.result()
                raise OSError("HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        return cls(server, task, sock, guard)

    @property
    def requests_in_progress(self) -> int:
        """Requests whose handler is running (uvicorn's tasks)."""
        return len(self._server.server_state.tasks)

    async def stop(self) -> None:
        """Stop accepting, let requests in flight finish (uvicorn's graceful shutdown), then return."""
        self._server.should_exit = True
        with contextlib.suppress(Exception):
            await self._task
