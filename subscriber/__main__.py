"""``kvnet-subscriber``: answer prompts reusing the longest KV prefix found locally or through a relay.

    kvnet-subscriber --relay moqt://HOST:PORT --ca CA_PEM --prompt TEXT [--prompt TEXT ...]
                     [--json] [--verify]

For each prompt: local cache hits first, then the longest remote prefix (located in one round trip),
fetched, verified (signature from a trusted key, token ids against our own prompt, chain hash, payload
digests) and loaded into the paged cache; only the remainder is prefilled. Prompts given together share one
process and cache, so a repeated prompt shows a local hit. ``--json`` prints one JSON object per prompt.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import count

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
from kvnet.progress import Activity, Progress

logger = logging.getLogger("subscriber")


@dataclass(frozen=True)
class SubscriberConfig:
    """The one-shot subscriber: prompts and output options."""

    node: NodeConfig
    prompts: tuple[str, ...]
    json_output: bool = False
    verify: bool = False
    publish: bool = False
    best_effort: bool = False
    """Answer without the relay when it cannot be reached (recomputing) instead of failing."""


def build_parser() -> argparse.ArgumentParser:
    p = config_parser("kvnet-subscriber", __doc__.split("\n\n")[0])
    add_prompt_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt on stdout")
    p.add_argument(
        "--verify", action="store_true",
        help="check the output against this node's own with the same prefix held locally (exit 3 if it "
        "differs) and report whether it also equals a cold recompute",
    )
    p.add_argument("--publish", action="store_true", help="also publish the blocks this prompt computed")
    p.add_argument(
        "--best-effort", action="store_true",
        help="answer even when --relay cannot be reached, recomputing every prompt locally (without it "
        "an unreachable relay is an error, exit status 1)",
    )
    add_node_arguments(p, relay_required=False)
    return p


def _human(report: dict[str, object]) -> str:
    t = report["timings"]
    assert isinstance(t, dict)
    lines = [
        f"prompt tokens    {report['prompt_tokens']}",
        f"local hit        {report['local_hit_tokens']} tokens",
        f"remote hit       {report['remote_hit_tokens']} tokens ({report['bytes_fetched']} bytes, "
        f"renditions {report['renditions']})",
        f"computed         {report['computed_tokens']} tokens",
        f"ttft             {t['ttft_s'] * 1e3:.1f} ms (locate {t['locate_s'] * 1e3:.1f}, fetch "
        f"{t['fetch_s'] * 1e3:.1f}, prefill {t['prefill_s'] * 1e3:.1f})",
        f"output           {report['output_text']!r}",
    ]
    lines.append(f"kv exact         {report['kv_exact']}")
    if "verified" in report:
        lines.append(f"verified         {report['verified']}")
    if "equals_recompute" in report:
        lines.append(f"equals recompute {report['equals_recompute']}")
    fallback = report["fallback"]
    assert isinstance(fallback, list)
    lines.extend(f"fallback         {why}" for why in fallback)
    return "\n".join(lines)


async def run(config: SubscriberConfig) -> int:
    progress = Progress.for_command(config.json_output)
    node = await command.load_node(config.node, progress)
    ok = True
    try:
        if config.node.relay_url is not None and node.peer is None:
            problem = explain_relay_problem(config.node, node.relay_problem or "no session")
            if not config.best_effort:
                raise RelayUnreachableError(f"{problem} (--best-effort answers without it)")
            logger.warning("%s; --best-effort: answering without it", problem)
        node.check_prompts(config.prompts, config.node.max_new_tokens)
        for i, prompt in enumerate(config.prompts):
            tokens = len(node.tokenize_prompt(prompt))
            step = f"prompt {i + 1}/{len(config.prompts)}: {tokens} tokens: locate, fetch, prefill, generate"
            async with progress.activity(step) as activity:
                generated = count(1)

                def on_token(_token_id: int, note: Activity = activity, n: Iterator[int] = generated) -> bool:
                    note.note(f"{next(n)} tokens generated")
                    return True

                report = await node.complete(
                    prompt, publish=config.publish, verify=config.verify, on_token=on_token
                )
            out = report.to_json()
            if config.json_output:
                print(json.dumps(out), flush=True)
            else:
                print(_human(out), flush=True)
            ok = ok and report.verified is not False
    finally:
        await node.close()
    return 0 if ok else 3


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_config(build_parser(), argv)
    setup_logging_from_args(args)

    async def start() -> int:
        prompts = command.prompts(args)
        config = SubscriberConfig(
            node=command.node_config(args), prompts=prompts, json_output=args.json,
            verify=args.verify, publish=args.publish, best_effort=args.best_effort,
        )
        return await run(config)

    return command.run_command("kvnet-subscriber", start)


if __name__ == "__main__":
    sys.exit(main())
