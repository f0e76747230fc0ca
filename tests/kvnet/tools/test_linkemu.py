"""Tests for kvnet.tools.linkemu: real UDP (and a real QUIC handshake) through the emulator on loopback."""

from __future__ import annotations

import asyncio
import math
import random
import socket
import threading
import time
from pathlib import Path

import pytest
from aioquic.asyncio import QuicConnectionProtocol, connect, serve

from kvnet.net.config import DATAGRAM_SIZE_ETHERNET, TlsConfig, TransportConfig
from kvnet.net.registry import client_configuration, server_configuration
from kvnet.tools.linkemu import EmulatorConfig, LinkEmulator, LinkParams, _Direction, parse_hostport
from tests.helpers.processes import make_certificates
from tests.helpers.waiting import async_wait_until


class _Echo(asyncio.DatagramProtocol):
    """Echoes every datagram and records arrival times."""

    def __init__(self, echo: bool = True) -> None:
        self.echo = echo
        self.arrivals: list[float] = []
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.arrivals.append(time.monotonic())
        if self.echo and self.transport is not None:
            self.transport.sendto(data, addr)


class _Client(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.queue: asyncio.Queue[bytes] = asyncio.Queue()

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.queue.put_nowait(data)


async def _server(echo: bool = True) -> tuple[asyncio.DatagramTransport, _Echo]:
    loop = asyncio.get_running_loop()
    transport, proto = await loop.create_datagram_endpoint(lambda: _Echo(echo), local_addr=("127.0.0.1", 0))
    # A big receive buffer so the only losses are the emulated ones.
    transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    return transport, proto


async def _client(addr: tuple[str, int]) -> tuple[asyncio.DatagramTransport, _Client]:
    loop = asyncio.get_running_loop()
    return await loop.create_datagram_endpoint(_Client, remote_addr=addr)


async def test_delay_within_tolerance() -> None:
    st, _ = await _server()
    target = st.get_extra_info("sockname")[:2]
    params = LinkParams(delay_ms=20.0)
    async with LinkEmulator(EmulatorConfig(listen=("127.0.0.1", 0), target=target, upstream=params,
                                           downstream=params)) as emu:
        ct, cp = await _client(emu.listen_address)
        rtts = []
        for i in range(15):
            t0 = time.monotonic()
            ct.sendto(b"ping%d" % i)
            assert await asyncio.wait_for(cp.queue.get(), 2) == b"ping%d" % i
            rtts.append(time.monotonic() - t0)
        ct.close()
    st.close()
    # Two one-way delays of 20 ms each: never less. How much more depends on the machine's load, so the
    # precision is a benchmark figure (docs/performance), not an assertion here.
    assert min(rtts) >= 0.040


async def _count_through(params: LinkParams, n: int, seed: int) -> int:
    st, sp = await _server(echo=False)
    target = st.get_extra_info("sockname")[:2]
    async with LinkEmulator(EmulatorConfig(listen=("127.0.0.1", 0), target=target, upstream=params,
                                           seed=seed)) as emu:
        ct, _ = await _client(emu.listen_address)
        for i in range(n):
            ct.sendto(b"x" * 100)
            if i % 50 == 49:
                # Sender pacing (part of the traffic pattern): both sockets drain, so the only losses
                # are the emulated ones, not socket-buffer overflow.
                await asyncio.sleep(0.002)
        stats = emu.stats()["upstream"]
        await async_wait_until(
            lambda: stats.dropped_loss + stats.forwarded == n and len(sp.arrivals) == stats.forwarded,
            "every datagram dropped or delivered",
        )
        ct.close()
    st.close()
    assert stats.received == n
    assert stats.forwarded == len(sp.arrivals)
    assert stats.dropped_loss + stats.forwarded == n
    return len(sp.arrivals)


async def test_random_loss_rate_within_binomial_bound() -> None:
    n, p = 4000, 0.1
    got = await _count_through(LinkParams(loss=p), n, seed=1)
    lost = n - got
    sd = math.sqrt(n * p * (1 - p))
    assert abs(lost - n * p) < 5 * sd


async def test_bursty_loss_keeps_long_run_rate() -> None:
    n, p, burst = 4000, 0.05, 4.0
    got = await _count_through(LinkParams(loss=p, loss_burst=burst), n, seed=2)
    lost = n - got
    # Bursts inflate the variance by roughly (2 * burst - 1); use a correspondingly wider bound.
    sd = math.sqrt(n * p * (1 - p) * (2 * burst - 1))
    assert abs(lost - n * p) < 5 * sd
    assert lost > 0


async def test_rate_limit() -> None:
    st, sp = await _server(echo=False)
    target = st.get_extra_info("sockname")[:2]
    rate = 200_000.0
    async with LinkEmulator(EmulatorConfig(listen=("127.0.0.1", 0), target=target,
                                           upstream=LinkParams(rate_bps=rate))) as emu:
        ct, _ = await _client(emu.listen_address)
        t0 = time.monotonic()
        for _ in range(100):
            ct.sendto(b"r" * 1000)
        await async_wait_until(lambda: len(sp.arrivals) == 100, "100 datagrams through the rate limit")
        ct.close()
    st.close()
    assert len(sp.arrivals) == 100
    elapsed = sp.arrivals[-1] - t0
    expected = 100 * 1000 / rate  # 0.5 s
    # Never faster than the rate; slower only by the machine's load (no upper bound: not a speed test).
    assert elapsed >= expected * 0.95


class _Departures:
    """Records when a direction schedules each datagram (the shaping arithmetic, apart from any clock)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.at: list[float] = []

    def schedule(self, at: float, direction: object, data: bytes, send: object) -> None:
        self.at.append(at)


def _departures(params: LinkParams, sends: list[tuple[float, int]]) -> list[float]:
    times = _Departures()
    direction = _Direction(params, random.Random(0), times)  # type: ignore[arg-type]
    for now, size in sends:
        direction.submit(b"x" * size, now, lambda _: True)
    return times.at


def test_a_burst_leaves_at_once_then_the_rate_holds() -> None:
    # 1000 B/s with a 3000-byte bucket: three 1000-byte datagrams leave at once, the rest one a second.
    sent = _departures(LinkParams(rate_bps=1000, burst_bytes=3000), [(0.0, 1000)] * 5)
    assert sent == pytest.approx([0.0, 0.0, 0.0, 1.0, 2.0])


def test_the_bucket_refills_while_idle_up_to_its_depth() -> None:
    # Drained at t=0; 1.5 s idle refills 1500 bytes; 100 s idle refills only the 3000-byte depth.
    params = LinkParams(rate_bps=1000, burst_bytes=3000)
    sent = _departures(params, [(0.0, 3000), (1.5, 1000), (1.5, 1000), (100.0, 3000), (100.0, 1000)])
    assert sent == pytest.approx([0.0, 1.5, 2.0, 100.0, 101.0])


def test_without_a_burst_each_datagram_waits_its_own_size() -> None:
    sent = _departures(LinkParams(rate_bps=1000), [(0.0, 500), (0.0, 500), (5.0, 1000)])
    assert sent == pytest.approx([0.5, 1.0, 6.0])


async def test_queue_bound_drops() -> None:
    st, sp = await _server(echo=False)
    target = st.get_extra_info("sockname")[:2]
    params = LinkParams(delay_ms=50, queue_packets=10)
    async with LinkEmulator(EmulatorConfig(listen=("127.0.0.1", 0), target=target, upstream=params)) as emu:
        ct, _ = await _client(emu.listen_address)
        for _ in range(50):
            ct.sendto(b"q")
        stats = emu.stats()["upstream"]
        await async_wait_until(
            lambda: stats.forwarded + stats.dropped_queue == 50 and len(sp.arrivals) == stats.forwarded,
            "every datagram queued-and-delivered or dropped",
        )
        ct.close()
    st.close()
    assert stats.forwarded == 10 == len(sp.arrivals)
    assert stats.dropped_queue == 40


def test_params_validation() -> None:
    with pytest.raises(ValueError, match="loss"):
        LinkParams(loss=1.5)
    with pytest.raises(ValueError, match="queue_packets"):
        LinkParams(queue_packets=0)
    assert parse_hostport("[::1]:443") == ("::1", 443)
    with pytest.raises(ValueError):
        parse_hostport("nohost")


async def test_quic_handshake_through_lossy_delayed_link(tmp_path: Path) -> None:
    issued = make_certificates(tmp_path, "server")
    settings = TransportConfig(max_datagram_size=DATAGRAM_SIZE_ETHERNET)
    server_tls = TlsConfig(cert_file=issued.cert, key_file=issued.key)
    server = await serve("127.0.0.1", 0, configuration=server_configuration(settings, server_tls))
    port = server._transport.get_extra_info("sockname")[1]  # type: ignore[union-attr]
    params = LinkParams(delay_ms=10, jitter_ms=2, loss=0.02)
    async with LinkEmulator(EmulatorConfig(listen=("127.0.0.1", 0), target=("127.0.0.1", port),
                                           upstream=params, downstream=params, seed=3)) as emu:
        host, eport = emu.listen_address
        client_cfg = client_configuration(settings, TlsConfig(ca_file=issued.ca), "localhost")
        t0 = time.monotonic()
        async with connect(host, eport, configuration=client_cfg) as client:
            assert isinstance(client, QuicConnectionProtocol)
            await asyncio.wait_for(client.ping(), 10)
            elapsed = time.monotonic() - t0
    server.close()
    # Handshake plus a ping need at least two round trips of 20 ms.
    assert elapsed >= 0.040
