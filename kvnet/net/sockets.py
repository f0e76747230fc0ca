"""The sockets kvnet opens itself: buffer sizing, a client's UDP socket, a group of UDP server sockets.

Owns: ``apply_socket_buffers`` (SO_RCVBUF/SO_SNDBUF from ``TransportConfig``, any socket), the UDP
sockets of the stacks that leave the socket to kvnet (``kvnet.net.stack.UdpStack``): one bound client
socket per connection, and ``count`` server sockets sharing one port with ``SO_REUSEPORT``; and the same
group of listening TCP sockets for the QMux stack (``tcp_server_sockets``).
"""

from __future__ import annotations

import logging
import socket

from kvnet.net.config import TransportConfig

logger = logging.getLogger(__name__)


def apply_socket_buffers(
    transport_socket: socket.socket | None, settings: TransportConfig
) -> tuple[int, int] | None:
    """Set SO_RCVBUF/SO_SNDBUF and return the sizes in effect (getsockopt: the kernel doubles what it
    grants). Unprivileged processes are capped at net.core.{r,w}mem_max, so try the FORCE variants
    (CAP_NET_ADMIN) first and fall back to the capped ones, logging once when we got less than asked."""
    if transport_socket is None:
        return None
    pairs = (
        (settings.socket_receive_buffer, getattr(socket, "SO_RCVBUFFORCE", None), socket.SO_RCVBUF),
        (settings.socket_send_buffer, getattr(socket, "SO_SNDBUFFORCE", None), socket.SO_SNDBUF),
    )
    for size, force_opt, opt in pairs:
        if size <= 0:
            continue
        try:
            if force_opt is None:
                raise PermissionError
            transport_socket.setsockopt(socket.SOL_SOCKET, force_opt, size)
        except (PermissionError, OSError):
            try:
                transport_socket.setsockopt(socket.SOL_SOCKET, opt, size)
            except OSError as exc:
                logger.warning("could not set socket buffer %d: %s", size, exc)
            # Linux reports double the size it granted (the bookkeeping overhead).
            granted = transport_socket.getsockopt(socket.SOL_SOCKET, opt) // 2
            if granted < size:
                logger.info(
                    "socket buffer %s: asked %d bytes, got %d (raise net.core.%s_max or run with "
                    "CAP_NET_ADMIN)", "SO_RCVBUF" if opt == socket.SO_RCVBUF else "SO_SNDBUF", size, granted,
                    "rmem" if opt == socket.SO_RCVBUF else "wmem",
                )
    return (transport_socket.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF),
            transport_socket.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF))


def udp_client_socket(settings: TransportConfig, family: int, local_host: str | None) -> socket.socket:
    """The bound UDP socket a client connection sends from (on ``local_host``, else the wildcard
    address)."""
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        wildcard = "::" if family == socket.AF_INET6 else "0.0.0.0"
        sock.bind((local_host or wildcard, 0))
        apply_socket_buffers(sock, settings)
    except BaseException:
        sock.close()
        raise
    return sock


def udp_server_sockets(host: str, port: int, count: int, settings: TransportConfig) -> list[socket.socket]:
    """``count`` UDP sockets bound to one ``host:port`` (port 0: the first chooses, the rest join it), for
    servers in separate processes (``relay.workers``). With more than one, each has ``SO_REUSEPORT``: the
    kernel hashes a datagram's 4-tuple to one socket of the group, so a QUIC connection stays with one
    process as long as the group does not change."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(family, socket.SOCK_DGRAM)
            sockets.append(sock)
            if count > 1:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
            port = sock.getsockname()[1]
            apply_socket_buffers(sock, settings)
            sock.setblocking(False)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def tcp_server_sockets(host: str, port: int, count: int, settings: TransportConfig) -> list[socket.socket]:
    """``count`` listening TCP sockets bound to one ``host:port`` (port 0: the first chooses, the rest join
    it), for servers in separate processes (``relay.workers``). With more than one, each has
    ``SO_REUSEPORT``: the kernel spreads new connections over the group, and a connection stays with the
    process that accepted it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if count > 1:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
            port = sock.getsockname()[1]
            apply_socket_buffers(sock, settings)
            sock.listen(1024)
            sock.setblocking(False)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets
