"""Progress on a terminal for the commands' slow steps (model load and conversion, prefills, fetches).

Owns ``Progress``: tqdm bars on stderr while stderr is a terminal and the command is not writing ``--json``;
nothing at all otherwise (logs, pipes and CI stay clean). While a bar is shown, log lines are written above
it (tqdm's logging redirect) instead of through it. The work itself runs in threads or awaits the network,
so a bar advances with the wall clock, toward an estimate where one exists (a prefill's, from the node's
measured prefill speed) and labelled as such.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import sys
import time
from collections.abc import AsyncIterator
from typing import IO

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

REFRESH_S = 0.2


class Progress:
    """Bars for one command; ``enabled`` False makes every method a no-op."""

    def __init__(self, enabled: bool, stream: IO[str] | None = None) -> None:
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr

    @classmethod
    def for_command(cls, json_output: bool = False) -> Progress:
        """Shown only on a terminal, and never with ``--json`` (whose stdout a program reads)."""
        return cls(enabled=not json_output and sys.stderr.isatty())

    @contextlib.asynccontextmanager
    async def activity(self, desc: str, estimate_s: float | None = None) -> AsyncIterator[Activity]:
        """A bar for one awaited step: elapsed time, and with ``estimate_s`` the share of that estimate
        (held below 100 % until the step ends). Yields an ``Activity`` to change the label or add a note."""
        if not self.enabled:
            yield Activity(None)
            return
        total = max(estimate_s, 1e-3) if estimate_s is not None else None
        fmt = (
            "{desc}: {percentage:3.0f}% of est. |{bar}| {elapsed} of ~{total:.1f}s{postfix}"
            if total is not None else "{desc}: {elapsed}{postfix}"
        )
        # A terminal that reports no size (0x0, e.g. a fresh pseudo-terminal) would make tqdm hide the bar.
        size = shutil.get_terminal_size(fallback=(100, 24))
        with logging_redirect_tqdm(), tqdm(
            total=total, desc=desc, bar_format=fmt, file=self.stream, leave=True,
            ncols=size.columns or 100, nrows=size.lines or 24,
        ) as bar:
            activity = Activity(bar)
            ticker = asyncio.get_running_loop().create_task(_tick(bar, total))
            try:
                yield activity
            finally:
                ticker.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await ticker
                if total is not None:
                    bar.n = total  # done: a finished step shows 100 % whatever the estimate said
                bar.refresh()


class Activity:
    """What an ``activity`` bar shows besides the time: its label and a short note after it."""

    def __init__(self, bar: tqdm | None) -> None:
        self._bar = bar

    def describe(self, desc: str) -> None:
        if self._bar is not None:
            self._bar.set_description_str(desc, refresh=True)

    def note(self, text: str) -> None:
        """Thread-safe: ``on_token`` callbacks call it from the model's worker thread."""
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=True)


async def _tick(bar: tqdm, total: float | None) -> None:
    started = time.monotonic()
    while True:
        await asyncio.sleep(REFRESH_S)
        if total is not None:
            bar.n = min(time.monotonic() - started, total * 0.99)
        bar.refresh()
