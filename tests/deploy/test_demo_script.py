"""scripts/demo on a fresh machine prints swerl's own lines only (issue 17): what pip and apt print
while it installs swerl and Docker goes to their logs, shown only when a step fails.

The script and deploy/docker-up.sh run as written, in a copy of their folders, with stand-ins on
PATH for what a fresh machine would run for real: a `python` whose pip prints what pip prints as
root, an `apt-get` that prints debconf's and needrestart's lines, a `docker` that answers once
"installed", and a `swerl` that prints the demo's first line. (`swerl demo`'s own output, free
of transformers' and grpc core's lines, is what tests/evaluation/test_cli_output.py and
tests/evaluate/test_official_layout.py check on `swerl eval`, which runs the same stack.)
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PIP_NOISE = (
    "WARNING: Running pip as the 'root' user can result in broken permissions and conflicting"
    " behaviour with the system package manager."
)
APT_NOISE = (
    "debconf: delaying package configuration, since apt-utils is not installed",
    "readline() on closed filehandle HENV at /usr/sbin/needrestart line 79.",
)
DEMO_LINE = "== exec node"


def _tool(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def _machine(tmp_path: Path, *, pip_fails: bool = False) -> tuple[Path, dict[str, str]]:
    """A checkout with the real scripts/demo and deploy/docker-up.sh (and the set-up library it
    sources), and a PATH on which Docker is missing until the stand-in apt-get installs it."""
    checkout = tmp_path / "swerl"
    for rel in ("scripts/demo", "deploy/docker-up.sh", "deploy/setup-lib.sh"):
        (checkout / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / rel, checkout / rel)
    fake = tmp_path / "bin"
    fake.mkdir()
    state = tmp_path / "state"
    state.mkdir()
    _tool(
        fake,
        "python",
        f"echo {PIP_NOISE!r} >&2\necho \"ERROR: pip's dependency resolver does not currently"
        ' take into account all the packages that are installed." >&2\n'
        + (
            "echo 'ERROR: No matching distribution found for grpcio' >&2\nexit 1\n"
            if pip_fails
            else "exit 0\n"
        ),
    )
    # Docker is missing until apt-get installs it: then dockerd exists, docker answers and the
    # base image is there.
    _tool(state, "dockerd", "exit 0\n")
    _tool(
        fake,
        "apt-get",
        "".join(f"echo {line!r} >&2\n" for line in APT_NOISE)
        + f'[ "$1" != install ] || cp {state}/dockerd {fake}/dockerd\n',
    )
    _tool(fake, "docker", f"[ -e {fake}/dockerd ]\n")
    _tool(fake, "sudo", 'exec "$@"\n')
    _tool(fake, "swerl", f'echo "{DEMO_LINE}"; echo "args: $*"\n')
    # Everything else the two scripts run, from the machine; nothing named docker* or swerl.
    tools = tmp_path / "tools"
    tools.mkdir()
    for name in ("bash", "env", "id", "dirname", "tail", "cp", "sleep"):
        found = shutil.which(name)
        assert found, name
        (tools / name).symlink_to(found)
    env = {
        "PATH": f"{fake}:{tools}",
        "HOME": str(tmp_path),
        "TMPDIR": str(tmp_path),
        "SWERL_APT_LOG": str(tmp_path / "apt.log"),
        "SWERL_DOCKERD_LOG": str(tmp_path / "dockerd.log"),
    }
    return checkout, env


def _run(checkout: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(checkout / "scripts" / "demo"), "--image", "x"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_demo_script_prints_only_swerls_own_lines(tmp_path):
    checkout, env = _machine(tmp_path)
    result = _run(checkout, env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    lines = output.splitlines()
    # It did install Docker (through apt-get) and ran `swerl demo` with the script's arguments.
    assert any(
        line.startswith("[docker-up] installing Debian packages: docker.io") for line in lines
    )
    assert DEMO_LINE in lines and "args: demo --image x" in lines
    foreign = [
        line
        for line in lines
        if not line.startswith(("[demo] ", "[docker-up] ", DEMO_LINE, "args: "))
    ]
    assert foreign == [], output
    # What pip and apt printed is in their logs.
    assert PIP_NOISE in (tmp_path / "swerl-demo-pip.log").read_text()
    assert APT_NOISE[0] in (tmp_path / "apt.log").read_text()


def test_a_failed_install_shows_pips_log(tmp_path):
    checkout, env = _machine(tmp_path, pip_fails=True)
    result = _run(checkout, env)
    assert result.returncode == 1
    assert "[demo] pip install failed; the end of its log:" in result.stderr
    assert "No matching distribution found for grpcio" in result.stderr
    assert DEMO_LINE not in result.stdout


def test_a_failed_apt_install_shows_apts_log(tmp_path):
    checkout, env = _machine(tmp_path)
    fake = Path(env["PATH"].split(":")[0])
    (fake / "apt-get").write_text(
        "#!/bin/bash\necho 'E: Unable to locate package docker.io' >&2\nexit 100\n"
    )
    result = _run(checkout, env)
    assert result.returncode == 1
    assert "[docker-up] installing docker.io failed; see" in result.stderr
    assert "E: Unable to locate package docker.io" in result.stderr
    assert DEMO_LINE not in result.stdout
    assert os.path.exists(env["SWERL_APT_LOG"])
