"""Bad command-line input to ``kvnet-node``: one line on stderr, exit status 2, never a traceback.

The same cases are tabulated in docs/nodes.md ("Bad input")."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

NODE = [sys.executable, "-m", "kvnet.node.serve", "--model", "tiny"]


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*NODE, *args], capture_output=True, text=True, timeout=120, cwd=cwd, check=False)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--store-bytes", "1X"], "argument --store-bytes: invalid size '1X'"),
        (["--cache-blocks", "abc"], "argument --cache-blocks: invalid int value: 'abc'"),
        (["--model", "nope"], "--model 'nope': unknown preset"),
        (["--http", "nohost"], "argument --http: expected HOST:PORT"),
        (["--relay", "moqt://127.0.0.1:1", "--ca", "NOT_PEM"], "not a usable PEM CA certificate: "
         "NO_CERTIFICATE_OR_CRL_FOUND"),
        (["--relay", "moqt://127.0.0.1:1", "--ca", "missing.pem"], "missing.pem: not a usable PEM CA "
         "certificate: No such file or directory"),
        (["--relay", "http://x", "--ca", "NOT_PEM"], "expected a moqt:// URL"),
        (["--checkpoint", "missing-dir"], "--checkpoint missing-dir: not a directory"),
        (["--signing-key", "missing.key"], "cannot read private key missing.key"),
        (["--config", "missing.yaml"], "--config missing.yaml: No such file or directory"),
        (["--block-size", "0"], "block_size must be positive"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    (tmp_path / "NOT_PEM").write_text("this is not a certificate\n")
    result = _run(args, tmp_path)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvnet-node: error: ") and message in lines[0], lines


def test_busy_http_port_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = _run(["--http", f"127.0.0.1:{port}"], tmp_path)
    assert result.returncode == 2
    expected = f"kvnet-node: error: --http 127.0.0.1:{port}: cannot listen: Address already in use"
    assert result.stderr.strip() == expected
