"""MoQT FETCH goodput, publisher -> subscriber directly over ``MoqtConnection``, next to raw bulk QUIC with
the same transport settings measured in the same run.

The publisher runs in a child process (so each side can have its own core, as in
``bench_transport.py``) and answers every FETCH with OBJECTS objects of OBJECT_KIB KiB each on one fetch
stream, waiting on the connection's send back-pressure. The subscriber (this process) opens a fresh
connection per run, sends the FETCH and times from the request to the last payload byte. Goodput is
payload bytes per second (MB/s = 10^6 bytes/s); with ``--codec`` the payloads are KV-like bf16 K/V
encoded by that rendition at publish time and the subscriber decodes every object, and goodput counts
the *decoded* bytes (what lands in the KV cache), so compression can give more than the raw link.

    python benchmarks/bench_fetch.py --objects 64 --object-kib 1024 --runs 3 --stack aioquic
    python benchmarks/bench_fetch.py --stack qh3 --codec lossless
    python benchmarks/bench_fetch.py --stack qh3 --profile      # cProfile both sides, one run
    python benchmarks/bench_fetch.py --datagram-size 16384 --datagram-size 1452   # loopback vs Ethernet

``fetch_goodput(settings, objects, object_bytes, runs, codec)`` is the reusable API (``benchmarks/run.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import dataclasses
import io
import json
import os
import pstats
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

from kvnet.net.config import DEFAULT_STACK, STACKS, TlsConfig, TransportConfig
from kvnet.net.connection import MoqtConnection
from kvnet.net.endpoint import connect, serve
from kvnet.net.handles import IncomingFetch
from kvnet.net.sockets import apply_socket_buffers
from proto.errors import RequestErrorCode
from proto.messages import Location

NS = (b"kvnet", b"bench-fetch")
# One synthetic "layer of a block" for the codec runs: [tokens, H_kv, D] bf16 per K and V. 256 x 8 x 128
# x 2 bytes x (K, V) = 1 MiB uncompressed, the object size of the plain runs.
KV_SHAPE = (256, 8, 128)


def kv_payloads(codec_name: str, objects: int) -> tuple[list[bytes], int]:
    """``objects`` encoded K/V layers (bf16, normal values with a few outlier channels, like real K) and
    the uncompressed size of one. A handful of distinct tensors are reused to keep setup short."""
    import torch

    from kvnet.blocks.codecs import get_codec

    codec = get_codec(codec_name)
    gen = torch.Generator().manual_seed(0)
    distinct = []
    for _ in range(min(objects, 8)):
        scale = torch.ones(KV_SHAPE[1], KV_SHAPE[2])
        scale[:, :4] = 8.0  # outlier channels
        k = (torch.randn(KV_SHAPE, generator=gen) * scale).to(torch.bfloat16)
        v = (torch.randn(KV_SHAPE, generator=gen) * 0.5).to(torch.bfloat16)
        distinct.append(codec.encode(k, v))
    raw = 2 * KV_SHAPE[0] * KV_SHAPE[1] * KV_SHAPE[2] * 2
    return [distinct[i % len(distinct)] for i in range(objects)], raw


# ---------------------------------------------------------------- publisher (child process)


async def _publisher_main(settings: TransportConfig, port: int, certdir: Path, objects: int,
                          object_bytes: int, codec: str | None) -> None:
    if codec:
        payloads, _ = kv_payloads(codec, objects)
    else:
        block = os.urandom(1 << 16)
        payloads = [block * (object_bytes >> 16) + block[: object_bytes & 0xFFFF]] * objects

    async def handle(req: IncomingFetch) -> None:
        req.accept_fetch(True, Location(0, objects))
        for i, p in enumerate(payloads):
            req.send_object(0, 0, i, p)
            await req.drain()
        req.finish()

    async def on_connection(conn: MoqtConnection) -> None:
        tasks = set()
        async for req in conn.incoming_requests():
            if isinstance(req, IncomingFetch):
                t = asyncio.create_task(handle(req))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
            else:
                req.reject(RequestErrorCode.NOT_SUPPORTED, "bench publisher serves FETCH only")
        await asyncio.gather(*tasks, return_exceptions=True)

    server = await serve("127.0.0.1", port, settings, TlsConfig.from_dir(certdir, "server"),
                         on_connection)
    print("ready", flush=True)
    try:
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # parent closes stdin
    finally:
        await server.close()


async def _raw_sender_main(settings: TransportConfig, port: int, certdir: Path) -> None:
    """Raw QUIC in the fetch's direction: the client opens a stream and writes its size in ASCII; we
    answer with that many bytes on the same stream (server -> client), with the same back-pressure bound
    as ``MoqtConnection`` (``ConnectionLimits.max_send_buffer``)."""
    from kvnet.net.limits import ConnectionLimits
    from kvnet.net.registry import get_stack

    stack = get_stack(settings.stack)
    events = stack.events
    high_water = ConnectionLimits().max_send_buffer
    chunk = memoryview(os.urandom(1 << 16) * 16)

    class Source(stack.QuicConnectionProtocol):  # type: ignore[name-defined]
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            self.drained = asyncio.Event()
            self.sid = -1

        def quic_event_received(self, event: Any) -> None:
            if isinstance(event, events.StreamDataReceived) and event.end_stream:
                self.sid = event.stream_id
                asyncio.get_running_loop().create_task(self.send(int(event.data)))

        def datagram_received(self, data: Any, addr: Any) -> None:
            super().datagram_received(data, addr)
            self.after_receive()

        def datagrams_received(self, data: Any, addr: Any) -> None:
            super().datagrams_received(data, addr)
            self.after_receive()

        def _process_events(self) -> None:
            # aiopquic has no datagram callbacks: its events (a send ring drained among them) come here.
            super()._process_events()
            self.after_receive()

        def after_receive(self) -> None:
            if self.sid >= 0 and stack.unsent_bytes(self._quic, [self.sid])[self.sid] < high_water:
                self.drained.set()

        async def send(self, size: int) -> None:
            sent = 0
            while sent < size:
                while stack.unsent_bytes(self._quic, [self.sid])[self.sid] >= high_water:
                    self.drained.clear()
                    await self.drained.wait()
                n = min(len(chunk), size - sent)
                self._quic.send_stream_data(self.sid, chunk[:n], end_stream=sent + n == size)
                self.transmit()
                sent += n
                await asyncio.sleep(0)

    config = stack.server_configuration(settings, TlsConfig.from_dir(certdir, "server"))
    assert stack.serve is not None  # a QUIC stack
    server = await stack.serve("127.0.0.1", port, configuration=config, create_protocol=Source)
    if not stack.binds_own_socket:  # picoquic sizes its own socket's buffers from the configuration
        apply_socket_buffers(server._transport.get_extra_info("socket"), settings)
    print("ready", flush=True)
    try:
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    finally:
        server.close()


async def _raw_receive_once(settings: TransportConfig, port: int, certdir: Path, size: int) -> float:
    from kvnet.net.registry import get_stack

    stack = get_stack(settings.stack)
    events = stack.events
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    got = 0

    class Sink(stack.QuicConnectionProtocol):  # type: ignore[name-defined]
        def quic_event_received(self, event: Any) -> None:
            nonlocal got
            if isinstance(event, events.StreamDataReceived):
                got += len(event.data)
                if event.end_stream and not done.done():
                    done.set_result(None)

    config = stack.client_configuration(settings, TlsConfig.from_dir(certdir, None), "localhost")
    assert stack.connect is not None  # a QUIC stack
    async with stack.connect("127.0.0.1", port, configuration=config, create_protocol=Sink) as proto:
        if settings.stack != "aiopquic":  # picoquic sizes its own socket's buffers from the configuration
            apply_socket_buffers(proto._transport.get_extra_info("socket"), settings)
        sid = proto._quic.get_next_available_stream_id()
        t0 = time.perf_counter()
        proto._quic.send_stream_data(sid, str(size).encode(), end_stream=True)
        proto.transmit()
        await asyncio.wait_for(done, 120)
        elapsed = time.perf_counter() - t0
    if got != size:
        raise RuntimeError(f"raw transfer delivered {got} of {size} bytes")
    return elapsed


def raw_receive_child(settings: TransportConfig, port: int, certdir: Path, size: int) -> list[float]:
    """In a receiver child process (an aiopquic receiver runs in the Python 3.12 environment): one raw
    transfer; returns [seconds, CPU seconds of this process during it]."""
    c0 = time.process_time()
    seconds = asyncio.run(_raw_receive_once(settings, port, certdir, size))
    return [seconds, time.process_time() - c0]


def raw_receive_in_child(
    settings: TransportConfig, port: int, certdir: Path, size: int
) -> list[float]:
    """``raw_receive_child`` run in a child process on the interpreter ``settings.stack`` needs."""
    python = str(common.native_quic_python()) if settings.stack == "aiopquic" else sys.executable
    done = subprocess.run(
        [python, __file__, "--raw-receive", str(size), "--settings", json.dumps(dataclasses.asdict(settings)),
         "--port", str(port), "--certdir", str(certdir)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"raw receiver failed: {done.stderr.strip()[-300:]}")
    result: list[float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def raw_server_to_client(settings: TransportConfig, size: int, runs: int, certdir: Path,
                         client_config: TransportConfig | None = None) -> list[float]:
    """MB/s of ``runs`` raw one-way QUIC transfers of ``size`` bytes from a server (child process) to a
    client, i.e. in the direction a FETCH response travels, with ``settings`` on the server and
    ``client_config`` (default: the same) on the client, e.g. a relay on aioquic and a node on qh3."""
    with Publisher(settings, certdir, 0, 0, raw=True) as port:
        return [size / asyncio.run(_raw_receive_once(client_config or settings, port, certdir, size)) / 1e6
                for _ in range(runs)]


def _serve_child(args: argparse.Namespace) -> None:
    settings = TransportConfig(**json.loads(args.settings))
    prof = cProfile.Profile() if args.profile else None
    if prof:
        prof.enable()
    try:
        if args.raw:
            asyncio.run(_raw_sender_main(settings, args.port, args.certdir))
        else:
            asyncio.run(_publisher_main(settings, args.port, args.certdir, args.objects, args.object_bytes,
                                        args.codec))
    finally:
        if prof:
            prof.disable()
            print_profile(prof, "publisher (sender)")


# ---------------------------------------------------------------- subscriber (this process)


async def _fetch_once(settings: TransportConfig, port: int, certdir: Path, objects: int,
                      codec: str | None) -> tuple[float, int, int]:
    """(seconds, payload bytes on the wire, bytes after decoding) of one FETCH on a fresh connection."""
    dec = None
    if codec:
        import torch

        from kvnet.blocks.codecs import get_codec

        dec = get_codec(codec)
    tls = TlsConfig.from_dir(certdir, None)
    async with connect(f"moqt://127.0.0.1:{port}", settings, tls) as conn:
        t0 = time.perf_counter()
        handle = await conn.fetch(NS, b"bulk", Location(0, 0), Location(0, objects))
        wire = decoded = 0
        async for obj in handle:
            wire += len(obj.payload)
            if dec is not None:
                k, _v = dec.decode(obj.payload, KV_SHAPE, torch.bfloat16)
                decoded += 2 * k.numel() * k.element_size()
            else:
                decoded += len(obj.payload)
        return time.perf_counter() - t0, wire, decoded


def print_profile(prof: cProfile.Profile, title: str, top: int = 22) -> None:
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    print(f"--- cProfile {title}, by own time ---\n{out.getvalue()}", file=sys.stderr, flush=True)


class Publisher:
    """The publisher child process, for ``with Publisher(...) as port:``."""

    def __init__(self, settings: TransportConfig, certdir: Path, objects: int, object_bytes: int,
                 codec: str | None = None, profile: bool = False, raw: bool = False) -> None:
        self.port = common.free_port()
        # aiopquic runs in the Python 3.12 environment (tests/helpers/processes.native_quic_python).
        python = str(common.native_quic_python()) if settings.stack == "aiopquic" else sys.executable
        cmd = [python, __file__, "--serve", "--settings", json.dumps(dataclasses.asdict(settings)),
               "--port", str(self.port), "--certdir", str(certdir), "--objects", str(objects),
               "--object-bytes", str(object_bytes)]
        if codec:
            cmd += ["--codec", codec]
        if profile:
            cmd.append("--profile")
        if raw:
            cmd.append("--raw")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def __enter__(self) -> int:
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            self.__exit__()
            raise RuntimeError("bench publisher failed to start")
        return self.port

    def __exit__(self, *exc: Any) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def fetch_goodput(settings: TransportConfig, objects: int = 64, object_bytes: int = 1 << 20,
                  runs: int = 3, codec: str | None = None, certdir: Path | None = None,
                  profile: bool = False, raw: bool = True) -> dict[str, Any]:
    """FETCH goodput next to raw QUIC, runs interleaved so that load changes hit all alike.

    Returns MB/s per run for: ``fetch`` (decoded payload bytes per second), ``fetch_wire`` (payload bytes
    on the wire per second), and with ``raw``: ``raw_s2c`` (raw QUIC server -> client, the direction of a
    FETCH response) and ``raw_c2s`` (``bench_transport``'s client -> server transfer), each of the same
    number of bytes as the fetch carried, plus ``wire_bytes``, ``decoded_bytes`` and the compression
    ``ratio``. ``profile`` runs cProfile on both fetch sides and prints the top functions."""
    if certdir is None:
        with common.test_certificates() as tmp:
            return fetch_goodput(settings, objects, object_bytes, runs, codec, tmp, profile, raw)
    bt = common.load_bench("bench_transport") if raw else None
    out: dict[str, Any] = {"fetch": [], "fetch_wire": [], "raw_s2c": [], "raw_c2s": []}
    wire = decoded = 0
    with Publisher(settings, certdir, objects, object_bytes, codec, profile) as port, \
            Publisher(settings, certdir, 0, 0, raw=True) as raw_port:
        for _ in range(runs):
            prof = cProfile.Profile() if profile else None
            if prof:
                prof.enable()
            secs, wire, decoded = asyncio.run(_fetch_once(settings, port, certdir, objects, codec))
            if prof:
                prof.disable()
                print_profile(prof, "subscriber (receiver)")
            out["fetch"].append(decoded / secs / 1e6)
            out["fetch_wire"].append(wire / secs / 1e6)
            if bt is not None:
                secs = asyncio.run(_raw_receive_once(settings, raw_port, certdir, wire))
                out["raw_s2c"].append(wire / secs / 1e6)
                out["raw_c2s"].append(wire / bt.run_once("raw", settings, certdir, wire) / 1e6)
    out.update(wire_bytes=wire, decoded_bytes=decoded, ratio=decoded / wire if wire else 0.0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--objects", type=int, default=64)
    ap.add_argument("--object-kib", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--stack", default=DEFAULT_STACK, choices=STACKS)
    ap.add_argument("--codec", default=None, help="encode payloads with this rendition (lossless, int8, ...)")
    ap.add_argument("--no-raw", action="store_true", help="skip the raw QUIC baseline")
    ap.add_argument("--datagram-size", type=int, action="append",
                    help="QUIC datagram size of both sides (repeatable: one block per size, same run; "
                         "default the stack's loopback size)")
    ap.add_argument("--profile", action="store_true", help="cProfile both sides (one run)")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--raw", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--settings", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--certdir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--object-bytes", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--raw-receive", type=int, metavar="BYTES", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        _serve_child(args)
        return 0
    if args.raw_receive:
        print(json.dumps(raw_receive_child(TransportConfig(**json.loads(args.settings)), args.port,
                                           args.certdir, args.raw_receive)))
        return 0
    object_bytes = args.object_kib << 10
    runs = 1 if args.profile else args.runs
    print(f"FETCH {args.objects} x {args.object_kib} KiB, stack {args.stack}, codec {args.codec or 'none'}, "
          f"median of {runs}, cores={os.cpu_count()}, load {common.load_average()}", flush=True)
    for size in args.datagram_size or [None]:
        settings = TransportConfig(stack=args.stack, max_datagram_size=size)
        with common.test_certificates() as certdir:
            res = fetch_goodput(settings, args.objects, object_bytes, runs, args.codec, certdir, args.profile,
                                raw=not (args.no_raw or args.profile))
        _report(res, settings.datagram_size)
    return 0


def _report(res: dict[str, Any], datagram_size: int) -> None:
    load = common.load_average()
    good = common.median(res["fetch"])
    print(f"-- datagram size {datagram_size} bytes")

    def line(name: str, rates: list[float]) -> None:
        print(f"{name:<28} {common.median(rates):8.1f} MB/s  (runs {' '.join(f'{r:.0f}' for r in rates)})  "
              f"{common.median(rates) / good:.2f}x fetch")

    line("fetch goodput (decoded)", res["fetch"])
    line("fetch payload on the wire", res["fetch_wire"])
    if res["raw_s2c"]:
        line("raw QUIC server -> client", res["raw_s2c"])
        line("raw QUIC client -> server", res["raw_c2s"])
        print(f"fetch / raw (same direction) = {good / common.median(res['raw_s2c']):.2f}x, "
              f"fetch / raw (bench_transport direction) = {good / common.median(res['raw_c2s']):.2f}x")
    print(f"{res['wire_bytes'] / 1e6:.1f} MB on the wire, compression ratio {res['ratio']:.2f}, load {load}",
          flush=True)


if __name__ == "__main__":
    sys.exit(main())
