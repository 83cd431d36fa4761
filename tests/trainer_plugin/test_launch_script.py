"""deploy/slime/run-qwen3-8b-grpo.sh: what it submits to Ray and how settings reach the plugin.

Ray and slime are not installable here, so the script runs with a recording `ray` executable
first on PATH and a minimal slime checkout (only the model-args file it sources). What the
script hands to `ray job submit` is then checked: slime's arguments, the hooks, and the
settings that the plugin reads inside slime's RolloutManager (runtime env + custom config).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
from pathlib import Path

import pytest
import yaml

from swerl.trainer_plugin.settings import settings_from_args

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy/slime/run-qwen3-8b-grpo.sh"

# Records its arguments; with PROBE set ("name=host:port ..."), also whether each server there
# is SERVING at the moment the job is submitted.
RECORDING_RAY = """#!/usr/bin/env bash
python3 - "$@" <<'PY'
import json, os, subprocess, sys
record = {"argv": sys.argv[1:], "serving": {}}
for item in os.environ.get("PROBE", "").split():
    name, address = item.split("=", 1)
    probe = [sys.executable, os.environ["HEAD_SERVICES"], "--wait-serving", address,
             "--timeout-s", "5"]
    record["serving"][name] = subprocess.run(probe).returncode == 0
with open(os.environ["RAY_CALLS"], "a") as out:
    out.write(json.dumps(record) + "\\n")
PY
"""


def run_script(tmp_path: Path, **env: str) -> list[list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ray").write_text(RECORDING_RAY)
    (bin_dir / "ray").chmod(0o755)
    slime = tmp_path / "slime"
    (slime / "scripts/models").mkdir(parents=True)
    (slime / "scripts/models/qwen3-8B.sh").write_text("MODEL_ARGS=(--num-layers 36)\n")
    calls = tmp_path / "ray-calls.jsonl"
    values = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "RAY_CALLS": str(calls),
        "HEAD_SERVICES": str(ROOT / "deploy/slime/head_services.py"),
        "SLIME_DIR": str(slime),
        "LOG_DIR": str(tmp_path / "logs"),
        "START_RAY": "0",
        "HEAD_IP": "10.0.0.1",
        "SWERL_TOKEN": "tok",
        "SWERL_CAPABILITY_SECRET": "sec",
        "EXEC_NODES": "n1=10.0.0.11:5000 n2=10.0.0.12:5000",
        **env,
    }
    subprocess.run(["bash", str(SCRIPT)], env=values, check=True, capture_output=True, timeout=180)
    return [json.loads(line) for line in calls.read_text().splitlines()]


def run_script_argv(tmp_path: Path, **env: str) -> list[list[str]]:
    return [record["argv"] for record in run_script(tmp_path, **env)]


def _submit_parts(call: list[str]) -> tuple[dict[str, str], list[str]]:
    assert call[:2] == ["job", "submit"]
    runtime_env = json.loads(call[call.index("--runtime-env-json") + 1])
    return runtime_env["env_vars"], call[call.index("--") + 1 :]


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_job_runs_slime_grpo_with_the_seed_arguments_and_every_swerl_hook(tmp_path):
    (call,) = run_script_argv(tmp_path, SERVICES_MODE="external")
    _, train = _submit_parts(call)
    assert train[0] == "python3" and train[1].endswith("slime/train.py")
    assert _flag(train, "--advantage-estimator") == "grpo"
    assert _flag(train, "--rollout-max-context-len") == "16384"
    assert _flag(train, "--rollout-max-response-len") == "4096"
    assert _flag(train, "--n-samples-per-prompt") == "8"
    assert _flag(train, "--num-layers") == "36", "the Qwen3-8B model args are sourced"
    hooks = {
        "--custom-generate-function-path": "swerl.trainer_plugin.generate",
        "--custom-rm-path": "swerl.trainer_plugin.reward_func",
        "--custom-rollout-log-function-path": "swerl.trainer_plugin.log_rollout_data",
        "--dynamic-sampling-filter-path": "swerl.trainer_plugin.filter_infra_failures",
        "--custom-reward-post-process-path": "swerl.trainer_plugin.post_process_rewards",
    }
    for flag, path in hooks.items():
        assert _flag(train, flag) == path
        module, _, name = path.rpartition(".")
        assert callable(getattr(__import__(module, fromlist=[name]), name))


def test_settings_reach_the_plugin_through_the_runtime_env_and_the_custom_config(
    tmp_path, monkeypatch
):
    (call,) = run_script_argv(
        tmp_path,
        SERVICES_MODE="external",
        DYNAMIC_HISTORY="1",
        WITH_PRM="1",
        MAX_TURNS="40",
        PRM_JUDGE_URL="http://10.0.0.9:30000",
        PRM_JUDGE_TOKENIZER="/models/judge",
    )
    env, train = _submit_parts(call)
    # What slime does in the RolloutManager: the runtime env is the process env, and every
    # top-level key of --custom-config-path becomes an attribute of args.
    for key in [k for k in os.environ if k.startswith("SWERL_PLUGIN_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        if key.startswith("SWERL_PLUGIN_"):
            monkeypatch.setenv(key, value)
    config = yaml.safe_load(Path(_flag(train, "--custom-config-path")).read_text())
    settings = settings_from_args(argparse.Namespace(**config))
    assert settings.agent_addresses == ["10.0.0.1:18091"]
    assert settings.agent_token.get_secret_value() == "tok"
    assert settings.dynamic_history is True and settings.prm_enabled is True
    assert settings.max_turns == 40 and settings.max_context_tokens == 16384
    assert settings.prm_coef == pytest.approx(0.2)


def test_ray_actor_mode_makes_the_job_own_the_head_services(tmp_path):
    (call,) = run_script_argv(
        tmp_path, WITH_PRM="1", PRM_JUDGE_URL="http://j:30000", PRM_JUDGE_TOKENIZER="/m/judge"
    )
    env, entry = _submit_parts(call)
    assert entry[:2] == ["python3", str(ROOT / "deploy/slime/head_services.py")]
    assert _flag(entry, "--services") == "pool,prm,agent"
    nodes = entry[entry.index("--exec-nodes") + 1 : entry.index("--state-dir")]
    assert nodes == ["n1=10.0.0.11:5000", "n2=10.0.0.12:5000"]
    train = entry[entry.index("--", 2) + 1 :]
    assert train[1].endswith("slime/train.py")
    # The services read their tokens from the same runtime env.
    assert env["SWERL_POOL_AUTH_TOKEN"] == "tok" and env["SWERL_POOL_CAPABILITY_SECRET"] == "sec"
    assert env["SWERL_PLUGIN_AGENT_TOKEN"] == "tok"
    assert env["SWERL_PRM_JUDGE_URL"] == "http://j:30000"


def test_the_script_refuses_to_start_without_a_token(tmp_path):
    with pytest.raises(subprocess.CalledProcessError) as failed:
        run_script_argv(tmp_path, SWERL_TOKEN="")
    assert b"SWERL_TOKEN" in failed.value.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_processes_mode_serves_pool_and_agent_during_the_job_and_stops_them_after(tmp_path):
    ports = {"pool": _free_port(), "agent": _free_port()}
    probe = " ".join(f"{name}=127.0.0.1:{port}" for name, port in ports.items())
    (record,) = run_script(
        tmp_path,
        SERVICES_MODE="processes",
        EXEC_NODES="",
        STATE_DIR=str(tmp_path / "state"),
        POOL_PORT=str(ports["pool"]),
        AGENT_PORT=str(ports["agent"]),
        PROBE=probe,
    )
    assert record["serving"] == {"pool": True, "agent": True}, "services were up for the job"
    env, train = _submit_parts(record["argv"])
    assert env["SWERL_PLUGIN_AGENT_ADDRESSES"] == f"10.0.0.1:{ports['agent']}"
    assert train[1].endswith("slime/train.py")
    for port in ports.values():  # the script's exit stopped them
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still served"
