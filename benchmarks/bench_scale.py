"""Relay scale: memory and CPU of a ``kvnet-relay`` process per 1k idle sessions and per 100k cached objects.

Starts a relay (``bench_relay.start_relay``) and reads its resident memory (``VmRSS``) and CPU time
(utime + stime) from ``/proc/<pid>`` (Linux only):

- sessions: opens SESSIONS MoQT sessions (QUIC + TLS 1.3 + SETUP) from this process, in batches, then
  waits IDLE seconds; reports RSS growth per 1k sessions, CPU seconds spent setting them up per 1k, and
  CPU while idle (percent of one core per 1k sessions: QUIC idle timers, keep-alives);
- objects: a publisher (``bench_relay.BenchPublisher``) serves tracks of 1000 objects of OBJECT_BYTES each;
  a subscriber FETCHes OBJECTS objects through the relay, which caches them; reports RSS growth per 100k
  objects, split into payload bytes and the rest (per-object overhead).

    python benchmarks/bench_scale.py --sessions 1000 --objects 100000
    python benchmarks/bench_scale.py --sessions 200 --objects 20000      # quicker; scaled per 1k / 100k
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

from kvnet.net.config import TlsConfig
from kvnet.net.connection import MoqtConnection
from kvnet.net.endpoint import connect
from proto.messages import Location

OBJECTS_PER_TRACK = 1000
_TICKS = os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime (fields 14 and 15 of stat)


async def _sessions(url: str, ca: Path, pid: int, n: int, idle: float, batch: int = 25) -> dict[str, float]:
    tls = TlsConfig(ca_file=ca)
    await asyncio.sleep(0.5)
    rss0, cpu0 = rss_bytes(pid), cpu_seconds(pid)
    conns: list[MoqtConnection] = []
    try:
        while len(conns) < n:
            k = min(batch, n - len(conns))
            conns += await asyncio.gather(*(connect(url, tls=tls) for _ in range(k)))
        await asyncio.sleep(1.0)
        rss1, cpu1 = rss_bytes(pid), cpu_seconds(pid)
        await asyncio.sleep(idle)
        cpu2 = cpu_seconds(pid)
        alive = sum(not c.is_closed for c in conns)
    finally:
        await asyncio.gather(*(c.close_session() for c in conns), return_exceptions=True)
    per = 1000 / n
    return {"sessions": n, "alive": alive, "rss_per_1k_mib": (rss1 - rss0) * per / 2**20,
            "setup_cpu_s_per_1k": (cpu1 - cpu0) * per,
            "idle_cpu_pct_per_1k": (cpu2 - cpu1) / idle * 100 * per, "rss_base_mib": rss0 / 2**20}


async def _objects(url: str, ca: Path, pid: int, n: int, object_bytes: int) -> dict[str, float]:
    br = common.load_bench("bench_relay")
    assert br is not None
    tls = TlsConfig(ca_file=ca)
    per_track = min(n, OBJECTS_PER_TRACK)
    payloads = [os.urandom(object_bytes) for _ in range(per_track)]
    pub = br.BenchPublisher(await connect(url, tls=tls), payloads)
    await pub.start()
    sub = await connect(url, tls=tls)
    try:
        await asyncio.sleep(0.5)
        rss0 = rss_bytes(pid)
        tracks = (n + per_track - 1) // per_track
        got = 0
        for t in range(tracks):
            h = await sub.fetch(br.NS, b"scale-%d" % t, Location(0, 0), Location(0, per_track))
            got += sum([1 async for _ in h])
        await asyncio.sleep(1.0)
        rss1 = rss_bytes(pid)
    finally:
        await sub.close_session()
        await pub.conn.close_session()
    per = 100_000 / got
    grow = (rss1 - rss0) * per
    payload = object_bytes * 100_000
    return {"objects": got, "object_bytes": object_bytes, "rss_per_100k_mib": grow / 2**20,
            "payload_per_100k_mib": payload / 2**20, "overhead_bytes_per_object": (grow - payload) / 100_000}


def relay_scale(sessions: int = 1000, objects: int = 100_000, object_bytes: int = 256, idle: float = 10.0,
                certdir: Path | None = None) -> dict[str, Any]:
    """Both measurements on fresh relays (``sessions`` or ``objects`` 0 skips one)."""
    if certdir is None:
        with common.test_certificates() as tmp:
            return relay_scale(sessions, objects, object_bytes, idle, tmp)
    br = common.load_bench("bench_relay")
    if br is None:
        raise RuntimeError("benchmarks/bench_relay.py is needed")
    out: dict[str, Any] = {}
    for part in ("sessions", "objects"):
        count = sessions if part == "sessions" else objects
        if not count:
            continue
        proc, port = br.start_relay(certdir, cache_bytes=max(1 << 30, 4 * count * (object_bytes + 512)))
        try:
            url = f"moqt://127.0.0.1:{port}"
            if part == "sessions":
                out[part] = asyncio.run(_sessions(url, certdir / "ca.pem", proc.pid, count, idle))
            else:
                out[part] = asyncio.run(_objects(url, certdir / "ca.pem", proc.pid, count, object_bytes))
            out[part]["load"] = common.load_average()
        finally:
            proc.terminate()
            proc.wait(timeout=15)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=1000)
    ap.add_argument("--objects", type=int, default=100_000)
    ap.add_argument("--object-bytes", type=int, default=256)
    ap.add_argument("--idle", type=float, default=10.0, help="seconds the sessions stay idle")
    args = ap.parse_args()
    print(f"relay scale, cores={os.cpu_count()}, load {common.load_average()}", flush=True)
    t0 = time.perf_counter()
    res = relay_scale(args.sessions, args.objects, args.object_bytes, args.idle)
    for part, figures in res.items():
        print(part + ": " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                      for k, v in figures.items()))
    print(f"{time.perf_counter() - t0:.0f} s, load {common.load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
