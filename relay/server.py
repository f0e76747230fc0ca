"""The relay's life as a server: listening (QUIC, and QMux beside it), the accept loop into one ``Relay``,
the metrics endpoint, and shutdown (GOAWAY, drain, close); and ``run``, a process's whole life around it.

Owns: ``serve`` and ``run``. What a session does once accepted is ``relay.relay.Relay``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
import time
from collections.abc import Callable, Coroutine

from kvnet.net.endpoint import freeze_startup_objects
from kvnet.net.endpoint import serve as serve_moqt
from kvnet.net.sockets import tcp_server_sockets
from kvnet.net.url import QMUX
from kvnet.security.signing import SigningError
from proto.session import SessionConfig
from relay.auth import AUTH_TOKEN_CACHE_SIZE
from relay.config import RelayConfig, startup_reason
from relay.metrics import Metrics, MetricsServer
from relay.relay import Relay

logger = logging.getLogger(__name__)


def run(config: RelayConfig, serving: Coroutine[object, object, None], name: str = "") -> int:
    """Run ``serving`` (``serve`` of ``config``, as a process's whole life) to its end; the exit code.
    What it raises comes from starting (reading key, token and cache files, binding the QUIC and metrics
    sockets): one line naming the flag, exit 2. Once it serves, a peer's failure ends that peer's session,
    not the relay. ``name`` prefixes the line (a worker of ``relay.workers``)."""
    freeze_startup_objects()
    try:
        asyncio.run(serving)
    except KeyboardInterrupt:
        return 130
    except (OSError, ValueError, SigningError) as exc:
        prefix = f"{name}: " if name else ""
        print(f"kvnet-relay: error: {prefix}{startup_reason(exc, config)}", file=sys.stderr)
        return 2
    return 0


async def serve(
    config: RelayConfig,
    stop: asyncio.Event | None = None,
    sock: socket.socket | None = None,
    on_listening: Callable[[tuple[str, int], int | None], None] | None = None,
    metrics: Metrics | None = None,
    qmux_sock: socket.socket | None = None,
    signals: bool = True,
) -> None:
    """Run a relay until SIGTERM/SIGINT (or ``stop``), then GOAWAY, drain and close. ``signals``: whether
    SIGTERM/SIGINT stop it (a process's relay; not one sharing its event loop with others). ``sock``: serve on
    that bound UDP socket instead of binding ``config``'s address (a worker of ``relay.workers``), and
    ``qmux_sock`` the same for the QMux listener (``config.qmux_host``), which serves beside QUIC into the
    same ``Relay`` (one cache, one set of limits and metrics); ``on_listening(quic address, metrics port)``
    is called once it serves; ``metrics``: the relay's (with families its caller added), else a new one."""
    metrics = metrics or Metrics()
    relay = Relay(config, metrics)
    session_cfg = SessionConfig(
        is_client=False,
        max_auth_token_cache_size=AUTH_TOKEN_CACHE_SIZE if config.auth_issuer_keys else None,
        max_requests_in_flight=config.limits.max_requests_per_session,
        max_object_size=config.limits.max_object_bytes,
        request_header_timeout=config.limits.request_header_timeout or None,
        max_request_header_timeouts=config.limits.max_request_header_timeouts,
    )
    server = await serve_moqt(
        config.host,
        config.port,
        config.transport,
        config.tls,
        relay.on_connection,
        session_config=session_cfg,
        limits=relay.connection_limits(),
        # The relay enforces max_sessions itself so refusals are counted and logged.
        max_connections=1 << 30,
        sock=sock,
    )
    qmux_server = None
    if config.qmux_host is not None:
        if qmux_sock is None:
            try:
                (qmux_sock,) = tcp_server_sockets(config.qmux_host, config.qmux_port, 1, config.transport)
            except OSError as exc:
                await server.close()
                where = f"--listen-qmux {config.qmux_host}:{config.qmux_port}"
                raise ValueError(f"{where}: cannot listen: {exc.strerror}") from exc
        qmux_server = await serve_moqt(
            config.qmux_host, config.qmux_port, config.transport, config.tls, relay.on_connection,
            session_config=session_cfg, limits=relay.connection_limits(), max_connections=1 << 30,
            sock=qmux_sock, stack=QMUX,
        )
    metrics_server: MetricsServer | None = None
    if config.metrics_port is not None:
        metrics_server = MetricsServer(metrics, config.metrics_host, config.metrics_port)
        await metrics_server.start()
    for up in relay.upstreams:
        up.start()
    watchdog = asyncio.get_running_loop().create_task(relay.pressure.watch())
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT) if signals else ():
        with contextlib.suppress(RuntimeError, ValueError):  # not in the main thread
            loop.add_signal_handler(sig, stop.set)
    host, port = server.address
    logger.info(
        "listening",
        extra={
            "quic": f"{host}:{port}",
            "qmux": "off" if qmux_server is None else "{}:{}".format(*qmux_server.address),
            "metrics": f"{config.metrics_host}:{metrics_server.port}" if metrics_server else "off",
            "upstreams": ",".join(config.upstreams) or "none",
            "cache_bytes": config.cache.max_bytes,
        },
    )
    if on_listening is not None:
        on_listening((host, port), metrics_server.port if metrics_server else None)
    await stop.wait()
    started = time.monotonic()
    logger.info(
        "shutting down: GOAWAY to all sessions",
        extra={"sessions": len(relay.peers), "drain_timeout": config.drain_timeout},
    )
    relay.going_away = True
    await asyncio.gather(
        server.shutdown(config.goaway_uri, config.drain_timeout),
        *([] if qmux_server is None else [qmux_server.shutdown(config.goaway_uri, config.drain_timeout)]),
    )
    watchdog.cancel()
    await relay.close()
    if metrics_server is not None:
        await metrics_server.close()
    logger.info("stopped", extra={"drain_seconds": round(time.monotonic() - started, 3)})
