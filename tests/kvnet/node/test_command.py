"""``kvnet.node.command``: the node commands' one-line errors and exit statuses, and their prompt checks."""

from __future__ import annotations

import argparse

import pytest

from kvnet.node import command
from kvnet.node.config import RelayUnreachableError


def run(start_raises: BaseException | None, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    async def start() -> int:
        if start_raises is not None:
            raise start_raises
        return 0

    status = command.run_command("kvnet-test", start)
    return status, capsys.readouterr().err


@pytest.mark.parametrize(
    ("raised", "status"),
    [
        (command.CommandError("--http 1.2.3.4:80: cannot listen"), command.USAGE),
        (RelayUnreachableError("no relay at moqt://x:1"), command.UNREACHABLE),
        (ConnectionRefusedError("refused"), command.UNREACHABLE),
        (TimeoutError("handshake timed out"), command.UNREACHABLE),
        (KeyboardInterrupt(), command.INTERRUPTED),
    ],
)
def test_each_expected_failure_is_one_line_and_its_status(
    raised: BaseException, status: int, capsys: pytest.CaptureFixture[str]
) -> None:
    got, err = run(raised, capsys)
    assert got == status
    if status != command.INTERRUPTED:
        assert err == f"kvnet-test: error: {raised}\n"


def test_success_is_zero_and_silent(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(None, capsys) == (0, "")


def test_an_unexpected_failure_is_not_hidden(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ZeroDivisionError):
        run(ZeroDivisionError("a bug"), capsys)


def test_a_command_needs_at_least_one_prompt() -> None:
    with pytest.raises(command.CommandError, match="give at least one --prompt or --prompt-file"):
        command.prompts(argparse.Namespace(prompt=[], prompt_file=[]))
    assert command.prompts(argparse.Namespace(prompt=["a", "b"], prompt_file=[])) == ("a", "b")
