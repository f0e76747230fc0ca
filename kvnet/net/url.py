"""Where a MoQT peer is: ``moqt://HOST[:PORT][/PATH]`` URLs and the transport each scheme names.

Owns: parsing and checking a peer URL (``parse_moqt_url``) into ``MoqtUrl`` and the table of accepted
schemes (``SCHEMES``). The scheme picks the transport family: ``moqt://`` is MoQT over QUIC, on the stack
``TransportConfig.stack`` names; another family (a byte-stream transport) is one more row of
``SCHEMES`` plus its stack module in ``kvnet.net.registry``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

DEFAULT_PORT = 4443
QUIC = "quic"
"""The transport family of ``moqt://``: QUIC, on the stack ``TransportConfig.stack`` names."""

QMUX = "qmux"
"""The transport family of ``moqt+qmux://``: MoQT over QMux over TLS 1.3 over TCP
(``kvnet.net.qmux_stack``)."""

SCHEMES: dict[str, str] = {"moqt": QUIC, "moqt+qmux": QMUX}
"""Accepted URL schemes and the transport family each names (``kvnet.net.registry.stack_for``)."""

_MAX_URL = 2048


@dataclass(frozen=True, slots=True)
class MoqtUrl:
    """A parsed peer URL such as ``moqt://host:port[/path]``."""

    host: str
    port: int
    path: str = field(default="")
    transport: str = QUIC
    """The transport family the scheme names (a value of ``SCHEMES``)."""


def parse_moqt_url(url: str) -> MoqtUrl:
    """Parse ``SCHEME://host[:port][/path]`` for a scheme of ``SCHEMES`` (``moqt``, ``moqt+qmux``); IPv6
    hosts in brackets. Port defaults to ``DEFAULT_PORT``. Raises ``ValueError`` with a one-line reason."""
    if len(url) > _MAX_URL:
        raise ValueError("URL too long")
    parts = urlsplit(url)
    transport = SCHEMES.get(parts.scheme)
    if transport is None:
        accepted = " or ".join(f"{scheme}://" for scheme in SCHEMES)
        raise ValueError(f"expected a {accepted} URL, got {url!r}")
    if not parts.hostname:
        raise ValueError(f"URL {url!r} has no host")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"URL {url!r} has an invalid port") from exc
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"URL {url!r} may not have user info, a query or a fragment")
    return MoqtUrl(
        host=parts.hostname, port=port if port is not None else DEFAULT_PORT, path=parts.path,
        transport=transport,
    )
