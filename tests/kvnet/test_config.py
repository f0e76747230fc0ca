"""``kvnet.config``: one size parser; flags from the command line, ``KVNET_*`` and a YAML file."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvnet.config import config_parser, parse_config, parse_size, size_arg


@pytest.mark.parametrize(
    ("text", "size"),
    [("4096", 4096), ("512K", 512 << 10), ("64M", 64 << 20), ("1G", 1 << 30), ("1g", 1 << 30),
     ("1GiB", 1 << 30), ("1.5G", 3 << 29), ("2MB", 2 << 20), (" 8k ", 8 << 10)],
)
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "G", "1X", "-1M", "1 G B", "one", "1e3"])
def test_parse_size_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="invalid size"):
        parse_size(text)


def _parser() -> argparse.ArgumentParser:
    p = config_parser("kvnet-test", "test")
    p.add_argument("--cache-blocks", type=int, default=2048, help="blocks")
    p.add_argument("--store-bytes", type=size_arg, default="512M", help="bytes")
    p.add_argument("--trust", type=Path, action="append", default=[], help="keys")
    p.add_argument("--no-push", action="store_true", help="flag")
    p.add_argument("--abr", choices=["auto", "fetch"], default="auto", help="policy")
    p.add_argument("--relay", required=True, help="url")
    return p


def test_precedence_command_line_then_environment_then_file(tmp_path: Path) -> None:
    config = tmp_path / "node.yaml"
    config.write_text("relay: moqt://file:1\ncache_blocks: 7\nstore-bytes: 1G\nno-push: true\n"
                      "trust: [a.pub, b.pub]\nabr: fetch\n")
    env = {"KVNET_CACHE_BLOCKS": "9", "KVNET_UNRELATED": "x"}
    args = parse_config(_parser(), ["--config", str(config), "--abr", "auto"], env=env)
    assert args.relay == "moqt://file:1"  # a required flag may come from the file
    assert args.cache_blocks == 9  # the environment wins over the file
    assert args.store_bytes == 1 << 30 and args.no_push is True
    assert args.trust == [Path("a.pub"), Path("b.pub")]
    assert args.abr == "auto"  # the command line wins over both
    defaults = parse_config(_parser(), ["--relay", "moqt://x:1"], env={})
    assert defaults.store_bytes == 512 << 20 and defaults.cache_blocks == 2048 and defaults.no_push is False


@pytest.mark.parametrize(
    ("env", "file_text", "message"),
    [
        ({"KVNET_CACHE_BLOCKS": "abc"}, None, "KVNET_CACHE_BLOCKS: invalid int value 'abc'"),
        ({"KVNET_STORE_BYTES": "1Q"}, None, "KVNET_STORE_BYTES: invalid size '1Q'"),
        ({"KVNET_NO_PUSH": "maybe"}, None, "KVNET_NO_PUSH: expected true or false"),
        ({"KVNET_ABR": "never"}, None, "KVNET_ABR: invalid choice 'never'"),
        ({}, "bogus: 1\n", "unknown setting 'bogus'"),
        ({}, "cache-blocks: [1\n", "not valid YAML"),
        ({}, "- a\n- b\n", "expected a mapping"),
        ({}, "cache-blocks: {a: 1}\n", "expected a single value"),
    ],
)
def test_bad_settings_are_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], env: dict[str, str], file_text: str | None,
    message: str,
) -> None:
    argv = ["--relay", "moqt://x:1"]
    if file_text is not None:
        config = tmp_path / "bad.yaml"
        config.write_text(file_text)
        argv += ["--config", str(config)]
    with pytest.raises(SystemExit) as exit_info:
        parse_config(_parser(), argv, env=env)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvnet-test: error: ") and message in err, err


def test_version_and_defaults_in_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_config(_parser(), ["--version"], env={})
    assert exit_info.value.code == 0 and capsys.readouterr().out.startswith("kvnet-test ")
    assert "(default: 2048)" in _parser().format_help()


def test_help_shows_defaults_as_the_flags_take_them() -> None:
    p = _parser()
    p.add_argument("--window", type=size_arg, default=4 << 20, help="bytes ahead")
    p.add_argument("--renditions", default=("lossless", "int8"), help="renditions")
    text = " ".join(p.format_help().split())
    assert "bytes ahead (default: 4M)" in text and "renditions (default: lossless,int8)" in text
    assert "(default: None)" not in text and "(default: [])" not in text and "(default: False)" not in text


def test_help_shows_a_docstring_description_as_plain_text() -> None:
    from kvnet.node import serve

    text = serve.build_parser().format_help()
    assert "kvnet-node: a long-running node" in text and "``" not in text
    assert "(None" not in text  # a flag without a default says what it means, not Python's None
