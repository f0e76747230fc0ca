"""UDP segmentation offload (GSO) for the datagrams one QUIC transmit produces, and receive offload (GRO)
with batched reads for a client's socket.

A stack's ``transmit()`` hands the transport one ``sendto`` per datagram: at 1452-byte datagrams that is
~700 system calls per MB, each a Python call into asyncio's transport. Linux (4.18+) takes a run of
equal-sized datagrams to one address as one buffer with a ``UDP_SEGMENT`` control message and cuts it
into datagrams below the socket layer (on loopback and most NICs in hardware or at the last moment), so
a transmit of N datagrams costs N / 44 ``sendmsg`` calls at 1452 bytes and the datagrams on the wire are
unchanged. Used where the kernel supports it; anything else (no support, a full socket buffer, an error)
goes through the transport's ``sendto`` as before, which also keeps the datagrams in order.

Receiving, asyncio's datagram transport reads one datagram per readiness callback of the event loop. A
``DatagramReceiver`` takes over a client socket's reading instead: it turns on ``UDP_GRO`` (the kernel
may then hand over a run of equal-sized datagrams from one sender as one buffer, with the segment size
in a control message) and reads until the socket is empty or ``READS_PER_WAKEUP`` reads are done,
passing each datagram, cut at the segment size, to the protocol's ``datagram_received`` as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import struct
import weakref
from collections.abc import Iterable
from typing import Any

logger = logging.getLogger(__name__)

# linux/udp.h; Python 3.11's socket module has neither name.
SOL_UDP = getattr(socket, "SOL_UDP", 17)
UDP_SEGMENT = getattr(socket, "UDP_SEGMENT", 103)
UDP_GRO = getattr(socket, "UDP_GRO", 104)
# The kernel's limits on one GSO send: 64 segments (UDP_MAX_SEGMENTS) and one IP packet's 64 KiB.
MAX_SEGMENTS = 64
MAX_GSO_BYTES = 65535 - 8 - 40
RECEIVE_BUFFER_BYTES = 65535
"""One read's buffer: the largest UDP payload, and the most GRO coalesces into one buffer."""
READS_PER_WAKEUP = 64
"""Reads per readiness callback at most, so that a flooded socket does not starve timers and other
connections of the event loop."""
_GRO_CMSG_SPACE = socket.CMSG_SPACE(4)  # the segment size, a C int


_senders: weakref.WeakKeyDictionary[Any, DatagramSender] = weakref.WeakKeyDictionary()


def sender_for(transport: Any) -> DatagramSender:
    """The one ``DatagramSender`` of a datagram transport, shared by every connection on it (a server's
    sessions share its socket, so they share one duplicate of it, closed with the transport)."""
    sender = _senders.get(transport)
    if sender is None:
        sender = _senders[transport] = DatagramSender(transport)
    return sender


class DatagramSender:
    """Sends the (data, address) pairs of one transmit, batching runs of equal-sized datagrams to one
    address with GSO. Owns a duplicate of the transport's socket (asyncio does not lend its own for
    ``sendmsg``), closed by ``close`` or when the transport is closing or collected."""

    def __init__(self, transport: Any) -> None:
        self._transport = weakref.proxy(transport)  # the registry above must not keep transports alive
        self._socket: socket.socket | None = None
        self.batched_sends = 0
        """``sendmsg`` calls that carried more than one datagram."""
        sock = transport.get_extra_info("socket")
        if sock is None or sock.type != socket.SOCK_DGRAM:
            return
        try:
            dup = socket.socket(sock.family, sock.type, sock.proto, fileno=os.dup(sock.fileno()))
        except OSError:
            return
        try:  # probe: kernels without UDP GSO refuse the option
            dup.setsockopt(SOL_UDP, UDP_SEGMENT, 0)
        except OSError:
            dup.close()
            return
        dup.setblocking(False)
        self._socket = dup
        weakref.finalize(transport, dup.close)

    @property
    def enabled(self) -> bool:
        return self._socket is not None

    def send(self, datagrams: Iterable[tuple[bytes, Any]]) -> None:
        if self._socket is not None and self._transport.is_closing():
            self.close()
        if self._socket is None:
            for data, addr in datagrams:
                self._transport.sendto(data, addr)
            return
        batch: list[bytes] = []
        batch_addr: Any = None
        segment = total = 0
        for data, addr in datagrams:
            size = len(data)
            if batch and (addr != batch_addr or size > segment or len(batch) >= MAX_SEGMENTS
                          or total + size > MAX_GSO_BYTES or len(batch[-1]) < segment):
                self._flush(batch, batch_addr, segment)
                batch = []
            if not batch:
                batch_addr, segment, total = addr, size, 0
            batch.append(data)
            total += size
        if batch:
            self._flush(batch, batch_addr, segment)

    def _flush(self, batch: list[bytes], addr: Any, segment: int) -> None:
        # Anything the transport still queues must go first; a single datagram gains nothing from GSO.
        if self._socket is not None and len(batch) > 1 and not self._transport.get_write_buffer_size():
            try:
                self._socket.sendmsg(batch, [(SOL_UDP, UDP_SEGMENT, struct.pack("=H", segment))], 0, addr)
            except BlockingIOError:
                pass  # the socket buffer is full: the transport queues these and waits for room
            except OSError as exc:
                # EIO: the route's device cannot segment; others: we will not try again on this socket.
                logger.info("UDP GSO off for this connection: %s", errno.errorcode.get(exc.errno or 0, exc))
                self.close()
            else:
                self.batched_sends += 1
                return
        for data in batch:
            self._transport.sendto(data, addr)

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


class DatagramReceiver:
    """Reads a datagram transport's socket in batches with GRO, as the transport's own reader.

    The transport keeps its reader registration, so ``pause_reading`` / ``resume_reading`` and ``close``
    work as before; only what a wakeup does changes. Reads go through a duplicate of the socket (asyncio
    does not lend its own), closed by ``close`` or when the transport is collected. ``install`` returns
    None where the transport is not one it knows how to take over, which then keeps reading itself.
    """

    def __init__(self, transport: Any, protocol: Any, sock: socket.socket) -> None:
        self._transport = weakref.proxy(transport)
        self._protocol = protocol
        self._socket: socket.socket | None = sock
        self.coalesced_reads = 0
        """Reads that carried more than one datagram (cut at the segment size GRO reported)."""
        self.datagrams = 0
        self._transport_read: Any = None
        """The transport's own one-datagram read, for wakeups after ``close``."""

    @classmethod
    def install(cls, transport: asyncio.DatagramTransport, protocol: Any) -> DatagramReceiver | None:
        sock = transport.get_extra_info("socket")
        loop = asyncio.get_running_loop()
        # asyncio's selector transports read in ``_read_ready``, registered with the loop under the
        # socket's descriptor; the public remove_reader refuses a transport's descriptor.
        reregister = (getattr(loop, "_remove_reader", None), getattr(loop, "_add_reader", None))
        if (sock is None or sock.type != socket.SOCK_DGRAM or None in reregister
                or not hasattr(transport, "_read_ready") or not hasattr(transport, "is_reading")):
            return None
        try:
            dup = socket.socket(sock.family, sock.type, sock.proto, fileno=os.dup(sock.fileno()))
        except OSError:
            return None
        with contextlib.suppress(OSError):  # no GRO here: batched reads alone still save wakeups
            dup.setsockopt(SOL_UDP, UDP_GRO, 1)
        dup.setblocking(False)
        receiver = cls(transport, protocol, dup)
        receiver._transport_read = transport._read_ready
        transport._read_ready = receiver._read  # what resume_reading registers
        if transport.is_reading():
            remove, add = reregister
            remove(sock.fileno())  # type: ignore[misc]
            add(sock.fileno(), receiver._read)  # type: ignore[misc]
        _receivers[transport] = receiver
        weakref.finalize(transport, receiver.close)
        return receiver

    def _read(self) -> None:
        sock = self._socket
        if sock is None:
            self._transport_read()
            return
        transport = self._transport
        protocol = self._protocol
        for _ in range(READS_PER_WAKEUP):
            try:
                if not transport.is_reading():  # paused (or closing) by the protocol meanwhile
                    return
                data, ancdata, _flags, addr = sock.recvmsg(RECEIVE_BUFFER_BYTES, _GRO_CMSG_SPACE)
            except (BlockingIOError, InterruptedError, ReferenceError):
                return
            except OSError as exc:
                protocol.error_received(exc)
                return
            segment = len(data)
            for level, kind, value in ancdata:
                if level == SOL_UDP and kind == UDP_GRO and len(value) >= 4:
                    segment = struct.unpack("=i", value[:4])[0]
            if 0 < segment < len(data):
                self.coalesced_reads += 1
                for start in range(0, len(data), segment):
                    self.datagrams += 1
                    protocol.datagram_received(data[start:start + segment], addr)
            else:
                self.datagrams += 1
                protocol.datagram_received(data, addr)
            if self._socket is None:  # closed meanwhile
                return

    def close(self) -> None:
        """Close the duplicate socket; the transport's reader (ours) then reads nothing more."""
        sock, self._socket = self._socket, None
        if sock is not None:
            sock.close()


_receivers: weakref.WeakKeyDictionary[Any, DatagramReceiver] = weakref.WeakKeyDictionary()


def receiver_for(transport: Any) -> DatagramReceiver | None:
    """The ``DatagramReceiver`` reading a transport's socket, or None if the transport reads itself."""
    return _receivers.get(transport)


def release(transport: Any) -> None:
    """Close the duplicate sockets of a transport that is going away (its ``DatagramSender`` and
    ``DatagramReceiver``, if it has them), which would otherwise keep the port open until the transport
    is collected."""
    receiver = _receivers.pop(transport, None)
    if receiver is not None:
        receiver.close()
    sender = _senders.pop(transport, None)
    if sender is not None:
        sender.close()
