"""The code's shape: no import cycle, layers chassis <- services <- tools, no module over 800 lines.

Modules are found through pyproject.toml's `package-dir` (the same table setup.py builds from), so
`swerl.exec.shell.session` is `services/exec/shell/session.py` here exactly as it is once
installed (a service's import path does not name its folder). Imports are read from the source
with `ast`; generated contract modules (`*_pb2*.py`) are not read, only imported.

Which imports count:
- Layering counts every import, at module level or inside a function: a lazy import is still a
  dependency of the importing module, and a service that reaches up into a tool lazily is as
  tied to that tool as one that does it at the top.
- Cycles count every import too, for the same reason: two modules that need each other are one
  unit, whichever of the two defers its import to call time (a lazy import hides a cycle from
  the interpreter, not from the reader). The one exception is `if TYPE_CHECKING:` blocks, which
  never run and only name types for mypy.
- A module depends on the packages it imports through (`import swerl.exec.client` needs
  `swerl.exec/__init__` first), but a package's `__init__` importing its own submodules is
  not a cycle with them: that is how a package publishes its names.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 reads pyproject.toml with tomli
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 800
# Folders whose modules must stay within MAX_LINES (the project's own code, not tests/benchmarks).
SIZE_CHECKED = ("services", "swerl", "trainer_plugin")

# The layers, lowest first. A module may import its own layer and the layers below it, never a
# layer above. The first prefix that matches a module names its layer (longest prefixes first).
CHASSIS = "chassis"
SERVICES = "services"
PLUGIN = "plugin"
TOOLS = "tools"
RANK = {CHASSIS: 0, SERVICES: 1, PLUGIN: 2, TOOLS: 3}
LAYER_OF_PREFIX = {
    "swerl.chassis": CHASSIS,
    "swerl.exec": SERVICES,
    "swerl.pool": SERVICES,
    "swerl.agent": SERVICES,
    "swerl.prm": SERVICES,
    # The trainer plugin is a client of the agent service that slime/miles load; it sits beside
    # the tools, not under them (SIBLINGS_APART): what both need lives in a service.
    "swerl.trainer_plugin": PLUGIN,
    "swerl.cli": TOOLS,
    "swerl.demo": TOOLS,
    "swerl.demo_vllm": TOOLS,
    "swerl.evaluation": TOOLS,
    "swerl.validate": TOOLS,
    "swerl.images": TOOLS,
    "swerl.web": TOOLS,
    "swerl.tasks": TOOLS,
    "swerl.data": TOOLS,
    "swerl.stack": TOOLS,
    "swerl.e2b": TOOLS,
    # the replay policy, the scripted PRM judge, the simulated pool nodes (demos, tests, benches)
    "swerl.devservers": TOOLS,
}
# Tools and the plugin are both clients of the services; neither builds on the other.
SIBLINGS_APART = {(TOOLS, PLUGIN), (PLUGIN, TOOLS)}


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    is_package: bool


def package_dirs() -> dict[str, Path]:
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: ROOT / folder for name, folder in table["package-dir"].items()}


def discover() -> dict[str, Module]:
    """Every hand-written module of the project, by its import name (package-dir resolved)."""
    dirs = package_dirs()
    # A folder named by a longer entry (services/exec for swerl.exec) is not also part of a
    # shorter one; here the folders are disjoint, but be exact about who owns a file.
    owner: dict[Path, str] = {}
    for name, folder in sorted(dirs.items(), key=lambda kv: len(kv[0])):
        for path in folder.rglob("*.py"):
            owner[path] = name
    modules: dict[str, Module] = {}
    for path, top in owner.items():
        if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        rel = path.relative_to(dirs[top]).with_suffix("").parts
        is_package = rel[-1] == "__init__"
        parts = (top, *rel[:-1]) if is_package else (top, *rel)
        modules[".".join(parts)] = Module(".".join(parts), path, is_package)
    return modules


def _type_checking_block(node: ast.AST) -> bool:
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, module level and lazy, except under `if TYPE_CHECKING:`."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if _type_checking_block(node):
            assert isinstance(node, ast.If)
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def imported_names(module: Module) -> set[str]:
    """The dotted names `module` imports, absolute, possibly naming attributes not modules."""
    tree = ast.parse(module.path.read_text(), str(module.path))
    package = module.name if module.is_package else module.name.rpartition(".")[0]
    names: set[str] = set()
    for node in _imports(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
            continue
        if node.level:
            base_parts = package.split(".")
            base_parts = base_parts[: len(base_parts) - (node.level - 1)]
            base = ".".join(base_parts + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        names.add(base)
        names.update(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
    return names


def resolve(name: str, modules: dict[str, Module]) -> str | None:
    """The project module a dotted import name lands in (the longest module prefix), if any."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        candidate = ".".join(parts[:cut])
        if candidate in modules:
            return candidate
    return None


def graph(modules: dict[str, Module]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for name, module in modules.items():
        targets = set()
        for imported in imported_names(module):
            target = resolve(imported, modules)
            if target is None or target == name:
                continue
            # A package's __init__ publishing its own submodules is not a dependency loop.
            if module.is_package and target.startswith(name + "."):
                continue
            targets.add(target)
            # Importing a.b.c runs a/__init__ and a/b/__init__ first.
            parts = target.split(".")
            for cut in range(1, len(parts)):
                parent = ".".join(parts[:cut])
                if parent in modules and parent != name and not name.startswith(parent + "."):
                    targets.add(parent)
        edges[name] = targets
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
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
    return found


def layer(name: str) -> str:
    if name == "swerl":
        return CHASSIS  # the package root only names the project
    parts = name.split(".")
    for cut in range(len(parts), 1, -1):
        prefix = ".".join(parts[:cut])
        if prefix in LAYER_OF_PREFIX:
            return LAYER_OF_PREFIX[prefix]
    raise AssertionError(f"{name} is in no layer: name it in LAYER_OF_PREFIX")


def violations(edges: dict[str, set[str]]) -> list[str]:
    found = []
    for source, targets in sorted(edges.items()):
        for target in sorted(targets):
            here, there = layer(source), layer(target)
            if RANK[there] > RANK[here] or (here, there) in SIBLINGS_APART:
                found.append(f"{source} ({here}) imports {target} ({there})")
    return found


MODULES = discover()
EDGES = graph(MODULES)


def test_the_check_sees_the_whole_project() -> None:
    # The package-dir mapping is resolved: service modules carry their import names, not folders.
    assert MODULES["swerl.exec.client"].path == ROOT / "services" / "exec" / "client.py"
    assert MODULES["swerl.trainer_plugin.hooks"].path == ROOT / "trainer_plugin" / "hooks.py"
    assert "swerl.chassis.server" in EDGES["swerl.exec.server"]
    # A lazy import inside a function counts (swerl.cli imports swerl.demo only in functions);
    # one under `if TYPE_CHECKING:` does not (swerl.pool.wire names PrefetchStatus that way).
    assert "swerl.demo" in EDGES["swerl.cli"]
    assert "swerl.pool.leases" not in EDGES["swerl.pool.wire"]
    # Importing a submodule runs its packages' __init__ first: an edge to each of them.
    assert {"swerl.exec", "swerl.exec.sweinstance"} <= EDGES["swerl.evaluation.runner"]
    assert not [n for n in MODULES if n.endswith(("_pb2", "_pb2_grpc"))]


def test_the_cycle_finder_finds_cycles() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_layer_check_finds_an_upward_import() -> None:
    edges = {"swerl.exec.servicer": {"swerl.tasks"}, "swerl.tasks": {"swerl.exec.client"}}
    assert violations(edges) == ["swerl.exec.servicer (services) imports swerl.tasks (tools)"]
    assert violations({"swerl.evaluation.runner": {"swerl.trainer_plugin.instance"}}) == [
        "swerl.evaluation.runner (tools) imports swerl.trainer_plugin.instance (plugin)"
    ]


def test_every_module_is_in_a_layer() -> None:
    unplaced = []
    for name in MODULES:
        try:
            layer(name)
        except AssertionError as exc:
            unplaced.append(str(exc))
    assert unplaced == []


def test_no_import_cycles() -> None:
    assert cycles(EDGES) == []


def test_layers_import_only_downward() -> None:
    assert violations(EDGES) == []


def test_no_module_over_800_lines() -> None:
    too_long = []
    for folder in SIZE_CHECKED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")):
                continue
            lines = len(path.read_text().splitlines())
            if lines > MAX_LINES:
                too_long.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert too_long == []
