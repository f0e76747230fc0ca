"""``kvnet-publisher``: prefill prompts, publish their KV blocks through a relay, keep serving them.

    kvnet-publisher --relay moqt://HOST:PORT --ca CA_PEM --prompt TEXT [--prompt TEXT ...]
                    [--prompt-file FILE] [--exit-after-publish] [--json]

Blocks are announced under the node's namespace (PUBLISH_NAMESPACE) and served on SUBSCRIBE/FETCH/
TRACK_STATUS for as long as the process runs; they are also pushed into the relay's cache with PUBLISH
(unless ``--no-push``), so they stay available after ``--exit-after-publish`` returns.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from kvnet.errors import ContextLengthError
from kvnet.logs import setup_logging_from_args
from kvnet.model.registry import default_models_dir
from kvnet.node.config import (
    NodeConfig,
    RelayUnreachableError,
    add_node_arguments,
    add_prompt_arguments,
    explain_relay_problem,
    node_config_from_cli,
    prompts_from_args,
)
from kvnet.progress import Progress
from kvnet.settings import parse_settings, settings_parser

# kvnet.node.node and kvnet.model.engine import torch (seconds): they are imported once the flags are parsed
# and checked, so --help and a mistyped flag answer at once (tests/kvnet/test_cli_startup.py).

logger = logging.getLogger("publisher")


@dataclass(frozen=True)
class PublisherConfig:
    """The one-shot publisher: which prompts, then stay or leave."""

    node: NodeConfig
    prompts: tuple[str, ...]
    exit_after_publish: bool = False
    json_output: bool = False
    best_effort: bool = False
    """Keep serving when the relay cannot be reached (the node keeps retrying) instead of failing."""


def build_parser() -> argparse.ArgumentParser:
    p = settings_parser("kvnet-publisher", __doc__.split("\n\n")[0])
    add_prompt_arguments(p)
    p.add_argument(
        "--exit-after-publish", action="store_true",
        help="exit once the blocks are pushed into the relay's cache instead of serving until interrupted",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt on stdout")
    p.add_argument(
        "--best-effort", action="store_true",
        help="when --relay cannot be reached, prefill anyway and keep serving while retrying it (without it "
        "an unreachable relay is an error, exit status 1; --exit-after-publish always needs the relay)",
    )
    add_node_arguments(p, relay_required=True)
    return p


async def run(config: PublisherConfig) -> int:
    from kvnet.model.engine import RequestTooLargeError
    from kvnet.node.node import start_node

    progress = Progress.for_command(config.json_output)
    async with progress.activity(f"loading model {config.node.checkpoint or config.node.model}"):
        node = await start_node(config.node)
    try:
        node.check_prompts(config.prompts, 0)  # a publisher prefills its prompts and generates nothing
    except (ContextLengthError, RequestTooLargeError):
        await node.close()
        raise
    if node.peer is None:
        problem = explain_relay_problem(config.node, node.relay_problem or "no session")
        if config.exit_after_publish:
            # Nothing would outlive this process: say so rather than exit as if the blocks were published.
            await node.close()
            raise RelayUnreachableError(f"{problem}; nothing published")
        if not config.best_effort:
            await node.close()
            raise RelayUnreachableError(
                f"{problem}; nothing published (--best-effort keeps serving and retries)"
            )
        logger.warning("%s; --best-effort: serving and retrying", problem)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        blocks = pushed = 0
        for i, prompt in enumerate(config.prompts):
            logger.info("prompt %d/%d: prefill ...", i + 1, len(config.prompts))
            tokens = len(node.encode_prompt(prompt))
            step = f"prompt {i + 1}/{len(config.prompts)}: prefill {tokens} tokens, publish"
            async with progress.activity(step, estimate_s=node.abr.prefill.estimate(tokens)):
                report = await node.publish_prompt(prompt)
            blocks += report.blocks
            pushed += report.pushed
            logger.info(
                "prompt %d/%d: %d tokens, %d blocks published (%d bytes, %d pushed), prefill %.3fs",
                i + 1, len(config.prompts), report.prompt_tokens, report.blocks, report.objects_bytes,
                report.pushed, report.prefill_s,
            )
            if config.json_output:
                print(json.dumps(report.to_json()), flush=True)
        if config.exit_after_publish:
            if blocks and not pushed:
                # Once this process exits only the relay's cache can serve the blocks, and it took none.
                logger.error("the relay accepted none of %d blocks; nothing outlives this process", blocks)
                return 1
            return 0
        logger.info("serving %d block objects; Ctrl-C to stop", len(node.store))
        print("READY", file=sys.stderr, flush=True)
        await stop.wait()
        return 0
    finally:
        await node.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_settings(build_parser(), argv)
    setup_logging_from_args(args)
    try:
        prompts = prompts_from_args(args)
        if not prompts:
            print("kvnet-publisher: error: give at least one --prompt or --prompt-file", file=sys.stderr)
            return 2
        node_cfg = node_config_from_cli(args, os.environ.get("KVNET_HOME"), default_models_dir(os.environ))
    except (ValueError, OSError) as exc:
        print(f"kvnet-publisher: error: {exc}", file=sys.stderr)
        return 2
    config = PublisherConfig(
        node=node_cfg, prompts=tuple(prompts), exit_after_publish=args.exit_after_publish,
        json_output=args.json, best_effort=args.best_effort,
    )
    from kvnet.model.engine import RequestTooLargeError  # torch: once every flag is checked
    from kvnet.node.node import NodeStartError

    try:
        return asyncio.run(run(config))
    except KeyboardInterrupt:
        return 130
    except (NodeStartError, ContextLengthError, RequestTooLargeError) as exc:
        print(f"kvnet-publisher: error: {exc}", file=sys.stderr)
        return 2
    except (RelayUnreachableError, ConnectionError, TimeoutError, OSError) as exc:
        print(f"kvnet-publisher: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
