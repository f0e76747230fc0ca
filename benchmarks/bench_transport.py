"""Raw bulk-transfer throughput over loopback: tuned aioquic, aioquic defaults, tuned qh3, TLS 1.3 over TCP.

One client sends SIZE MiB one-way on one stream to a server in a separate process (so each side can have
its own core); the server answers one byte after the FIN, and the client times from the first write to
that byte. Prints the median of RUNS runs per mode in MB/s (10^6 bytes/s), the ratios, and the load average.

    python benchmarks/bench_transport.py --size-mib 128 --runs 3
    python benchmarks/bench_transport.py --modes aioquic-tuned --profile   # cProfile both sides

Modes: aioquic-tuned (``TransportConfig(stack="aioquic")``), aioquic-default (aioquic's own defaults,
same certificates), qh3-tuned (``TransportConfig(stack="qh3")``), tcp-tls (asyncio streams over TLS 1.3).
Diagnostic modes: aioquic-rttexit (tuned, but aioquic's RTT-increase slow-start exit on), qh3-16384,
qh3-9000, qh3-1452 (qh3 with that datagram size).

Other benchmarks reuse ``raw_quic_throughput(settings, size)`` (or ``measure(mode, ...)``) to report
their figures as a ratio to raw QUIC on the same machine and load.
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
import ssl
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import free_port, test_certificates

from kvnet.net.config import TlsConfig, TransportConfig
from kvnet.net.registry import client_configuration, get_stack, server_configuration
from kvnet.net.sockets import apply_socket_buffers
from kvnet.net.stack import ALPN_MOQT, Stack

CHUNK = 1 << 20
# Bytes the client keeps queued in the QUIC stack (aioquic: unacknowledged, qh3: unsent): enough to keep
# the window full, bounded so we measure the transport rather than buffer growth.
HIGH_WATER = 16 << 20
MODES: dict[str, TransportConfig | None] = {
    "aioquic-tuned": TransportConfig(stack="aioquic"),
    "aioquic-default": None,
    "qh3-tuned": TransportConfig(stack="qh3"),
    "tcp-tls": None,
    "aioquic-rttexit": TransportConfig(stack="aioquic", slow_start_rtt_exit=True),
    "qh3-16384": TransportConfig(stack="qh3", max_datagram_size=16384),
    "qh3-9000": TransportConfig(stack="qh3", max_datagram_size=9000),
    "qh3-1452": TransportConfig(stack="qh3", max_datagram_size=1452),
}
DEFAULT_MODES = ("aioquic-tuned", "aioquic-default", "qh3-tuned", "tcp-tls")


def _config_to_json(settings: TransportConfig | None) -> str:
    return "null" if settings is None else json.dumps(dataclasses.asdict(settings))


def _config_from_json(text: str) -> TransportConfig | None:
    fields = json.loads(text)
    return None if fields is None else TransportConfig(**fields)


def _quic_config(settings: TransportConfig | None, is_client: bool, certdir: Path) -> Any:
    if settings is None:  # aioquic's own defaults, same certificates
        from aioquic.quic.configuration import QuicConfiguration

        cfg = QuicConfiguration(is_client=is_client, alpn_protocols=[ALPN_MOQT])
        if is_client:
            cfg.load_verify_locations(cafile=str(certdir / "ca.pem"))
            cfg.server_name = "localhost"
        else:
            cfg.load_cert_chain(certdir / "server.pem", certdir / "server-key.pem")
        return cfg
    if is_client:
        return client_configuration(settings, TlsConfig.from_dir(certdir, None), "localhost")
    return server_configuration(settings, TlsConfig.from_dir(certdir, "server"))


def _stack(settings: TransportConfig | None) -> Stack:
    return get_stack("aioquic" if settings is None else settings.stack)


# ---------------------------------------------------------------- server side (child process)


async def _serve_quic(settings: TransportConfig | None, port: int, certdir: Path) -> None:
    stack = _stack(settings)
    events = stack.events
    done = asyncio.Event()

    class Sink(stack.QuicConnectionProtocol):  # type: ignore[name-defined]
        def quic_event_received(self, event: Any) -> None:
            if isinstance(event, events.StreamDataReceived) and event.end_stream:
                self._quic.send_stream_data(event.stream_id, b"k", end_stream=True)
                self.transmit()
            elif isinstance(event, events.ConnectionTerminated):
                done.set()

    assert stack.serve is not None  # a QUIC stack

    server = await stack.serve(
        "127.0.0.1", port, configuration=_quic_config(settings, False, certdir), create_protocol=Sink
    )
    if settings is not None:
        apply_socket_buffers(server._transport.get_extra_info("socket"), settings)
    print("ready", flush=True)
    await done.wait()
    server.close()


async def _serve_tcp(port: int, certdir: Path, size: int) -> None:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(certdir / "server.pem", certdir / "server-key.pem")
    done = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        got = 0
        while got < size:
            data = await reader.read(1 << 20)
            if not data:
                break
            got += len(data)
        writer.write(b"k")
        await writer.drain()
        writer.close()
        done.set()

    server = await asyncio.start_server(handle, "127.0.0.1", port, ssl=ctx)
    print("ready", flush=True)
    await done.wait()
    server.close()


def _server_main(mode: str, settings_json: str, port: int, certdir: Path, size: int, profile: bool) -> None:
    settings = _config_from_json(settings_json)
    prof = cProfile.Profile() if profile else None
    if prof:
        prof.enable()
    if mode == "tcp-tls":
        asyncio.run(_serve_tcp(port, certdir, size))
    else:
        asyncio.run(_serve_quic(settings, port, certdir))
    if prof:
        prof.disable()
        _print_profile(prof, "server (receiver)")


# ---------------------------------------------------------------- client side


async def _client_quic(settings: TransportConfig | None, port: int, certdir: Path, size: int) -> float:
    stack = _stack(settings)
    events = stack.events
    loop = asyncio.get_running_loop()
    acked: asyncio.Future[None] = loop.create_future()
    drained = asyncio.Event()

    class Source(stack.QuicConnectionProtocol):  # type: ignore[name-defined]
        stream_id = -1

        def quic_event_received(self, event: Any) -> None:
            if isinstance(event, events.StreamDataReceived) and event.data == b"k" and not acked.done():
                acked.set_result(None)

        def datagram_received(self, data: Any, addr: Any) -> None:
            super().datagram_received(data, addr)
            self._after_receive()

        def datagrams_received(self, data: Any, addr: Any) -> None:
            # qh3's client transport delivers GRO batches here and never calls datagram_received.
            super().datagrams_received(data, addr)
            self._after_receive()

        def _after_receive(self) -> None:
            if self.stream_id >= 0 and buffered(self) < HIGH_WATER // 2:
                drained.set()

    def buffered(proto: Any) -> int:
        return stack.unsent_bytes(proto._quic, [proto.stream_id])[proto.stream_id]

    chunk = memoryview(b"\x5a" * CHUNK)
    assert stack.connect is not None  # a QUIC stack
    async with stack.connect(
        "127.0.0.1", port, configuration=_quic_config(settings, True, certdir), create_protocol=Source
    ) as proto:
        if settings is not None:
            apply_socket_buffers(proto._transport.get_extra_info("socket"), settings)
        sid = proto._quic.get_next_available_stream_id()
        proto.stream_id = sid
        t0 = time.perf_counter()
        sent = 0
        while sent < size:
            while buffered(proto) >= HIGH_WATER:
                drained.clear()
                await drained.wait()
            n = min(CHUNK, size - sent)
            proto._quic.send_stream_data(sid, chunk[:n], end_stream=sent + n == size)
            proto.transmit()
            sent += n
            await asyncio.sleep(0)
        await asyncio.wait_for(acked, 120)
        return time.perf_counter() - t0


async def _client_tcp(port: int, certdir: Path, size: int) -> float:
    ctx = ssl.create_default_context(cafile=str(certdir / "ca.pem"))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname="localhost")
    chunk = b"\x5a" * CHUNK
    t0 = time.perf_counter()
    sent = 0
    while sent < size:
        n = min(CHUNK, size - sent)
        writer.write(chunk[:n])
        await writer.drain()
        sent += n
    # asyncio TLS transports cannot half-close, so the server learns the end from the byte count.
    ack = await asyncio.wait_for(reader.read(1), 120)
    elapsed = time.perf_counter() - t0
    if ack != b"k":
        raise RuntimeError("TCP server did not acknowledge the transfer")
    writer.close()
    return elapsed


def _print_profile(prof: cProfile.Profile, title: str) -> None:
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
    print(f"--- cProfile {title}, by own time ---\n{out.getvalue()}", file=sys.stderr)


# ---------------------------------------------------------------- reusable API


def run_once(mode: str, settings: TransportConfig | None, certdir: Path, size: int,
             profile: bool = False) -> float:
    """One transfer of ``size`` bytes; returns seconds. ``mode`` is "tcp-tls" or anything else for QUIC
    with ``settings`` (None: aioquic's own defaults)."""
    port = free_port()
    cmd = [sys.executable, __file__, "--serve", mode, "--settings", _config_to_json(settings),
           "--port", str(port), "--certdir", str(certdir), "--size", str(size)]
    if profile:
        cmd.append("--profile")
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        if child.stdout.readline().strip() != "ready":
            raise RuntimeError(f"{mode} server failed to start")
        prof = cProfile.Profile() if profile else None
        if prof:
            prof.enable()
        if mode == "tcp-tls":
            elapsed = asyncio.run(_client_tcp(port, certdir, size))
        else:
            elapsed = asyncio.run(_client_quic(settings, port, certdir, size))
        if prof:
            prof.disable()
            _print_profile(prof, f"{mode} client (sender)")
        child.wait(timeout=30)
        return elapsed
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def measure(mode: str, size: int = 128 << 20, runs: int = 3, certdir: Path | None = None,
            settings: TransportConfig | None = None) -> list[float]:
    """MB/s of each of ``runs`` one-way transfers of ``size`` bytes in ``mode`` (a ``MODES`` key, or any
    name with explicit ``settings``)."""
    if settings is None and mode in MODES:
        settings = MODES[mode]
    if certdir is None:
        with test_certificates() as tmp:
            return measure(mode, size, runs, tmp, settings)
    return [size / run_once(mode, settings, certdir, size) / 1e6 for _ in range(runs)]


def raw_quic_throughput(settings: TransportConfig | None = None, size: int = 128 << 20,
                        runs: int = 3) -> float:
    """Median MB/s of raw one-way QUIC bulk transfer with ``settings`` (default: kvnet's defaults, i.e.
    the default stack tuned). The yardstick for "ratio to raw QUIC" in the relay and node benchmarks."""
    return statistics.median(measure("raw", size, runs, settings=settings or TransportConfig()))


def load_average() -> str:
    """The 1/5/15-minute load average, to print next to every figure (the cores are shared)."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma list of {', '.join(MODES)}")
    ap.add_argument("--profile", action="store_true", help="cProfile both sides (one run, slower)")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--settings", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--certdir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--size", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        _server_main(args.serve, args.settings, args.port, args.certdir, args.size, args.profile)
        return 0
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            ap.error(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
    size = args.size_mib << 20
    results: dict[str, float] = {}
    with test_certificates() as certdir:
        print(f"{args.size_mib} MiB one-way over loopback, median of {args.runs}, cores={os.cpu_count()}, "
              f"load {load_average()}")
        for mode in modes:
            try:
                if args.profile:
                    run_once(mode, MODES[mode], certdir, size, profile=True)
                    continue
                rates = measure(mode, size, args.runs, certdir)
            except Exception as exc:  # a mode that cannot run is reported, the others still are
                print(f"{mode:16s} failed: {type(exc).__name__}: {exc}")
                continue
            results[mode] = statistics.median(rates)
            runs = " ".join(f"{r:.0f}" for r in rates)
            print(f"{mode:16s} {results[mode]:8.1f} MB/s   (runs: {runs})   load {load_average()}",
                  flush=True)
    for base in ("aioquic-tuned", "qh3-tuned"):
        if results.get(base):
            ratios = ", ".join(f"{m} {v / results[base]:.2f}x" for m, v in results.items())
            print(f"ratios to {base}: {ratios}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
