"""Run the services of the project's ``docker-compose.yml`` as processes in Linux network namespaces.

Owns:

* ``parse_yaml_subset`` — a reader for the strict YAML subset the compose file is written in (block mappings
  and sequences, quoted and plain scalars, one-line flow sequences, comments). Anything outside the subset
  raises ``ComposeError`` naming the line, so the compose file stays the one source of truth for both the
  container demo and the namespace cluster without a YAML dependency, and never silently means something
  else to us than to Docker Compose.
* ``load_compose`` — the compose model: services (command, environment, networks, volumes, depends_on,
  healthcheck, exposed ports), networks and volumes, with compose's ``$$`` escape applied.
* ``plan_cluster`` — a pure function from that model to a namespace topology: one namespace per service,
  one bridge per compose network (all bridges live in one switch namespace, so the root namespace is never
  touched), one veth pair per (service, network), addresses from a private range, a hosts file per namespace
  that maps service names to addresses as compose's DNS would, and a link emulator namespace inserted on each
  impaired client->server path (the client's hosts file points the server's name at the emulator, so the
  compose command runs unchanged and TLS still verifies the server's name).
* ``NetnsCluster`` — creates that topology, starts each service's compose command in its namespace in
  dependency order (waiting for health checks and one-shot init services as compose does), logs each
  service to ``RUN_DIR/logs/SERVICE.log``, and tears everything down by name prefix, idempotently.

Must not know: what the services are. They are argv lists read from the compose file; this module never
imports the relay or the nodes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# Where `ip netns exec NAME` finds files it bind-mounts over /etc (iproute2 convention).
NETNS_ETC = Path("/etc/netns")
# Every namespace, per-namespace /etc directory and process of one cluster carries this prefix.
DEFAULT_PREFIX = "kvnc"
# Private range used only on links inside our own namespaces: network i gets 10.77.(i+1).0/24.
DEFAULT_SUBNET_BASE = "10.77"
SWITCH_SUFFIX = "sw"
EMULATOR_HOST_BASE = 200
SERVICE_HOST_BASE = 10
# Environment variable set on every process we start, so our processes can be recognised.
CLUSTER_ENV = "KVNET_CLUSTER"


class ComposeError(ValueError):
    """The compose file is malformed or uses something outside the supported subset."""


class ClusterError(RuntimeError):
    """Building or running the namespace cluster failed."""


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


# ---------------------------------------------------------------------------------------------------------
# Topology plan (pure)


@dataclass(frozen=True, slots=True)
class LinkShape:
    """Impairment of the path from ``client`` to ``server`` (both compose services on one network), applied
    by a ``kvnet linkemu`` process in its own namespace on that path. Values are per direction."""

    client: str
    server: str
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0
    reorder: float = 0.0
    rate_bytes_per_s: float = 0.0
    """0 = no rate limit in the emulator (``NetnsCluster.limit_rate`` limits access links with tc instead)."""
    seed: int = 1

    def linkemu_args(self) -> list[str]:
        args = ["--delay-ms", repr(self.delay_ms), "--loss", repr(self.loss), "--seed", str(self.seed)]
        if self.jitter_ms:
            args += ["--jitter-ms", repr(self.jitter_ms)]
        if self.reorder:
            args += ["--reorder", repr(self.reorder)]
        if self.rate_bytes_per_s:
            args += ["--rate", repr(self.rate_bytes_per_s)]
        return args


@dataclass(frozen=True, slots=True)
class Interface:
    namespace: str
    name: str
    """Interface name inside ``namespace``."""
    switch_port: str
    """Name of the peer end on the bridge in the switch namespace."""
    network: str
    address: str


@dataclass(frozen=True, slots=True)
class Emulator:
    link: LinkShape
    namespace: str
    interface: Interface
    target: str
    """Server address on the shared network."""
    udp_ports: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ClusterPlan:
    prefix: str
    switch_namespace: str
    bridges: Mapping[str, str]
    """Compose network -> bridge name in the switch namespace."""
    namespaces: Mapping[str, str]
    """Service -> namespace."""
    interfaces: tuple[Interface, ...]
    emulators: tuple[Emulator, ...]
    hosts: Mapping[str, Mapping[str, str]]
    """Namespace -> {service name: address} as seen from inside it."""

    def address(self, service: str, network: str | None = None) -> str:
        for itf in self.interfaces:
            if itf.namespace == self.namespaces[service] and network in (None, itf.network):
                return itf.address
        raise KeyError(f"{service} has no address on {network}")

    def all_namespaces(self) -> list[str]:
        return [self.switch_namespace, *self.namespaces.values(), *(e.namespace for e in self.emulators)]


def _check_prefix(prefix: str) -> None:
    if not re.fullmatch(r"[a-z][a-z0-9]{1,9}", prefix):
        raise ValueError(f"prefix must be 2-10 lowercase letters/digits, starting with a letter: {prefix!r}")


def plan_cluster(
    project: ComposeProject,
    prefix: str = DEFAULT_PREFIX,
    links: Sequence[LinkShape] = (),
    subnet_base: str = DEFAULT_SUBNET_BASE,
) -> ClusterPlan:
    """Namespaces, interfaces, addresses, hosts files and emulators for ``project``."""
    _check_prefix(prefix)
    if len(project.networks) > 200 or len(project.services) > 180:
        raise ValueError("too many networks or services for the address plan")
    switch = f"{prefix}-{SWITCH_SUFFIX}"
    bridges = {net: f"br{i}" for i, net in enumerate(project.networks)}
    subnet = {net: f"{subnet_base}.{i + 1}" for i, net in enumerate(project.networks)}
    namespaces = {name: f"{prefix}-{name}" for name in project.services}
    interfaces: list[Interface] = []
    host_count = dict.fromkeys(project.networks, SERVICE_HOST_BASE)
    for s_idx, (name, svc) in enumerate(project.services.items()):
        for n_idx, net in enumerate(svc.networks):
            addr = f"{subnet[net]}.{host_count[net]}"
            host_count[net] += 1
            interfaces.append(Interface(namespaces[name], f"eth{n_idx}", f"s{s_idx}n{n_idx}", net, addr))

    def addr_of(service: str, network: str) -> str:
        ns = namespaces[service]
        return next(i.address for i in interfaces if i.namespace == ns and i.network == network)

    emulators: list[Emulator] = []
    redirects: dict[tuple[str, str], str] = {}
    for e_idx, link in enumerate(links):
        for who in (link.client, link.server):
            if who not in project.services:
                raise ValueError(f"link {link.client}->{link.server}: unknown service {who!r}")
        server_nets = project.services[link.server].networks
        shared = [n for n in project.services[link.client].networks if n in server_nets]
        if not shared:
            raise ValueError(f"link {link.client}->{link.server}: the services share no network")
        if (link.client, link.server) in redirects:
            raise ValueError(f"link {link.client}->{link.server} given twice")
        ports = project.services[link.server].exposed_ports("udp")
        if not ports:
            raise ValueError(f"link {link.client}->{link.server}: {link.server} exposes no UDP port")
        net = shared[0]
        ns = f"{prefix}-emu{e_idx}"
        itf = Interface(ns, "eth0", f"e{e_idx}", net, f"{subnet[net]}.{EMULATOR_HOST_BASE + e_idx}")
        emulators.append(Emulator(link, ns, itf, addr_of(link.server, net), ports))
        redirects[(link.client, link.server)] = itf.address
    hosts: dict[str, dict[str, str]] = {}
    for name, svc in project.services.items():
        table: dict[str, str] = {name: addr_of(name, svc.networks[0])}
        for other, osvc in project.services.items():
            shared = [n for n in svc.networks if n in osvc.networks]
            if other == name or not shared:
                continue  # compose DNS only resolves services on a shared network
            table[other] = redirects.get((name, other), addr_of(other, shared[0]))
        hosts[namespaces[name]] = table
    return ClusterPlan(
        prefix=prefix,
        switch_namespace=switch,
        bridges=bridges,
        namespaces=namespaces,
        interfaces=tuple(interfaces),
        emulators=tuple(emulators),
        hosts=hosts,
    )


def map_paths(value: str, mounts: Mapping[str, Path]) -> str:
    """Replace container mount points (``/certs``, ``/certs/ca.pem``, ``--ca=/certs/ca.pem``, and the same
    inside ``sh -c`` strings) with the host directories that stand in for them."""
    for target, host in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
        pattern = re.compile(r"(?<![\w./-])" + re.escape(target.rstrip("/")) + r"(?=$|[/\s;&|'\"])")
        replacement = str(host).replace("\\", "\\\\")
        value = pattern.sub(replacement, value)
    return value


def mount_map(project: ComposeProject, run_dir: Path, service: str) -> dict[str, Path]:
    """Container mount point -> host directory standing in for it (named volumes live in the run dir)."""
    out: dict[str, Path] = {}
    for m in project.services[service].volumes:
        host = run_dir / "volumes" / m.source if m.is_named else (project.directory / m.source).resolve()
        out[m.target] = host
    return out


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    """How one compose service is started in its namespace."""

    service: str
    namespace: str
    argv: tuple[str, ...]
    """The compose command after mount-point mapping."""
    env: Mapping[str, str]
    cwd: Path
    healthcheck: tuple[str, ...] | None


def launch_spec(project: ComposeProject, plan: ClusterPlan, run_dir: Path, service: str) -> LaunchSpec:
    """The argv/env/cwd a compose service runs with in the namespace cluster (pure; used by the sync test)."""
    svc = project.services[service]
    mounts = mount_map(project, run_dir, service)
    argv = tuple(map_paths(a, mounts) for a in svc.command)
    env = {k: map_paths(v, mounts) for k, v in svc.environment.items()}
    hc = tuple(map_paths(a, mounts) for a in svc.healthcheck.test) if svc.healthcheck else None
    return LaunchSpec(service, plan.namespaces[service], argv, env, run_dir / "work" / service, hc)


# ---------------------------------------------------------------------------------------------------------
# Running it


def _run(argv: Sequence[str], check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise ClusterError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def netns_available() -> str | None:
    """None if this process can build namespace clusters, else the reason it cannot."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 'ip' is not installed"
    probe = f"kvnprobe{os.getpid()}"
    try:
        proc = _run(["ip", "netns", "add", probe], check=False)
        if proc.returncode != 0:
            return f"'ip netns add' failed: {proc.stderr.strip()}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return None


def list_namespaces(prefix: str) -> list[str]:
    """Namespaces of the cluster with ``prefix`` (exact ``PREFIX-`` match, so kvnc never matches kvnc2)."""
    proc = _run(["ip", "netns", "list"], check=False)
    names = [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]
    return [n for n in names if n.startswith(prefix + "-")]


def _namespace_pids(namespace: str) -> list[int]:
    proc = _run(["ip", "netns", "pids", namespace], check=False)
    return [int(p) for p in proc.stdout.split() if p.isdigit()]


def teardown(prefix: str, grace_s: float = 5.0) -> list[str]:
    """Stop every process in the cluster's namespaces, delete the namespaces and their /etc files.

    Idempotent; finds leftovers by name prefix alone, so it also cleans up after a crashed run.
    Returns the namespaces that were removed.
    """
    _check_prefix(prefix)
    namespaces = list_namespaces(prefix)
    # Only processes inside our own namespaces are signalled: `ip netns pids` lists exactly those.
    pids = {p for ns in namespaces for p in _namespace_pids(ns)}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 2.0)
        while pids and time.monotonic() < deadline:
            pids = {p for p in pids if Path(f"/proc/{p}").exists() and not _is_zombie(p)}
            if pids:
                time.sleep(0.05)
        if not pids:
            break
    for ns in namespaces:
        _run(["ip", "netns", "del", ns], check=False)
    if NETNS_ETC.is_dir():
        for d in NETNS_ETC.glob(f"{prefix}-*"):
            shutil.rmtree(d, ignore_errors=True)
        with contextlib.suppress(OSError):
            NETNS_ETC.rmdir()  # only succeeds when no one else keeps files there
    return namespaces


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] == "Z"


@dataclass
class _Running:
    spec: LaunchSpec
    proc: subprocess.Popen[bytes]
    log: Path


class NetnsCluster:
    """A compose project running as processes in network namespaces.

    ``up()`` builds the topology and starts every service; ``down()`` undoes everything and is safe to call
    any number of times (also from another process, via ``teardown(prefix)``).
    """

    def __init__(
        self,
        project: ComposeProject,
        run_dir: Path,
        prefix: str = DEFAULT_PREFIX,
        links: Sequence[LinkShape] = (),
        bin_dir: Path | None = None,
        health_poll_s: float = 0.25,
    ) -> None:
        self.project = project
        self.run_dir = run_dir.resolve()
        self.plan = plan_cluster(project, prefix, links)
        # Console scripts (kvnet-relay, ...) come from the environment this module runs in.
        self.bin_dir = bin_dir or Path(sys.executable).parent
        self.health_poll_s = health_poll_s
        self._running: dict[str, _Running] = {}
        self._emulators: list[subprocess.Popen[bytes]] = []

    @property
    def prefix(self) -> str:
        return self.plan.prefix

    # -- topology --------------------------------------------------------------------------------------

    def _ip(self, namespace: str, *args: str) -> None:
        _run(["ip", "-n", namespace, *args])

    def _add_interface(self, itf: Interface) -> None:
        sw = self.plan.switch_namespace
        # Both ends are created from the switch namespace, so no interface ever appears in the root one.
        peer = ("peer", "name", itf.name, "netns", itf.namespace)
        self._ip(sw, "link", "add", itf.switch_port, "type", "veth", *peer)
        self._ip(sw, "link", "set", itf.switch_port, "master", self.plan.bridges[itf.network], "up")
        self._ip(itf.namespace, "addr", "add", f"{itf.address}/24", "dev", itf.name)
        self._ip(itf.namespace, "link", "set", itf.name, "up")

    def _write_hosts(self, namespace: str, table: Mapping[str, str]) -> None:
        etc = NETNS_ETC / namespace
        etc.mkdir(parents=True, exist_ok=True)
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost"]
        lines += [f"{addr} {name}" for name, addr in table.items()]
        (etc / "hosts").write_text("\n".join(lines) + "\n")

    def build_topology(self) -> None:
        if list_namespaces(self.prefix):
            raise ClusterError(f"a cluster with prefix {self.prefix!r} exists; run 'down' first")
        for ns in self.plan.all_namespaces():
            _run(["ip", "netns", "add", ns])
            self._ip(ns, "link", "set", "lo", "up")
        for bridge in self.plan.bridges.values():
            self._ip(self.plan.switch_namespace, "link", "add", bridge, "type", "bridge")
            self._ip(self.plan.switch_namespace, "link", "set", bridge, "up")
        for itf in self.plan.interfaces:
            self._add_interface(itf)
        for emu in self.plan.emulators:
            self._add_interface(emu.interface)
        for ns, table in self.plan.hosts.items():
            self._write_hosts(ns, table)

    # -- processes ---------------------------------------------------------------------------------------

    def base_env(self) -> dict[str, str]:
        dirs = [str(self.bin_dir), "/usr/local/bin", "/usr/bin", "/bin", "/usr/sbin", "/sbin"]
        path = os.pathsep.join(dirs)
        env = {
            "PATH": path,
            "HOME": str(self.run_dir),
            "LANG": "C.UTF-8",
            "PYTHONUNBUFFERED": "1",
            CLUSTER_ENV: self.prefix,
        }
        return env

    def spec(self, service: str) -> LaunchSpec:
        return launch_spec(self.project, self.plan, self.run_dir, service)

    def _popen(self, namespace: str, argv: Sequence[str], env: Mapping[str, str], cwd: Path, log: Path) -> (
        subprocess.Popen[bytes]
    ):
        log.parent.mkdir(parents=True, exist_ok=True)
        cwd.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            out.write(f"== {time.strftime('%H:%M:%S')} start: {' '.join(argv)}\n".encode())
            out.flush()
            return subprocess.Popen(
                ["ip", "netns", "exec", namespace, *argv],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=dict(env),
                cwd=cwd,
                start_new_session=True,  # own process group: a stop signals the service, not us
            )

    def start_emulators(self) -> None:
        for emu in self.plan.emulators:
            for port in emu.udp_ports:
                argv = [
                    "kvnet", "linkemu", "--listen", f"0.0.0.0:{port}", "--target", f"{emu.target}:{port}",
                    *emu.link.linkemu_args(),
                ]
                log = self.run_dir / "logs" / f"linkemu-{emu.link.client}-{emu.link.server}-{port}.log"
                self._emulators.append(self._popen(emu.namespace, argv, self.base_env(), self.run_dir, log))

    def start_service(self, service: str) -> None:
        """Start one service (again) with its compose command; does not wait for health."""
        if service in self._running and self._running[service].proc.poll() is None:
            raise ClusterError(f"{service} is already running")
        spec = self.spec(service)
        # Each service gets its own HOME (like its own container), so per-user state never collides.
        env = {**self.base_env(), "HOME": str(spec.cwd), **spec.env}
        log = self.run_dir / "logs" / f"{service}.log"
        proc = self._popen(spec.namespace, spec.argv, env, spec.cwd, log)
        self._running[service] = _Running(spec, proc, log)
        self._save_state()

    def stop_service(self, service: str, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> int | None:
        """Signal a service's process group and wait for it; SIGKILL after ``timeout_s``."""
        run = self._running.get(service)
        if run is None or run.proc.poll() is not None:
            return None if run is None else run.proc.returncode
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.proc.pid, sig)
        try:
            return run.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(run.proc.pid, signal.SIGKILL)
            return run.proc.wait(5.0)

    def is_running(self, service: str) -> bool:
        run = self._running.get(service)
        return run is not None and run.proc.poll() is None

    def log_tail(self, service: str, lines: int = 30) -> str:
        path = self.run_dir / "logs" / f"{service}.log"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def diagnostics(self, names: Sequence[str] | None = None, lines: int = 15, width: int = 500) -> str:
        """Tails of the cluster's logs (services, link emulators, spawned processes) for failure messages;
        ``names`` selects logs by file stem (``edge-b``, ``abr-publisher``), default all."""
        parts: list[str] = []
        for path in sorted((self.run_dir / "logs").glob("*.log")):
            if names is not None and path.stem not in names:
                continue
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {path.name} (last {len(tail)} lines)\n" + "\n".join(x[:width] for x in tail))
        return "\n".join(parts)

    def _one_shot(self, service: str) -> bool:
        """An init service (others wait for it to exit 0), never restarted by ``recover``."""
        conditions = [s.depends_on.get(service) for s in self.project.services.values()]
        return "service_completed_successfully" in conditions

    def probe(self, service: str, attempts: int = 3) -> bool:
        """True if ``service`` runs and passes its compose healthcheck in one of ``attempts`` tries."""
        for i in range(attempts):
            if not self.is_running(service):
                return False
            if self._healthy(service):
                return True
            if i + 1 < attempts:
                time.sleep(2 * self.health_poll_s)
        return False

    def recover(self) -> list[str]:
        """Bring the cluster back to what ``up`` left: restart every long-running service that exited or
        fails its healthcheck, and after it every service that declared ``restart: true`` on a restarted
        one (compose semantics), in dependency order; wait until all are healthy. Returns what restarted."""
        order = [name for name in self.project.start_order() if not self._one_shot(name)]
        restart: list[str] = []
        for name in order:
            svc = self.project.services[name]
            if any(dep in restart for dep in svc.restart_with) or not self.probe(name):
                restart.append(name)
        for name in reversed(restart):
            self.stop_service(name)
        for name in restart:
            for dep, cond in self.project.services[name].depends_on.items():
                self.wait_ready(dep, cond)
            logger.info("recover: restarting %s", name)
            self.start_service(name)
        for name in restart:
            self.wait_ready(name)
        return restart

    def exec(
        self, service: str, argv: Sequence[str], timeout_s: float = 60.0, env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run a command in a service's namespace with its environment (``docker compose exec``)."""
        spec = self.spec(service)
        full_env = {**self.base_env(), "HOME": str(spec.cwd), **spec.env, **(env or {})}
        # Paths like /certs/ca.pem mean the same inside `exec` as in the service's own command.
        mapped = [map_paths(a, mount_map(self.project, self.run_dir, service)) for a in argv]
        spec.cwd.mkdir(parents=True, exist_ok=True)
        return subprocess.run(
            ["ip", "netns", "exec", spec.namespace, *mapped],
            capture_output=True,
            text=True,
            env=full_env,
            cwd=spec.cwd,
            timeout=timeout_s,
            check=False,
        )

    def _healthy(self, service: str) -> bool:
        spec = self.spec(service)
        svc = self.project.services[service]
        if spec.healthcheck is None or svc.healthcheck is None:
            return True
        try:
            proc = self.exec(service, spec.healthcheck, timeout_s=max(svc.healthcheck.timeout_s, 1.0))
        except subprocess.TimeoutExpired:
            return False
        return proc.returncode == 0

    def wait_ready(self, service: str, condition: str = "service_healthy") -> None:
        """Block until ``service`` meets a compose depends_on condition; raise with its log if it can't."""
        run = self._running[service]
        svc = self.project.services[service]
        if condition == "service_completed_successfully":
            try:
                rc = run.proc.wait(120.0)
            except subprocess.TimeoutExpired:
                raise ClusterError(f"{service} did not finish:\n{self.log_tail(service)}") from None
            if rc != 0:
                raise ClusterError(f"{service} exited with {rc}:\n{self.log_tail(service)}")
            return
        if condition == "service_started" or svc.healthcheck is None:
            return
        deadline = time.monotonic() + svc.healthcheck.deadline_s
        while True:
            if run.proc.poll() is not None:
                raise ClusterError(f"{service} exited with {run.proc.returncode}:\n{self.log_tail(service)}")
            if self._healthy(service):
                return
            if time.monotonic() > deadline:
                raise ClusterError(f"{service} not healthy in {svc.healthcheck.deadline_s:.0f}s:\n"
                                   f"{self.log_tail(service)}")
            # Compose polls every `interval`; polling faster only makes start-up quicker, never different.
            time.sleep(self.health_poll_s)

    def start_all(self) -> None:
        """Start services in dependency order, honouring each depends_on condition."""
        for name in self.project.start_order():
            for dep, cond in self.project.services[name].depends_on.items():
                self.wait_ready(dep, cond)
            self.start_service(name)
        for name in self.project.services:
            if self.project.services[name].healthcheck is not None:
                self.wait_ready(name)

    def _interface(self, service: str, network: str) -> Interface:
        ns = self.plan.namespaces[service]
        return next(i for i in self.plan.interfaces if i.namespace == ns and i.network == network)

    def limit_rate(self, service: str, network: str, rate_bit: int, burst_bytes: int = 16384) -> None:
        """Token-bucket limit (tc tbf) on the service's access link, both directions."""
        itf = self._interface(service, network)
        for ns, dev in ((self.plan.switch_namespace, itf.switch_port), (itf.namespace, itf.name)):
            _run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate_bit}bit",
                  "burst", str(burst_bytes), "latency", "200ms"])

    def clear_rate(self, service: str, network: str) -> None:
        itf = self._interface(service, network)
        for ns, dev in ((self.plan.switch_namespace, itf.switch_port), (itf.namespace, itf.name)):
            _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)

    def _save_state(self) -> None:
        state = {
            "prefix": self.prefix,
            "namespaces": self.plan.namespaces,
            "addresses": {i.namespace: i.address for i in self.plan.interfaces},
            "pids": {name: run.proc.pid for name, run in self._running.items()},
            "emulator_pids": [p.pid for p in self._emulators],
        }
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "state.json").write_text(json.dumps(state, indent=2) + "\n")

    def up(self) -> None:
        """Build the topology and start everything; on any failure (or interrupt) tear down and re-raise."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.build_topology()
            self.start_emulators()
            self.start_all()
            self._save_state()
        except BaseException:
            self.down()
            raise

    def down(self, grace_s: float = 6.0) -> None:
        """Stop everything (all at once: relays drain for up to their ``--drain-timeout``), SIGKILL what is
        left after ``grace_s``, remove the namespaces."""
        procs = [*(r.proc for r in self._running.values()), *self._emulators]
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
        teardown(self.prefix, grace_s=1.0)
        # Reap whatever teardown had to kill so no zombie outlives us.
        for proc in [*(r.proc for r in self._running.values()), *self._emulators]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(2.0)

    def __enter__(self) -> NetnsCluster:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def spawn(self, service: str, argv: Sequence[str], log_name: str) -> subprocess.Popen[bytes]:
        """Start an extra background process in a service's namespace (a second node, a one-shot publisher
        that must keep serving); the caller stops it with ``stop_process``. ``down`` kills it regardless,
        since it lives in one of our namespaces."""
        spec = self.spec(service)
        mapped = [map_paths(a, mount_map(self.project, self.run_dir, service)) for a in argv]
        env = {**self.base_env(), "HOME": str(spec.cwd), **spec.env}
        return self._popen(spec.namespace, mapped, env, spec.cwd, self.run_dir / "logs" / f"{log_name}.log")

    def http_json(
        self,
        service: str,
        port: int,
        path: str,
        body: Mapping[str, Any] | None = None,
        timeout_s: float = 60.0,
    ) -> Any:
        """GET (or POST ``body`` as JSON) ``http://127.0.0.1:PORT/PATH`` inside a service's namespace."""
        script = (
            "import json, sys, urllib.request\n"
            "url, body, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])\n"
            "data = body.encode() if body else None\n"
            "req = urllib.request.Request(url, data=data, headers={'Content-Type': 'application/json'})\n"
            "sys.stdout.write(urllib.request.urlopen(req, timeout=timeout).read().decode())\n"
        )
        url = f"http://127.0.0.1:{port}{path}"
        payload = json.dumps(body) if body is not None else ""
        argv = ["python", "-c", script, url, payload, str(timeout_s)]
        proc = self.exec(service, argv, timeout_s=timeout_s + 10)
        if proc.returncode != 0:
            raise ClusterError(f"{service}: HTTP {path} failed: {proc.stderr.strip()[-2000:]}")
        text = proc.stdout
        return text if path.endswith("/metrics") else json.loads(text)


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> int:
    """SIGTERM a process group we started, SIGKILL after ``timeout_s``; returns the exit status."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    return proc.wait(5.0)


def upstream_links(project: ComposeProject, **shape: Any) -> list[LinkShape]:
    """One impaired link per relay chaining: every ``--upstream moqt://HOST:PORT`` whose HOST is a compose
    service becomes ``LinkShape(client=that relay, server=HOST, **shape)`` (the origin<->edge paths)."""
    links: list[LinkShape] = []
    for name, svc in project.services.items():
        args = list(svc.command)
        for i, arg in enumerate(args[:-1]):
            if arg != "--upstream":
                continue
            m = re.fullmatch(r"moqt://([^:/\[\]]+)(?::\d+)?/?", args[i + 1])
            if m and m.group(1) in project.services:
                links.append(LinkShape(client=name, server=m.group(1), seed=len(links) + 1, **shape))
    return links


def parse_prometheus(text: str) -> dict[str, float]:
    """``{'name{labels}': value}`` from the Prometheus text format (comments skipped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            out[key] = float(value)
    return out


# ---------------------------------------------------------------------------------------------------------
# The smoke check (also the one-line demo of docs/cluster.md)

SMOKE_PROMPT = (
    "You are a careful assistant for the kvnet cluster. The shared context below is the same for every user "
    "of this deployment, so its KV cache is computed once and fetched by everyone else. " * 3
)


def subscriber_argv(edge: str, prompt: str, *extra: str) -> list[str]:
    """The one-shot subscriber command run inside a subscriber service (``docker compose exec sub-b ...``)."""
    return [
        "kvnet-subscriber", "--relay", f"moqt://{edge}:4443", "--ca", "/certs/ca.pem",
        "--trust", "/keys/pub-a", "--trust", "/keys/pub-b", "--abr", "fetch",
        "--prompt", prompt, "--json", "--verify", *extra,
    ]


def run_smoke(cluster: NetnsCluster, prompt: str = SMOKE_PROMPT) -> dict[str, Any]:
    """Publish ``prompt`` at pub-a (site a), ask for it from sub-b (site b, through both edges and the origin)
    and check the verified remote hit. Returns the subscriber's report."""
    published = cluster.http_json("pub-a", 8000, "/v1/completions", {"prompt": prompt, "max_tokens": 4})
    logger.info("pub-a answered: %s", json.dumps(published.get("usage", {})))
    argv = subscriber_argv("edge-b", prompt + " Question: what is kvnet?")
    proc = cluster.exec("sub-b", argv, timeout_s=120)
    if proc.returncode != 0:
        raise ClusterError(f"subscriber failed ({proc.returncode}): {proc.stderr.strip()[-3000:]}")
    report: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    if report.get("verified") is not True or report.get("remote_hit_tokens", 0) <= 0:
        raise ClusterError(f"no verified remote hit: {json.dumps(report)}")
    return report


# ---------------------------------------------------------------------------------------------------------
# Command line (scripts/netns-cluster)


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="netns-cluster",
        description="Run docker-compose.yml's services as processes in Linux network namespaces (root).",
    )
    p.add_argument("command", choices=("up", "smoke", "down", "status"))
    p.add_argument("--compose", type=Path, default=Path("docker-compose.yml"), help="compose file")
    p.add_argument("--run-dir", type=Path, default=Path("run/netns-cluster"), help="logs, volumes, state")
    p.add_argument("--prefix", default=DEFAULT_PREFIX, help="name prefix of namespaces (unique per cluster)")
    p.add_argument("--delay-ms", type=float, default=10.0, help="one-way delay on each origin<->edge path")
    p.add_argument("--jitter-ms", type=float, default=0.0)
    p.add_argument("--loss", type=float, default=0.01, help="loss probability per direction")
    p.add_argument("--reorder", type=float, default=0.0)
    p.add_argument("--rate-mbit", type=float, default=0.0, help="origin<->edge rate limit (0 = none)")
    return p


def _raise_interrupt(signum: int, _frame: object) -> None:
    # SIGTERM/SIGHUP take the same path as Ctrl-C, so every `finally` and `except BaseException` tears down.
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupt)
    if args.command == "down":
        removed = teardown(args.prefix)
        print(f"removed {len(removed)} namespaces" + (f": {' '.join(removed)}" if removed else ""))
        return 0
    if args.command == "status":
        names = list_namespaces(args.prefix)
        print("\n".join(names) if names else f"no cluster with prefix {args.prefix!r}")
        return 0
    reason = netns_available()
    if reason is not None:
        print(f"netns-cluster: {reason}", file=sys.stderr)
        return 2
    project = load_compose(args.compose)
    shape = {
        "delay_ms": args.delay_ms,
        "jitter_ms": args.jitter_ms,
        "loss": args.loss,
        "reorder": args.reorder,
        "rate_bytes_per_s": args.rate_mbit * 1e6 / 8,
    }
    cluster = NetnsCluster(project, args.run_dir, args.prefix, upstream_links(project, **shape))
    try:
        if args.command == "up":
            cluster.up()
            print(f"cluster {args.prefix!r} is up; logs in {cluster.run_dir / 'logs'}")
            for name in project.services:
                ns = cluster.plan.namespaces[name]
                addrs = [i.address for i in cluster.plan.interfaces if i.namespace == ns]
                print(f"  {name:8} {ns:20} {' '.join(addrs)}")
            return 0
        already_up = bool(list_namespaces(args.prefix))
        if not already_up:
            cluster.up()
        try:
            report = run_smoke(cluster)
        finally:
            if not already_up:
                cluster.down()
        hit, total = report["remote_hit_tokens"], report["prompt_tokens"]
        print(f"smoke ok: remote hit {hit} of {total} tokens, verified")
        return 0
    except KeyboardInterrupt:
        print("interrupted; cluster torn down", file=sys.stderr)
        return 130
    except (ClusterError, ComposeError, OSError, subprocess.TimeoutExpired) as exc:
        print(f"netns-cluster: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
