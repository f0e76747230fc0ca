"""``kvnet-node``'s command head: the defaults it shows before the HTTP API (and torch) are imported."""

from __future__ import annotations

from kvnet.node import httpapi, serve
from kvnet.node.httpguard import HttpLimits


def test_defaults_are_the_http_servers() -> None:
    assert serve.build_parser().parse_args([]).max_connections == HttpLimits.max_connections
    assert serve.ServeConfig(node=serve.NodeConfig()).api == httpapi.ApiConfig()


def test_the_default_model_is_the_trained_one() -> None:
    args = serve.build_parser().parse_args([])
    assert args.model == "smollm2"
    assert serve.NodeConfig().model == "smollm2"
