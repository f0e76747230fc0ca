"""Every command parses, checks and answers ``--help`` before it imports torch (seconds of import): a
flag mistake or a missing file is reported at once. Each case runs the command's module as ``__main__``
in a fresh interpreter and reports, after it exits, whether torch was loaded. The time ``--help`` takes is
measured by benchmarks/bench_cli.py, not asserted here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.processes import REPO, make_certificates

COMMANDS = {
    "kvnet-node": "kvnet.node.serve",
    "kvnet-publisher": "publisher",
    "kvnet-subscriber": "subscriber",
    "kvnet-relay": "relay",
    "kvnet": "kvnet.cli",
}
# Runs the module as the command would, then says (after SystemExit, from atexit) whether torch loaded.
PROBE = """
import atexit, runpy, sys
atexit.register(lambda: print("torch loaded:", "torch" in sys.modules, file=sys.__stdout__, flush=True))
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def run_command(module: str, *args: str) -> tuple[int, str, str]:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, module, *args], cwd=REPO, capture_output=True, text=True, timeout=120,
        stdin=subprocess.DEVNULL, check=False,
    )
    return result.returncode, result.stdout, result.stderr


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_does_not_import_torch(command: str) -> None:
    status, out, err = run_command(COMMANDS[command], "--help")
    assert status == 0, err
    assert "usage:" in out, out
    assert out.strip().endswith("torch loaded: False"), out[-500:]


@pytest.fixture(scope="module")
def ca_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certificates(tmp_path_factory.mktemp("certs")).ca


@pytest.mark.parametrize("command", ["kvnet-node", "kvnet-publisher", "kvnet-subscriber"])
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--relay", "moqt://127.0.0.1:1", "--ca", "missing.pem"], "--ca missing.pem: not a usable PEM"),
        (["--model", "nope"], "--model 'nope': unknown preset"),
        (["--checkpoint", "missing-dir"], "--checkpoint missing-dir: not a directory"),
    ],
)
def test_bad_flags_are_refused_before_torch_is_imported(
    command: str, args: list[str], message: str, ca_file: Path
) -> None:
    prompt = [] if command == "kvnet-node" else ["--prompt", "hi"]
    needs_relay = command == "kvnet-publisher" and "--relay" not in args
    relay = ["--relay", "moqt://127.0.0.1:1", "--ca", str(ca_file)] if needs_relay else []
    status, out, err = run_command(COMMANDS[command], *relay, *prompt, *args)
    assert status == 2, err
    assert message in err, err
    assert out.strip().endswith("torch loaded: False"), (out, err)
