"""Raw bulk-transfer throughput over loopback: tuned aioquic vs aioquic defaults vs qh3 vs TCP+TLS 1.3.

One client sends SIZE MiB one-way on one stream to a server in a separate process (so each side has its own
core); the server answers one byte after the FIN, and the client times from the first write to that byte.
Prints the median of RUNS runs per mode in MB/s (10^6 bytes/s) and the ratio to tuned aioquic.

    python benchmarks/bench_transport.py --size-mib 256 --runs 3
    python benchmarks/bench_transport.py --modes aioquic-tuned --profile   # cProfile both sides

Modes: aioquic-tuned (kvnet.quic.TransportSettings defaults), aioquic-default (aioquic's own defaults,
same certificates), aioquic-1452 (tuned but Ethernet-sized datagrams), qh3 (same API, its best settings),
tcp-tls (asyncio streams over TLS 1.3).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import pstats
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvnet import certs, quic

CHUNK = 1 << 20
# Unacknowledged bytes the client keeps queued in the QUIC stack: enough to fill the window, bounded so
# we measure transport speed rather than how fast Python can grow a bytearray.
HIGH_WATER = 16 << 20
MODES = (
    "aioquic-tuned", "aioquic-reno", "aioquic-cubic", "aioquic-default", "aioquic-1452", "qh3", "tcp-tls",
)
_TUNED = ("aioquic-tuned", "aioquic-reno", "aioquic-cubic", "aioquic-1452")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _lib(mode: str) -> Any:
    if mode == "qh3":
        import qh3.asyncio
        import qh3.quic.configuration
        import qh3.quic.events

        return qh3
    import aioquic.asyncio
    import aioquic.quic.configuration
    import aioquic.quic.events

    return aioquic


def _quic_config(mode: str, is_client: bool, certdir: Path) -> Any:
    lib = _lib(mode)
    cfg = lib.quic.configuration.QuicConfiguration(is_client=is_client, alpn_protocols=[quic.ALPN_MOQT])
    if mode in _TUNED:
        st = quic.TransportSettings() if mode != "aioquic-1452" else quic.TransportSettings.for_ethernet()
        cfg.max_datagram_size = st.max_datagram_size
        cfg.max_data = st.max_data
        cfg.max_stream_data = st.max_stream_data
        cfg.congestion_control_algorithm = st.congestion_control
        if mode in ("aioquic-reno", "aioquic-cubic"):
            cfg.congestion_control_algorithm = mode.split("-")[1]
    elif mode == "qh3":
        # qh3 accepts large datagrams (measured best around 9000 on loopback) and tunes windows itself.
        cfg.max_datagram_size = 9000
        cfg.max_data = 64 << 20
        cfg.max_stream_data = 32 << 20
    if is_client:
        cfg.load_verify_locations(cafile=str(certdir / "ca.pem"))
        cfg.server_name = "localhost"
    else:
        cfg.load_cert_chain(certdir / "server.pem", certdir / "server-key.pem")
    return cfg


def _set_buffers(mode: str, transport: Any) -> None:
    if mode in _TUNED or mode == "qh3":
        quic.apply_socket_buffers(transport.get_extra_info("socket"), quic.TransportSettings())


# ---------------------------------------------------------------- server side (child process)


async def _serve_quic(mode: str, port: int, certdir: Path, done: asyncio.Event) -> None:
    lib = _lib(mode)
    events = lib.quic.events

    class Sink(lib.asyncio.QuicConnectionProtocol):  # type: ignore[misc, name-defined]
        def quic_event_received(self, event: Any) -> None:
            if isinstance(event, events.StreamDataReceived) and event.end_stream:
                self._quic.send_stream_data(event.stream_id, b"k", end_stream=True)
                self.transmit()
            elif isinstance(event, events.ConnectionTerminated):
                done.set()

    server = await lib.asyncio.serve(
        "127.0.0.1", port, configuration=_quic_config(mode, False, certdir), create_protocol=Sink
    )
    _set_buffers(mode, server._transport)
    print("ready", flush=True)
    await done.wait()
    server.close()


async def _serve_tcp(port: int, certdir: Path, size: int, done: asyncio.Event) -> None:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(certdir / "server.pem", certdir / "server-key.pem")

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


def server_main(mode: str, port: int, certdir: Path, size: int, profile: bool) -> None:
    async def run() -> None:
        done = asyncio.Event()
        if mode == "tcp-tls":
            await _serve_tcp(port, certdir, size, done)
        else:
            await _serve_quic(mode, port, certdir, done)

    prof = cProfile.Profile() if profile else None
    if prof:
        prof.enable()
    asyncio.run(run())
    if prof:
        prof.disable()
        _print_profile(prof, "server (receiver)")


# ---------------------------------------------------------------- client side


async def _client_quic(mode: str, port: int, certdir: Path, size: int) -> float:
    lib = _lib(mode)
    events = lib.quic.events
    loop = asyncio.get_running_loop()
    acked: asyncio.Future[None] = loop.create_future()
    drained = asyncio.Event()

    class Source(lib.asyncio.QuicConnectionProtocol):  # type: ignore[misc, name-defined]
        stream_id = -1

        def quic_event_received(self, event: Any) -> None:
            if isinstance(event, events.StreamDataReceived) and event.data == b"k" and not acked.done():
                acked.set_result(None)

        def datagram_received(self, data: Any, addr: Any) -> None:
            super().datagram_received(data, addr)
            if self.stream_id >= 0 and buffered(self) < HIGH_WATER // 2:
                drained.set()

    def buffered(proto: Any) -> int:
        q = proto._quic
        if mode == "qh3":
            return int(q.get_send_buffer_size(proto.stream_id))
        # aioquic keeps unacknowledged stream bytes in the sender's buffer.
        stream = q._streams.get(proto.stream_id)
        return 0 if stream is None else len(stream.sender._buffer)

    chunk = b"\x5a" * CHUNK
    async with lib.asyncio.connect(
        "127.0.0.1", port, configuration=_quic_config(mode, True, certdir), create_protocol=Source
    ) as proto:
        _set_buffers(mode, proto._transport)
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
    assert ack == b"k"
    writer.close()
    return elapsed


def _print_profile(prof: cProfile.Profile, title: str) -> None:
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
    print(f"--- cProfile {title}, by own time ---\n{out.getvalue()}", file=sys.stderr)


def run_once(mode: str, certdir: Path, size: int, profile: bool) -> float:
    port = _free_port()
    cmd = [sys.executable, __file__, "--serve", mode, "--port", str(port), "--certdir", str(certdir),
           "--size", str(size)]
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
            elapsed = asyncio.run(_client_quic(mode, port, certdir, size))
        if prof:
            prof.disable()
            _print_profile(prof, f"{mode} client (sender)")
        child.wait(timeout=30)
        return elapsed
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--profile", action="store_true", help="cProfile both sides (one run, slower)")
    ap.add_argument("--serve", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--certdir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--size", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        server_main(args.serve, args.port, args.certdir, args.size, args.profile)
        return 0
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            ap.error(f"unknown mode {m!r}; choose from {MODES}")
    size = args.size_mib << 20
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        certdir = Path(tmp)
        certs.create_ca(certdir)
        certs.issue_cert(certdir, "server", ["localhost", "127.0.0.1"])
        print(f"{args.size_mib} MiB one-way over loopback, median of {args.runs}, cores={os.cpu_count()}")
        for mode in modes:
            times = []
            for _ in range(1 if args.profile else args.runs):
                try:
                    times.append(run_once(mode, certdir, size, args.profile))
                except Exception as exc:  # a mode that cannot run is reported, the others still are
                    print(f"{mode:16s} failed: {type(exc).__name__}: {exc}")
                    break
            if times:
                results[mode] = size / statistics.median(times) / 1e6
                runs = " ".join(f"{size / t / 1e6:.0f}" for t in times)
                print(f"{mode:16s} {results[mode]:8.1f} MB/s   (runs: {runs})", flush=True)
    base = results.get("aioquic-tuned")
    if base:
        print("ratios to aioquic-tuned: " + ", ".join(f"{m} {v / base:.2f}x" for m, v in results.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
