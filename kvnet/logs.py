"""One log format for every kvnet process: logfmt-style ``key=value`` lines or JSON, on stderr.

Owns the two formatters, ``setup_logging`` and the flags that choose them (``add_log_arguments``); the
relay, the node commands (and the node's HTTP access log, which uvicorn writes through the same root
handler), the ``kvnet`` tools and the namespace cluster runner all log through it, chosen by
``--log-format`` / ``--log-level`` or, for every command alike, ``KVNET_LOG_FORMAT`` / ``KVNET_LOG_LEVEL``.
Imports only the standard library, so any tool may use it.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any

LOG_FORMATS = ("kv", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_SETTINGS_ENV = {"log_format": "KVNET_LOG_FORMAT", "log_level": "KVNET_LOG_LEVEL"}
"""Environment names of the log settings shared by every command (a command's own prefix still wins)."""

# LogRecord attributes that are not user-supplied ``extra`` fields (uvicorn adds a colored copy of its
# message for its own terminal formatter).
_RESERVED = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message", "asctime", "color_message",
}
ACCESS_LOGGER = "uvicorn.access"
"""The HTTP access log of ``kvnet-node`` (uvicorn's), one line per request."""


def _kv_value(v: object) -> str:
    s = str(v)
    if s == "" or any(c in s for c in ' "=\n'):
        return json.dumps(s)
    return s


class KeyValueFormatter(logging.Formatter):
    """logfmt-style lines: ``ts=... level=info logger=relay.relay msg="..." key=value``."""

    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields.update({k: v for k, v in record.__dict__.items() if k not in _RESERVED})
        if record.exc_info:
            fields["exc"] = self.formatException(record.exc_info)
        return " ".join(f"{k}={_kv_value(v)}" for k, v in fields.items())


class JsonFormatter(logging.Formatter):
    """One JSON object per line with the same fields as ``KeyValueFormatter``."""

    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] = {
            "ts": record.created,
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields.update({k: v for k, v in record.__dict__.items() if k not in _RESERVED})
        if record.exc_info:
            fields["exc"] = self.formatException(record.exc_info)
        return json.dumps(fields, default=str)


class AccessLogFields(logging.Filter):
    """Turns uvicorn's access line (``'%s - "%s %s HTTP/%s" %d'``) into fields: ``msg="POST
    /v1/completions 200" client=127.0.0.1:5123 method=POST path=/v1/completions status=200``, easy to
    filter on in either format."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) == 5:
            client, method, path, _http_version, status = args
            record.msg, record.args = "%s %s %s", (method, path, status)
            record.__dict__.update(client=client, method=method, path=path, status=status)
        return True


def setup_logging(log_format: str, level: str) -> None:
    """Route every logger to stderr in ``log_format`` (``kv`` or ``json``) at ``level``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    access = logging.getLogger(ACCESS_LOGGER)
    if not any(isinstance(f, AccessLogFields) for f in access.filters):
        access.addFilter(AccessLogFields())
    # The QUIC stacks log packet-level events and every peer close; keep them quiet unless asked for.
    logging.getLogger("quic").setLevel(logging.ERROR if level != "debug" else logging.DEBUG)


def add_log_arguments(parser: argparse.ArgumentParser) -> None:
    """``--log-format``, ``--log-level`` and ``-v``, the same on every command."""
    parser.add_argument(
        "--log-format", choices=LOG_FORMATS, default="kv",
        help="log lines on stderr: logfmt (kv) or JSON (env KVNET_LOG_FORMAT for every command)",
    )
    parser.add_argument(
        "--log-level", choices=LOG_LEVELS, default="info",
        help="least severe level logged (env KVNET_LOG_LEVEL for every command)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging (--log-level debug)")


def setup_logging_from_args(args: argparse.Namespace) -> None:
    """``setup_logging`` from ``add_log_arguments``' flags (``-v`` is ``--log-level debug``)."""
    setup_logging(args.log_format, "debug" if args.verbose else args.log_level)
