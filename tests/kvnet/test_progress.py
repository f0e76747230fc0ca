"""``kvnet.progress`` through a real command on a real pseudo-terminal: bars on a terminal, none in a pipe
or with ``--json``."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from tests.helpers.processes import make_certificates, start_relay

SUBSCRIBER = [sys.executable, "-m", "subscriber", "--model", "tiny", "--prompt", "progress on a terminal",
              "--max-tokens", "3"]
LOAD_BAR = "loading model tiny: 00:"
PROMPT_BAR = "prompt 1/1: "


def _run_on_pty(argv: list[str], cwd: Path) -> tuple[int, str]:
    """Run ``argv`` with stdin, stdout and stderr on a new 24x100 pseudo-terminal; return (status, output)."""
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    env = {**os.environ, "KVNET_HOME": str(cwd / "home")}
    proc = subprocess.Popen(argv, stdin=secondary, stdout=secondary, stderr=secondary, cwd=cwd, env=env)
    os.close(secondary)
    chunks = []
    while True:
        try:
            data = os.read(primary, 65536)
        except OSError:  # EIO: every holder of the terminal's other end has closed it
            break
        if not data:
            break
        chunks.append(data)
    os.close(primary)
    return proc.wait(timeout=120), b"".join(chunks).decode(errors="replace")


def test_bars_on_a_terminal(tmp_path: Path) -> None:
    status, output = _run_on_pty(SUBSCRIBER, tmp_path)
    assert status == 0, output
    assert LOAD_BAR in output and PROMPT_BAR in output and "3 tokens generated" in output, output
    assert "prompt tokens" in output  # the report itself is still printed


def test_no_bars_with_json_even_on_a_terminal(tmp_path: Path) -> None:
    status, output = _run_on_pty([*SUBSCRIBER, "--json"], tmp_path)
    assert status == 0, output
    assert LOAD_BAR not in output and PROMPT_BAR not in output, output
    assert '"prompt_tokens"' in output


@pytest.mark.parametrize("json_output", [False, True])
def test_no_bars_when_stderr_is_not_a_terminal(tmp_path: Path, json_output: bool) -> None:
    argv = [*SUBSCRIBER, "--json"] if json_output else SUBSCRIBER
    env = {**os.environ, "KVNET_HOME": str(tmp_path / "home")}
    result = subprocess.run(
        argv, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env, check=False
    )
    assert result.returncode == 0, result.stderr
    assert LOAD_BAR not in result.stderr and PROMPT_BAR not in result.stderr, result.stderr
    assert "\r" not in result.stderr
    assert "loading model tiny ..." in result.stderr  # the log line, in the one log format


def test_publisher_prefill_bar_against_its_estimate(tmp_path: Path) -> None:
    cert_dir = make_certificates(tmp_path / "certs")
    relay = start_relay(cert_dir, tmp_path)
    try:
        argv = [
            sys.executable, "-m", "publisher", "--relay", f"moqt://127.0.0.1:{relay.port}",
            "--ca", str(cert_dir.ca), "--model", "tiny", "--prompt", "a prompt to prefill " * 20,
            "--exit-after-publish",
        ]
        status, output = _run_on_pty(argv, tmp_path)
    finally:
        relay.stop()
    assert status == 0, output
    assert "prompt 1/1: prefill 401 tokens, publish: 100% of est." in output, output
