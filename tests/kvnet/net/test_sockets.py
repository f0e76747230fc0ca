"""Tests for kvnet.net.sockets: socket buffer sizing with and without privileges."""

from __future__ import annotations

import socket

from kvnet.net.config import (
    TransportConfig,
)
from kvnet.net.sockets import apply_socket_buffers


class _UnprivilegedSocket:
    """A UDP socket on which the FORCE options fail as they do without CAP_NET_ADMIN."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)

    def setsockopt(self, level: int, opt: int, value: int) -> None:
        if opt in (getattr(socket, "SO_RCVBUFFORCE", -1), getattr(socket, "SO_SNDBUFFORCE", -1)):
            raise PermissionError("operation not permitted")
        self.sock.setsockopt(level, opt, value)

    def getsockopt(self, level: int, opt: int) -> int:
        return int(self.sock.getsockopt(level, opt))


def test_socket_buffers_report_what_the_kernel_applied() -> None:
    settings = TransportConfig(socket_receive_buffer=1 << 20, socket_send_buffer=1 << 20)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        applied = apply_socket_buffers(sock, settings)
        assert applied == (sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF),
                           sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF))
    fake = _UnprivilegedSocket()
    try:
        # Without privileges the plain options still apply, capped by the kernel (which doubles them).
        rcv, snd = apply_socket_buffers(fake, settings)  # type: ignore[arg-type, misc]
        assert rcv >= min(1 << 20, 212992) and snd >= min(1 << 20, 212992)
    finally:
        fake.sock.close()
