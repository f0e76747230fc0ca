"""Every row of docs/bad-input.md, run as written: one line on stderr naming the problem, the documented
exit status, no traceback. The table is the list of cases, so the docs cannot drift from the commands."""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvnet.security import certs
from kvnet.security.signing import generate_keypair
from tests.helpers.processes import REPO, CertDir, start_relay

TABLE = REPO / "docs" / "bad-input.md"
COMMANDS = {
    "kvnet-node": ["-m", "kvnet.node.serve"],
    "kvnet-publisher": ["-m", "publisher"],
    "kvnet-subscriber": ["-m", "subscriber"],
    "kvnet-relay": ["-m", "relay"],
    "kvnet": ["-m", "kvnet.cli"],
    "netns-cluster": ["-m", "kvnet.tools.cluster"],
}
_PORT = re.compile(r"\$(BUSY_TCP|BUSY_UDP|RELAY_UDP)")
_ROW = re.compile(r"^\| `(?P<command>[^`]+)` \| `(?P<message>[^`]+)` \| (?P<exit>\d+) \|$")


@dataclass(frozen=True)
class Row:
    command: str
    message: str
    exit_status: int


def table_rows() -> list[Row]:
    rows = [
        Row(m["command"], m["message"], int(m["exit"]))
        for m in map(_ROW.match, TABLE.read_text(encoding="utf-8").splitlines())
        if m is not None
    ]
    assert len(rows) >= 40, f"{TABLE} lost its table"
    return rows


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("bad-input")
    certs.create_ca(d / "certs")
    certs.issue_cert(d / "certs", "relay", ["127.0.0.1"])  # not localhost: a row dials a name it lacks
    certs.create_ca(d / "other-ca")  # a CA that did not issue the relay's certificate
    (d / "ca.txt").write_text("this is not a certificate\n")
    (d / "bad.yaml").write_text("cache-blocks: [1\n")
    (d / "list.yaml").write_text("- a\n")
    (d / "unknown.yaml").write_text("bogus: 1\n")
    # The node's default key directory exists, so no row logs "created publisher signing key" first.
    generate_keypair(d / "home" / "keys", "publisher")
    return d


@pytest.fixture(scope="module")
def busy_ports(workdir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """``$BUSY_TCP`` / ``$BUSY_UDP``: ports another socket holds (the UDP one never answers);
    ``$RELAY_UDP``: a relay serving the certificate of ``certs/``."""
    cert_dir = workdir / "certs"
    relay = start_relay(
        CertDir(cert_dir, cert_dir / "ca.pem", cert_dir / "relay.pem", cert_dir / "relay-key.pem"),
        tmp_path_factory.mktemp("relay-logs"),
    )
    try:
        with socket.socket() as tcp, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            tcp.bind(("127.0.0.1", 0))
            tcp.listen()
            udp.bind(("127.0.0.1", 0))
            yield {
                "BUSY_TCP": str(tcp.getsockname()[1]), "BUSY_UDP": str(udp.getsockname()[1]),
                "RELAY_UDP": str(relay.port),
            }
    finally:
        relay.stop()


def _expected(message: str) -> re.Pattern[str]:
    return re.compile(".*".join(re.escape(part) for part in message.split("...")))


@pytest.mark.parametrize("row", table_rows(), ids=lambda row: row.command)
def test_documented_bad_input(row: Row, workdir: Path, busy_ports: dict[str, str]) -> None:
    words = shlex.split(row.command)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVNET_")}
    env["KVNET_HOME"] = str(workdir / "home")
    while "=" in words[0]:
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    argv = [sys.executable, *COMMANDS[words[0]], *words[1:]]
    argv = [re.sub(_PORT, lambda m: busy_ports[m[1]], a) for a in argv]
    message = re.sub(_PORT, lambda m: busy_ports[m[1]], row.message)
    result = subprocess.run(
        argv, cwd=workdir, env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
        check=False,
    )
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == row.exit_status, result.stderr
    assert len(lines) == 1, lines
    assert _expected(message).fullmatch(lines[0]), (lines[0], message)


def test_best_effort_subscriber_answers_without_an_unreachable_relay(
    workdir: Path, busy_ports: dict[str, str]
) -> None:
    # The rows above: without --best-effort the same command exits 1 naming the relay.
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVNET_")}
    env["KVNET_HOME"] = str(workdir / "home")
    relay = f"moqt://127.0.0.1:{busy_ports['BUSY_UDP']}"
    result = subprocess.run(
        [sys.executable, *COMMANDS["kvnet-subscriber"], "--relay", relay, "--ca", "certs/ca.pem",
         "--relay-idle-timeout", "0.5", "--model", "tiny", "--prompt", "hi", "--json", "--best-effort"],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert f"relay {relay} unreachable" in result.stderr and "--best-effort: answering without it" in (
        result.stderr
    ), result.stderr
    assert '"computed_tokens": 3' in result.stdout, result.stdout
