"""Relay throughput: one publisher, N subscribers (N = 1, 2, 4) through a real ``kvnet-relay`` process,
next to a raw QUIC bulk transfer with the same transport settings measured in the same run.

Scenarios per N, each the median of RUNS runs, in MB/s (10^6 bytes/s) of payload delivered to all subscribers:
  fetch-cold   N subscribers FETCH the same uncached track at once: one upstream fetch, coalesced, streamed
  fetch-warm   N subscribers FETCH a track the relay already caches
  subscribe    N subscribers SUBSCRIBE; the publisher sends the track once and the relay fans it out
The raw baseline is ``benchmarks/bench_transport.py``'s ``raw_quic_throughput`` with the same
``TransportConfig`` (one-way, same size), measured in the same run.

    python benchmarks/bench_relay.py --size-mib 32 --runs 3
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import common  # noqa: E402

from kvnet.net.config import TlsConfig, TransportConfig  # noqa: E402
from kvnet.net.connection import MoqtConnection  # noqa: E402
from kvnet.net.endpoint import connect  # noqa: E402
from kvnet.net.handles import IncomingFetch, IncomingSubscribe  # noqa: E402
from proto.data import ObjectStatus  # noqa: E402
from proto.messages import Location  # noqa: E402
from tests.helpers.processes import CertDir, make_certificates  # noqa: E402
from tests.helpers.processes import start_relay as start_relay_process  # noqa: E402

NS = (b"kvnet", b"bench")
OBJECT_BYTES = 1 << 20


def start_relay(certdir: Path, cache_bytes: int) -> tuple[subprocess.Popen[bytes], int]:
    """A relay with ``certdir``'s ``server`` certificate (``common.test_certificates``) and a cache of
    ``cache_bytes``; its log goes into ``certdir``. Returns the process and its QUIC port once it serves."""
    cert_dir = CertDir(certdir, certdir / "ca.pem", certdir / "server.pem", certdir / "server-key.pem")
    bytes_flag = str(cache_bytes)
    rp = start_relay_process(
        cert_dir, certdir, "--cache-bytes", bytes_flag, "--cache-track-bytes", bytes_flag,
        log_level="warning", ready_marker=None,
    )
    return rp.proc, rp.port


class BenchPublisher:
    def __init__(self, conn: MoqtConnection, payloads: list[bytes]) -> None:
        self.conn = conn
        self.payloads = payloads
        self.go = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.conn.publish_namespace(NS)
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async for req in self.conn.incoming_requests():
            asyncio.create_task(self._handle(req))  # noqa: RUF006 - lives as long as the connection

    async def _handle(self, req: Any) -> None:
        n = len(self.payloads)
        if isinstance(req, IncomingFetch):
            req.accept_fetch(True, Location(0, n))
            for i, p in enumerate(self.payloads):
                req.send_object(0, 0, i, p)
                await req.drain()
            req.finish()
        elif isinstance(req, IncomingSubscribe):
            req.accept_subscribe(1)
            await self.go.wait()
            sid = req.open_subgroup(0, 0)
            for i, p in enumerate(self.payloads):
                req.send_object(sid, i, p)
                await req.drain()
            req.send_object(sid, n, b"", end_stream=True, status=ObjectStatus.END_OF_TRACK)
            # At once: PUBLISH_DONE's Stream Count keeps the subscription open until the data arrived.
            req.publish_done(0x2, "done")
        else:
            req.reject(0x3, "bench publisher")


async def _drain_fetch(conn: MoqtConnection, name: bytes, n: int) -> int:
    h = await conn.fetch(NS, name, Location(0, 0), Location(0, n))
    return sum([len(o.payload) async for o in h])


async def _drain_sub(sub: Any, last: list[float]) -> int:
    """Payload bytes of a subscription; appends the arrival time of its last payload byte to ``last``
    (PUBLISH_DONE comes after a deliberate grace period, which is not the relay's throughput)."""
    n = 0
    t = time.perf_counter()
    async for o in sub:
        if o.payload:
            n += len(o.payload)
            t = time.perf_counter()
    last.append(t)
    return n


async def run_relay_scenarios(url: str, ca: Path, size: int, ns: list[int], runs: int) -> dict[str, float]:
    n_obj = max(1, size // OBJECT_BYTES)
    tls = TlsConfig(ca_file=ca)
    payloads = [os.urandom(1024) * (OBJECT_BYTES // 1024) for _ in range(n_obj)]
    pub = BenchPublisher(await connect(url, tls=tls), payloads)
    await pub.start()
    names = (f"t{i}".encode() for i in itertools.count())
    results: dict[str, float] = {}
    for n in ns:
        subs = [await connect(url, tls=tls) for _ in range(n)]
        for scenario in ("fetch-cold", "fetch-warm", "subscribe"):
            rates = []
            for _ in range(runs):
                name = next(names)
                if scenario == "fetch-warm":
                    await _drain_fetch(subs[0], name, n_obj)  # populate the cache
                if scenario == "subscribe":
                    pub.go = asyncio.Event()
                    handles = [await s.subscribe(NS, name) for s in subs]
                    t0 = time.perf_counter()
                    pub.go.set()
                    last: list[float] = []
                    got = await asyncio.gather(*(_drain_sub(h, last) for h in handles))
                    dt = max(last) - t0
                else:
                    t0 = time.perf_counter()
                    got = await asyncio.gather(*(_drain_fetch(s, name, n_obj) for s in subs))
                    dt = time.perf_counter() - t0
                assert all(g == n_obj * OBJECT_BYTES for g in got), got
                rates.append(sum(got) / dt / 1e6)
            results[f"{scenario} N={n}"] = statistics.median(rates)
            print(
                f"{scenario:11s} N={n}  {results[f'{scenario} N={n}']:8.1f} MB/s aggregate   "
                f"(runs: {' '.join(f'{r:.0f}' for r in rates)})",
                flush=True,
            )
        for s in subs:
            await s.close_session()
    await pub.conn.close_session()
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=32, help="track size (1 MiB objects)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--subscribers", default="1,2,4")
    args = ap.parse_args()
    size = args.size_mib << 20
    ns = [int(x) for x in args.subscribers.split(",")]
    bt = common.load_bench("bench_transport")
    assert bt is not None
    with tempfile.TemporaryDirectory() as tmp:
        certdir = make_certificates(Path(tmp), "server").dir
        print(
            f"{args.size_mib} MiB track, 1 MiB objects, loopback, "
            f"median of {args.runs}, cores={os.cpu_count()}"
        )
        settings = TransportConfig()  # what the relay and the peers below use
        raw = bt.raw_quic_throughput(settings, size, args.runs)
        print(
            f"raw QUIC    one-way  {raw:8.1f} MB/s   (bench_transport, stack={settings.stack}, "
            f"load {bt.load_average()})",
            flush=True,
        )
        # Budget for every track the run creates, so warm fetches really are cache hits.
        proc, port = start_relay(certdir, cache_bytes=size * (3 * args.runs * len(ns) + 2))
        try:
            res = asyncio.run(
                run_relay_scenarios(f"moqt://127.0.0.1:{port}", certdir / "ca.pem", size, ns, args.runs)
            )
        finally:
            proc.terminate()
            proc.wait(timeout=15)
    print(f"load after: {bt.load_average()}")
    print("ratios to raw QUIC: " + ", ".join(f"{k} {v / raw:.2f}x" for k, v in res.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
