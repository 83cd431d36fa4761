"""The node's runtime and isolation class are settings (`--runtime docker|podman`, `--isolation
runc|gvisor`), checked at start: an unknown name, a runtime socket that is not there, a socket
that serves the other runtime, or an isolation class whose OCI runtime the daemon lacks is one
line from `swerl exec serve` (exit 2) and no node, never a half-started one (issue 38)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from testkit.exec import node_settings

from swerl.chassis.errors import StartupRefused
from swerl.exec.runtimes import check_runtime, open_runtime

SWERL = [sys.executable, "-m", "swerl.cli"]


def _serve(tmp_path: Path, *flags: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            *SWERL,
            *("exec", "serve", "--host", "127.0.0.1", "--port", "0"),
            *("--state-dir", str(tmp_path / "state"), "--auth-token", "t"),
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )


def test_an_unknown_runtime_is_refused_by_the_command_line(tmp_path: Path) -> None:
    done = _serve(tmp_path, "--runtime", "lxc")
    assert done.returncode == 2
    assert "invalid choice: 'lxc'" in done.stderr and "docker" in done.stderr
    assert "Traceback" not in done.stderr


def test_an_unknown_isolation_from_the_environment_is_one_line(tmp_path: Path) -> None:
    done = _serve(tmp_path, SWERL_EXEC_ISOLATION="kata")
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("swerl: invalid setting isolation:")
    assert "'runc'" in line and "'gvisor'" in line


def test_podman_without_its_socket_is_refused_naming_how_to_start_it(tmp_path: Path) -> None:
    socket = tmp_path / "podman.sock"
    done = _serve(tmp_path, "--runtime", "podman", "--docker-host", f"unix://{socket}")
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line == (
        f"swerl: runtime podman: no API socket at {socket}: start `podman system service`"
        " (deploy/podman-up.sh) or give --docker-host"
    )
    assert not (tmp_path / "state").exists() or not any((tmp_path / "state").iterdir())


def test_open_runtime_refuses_a_missing_docker_socket(tmp_path: Path) -> None:
    settings = node_settings(tmp_path, docker_host=f"unix://{tmp_path}/docker.sock")
    with pytest.raises(StartupRefused, match=r"no API socket at .*start dockerd"):
        open_runtime(settings)


@pytest.mark.docker
async def test_podman_asked_of_a_dockerd_socket_is_refused(tmp_path: Path) -> None:
    settings = node_settings(tmp_path, runtime="podman", docker_host="unix:///var/run/docker.sock")
    runtime = open_runtime(settings)
    try:
        with pytest.raises(StartupRefused) as refused:
            await check_runtime(runtime, settings)
    finally:
        runtime.close()
    assert "runtime podman was asked for, but the API at unix:///var/run/docker.sock" in str(
        refused.value
    )
    assert "is docker's: give --runtime docker" in str(refused.value)


class _DaemonWithout:
    """Just the two daemon questions check_runtime asks, answered as a dockerd without runsc."""

    def __init__(self, product: str, runtimes: list[str], default: str = "runc") -> None:
        self._product, self._runtimes, self._default = product, runtimes, default

    async def product(self) -> str:
        return self._product

    async def oci_runtimes(self) -> list[str]:
        return self._runtimes

    async def default_oci_runtime(self) -> str:
        return self._default


async def test_gvisor_on_a_daemon_without_runsc_is_refused_naming_how_to_register_it(
    tmp_path: Path,
) -> None:
    runtime = "docker"
    settings = node_settings(tmp_path, runtime=runtime, isolation="gvisor")
    daemon = _DaemonWithout(runtime, ["io.containerd.runc.v2", "runc"])
    with pytest.raises(StartupRefused) as refused:
        await check_runtime(daemon, settings)  # type: ignore[arg-type]
    message = str(refused.value)
    assert message.startswith(
        f"isolation gvisor needs the OCI runtime 'runsc', which {runtime} does not offer"
        " (it has: io.containerd.runc.v2, runc): install runsc and register it,"
    )
    assert "deploy/gvisor-up.sh" in message


async def test_runc_needs_no_runtime_of_its_own(tmp_path: Path) -> None:
    settings = node_settings(tmp_path)
    await check_runtime(_DaemonWithout("docker", ["runc"]), settings)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("isolation", "default", "says"),
    [
        (
            "gvisor",
            "runc",
            "a service whose default is runsc (unix:///run/podman/podman-runsc.sock)",
        ),
        ("runc", "runsc", "use --isolation gvisor, or a podman service that runs runc"),
    ],
)
async def test_podman_isolation_must_be_its_services_default_runtime(
    tmp_path: Path, isolation: str, default: str, says: str
) -> None:
    """Podman 4.3's compatible API ignores the runtime a create names: the isolation class is
    the service's default runtime, so a mismatch is refused at start (docs/runtimes-findings)."""
    settings = node_settings(tmp_path, runtime="podman", isolation=isolation)
    daemon = _DaemonWithout("podman", ["crun", "runc", "runsc"], default=default)
    with pytest.raises(StartupRefused) as refused:
        await check_runtime(daemon, settings)  # type: ignore[arg-type]
    message = str(refused.value)
    assert message.startswith(f"isolation {isolation} on podman: the service at")
    assert f"runs {default} for every container" in message and says in message
    matched = _DaemonWithout(
        "podman", ["runc", "runsc"], default="runsc" if isolation == "gvisor" else "runc"
    )
    await check_runtime(matched, settings)  # type: ignore[arg-type]
