"""``kvnet-node``: a long-running node doing both roles behind an OpenAI-style HTTP API.

    kvnet-node --relay moqt://HOST:PORT --ca CA_PEM [--http 127.0.0.1:8000] [--no-publish]

Every prompt it computes is published (its new full blocks are encoded, signed, stored and pushed), and
every prompt reuses the longest prefix it can find: its own cache first, then the relay. The HTTP API is
OpenAI-compatible (``kvnet.node.httpapi``): ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``,
plus ``/health``, ``/ready`` and ``/metrics``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvnet.config import config_parser, parse_config
from kvnet.logs import setup_logging_from_args
from kvnet.node import command
from kvnet.node.config import NodeConfig, add_node_arguments, explain_relay_problem
from kvnet.node.httpguard import HttpLimits
from kvnet.progress import Progress

# The model, the node and the HTTP API import torch (seconds): they are imported once the flags are
# parsed and checked, so --help and a mistyped flag answer at once (tests/kvnet/test_cli_startup.py).
if TYPE_CHECKING:
    from kvnet.model.engine import Admission
    from kvnet.model.generate import SamplingParams, TokenCallback
    from kvnet.node.httpapi import AdmissionTicket, ApiConfig, GenerationOutcome
    from kvnet.node.node import Node

logger = logging.getLogger("kvnet-node")



def _default_api_config() -> ApiConfig:
    from kvnet.node.httpapi import ApiConfig

    return ApiConfig()


@dataclass(frozen=True)
class ServeConfig:
    """The long-running node: its node config and HTTP listener."""

    node: NodeConfig
    http_host: str = "127.0.0.1"
    http_port: int = 8000
    publish: bool = True
    api: ApiConfig = field(default_factory=_default_api_config)
    http_limits: HttpLimits = field(default_factory=HttpLimits)
    """HTTP connections served at once and client deadlines (``kvnet.node.httpguard``)."""


class NodeBackend:
    """Adapts ``Node`` to the HTTP API's ``CompletionBackend``."""

    def __init__(self, node: Node, publish: bool) -> None:
        self.node = node
        self.publish = publish
        self.model_name = node.model_name
        self.max_context_tokens = node.model.args.max_seq_len
        from kvnet.node.metrics import NodeMetrics

        self.metrics = NodeMetrics(node)
        self.draining = False
        """Set when the node starts shutting down: /ready turns 503 so a load balancer stops sending."""

    def tokenize(self, text: str) -> list[int]:
        return self.node.tokenize_prompt(text)

    def tokenize_chat(self, messages: list[dict[str, str]]) -> list[int]:
        tokenize_chat = getattr(self.node.tokenizer, "tokenize_chat", None)
        if tokenize_chat is None or getattr(self.node.tokenizer, "chat_template", None) is None:
            from kvnet.node.httpapi import ChatUnsupportedError

            raise ChatUnsupportedError("its tokenizer has no chat template; use /v1/completions")
        ids: list[int] = tokenize_chat(messages)
        return ids

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self.node.tokenizer.detokenize(token_ids)

    def validate_token_ids(self, token_ids: Sequence[int]) -> None:
        vocab = self.node.model.args.vocab_size
        for index, token_id in enumerate(token_ids):
            if not 0 <= token_id < vocab:
                raise ValueError(f"token {index} has id {token_id}, outside the vocabulary [0, {vocab})")

    def admit(self, prompt_tokens: int, max_tokens: int, sequences: int) -> Admission:
        return self.node.engine.admit(prompt_tokens, max_tokens, sequences)

    async def generate(
        self, prompt_ids: list[int], max_tokens: int, sampling: SamplingParams, on_token: TokenCallback,
        admission: AdmissionTicket,
    ) -> GenerationOutcome:
        from kvnet.model.engine import Admission
        from kvnet.node.httpapi import GenerationOutcome

        assert isinstance(admission, Admission)  # what admit() returned
        report = await self.node.complete(
            "", max_tokens, prompt_ids=prompt_ids, sampling=sampling, on_token=on_token, publish=self.publish,
            admission=admission,
        )
        self.metrics.observe(report)
        return GenerationOutcome(
            token_ids=report.output_token_ids,
            prompt_tokens=report.prompt_tokens,
            local_hit_tokens=report.local_hit_tokens,
            remote_hit_tokens=report.remote_hit_tokens,
            finish_reason=report.finish_reason,
            report=report.to_json(),
        )

    def health(self) -> dict[str, Any]:
        return self.node.health()

    def readiness(self) -> tuple[bool, str]:
        """Ready while requests are served. Without its relay a node still serves (it recomputes what it
        cannot fetch), so relay state is in /health and kvnet_relay_connected, not here."""
        if self.draining:
            return False, "shutting down"
        if not self.node.engine.serving:
            return False, "the batching engine stopped"
        return True, ""

    def metrics_exposition(self) -> bytes:
        return self.metrics.exposition()

    def observe_request(self, latency_s: float, queue_s: float) -> None:
        self.metrics.observe_request(latency_s, queue_s)


async def serve(config: ServeConfig) -> int:
    from kvnet.node.httpapi import HttpServer, OpenAiApi, bind_http

    try:
        sock = bind_http(config.http_host, config.http_port)
    except (OSError, OverflowError) as exc:
        where = f"{config.http_host}:{config.http_port}"
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise command.CommandError(
            f"--http {where}: cannot listen: {reason} (--http HOST:PORT moves it)"
        ) from None
    try:
        node = await command.load_node(config.node, Progress.for_command())
    except BaseException:
        sock.close()
        raise
    if config.node.relay_url is not None and node.peer is None:
        # A server starts anyway (its relay may come up later); say once what to fix, in the user's terms.
        problem = explain_relay_problem(config.node, node.relay_problem or "no session")
        logger.warning("%s; serving without it (recomputing) and reconnecting in the background", problem)
    backend = NodeBackend(node, config.publish)
    api = OpenAiApi(backend, config.api)
    server = await HttpServer.start(api.app, sock, limits=config.http_limits)
    backend.metrics.watch_http(server.guard.stats, api.queue)
    logger.info("serving http://%s:%d (model %s)", server.host, server.port, api.model_name)
    print(f"READY http://{server.host}:{server.port}", file=sys.stderr, flush=True)
    stop = command.stop_event()
    try:
        await stop.wait()
    finally:
        backend.draining = True
        await server.stop()
        await node.close()
    return 0


def _hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def build_parser() -> argparse.ArgumentParser:
    p = config_parser("kvnet-node", __doc__.split("\n\n")[0])
    p.add_argument("--http", type=_hostport, default="127.0.0.1:8000", help="HTTP listen HOST:PORT")
    p.add_argument("--no-publish", action="store_true", help="reuse prefixes but do not publish blocks")
    p.add_argument("--served-model-name", help="model name clients give in requests (default: the model's)")
    p.add_argument(
        "--api-key", help="require 'Authorization: Bearer KEY' on /v1/* (default: no key; KVNET_API_KEY "
        "keeps it out of the process list)",
    )
    p.add_argument("--max-connections", type=int, default=HttpLimits.max_connections,
                   help="HTTP connections served at once; past it, idle ones are closed first and requests "
                   "wait in a bounded queue before a 503")
    add_node_arguments(p, relay_required=False)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_config(build_parser(), argv)
    setup_logging_from_args(args)

    async def start() -> int:
        node_cfg = command.node_config(args)
        from kvnet.node.httpapi import ApiConfig  # torch: after every check that does not need it

        try:
            api = ApiConfig(served_model_name=args.served_model_name, api_key=args.api_key)
            limits = HttpLimits(max_connections=args.max_connections)
        except ValueError as exc:
            raise command.CommandError(str(exc)) from None
        host, port = args.http
        return await serve(ServeConfig(node=node_cfg, http_host=host, http_port=port,
                                       publish=not args.no_publish, api=api, http_limits=limits))

    return command.run_command("kvnet-node", start)


if __name__ == "__main__":
    sys.exit(main())
