"""Errors the MoQT connection glue raises to role code (relay, nodes).

Owns the exception classes only; ``kvnet.net.connection`` and ``kvnet.net.handles`` raise them.
"""

from __future__ import annotations

from proto.errors import RequestErrorCode


class MoqtConnectionError(Exception):
    """The connection could not be established or is gone."""


class ConnectionClosed(MoqtConnectionError):
    """The session ended while a request was outstanding."""

    def __init__(self, error_code: int, reason: str) -> None:
        super().__init__(f"MoQT session closed (code {error_code:#x}): {reason}")
        self.error_code = error_code
        self.reason = reason


class RequestRejected(Exception):
    """The peer answered a request with REQUEST_ERROR."""

    def __init__(self, code: int, reason: str, retry_interval: int = 0) -> None:
        name = RequestErrorCode(code).name if code in RequestErrorCode._value2member_map_ else hex(code)
        super().__init__(f"request rejected: {name}: {reason}")
        self.code = code
        self.reason = reason
        self.retry_interval = retry_interval


class StreamResetError(Exception):
    """A data stream of a request (fetch stream, subgroup) ended before its FIN: reset by the peer, or
    abandoned by us (``reason`` says why, e.g. an object over a size limit)."""

    def __init__(self, code: int, reason: str = "") -> None:
        why = f"data stream abandoned: {reason}" if reason else "data stream reset by peer"
        super().__init__(f"{why} (code {code:#x})")
        self.code = code
        self.reason = reason


class LimitError(Exception):
    """A per-connection limit was reached (buffered bytes of a request)."""
