"""Locate latency vs prompt length, in round trips: kvnet's locate (``kvnet.exchange.locate.locate_prefix``, a
bounded fan-out search with TRACK_STATUS probes) over one ``MoqtConnection`` through kvnet's userspace
link emulator, N = 16 .. 4096 blocks.

The publisher (kvnet's own ``BlockServer`` over a ``BlockStore``) holds the first half of the N blocks, so
the search has to find a boundary in the middle:
round 1 probes ``--fan-out`` blocks spread over the chain, round 2 every block of the one gap that holds
the boundary (N <= fan-out: one round of N probes). ``--mode all`` is the former locate for comparison:
one TRACK_STATUS per block, all at once. Processes: the publisher (a child process), the link emulator
(``kvnet linkemu``, a child process) and, with ``--relay``, a ``kvnet-relay`` process between them; the
subscriber is this process. The publisher answers in its own process so that each side has its own core.
With ``--relay --push`` the publisher first PUBLISHes its blocks into the relay's cache, as nodes do by
default, so the relay answers the hits itself and forwards only the misses; without ``--push`` the relay's
cache is cold and every probe goes on to the publisher.

Two RTTs are measured (``--rtts-ms``, default 20 and 120): the locate time divided by the RTT counts
CPU time as round trips too, so the round-trip count is also given as the slope of locate time over
RTT between the two links, which is what a longer RTT really costs (the CPU part does not grow with it).

    python benchmarks/bench_locate.py --blocks 16,256,1024,4096 --runs 3
    python benchmarks/bench_locate.py --relay            # subscriber -> link -> relay -> publisher
    python benchmarks/bench_locate.py --relay --push     # blocks pushed into the relay first (node default)
    python benchmarks/bench_locate.py --relay --mode all # the former one-request-per-block locate
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

from kvnet.exchange.blockstore import BlockStore, StoredBlock
from kvnet.exchange.locate import DEFAULT_LOCATE_FAN_OUT, locate_prefix
from kvnet.exchange.publishing import BlockServer
from kvnet.net.config import DEFAULT_STACK, STACKS, TlsConfig, TransportConfig
from kvnet.net.connection import MoqtConnection
from kvnet.net.endpoint import connect, serve
from kvnet.net.errors import RequestRejected
from proto.errors import RequestErrorCode
from proto.kvobject import block_track

BLOCKS = (16, 64, 256, 1024, 4096)
FINGERPRINT = bytes(range(32))
NAMESPACE_ID = "bench"
RENDITION = "lossless"


def block_hash(i: int) -> bytes:
    return i.to_bytes(32, "big")


def track(i: int) -> tuple[tuple[bytes, ...], bytes]:
    """Full Track Name of block ``i``, as a node names it."""
    return block_track(FINGERPRINT, NAMESPACE_ID, block_hash(i), RENDITION)


# ---------------------------------------------------------------- publisher (child process)


def _blocks(cached: int) -> list[StoredBlock]:
    """Blocks 0 .. cached-1, each a one-layer block of two small objects (a locate only asks whether a
    block exists; the bytes matter to FETCH, measured elsewhere)."""
    return [StoredBlock(block_hash(i), RENDITION, (b"manifest", b"layer 0")) for i in range(cached)]


def _block_server(conn: MoqtConnection, blocks: list[StoredBlock]) -> BlockServer:
    """kvnet's publisher, serving ``blocks``."""
    store = BlockStore(max_bytes=1 << 30)
    for block in blocks:
        store.put(block)
    return BlockServer(conn, store, FINGERPRINT, NAMESPACE_ID, num_layers=1)


async def _publisher_main(settings: TransportConfig, certdir: Path, cached: int, port: int,
                          relay_url: str | None, push: bool) -> None:
    stop = asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # parent closes stdin
    blocks = _blocks(cached)
    if relay_url is None:
        server = await serve("127.0.0.1", port, settings, TlsConfig.from_dir(certdir, "server"),
                             lambda conn: _block_server(conn, blocks).serve())
        print("ready", flush=True)
        await stop
        await server.close()
        return
    async with connect(relay_url, settings, TlsConfig.from_dir(certdir, None)) as conn:
        block_server = _block_server(conn, blocks)
        await block_server.announce()
        task = asyncio.create_task(block_server.serve())
        if push:
            pushed = await block_server.push(blocks)
            if pushed != cached:
                raise RuntimeError(f"the relay took {pushed} of {cached} pushed blocks")
        print("ready", flush=True)
        await stop
        task.cancel()


def _spawn(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, cwd=common.REPO, env=dict(os.environ, PYTHONPATH=str(common.REPO)))


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.stdin is not None:
        with contextlib.suppress(OSError):
            proc.stdin.close()
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def topology(settings: TransportConfig, certdir: Path, cached: int, rtt_ms: float,
             relay: bool, push: bool = False) -> Iterator[str]:
    """Start (relay,) publisher and link emulator; yields the URL the subscriber connects to. ``push``:
    the publisher PUBLISHes its blocks into the relay before it reports ready."""
    procs: list[subprocess.Popen[Any]] = []
    try:
        relay_url = None
        if relay:
            br = common.load_bench("bench_relay")
            if br is None:
                raise RuntimeError("benchmarks/bench_relay.py is needed for --relay")
            rproc, rport = br.start_relay(certdir, cache_bytes=64 << 20)
            procs.append(rproc)
            relay_url = f"moqt://127.0.0.1:{rport}"
            target = rport
        else:
            target = common.free_port()
        cmd = [__file__, "--serve", "--settings", json.dumps({"stack": settings.stack}), "--certdir",
               str(certdir), "--cached", str(cached), "--port", str(target)]
        if relay_url:
            cmd += ["--relay-url", relay_url] + (["--push"] if push else [])
        pub = _spawn(cmd)
        procs.append(pub)
        assert pub.stdout is not None
        if pub.stdout.readline().strip() != "ready":
            raise RuntimeError("locate publisher failed to start")
        emu_port = common.free_port()
        emu = _spawn(["-m", "kvnet.cli", "linkemu", "--listen", f"127.0.0.1:{emu_port}", "--target",
                      f"127.0.0.1:{target}", "--delay-ms", str(rtt_ms / 2)])
        procs.append(emu)
        assert emu.stdout is not None
        emu.stdout.readline()  # "forwarding ..." once it listens
        yield f"moqt://127.0.0.1:{emu_port}"
    finally:
        for p in reversed(procs):
            _stop(p)


# ---------------------------------------------------------------- subscriber (this process)


def locate_round_trips(settings: TransportConfig, blocks: list[int], runs: int = 3,
                       rtts_ms: tuple[float, float] = (20.0, 120.0), relay: bool = False,
                       certdir: Path | None = None, fan_out: int | None = DEFAULT_LOCATE_FAN_OUT,
                       push: bool = False) -> dict[str, Any]:
    """Per N: locate seconds (every run) at each RTT, RTTs = time / RTT at each, the slope estimate
    (time(rtt2) - time(rtt1)) / (rtt2 - rtt1) of medians, and the probes and rounds of one locate.
    ``fan_out`` None: every block probed at once (the former locate). ``push`` (with ``relay``): the
    blocks are in the relay's cache, as after a node's push."""
    if certdir is None:
        with common.test_certificates() as tmp:
            return locate_round_trips(settings, blocks, runs, rtts_ms, relay, tmp, fan_out, push)
    times: dict[float, dict[int, list[float]]] = {}
    cost: dict[int, tuple[int, int]] = {}
    for rtt in rtts_ms:
        with topology(settings, certdir, max(blocks) // 2, rtt, relay, push) as url:
            times[rtt] = asyncio.run(
                _measure(url, settings, certdir, blocks, runs, max(blocks) // 2, fan_out, cost)
            )
    r1, r2 = rtts_ms
    result: dict[str, Any] = {"rtts_ms": list(rtts_ms), "per_n": {}}
    for n in blocks:
        m1, m2 = common.median(times[r1][n]), common.median(times[r2][n])
        result["per_n"][n] = {
            "seconds": {str(r): times[r][n] for r in rtts_ms},
            "rtts_at": {str(r): common.median(times[r][n]) / (r / 1e3) for r in rtts_ms},
            "slope_rtts": (m2 - m1) / ((r2 - r1) / 1e3),
            "probes": cost[n][0],
            "rounds": cost[n][1],
        }
    return result


async def _measure(url: str, settings: TransportConfig, certdir: Path, blocks: list[int],
                   runs: int, cached: int, fan_out: int | None,
                   cost: dict[int, tuple[int, int]]) -> dict[int, list[float]]:
    """Locate seconds per N over one connection, after a warm-up: the search runs over tracks
    cached - N/2 .. cached + N/2 - 1, of which exactly the first N/2 exist. Records (probes, rounds)
    per N in ``cost``."""
    out: dict[int, list[float]] = {}
    async with connect(url, settings, TlsConfig.from_dir(certdir, None)) as conn:

        async def one(i: int) -> bool:
            try:
                await conn.track_status(*track(i))
                return True
            except RequestRejected as exc:
                if exc.code != RequestErrorCode.DOES_NOT_EXIST:
                    raise
                return False

        await asyncio.gather(*(one(i) for i in range(4)))  # warm-up
        for n in blocks:
            first = cached - n // 2

            async def probe(i: int, _rendition: str, first: int = first) -> None:
                await conn.track_status(*track(first + i))

            times = []
            for _ in range(runs):
                t0 = time.perf_counter()
                if fan_out is None:
                    found = await asyncio.gather(*(one(first + i) for i in range(n)))
                    hit = next((i for i, ok in enumerate(found) if not ok), n)
                    cost[n] = (n, 1)
                else:
                    located = await locate_prefix(n, ("lossless",), probe, fan_out=fan_out, timeout=60.0)
                    hit = len(located.available)
                    cost[n] = (located.probes, located.rounds)
                times.append(time.perf_counter() - t0)
                if hit != n // 2:
                    raise RuntimeError(f"locate of {n} found {hit} cached blocks, expected {n // 2}")
            out[n] = times
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", default=",".join(map(str, BLOCKS)))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rtts-ms", default="20,120")
    ap.add_argument("--stack", default=DEFAULT_STACK, choices=STACKS)
    ap.add_argument("--relay", action="store_true", help="through a kvnet-relay process")
    ap.add_argument("--push", action="store_true",
                    help="with --relay: the publisher pushes its blocks into the relay's cache first")
    ap.add_argument("--mode", default="search", choices=["search", "all"],
                    help="search: bounded fan-out locate (kvnet's); all: one TRACK_STATUS per block at once")
    ap.add_argument("--fan-out", type=int, default=DEFAULT_LOCATE_FAN_OUT, help="probes per round (search)")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--settings", help=argparse.SUPPRESS)
    ap.add_argument("--certdir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--cached", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--relay-url", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        settings = TransportConfig(**json.loads(args.settings))
        asyncio.run(
            _publisher_main(settings, args.certdir, args.cached, args.port, args.relay_url, args.push)
        )
        return 0
    blocks = [int(x) for x in args.blocks.split(",") if x]
    r1, r2 = (float(x) for x in args.rtts_ms.split(","))
    settings = TransportConfig(stack=args.stack)
    fan_out = args.fan_out if args.mode == "search" else None
    mode = f"search, fan-out {fan_out}" if fan_out else "all at once"
    path = ("relay, blocks pushed" if args.push else "relay, cache cold") if args.relay else "direct"
    print(f"locate ({mode}) via {path}, stack {args.stack}, median of "
          f"{args.runs}, cores={os.cpu_count()}, load {common.load_average()}", flush=True)
    res = locate_round_trips(settings, blocks, args.runs, (r1, r2), args.relay, fan_out=fan_out,
                             push=args.push)
    heads = [f"ms @{r1:g}", f"RTTs @{r1:g}", f"ms @{r2:g}", f"RTTs @{r2:g}", "slope RTTs", "probes", "rounds"]
    print(f"{'blocks':>7} " + " ".join(f"{h:>10}" for h in heads))
    for n, row in res["per_n"].items():
        s1, s2 = (common.median(row["seconds"][str(r)]) * 1e3 for r in (r1, r2))
        a1, a2 = (row["rtts_at"][str(r)] for r in (r1, r2))
        print(f"{n:>7} {s1:>10.0f} {a1:>10.2f} {s2:>10.0f} {a2:>10.2f} {row['slope_rtts']:>10.2f} "
              f"{row['probes']:>10} {row['rounds']:>10}")
    print(f"load {common.load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
