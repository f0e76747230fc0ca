"""``kvnet-node``'s command head: the defaults it shows before the HTTP API (and torch) are imported."""

from __future__ import annotations

from kvnet.node import httpapi, serve


def test_max_connections_default_is_the_http_servers() -> None:
    # serve.py cannot import httpapi before the flags are parsed (it imports torch), so it keeps a copy.
    assert serve.DEFAULT_MAX_CONNECTIONS == httpapi.DEFAULT_MAX_CONNECTIONS
    assert serve.ServeConfig(node=serve.NodeConfig()).api == httpapi.ApiSettings()


def test_the_default_model_is_the_trained_one() -> None:
    args = serve.build_parser().parse_args([])
    assert args.model == "smollm2"
    assert serve.NodeConfig().model == "smollm2"
