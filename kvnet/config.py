"""Settings of kvnet's commands: one size parser, and every flag also from the environment or a YAML file.

Owns: ``parse_size`` (every byte-count flag of every command), ``config_parser`` (an ``ArgumentParser``
that shows defaults in ``--help`` and has ``--version``) and ``parse_config``, which fills each flag from,
in falling precedence, the command line, an environment variable (``--cache-blocks`` is
``KVNET_CACHE_BLOCKS`` for the nodes and ``KVNET_RELAY_CACHE_BYTES``-style names under the relay's prefix)
and a YAML config file (``--config FILE``: a mapping of flag names, dashes or underscores, to values; a
``.toml`` file is read as TOML, for relay config files written before the one format). The log settings
have one environment name for every command (``KVNET_LOG_FORMAT``, ``KVNET_LOG_LEVEL``), below the
command's own. Every bad value, wherever it came from, is one line naming its source and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import re
import tomllib
from collections.abc import Collection, Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, NoReturn

import yaml

from kvnet.logs import LOG_SETTINGS_ENV

_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?", re.IGNORECASE)
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
MAX_CONFIG_BYTES = 1 << 20


def parse_size(text: str) -> int:
    """``512M``, ``1G``, ``1.5GiB``, ``4096`` -> bytes (binary units); ``ValueError`` naming the text."""
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"invalid size {text!r} (expected e.g. 4096, 512K, 64M, 1G)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])


def format_size(size: int) -> str:
    """Bytes as ``parse_size`` reads them, in the largest unit that divides exactly (``256M``, ``1536``)."""
    for unit in ("T", "G", "M", "K"):
        if size and size % _SIZE_UNITS[unit] == 0:
            return f"{size // _SIZE_UNITS[unit]}{unit}"
    return str(size)


def size_arg(text: str) -> int:
    """``parse_size`` as an argparse ``type`` (its error becomes argparse's one-line message)."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def version() -> str:
    try:
        return metadata.version("kvnet")
    except metadata.PackageNotFoundError:  # running from a source tree without an install
        return "unknown"


class ConfigHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in ``--help``, except where the help text already says what happens without the flag
    (a default of None, an on/off flag, or help that names its default)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if default is None or isinstance(default, bool) or default == [] or "default" in text.lower():
            return text
        if default is argparse.SUPPRESS:
            return text
        if action.type is size_arg and isinstance(default, int):
            shown = format_size(default)  # as the flag takes it: 4M, not 4194304
        elif isinstance(default, list | tuple):
            shown = ",".join(map(str, default))
        else:
            shown = str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


class CommandParser(argparse.ArgumentParser):
    """argparse with its errors on one line (no usage dump): ``PROG: error: MESSAGE``, exit status 2; its
    subcommand parsers are ``CommandParser`` too and show their defaults."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", ConfigHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def config_parser(prog: str, description: str, *, config_file: bool = True) -> argparse.ArgumentParser:
    """A ``CommandParser`` with defaults in ``--help``, ``--version`` and (``config_file``) ``--config``."""
    # Module docstrings, which commands use as their description, quote names in reST (``kvnet-node``).
    parser = CommandParser(prog=prog, description=description.replace("``", ""))
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    if config_file:
        parser.add_argument(
            "--config", type=Path, default=None,
            help="YAML file of settings (flag names as keys); the command line and the environment win "
            "over it",
        )
    return parser


def env_name(prefix: str, action: argparse.Action) -> str:
    """``prefix`` + the long flag upper-cased, dashes as underscores (``--cache-blocks``: CACHE_BLOCKS)."""
    flag = max(action.option_strings, key=len).lstrip("-")
    return prefix + flag.upper().replace("-", "_")


def _settable(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Actions a setting can fill, by every name a config file may use for them."""
    out: dict[str, argparse.Action] = {}
    for action in parser._actions:  # argparse offers no public list of its actions
        if not action.option_strings or isinstance(action, argparse._HelpAction | argparse._VersionAction):
            continue
        if action.dest == "config":
            continue
        flag = max(action.option_strings, key=len).lstrip("-")
        out[flag] = out[flag.replace("-", "_")] = out[action.dest] = action
    return out


def _convert(action: argparse.Action, value: Any, source: str) -> Any:
    """A setting's value as the command line would have made it; ``ValueError`` naming ``source``."""
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        if isinstance(value, bool):
            flag = value
        elif isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            flag = value.strip().lower() in _TRUE
        else:
            raise ValueError(f"{source}: expected true or false, got {value!r}")
        return flag if isinstance(action, argparse._StoreTrueAction) else not flag
    if isinstance(action, argparse._AppendAction):
        items = value if isinstance(value, list) else [s for s in str(value).split(",") if s.strip()]
        return [_convert_one(action, item, source) for item in items]
    return _convert_one(action, value, source)


def _convert_one(action: argparse.Action, value: Any, source: str) -> Any:
    if isinstance(value, dict | list) or value is None:
        raise ValueError(f"{source}: expected a single value, got {value!r}")
    text = str(value)
    try:
        converted = action.type(text) if callable(action.type) else text
    except argparse.ArgumentTypeError as exc:
        raise ValueError(f"{source}: {exc}") from None
    except (ValueError, TypeError):
        kind = getattr(action.type, "__name__", "")
        raise ValueError(f"{source}: invalid {kind} value {text!r}") from None
    if action.choices is not None and converted not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise ValueError(f"{source}: invalid choice {text!r} (choose from {choices})")
    return converted


def read_config_file(path: Path) -> dict[str, Any]:
    """The mapping in a YAML (or, by its ``.toml`` suffix, TOML) settings file; ``ValueError`` with the
    file and the reason."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"--config {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ValueError(f"--config {path}: larger than {MAX_CONFIG_BYTES} bytes")
    if path.suffix == ".toml":
        try:
            return tomllib.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise ValueError(f"--config {path}: not valid TOML: {exc}") from None
    try:
        loaded = yaml.safe_load(data)
    except yaml.YAMLError as exc:
        reason = " ".join(str(exc).split())
        raise ValueError(f"--config {path}: not valid YAML: {reason}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ValueError(f"--config {path}: expected a mapping of setting names to values")
    return loaded


def parse_config(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    env_prefix: str = "KVNET_",
    config_sections: Collection[str] = (),
) -> argparse.Namespace:
    """Parse ``argv`` with defaults taken from the config file and the environment (see the module).

    ``config_sections`` names keys of the file that hold a mapping of settings without a flag (the
    relay's ``cache:``, ``limits:``, ``transport:``); they are returned, unconverted, as the namespace's
    ``config_sections`` dict for the command to check."""
    environ = os.environ if env is None else env
    actions = _settable(parser)
    defaults: dict[str, Any] = {}
    sections: dict[str, Any] = {}
    config_path: Path | None = None
    if "config" in {a.dest for a in parser._actions}:
        # Only --config first: the file may supply flags the full parser requires.
        pre = argparse.ArgumentParser(add_help=False)
        pre.add_argument("--config", type=Path)
        config_path = pre.parse_known_args(argv)[0].config
    if config_path is None and env_prefix + "CONFIG" in environ:
        config_path = Path(environ[env_prefix + "CONFIG"])
    try:
        if config_path is not None:
            for key, value in read_config_file(config_path).items():
                if key in config_sections:
                    if not isinstance(value, dict):
                        raise ValueError(f"--config {config_path}: {key}: expected a mapping of settings")
                    sections[key] = value
                    continue
                action = actions.get(str(key))
                if action is None:
                    raise ValueError(f"--config {config_path}: unknown setting {key!r}")
                defaults[action.dest] = _convert(action, value, f"--config {config_path}: {key}")
        for action in {id(a): a for a in actions.values()}.values():
            # The command's own name wins over the one every command shares (log settings).
            for name in (LOG_SETTINGS_ENV.get(action.dest), env_name(env_prefix, action)):
                if name is not None and name in environ:
                    defaults[action.dest] = _convert(action, environ[name], name)
    except ValueError as exc:
        parser.error(str(exc))
    for action in actions.values():
        if action.dest in defaults:
            action.required = False  # given by the file or the environment
    # argparse appends a repeatable flag's values to its default: given on the command line, they replace
    # the environment's or the file's list instead.
    lists = {a.dest: defaults.pop(a.dest) for a in actions.values()
             if isinstance(a, argparse._AppendAction) and a.dest in defaults}
    parser.set_defaults(**defaults, **dict.fromkeys(lists))
    args = parser.parse_args(argv)
    for dest, value in lists.items():
        if getattr(args, dest) is None:
            setattr(args, dest, value)
    args.config_sections = sections
    return args
