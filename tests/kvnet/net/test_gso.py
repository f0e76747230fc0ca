"""Tests for kvnet.net.gso: batches of datagrams sent with UDP GSO arrive as the same datagrams, in order,
over real loopback sockets; without GSO the sender falls back to the transport's sendto. A receiver reading
with GRO cuts coalesced reads back into the same datagrams, and a QUIC connection whose client reads that
way moves data unchanged."""

from __future__ import annotations

import asyncio
import select
import socket
from typing import Any

import pytest

from kvnet.net import gso
from tests.helpers.waiting import async_wait_until


class Collect(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.received: list[bytes] = []
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.received.append(data)


async def endpoints() -> tuple[asyncio.DatagramTransport, Collect, Any]:
    loop = asyncio.get_running_loop()
    receiver, collect = await loop.create_datagram_endpoint(Collect, local_addr=("127.0.0.1", 0))
    receiver.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    sender, _ = await loop.create_datagram_endpoint(asyncio.DatagramProtocol, local_addr=("127.0.0.1", 0))
    return sender, collect, receiver.get_extra_info("sockname")


def datagrams(sizes: list[int]) -> list[bytes]:
    return [bytes([i % 256]) * size for i, size in enumerate(sizes)]


@pytest.mark.parametrize(
    "sizes",
    [
        [1452] * 10 + [500],  # a run with a short last datagram: one GSO send
        [1452] * 100,  # more than one send's 64 segments and 64 KiB
        [8952] * 9,  # 8 fit under 64 KiB
        [1200, 1452, 1452, 300, 1452, 1452],  # larger after smaller and short in the middle start new runs
        [16384] * 5,
        [1452],
    ],
)
async def test_datagrams_arrive_unchanged_and_in_order(sizes: list[int]) -> None:
    sender, collect, addr = await endpoints()
    try:
        out = gso.sender_for(sender)
        assert gso.sender_for(sender) is out  # one per transport
        if not out.enabled:
            pytest.skip("this kernel has no UDP GSO")
        sent = datagrams(sizes)
        out.send((d, addr) for d in sent)
        await async_wait_until(lambda: len(collect.received) >= len(sent), "all datagrams received")
        assert collect.received == sent
        assert out.batched_sends >= (1 if len(sizes) > 1 else 0)
    finally:
        sender.close()


async def test_a_closed_sender_sends_through_the_transport() -> None:
    sender, collect, addr = await endpoints()
    out = gso.DatagramSender(sender)
    out.close()
    assert not out.enabled
    out.send([(b"a" * 1300, addr), (b"b" * 1300, addr)])
    await async_wait_until(lambda: len(collect.received) >= 2, "datagrams received")
    assert collect.received == [b"a" * 1300, b"b" * 1300] and out.batched_sends == 0
    sender.close()


@pytest.mark.parametrize("sizes", [[1452] * 200 + [700], [8952] * 30, [1200, 1452, 1452, 300] * 20])
async def test_a_receiver_reading_with_gro_hands_over_the_same_datagrams(sizes: list[int]) -> None:
    sender, collect, addr = await endpoints()
    try:
        out = gso.sender_for(sender)
        if not out.enabled:
            pytest.skip("this kernel has no UDP GSO")
        receiver = gso.DatagramReceiver.install(collect.transport, collect)
        assert receiver is not None
        sent = datagrams(sizes)
        out.send((d, addr) for d in sent)
        await async_wait_until(lambda: len(collect.received) >= len(sent), "all datagrams received")
        assert collect.received == sent
        assert receiver.datagrams == len(sent)
        assert receiver.coalesced_reads >= 1  # loopback hands a GSO send to a GRO socket whole
    finally:
        sender.close()
        collect.transport.close()


async def test_a_paused_transport_is_not_read_until_resumed() -> None:
    """The receiver reads as the transport's own reader: ``pause_reading`` stops it (a slow subscriber's
    socket buffer fills, which is what lets the relay notice it), ``resume_reading`` starts it again."""
    sender, collect, addr = await endpoints()
    try:
        receiver = gso.DatagramReceiver.install(collect.transport, collect)
        assert receiver is not None
        collect.transport.pause_reading()
        sent = datagrams([1000] * 20)
        for d in sent:
            sender.sendto(d, addr)
        sock = collect.transport.get_extra_info("socket")
        await async_wait_until(lambda: select.select([sock], [], [], 0)[0], "datagrams queued in the socket")
        # A marker reaching another socket proves the loop polled while the paused socket was readable:
        # a reader still registered for it would have run in that same poll.
        marker_sender, marker, marker_addr = await endpoints()
        try:
            marker_sender.sendto(b"marker", marker_addr)
            await async_wait_until(lambda: marker.received == [b"marker"], "the marker datagram received")
        finally:
            marker_sender.close()
            marker.transport.close()
        assert collect.received == []
        collect.transport.resume_reading()
        await async_wait_until(lambda: len(collect.received) >= len(sent), "all datagrams received")
        assert collect.received == sent
    finally:
        sender.close()
        collect.transport.close()
