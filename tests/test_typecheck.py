"""The type check is real: mypy sees swerl's generated contracts, so a wrong type fails CI.

scripts/typecheck runs `mypy -p swerl` on a regular install (an editable one hides swerl from
mypy), and scripts/test hands that install to these tests (SWERL_TYPECHECK_SITE). They
type-check small programs against such an install and assert mypy rejects what the code review
found slipping through when every swerl import was `Any`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A regular (non-editable) install of the checkout, as scripts/typecheck makes one: the one
    it made when SWERL_TYPECHECK_SITE names it (scripts/test), else one made here."""
    given = os.environ.get("SWERL_TYPECHECK_SITE")
    if given:
        site = Path(given)
        assert (site / "swerl" / "__init__.py").is_file(), (
            f"SWERL_TYPECHECK_SITE={given} holds no install of swerl"
            " (scripts/typecheck --install-only makes it)"
        )
        return site
    site = tmp_path_factory.mktemp("typecheck-site")
    subprocess.run(
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
            str(ROOT),
        ],
        check=True,
        timeout=600,
    )
    return site


def _mypy(site: Path, program: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    source = tmp_path / "program.py"
    source.write_text(program)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(ROOT / "pyproject.toml"),
            "--cache-dir",
            str(tmp_path / "cache"),
            str(source),
        ],
        cwd=site,
        env={"MYPYPATH": str(site), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_the_installed_package_is_typed(installed_site: Path) -> None:
    assert (installed_site / "swerl" / "py.typed").is_file()
    assert (installed_site / "swerl" / "exec" / "v1" / "sandbox_pb2.pyi").is_file()


def test_an_int_assigned_to_a_contract_enum_field_fails_the_check(
    installed_site: Path, tmp_path: Path
) -> None:
    checked = _mypy(
        installed_site,
        "from swerl.pool.v1 import pool_pb2 as pb\nstate: int = 3\nlease = pb.Lease(state=state)\n",
        tmp_path,
    )
    assert checked.returncode == 1, checked.stdout
    assert 'Argument "state" to "Lease" has incompatible type "int"' in checked.stdout


def test_the_enum_value_itself_passes_the_check(installed_site: Path, tmp_path: Path) -> None:
    checked = _mypy(
        installed_site,
        "from swerl.pool.v1 import pool_pb2 as pb\nlease = pb.Lease(state=pb.LEASE_STATE_ACTIVE)\n",
        tmp_path,
    )
    assert checked.returncode == 0, checked.stdout
