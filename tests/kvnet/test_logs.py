"""``kvnet.logs``: the one log format (logfmt or JSON lines), the shared flags and the HTTP access log."""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.request
from collections.abc import Iterator

import pytest
from fastapi import FastAPI

from kvnet.config import config_parser, parse_config
from kvnet.logs import ACCESS_LOGGER, LOG_SETTINGS_ENV, add_log_arguments, setup_logging
from kvnet.node.httpapi import HttpServer, bind_http


@pytest.fixture(autouse=True)
def _restore_root_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_kv_line_quotes_what_needs_quoting(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging("kv", "info")
    logging.getLogger("relay.relay").info("listening now", extra={"quic": "127.0.0.1:4443", "note": 'a "b"'})
    logging.getLogger("relay.relay").debug("not shown at info")
    line = capsys.readouterr().err.strip()
    assert line.startswith("ts=") and line.count("\n") == 0
    assert ' level=info logger=relay.relay msg="listening now" quic=127.0.0.1:4443 note="a \\"b\\""' in line


def test_json_line_has_the_same_fields(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging("json", "debug")
    logging.getLogger("kvnet.node.node").debug("model ready", extra={"tokens": 3})
    record = json.loads(capsys.readouterr().err)
    assert {k: record[k] for k in ("level", "logger", "msg", "tokens")} == {
        "level": "debug", "logger": "kvnet.node.node", "msg": "model ready", "tokens": 3,
    }


def test_log_settings_come_from_the_shared_environment_names() -> None:
    parser = config_parser("kvnet-test", "test", config_file=False)
    add_log_arguments(parser)
    shared = {LOG_SETTINGS_ENV["log_format"]: "json", "KVNET_LOG_LEVEL": "error"}
    args = parse_config(parser, [], env=shared)
    assert (args.log_format, args.log_level) == ("json", "error")
    own = {"KVNET_LOG_FORMAT": "json", "KVNET_X_LOG_FORMAT": "kv"}
    assert parse_config(parser, [], env=own, env_prefix="KVNET_X_").log_format == "kv"
    command_line = parse_config(parser, ["--log-format", "json"], env={"KVNET_LOG_FORMAT": "kv"})
    assert command_line.log_format == "json"


@pytest.mark.parametrize("log_format", ["kv", "json"])
async def test_access_log_of_a_real_http_server(capsys: pytest.CaptureFixture[str], log_format: str) -> None:
    setup_logging(log_format, "info")
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    server = await HttpServer.start(app, bind_http("127.0.0.1", 0))
    try:
        url = f"http://127.0.0.1:{server.port}/health?probe=1"
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=30).read())
        assert json.loads(body) == {"status": "ok"}
    finally:
        await server.stop()
    lines = [line for line in capsys.readouterr().err.splitlines() if ACCESS_LOGGER in line]
    assert len(lines) == 1, lines
    if log_format == "json":
        record = json.loads(lines[0])
        assert record["msg"] == "GET /health?probe=1 200" and record["status"] == 200
        assert record["method"] == "GET" and record["client"].startswith("127.0.0.1:")
        assert "color_message" not in record
    else:
        assert 'msg="GET /health?probe=1 200" client=127.0.0.1:' in lines[0]
        assert lines[0].endswith('method=GET path="/health?probe=1" status=200')
