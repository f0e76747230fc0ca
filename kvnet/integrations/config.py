"""The settings of kvnet inside an inference engine, read from the engine's connector configuration.

Owns: ``ConnectorConfig.from_extra_config`` — the ``kv_connector_extra_config`` mapping of vLLM (or any
engine that hands kvnet a dict of plain values) turned into a checked ``NodeConfig`` (relay, TLS, token,
keys, tenant, renditions, timeouts: the same knobs, defaults and key-directory rules as kvnet's node
commands) plus the few settings only an engine connector has. Unknown keys and bad values raise
``ConfigError`` with a one-line message naming the key. Nothing here imports an engine.

Keys (all optional except ``relay`` and ``ca``; the node flag each mirrors in brackets):

=================== =================================================================================
relay               ``moqt://HOST:PORT`` (QUIC) or ``moqt+qmux://HOST:PORT`` (QMux) of the relay [--relay]
ca                  CA certificate (PEM) the relay's certificate must chain to [--ca]
cert, key           client certificate and its key for mTLS [--cert, --key]
token               authorization token file presented in SETUP [--token]
key_dir             keys directory; default ``$KVNET_HOME/keys`` (``~/.kvnet/keys``) [--key-dir]
signing_key         Ed25519 private key signing our manifests; default ``KEY_DIR/publisher.key``,
                    created on first use [--signing-key]
trust               trusted public key file or directory of ``*.pub`` (string or list); default
                    ``KEY_DIR`` [--trust]
trust_any           accept blocks signed by any key (development only) [--trust-any]
node_secret         node secret file from which the tenant's salt and namespace derive [--node-secret]
tenant              tenant this engine computes for [--tenant]
renditions          renditions published, list or comma-separated [--renditions]
accept              renditions accepted when loading [--accept]
payload_digest      ``blake3`` (default) or ``sha256``: the hash of each layer payload in the manifests
                    this engine signs [--payload-digest]
push                PUBLISH computed blocks into the relay's cache (default true) [--no-push]
store_bytes         publisher-side block store budget, bytes or ``512M`` [--store-bytes]
fetch_window        raw bytes requested ahead while fetching [--fetch-window]
fetch_connections   relay sessions one load's blocks are split over, 1 to 16 (default by cores)
                    [--fetch-connections]
fetch_verify_workers
                    threads that check and decode fetched layers while the connector's event
                    loop keeps reading, 0 to 64 or ``auto``
                    (default: every core but two, and at least 1 inside an engine; see
                    ``connector_verify_workers``) [--fetch-verify-workers]
timeout             seconds per locate or fetch before giving up (default 10) [--timeout]
abr                 ``auto`` (default): load the located blocks that beat computing them, by the
                    throughput, round trips and prefill times the engine measured; ``fetch``: load every
                    located block; ``recompute``: load nothing (publish only) [--abr]
assume_throughput   bytes/s the ABR assumes before it measured a load (default 1e8)
                    [--assume-throughput]
fetch_margin        seconds a load may cost beyond computing the blocks it delivered before the rest
                    is given up and computed (``abr: auto``; default 1) [--fetch-margin]
quic_stack          ``aioquic`` or ``qh3`` [--quic-stack]
max_datagram_size   largest UDP payload of the relay session [--max-datagram-size]
locate_deadline     seconds the scheduler waits for a locate before a request proceeds with what is
                    local (default 2)
drain_timeout       seconds a clean shutdown waits for pending pushes (default 10)
publish_backlog_bytes
                    bytes of computed blocks copied out of the engine and not yet encoded, stored and
                    pushed, bytes or ``256M`` (default 256 MiB); a save that would pass it is dropped
                    and counted, never waited for
metrics_dir         directory where each side writes its cumulative counters as JSON
                    (``scheduler.json``, ``worker.json``) whenever they change
=================== =================================================================================
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvnet.config import parse_size
from kvnet.exchange.config import auto_verify_workers
from kvnet.node.config import NodeConfig, default_key_dir, parse_renditions, resolve_keys

DEFAULT_LOCATE_DEADLINE = 2.0
DEFAULT_DRAIN_TIMEOUT = 10.0
DEFAULT_PUBLISH_BACKLOG_BYTES = 256 << 20


def connector_verify_workers(cores: int | None = None) -> int:
    """Verify threads of a connector's fetches by default: ``auto_verify_workers`` (every core but two),
    and at least 1. A node on 2 cores verifies on its event loop, but vLLM pins its CPU worker, the
    connector's threads included, to the model's core, and its engine processes poll for each other while
    a load is pending: a verify thread (its digests and decode copies release the GIL) gets the
    connector a larger share of that core, ~1.2x the goodput inside vLLM on 2 cores (docs/vllm.md, "A
    verify thread inside vLLM")."""
    return max(1, auto_verify_workers(cores))


class ConfigError(ValueError):
    """The connector configuration cannot be used; the message names the key."""


@dataclass(frozen=True)
class ConnectorConfig:
    """``NodeConfig`` for the relay session, keys and renditions, plus the connector's own deadlines."""

    node: NodeConfig
    locate_deadline: float = DEFAULT_LOCATE_DEADLINE
    """Seconds a request waits for its locate before it proceeds with what is local."""
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT
    """Seconds a clean shutdown waits for blocks still being encoded or pushed."""
    metrics_dir: Path | None = None
    """Where the connector keeps its counters as JSON files (none: only the engine's stats)."""
    publish_backlog_bytes: int = DEFAULT_PUBLISH_BACKLOG_BYTES
    """Bytes of block copies waiting to be encoded, stored and pushed; saves beyond it are dropped."""

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, Any], kvnet_home: str | None, *, resolve_key_files: bool = True
    ) -> ConnectorConfig:
        """Check ``extra`` and resolve keys as kvnet's node commands do (``resolve_keys`` with ``key_dir``
        or ``$KVNET_HOME/keys``; ``kvnet_home`` is the caller's reading of the environment). A side that
        neither signs nor verifies passes ``resolve_key_files=False`` and touches no key file."""
        unknown = sorted(set(extra) - _KEYS)
        if unknown:
            raise ConfigError(f"unknown kvnet setting(s) {unknown}; known: {sorted(_KEYS)}")
        fields: dict[str, Any] = {"fetch_verify_workers": connector_verify_workers()}
        for key, value in extra.items():
            if value is None or key in _OWN_KEYS or key in _OTHER_KEYS:
                continue
            name, parse = _NODE_FIELDS[key]
            try:
                fields[name] = parse(value)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"kvnet setting {key!r}: {exc}") from None
        if not extra.get("relay"):
            raise ConfigError("kvnet setting 'relay' is required (moqt://HOST:PORT or moqt+qmux://HOST:PORT)")
        try:
            node = NodeConfig(**fields)
            if resolve_key_files:
                key_dir = _path(extra["key_dir"]) if extra.get("key_dir") else default_key_dir(kvnet_home)
                node = resolve_keys(node, key_dir)
        except (ValueError, OSError) as exc:
            raise ConfigError(f"kvnet settings: {exc}") from None
        own: dict[str, Any] = {
            k: _positive_seconds(k, extra[k]) for k in _OWN_KEYS if extra.get(k) is not None
        }
        if extra.get("metrics_dir") is not None:
            own["metrics_dir"] = _path(extra["metrics_dir"])
        backlog = extra.get("publish_backlog_bytes")
        if backlog is not None:
            own["publish_backlog_bytes"] = _positive_size("publish_backlog_bytes", backlog)
        return cls(node=node, **own)

    def with_node(self, **changes: Any) -> ConnectorConfig:
        return dataclasses.replace(self, node=dataclasses.replace(self.node, **changes))


def _path(value: Any) -> Path:
    if not isinstance(value, str | Path) or not str(value):
        raise ValueError(f"expected a file path, got {value!r}")
    return Path(value)


def _paths(value: Any) -> tuple[Path, ...]:
    items = [value] if isinstance(value, str | Path) else value
    if not isinstance(items, list | tuple):
        raise ValueError(f"expected a path or a list of paths, got {value!r}")
    return tuple(_path(v) for v in items)


def _text(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"expected a non-empty string, got {value!r}")
    return value


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"expected a number, got {value!r}")
    return float(value)


def _integer(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected an integer, got {value!r}")
    return value


def _size(value: Any) -> int:
    return _integer(value) if not isinstance(value, str) else parse_size(value)


def _verify_workers(value: Any) -> int:
    return connector_verify_workers() if value == "auto" else _integer(value)


def _renditions(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return parse_renditions(value)
    if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ValueError(f"expected a list of rendition names, got {value!r}")


def _published_renditions(value: Any) -> tuple[str, ...]:
    renditions = _renditions(value)
    if "kvtc" in renditions:
        # kvtc's tables come from kvnet's own engine (``kvnet kvtc calibrate``) and are bound to its model
        # fingerprint, which a vLLM engine's blocks never share (docs/vllm.md, "kvtc and vLLM").
        raise ValueError("kvtc is not published from inside vLLM: its tables are calibrated with kvnet's own "
                         "engine and bound to that engine's fingerprint, not vLLM's")
    return renditions


def _positive_seconds(key: str, value: Any) -> float:
    try:
        seconds = _number(value)
    except ValueError as exc:
        raise ConfigError(f"kvnet setting {key!r}: {exc}") from None
    if seconds <= 0:
        raise ConfigError(f"kvnet setting {key!r}: must be positive, got {value!r}")
    return seconds


def _positive_size(key: str, value: Any) -> int:
    try:
        size = _size(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"kvnet setting {key!r}: {exc}") from None
    if size <= 0:
        raise ConfigError(f"kvnet setting {key!r}: must be positive, got {value!r}")
    return size


_NODE_FIELDS: dict[str, tuple[str, Any]] = {
    "relay": ("relay_url", _text),
    "ca": ("ca_file", _path),
    "cert": ("cert_file", _path),
    "key": ("key_file", _path),
    "token": ("token_file", _path),
    "signing_key": ("signing_key", _path),
    "trust": ("trust", _paths),
    "trust_any": ("trust_any", _flag),
    "node_secret": ("node_secret", _path),
    "tenant": ("tenant", _text),
    "renditions": ("publish_renditions", _published_renditions),
    "accept": ("acceptable_renditions", _renditions),
    "payload_digest": ("payload_digest", _text),
    "push": ("push", _flag),
    "store_bytes": ("store_bytes", _size),
    "fetch_window": ("fetch_window_bytes", _size),
    "fetch_connections": ("fetch_connections", _integer),
    "fetch_verify_workers": ("fetch_verify_workers", _verify_workers),
    "timeout": ("request_timeout", _number),
    "abr": ("abr_mode", _text),
    "assume_throughput": ("prior_throughput_bps", _number),
    "fetch_margin": ("fetch_margin", _number),
    "quic_stack": ("quic_stack", _text),
    "max_datagram_size": ("max_datagram_size", _integer),
}
_OWN_KEYS = frozenset({"locate_deadline", "drain_timeout"})
_OTHER_KEYS = frozenset({"key_dir", "metrics_dir", "publish_backlog_bytes"})
_KEYS = frozenset(_NODE_FIELDS) | _OWN_KEYS | _OTHER_KEYS
