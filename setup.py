"""Build hooks for swerl: generate the protobuf/gRPC Python modules from protos/ at build time.

Generated `*_pb2.py`, `*_pb2.pyi` and `*_pb2_grpc.py` are never committed. They are written next to
the hand-written code of each service (protos/swerl/exec/v1/x.proto -> services/exec/v1/x_pb2.py,
importable as swerl.exec.v1.x_pb2), for regular and editable installs alike. The generator is
pinned in pyproject.toml's build requirements; see the comment there for why.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PROTO_ROOT = ROOT / "protos"
# Top-level directory of each installed package name (mirrors [tool.setuptools] package-dir).
PACKAGE_DIRS = {"swerl": ROOT / "services", "swerl.trainer_plugin": ROOT / "trainer_plugin"}


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
            assert rel.parts[0] == "swerl", rel
            target = PACKAGE_DIRS["swerl"].joinpath(*rel.parts[1:])
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
