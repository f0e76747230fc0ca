"""The compose model of ``docker-compose.yml``, read without a YAML dependency.

* ``parse_yaml_subset`` — a reader for the strict YAML subset the compose file is written in (block mappings
  and sequences, quoted and plain scalars, one-line flow sequences, comments). Anything outside the subset
  raises ``ComposeError`` naming the line, so the compose file stays the one source of truth for both the
  container demo and the namespace cluster without a YAML dependency, and never silently means something
  else to us than to Docker Compose.
* ``load_compose`` — the compose model: services (command, environment, networks, volumes, depends_on,
  healthcheck, exposed ports), networks and volumes, with compose's ``$$`` escape applied.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ComposeError(ValueError):
    """The compose file is malformed or uses something outside the supported subset."""


# ---------------------------------------------------------------------------------------------------------
# The YAML subset reader


_UNSUPPORTED_START = ("&", "*", "!", "|", ">", "{", "%", "@", "`")
_INT_RE = re.compile(r"[-+]?(0|[1-9][0-9]*)")
_FLOAT_RE = re.compile(r"[-+]?([0-9]+\.[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?")


@dataclass(frozen=True, slots=True)
class _Line:
    number: int
    indent: int
    text: str


def _strip_comment(raw: str, number: int) -> str:
    """Drop a ``#`` comment that is outside quotes (YAML: at line start or after whitespace)."""
    quote: str | None = None
    i = 0
    while i < len(raw):
        c = raw[i]
        if quote == '"':
            if c == "\\":
                i += 2
                continue
            if c == '"':
                quote = None
        elif quote == "'":
            if c == "'":
                if i + 1 < len(raw) and raw[i + 1] == "'":
                    i += 2
                    continue
                quote = None
        elif c in "\"'" and (i == 0 or raw[i - 1] in " \t[,:-"):
            quote = c
        elif c == "#" and (i == 0 or raw[i - 1] in " \t"):
            return raw[:i].rstrip()
        i += 1
    if quote is not None:
        raise ComposeError(f"line {number}: unterminated quoted string")
    return raw.rstrip()


def _lines(text: str) -> list[_Line]:
    out: list[_Line] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        body = _strip_comment(raw, number)
        if not body.strip():
            continue
        stripped = body.lstrip(" ")
        if stripped.startswith("\t") or "\t" in body[: len(body) - len(stripped) + 1]:
            raise ComposeError(f"line {number}: tabs are not allowed in indentation")
        if stripped in ("---", "...") or stripped.startswith("--- "):
            raise ComposeError(f"line {number}: multi-document files are not supported")
        out.append(_Line(number, len(body) - len(stripped), stripped))
    return out


def _parse_double_quoted(text: str, number: int) -> tuple[str, str]:
    """A double-quoted scalar at the start of ``text``; returns (value, rest). JSON escapes are a subset of
    YAML's and the only ones accepted here."""
    i = 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == '"':
            try:
                value = json.loads(text[: i + 1])
            except json.JSONDecodeError as exc:
                raise ComposeError(f"line {number}: unsupported escape in {text[: i + 1]}") from exc
            return str(value), text[i + 1 :]
        i += 1
    raise ComposeError(f"line {number}: unterminated double-quoted string")


def _parse_single_quoted(text: str, number: int) -> tuple[str, str]:
    i = 1
    parts: list[str] = []
    while i < len(text):
        if text[i] == "'":
            if i + 1 < len(text) and text[i + 1] == "'":
                parts.append("'")
                i += 2
                continue
            return "".join(parts), text[i + 1 :]
        parts.append(text[i])
        i += 1
    raise ComposeError(f"line {number}: unterminated single-quoted string")


def _plain_scalar(text: str, number: int) -> Any:
    if text.startswith(_UNSUPPORTED_START):
        raise ComposeError(f"line {number}: unsupported YAML construct {text[:20]!r}")
    if text in ("null", "~", "Null", "NULL"):
        return None
    if text in ("true", "True", "TRUE"):
        return True
    if text in ("false", "False", "FALSE"):
        return False
    if _INT_RE.fullmatch(text):
        return int(text)
    if _FLOAT_RE.fullmatch(text):
        return float(text)
    if ": " in text or text.endswith(":"):
        raise ComposeError(f"line {number}: a mapping value cannot start here: {text!r}")
    return text


def _parse_flow_sequence(text: str, number: int) -> list[Any]:
    """``[a, "b", 'c']`` on one line: scalars only, no nesting."""
    if not text.endswith("]"):
        raise ComposeError(f"line {number}: a flow sequence must close on the same line")
    body = text[1:-1].strip()
    items: list[Any] = []
    while body:
        if body.startswith('"'):
            value, body = _parse_double_quoted(body, number)
            items.append(value)
        elif body.startswith("'"):
            value, body = _parse_single_quoted(body, number)
            items.append(value)
        else:
            end = body.find(",")
            token = (body if end < 0 else body[:end]).strip()
            if not token or token.startswith(("[", "{")):
                raise ComposeError(f"line {number}: unsupported flow sequence item in {text!r}")
            items.append(_plain_scalar(token, number))
            body = "" if end < 0 else body[end:]
        body = body.strip()
        if body.startswith(","):
            body = body[1:].strip()
            if not body:
                raise ComposeError(f"line {number}: trailing comma in flow sequence")
        elif body:
            raise ComposeError(f"line {number}: expected ',' in flow sequence, got {body[:20]!r}")
    return items


def _parse_inline_value(text: str, number: int) -> Any:
    if text.startswith('"'):
        value, rest = _parse_double_quoted(text, number)
    elif text.startswith("'"):
        value, rest = _parse_single_quoted(text, number)
    elif text.startswith("["):
        return _parse_flow_sequence(text, number)
    else:
        return _plain_scalar(text, number)
    if rest.strip():
        raise ComposeError(f"line {number}: unexpected text after quoted scalar: {rest.strip()!r}")
    return value


def _split_key(text: str, number: int) -> tuple[str, str] | None:
    """``key: value`` -> (key, value text); None if ``text`` is not a mapping entry."""
    if text.startswith('"'):
        key, rest = _parse_double_quoted(text, number)
    elif text.startswith("'"):
        key, rest = _parse_single_quoted(text, number)
    else:
        m = re.match(r"([^\s:\"'#\[\]{},][^:#]*?)\s*:(\s|$)", text)
        if m is None:
            return None
        key = m.group(1)
        if key.startswith(_UNSUPPORTED_START) or key.startswith(("? ", "-")):
            raise ComposeError(f"line {number}: unsupported mapping key {key!r}")
        return key, text[m.end() :].strip()
    if not rest.startswith(":") or (len(rest) > 1 and rest[1] != " "):
        return None
    return key, rest[1:].strip()


class _SubsetParser:
    def __init__(self, lines: list[_Line]) -> None:
        self._lines = lines
        self._i = 0

    def parse(self) -> Any:
        if not self._lines:
            return None
        value = self._block(self._lines[0].indent)
        if self._i < len(self._lines):
            line = self._lines[self._i]
            raise ComposeError(f"line {line.number}: unexpected indentation")
        return value

    def _block(self, indent: int) -> Any:
        line = self._lines[self._i]
        if line.indent != indent:
            raise ComposeError(f"line {line.number}: unexpected indentation")
        if line.text == "-" or line.text.startswith("- "):
            return self._sequence(indent)
        return self._mapping(indent)

    def _nested_or_null(self, parent_indent: int, allow_same_indent_sequence: bool) -> Any:
        """The block under a ``key:`` with nothing after the colon."""
        if self._i >= len(self._lines):
            return None
        nxt = self._lines[self._i]
        if nxt.indent > parent_indent:
            return self._block(nxt.indent)
        if allow_same_indent_sequence and nxt.indent == parent_indent and nxt.text.startswith("- "):
            # YAML allows "key:\n- item" with the sequence at the key's own indentation.
            return self._sequence(parent_indent)
        return None

    def _mapping(self, indent: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        while self._i < len(self._lines):
            line = self._lines[self._i]
            if line.indent < indent:
                break
            if line.indent > indent:
                raise ComposeError(f"line {line.number}: unexpected indentation")
            if line.text.startswith("- ") or line.text == "-":
                break
            entry = _split_key(line.text, line.number)
            if entry is None:
                raise ComposeError(f"line {line.number}: expected 'key: value', got {line.text[:40]!r}")
            key, rest = entry
            if key in out:
                raise ComposeError(f"line {line.number}: duplicate key {key!r}")
            self._i += 1
            if rest:
                out[key] = _parse_inline_value(rest, line.number)
            else:
                out[key] = self._nested_or_null(indent, allow_same_indent_sequence=True)
        return out

    def _sequence(self, indent: int) -> list[Any]:
        out: list[Any] = []
        while self._i < len(self._lines):
            line = self._lines[self._i]
            if line.indent < indent:
                break
            if line.indent > indent:
                raise ComposeError(f"line {line.number}: unexpected indentation")
            if not (line.text.startswith("- ") or line.text == "-"):
                break
            item = line.text[1:].strip()
            self._i += 1
            if not item:
                out.append(self._nested_or_null(indent, allow_same_indent_sequence=False))
                continue
            entry = None if item.startswith(("'", '"', "[")) else _split_key(item, line.number)
            if entry is None:
                out.append(_parse_inline_value(item, line.number))
                continue
            # "- key: value" opens a mapping whose further keys sit at the item's column.
            child_indent = indent + (len(line.text) - len(item))
            self._lines[self._i - 1] = _Line(line.number, child_indent, item)
            self._i -= 1
            out.append(self._mapping(child_indent))
        return out


def parse_yaml_subset(text: str) -> Any:
    """Parse the YAML subset described in the module docstring into dicts, lists and scalars."""
    return _SubsetParser(_lines(text)).parse()


# ---------------------------------------------------------------------------------------------------------
# The compose model


_VAR_RE = re.compile(r"\$(?!\$)")


def _interpolate(value: str, where: str) -> str:
    """Compose interpolation: ``$$`` is a literal ``$``. Variable references are refused, because their
    value would come from whoever runs ``docker compose`` and the namespace cluster could not reproduce it."""
    if _VAR_RE.search(value.replace("$$", "")):
        raise ComposeError(f"{where}: variable interpolation is not supported, write $$ for a literal $")
    return value.replace("$$", "$")


def _str_list(value: Any, where: str) -> tuple[str, ...]:
    if isinstance(value, str):
        raise ComposeError(f"{where}: use the list form so arguments are unambiguous")
    if not isinstance(value, list) or not all(isinstance(v, str | int | float) for v in value):
        raise ComposeError(f"{where}: expected a list of strings")
    return tuple(_interpolate(str(v), where) for v in value)


@dataclass(frozen=True, slots=True)
class VolumeMount:
    source: str
    """A named volume, or a host path (starts with ``.`` or ``/``) for a bind mount."""
    target: str
    read_only: bool = False

    @property
    def is_named(self) -> bool:
        return not self.source.startswith((".", "/"))


@dataclass(frozen=True, slots=True)
class Healthcheck:
    test: tuple[str, ...]
    """argv run inside the service (compose ``CMD`` form; ``CMD-SHELL`` becomes ``sh -c``)."""
    interval_s: float = 30.0
    timeout_s: float = 30.0
    retries: int = 3
    start_period_s: float = 0.0

    @property
    def deadline_s(self) -> float:
        """How long compose would wait before calling the service unhealthy."""
        return self.start_period_s + self.retries * (self.interval_s + self.timeout_s)


@dataclass(frozen=True, slots=True)
class Service:
    name: str
    command: tuple[str, ...]
    environment: Mapping[str, str]
    networks: tuple[str, ...]
    volumes: tuple[VolumeMount, ...] = ()
    depends_on: Mapping[str, str] = field(default_factory=dict)
    """Service name -> compose condition (``service_started``, ``service_healthy``,
    ``service_completed_successfully``)."""
    restart_with: tuple[str, ...] = ()
    """Dependencies declared with ``restart: true``: when one of them is restarted, this service is restarted
    after it (compose semantics), e.g. a node that holds one session to its edge relay."""
    healthcheck: Healthcheck | None = None
    expose: tuple[str, ...] = ()
    """Ports as compose writes them (``4443/udp``, ``8000``)."""
    raw: Mapping[str, Any] = field(default_factory=dict)

    def exposed_ports(self, protocol: str) -> tuple[int, ...]:
        ports: list[int] = []
        for item in self.expose:
            port, _, proto = item.partition("/")
            if (proto or "tcp") == protocol:
                ports.append(int(port))
        return tuple(ports)


@dataclass(frozen=True, slots=True)
class ComposeProject:
    name: str
    services: Mapping[str, Service]
    networks: tuple[str, ...]
    volumes: tuple[str, ...]
    directory: Path

    def start_order(self) -> list[str]:
        """Services in dependency order (compose file order among independent ones)."""
        order: list[str] = []
        state: dict[str, str] = {}

        def visit(name: str, chain: tuple[str, ...]) -> None:
            if state.get(name) == "done":
                return
            if state.get(name) == "visiting":
                raise ComposeError(f"depends_on cycle: {' -> '.join((*chain, name))}")
            state[name] = "visiting"
            for dep in self.services[name].depends_on:
                visit(dep, (*chain, name))
            state[name] = "done"
            order.append(name)

        for name in self.services:
            visit(name, ())
        return order


_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: Any, where: str) -> float:
    """Compose durations: ``1m30s``, ``500ms``, ``2s``."""
    text = str(value)
    pos = 0
    total = 0.0
    for m in _DURATION_RE.finditer(text):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _DURATION_UNITS[m.group(2)]
        pos = m.end()
    if pos != len(text) or not text:
        raise ComposeError(f"{where}: invalid duration {text!r}")
    return total


_SERVICE_KEYS = {
    "image", "build", "command", "environment", "networks", "volumes", "depends_on", "healthcheck", "expose",
    "ports", "restart", "init", "stop_grace_period", "stop_signal", "tmpfs", "read_only", "profiles",
}


def _parse_healthcheck(value: Any, where: str) -> Healthcheck:
    if not isinstance(value, dict):
        raise ComposeError(f"{where}: expected a mapping")
    test = _str_list(value.get("test"), f"{where}.test")
    if test and test[0] == "CMD":
        argv = test[1:]
    elif test and test[0] == "CMD-SHELL" and len(test) == 2:
        argv = ("sh", "-c", test[1])
    else:
        raise ComposeError(f"{where}.test: must start with CMD or CMD-SHELL")
    return Healthcheck(
        test=argv,
        interval_s=parse_duration(value.get("interval", "30s"), f"{where}.interval"),
        timeout_s=parse_duration(value.get("timeout", "30s"), f"{where}.timeout"),
        retries=int(value.get("retries", 3)),
        start_period_s=parse_duration(value.get("start_period", "0s"), f"{where}.start_period"),
    )


def _parse_service(name: str, value: Any, networks: Sequence[str], volumes: Sequence[str]) -> Service:
    where = f"services.{name}"
    if not isinstance(value, dict):
        raise ComposeError(f"{where}: expected a mapping")
    unknown = set(value) - _SERVICE_KEYS
    if unknown:
        names = ", ".join(sorted(unknown))
        raise ComposeError(f"{where}: keys not supported by the namespace runner: {names}")
    if "image" not in value and "build" not in value:
        raise ComposeError(f"{where}: needs image or build")
    command = _str_list(value.get("command"), f"{where}.command")
    if not command:
        raise ComposeError(f"{where}.command: must not be empty")
    env_raw = value.get("environment") or {}
    if not isinstance(env_raw, dict):
        raise ComposeError(f"{where}.environment: use the mapping form")
    env = {str(k): _interpolate(str(v), f"{where}.environment.{k}") for k, v in env_raw.items()}
    nets_raw = value.get("networks") or []
    if not isinstance(nets_raw, list) or not all(isinstance(n, str) for n in nets_raw):
        raise ComposeError(f"{where}.networks: expected a list of network names")
    for net in nets_raw:
        if net not in networks:
            raise ComposeError(f"{where}.networks: {net!r} is not declared under top-level networks")
    if not nets_raw:
        raise ComposeError(f"{where}.networks: every service names its networks explicitly")
    mounts: list[VolumeMount] = []
    for item in value.get("volumes") or []:
        parts = str(item).split(":")
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in ("ro", "rw")):
            raise ComposeError(f"{where}.volumes: expected SOURCE:TARGET[:ro|rw], got {item!r}")
        mount = VolumeMount(parts[0], parts[1], read_only=len(parts) == 3 and parts[2] == "ro")
        if mount.is_named and mount.source not in volumes:
            raise ComposeError(f"{where}.volumes: {mount.source!r} is not declared under top-level volumes")
        mounts.append(mount)
    deps_raw = value.get("depends_on") or {}
    restart_with: list[str] = []
    if isinstance(deps_raw, list):
        deps = {str(d): "service_started" for d in deps_raw}
    elif isinstance(deps_raw, dict):
        deps = {}
        for dep, spec in deps_raw.items():
            spec = spec if isinstance(spec, dict) else {}
            unknown_keys = set(spec) - {"condition", "restart"}
            if unknown_keys:
                names = ", ".join(sorted(unknown_keys))
                raise ComposeError(f"{where}.depends_on.{dep}: unsupported keys: {names}")
            cond = spec.get("condition", "service_started")
            if cond not in ("service_started", "service_healthy", "service_completed_successfully"):
                raise ComposeError(f"{where}.depends_on.{dep}: unknown condition {cond!r}")
            restart = spec.get("restart", False)
            if not isinstance(restart, bool):
                raise ComposeError(f"{where}.depends_on.{dep}.restart: expected true or false")
            deps[str(dep)] = str(cond)
            if restart:
                restart_with.append(str(dep))
    else:
        raise ComposeError(f"{where}.depends_on: expected a list or mapping")
    hc = value.get("healthcheck")
    expose = tuple(str(p) for p in value.get("expose") or [])
    return Service(
        name=name,
        command=command,
        environment=env,
        networks=tuple(nets_raw),
        volumes=tuple(mounts),
        depends_on=deps,
        restart_with=tuple(restart_with),
        healthcheck=_parse_healthcheck(hc, f"{where}.healthcheck") if hc is not None else None,
        expose=expose,
        raw=value,
    )


def load_compose(path: Path | str) -> ComposeProject:
    """Read and check a compose file written in the supported subset."""
    path = Path(path)
    doc = parse_yaml_subset(path.read_text(encoding="utf-8"))
    if not isinstance(doc, dict) or not isinstance(doc.get("services"), dict):
        raise ComposeError(f"{path}: expected a top-level 'services' mapping")
    unknown = set(doc) - {"name", "services", "networks", "volumes"}
    if unknown:
        raise ComposeError(f"{path}: unsupported top-level keys: {', '.join(sorted(unknown))}")
    networks = tuple(doc.get("networks") or {})
    volumes = tuple(doc.get("volumes") or {})
    services = {str(n): _parse_service(str(n), v, networks, volumes) for n, v in doc["services"].items()}
    for svc in services.values():
        for dep in svc.depends_on:
            if dep not in services:
                raise ComposeError(f"services.{svc.name}.depends_on: unknown service {dep!r}")
            if svc.depends_on[dep] == "service_healthy" and services[dep].healthcheck is None:
                raise ComposeError(f"services.{svc.name}.depends_on.{dep}: {dep} has no healthcheck")
    project = ComposeProject(
        name=str(doc.get("name", path.parent.name)),
        services=services,
        networks=networks,
        volumes=volumes,
        directory=path.parent.resolve(),
    )
    project.start_order()  # raises on cycles
    return project
