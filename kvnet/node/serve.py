"""``kvnet-node``: a long-running node doing both roles behind an OpenAI-style HTTP API.

    kvnet-node --relay moqt://HOST:PORT --ca CA_PEM [--http 127.0.0.1:8000] [--no-publish]

Every prompt it computes is published (its new full blocks are encoded, signed, stored and pushed), and
every prompt reuses the longest prefix it can find: its own cache first, then the relay. Endpoints:
``POST /v1/completions``, ``GET /health``, ``GET /metrics``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvnet.node.config import NodeConfig, add_node_arguments, node_config_from_cli, setup_logging
from kvnet.node.httpapi import HttpApi, start_http
from kvnet.node.node import Node, start_node

logger = logging.getLogger("kvnet-node")


@dataclass(frozen=True)
class ServeConfig:
    """The long-running node: its node config and HTTP listener."""

    node: NodeConfig
    http_host: str = "127.0.0.1"
    http_port: int = 8000
    publish: bool = True


class NodeBackend:
    """Adapts ``Node`` to the HTTP API's ``CompletionBackend``."""

    def __init__(self, node: Node, publish: bool) -> None:
        self.node = node
        self.publish = publish
        self.model_name = node.model_name

    async def complete(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        ids_len = len(self.node.encode_prompt(prompt))
        if ids_len + max_tokens > self.node.model.args.max_seq_len:
            raise ValueError(
                f"prompt of {ids_len} tokens plus max_tokens {max_tokens} exceeds the model context "
                f"({self.node.model.args.max_seq_len})"
            )
        report = await self.node.complete(prompt, max_tokens, publish=self.publish)
        return {
            "text": report.output_text,
            "token_ids": report.output_token_ids,
            "finish_reason": report.finish_reason,
            "prompt_tokens": report.prompt_tokens,
            "local_hit_tokens": report.local_hit_tokens,
            "remote_hit_tokens": report.remote_hit_tokens,
            "report": report.to_json(),
        }

    def health(self) -> dict[str, Any]:
        return self.node.health()

    def metrics(self) -> dict[str, float]:
        return self.node.metrics()


async def serve(config: ServeConfig) -> int:
    node = await start_node(config.node)
    server = await start_http(HttpApi(NodeBackend(node, config.publish)), config.http_host, config.http_port)
    host, port = server.sockets[0].getsockname()[:2]
    logger.info("serving http://%s:%d (POST /v1/completions, GET /health, GET /metrics)", host, port)
    print(f"READY http://{host}:{port}", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        server.close()
        await server.wait_closed()
        await node.close()
    return 0


def _hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvnet-node", description=__doc__.split("\n\n")[0])
    p.add_argument("--http", type=_hostport, default=("127.0.0.1", 8000), help="HTTP listen HOST:PORT")
    p.add_argument("--no-publish", action="store_true", help="reuse prefixes but do not publish blocks")
    add_node_arguments(p, relay_required=False)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    try:
        node_cfg = node_config_from_cli(args, os.environ.get("KVNET_HOME"))
    except (ValueError, OSError) as exc:
        print(f"kvnet-node: error: {exc}", file=sys.stderr)
        return 2
    host, port = args.http
    try:
        return asyncio.run(serve(ServeConfig(node=node_cfg, http_host=host, http_port=port,
                                             publish=not args.no_publish)))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
