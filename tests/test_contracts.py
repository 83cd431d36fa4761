"""The generated contract code: present for every service, and importable under the protobuf
runtimes swerl meets in the field (the pinned generator emits 4.25-style gencode; slime's image
and newer environments carry 5.x-7.x runtimes)."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import swerl

SERVICES = {
    "swerl.exec.v1.sandbox_pb2": "SandboxService",
    "swerl.exec.v1.evaluate_pb2": "EvaluateService",
    "swerl.pool.v1.pool_pb2": "PoolService",
    "swerl.agent.v1.agent_pb2": "AgentService",
    "swerl.prm.v1.prm_pb2": "PrmService",
}


@pytest.mark.parametrize("module", sorted(SERVICES))
def test_every_contract_is_generated_with_its_service(module):
    generated = importlib.import_module(module)
    service = generated.DESCRIPTOR.services_by_name[SERVICES[module]]
    assert service.methods, f"{service.full_name} has no RPCs"
    importlib.import_module(module + "_grpc")


def _gencode_tree(tmp_path: Path) -> Path:
    """A copy of only the generated modules, importable as swerl.<svc>.v1.*."""
    root = tmp_path / "gencode"
    package = Path(swerl.__file__).parent
    for generated in package.rglob("*_pb2*.py"):
        target = root / "swerl" / generated.relative_to(package)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(generated, target)
    for directory in [root / "swerl", *(root / "swerl").rglob("*")]:
        if directory.is_dir():
            (directory / "__init__.py").touch()
    return root


@pytest.mark.parametrize("runtime", ["5.29.5", "6.33.5", "7.36.2"])
def test_gencode_imports_under_newer_protobuf_runtimes(tmp_path, runtime):
    site = tmp_path / "site"
    install = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-deps",
            "--target",
            str(site),
            f"protobuf=={runtime}",
        ],
        capture_output=True,
        text=True,
    )
    assert install.returncode == 0, install.stderr[-2000:]
    modules = ", ".join(sorted(SERVICES))
    probe = (
        "import google.protobuf, importlib\n"
        f"assert google.protobuf.__version__ == {runtime!r}, google.protobuf.__version__\n"
        f"for name in {sorted(SERVICES)!r}:\n"
        "    importlib.import_module(name)\n"
        "from swerl.exec.v1 import sandbox_pb2 as pb\n"
        "raw = pb.ExecRequest(start=pb.ExecStart(command='echo hi')).SerializeToString()\n"
        "assert pb.ExecRequest.FromString(raw).start.command == 'echo hi'\n"
    )
    env = {"PYTHONPATH": f"{site}:{_gencode_tree(tmp_path)}", "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", probe], capture_output=True, text=True, env=env
    )
    assert result.returncode == 0, f"{modules} under protobuf {runtime}:\n{result.stderr}"
