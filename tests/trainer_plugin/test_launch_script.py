"""deploy/slime's launch scripts: what they submit to Ray and how settings reach the plugin.

Ray, slime and miles are not installable here, so the scripts run with a recording `ray`
executable first on PATH (a dry run: nothing is started) and minimal framework checkouts (only
the model-args files they read: slime's `.sh`, miles' newer `.py` with its loader). What a
script hands to `ray job submit` is then checked: the framework's arguments, the hooks, resuming
(`--load` = `--save`), and the settings the plugin reads inside the RolloutManager (runtime env
+ custom config).
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

# Each test names its framework itself: scripts/test's miles pass leaves this file out.
pytestmark = pytest.mark.framework_neutral

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy/slime/run-qwen3-8b-grpo.sh"
SEED_SCRIPT = ROOT / "deploy/slime/run-qwen3-4b-instruct-grpo.sh"
SCRIPTS = sorted((ROOT / "deploy/slime").glob("*.sh"))

# A miles checkout's model-args loader, as far as the scripts use it: scripts/models/<type>.py
# declares model_args() -> str.
MILES_LOADER = """
import importlib.util, pathlib

def load_model_args(model_type):
    root = pathlib.Path(__file__).resolve().parents[3]
    spec = importlib.util.spec_from_file_location("m", root / "scripts/models" / f"{model_type}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return " ".join(module.model_args().split())
"""

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


def fake_checkouts(tmp_path: Path) -> tuple[Path, Path]:
    """slime with .sh model args; miles with .py model args and its loader."""
    slime = tmp_path / "slime"
    (slime / "scripts/models").mkdir(parents=True)
    (slime / "scripts/models/qwen3-8B.sh").write_text("MODEL_ARGS=(--num-layers 36)\n")
    (slime / "scripts/models/qwen3-4B-Instruct-2507.sh").write_text(
        "MODEL_ARGS=(--num-layers 36 --hidden-size 2560)\n"
    )
    miles = tmp_path / "miles"
    (miles / "scripts/models").mkdir(parents=True)
    (miles / "scripts/models/qwen3-4B-Instruct-2507.py").write_text(
        "def model_args():\n    return '--num-layers 36\\n --hidden-size 2560'\n"
    )
    loader = miles / "miles/utils/external_utils"
    loader.mkdir(parents=True)
    for package in (miles / "miles", miles / "miles/utils", loader):
        (package / "__init__.py").write_text("")
    (loader / "model_args_utils.py").write_text(MILES_LOADER)
    return slime, miles


def run_script(tmp_path: Path, script: Path = SCRIPT, **env: str) -> list[list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ray").write_text(RECORDING_RAY)
    (bin_dir / "ray").chmod(0o755)
    slime, miles = fake_checkouts(tmp_path)
    calls = tmp_path / "ray-calls.jsonl"
    values = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "RAY_CALLS": str(calls),
        "HEAD_SERVICES": str(ROOT / "deploy/slime/head_services.py"),
        "SLIME_DIR": str(slime),
        "MILES_DIR": str(miles),
        "LOG_DIR": str(tmp_path / "logs"),
        "START_RAY": "0",
        "HEAD_IP": "10.0.0.1",
        "SWERL_TOKEN": "tok",
        "SWERL_CAPABILITY_SECRET": "sec",
        "EXEC_NODES": "n1=10.0.0.11:5000 n2=10.0.0.12:5000",
        **env,
    }
    subprocess.run(["bash", str(script)], env=values, check=True, capture_output=True, timeout=180)
    return [json.loads(line) for line in calls.read_text().splitlines()]


def run_script_argv(tmp_path: Path, script: Path = SCRIPT, **env: str) -> list[list[str]]:
    return [record["argv"] for record in run_script(tmp_path, script, **env)]


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
    assert _flag(train, "--load") == _flag(train, "--save"), "a restarted job resumes"
    hooks = {
        "--custom-generate-function-path": "swerl.trainer_plugin.generate",
        "--custom-rm-path": "swerl.trainer_plugin.reward_func",
        "--custom-rollout-log-function-path": "swerl.trainer_plugin.log_rollout_data",
        "--custom-eval-rollout-log-function-path": "swerl.trainer_plugin.log_eval_rollout_data",
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


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_launch_script_parses(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.parametrize(
    ("framework", "generate_hook"),
    [("miles", "swerl.trainer_plugin.miles_generate"), ("slime", "swerl.trainer_plugin.generate")],
)
def test_the_seed_setup_trains_qwen3_4b_instruct_under_miles_or_slime(
    tmp_path, framework, generate_hook
):
    env = {"SERVICES_MODE": "external"}
    if framework == "slime":
        env["FRAMEWORK"] = "slime"  # miles is the default of the seed script
    (call,) = run_script_argv(tmp_path, SEED_SCRIPT, **env)
    runtime_env, train = _submit_parts(call)
    assert train[1] == str(tmp_path / framework / "train.py")
    assert runtime_env["PYTHONPATH"].endswith(str(tmp_path / framework))
    assert runtime_env["SWERL_PLUGIN_FRAMEWORK"] == framework
    assert _flag(train, "--custom-generate-function-path") == generate_hook
    assert _flag(train, "--hidden-size") == "2560", "the 4B-Instruct model args"
    assert _flag(train, "--hf-checkpoint") == "/root/Qwen3-4B-Instruct-2507"
    assert _flag(train, "--load") == _flag(train, "--save") == "/root/Qwen3-4B-Instruct-2507_swerl"
    # The seed's run: 4 GPUs, TP 2, one GPU per engine, 8 x 8 samples, temperature 0.8.
    assert _flag(train, "--actor-num-gpus-per-node") == "4"
    assert _flag(train, "--tensor-model-parallel-size") == "2"
    assert _flag(train, "--rollout-num-gpus-per-engine") == "1"
    assert _flag(train, "--rollout-batch-size") == _flag(train, "--n-samples-per-prompt") == "8"
    assert _flag(train, "--global-batch-size") == "64"
    assert _flag(train, "--rollout-temperature") == "0.8"
    assert _flag(train, "--rollout-max-response-len") == "8192"
    assert _flag(train, "--kl-loss-coef") == "0.01"


def test_miles_legacy_rollout_keeps_the_slime_style_hook_and_passes_its_switch_on(tmp_path):
    (call,) = run_script_argv(
        tmp_path, SEED_SCRIPT, SERVICES_MODE="external", MILES_USE_LEGACY_ROLLOUT_V1="1"
    )
    runtime_env, train = _submit_parts(call)
    assert _flag(train, "--custom-generate-function-path") == "swerl.trainer_plugin.generate"
    assert runtime_env["MILES_USE_LEGACY_ROLLOUT_V1"] == "1"


def test_an_unknown_framework_is_refused(tmp_path):
    with pytest.raises(subprocess.CalledProcessError) as failed:
        run_script_argv(tmp_path, FRAMEWORK="verl", SERVICES_MODE="external")
    assert b"FRAMEWORK must be slime or miles" in failed.value.stderr


DATA_SOURCE = "swerl.trainer_plugin.data_source.PrefetchingDataSource"


@pytest.mark.parametrize(
    ("env", "pool"),
    [
        ({}, "10.0.0.1:18090"),  # ray-actor: the head's own pool
        (
            {"SERVICES_MODE": "external", "POOL_ADDRESS": "pool.internal:18090"},
            "pool.internal:18090",
        ),
        ({"SERVICES_MODE": "external"}, None),  # no pool address known: no prefetch
        ({"PREFETCH": "0"}, None),
    ],
)
def test_prefetch_uses_the_data_source_and_the_pool_address_when_one_is_configured(
    tmp_path, env, pool
):
    (call,) = run_script_argv(tmp_path, **env)
    runtime_env, entry = _submit_parts(call)
    if pool is None:
        assert "--data-source-path" not in entry
        assert "SWERL_PLUGIN_POOL_ADDRESS" not in runtime_env
        return
    assert _flag(entry, "--data-source-path") == DATA_SOURCE
    module, _, name = DATA_SOURCE.rpartition(".")
    assert isinstance(getattr(__import__(module, fromlist=[name]), name), type)
    assert runtime_env["SWERL_PLUGIN_POOL_ADDRESS"] == pool
    assert runtime_env["SWERL_PLUGIN_POOL_TOKEN"] == "tok"


def test_the_seed_script_prefetches_too(tmp_path):
    (call,) = run_script_argv(tmp_path, SEED_SCRIPT)
    runtime_env, entry = _submit_parts(call)
    assert _flag(entry, "--data-source-path") == DATA_SOURCE
    assert runtime_env["SWERL_PLUGIN_POOL_ADDRESS"] == "10.0.0.1:18090"
