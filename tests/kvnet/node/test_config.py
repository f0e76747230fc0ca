"""Tests for kvnet/node/config.py: NodeConfig refuses bad values naming the field; flags map onto it."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from kvnet.config import config_parser, parse_config
from kvnet.exchange.config import auto_fetch_connections, auto_kvtc_decode_processes, auto_verify_workers
from kvnet.net.config import DATAGRAM_SIZE_ETHERNET
from kvnet.node.config import NodeConfig, add_node_arguments, explain_relay_problem, node_config_from_args


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("dtype", "int8", "dtype must be one of"),
        ("block_size", 0, "block_size must be positive"),
        ("publish_renditions", ("lossless", "fp4"), "unknown rendition"),
        ("publish_renditions", ("lossless", "kvtc"), "kvtc needs the model's tables"),
        ("payload_digest", "md5", "payload_digest must be one of"),
        ("abr_mode", "sometimes", "abr_mode must be"),
        ("fetch_verify_workers", -1, "fetch_verify_workers must be in"),
        ("fetch_connections", 0, r"fetch_connections must be in \[1, 16\]"),
        ("fetch_connections", 17, r"fetch_connections must be in \[1, 16\]"),
        ("kvtc_decode_processes", 17, r"kvtc_decode_processes must be in \[0, 16\]"),
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
        "--fetch-verify-workers", "0", "--payload-digest", "sha256",
    ])
    config = node_config_from_args(args)
    assert (config.relay_url, config.ca_file, config.token_file) == (
        "moqt://127.0.0.1:4443", Path("ca.pem"), Path("node.tok")
    )
    assert (config.dtype, config.block_size, config.store_bytes) == ("bfloat16", 16, 64 << 20)
    assert config.fetch_verify_workers == 0
    assert config.publish_renditions == ("lossless", "int8")
    assert config.max_datagram_size == DATAGRAM_SIZE_ETHERNET
    assert config.payload_digest == "sha256"
    assert node_config_from_args(parser.parse_args([])).payload_digest == "blake3"


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

    from kvnet.node.config import resolve_keys
    from kvnet.security.signing import load_signer

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


def test_fetch_connections_default_to_the_host_cores_and_refuse_bad_counts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = argparse.ArgumentParser()
    add_node_arguments(parser, relay_required=False)
    assert node_config_from_args(parser.parse_args([])).fetch_connections == auto_fetch_connections()
    assert node_config_from_args(parser.parse_args(["--fetch-connections", "3"])).fetch_connections == 3
    assert node_config_from_args(
        parser.parse_args(["--fetch-connections", "auto"])
    ).fetch_connections == auto_fetch_connections()
    for bad, message in (("0", "must be in [1, 16], got 0"), ("17", "must be in [1, 16], got 17"),
                         ("many", "expected a session count or 'auto', got 'many'")):
        with pytest.raises(SystemExit):
            parser.parse_args(["--fetch-connections", bad])
        err = capsys.readouterr().err
        assert f"argument --fetch-connections: {message}" in err and "Traceback" not in err


def test_kvtc_decode_processes_default_to_one_per_core_and_refuse_bad_counts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert [auto_kvtc_decode_processes(cores) for cores in (1, 2, 4, 9, 64)] == [1, 2, 4, 8, 8]
    parser = argparse.ArgumentParser()
    add_node_arguments(parser, relay_required=False)
    default = node_config_from_args(parser.parse_args([])).kvtc_decode_processes
    assert default == auto_kvtc_decode_processes()
    for flag, count in (("0", 0), ("3", 3), ("auto", default)):
        args = parser.parse_args(["--kvtc-decode-processes", flag])
        assert node_config_from_args(args).kvtc_decode_processes == count
    for bad, message in (("17", "must be in [0, 16], got 17"), ("-1", "must be in [0, 16], got -1"),
                         ("many", "expected a process count or 'auto', got 'many'")):
        with pytest.raises(SystemExit):
            parser.parse_args(["--kvtc-decode-processes", bad])
        err = capsys.readouterr().err
        assert f"argument --kvtc-decode-processes: {message}" in err and "Traceback" not in err


def test_fetch_connections_come_from_the_config_file_and_the_environment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = config_parser("kvnet-node", "test")
    add_node_arguments(parser, relay_required=False)
    config = tmp_path / "node.yaml"
    config.write_text("fetch_connections: 3\n")
    args = parse_config(parser, ["--config", str(config)], env={})
    assert node_config_from_args(args).fetch_connections == 3
    args = parse_config(parser, [], env={"KVNET_FETCH_CONNECTIONS": "2"})
    assert node_config_from_args(args).fetch_connections == 2
    config.write_text("fetch-connections: 99\n")
    with pytest.raises(SystemExit):
        parse_config(parser, ["--config", str(config)], env={})
    err = capsys.readouterr().err.strip()
    assert "fetch-connections" in err and "must be in [1, 16], got 99" in err and "\n" not in err, err


def test_relay_peer_config_carries_the_relay_session_settings(tmp_path: Path) -> None:
    ca, token = tmp_path / "ca.pem", tmp_path / "node.token"
    ca.write_text("")  # TLS settings check that the file is there; it is read only when connecting
    config = NodeConfig(
        relay_url="moqt://relay:4443", ca_file=ca, token_file=token, request_timeout=3.0, trust_any=True,
        fetch_window_bytes=1 << 20, fetch_verify_workers=2, fetch_connections=3, relay_idle_timeout=6.0,
    )
    peer = config.relay_peer_config()
    assert (peer.relay_url, peer.tls.ca_file, peer.tls.cert_file, peer.token_file) == (
        "moqt://relay:4443", ca, None, token)
    assert (peer.request_timeout, peer.trust_any) == (3.0, True)
    assert (peer.fetch_window_bytes, peer.fetch_verify_workers, peer.fetch_connections) == (1 << 20, 2, 3)
    assert peer.transport == config.transport_config
    assert peer.transport.idle_timeout == 6.0
    # A GOAWAY's New Session URI replaces the configured relay, nothing else.
    assert config.relay_peer_config("moqt://other:4443") == dataclasses.replace(
        peer, relay_url="moqt://other:4443")
    with pytest.raises(ValueError, match="relay_url"):
        NodeConfig().relay_peer_config()
