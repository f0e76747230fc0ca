"""Opening MoQT connections: ``connect`` to a relay, ``serve`` as one, and process start-up tuning.

Owns: resolving a peer URL (``kvnet.net.url``) and opening the client endpoint on the stack it and
``TransportConfig.stack`` pick (``kvnet.net.registry.stack_for``), completing the handshake and the MoQT
SETUP exchange (``connect``); the listening endpoint that runs one task per connection and shuts down
with GOAWAY and a drain (``serve``, ``MoqtServer``). What differs between stacks is their
``kvnet.net.stack.Stack``'s ``open_client`` and ``listen``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import socket
from collections.abc import Awaitable, Callable, Generator
from types import TracebackType
from typing import Any

from kvnet.net.config import TlsConfig, TransportConfig
from kvnet.net.connection import MoqtConnection, protocol_class
from kvnet.net.errors import ConnectionClosed, MoqtConnectionError
from kvnet.net.limits import ConnectionLimits
from kvnet.net.registry import get_stack, stack_for
from kvnet.net.url import parse_moqt_url
from proto.errors import SessionErrorCode
from proto.session import SessionConfig

logger = logging.getLogger(__name__)


class _Connector:
    """``conn = await connect(...)`` or ``async with connect(...) as conn``."""

    def __init__(self, coro: Callable[[], Awaitable[MoqtConnection]]) -> None:
        self._coro = coro
        self._conn: MoqtConnection | None = None

    def __await__(self) -> Generator[Any, None, MoqtConnection]:
        return self._coro().__await__()

    async def __aenter__(self) -> MoqtConnection:
        self._conn = await self._coro()
        return self._conn

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._conn is not None:
            await self._conn.close_session()


def freeze_startup_objects() -> None:
    """Put every object alive now out of the cyclic garbage collector's reach (``gc.freeze``).

    A role process calls this once it has started (imports, model, configuration) and before it serves.
    torch alone leaves ~185k objects that every full collection traverses (~80 ms here), and collections
    run on the event loop, stalling every session of the process; a subscriber spent 3 ms of each 64-probe
    locate in collections before (313 ms over 100 locates), 0.3 ms after. Objects made later (sessions,
    cached blocks) are collected as usual.
    """
    gc.collect()
    gc.freeze()


def connect(
    url: str,
    settings: TransportConfig | None = None,
    tls: TlsConfig | None = None,
    session_config: SessionConfig | None = None,
    limits: ConnectionLimits | None = None,
    local_host: str | None = None,
) -> _Connector:
    """Connect to ``moqt://host:port[/path]`` (QUIC, on ``settings.stack``) or ``moqt+qmux://host:port[/path]``
    (QMux over TLS/TCP), complete the transport's handshake and the MoQT SETUP exchange.

    ``local_host`` binds the client socket to that source address (the wildcard address by default)."""
    settings = settings or TransportConfig()
    tls = tls or TlsConfig()
    limits = limits or ConnectionLimits()
    target = parse_moqt_url(url)

    async def run() -> MoqtConnection:
        loop = asyncio.get_running_loop()
        stack = stack_for(target, settings)
        config = stack.client_configuration(settings, tls, server_name=target.host)
        infos = await loop.getaddrinfo(target.host, target.port, type=stack.socket_type)
        if not infos:
            raise MoqtConnectionError(f"cannot resolve {target.host}")
        family, _, _, _, addr = infos[0]
        scfg = session_config or SessionConfig(
            is_client=True, path=target.path or None, authority=f"{target.host}:{target.port}"
        )
        transport, protocol = await stack.open_client(
            settings, config, family, local_host,
            lambda quic_connection: protocol_class(stack.name)(
                quic_connection, session_config=scfg, settings=settings, limits=limits,
            ),
        )
        conn: MoqtConnection = protocol
        # A socket made for this connection is closed with it; a stack that binds its own stops it.
        conn.owns_transport = not stack.binds_own_socket
        handshake = "QUIC/TLS handshake" if stack.socket_type == socket.SOCK_DGRAM else "TCP/TLS handshake"
        try:
            conn.connect(addr)
            try:
                async with asyncio.timeout(settings.handshake_timeout):
                    await conn.wait_connected()
            except ConnectionError as exc:
                reason = str(exc)
                if conn.session.closed:
                    code, phrase = conn.session.closed
                    reason = phrase or f"closed with error {code:#x}"
                raise MoqtConnectionError(f"{handshake} with {url} failed: {reason}") from exc
            except TimeoutError as exc:
                raise MoqtConnectionError(f"{handshake} with {url} timed out") from exc
            try:
                await conn.wait_setup()
            except TimeoutError as exc:
                raise MoqtConnectionError(f"no MoQT SETUP from {url}") from exc
            except ConnectionClosed as exc:
                raise MoqtConnectionError(f"MoQT setup with {url} failed: {exc}") from exc
        except BaseException:
            conn.close()
            transport.close()
            raise
        return conn

    return _Connector(run)


class MoqtServer:
    """A listening endpoint; each connection gets its own task running ``on_connection``."""

    def __init__(
        self, quic_server: Any, tasks: set[asyncio.Task[None]], connections: set[MoqtConnection],
        address: tuple[str, int],
    ) -> None:
        self._server = quic_server
        self._address = address
        self._tasks = tasks
        self.connections = connections
        """Connections whose SETUP completed and whose handler is running."""

    @property
    def address(self) -> tuple[str, int]:
        return self._address

    async def shutdown(self, new_session_uri: str = "", drain_timeout: float = 5.0) -> None:
        """GOAWAY to every session, wait up to ``drain_timeout`` for them to end, then close everything."""
        for conn in list(self.connections):
            with contextlib.suppress(Exception):
                await conn.goaway_peer(new_session_uri, int(drain_timeout * 1000))
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=drain_timeout)
        await self.close()

    async def close(self) -> None:
        for conn in list(self.connections):
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2):
                    await conn.close_session(SessionErrorCode.NO_ERROR, "server closing")
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._server.close()


async def serve(
    host: str,
    port: int,
    settings: TransportConfig,
    tls: TlsConfig,
    on_connection: Callable[[MoqtConnection], Awaitable[None]],
    session_config: SessionConfig | None = None,
    limits: ConnectionLimits | None = None,
    max_connections: int = 1024,
    sock: socket.socket | None = None,
    stack: str | None = None,
) -> MoqtServer:
    """Listen on host:port (or on ``sock``, bound beforehand by ``kvnet.net.registry.server_sockets``).
    After SETUP completes, ``on_connection(conn)`` runs in its own task; when it returns (or raises,
    which is logged) the session is closed. Beyond ``max_connections`` live sessions new ones are closed
    with EXCESSIVE_LOAD. ``stack`` picks the transport stack (``kvnet.net.registry``: "qmux" serves
    ``moqt+qmux://``), by default ``settings.stack``, the QUIC one."""
    transport_stack = get_stack(stack or settings.stack)
    config = transport_stack.server_configuration(settings, tls)
    cls = protocol_class(transport_stack.name)
    scfg = session_config or SessionConfig(is_client=False)
    ca = str(tls.ca_file) if tls.require_client_cert and tls.ca_file is not None else None
    tasks: set[asyncio.Task[None]] = set()
    live: set[MoqtConnection] = set()

    async def run(conn: MoqtConnection) -> None:
        try:
            await conn.wait_setup()
        except (TimeoutError, ConnectionClosed) as exc:
            logger.info("session setup failed: %s", exc)
            conn.close()
            return
        if len(live) >= max_connections:
            # The session registry has no load code; INTERNAL_ERROR with a reason is the closest.
            await conn.close_session(SessionErrorCode.INTERNAL_ERROR, "too many sessions")
            return
        live.add(conn)
        try:
            await on_connection(conn)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("connection handler failed")
            if not conn.is_closed:
                conn.run_action(conn.session.close, SessionErrorCode.INTERNAL_ERROR, "internal error")
        finally:
            live.discard(conn)
            if not conn.is_closed:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(2):
                        await conn.close_session()

    def create_protocol(quic_connection: Any, stream_handler: Any = None) -> MoqtConnection:
        conn = cls(
            quic_connection,
            stream_handler,
            session_config=scfg,
            settings=settings,
            limits=limits,
            client_ca_file=ca,
        )
        task = asyncio.get_running_loop().create_task(run(conn))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return conn

    server, address = await transport_stack.listen(
        host, port, settings, config, create_protocol, sock=sock, max_connections=max_connections
    )
    return MoqtServer(server, tasks, live, address)
