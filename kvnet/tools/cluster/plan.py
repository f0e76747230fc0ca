"""The namespace topology for a compose project, as a pure function of the compose model.

``plan_cluster`` maps the model to one namespace per service, one bridge per compose network (all bridges
live in one switch namespace, so the root namespace is never touched), one veth pair per (service,
network), addresses from a private range, a hosts file per namespace that maps service names to addresses
as compose's DNS would, and a link emulator namespace inserted on each impaired client->server path (the
client's hosts file points the server's name at the emulator, so the compose command runs unchanged and
TLS still verifies the server's name). ``launch_spec`` is the argv/env/cwd each service runs with.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .compose import ComposeProject

# Every namespace, per-namespace /etc directory and process of one cluster carries this prefix.
DEFAULT_PREFIX = "kvnc"
# Loss per direction on an emulated origin<->edge path: a WAN link between sites. At 1% a QUIC flow over the
# three relays' 20 ms round trips moves well under 1 MB/s (the loss rate, not the link, sets the window),
# which no CPU prefill of a small model loses to; 0.1% is a lossy WAN that still carries a few MB/s.
DEFAULT_LOSS = 0.001
# Private range used only on links inside our own namespaces: network i gets 10.77.(i+1).0/24.
DEFAULT_SUBNET_BASE = "10.77"
SWITCH_SUFFIX = "sw"
EMULATOR_HOST_BASE = 200
SERVICE_HOST_BASE = 10


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


def check_prefix(prefix: str) -> None:
    """Raise ``ValueError`` unless ``prefix`` is short and safe in namespace and interface names."""
    if not re.fullmatch(r"[a-z][a-z0-9]{1,9}", prefix):
        raise ValueError(f"prefix must be 2-10 lowercase letters/digits, starting with a letter: {prefix!r}")


def plan_cluster(
    project: ComposeProject,
    prefix: str = DEFAULT_PREFIX,
    links: Sequence[LinkShape] = (),
    subnet_base: str = DEFAULT_SUBNET_BASE,
) -> ClusterPlan:
    """Namespaces, interfaces, addresses, hosts files and emulators for ``project``."""
    check_prefix(prefix)
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
