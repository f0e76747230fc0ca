"""Relay configuration: file (YAML, or TOML) + environment + flag merging, validation errors that name
the field, metrics rendering."""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path

import pytest

import relay
from relay.__main__ import build_parser, config_from_args, parse_args
from relay.config import NO_TRUST, load_config, parse_hostport
from relay.metrics import Metrics, parse_prometheus
from tests.helpers.processes import REPO, CertDir, free_port


def _args(argv: list[str], env: dict[str, str] | None = None) -> argparse.Namespace:
    return parse_args(build_parser(), argv, env={} if env is None else env)


def test_file_then_flags(cert_dir: CertDir, tmp_path: Path) -> None:
    f = tmp_path / "relay.toml"
    f.write_text(
        f'listen = "127.0.0.1:5000"\ncert = "{cert_dir.cert}"\nkey = "{cert_dir.key}"\nca = "{cert_dir.ca}"\n'
        'upstream = ["moqt://origin:4443"]\nlog_format = "json"\n'
        "[cache]\nmax_bytes = 1000\nnegative_ttl = 0\n[limits]\nmax_sessions = 7\n"
        "[transport]\nmax_datagram_size = 1452\n"
    )
    args = _args(
        ["--config", str(f), "--listen", "0.0.0.0:6000", "--cache-bytes", "2000"]
    )
    cfg = config_from_args(args)
    assert (cfg.host, cfg.port) == ("0.0.0.0", 6000)
    assert cfg.cache.max_bytes == 2000 and cfg.cache.negative_ttl == 0
    assert cfg.limits.max_sessions == 7
    assert cfg.transport.max_datagram_size == 1452
    assert cfg.upstreams == ("moqt://origin:4443",) and cfg.log_format == "json"


@pytest.mark.parametrize(("link", "size"), [("ethernet", 1452), ("jumbo", 8952), ("loopback", None)])
def test_link_flag_overrides_the_file(cert_dir: CertDir, tmp_path: Path, link: str, size: int | None) -> None:
    f = tmp_path / "relay.toml"
    f.write_text(f'cert = "{cert_dir.cert}"\nkey = "{cert_dir.key}"\n[transport]\nmax_datagram_size = 4000\n')
    cfg = config_from_args(_args(["--config", str(f), "--link", link]))
    assert cfg.transport.max_datagram_size == size


def test_validation_names_the_field(cert_dir: CertDir) -> None:
    base = {"cert": str(cert_dir.cert), "key": str(cert_dir.key)}
    with pytest.raises(ValueError, match="unknown keys: bogus"):
        load_config({**base, "bogus": 1}, {})
    with pytest.raises(ValueError, match=r"\[limits\] has unknown keys: nope"):
        load_config({**base, "limits": {"nope": 1}}, {})
    with pytest.raises(ValueError, match="max_sessions"):
        load_config({**base, "limits": {"max_sessions": 0}}, {})
    with pytest.raises(ValueError, match="upstreams: verifying upstream relays needs ca"):
        load_config({**base, "upstream": ["moqt://x:1"]}, {})
    with pytest.raises(ValueError, match="moqt://"):
        load_config({**base, "ca": str(cert_dir.ca), "upstream": ["http://x:1"]}, {})
    with pytest.raises(ValueError, match="cert and key are required"):
        load_config({}, {})
    with pytest.raises(ValueError, match="log_format"):
        load_config({**base, "log_format": "xml"}, {})
    metrics_off = load_config({**base, "metrics": ""}, {})
    assert metrics_off.metrics_port is None


def test_parse_hostport() -> None:
    assert parse_hostport("[::1]:443", "listen") == ("::1", 443)
    with pytest.raises(ValueError, match="listen must be host:port"):
        parse_hostport("nohost", "listen")
    with pytest.raises(ValueError, match="port must be in"):
        parse_hostport("a:70000", "listen")


def test_metrics_render_and_parse() -> None:
    m = Metrics()
    m.counter("requests_total", "requests")
    m.inc("requests_total", labels={"type": "fetch", "outcome": "ok"})
    m.inc("requests_total", 2, labels={"type": "fetch", "outcome": "ok"})
    m.gauge_fn("cache_bytes", "bytes", lambda: 123)
    text = m.render()
    assert "# TYPE kvnet_relay_requests_total counter" in text
    samples = parse_prometheus(text)
    assert samples['kvnet_relay_requests_total{outcome="ok",type="fetch"}'] == 3
    assert samples["kvnet_relay_cache_bytes"] == 123


def test_a_metric_reads_zero_before_its_first_increment_and_an_undeclared_one_is_an_error() -> None:
    m = Metrics()
    m.counter("requests_total", "requests")
    assert m.value("requests_total", {"type": "fetch"}) == 0
    with pytest.raises(KeyError, match="requests_totl"):
        m.value("requests_totl")


def test_every_counter_the_relay_increments_is_declared_so_it_is_exported_before_its_first_event() -> None:
    # Scanned from the source: an ``inc("name")`` whose family was never declared is missing from /metrics
    # until it first happens, and a test reading it in-process then fails with KeyError.
    incremented, declared = set(), set()
    for path in Path(relay.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                continue
            if node.func.attr == "inc":
                incremented.add(node.args[0].value)
            elif node.func.attr in ("counter", "counter_fn", "gauge_fn"):
                declared.add(node.args[0].value)
    assert incremented and not incremented - declared, sorted(incremented - declared)


def test_auth_keys_from_file_and_flags(cert_dir: CertDir, tmp_path: Path) -> None:
    f = tmp_path / "relay.toml"
    f.write_text(
        f'cert = "{cert_dir.cert}"\nkey = "{cert_dir.key}"\nauth_issuer_keys = "a.pub"\n'
        'upstream_token = "edge.token"\n'
    )
    cfg = config_from_args(_args(["--config", str(f)]))
    assert cfg.auth_issuer_keys == (Path("a.pub"),) and cfg.upstream_token == Path("edge.token")
    args = ["--config", str(f), "--auth-issuer-key", "b.pub", "--auth-issuer-key", "c.pub"]
    cfg = config_from_args(_args(args))
    assert cfg.auth_issuer_keys == (Path("b.pub"), Path("c.pub"))


def test_limit_and_share_flags(cert_dir: CertDir, tmp_path: Path) -> None:
    f = tmp_path / "relay.toml"
    f.write_text(
        f'cert = "{cert_dir.cert}"\nkey = "{cert_dir.key}"\n'
        "[limits]\nslow_peer_timeout = 7.0\nsession_idle_timeout = 0\n[cache]\nshare_fraction = 0.25\n"
    )
    args = [
        "--config", str(f), "--max-requests", "10", "--max-buffered-bytes-total", "5000",
        "--request-header-timeout", "2.5", "--setup-timeout", "3", "--cache-share-depth", "3",
    ]  # fmt: skip
    cfg = config_from_args(_args(args))
    lim = cfg.limits
    assert (lim.max_requests, lim.max_buffered_bytes, lim.request_header_timeout) == (10, 5000, 2.5)
    assert (lim.setup_timeout, lim.slow_peer_timeout, lim.session_idle_timeout) == (3.0, 7.0, 0.0)
    assert cfg.cache.share_depth == 3 and cfg.cache.share_limit == cfg.cache.max_bytes // 4
    base = {"cert": str(cert_dir.cert), "key": str(cert_dir.key)}
    with pytest.raises(ValueError, match="share_fraction"):
        load_config({**base, "cache": {"share_fraction": 0}}, {})
    with pytest.raises(ValueError, match="slow_peer_timeout"):
        load_config({**base, "limits": {"slow_peer_timeout": 0}}, {})


def test_yaml_file_of_flags_and_sections_then_environment(cert_dir: CertDir, tmp_path: Path) -> None:
    f = tmp_path / "relay.yaml"
    f.write_text(
        f"cert: {cert_dir.cert}\nkey: {cert_dir.key}\nca: {cert_dir.ca}\ncache-bytes: 1G\n"
        "max-buffered-bytes-per-address: 64M\nupstream: [moqt://origin:4443]\n"
        "limits:\n  max_subscribers_per_track: 9\ntransport:\n  udp_segmentation: false\n"
    )
    env = {"KVNET_RELAY_MAX_SESSIONS": "12", "KVNET_LOG_FORMAT": "json", "KVNET_RELAY_CONFIG": str(f)}
    cfg = config_from_args(_args(["--upstream", "moqt://other:4443"], env))
    assert cfg.cache.max_bytes == 1 << 30 and cfg.limits.max_buffered_bytes_per_address == 64 << 20
    assert cfg.limits.max_subscribers_per_track == 9 and cfg.transport.udp_segmentation is False
    assert cfg.limits.max_sessions == 12 and cfg.log_format == "json"
    # A repeatable flag on the command line replaces the file's list.
    assert cfg.upstreams == ("moqt://other:4443",)
    own_name_wins = {"KVNET_LOG_FORMAT": "json", "KVNET_RELAY_LOG_FORMAT": "kv", "KVNET_RELAY_CONFIG": str(f)}
    assert config_from_args(_args([], own_name_wins)).log_format == "kv"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("limits: 3\n", "limits: expected a mapping of settings"),
        ("limits:\n  max_subscribers_per_track: many\n", "[limits]"),
        ("cache-bytes: 1Q\n", "invalid size '1Q'"),
        ("transport:\n  bogus: 1\n", "[transport] has unknown keys: bogus"),
    ],
)
def test_bad_config_file_is_one_line(
    cert_dir: CertDir, tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    f = tmp_path / "relay.yaml"
    f.write_text(f"cert: {cert_dir.cert}\nkey: {cert_dir.key}\n{text}")
    with pytest.raises(SystemExit) as exit_info:
        parser = build_parser()
        try:
            config_from_args(parse_args(parser, ["--config", str(f)], env={}))
        except ValueError as exc:
            parser.error(str(exc))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvnet-relay: error: ") and message in err, err


def test_help_shows_section_defaults() -> None:
    text = " ".join(build_parser().format_help().split())
    assert "cache byte budget (default: 256M)" in text
    assert "(default: None)" not in text


def test_a_relay_without_trust_or_trust_any_does_not_start(cert_dir: CertDir) -> None:
    """Neither ``--trust`` nor ``--trust-any``: one line saying what it would risk, exit 2, nothing served."""
    done = subprocess.run(
        [sys.executable, "-m", "relay", "--listen", f"127.0.0.1:{free_port()}", "--metrics", "",
         "--cert", str(cert_dir.cert), "--key", str(cert_dir.key)],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [f"kvnet-relay: error: {NO_TRUST}"]


def test_listen_qmux_and_qmux_upstreams_from_file_and_flags(cert_dir: CertDir, tmp_path: Path) -> None:
    f = tmp_path / "relay.toml"
    f.write_text(
        f'cert = "{cert_dir.cert}"\nkey = "{cert_dir.key}"\nca = "{cert_dir.ca}"\n'
        'listen_qmux = "127.0.0.1:5001"\nupstream = ["moqt+qmux://origin:4443", "moqt://backup:4443"]\n'
    )
    cfg = config_from_args(_args(["--config", str(f)]))
    assert (cfg.qmux_host, cfg.qmux_port) == ("127.0.0.1", 5001)
    assert cfg.upstreams == ("moqt+qmux://origin:4443", "moqt://backup:4443")
    cfg = config_from_args(_args(["--config", str(f), "--listen-qmux", "[::1]:0"]))
    assert (cfg.qmux_host, cfg.qmux_port) == ("::1", 0)
    plain = config_from_args(_args(["--cert", str(cert_dir.cert), "--key", str(cert_dir.key)]))
    assert plain.qmux_host is None
    base = {"cert": str(cert_dir.cert), "key": str(cert_dir.key)}
    with pytest.raises(ValueError, match="listen-qmux"):
        load_config({**base, "listen_qmux": "nowhere"}, {})
    assert load_config({**base, "listen_qmux": "127.0.0.1:1", "workers": 2}, {}).workers == 2
