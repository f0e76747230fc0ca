"""Tests for kvnet.net.config: transport settings validation, link presets, the datagram size rule."""

from __future__ import annotations

import pytest

from kvnet.net.config import (
    DATAGRAM_SIZE_ETHERNET,
    DATAGRAM_SIZE_JUMBO,
    DATAGRAM_SIZE_LOOPBACK,
    DATAGRAM_SIZE_QH3_LOOPBACK,
    DEFAULT_STACK,
    MAX_DATAGRAM_SIZE_AIOPQUIC,
    TransportConfig,
    choose_datagram_size,
    path_is_loopback,
)


def test_settings_defaults_and_validation() -> None:
    s = TransportConfig()
    assert s.stack == DEFAULT_STACK and s.socket_receive_buffer == 4 << 20
    assert TransportConfig(stack="aioquic").datagram_size == 16384
    assert TransportConfig(stack="qh3").datagram_size == DATAGRAM_SIZE_QH3_LOOPBACK
    assert TransportConfig.for_ethernet().datagram_size == 1452
    with pytest.raises(ValueError, match="max_datagram_size"):
        TransportConfig(stack="aioquic", max_datagram_size=16385)
    assert TransportConfig(stack="qh3", max_datagram_size=65000).datagram_size == 65000
    with pytest.raises(ValueError, match="max_datagram_size"):
        TransportConfig(stack="qh3", max_datagram_size=65508)
    with pytest.raises(ValueError, match="stack"):
        TransportConfig(stack="quiche")
    with pytest.raises(ValueError, match="max_datagram_size"):
        TransportConfig(max_datagram_size=1000)
    with pytest.raises(ValueError, match="congestion_control"):
        TransportConfig(congestion_control="bbr")
    with pytest.raises(ValueError, match="max_streams_bidi"):
        TransportConfig(max_streams_bidi=0)


def test_link_presets_size_datagrams_never_above_the_peer() -> None:
    for stack in ("aioquic", "qh3"):
        assert TransportConfig.for_link("ethernet", stack).datagram_size == 1452
        assert TransportConfig.for_link("jumbo", stack).datagram_size == 8952
        loopback = TransportConfig.for_link("loopback", stack)
        assert loopback == TransportConfig(stack=stack)
        # The loopback preset is the loopback size on this machine only; the peer's limit caps every preset.
        assert choose_datagram_size(loopback, None, loopback=False) == DATAGRAM_SIZE_ETHERNET
        assert choose_datagram_size(TransportConfig.for_link("jumbo", stack), 1500, True) == 1500
    # aiopquic's picoquic probes up to its own maximum and no further, and never above the peer's limit
    # (its own rule); a setting below the Ethernet size turns probing off.
    assert TransportConfig.for_link("ethernet", "aiopquic").datagram_size == 1452
    for link in ("jumbo", "loopback"):
        settings = TransportConfig.for_link(link, "aiopquic")
        assert settings.datagram_size == MAX_DATAGRAM_SIZE_AIOPQUIC
    assert TransportConfig(stack="aiopquic", max_datagram_size=1300).datagram_size == 1300
    with pytest.raises(ValueError, match="max_datagram_size must be in 1252"):
        TransportConfig(stack="aiopquic", max_datagram_size=1200)
    assert TransportConfig.for_ethernet() == TransportConfig.for_link("ethernet")
    with pytest.raises(ValueError, match="link must be one of"):
        TransportConfig.for_link("wifi")


def test_choose_datagram_size() -> None:
    default = TransportConfig()
    jumbo = TransportConfig(max_datagram_size=DATAGRAM_SIZE_JUMBO)
    # Off-host without configuration: the size every path carries; on loopback: the stack's loopback size.
    assert choose_datagram_size(default, None, loopback=False) == DATAGRAM_SIZE_ETHERNET
    assert choose_datagram_size(default, None, loopback=True) == DATAGRAM_SIZE_LOOPBACK
    # A configured size is taken as known to fit the path, but never above the peer's limit.
    assert choose_datagram_size(jumbo, None, loopback=False) == DATAGRAM_SIZE_JUMBO
    assert choose_datagram_size(jumbo, 1452, loopback=False) == 1452
    assert choose_datagram_size(default, 1300, loopback=True) == 1300
    assert path_is_loopback("127.0.0.1") and path_is_loopback("::1")
    assert path_is_loopback("::ffff:127.0.0.1") and not path_is_loopback("10.0.0.1")
    assert not path_is_loopback("not-an-address")
