"""Tests for kvnet.net.url: peer URLs and the transport family their scheme names."""

from __future__ import annotations

import pytest

from kvnet.net.url import DEFAULT_PORT, QMUX, QUIC, SCHEMES, MoqtUrl, parse_moqt_url


def test_parse_moqt_url() -> None:
    assert parse_moqt_url("moqt://relay.example:4433/kv") == MoqtUrl("relay.example", 4433, "/kv")
    assert parse_moqt_url("moqt://[::1]:5") == MoqtUrl("::1", 5, "")
    assert parse_moqt_url("moqt://h").port == DEFAULT_PORT
    for bad in ("https://h:1", "moqt://:1", "moqt://h:99999", "moqt://u@h:1", "moqt://h:1?x=1"):
        with pytest.raises(ValueError):
            parse_moqt_url(bad)


def test_the_scheme_names_the_transport_family() -> None:
    assert parse_moqt_url("moqt://h:1").transport == QUIC
    assert set(SCHEMES.values()) >= {QUIC}
    # An unknown scheme is refused with the accepted ones named, in one line.
    with pytest.raises(ValueError, match=r"expected a moqt:// or moqt\+qmux:// URL, got 'tcp://h:1'"):
        parse_moqt_url("tcp://h:1")


def test_moqt_over_qmux_urls_name_the_qmux_transport() -> None:
    url = parse_moqt_url("moqt+qmux://[::1]:5000/path")
    assert (url.host, url.port, url.path, url.transport) == ("::1", 5000, "/path", QMUX)
    assert parse_moqt_url("moqt+qmux://relay").port == DEFAULT_PORT
    assert parse_moqt_url("moqt://relay").transport == QUIC
