"""The stacks kvnet can run MoQT on, by name: the one place a stack name becomes a ``Stack``.

Owns: the table from stack name to the module implementing it (imported on first use, so a process
loads only the stacks it runs), ``get_stack``, ``stack_for`` (the stack a parsed peer URL and the
settings pick), and the entry points role code calls without holding a stack (``client_configuration``,
``server_configuration``, ``server_sockets``). Adding a transport is one module that defines ``STACK``
(a ``kvnet.net.stack.Stack``) and one row here.
"""

from __future__ import annotations

import functools
import importlib
import socket
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from kvnet.net.config import STACKS, TlsConfig, TransportConfig
from kvnet.net.stack import Stack
from kvnet.net.url import QUIC, MoqtUrl

_MODULES: dict[str, Callable[[], ModuleType]] = {
    "aioquic": lambda: importlib.import_module("kvnet.net.aioquic_stack"),
    "qh3": lambda: importlib.import_module("kvnet.net.qh3_stack"),
    "aiopquic": lambda: importlib.import_module("kvnet.net.aiopquic_stack"),
    "qmux": lambda: importlib.import_module("kvnet.net.qmux_stack"),
}
"""Each stack's module, which defines ``STACK``."""

_NEEDS_PYTHON: dict[str, tuple[int, int]] = {"aiopquic": (3, 12)}
_HOW_TO_INSTALL: dict[str, str] = {"aiopquic": "see scripts/setup-py312", "qh3": "pip install qh3"}


@functools.cache
def get_stack(name: str) -> Stack:
    """The stack called ``name`` (one of ``_MODULES``), imported on first use. Raises ``ValueError``
    with a one-line reason for an unknown name or a stack this interpreter cannot load."""
    load = _MODULES.get(name)
    if load is None:
        raise ValueError(
            f"unknown QUIC stack {name!r}; choose from {STACKS} (or qmux, named by moqt+qmux:// URLs)"
        )
    needs = _NEEDS_PYTHON.get(name)
    if needs is not None and sys.version_info < needs:
        raise ValueError(
            f"QUIC stack {name} needs Python >= {needs[0]}.{needs[1]} (this is "
            f"{sys.version_info[0]}.{sys.version_info[1]}); scripts/setup-py312 makes such an environment"
        )
    try:
        module = load()
    except ImportError as exc:
        hint = _HOW_TO_INSTALL.get(name, "install it")
        raise ValueError(f"QUIC stack {name} is not installed ({exc}): {hint}") from exc
    stack: Stack = module.STACK
    return stack


def stack_for(url: MoqtUrl, settings: TransportConfig) -> Stack:
    """The stack a connection to ``url`` runs on: ``settings.stack`` for QUIC (``moqt://``), else the
    stack named by the URL's transport family."""
    return get_stack(settings.stack if url.transport == QUIC else url.transport)


def client_configuration(
    settings: TransportConfig, tls: TlsConfig, server_name: str | None = None
) -> Any:
    """Client configuration for ``settings.stack`` (``Stack.client_configuration``)."""
    return get_stack(settings.stack).client_configuration(settings, tls, server_name)


def server_configuration(settings: TransportConfig, tls: TlsConfig) -> Any:
    """Server configuration for ``settings.stack`` (``Stack.server_configuration``); raises ``ValueError``
    when the stack cannot do what ``tls`` asks."""
    return get_stack(settings.stack).server_configuration(settings, tls)


def server_sockets(host: str, port: int, count: int, settings: TransportConfig) -> list[socket.socket]:
    """``count`` sockets bound to one ``host:port`` for ``settings.stack``'s servers in separate processes
    (``Stack.server_sockets``; refused for a stack that binds its own socket)."""
    return get_stack(settings.stack).server_sockets(host, port, count, settings)
