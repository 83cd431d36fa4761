"""deploy/: systemd units pass `systemd-analyze verify`, env files are valid settings, the
compose file validates with `docker compose config`, the bootstrap script plans the right steps."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from swerl.agent.settings import AgentSettings
from swerl.exec.settings import ExecSettings
from swerl.pool.settings import PoolSettings
from swerl.prm.settings import PrmSettings

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
UNITS = {
    "exec": ExecSettings,
    "pool": PoolSettings,
    "agent": AgentSettings,
    "prm": PrmSettings,
}


def _systemd_analyze() -> str:
    found = shutil.which("systemd-analyze")
    if found is None:
        pytest.fail("systemd-analyze is missing: apt-get install systemd (scripts/test does)")
    return found


def _unit(name: str) -> str:
    return (DEPLOY / "systemd" / f"swerl-{name}.service").read_text()


def _directive(unit: str, key: str) -> list[str]:
    return re.findall(rf"^{key}=(.*)$", unit, flags=re.MULTILINE)


def _env_file(name: str) -> dict[str, str]:
    values = {}
    for line in (DEPLOY / "env" / f"{name}.env").read_text().splitlines():
        match = re.match(r"^(SWERL_\w+)=(.*)$", line)
        if match:
            values[match.group(1)] = match.group(2)
    return values


def test_every_unit_passes_systemd_analyze_verify_without_a_warning(tmp_path):
    analyze = _systemd_analyze()
    # verify checks that ExecStart exists: point it at this environment's real `swerl`.
    swerl = Path(sys.executable).with_name("swerl")
    assert swerl.exists(), swerl
    paths = []
    for name in UNITS:
        unit = _unit(name).replace("/opt/swerl/venv/bin/swerl", str(swerl))
        path = tmp_path / f"swerl-{name}.service"
        path.write_text(unit)
        paths.append(str(path))
    result = subprocess.run(
        [analyze, "verify", *paths], capture_output=True, text=True, timeout=120
    )
    # verify exits 0 on unknown keys and bad values, and only warns: any output is a finding.
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "" and result.stderr.strip() == "", result.stderr


def test_verify_does_catch_a_broken_unit(tmp_path):
    analyze = _systemd_analyze()
    broken = _unit("pool").replace("NoNewPrivileges=yes", "NoNewPrivilegez=yes")
    broken = broken.replace("/opt/swerl/venv/bin/swerl", str(Path(sys.executable)))
    path = tmp_path / "swerl-pool.service"
    path.write_text(broken)
    result = subprocess.run([analyze, "verify", str(path)], capture_output=True, text=True)
    assert "Unknown key" in result.stderr


@pytest.mark.parametrize("name", list(UNITS))
def test_units_stop_after_the_drain_grace_restart_on_failure_and_are_hardened(name):
    unit = _unit(name)
    grace = float(_env_file(name)[f"SWERL_{name.upper()}_DRAIN_GRACE_S"])
    (timeout,) = _directive(unit, "TimeoutStopSec")
    assert float(timeout) > grace + 5
    assert _directive(unit, "Restart") == ["on-failure"]
    assert _directive(unit, "EnvironmentFile") == [f"/etc/swerl/{name}.env"]
    assert _directive(unit, "KillSignal") == ["SIGTERM"]
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "CapabilityBoundingSet": "",
        "User": "swerl",
    }.items():
        assert _directive(unit, key) == [value], key
    assert _directive(unit, "ExecStart") == [f"/opt/swerl/venv/bin/swerl {name} serve"]


def test_the_exec_unit_needs_docker_and_keeps_its_state_at_the_host_path():
    unit = _unit("exec")
    assert "docker.service" in _directive(unit, "Requires")[0]
    assert _directive(unit, "SupplementaryGroups") == ["docker"]
    assert _directive(unit, "StateDirectory") == ["swerl/exec"]
    assert "SWERL_EXEC_STATE_DIR=/var/lib/swerl/exec" in _directive(unit, "Environment")


@pytest.mark.parametrize("name", list(UNITS))
def test_example_env_files_are_valid_settings_of_their_service(name, monkeypatch):
    settings_cls = UNITS[name]
    prefix = settings_cls.model_config["env_prefix"]
    for key in list(os.environ):
        if key.startswith("SWERL_"):
            monkeypatch.delenv(key)
    text = (DEPLOY / "env" / f"{name}.env").read_text()
    for match in re.finditer(r"^#?(SWERL_\w+)=", text, flags=re.MULTILINE):
        field = match.group(1).removeprefix(prefix).lower()
        assert field in settings_cls.model_fields, f"{name}.env names no setting {match.group(1)}"
    settings = settings_cls(_env_file=str(DEPLOY / "env" / f"{name}.env"))
    assert settings.auth_token is not None and not settings.insecure
    assert settings.log_format == "json"


def test_bootstrap_dry_run_plans_docker_user_venv_env_unit_and_pre_pull(tmp_path):
    images = tmp_path / "images.txt"
    images.write_text("swerl-base:bookworm\n")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    env = {**os.environ, "SWERL_ETC": str(tmp_path / "etc")}
    result = subprocess.run(
        [
            "bash",
            str(DEPLOY / "bootstrap-node.sh"),
            "--dry-run",
            "--images",
            str(images),
            "--wheelhouse",
            str(wheels),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    planned = [line[2:] for line in result.stdout.splitlines() if line.startswith("+ ")]
    order = [
        "systemctl enable --now docker.service",
        "usermod -a -G docker swerl",
        f"--no-index --find-links {wheels} --upgrade swerl[node]",
        f"{tmp_path / 'etc'}/exec.env",
        "/etc/systemd/system/swerl-exec.service",
        "systemctl restart swerl-exec.service",
        f"images pull --images {images} --node 127.0.0.1:5000",
    ]
    positions = [next(i for i, line in enumerate(planned) if step in line) for step in order]
    assert positions == sorted(positions), planned
    # The token goes through the environment, never onto a command line.
    assert not any("change-me" in line for line in planned)


def test_bootstrap_refuses_missing_inputs(tmp_path):
    result = subprocess.run(
        ["bash", str(DEPLOY / "bootstrap-node.sh"), "--dry-run", "--images", str(tmp_path / "x")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1 and "not found" in result.stderr


def _compose() -> list[str]:
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True)
    if probe.returncode != 0:
        install = subprocess.run(
            ["bash", str(DEPLOY / "install-compose.sh")], capture_output=True, text=True
        )
        if install.returncode != 0:
            pytest.fail(f"docker compose unavailable and not installable:\n{install.stderr}")
    return ["docker", "compose", "-f", str(DEPLOY / "compose.yaml")]


@pytest.mark.docker  # the docker CLI's compose plugin
def test_compose_file_validates_with_docker_compose_config():
    result = subprocess.run(
        [*_compose(), "config", "--format", "json"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    import json

    config = json.loads(result.stdout)
    assert set(config["services"]) == {"exec", "pool", "agent", "prm", "policy", "judge"}
    exec_service = config["services"]["exec"]
    mounts = {m["target"]: m for m in exec_service["volumes"]}
    assert "/var/run/docker.sock" in mounts
    state = exec_service["environment"]["SWERL_EXEC_STATE_DIR"]
    assert mounts[state]["source"] == state  # the same path inside and out
    for service in config["services"].values():
        assert all(p["host_ip"] == "127.0.0.1" for p in service.get("ports", []))


@pytest.mark.docker  # the docker CLI's compose plugin
def test_compose_config_rejects_a_broken_file(tmp_path):
    broken = tmp_path / "compose.yaml"
    broken.write_text((DEPLOY / "compose.yaml").read_text().replace("services:", "servicez:"))
    result = subprocess.run(
        ["docker", "compose", "-f", str(broken), "config", "-q"], capture_output=True, text=True
    )
    assert result.returncode != 0
