"""The import rules of docs/architecture.md, checked on every import statement of the source tree.

Every ``import`` and ``from ... import`` counts wherever it stands (module level, inside functions, under
``if TYPE_CHECKING``), relative imports are resolved against the importing module, and
``importlib.import_module("name")`` with a literal name counts as an import of that name. A rule names
the importing modules it covers and the modules they must not import (or, for proto/, the only ones they
may import); ``from a.b import c`` imports both ``a.b`` and ``a.b.c`` as far as the rules are concerned,
so ``from kvnet.blocks import codecs`` is caught like ``import kvnet.blocks.codecs``.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.waiting import scaled

REPO = Path(__file__).resolve().parents[1]
SOURCE_PACKAGES = ("kvnet", "proto", "relay", "publisher", "subscriber")
ROLE_PACKAGES = ("relay", "publisher", "subscriber")
# proto/ is sans-I/O: the standard library minus the I/O and concurrency modules, plus msgpack and blake3
# (a hash function, computation only, as hashlib is).
PROTO_FORBIDDEN_STDLIB = ("asyncio", "socket", "ssl", "selectors", "threading", "subprocess")


@dataclass(frozen=True)
class Import:
    """One imported module name, where it was imported and by which module."""

    importer: str
    imported: str
    path: str
    line: int


@dataclass(frozen=True)
class Rule:
    """Modules matching ``importer`` must not import a module for which ``forbids`` is true."""

    text: str
    importer: Callable[[str], bool]
    forbids: Callable[[str], bool]


def under(*prefixes: str) -> Callable[[str], bool]:
    """True for a module named by one of ``prefixes`` or inside it."""
    return lambda name: any(name == p or name.startswith(p + ".") for p in prefixes)


def _role_of(name: str) -> str | None:
    top = name.split(".")[0]
    return top if top in ROLE_PACKAGES else None


def _proto_forbids(name: str) -> bool:
    top = name.split(".")[0]
    if top in ("proto", "msgpack", "blake3", "__future__"):
        return False
    return top not in sys.stdlib_module_names or top in PROTO_FORBIDDEN_STDLIB


RULES = (
    Rule("proto/ imports only the standard library (no I/O), msgpack and blake3", under("proto"),
         _proto_forbids),
    Rule("kvnet/cache and kvnet/model never import kvnet/net", under("kvnet.cache", "kvnet.model"),
         under("kvnet.net")),
    Rule("relay/ never imports torch, kvnet.model or kvnet.blocks (it stores and forwards objects; signing "
         "is kvnet.security's, the chain hash kvnet.cache.hashing's)", under("relay"),
         under("torch", "kvnet.model", "kvnet.blocks")),
    Rule("kvnet/tools imports nothing from the rest of kvnet but kvnet.logs and kvnet.config (the one log "
         "format and settings parser; standard library and PyYAML only)", under("kvnet.tools"),
         lambda name: under("kvnet")(name)
         and not under("kvnet.tools", "kvnet.logs", "kvnet.config")(name)),
    Rule("kvnet/exchange never imports kvnet.node or kvnet.integrations", under("kvnet.exchange"),
         under("kvnet.node", "kvnet.integrations")),
    Rule("kvnet/storage never imports torch, kvnet.model or kvnet.blocks (the relay stores its tracks "
         "through it)", under("kvnet.storage"), under("torch", "kvnet.model", "kvnet.blocks")),
    Rule("kvnet.blocks.kvtc_entropy never imports torch or another kvnet.blocks module (its worker processes "
         "start with numpy and constriction only)", under("kvnet.blocks.kvtc_entropy"),
         lambda name: under("torch", "kvnet.blocks")(name) and not under("kvnet.blocks.kvtc_entropy")(name)),
    Rule("kvnet never imports a role package (relay, publisher, subscriber)", under("kvnet"),
         under(*ROLE_PACKAGES)),
    *(
        Rule(f"{role}/ never imports another role package", under(role),
             under(*(other for other in ROLE_PACKAGES if other != role)))
        for role in ROLE_PACKAGES
    ),
)


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(importer: str, is_package: bool, level: int, module: str | None) -> str:
    """The absolute name of ``from <level dots><module> import ...`` written in ``importer``."""
    if level == 0:
        return module or ""
    base = importer.split(".")
    # In a package's __init__, one dot is the package itself; in a module, it is the enclosing package.
    drop = level - 1 if is_package else level
    if drop >= len(base):
        raise ValueError(f"relative import beyond the top-level package in {importer}")
    base = base[: len(base) - drop]
    return ".".join([*base, module] if module else base)


def imports_of(path: Path, root: Path) -> Iterator[Import]:
    """Every module name ``path`` imports, anywhere in its body."""
    importer = module_name(path, root)
    where = path.relative_to(root).as_posix()
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(importer, alias.name, where, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(importer, is_package, node.level, node.module)
            yield Import(importer, base, where, node.lineno)
            for alias in node.names:
                if alias.name != "*":
                    yield Import(importer, f"{base}.{alias.name}", where, node.lineno)
        elif (
            isinstance(node, ast.Call)
            and _is_import_module_call(node.func)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield Import(importer, node.args[0].value, where, node.lineno)


def _is_import_module_call(func: ast.expr) -> bool:
    if isinstance(func, ast.Attribute):
        return func.attr == "import_module"
    return isinstance(func, ast.Name) and func.id in ("import_module", "__import__")


def source_files(root: Path, packages: tuple[str, ...] = SOURCE_PACKAGES) -> Iterator[Path]:
    for package in packages:
        yield from sorted((root / package).rglob("*.py"))


def violations(root: Path, packages: tuple[str, ...] = SOURCE_PACKAGES) -> list[str]:
    """One line per import that breaks a rule: where, what, and the rule."""
    found = []
    for path in source_files(root, packages):
        for imp in imports_of(path, root):
            for rule in RULES:
                if rule.importer(imp.importer) and rule.forbids(imp.imported):
                    where = f"{imp.path}:{imp.line}"
                    found.append(f"{where}: {imp.importer} imports {imp.imported} ({rule.text})")
    return found


def test_source_tree_follows_the_import_rules() -> None:
    found = violations(REPO)
    assert not found, "import rules broken (see docs/architecture.md):\n" + "\n".join(found)


def test_the_walk_sees_every_source_package() -> None:
    # A rule over a package the walk never reaches would pass vacuously.
    seen = {module_name(p, REPO).split(".")[0] for p in source_files(REPO)}
    assert seen == set(SOURCE_PACKAGES)
    importers = {module_name(p, REPO) for p in source_files(REPO)}
    for rule in RULES:
        assert any(rule.importer(name) for name in importers), f"no module is covered by: {rule.text}"


# One file per rule, each breaking it in a way a naive check would miss (inside a function, relative,
# ``from package import module``, importlib); the checker must name every one of them.
_BROKEN_TREE = {
    "proto/__init__.py": "",
    "proto/wire.py": "def f():\n    import asyncio\n",
    "proto/codec.py": "import numpy\n",
    "kvnet/__init__.py": "",
    "kvnet/net/__init__.py": "",
    "kvnet/net/config.py": "",
    "kvnet/cache/__init__.py": "",
    "kvnet/cache/pool.py": "from ..net import config\n",
    "kvnet/model/__init__.py": "",
    "kvnet/model/gen.py": "def f():\n    from kvnet.net.config import x\n",
    "kvnet/blocks/__init__.py": "",
    "kvnet/blocks/codecs.py": "",
    "kvnet/blocks/kvtc_entropy.py": "def f():\n    from . import codecs\n",
    "kvnet/tools/__init__.py": "",
    "kvnet/tools/emu.py": "from .. import errors\n",
    "kvnet/exchange/__init__.py": "",
    "kvnet/exchange/peer.py": "def f():\n    from ..integrations import vllm\n",
    "kvnet/exchange/fetch.py": "from kvnet.node import node\n",
    "kvnet/storage/__init__.py": "",
    "kvnet/storage/disk.py": "def f():\n    from ..blocks import codecs\n",
    "kvnet/storage/files.py": "import torch\n",
    "kvnet/node.py": "import importlib\nimportlib.import_module('relay.server')\n",
    "relay/__init__.py": "",
    "relay/server.py": "from kvnet.blocks import codecs\n",
    "relay/manifest.py": "from kvnet.blocks.kvobject import BlockManifest\n",
    "relay/cache.py": "if True:\n    import torch.nn\n",
    "relay/peer.py": "from kvnet.model.transformer import Transformer\n",
    "relay/client.py": "from subscriber import main\n",
    "publisher/__init__.py": "from . import cli\n",
    "publisher/cli.py": "from relay import config\n",
    "subscriber/__init__.py": "",
    "subscriber/main.py": "import publisher.cli\n",
}


@pytest.fixture
def broken_tree(tmp_path: Path) -> Path:
    for name, text in _BROKEN_TREE.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    "expected",
    [
        "proto/wire.py:2: proto.wire imports asyncio",
        "proto/codec.py:1: proto.codec imports numpy",
        "kvnet/cache/pool.py:1: kvnet.cache.pool imports kvnet.net.config",
        "kvnet/model/gen.py:2: kvnet.model.gen imports kvnet.net.config",
        "kvnet/tools/emu.py:1: kvnet.tools.emu imports kvnet.errors",
        "kvnet/exchange/peer.py:2: kvnet.exchange.peer imports kvnet.integrations",
        "kvnet/exchange/fetch.py:1: kvnet.exchange.fetch imports kvnet.node",
        "kvnet/storage/disk.py:2: kvnet.storage.disk imports kvnet.blocks.codecs",
        "kvnet/blocks/kvtc_entropy.py:2: kvnet.blocks.kvtc_entropy imports kvnet.blocks.codecs",
        "kvnet/storage/files.py:1: kvnet.storage.files imports torch",
        "kvnet/node.py:2: kvnet.node imports relay.server",
        "relay/server.py:1: relay.server imports kvnet.blocks.codecs",
        "relay/manifest.py:1: relay.manifest imports kvnet.blocks.kvobject",
        "relay/cache.py:2: relay.cache imports torch.nn",
        "relay/peer.py:1: relay.peer imports kvnet.model.transformer",
        "relay/client.py:1: relay.client imports subscriber",
        "publisher/cli.py:1: publisher.cli imports relay.config",
        "subscriber/main.py:1: subscriber.main imports publisher.cli",
    ],
)
def test_the_checker_names_each_broken_rule(broken_tree: Path, expected: str) -> None:
    found = violations(broken_tree)
    assert any(line.startswith(expected) for line in found), "\n".join(found)


def test_relative_imports_resolve_against_the_importing_module() -> None:
    assert _resolve("kvnet.cache.pool", False, 1, "hashing") == "kvnet.cache.hashing"
    assert _resolve("kvnet.cache.pool", False, 2, "net") == "kvnet.net"
    assert _resolve("kvnet.cache", True, 1, "pool") == "kvnet.cache.pool"
    assert _resolve("publisher", True, 1, None) == "publisher"


@pytest.mark.parametrize(
    ("entry", "absent"),
    [
        ("relay.__main__", ("torch", "kvnet.model", "kvnet.blocks", "publisher", "subscriber")),
        ("proto.session", ("asyncio", "kvnet", "msgpack")),
        ("kvnet.storage.disk", ("torch", "kvnet.model", "kvnet.blocks")),
        ("kvnet.blocks.kvtc_entropy", ("torch", "kvnet.blocks.codecs")),
        ("kvnet.tools.cluster.__main__", ("kvnet.net", "kvnet.model", "torch")),
    ],
)
def test_entry_points_do_not_load_forbidden_modules_at_run_time(entry: str, absent: tuple[str, ...]) -> None:
    # The ast rules see direct imports; this sees what importing the entry module drags in transitively.
    probe = (
        f"import sys, importlib; importlib.import_module({entry!r}); "
        f"print(' '.join(m for m in {absent!r} if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=scaled(120)
    )
    assert out.returncode == 0, f"importing {entry} failed:\n{out.stderr}"
    assert out.stdout.strip() == "", f"importing {entry} loads {out.stdout.strip()}"


def test_every_module_is_named_in_the_architecture_doc() -> None:
    doc = (REPO / "docs" / "architecture.md").read_text()
    missing = [
        path.relative_to(REPO).as_posix()
        for path in source_files(REPO)
        if path.name != "__init__.py" and f"`{path.relative_to(REPO).as_posix()}`" not in doc
    ]
    assert not missing, "modules without a line in docs/architecture.md (module: its one job):\n" + "\n".join(
        missing
    )


def test_readme_layout_names_every_package() -> None:
    readme = (REPO / "README.md").read_text()
    layout = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    # The first word of each line: top-level packages as "relay/", kvnet's rooms indented as "node/".
    entries = {line.split()[0] for line in layout.splitlines() if line.strip() and not line.startswith("`")}
    packages = [
        path.parent.relative_to(REPO).as_posix() + "/"
        for path in source_files(REPO)
        if path.name == "__init__.py" and path.parent.parent in (REPO, REPO / "kvnet")
    ]
    missing = [name for name in packages if not {name, name.removeprefix("kvnet/")} & entries]
    assert not missing, f"README's Layout section does not name {missing}"


# -------------------------------------------------------------------------------- no circles inside a room

# Rooms whose modules must not import each other in a circle (type-only imports count: a circle held
# together by them is still two modules that cannot be read or changed apart).
ACYCLIC_ROOMS = ("kvnet.net", "kvnet.exchange", "kvnet.node", "relay")
# Circles that the restructuring of their room removes, and this table with them. Each is an expected
# failure that must fail: once the circle is gone, its entry here has to go too.
KNOWN_CIRCLES: dict[str, str] = {}


def import_graph(root: Path, room: str) -> dict[str, set[str]]:
    """Module -> the modules of the same room it imports (``from a import b`` counts ``a.b`` when that is
    a module of the tree, else the package ``a``)."""
    modules = {module_name(path, root) for path in source_files(root, (room.split(".")[0],))}
    members = {name for name in modules if under(room)(name)}
    graph: dict[str, set[str]] = {name: set() for name in members}
    for path in source_files(root, (room.split(".")[0],)):
        importer = module_name(path, root)
        if importer not in members:
            continue
        for imp in imports_of(path, root):
            if imp.imported in members and imp.imported != importer:
                graph[importer].add(imp.imported)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


@pytest.mark.parametrize(
    "room",
    [
        pytest.param(room, marks=pytest.mark.xfail(strict=True, reason=KNOWN_CIRCLES[room]))
        if room in KNOWN_CIRCLES else room
        for room in ACYCLIC_ROOMS
    ],
)
def test_no_import_circles_inside_a_room(room: str) -> None:
    found = circles(import_graph(REPO, room))
    assert not found, f"import circles inside {room}:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_circle_check_finds_a_circle_through_a_function_and_a_relative_import(tmp_path: Path) -> None:
    tree = {
        "kvnet/__init__.py": "",
        "kvnet/net/__init__.py": "",
        "kvnet/net/a.py": "from kvnet.net import b\n",
        "kvnet/net/b.py": "def f():\n    from .c import x\n",
        "kvnet/net/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n",
        "kvnet/net/d.py": "from kvnet.net import a\n",
    }
    for name, text in tree.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert circles(import_graph(tmp_path, "kvnet.net")) == [["kvnet.net.a", "kvnet.net.b", "kvnet.net.c"]]


# ------------------------------------------------------------------ the room table is the import graph

# The modules directly in kvnet/ that import nothing else of ours (kvnet/cli.py, the kvnet command, is a
# room of its own: it reaches into model, security and tools).
LEAF_MODULES = ("errors", "dtypes", "config", "logs", "progress")
ROOM_TABLE_HEADER = "| room | imports |"


def room_of(module: str) -> str | None:
    """The room of docs/architecture.md's "Layers" that ``module`` belongs to; None for a module of no
    room (third-party, the standard library, and the bare ``kvnet`` package, which holds nothing and which
    every ``kvnet`` import loads). A new package in kvnet/ is a room of its own, so it needs a row."""
    parts = module.split(".")
    if parts[0] in ("proto", *ROLE_PACKAGES):
        return parts[0]
    if parts[0] != "kvnet" or len(parts) == 1:
        return None
    if parts[1] == "cli":
        return "kvnet/cli.py"
    if parts[1] in LEAF_MODULES:
        return "leaves"
    return f"kvnet/{parts[1]}"


def room_edges(root: Path) -> dict[tuple[str, str], str]:
    """(importer room, imported room) -> the first import statement that makes the edge (path:line)."""
    edges: dict[tuple[str, str], str] = {}
    for path in source_files(root):
        importer = room_of(module_name(path, root))
        for imp in imports_of(path, root):
            imported = room_of(imp.imported)
            if importer and imported and imported != importer:
                edges.setdefault((importer, imported), f"{imp.path}:{imp.line}")
    return edges


def documented_rooms(doc: str) -> dict[str, set[str]]:
    """The room table of the doc: room -> the rooms its row says it imports (the backquoted names)."""
    lines = doc.splitlines()
    start = lines.index(ROOM_TABLE_HEADER)
    table: dict[str, set[str]] = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        room_cell, imports_cell = (cell.strip() for cell in line.strip().strip("|").split("|"))
        table[room_cell.strip("`")] = set(re.findall(r"`([^`]+)`", imports_cell))
    return table


def picture_layers(doc: str, rooms: set[str]) -> dict[str, list[int]]:
    """Room -> the lines of the "Layers" picture it stands on (a name written ``proto/`` is ``proto``)."""
    picture = doc.split("## Layers", 1)[1].split("```", 2)[1]
    layers: dict[str, list[int]] = {}
    for depth, line in enumerate(picture.splitlines()):
        for token in re.findall(r"[\w/.-]+", line):
            if token.rstrip("/") in rooms:
                layers.setdefault(token.rstrip("/"), []).append(depth)
    return layers


def room_table_differences(doc: str, root: Path) -> list[str]:
    """Every way the doc's room table and picture disagree with the import graph of ``root``."""
    table = documented_rooms(doc)
    code_rooms = {room for path in source_files(root) if (room := room_of(module_name(path, root)))}
    edges = room_edges(root)
    documented = {(room, imported) for room, imports in table.items() for imported in imports}
    found = [f"room {room} has no row in the room table" for room in sorted(code_rooms - set(table))]
    found += [
        f"the room table has a row for {room}, which holds no module"
        for room in sorted(set(table) - code_rooms)
    ]
    found += [
        f"{a} imports {b} ({edges[a, b]}), which the room table does not name"
        for a, b in sorted(set(edges) - documented)
    ]
    found += [
        f"the room table says {a} imports {b}, which no module of {a} does"
        for a, b in sorted(documented - set(edges))
    ]
    layers = picture_layers(doc, set(table))
    found += [
        f"room {room} stands {len(layers.get(room, []))} times in the picture, not once"
        for room in sorted(table)
        if len(layers.get(room, [])) != 1
    ]
    found += [
        f"{a} imports {b} ({where}), but {b} is not drawn below {a} in the picture"
        for (a, b), where in sorted(edges.items())
        if len(layers.get(a, [])) == 1 and len(layers.get(b, [])) == 1 and layers[a][0] >= layers[b][0]
    ]
    return found


def test_the_room_table_and_picture_are_the_import_graph() -> None:
    found = room_table_differences((REPO / "docs" / "architecture.md").read_text(), REPO)
    assert not found, "docs/architecture.md's Layers disagree with the imports:\n" + "\n".join(found)


def test_the_room_check_names_each_disagreement(tmp_path: Path) -> None:
    tree = {
        "proto/__init__.py": "",
        "kvnet/__init__.py": "",
        "kvnet/errors.py": "",
        "kvnet/cache/__init__.py": "",
        "kvnet/cache/pool.py": "def f():\n    from .. import errors\n",
        "kvnet/net/__init__.py": "from proto import wire\n",
        "kvnet/model/__init__.py": "",
        "kvnet/model/gen.py": "import importlib\nimportlib.import_module('kvnet.net')\n",
        "relay/__init__.py": "",
        "publisher/__init__.py": "",
        "subscriber/__init__.py": "",
    }
    for name, text in tree.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    doc = "\n".join([
        "## Layers", "```",
        "  top  relay/ publisher/ subscriber/ kvnet/model",
        "  mid  kvnet/net kvnet/cache",
        "  base  proto/ leaves",
        "```",
        ROOM_TABLE_HEADER, "|---|---|",
        "| `relay` | — |", "| `publisher` | — |", "| `subscriber` | — |",
        "| `kvnet/model` | `kvnet/cache` |", "| `kvnet/cache` | `leaves` |",
        "| `kvnet/net` | `kvnet/cache` |", "| `kvnet/tools` | — |",
        "| `proto` | `kvnet/net` |", "| `leaves` | — |", "",
    ])
    assert room_table_differences(doc, tmp_path) == [
        "the room table has a row for kvnet/tools, which holds no module",
        "kvnet/model imports kvnet/net (kvnet/model/gen.py:2), which the room table does not name",
        "kvnet/net imports proto (kvnet/net/__init__.py:1), which the room table does not name",
        "the room table says kvnet/model imports kvnet/cache, which no module of kvnet/model does",
        "the room table says kvnet/net imports kvnet/cache, which no module of kvnet/net does",
        "the room table says proto imports kvnet/net, which no module of proto does",
        "room kvnet/tools stands 0 times in the picture, not once",
    ]
    # Drawn the other way up, the model's import of the network points up the picture.
    upward = doc.replace("subscriber/ kvnet/model", "subscriber/ kvnet/net")
    upward = upward.replace("mid  kvnet/net", "mid  kvnet/model")
    assert (
        "kvnet/model imports kvnet/net (kvnet/model/gen.py:2), but kvnet/net is not drawn below "
        "kvnet/model in the picture"
    ) in room_table_differences(upward, tmp_path)


def wait_for_calls(root: Path, packages: tuple[str, ...] = SOURCE_PACKAGES) -> list[str]:
    """Where the source calls ``asyncio.wait_for``: on Python 3.11 it returns the inner result, swallowing
    the caller's cancellation, when both land in one loop iteration (a cancelled locate ran on to its
    timeout); ``async with asyncio.timeout(...)`` has no such gap."""
    found = []
    for path in source_files(root, packages):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Attribute) and node.attr == "wait_for"
                    and isinstance(node.value, ast.Name) and node.value.id == "asyncio"):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_library_code_bounds_waits_with_asyncio_timeout_not_wait_for(tmp_path: Path) -> None:
    assert wait_for_calls(REPO) == []
    planted = tmp_path / "kvnet" / "waits.py"
    planted.parent.mkdir()
    planted.write_text("import asyncio\n\nasync def f(x):\n    return await asyncio.wait_for(x, 1)\n")
    assert wait_for_calls(tmp_path, ("kvnet",)) == ["kvnet/waits.py:4"]
