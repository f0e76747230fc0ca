"""Which I/O model receives, and which sends, TLS 1.3 over TCP cheapest inside an asyncio process (the
choice behind ``kvnet.net.qmux_stack``).

One connection over loopback; the other end is a child process on a blocking ``ssl`` socket (writing
1 MiB ``sendall`` calls, or reading with ``recv_into`` one buffer), so only this process's model varies.
Receivers, all in this process on one event loop:

- ``streams``: ``asyncio.open_connection(ssl=...)``, ``reader.read(1 MiB)`` (a new ``bytes`` each);
- ``buffered``: ``loop.create_connection(ssl=...)`` with a ``BufferedProtocol`` reading into one
  preallocated buffer (asyncio's SSL layer decrypts from its memory BIO into it);
- ``nonblocking``: a non-blocking ``ssl.SSLSocket`` under ``loop.add_reader``, ``recv_into`` one
  preallocated buffer until ``SSLWantReadError`` (OpenSSL reads the socket and decrypts into it);
- ``thread``: a reader thread doing blocking ``recv_into`` and handing each read's bytes to the event
  loop with ``call_soon_threadsafe``.

Senders (``send-*``), 1 MiB of stream data at a time, as a relay serving cached objects writes:

- ``send-buffered``: ``loop.create_server(ssl=...)``, ``transport.write`` with asyncio's
  ``pause_writing``/``resume_writing`` back-pressure (4 MiB high water, what the QMux stack sets);
  asyncio's SSL layer encrypts into a memory BIO and its socket transport writes that out;
- ``send-nonblocking``: a non-blocking ``ssl.SSLSocket`` under ``loop.add_writer``, ``send`` of the
  same buffer until ``SSLWantWriteError`` (OpenSSL encrypts and writes the socket itself).

Reported per model: MB/s and this process's CPU ms per MB (threads included), medians over
interleaved runs, with the load average.

    python benchmarks/bench_tls_io.py --mib 256 --runs 3
    python benchmarks/bench_tls_io.py --mib 256 --runs 5 --models send-buffered,send-nonblocking
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvnet.security import certs

CHUNK = 1 << 20
MODELS = ("streams", "buffered", "nonblocking", "thread", "send-buffered", "send-nonblocking")
# Bytes asyncio's SSL transport may hold before it pauses the sender (kvnet.net.qmux_stack's high water).
SEND_HIGH_WATER = 4 << 20


def _sender(port: int, ca: str, total: int) -> None:
    """Child: connect, send ``total`` bytes in 1 MiB writes, wait for the receiver's close."""
    ctx = ssl.create_default_context(cafile=ca)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    raw = socket.create_connection(("127.0.0.1", port))
    with ctx.wrap_socket(raw, server_hostname="localhost") as s:
        block = os.urandom(CHUNK)
        sent = 0
        while sent < total:
            n = min(CHUNK, total - sent)
            s.sendall(block[:n])
            sent += n
        s.recv(1)


def _receiver(port: int, ca: str) -> None:
    """Child: connect, read into one buffer until the sender closes."""
    ctx = ssl.create_default_context(cafile=ca)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    raw = socket.create_connection(("127.0.0.1", port))
    with ctx.wrap_socket(raw, server_hostname="localhost") as s:
        buf = memoryview(bytearray(CHUNK))
        while s.recv_into(buf):
            pass


def _server_context(d: Path) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(d / "server.pem", d / "server-key.pem")
    return ctx


async def _streams(listener: socket.socket, ctx: ssl.SSLContext, total: int) -> None:
    done = asyncio.get_running_loop().create_future()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        got = 0
        while got < total:
            data = await reader.read(CHUNK)
            if not data:
                break
            got += len(data)
        writer.close()
        done.set_result(got)

    server = await asyncio.start_server(handle, sock=listener, ssl=ctx)
    await done
    server.close()


class _Buffered(asyncio.BufferedProtocol):
    def __init__(self, total: int, done: asyncio.Future[int]) -> None:
        self.buf = bytearray(CHUNK)
        self.got = 0
        self.total = total
        self.done = done
        self.transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self.buf)

    def buffer_updated(self, nbytes: int) -> None:
        self.got += nbytes
        if self.got >= self.total and not self.done.done():
            assert self.transport is not None
            self.transport.close()
            self.done.set_result(self.got)


async def _buffered(listener: socket.socket, ctx: ssl.SSLContext, total: int) -> None:
    loop = asyncio.get_running_loop()
    done: asyncio.Future[int] = loop.create_future()
    server = await loop.create_server(lambda: _Buffered(total, done), sock=listener, ssl=ctx)
    await done
    server.close()


async def _accept_tls(listener: socket.socket, ctx: ssl.SSLContext) -> ssl.SSLSocket:
    loop = asyncio.get_running_loop()
    listener.setblocking(False)
    raw, _ = await loop.sock_accept(listener)
    raw.setblocking(True)
    tls = await asyncio.to_thread(ctx.wrap_socket, raw, server_side=True)
    return tls


async def _nonblocking(listener: socket.socket, ctx: ssl.SSLContext, total: int) -> None:
    loop = asyncio.get_running_loop()
    tls = await _accept_tls(listener, ctx)
    tls.setblocking(False)
    buf = memoryview(bytearray(CHUNK))
    done: asyncio.Future[int] = loop.create_future()
    got = 0

    def readable() -> None:
        nonlocal got
        while True:
            try:
                n = tls.recv_into(buf)
            except (ssl.SSLWantReadError, BlockingIOError):
                return
            if n == 0 or got + n >= total:
                got += n
                loop.remove_reader(tls.fileno())
                done.set_result(got)
                return
            got += n

    loop.add_reader(tls.fileno(), readable)
    await done
    tls.close()


async def _thread(listener: socket.socket, ctx: ssl.SSLContext, total: int) -> None:
    loop = asyncio.get_running_loop()
    tls = await _accept_tls(listener, ctx)
    done: asyncio.Future[int] = loop.create_future()
    got = [0]

    def deliver(data: bytes) -> None:
        got[0] += len(data)
        if got[0] >= total and not done.done():
            done.set_result(got[0])

    def reader() -> None:
        buf = memoryview(bytearray(CHUNK))
        seen = 0
        while seen < total:
            n = tls.recv_into(buf)
            if n == 0:
                break
            seen += n
            loop.call_soon_threadsafe(deliver, bytes(buf[:n]))

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    await done
    thread.join()
    tls.close()


class _BufferedSender(asyncio.Protocol):
    """Writes ``total`` bytes in 1 MiB writes while asyncio's SSL transport takes them, then closes."""

    def __init__(self, total: int, done: asyncio.Future[int]) -> None:
        self.block = os.urandom(CHUNK)
        self.sent = 0
        self.total = total
        self.done = done
        self.paused = False
        self.transport: asyncio.WriteTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        self.transport = transport
        transport.set_write_buffer_limits(SEND_HIGH_WATER, SEND_HIGH_WATER // 4)
        self._write()

    def _write(self) -> None:
        assert self.transport is not None
        while not self.paused and self.sent < self.total:
            self.transport.write(self.block)
            self.sent += CHUNK
        if self.sent >= self.total and not self.paused:
            self.transport.close()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self._write()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(self.sent)


async def _send_buffered(listener: socket.socket, ctx: ssl.SSLContext, total: int) -> None:
    loop = asyncio.get_running_loop()
    done: asyncio.Future[int] = loop.create_future()
    server = await loop.create_server(lambda: _BufferedSender(total, done), sock=listener, ssl=ctx)
    await done
    server.close()


async def _send_nonblocking(listener: socket.socket, ctx: ssl.SSLContext, total: int) -> None:
    loop = asyncio.get_running_loop()
    tls = await _accept_tls(listener, ctx)
    tls.setblocking(False)
    block = memoryview(os.urandom(CHUNK))
    done: asyncio.Future[int] = loop.create_future()
    sent = 0

    def writable() -> None:
        nonlocal sent
        while sent < total:
            try:
                sent += tls.send(block)  # all of it, or SSLWantWriteError (retried with the same buffer)
            except (ssl.SSLWantWriteError, BlockingIOError):
                return
        loop.remove_writer(tls.fileno())
        done.set_result(sent)

    loop.add_writer(tls.fileno(), writable)
    await done
    tls.close()


MODEL_RUNS: dict[str, Callable[[socket.socket, ssl.SSLContext, int], Coroutine[Any, Any, None]]] = {
    "streams": _streams, "buffered": _buffered, "nonblocking": _nonblocking, "thread": _thread,
    "send-buffered": _send_buffered, "send-nonblocking": _send_nonblocking,
}


def _one(model: str, d: Path, total: int) -> tuple[float, float]:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    other = ["--receive", str(port), str(d / "ca.pem")] if model.startswith("send-") else [
        "--send", str(port), str(d / "ca.pem"), str(total)]
    child = subprocess.Popen([sys.executable, __file__, *other])
    try:
        cpu0, t0 = time.process_time(), time.perf_counter()
        asyncio.run(MODEL_RUNS[model](listener, _server_context(d), total))
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    finally:
        child.wait(60)
        listener.close()
    mb = total / 1e6
    return mb / wall, cpu * 1000 / mb


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--send", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--receive", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.send:
        _sender(int(args.send[0]), args.send[1], int(args.send[2]))
        return
    if args.receive:
        _receiver(int(args.receive[0]), args.receive[1])
        return
    models = args.models.split(",")
    results: dict[str, list[tuple[float, float]]] = {m: [] for m in models}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        certs.create_ca(d)
        certs.issue_cert(d, "server", ["localhost", "127.0.0.1"])
        for _ in range(args.runs):
            for m in models:
                results[m].append(_one(m, d, args.mib << 20))
    print(f"TLS 1.3, one loopback connection, {args.mib} MiB, median of {args.runs} "
          f"(load {os.getloadavg()[0]:.1f})")
    for m, rs in results.items():
        rate = statistics.median(r[0] for r in rs)
        cpu = statistics.median(r[1] for r in rs)
        side = "sender" if m.startswith("send-") else "receiver"
        runs = " ".join(f"{r[1]:.2f}" for r in rs)
        print(f"  {m:16s} {rate:7.0f} MB/s  {cpu:5.2f} ms/MB {side} CPU  (runs {runs})")


if __name__ == "__main__":
    main()
