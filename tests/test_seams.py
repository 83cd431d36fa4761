"""The seams between services: one client per node seam, and a pool client of leases only.

- Every call a process makes to an exec node goes through the node's client
  (swerl.exec.client), whose deadlines are the node's own. The raw SandboxService and
  EvaluateService stubs are named only inside the exec node's package and in the pool's own
  connection to its nodes (swerl.pool.nodes: the control plane speaks the node's contract).
- The pool's client library (swerl.pool.client) handles leases only: it imports nothing of the
  exec node's package, so a lease holder composes the node's client itself (from the lease's
  node address and token), and the node can use the pool's client without a package loop.

Modules are read with `ast`, as tests/test_layering.py reads them, through pyproject.toml's
`package-dir` (services/exec is swerl.exec, and so on); generated `*_pb2*.py` are not read.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 reads pyproject.toml with tomli
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent

# The raw stubs of the node's two services, and the generated modules that define them.
RAW_STUBS = frozenset({"SandboxServiceStub", "EvaluateServiceStub"})
STUB_MODULES = frozenset({"swerl.exec.v1.sandbox_pb2_grpc", "swerl.exec.v1.evaluate_pb2_grpc"})
# Who may name them: the exec node's own package, and the pool's connection to its nodes.
NODE_PACKAGE = "swerl.exec"
STUB_OWNERS = frozenset({"swerl.pool.nodes"})
POOL_CLIENT = "swerl.pool.client"
# The node's generated contract: pool.proto embeds the node's messages (a sandbox's resources),
# so the pool's own generated code imports it, through the empty package inits above it.
NODE_CONTRACT = "swerl.exec.v1"


def modules() -> dict[str, Path]:
    """Every hand-written module of swerl's source, by its import name."""
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found: dict[str, Path] = {}
    for top, folder in table["package-dir"].items():
        for path in (ROOT / folder).rglob("*.py"):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((top, *parts))] = path
    return found


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def imported(tree: ast.AST, package: str) -> set[str]:
    """Every dotted name `tree` imports (absolute; modules and the names taken from them), at
    module level, inside functions and under `if TYPE_CHECKING:` alike."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def raw_stub_uses(source: str, package: str) -> list[str]:
    """What in `source` reaches a raw node stub: an import of a stub module or of a stub by
    name, or a stub named at all (`sandbox_pb2_grpc.SandboxServiceStub(...)`, an annotation)."""
    tree = ast.parse(source)
    uses = sorted(
        name
        for name in imported(tree, package)
        if name in STUB_MODULES
        or any(name.startswith(f"{module}.") for module in STUB_MODULES)
        or name.rpartition(".")[2] in RAW_STUBS
    )
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in RAW_STUBS:
            uses.append(f"line {node.lineno}: {node.id}")
        elif isinstance(node, ast.Attribute) and node.attr in RAW_STUBS:
            uses.append(f"line {node.lineno}: .{node.attr}")
    return uses


def may_name_raw_stubs(name: str) -> bool:
    return name == NODE_PACKAGE or name.startswith(NODE_PACKAGE + ".") or name in STUB_OWNERS


def test_no_module_outside_the_exec_node_and_the_pools_node_connection_names_a_raw_stub():
    found = modules()
    assert POOL_CLIENT in found and "swerl.agent.loop.sandbox" in found  # the discovery is real
    offenders = {}
    for name, path in sorted(found.items()):
        if may_name_raw_stubs(name):
            continue
        uses = raw_stub_uses(path.read_text(), _package_of(name, path))
        if uses:
            offenders[str(path.relative_to(ROOT))] = uses
    assert not offenders, (
        "these modules call an exec node through a raw stub; call swerl.exec.client's"
        f" SandboxClient (add the method there if it lacks one): {offenders}"
    )


def test_the_stub_check_sees_each_way_of_reaching_a_raw_stub():
    ways = {
        "from swerl.exec.v1 import sandbox_pb2_grpc": "swerl.exec.v1.sandbox_pb2_grpc",
        "from swerl.exec.v1.evaluate_pb2_grpc import EvaluateServiceStub": "EvaluateServiceStub",
        "import swerl.exec.v1.sandbox_pb2_grpc as raw": "swerl.exec.v1.sandbox_pb2_grpc",
        "def f():\n    from swerl.exec.v1 import evaluate_pb2_grpc": "evaluate_pb2_grpc",
        "from ..exec.v1 import sandbox_pb2_grpc": "swerl.exec.v1.sandbox_pb2_grpc",
        "stub = grpc_module.SandboxServiceStub(channel)": ".SandboxServiceStub",
    }
    for source, expected in ways.items():
        uses = raw_stub_uses(source, "swerl.agent")
        assert any(expected in use for use in uses), (source, uses)
    # What every client may import: the messages, and the node's client.
    clean = "from swerl.exec.v1 import sandbox_pb2\nfrom swerl.exec.client import SandboxClient"
    assert raw_stub_uses(clean, "swerl.agent") == []


def test_only_the_exec_package_and_the_pools_node_connection_may_name_raw_stubs():
    assert may_name_raw_stubs("swerl.exec.client")
    assert may_name_raw_stubs("swerl.pool.nodes")
    for name in (
        "swerl.agent.loop.sandbox",
        "swerl.pool.client",
        "swerl.validate",
        "swerl.executor",
    ):
        assert not may_name_raw_stubs(name), name


def test_the_pool_client_module_imports_nothing_of_the_exec_node():
    path = modules()[POOL_CLIENT]
    names = imported(ast.parse(path.read_text()), _package_of(POOL_CLIENT, path))
    from_exec = sorted(n for n in names if n == NODE_PACKAGE or n.startswith(NODE_PACKAGE + "."))
    assert from_exec == [], f"{path.relative_to(ROOT)} imports {from_exec}"


def test_importing_the_pool_client_loads_no_hand_written_module_of_the_exec_node():
    script = (
        "import json, sys\n"
        f"import {POOL_CLIENT}\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('swerl'))))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=ROOT.parent,
        env=env,
        timeout=120,
        check=True,
    )
    loaded = json.loads(done.stdout.splitlines()[-1])
    assert POOL_CLIENT in loaded
    node_modules = [m for m in loaded if m == NODE_PACKAGE or m.startswith(NODE_PACKAGE + ".")]
    # The generated contract (and the package inits on its way) only, never the node's code.
    leaked = [
        m
        for m in node_modules
        if m not in (NODE_PACKAGE, NODE_CONTRACT) and not m.startswith(NODE_CONTRACT + ".")
    ]
    assert leaked == [], f"import {POOL_CLIENT} loads the exec node's {leaked}"
    # ...which is only so while those inits are empty: they import nothing of the node.
    found = modules()
    for init in (NODE_PACKAGE, NODE_CONTRACT):
        tree = ast.parse(found[init].read_text())
        assert not imported(tree, init), f"{found[init]} imports something"


# The exec node's runtime seam (issue 38): the runtime's SDK and its implementation are named by
# the implementation and by the factory that picks it, and nowhere else in the node.
RUNTIME_IMPLEMENTATION = "swerl.exec.docker_backend"
RUNTIME_FACTORY = "swerl.exec.runtimes"


def test_inside_the_exec_node_only_the_runtime_implementation_imports_the_docker_sdk():
    offenders = {}
    for name, path in modules().items():
        if not name.startswith(NODE_PACKAGE + ".") or name == RUNTIME_IMPLEMENTATION:
            continue
        names = imported(ast.parse(path.read_text()), _package_of(name, path))
        sdk = sorted(n for n in names if n == "docker" or n.startswith("docker."))
        if sdk:
            offenders[name] = sdk
    assert offenders == {}


def test_the_node_names_its_runtime_implementation_only_in_the_factory():
    offenders = {}
    for name, path in modules().items():
        if not name.startswith(NODE_PACKAGE + ".") or name in (
            RUNTIME_IMPLEMENTATION,
            RUNTIME_FACTORY,
        ):
            continue
        names = imported(ast.parse(path.read_text()), _package_of(name, path))
        if any(
            n == RUNTIME_IMPLEMENTATION or n.startswith(RUNTIME_IMPLEMENTATION + ".") for n in names
        ):
            offenders[name] = path
    assert offenders == {}
