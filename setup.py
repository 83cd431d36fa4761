"""Build hooks for swerl: generate the protobuf/gRPC Python modules from protos/ at build time.

Generated `*_pb2.py`, `*_pb2.pyi` and `*_pb2_grpc.py` are never committed. They are written next to
the hand-written code of each service: the proto package names the import path, and
pyproject.toml's `package-dir` names the folder of that import path (protos/swerl/exec/v1/x.proto
-> swerl.exec.v1 -> services/exec/v1/x_pb2.py), for regular and editable installs alike. The
generator is pinned in pyproject.toml's build requirements; see the comment there for why.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 builds get tomli from the build requirements
    import tomli as tomllib

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PROTO_ROOT = ROOT / "protos"
# The folder of each package named in pyproject.toml's [tool.setuptools] package-dir.
PACKAGE_DIRS = {
    name: ROOT / folder
    for name, folder in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ].items()
}


def folder_of(package: str) -> Path:
    """The folder that holds `package` (the longest package-dir entry that is a prefix of it)."""
    parts = package.split(".")
    for cut in range(len(parts), 0, -1):
        top = ".".join(parts[:cut])
        if top in PACKAGE_DIRS:
            return PACKAGE_DIRS[top].joinpath(*parts[cut:])
    raise SystemExit(f"no package-dir entry covers {package}")


def generate_protos() -> None:
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(PROTO_ROOT.rglob("*.proto"))
    if not protos:
        raise SystemExit("no .proto files under protos/")
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as out:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{well_known}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            *[str(p) for p in protos],
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed on " + " ".join(str(p) for p in protos))
        for generated in Path(out).rglob("*_pb2*"):
            rel = generated.relative_to(out)  # swerl/exec/v1/sandbox_pb2.py
            target = folder_of(".".join(rel.parts[:-1])) / rel.name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(generated, target)


def discover_packages() -> list[str]:
    packages = []
    for top, directory in PACKAGE_DIRS.items():
        for init in sorted(directory.rglob("__init__.py")):
            rel = init.parent.relative_to(directory).parts
            packages.append(".".join((top, *rel)))
    return sorted(set(packages))


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        generate_protos()
        super().run()


setup(
    packages=discover_packages(),
    package_data={"": ["*.pyi", "py.typed", "*.yaml", "*.j2", "*.sh"]},
    cmdclass={"build_py": BuildPyWithProtos},
)
