"""An engine connector's configuration dict (``kvnet.integrations.config``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvnet.exchange.config import auto_verify_workers
from kvnet.integrations.config import (
    DEFAULT_PUBLISH_BACKLOG_BYTES,
    ConfigError,
    ConnectorConfig,
    connector_verify_workers,
)
from kvnet.security import certs

RELAY = "moqt://127.0.0.1:4443"


@pytest.fixture
def base(tmp_path: Path) -> dict[str, object]:
    ca_dir = tmp_path / "ca"
    ca_dir.mkdir()
    certs.create_ca(ca_dir)
    return {"relay": RELAY, "ca": str(ca_dir / "ca.pem")}


def test_keys_default_to_kvnet_home_like_the_node_commands(tmp_path: Path, base: dict[str, object]) -> None:
    settings = ConnectorConfig.from_extra_config(base, str(tmp_path))
    keys = tmp_path / "keys"
    assert settings.node.signing_key == keys / "publisher.key"
    assert (keys / "publisher.key").exists() and (keys / "publisher.pub").exists()
    assert settings.node.trust == (keys,)
    assert settings.node.relay_url == RELAY and settings.node.ca_file == Path(str(base["ca"]))


def test_a_side_that_neither_signs_nor_verifies_touches_no_key_file(
    tmp_path: Path, base: dict[str, object]
) -> None:
    ConnectorConfig.from_extra_config(base, str(tmp_path), resolve_key_files=False)
    assert not (tmp_path / "keys").exists()


def test_values_map_to_the_node_config(tmp_path: Path, base: dict[str, object]) -> None:
    settings = ConnectorConfig.from_extra_config(
        {**base, "renditions": "lossless,int8", "accept": ["lossless", "int8"], "push": False,
         "store_bytes": "64M", "timeout": 3, "trust": [str(tmp_path)], "key_dir": str(tmp_path / "k"),
         "locate_deadline": 0.5, "drain_timeout": 4, "metrics_dir": str(tmp_path / "m"),
         "fetch_connections": 3, "publish_backlog_bytes": "32M", "abr": "fetch", "assume_throughput": 2e9,
         "fetch_margin": 5, "payload_digest": "sha256", "fetch_verify_workers": 3},
        None,
    )
    node = settings.node
    assert node.publish_renditions == ("lossless", "int8")
    assert node.acceptable_renditions == ("lossless", "int8")
    assert node.push is False and node.store_bytes == 64 << 20 and node.request_timeout == 3.0
    assert node.trust == (tmp_path,) and node.signing_key == tmp_path / "k" / "publisher.key"
    assert settings.locate_deadline == 0.5 and settings.drain_timeout == 4.0
    assert settings.metrics_dir == tmp_path / "m"
    assert node.fetch_connections == 3
    assert settings.publish_backlog_bytes == 32 << 20
    assert node.abr_mode == "fetch" and node.prior_throughput_bps == 2e9 and node.fetch_margin == 5.0
    assert node.payload_digest == "sha256"
    assert node.fetch_verify_workers == 3


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"relay_url": "x"}, "unknown kvnet setting"),
        ({"push": "yes"}, "'push'"),
        ({"timeout": "10"}, "'timeout'"),
        ({"locate_deadline": 0}, "'locate_deadline'"),
        ({"publish_backlog_bytes": 0}, "'publish_backlog_bytes'"),
        ({"publish_backlog_bytes": "lots"}, "'publish_backlog_bytes'"),
        ({"renditions": "lossless,fancy"}, "unknown rendition"),
        ({"renditions": ["lossless", "kvtc"]}, "'renditions': kvtc is not published from inside vLLM"),
        ({"trust": 3}, "'trust'"),
        ({"tenant": "other"}, "node-secret"),
        ({"fetch_connections": "2"}, "'fetch_connections'"),
        ({"fetch_connections": 17}, "fetch_connections must be in \\[1, 16\\]"),
        ({"abr": "sometimes"}, "abr_mode must be auto, fetch or recompute"),
        ({"assume_throughput": 0}, "assumed throughput must be a positive number"),
        ({"assume_throughput": "fast"}, "'assume_throughput'"),
        ({"payload_digest": "md5"}, "payload_digest must be one of"),
        ({"fetch_verify_workers": "many"}, "'fetch_verify_workers'"),
        ({"fetch_verify_workers": -1}, "fetch_verify_workers must be in \\[0, 64\\]"),
    ],
)
def test_bad_settings_name_the_key(
    tmp_path: Path, base: dict[str, object], extra: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        ConnectorConfig.from_extra_config({**base, **extra}, str(tmp_path))


def test_the_publish_backlog_has_a_bound_by_default(tmp_path: Path, base: dict[str, object]) -> None:
    settings = ConnectorConfig.from_extra_config(base, str(tmp_path), resolve_key_files=False)
    assert settings.publish_backlog_bytes == DEFAULT_PUBLISH_BACKLOG_BYTES > 0


@pytest.mark.parametrize(
    ("cores", "node", "connector"), [(1, 0, 1), (2, 0, 1), (3, 1, 1), (4, 2, 2), (16, 8, 8)]
)
def test_a_connector_verifies_on_at_least_one_thread_of_its_own(
    cores: int, node: int, connector: int
) -> None:
    # Inside vLLM the engine's processes poll while a load is pending: the connector's loop shares its core.
    # A node verifies on its event loop below 3 cores; a connector never does.
    assert auto_verify_workers(cores) == node
    assert connector_verify_workers(cores) == connector


def test_verify_workers_default_to_the_connector_choice_and_take_auto(
    tmp_path: Path, base: dict[str, object]
) -> None:
    plain = ConnectorConfig.from_extra_config(base, str(tmp_path), resolve_key_files=False)
    auto = ConnectorConfig.from_extra_config(
        {**base, "fetch_verify_workers": "auto"}, str(tmp_path), resolve_key_files=False
    )
    none = ConnectorConfig.from_extra_config(
        {**base, "fetch_verify_workers": 0}, str(tmp_path), resolve_key_files=False
    )
    assert plain.node.fetch_verify_workers == auto.node.fetch_verify_workers == connector_verify_workers()
    assert none.node.fetch_verify_workers == 0


def test_relay_and_a_usable_ca_are_required(tmp_path: Path, base: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match="'relay' is required"):
        ConnectorConfig.from_extra_config({"ca": base["ca"]}, str(tmp_path))
    with pytest.raises(ConfigError, match="ca"):
        ConnectorConfig.from_extra_config({"relay": RELAY}, str(tmp_path))
    with pytest.raises(ConfigError, match="not a usable PEM CA"):
        ConnectorConfig.from_extra_config({"relay": RELAY, "ca": str(tmp_path / "missing.pem")}, None)


def test_the_relay_key_takes_a_qmux_url(tmp_path: Path, base: dict[str, object]) -> None:
    qmux = "moqt+qmux://127.0.0.1:4443"
    settings = ConnectorConfig.from_extra_config(
        {**base, "relay": qmux}, str(tmp_path), resolve_key_files=False
    )
    assert settings.node.relay_url == qmux
