"""Tests for kvnet/exchange/config.py: the host-sized fetch defaults and ``RelayPeerConfig``'s checks."""

from __future__ import annotations

import pytest

from kvnet.exchange.config import (
    MAX_FETCH_CONNECTIONS,
    MAX_VERIFY_WORKERS,
    RelayPeerConfig,
    auto_fetch_connections,
    auto_verify_workers,
)
from kvnet.net.config import TlsConfig, TransportConfig


def test_verify_workers_leave_two_cores_and_stop_at_eight() -> None:
    assert [auto_verify_workers(n) for n in (1, 2, 3, 4, 16, 64)] == [0, 0, 1, 2, 8, 8]


def test_fetch_connections_take_one_per_eight_cores_up_to_four() -> None:
    assert [auto_fetch_connections(n) for n in (1, 2, 8, 15, 16, 32, 64, 256)] == [1, 1, 1, 1, 2, 4, 4, 4]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("request_timeout", 0.0, "request_timeout must be positive"),
        ("fetch_window_bytes", 0, "fetch_window_bytes must be positive"),
        ("fetch_verify_workers", -1, "fetch_verify_workers must be in"),
        ("fetch_verify_workers", MAX_VERIFY_WORKERS + 1, "fetch_verify_workers must be in"),
        ("fetch_connections", 0, r"fetch_connections must be in \[1, 16\]"),
        ("fetch_connections", MAX_FETCH_CONNECTIONS + 1, r"fetch_connections must be in \[1, 16\]"),
    ],
)
def test_relay_peer_config_refuses_bad_values(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RelayPeerConfig(relay_url="moqt://relay:4443", tls=TlsConfig(), transport=TransportConfig(),
                        **{field: value})  # type: ignore[arg-type]
