"""Reconnect times of the connection lifecycle: an origin relay restarted under a ``kvnet-node`` and an edge
relay (``--upstream``), ``--runs`` times each way.

Per run, for the way the origin stops (``sigterm``: GOAWAY then drain; ``sigkill``: silence, noticed by
keep-alive loss after the node's ``--relay-idle-timeout`` and the edge's ``--upstream-idle-timeout``):

- ``noticed``: from the signal until the node's ``/health`` says ``relay_connected: false`` and the edge's
  ``kvnet_relay_upstreams_connected`` gauge is 0 (both have left the dead session);
- ``back``: from the restarted origin logging ``listening`` until the node's ``/health`` says it is
  connected and the edge's gauge is 1 again (both reconnected; bounded by the backoff cap, 5 s, plus a
  handshake).

Medians over the runs, the load average printed with each figure. Real processes on loopback.

    python benchmarks/bench_reconnect.py [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import free_port, load_average  # noqa: E402
from tests.helpers.processes import CertDir, RelayProcess, make_certificates, start_relay  # noqa: E402

POLL_S = 0.02
WAIT_S = 120.0
"""Deadline of any one wait (a stuck step fails the run instead of hanging it)."""


def _relay_connected(url: str) -> bool:
    """The node's ``/health`` ``relay_connected`` (``/ready`` stays 200 without a relay: the node serves)."""
    with urllib.request.urlopen(f"{url}/health", timeout=10) as resp:
        return bool(json.loads(resp.read())["relay_connected"])


def _upstreams(edge: RelayProcess) -> float:
    return edge.metrics().get("kvnet_relay_upstreams_connected", -1.0)


def _until(condition: Callable[[], bool], what: str) -> float:
    """Poll ``condition``; the monotonic time it first held."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {WAIT_S:g} s")
        time.sleep(POLL_S)
    return time.monotonic()


def measure(runs: int, way: str, work: Path, certs: CertDir) -> dict[str, list[float]]:
    """``runs`` restarts of the origin stopped by ``way`` (sigterm or sigkill); seconds per run."""
    origin_port = free_port()
    origin = start_relay(certs, work, port=origin_port, log_level="info", name="origin")
    edge = start_relay(certs, work, "--upstream", f"moqt://127.0.0.1:{origin_port}", name="edge",
                       log_level="info")
    http_port = free_port()
    node_url = f"http://127.0.0.1:{http_port}"
    env = {**os.environ, "KVNET_HOME": str(work / "home"), "OMP_NUM_THREADS": "1"}
    node = subprocess.Popen(
        [sys.executable, "-m", "kvnet.node.serve", "--model", "tiny", "--http", f"127.0.0.1:{http_port}",
         "--relay", f"moqt://127.0.0.1:{origin_port}", "--ca", str(certs.ca), "--log-level", "warning"],
        cwd=REPO, env=env, stderr=subprocess.DEVNULL,
    )
    noticed: list[float] = []
    back: list[float] = []
    try:
        _until(lambda: _relay_connected_safe(node_url) and _upstreams(edge) == 1, "first sessions")
        for run in range(runs):
            stopped = time.monotonic()
            origin.proc.send_signal(signal.SIGTERM if way == "sigterm" else signal.SIGKILL)
            left = _until(lambda: not _relay_connected(node_url) and _upstreams(edge) == 0, "session left")
            noticed.append(left - stopped)
            origin.proc.wait(timeout=WAIT_S)
            origin = start_relay(certs, work, port=origin_port, log_level="info", name=f"origin-{way}-{run}")
            listening = time.monotonic()
            joined = _until(lambda: _relay_connected(node_url) and _upstreams(edge) == 1, "reconnected")
            back.append(joined - listening)
    finally:
        node.terminate()
        node.wait(timeout=30)
        edge.stop()
        origin.stop()
    return {"noticed": noticed, "back": back}


def _relay_connected_safe(url: str) -> bool:
    """``_relay_connected``, or False while the node is not serving HTTP yet."""
    try:
        return _relay_connected(url)
    except OSError:
        return False


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=5, help="restarts per way of stopping the origin")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        certs = make_certificates(work / "certs")
        print("way      figure    median_s  min_s  max_s  runs  load")
        for way in ("sigterm", "sigkill"):
            for figure, values in measure(args.runs, way, work, certs).items():
                print(f"{way:8} {figure:8} {statistics.median(values):9.2f} {min(values):6.2f} "
                      f"{max(values):6.2f} {len(values):5}  {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
