"""The head the three node commands share (``kvnet-publisher``, ``kvnet-subscriber``, ``kvnet-node``): the
node's flags read into a ``NodeConfig``, the model loaded behind a progress line, SIGINT/SIGTERM as a stop
event, and every failure a command expects answered with one line and its exit status: 2 for bad flags,
input or a node that cannot start, 1 for a relay or network that cannot be reached, 130 when interrupted.

torch (through ``kvnet.node.node`` and ``kvnet.model.engine``) is imported only once the flags are parsed
and checked, so ``--help`` and a mistyped flag answer at once (tests/integration/test_cli_startup.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from kvnet.errors import ContextLengthError
from kvnet.model.registry import default_models_dir
from kvnet.node.config import NodeConfig, RelayUnreachableError, node_config_from_cli, prompts_from_args
from kvnet.progress import Progress

if TYPE_CHECKING:
    from kvnet.node.node import Node

USAGE = 2
"""Exit status for bad flags or input, or a node that cannot start."""
UNREACHABLE = 1
"""Exit status for a relay or network that cannot be reached."""
INTERRUPTED = 130


class CommandError(Exception):
    """A failure the command reports as one line and exits with ``status``."""

    def __init__(self, message: str, status: int = USAGE) -> None:
        super().__init__(message)
        self.status = status


def node_config(args: argparse.Namespace) -> NodeConfig:
    """The node's settings from parsed flags (``KVNET_HOME`` and the models directory from the environment);
    ``CommandError`` (exit 2) when they do not hold."""
    try:
        return node_config_from_cli(args, os.environ.get("KVNET_HOME"), default_models_dir(os.environ))
    except (ValueError, OSError) as exc:
        raise CommandError(str(exc)) from None


def prompts(args: argparse.Namespace) -> tuple[str, ...]:
    """The prompts of ``--prompt`` / ``--prompt-file``, at least one; ``CommandError`` (exit 2) otherwise."""
    try:
        found = tuple(prompts_from_args(args))
    except (ValueError, OSError) as exc:
        raise CommandError(str(exc)) from None
    if not found:
        raise CommandError("give at least one --prompt or --prompt-file")
    return found


async def load_node(config: NodeConfig, progress: Progress) -> Node:
    """Start the node (model, cache, relay session) behind a "loading model" progress line."""
    from kvnet.node.node import start_node

    async with progress.activity(f"loading model {config.checkpoint or config.model}"):
        return await start_node(config)


def stop_event() -> asyncio.Event:
    """An event SIGINT and SIGTERM set (a long-running command's way to stop cleanly)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    return stop


def run_command(name: str, start: Callable[[], Coroutine[Any, Any, int]]) -> int:
    """Run a command's ``start()`` (which reads its flags and runs it) to its exit status, turning each
    failure a node command expects into one line on stderr, ``NAME: error: WHY``, and its status."""
    try:
        return asyncio.run(_checked(start))
    except KeyboardInterrupt:
        return INTERRUPTED
    except CommandError as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return exc.status


async def _checked(start: Callable[[], Coroutine[Any, Any, int]]) -> int:
    try:
        return await start()
    except CommandError:
        raise
    except (ContextLengthError, RelayUnreachableError, ConnectionError, TimeoutError, OSError) as exc:
        raise CommandError(str(exc), USAGE if isinstance(exc, ContextLengthError) else UNREACHABLE) from None
    except Exception as exc:
        from kvnet.model.engine import RequestTooLargeError
        from kvnet.node.node import NodeStartError

        if isinstance(exc, NodeStartError | RequestTooLargeError):
            raise CommandError(str(exc)) from None
        raise
