"""Tests for kvnet/node/config.py: NodeConfig refuses bad values naming the field; flags map onto it."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvnet.net.settings import DATAGRAM_SIZE_ETHERNET
from kvnet.node.config import (
    NodeConfig,
    add_node_arguments,
    auto_verify_workers,
    explain_relay_problem,
    node_config_from_args,
)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("dtype", "int8", "dtype must be one of"),
        ("block_size", 0, "block_size must be positive"),
        ("publish_renditions", ("lossless", "fp4"), "unknown rendition"),
        ("abr_mode", "sometimes", "abr_mode must be"),
        ("fetch_verify_workers", -1, "fetch_verify_workers must be in"),
        ("tenant", "acme", "tenant: a tenant other than the default needs --node-secret"),
    ],
)
def test_bad_values_are_refused_naming_the_field(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        NodeConfig(**{field: value})  # type: ignore[arg-type]


def test_flags_map_onto_the_config() -> None:
    parser = argparse.ArgumentParser()
    add_node_arguments(parser, relay_required=False)
    args = parser.parse_args([
        "--relay", "moqt://127.0.0.1:4443", "--ca", "ca.pem", "--dtype", "bfloat16", "--block-size", "16",
        "--renditions", "lossless,int8", "--store-bytes", "64M", "--token", "node.tok", "--ethernet",
        "--fetch-verify-workers", "0",
    ])
    config = node_config_from_args(args)
    assert (config.relay_url, config.ca_file, config.token_file) == (
        "moqt://127.0.0.1:4443", Path("ca.pem"), Path("node.tok")
    )
    assert (config.dtype, config.block_size, config.store_bytes) == ("bfloat16", 16, 64 << 20)
    assert config.fetch_verify_workers == 0
    assert config.publish_renditions == ("lossless", "int8")
    assert config.max_datagram_size == DATAGRAM_SIZE_ETHERNET


@pytest.mark.parametrize(
    ("flags", "size"),
    [([], None), (["--ethernet"], 1452), (["--link", "ethernet"], 1452), (["--link", "jumbo"], 8952),
     (["--link", "loopback"], None), (["--max-datagram-size", "4000"], 4000)],
)
def test_link_flag_picks_the_datagram_size(flags: list[str], size: int | None) -> None:
    parser = argparse.ArgumentParser()
    add_node_arguments(parser, relay_required=False)
    assert node_config_from_args(parser.parse_args(flags)).max_datagram_size == size


def test_link_and_datagram_size_flags_exclude_each_other(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_node_arguments(parser, relay_required=False)
    with pytest.raises(SystemExit):
        parser.parse_args(["--link", "jumbo", "--max-datagram-size", "1452"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_unknown_dtype_flag_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_node_arguments(parser, relay_required=False)
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "int8"])
    assert "invalid choice: 'int8'" in capsys.readouterr().err


def _resolve_in_step(key_dir: Path, start: object, results: list[object]) -> None:
    import threading

    from kvnet.blocks.signing import load_signer
    from kvnet.node.config import resolve_keys

    assert isinstance(start, threading.Barrier)
    start.wait()
    try:
        config = resolve_keys(NodeConfig(), key_dir)
        assert config.signing_key is not None
        load_signer(config.signing_key)
        results.append(config.signing_key)
    except BaseException as exc:  # collected and asserted on by the test
        results.append(exc)


def test_processes_sharing_a_key_directory_agree_on_one_signing_key(tmp_path: Path) -> None:
    # Engines and nodes started together with one KVNET_HOME all make the default key on first use: exactly
    # one creates it, the others take it, and nobody reads a half-written file.
    import threading

    for round_ in range(10):
        key_dir = tmp_path / f"keys{round_}"
        start = threading.Barrier(8)
        results: list[object] = []
        threads = [
            threading.Thread(target=_resolve_in_step, args=(key_dir, start, results)) for _ in range(8)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [key_dir / "publisher.key"] * 8, results
        assert sorted(p.name for p in key_dir.iterdir()) == ["publisher.key", "publisher.pub"]


@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        # aioquic (OpenSSL's words) and qh3 (rustls's), as Node.relay_problem words them.
        ("self-signed certificate in certificate chain", "does not verify against --ca ca.pem"),
        ("the server certificate is unacceptable", "does not verify against --ca ca.pem"),
        ("hostname 'localhost' doesn't match IPAddressPattern(...)", "--host localhost'"),
        ("Idle timeout", "a QUIC handshake to UDP localhost:4443 got no answer within 2 s"),
    ],
)
def test_relay_problems_say_what_to_do(reason: str, expected: str) -> None:
    config = NodeConfig(relay_url="moqt://localhost:4443", ca_file=Path("ca.pem"), relay_idle_timeout=2.0)
    url = "moqt://localhost:4443"
    problem = f"cannot reach relay {url}: QUIC/TLS handshake with {url} failed: {reason}"
    assert expected in explain_relay_problem(config, problem)
    assert explain_relay_problem(config, f"relay {url}: GOAWAY") == f"relay {url}: GOAWAY"  # nothing to add


def test_verify_workers_default_to_the_host_cores_and_take_auto(capsys: pytest.CaptureFixture[str]) -> None:
    assert [auto_verify_workers(n) for n in (1, 2, 3, 4, 16, 64)] == [0, 0, 1, 2, 8, 8]
    parser = argparse.ArgumentParser()
    add_node_arguments(parser, relay_required=False)
    assert node_config_from_args(parser.parse_args([])).fetch_verify_workers == auto_verify_workers()
    args = parser.parse_args(["--fetch-verify-workers", "auto", "--renditions", "lossless,plain",
                              "--accept", "plain,lossless"])
    config = node_config_from_args(args)
    assert config.fetch_verify_workers == auto_verify_workers()
    assert (config.publish_renditions, config.acceptable_renditions) == (("lossless", "plain"),
                                                                          ("plain", "lossless"))
    with pytest.raises(SystemExit):
        parser.parse_args(["--fetch-verify-workers", "many"])
    assert "expected a thread count or 'auto', got 'many'" in capsys.readouterr().err
