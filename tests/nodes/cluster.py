"""Real-process test cluster: a relay daemon, publishers and subscribers on loopback, certs from
kvnet.security.certs.

Nothing is mocked: every process is started with ``python -m relay|publisher|subscriber`` and talks QUIC
to the others. Keys live in a per-test KVNET_HOME, so the publisher's default signing key is the
subscriber's default trust.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from kvnet.security.signing import generate_keypair
from tests.helpers.processes import (
    REPO,
    START_TIMEOUT,
    RelayProcess,
    free_port,
    make_certificates,
    start_relay,
    wait_for_output,
)
from tests.helpers.waiting import scaled

TEST_BLOCK_SIZE = 16


def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 60.0) -> Any:
    """GET (no body) or POST a JSON body; the decoded JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=scaled(timeout)) as resp:
        raw = resp.read()
    return json.loads(raw) if raw.startswith((b"{", b"[")) else raw.decode()


class Cluster:
    """Processes of one test; ``close()`` kills whatever is still running."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.certs = tmp / "certs"
        self.certs.mkdir()
        self.cert_dir = make_certificates(self.certs)
        self.home = tmp / "home"
        generate_keypair(self.home / "keys", "publisher")
        self.procs: list[subprocess.Popen[bytes]] = []
        self.env = {
            **os.environ,
            "KVNET_HOME": str(self.home),
            "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "OMP_NUM_THREADS": "1",
        }
        self.relay_port = 0
        self.metrics_port = 0
        self.relay: subprocess.Popen[bytes] | None = None
        self._relay_process: RelayProcess | None = None

    @property
    def ca(self) -> Path:
        return self.cert_dir.ca

    def url(self, port: int | None = None) -> str:
        return f"moqt://127.0.0.1:{port or self.relay_port}"

    def _spawn(self, args: Sequence[str], name: str, stdout_to_log: bool = False) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"{name}-{len(self.procs)}.log", "wb")  # noqa: SIM115 (owned by the process)
        stdout = log if stdout_to_log else subprocess.PIPE
        proc = subprocess.Popen([sys.executable, *args], cwd=REPO, env=self.env, stdout=stdout, stderr=log)
        proc.log_path = log.name  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def log_of(self, proc: subprocess.Popen[bytes]) -> str:
        return Path(proc.log_path).read_text(errors="replace")  # type: ignore[attr-defined]

    def start_relay(self, *extra: str) -> subprocess.Popen[bytes]:
        """Start the cluster's relay; a restarted relay keeps the ports of the first one."""
        self.relay_port = self.relay_port or free_port()
        self.metrics_port = self.metrics_port or free_port()
        rp = start_relay(
            self.cert_dir, self.tmp, *extra, port=self.relay_port, metrics_port=self.metrics_port,
            log_level=None, env=self.env, name=f"relay-{len(self.procs)}",
        )
        rp.proc.log_path = str(rp.log_path)  # type: ignore[attr-defined]
        self.procs.append(rp.proc)
        self._relay_process = rp
        self.relay = rp.proc
        return rp.proc

    def wait_for_log(self, proc: subprocess.Popen[bytes], marker: str, name: str) -> None:
        """Return once ``marker`` is in the process's log (raise with its tail if it exits first)."""
        wait_for_output(proc, lambda: self.log_of(proc), marker, name)

    def start_linkemu(self, *shape: str) -> int:
        """Start ``kvnet linkemu`` in front of the relay with ``shape`` flags (``--delay-ms 10``...);
        returns the emulator's port once it forwards."""
        port = free_port()
        args = ["-m", "kvnet.cli", "linkemu", "--listen", f"127.0.0.1:{port}"]
        proc = self._spawn([*args, "--target", f"127.0.0.1:{self.relay_port}", *shape], "linkemu", True)
        self.wait_for_log(proc, "forwarding", "linkemu")
        return port

    def relay_metrics(self) -> dict[str, float]:
        assert self._relay_process is not None, "start_relay first"
        return self._relay_process.metrics()

    def node_args(
        self, prompts: Sequence[str], extra: Sequence[str], relay_port: int | None,
        relay_url: str | None = None,
    ) -> list[str]:
        """A node's flags; ``--relay`` is ``relay_url`` when given (a ``moqt+qmux://`` one, say)."""
        args = ["--relay", relay_url or self.url(relay_port), "--ca", str(self.ca), *self._block_size(extra)]
        for p in prompts:
            args += ["--prompt", p]
        return [*args, *extra]

    @staticmethod
    def _block_size(extra: Sequence[str]) -> list[str]:
        # The tests' prompts are a few hundred tokens: 16-token blocks give them many blocks to share,
        # whatever the nodes' default; a test that wants another size passes its own. The tiny preset
        # keeps processes quick to start; its prefill is so fast that tests force --abr where it matters.
        args = [] if "--block-size" in extra else ["--block-size", str(TEST_BLOCK_SIZE)]
        return args if "--model" in extra or "--checkpoint" in extra else [*args, "--model", "tiny"]

    def start_publisher(
        self, prompts: Sequence[str], *extra: str, wait: bool = True
    ) -> subprocess.Popen[bytes]:
        """Start a serving publisher; with ``wait``, return once it has published everything."""
        proc = self._spawn(["-m", "publisher", *self.node_args(prompts, extra, None)], "publisher")
        if wait:
            self.wait_for_log(proc, "READY", "publisher")
        return proc

    def publish_and_exit(self, prompts: Sequence[str], *extra: str) -> None:
        proc = self._spawn(
            ["-m", "publisher", *self.node_args(prompts, ["--exit-after-publish", *extra], None)], "publisher"
        )
        rc = proc.wait(timeout=scaled(START_TIMEOUT))
        assert rc == 0, self.log_of(proc)[-3000:]

    def start_subscriber(
        self, prompts: Sequence[str], *extra: str, relay_port: int | None = None, relay_url: str | None = None
    ) -> subprocess.Popen[bytes]:
        # On the tiny model recomputing is cheaper than fetching, so the ABR would (rightly) recompute;
        # tests about remote hits pin the policy to fetch unless they choose one.
        policy = [] if "--abr" in extra else ["--abr", "fetch"]
        return self._spawn(
            ["-m", "subscriber", "--json", *policy, *self.node_args(prompts, extra, relay_port, relay_url)],
            "subscriber",
        )

    def subscribe(
        self, prompts: Sequence[str], *extra: str, relay_port: int | None = None, timeout: float = 120.0,
        relay_url: str | None = None,
    ) -> list[dict[str, Any]]:
        """Run a one-shot subscriber to completion; one report per prompt."""
        proc = self.start_subscriber(prompts, *extra, relay_port=relay_port, relay_url=relay_url)
        out, _ = proc.communicate(timeout=scaled(timeout))
        assert proc.returncode == 0, f"subscriber rc={proc.returncode}: {self.log_of(proc)[-3000:]}"
        return [json.loads(line) for line in out.decode().splitlines() if line.strip()]

    def start_http_node(self, *extra: str) -> tuple[subprocess.Popen[bytes], str]:
        """Start ``kvnet-node`` on a free HTTP port; returns the process and its base URL once it serves."""
        port = free_port()
        args = ["-m", "kvnet.node.serve", "--http", f"127.0.0.1:{port}", "--relay", self.url()]
        args += ["--ca", str(self.ca), *self._block_size(extra)]
        proc = self._spawn([*args, *extra], "node")
        return proc, f"http://127.0.0.1:{port}"

    def wait_http_node(self, proc: subprocess.Popen[bytes]) -> None:
        self.wait_for_log(proc, "READY http://", "node")

    def kill(self, proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
        if proc.poll() is None:
            proc.send_signal(sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=scaled(10))

    def close(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=scaled(5))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


@contextlib.contextmanager
def cluster(tmp: Path) -> Iterator[Cluster]:
    c = Cluster(tmp)
    try:
        yield c
    finally:
        c.close()


# A long shared prefix (system prompt + document) and user parts; byte tokenizer: 1 token per byte.
SHARED_PREFIX = (
    "System: you are a careful assistant for the kvnet project. Answer briefly and cite the document.\n"
    "Document: Media over QUIC relays cache, fan out and route named immutable objects. A KV block is "
    "exactly that: immutable, named by its prefix hash, fetched by many subscribers at once.\n"
)
