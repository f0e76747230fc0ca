"""``kvnet-publisher``: prefill prompts, publish their KV blocks through a relay, keep serving them.

    kvnet-publisher --relay moqt://HOST:PORT --ca CA_PEM --prompt TEXT [--prompt TEXT ...]
                    [--prompt-file FILE] [--exit-after-publish] [--json]

Blocks are announced under the node's namespace (PUBLISH_NAMESPACE) and served on SUBSCRIBE/FETCH/
TRACK_STATUS for as long as the process runs; they are also pushed into the relay's cache with PUBLISH
(unless ``--no-push``), so they stay available after ``--exit-after-publish`` returns.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from kvnet.config import config_parser, parse_config
from kvnet.logs import setup_logging_from_args
from kvnet.node import command
from kvnet.node.config import (
    NodeConfig,
    RelayUnreachableError,
    add_node_arguments,
    add_prompt_arguments,
    explain_relay_problem,
)
from kvnet.progress import Progress

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
    p = config_parser("kvnet-publisher", __doc__.split("\n\n")[0])
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
    progress = Progress.for_command(config.json_output)
    node = await command.load_node(config.node, progress)
    try:
        node.check_prompts(config.prompts, 0)  # a publisher prefills its prompts and generates nothing
    except Exception:
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
    stop = command.stop_event()
    try:
        blocks = pushed = 0
        for i, prompt in enumerate(config.prompts):
            logger.info("prompt %d/%d: prefill ...", i + 1, len(config.prompts))
            tokens = len(node.tokenize_prompt(prompt))
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
    args = parse_config(build_parser(), argv)
    setup_logging_from_args(args)

    async def start() -> int:
        prompts = command.prompts(args)
        config = PublisherConfig(
            node=command.node_config(args), prompts=prompts,
            exit_after_publish=args.exit_after_publish, json_output=args.json, best_effort=args.best_effort,
        )
        return await run(config)

    return command.run_command("kvnet-publisher", start)


if __name__ == "__main__":
    sys.exit(main())
