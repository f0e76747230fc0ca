"""UDP segmentation offload (GSO) for the datagrams one QUIC transmit produces.

A stack's ``transmit()`` hands the transport one ``sendto`` per datagram: at 1452-byte datagrams that is
~700 system calls per MB, each a Python call into asyncio's transport. Linux (4.18+) takes a run of
equal-sized datagrams to one address as one buffer with a ``UDP_SEGMENT`` control message and cuts it
into datagrams below the socket layer (on loopback and most NICs in hardware or at the last moment), so
a transmit of N datagrams costs N / 44 ``sendmsg`` calls at 1452 bytes and the datagrams on the wire are
unchanged. Used where the kernel supports it; anything else (no support, a full socket buffer, an error)
goes through the transport's ``sendto`` as before, which also keeps the datagrams in order.
"""

from __future__ import annotations

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
# The kernel's limits on one GSO send: 64 segments (UDP_MAX_SEGMENTS) and one IP packet's 64 KiB.
MAX_SEGMENTS = 64
MAX_GSO_BYTES = 65535 - 8 - 40


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
