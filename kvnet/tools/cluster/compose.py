"""The compose model of ``docker-compose.yml``, read with PyYAML.

* ``parse_yaml`` — one YAML document through PyYAML's safe loader, refusing repeated keys (which Docker
  Compose refuses too) and naming the line of any error, so the compose file stays the one source of truth
  for both the container demo and the namespace cluster.
* ``load_compose`` — the compose model: services (command, environment, networks, volumes, depends_on,
  healthcheck, exposed ports), networks and volumes, with compose's ``$$`` escape applied. Services listed
  under ``profiles`` are left out unless one of their profiles is asked for, as ``docker compose`` does.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ComposeError(ValueError):
    """The compose file is malformed or uses something outside the supported subset."""


# ---------------------------------------------------------------------------------------------------------
# Reading YAML


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing what it would otherwise let through silently: a repeated key (the
    later value would win without a word, while Docker Compose refuses the file)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ComposeError(f"line {key_node.start_mark.line + 1}: duplicate key {key!r}")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


# Docker Compose reads YAML 1.2, where only true/false are booleans: ``restart: yes`` is the string "yes"
# there, not YAML 1.1's True. Keep PyYAML's other implicit types, swap its bool pattern for 1.2's.
_StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def parse_yaml(text: str) -> Any:
    """One YAML document (safe types only) as dicts, lists and scalars; ``ComposeError`` naming the line
    for malformed YAML, a repeated key or several documents."""
    try:
        documents = list(yaml.load_all(text, Loader=_StrictLoader))  # a SafeLoader: no arbitrary objects
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}: " if mark is not None else ""
        raise ComposeError(f"{where}{exc.problem or exc.context or 'malformed YAML'}") from None
    except yaml.YAMLError as exc:
        raise ComposeError(f"malformed YAML: {exc}") from None
    if len(documents) > 1:
        raise ComposeError("multi-document YAML is not supported: one compose document per file")
    return documents[0] if documents else None


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


def _profiles(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(p, str) for p in value):
        raise ComposeError(f"{where}.profiles: expected a non-empty list of profile names")
    return tuple(value)


def load_compose(path: Path | str, profiles: Sequence[str] = ()) -> ComposeProject:
    """Read and check a compose file written in the supported subset, with the services of ``profiles``
    (services without ``profiles`` always run)."""
    path = Path(path)
    doc = parse_yaml(path.read_text(encoding="utf-8"))
    if not isinstance(doc, dict) or not isinstance(doc.get("services"), dict):
        raise ComposeError(f"{path}: expected a top-level 'services' mapping")
    unknown = set(doc) - {"name", "services", "networks", "volumes"}
    if unknown:
        raise ComposeError(f"{path}: unsupported top-level keys: {', '.join(sorted(unknown))}")
    networks = tuple(doc.get("networks") or {})
    volumes = tuple(doc.get("volumes") or {})
    services: dict[str, Service] = {}
    for name, value in doc["services"].items():
        service = _parse_service(str(name), value, networks, volumes)
        wanted = _profiles(value["profiles"], f"services.{name}") if "profiles" in value else ()
        if not wanted or set(wanted) & set(profiles):
            services[service.name] = service
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
