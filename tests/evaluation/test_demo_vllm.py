"""`swerl demo --engine vllm`: one line saying what to run when vLLM's environment is missing
(before anything starts), and (marked vllm) the demo's episodes resolved by the run's engine."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest
from testkit.vllm_engine import VllmEngine, wait_for_engine


def _demo_env(**changes: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWERL_VLLM_")}
    return {**env, **changes}


async def _demo(*args: str, env: dict[str, str], timeout_s: float) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "swerl.cli",
        "demo",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=timeout_s)
    return process.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace")


async def test_demo_on_vllm_without_its_environment_says_what_to_run(tmp_path) -> None:
    missing = tmp_path / "no-vllm-env"
    code, out, err = await _demo(
        "--engine", "vllm", env=_demo_env(SWERL_VLLM_ENV=str(missing)), timeout_s=60
    )
    assert code == 2
    assert err.strip() == (
        f"swerl demo: --engine vllm needs vLLM's environment ({missing}/bin/python and the model"
        f" {missing}/swerl-tiny-qwen3 are not there): run scripts/vllm-env once (about 2"
        " minutes), or give --policy-url of a running engine"
    )
    assert out == ""  # nothing started: not even the exec node's tour


async def test_demo_refuses_a_policy_url_without_the_vllm_engine() -> None:
    code, out, err = await _demo(
        "--policy-url", "http://127.0.0.1:9", env=_demo_env(), timeout_s=60
    )
    assert (code, out) == (2, "")
    assert err.strip() == "swerl demo: --policy-url is the engine of --engine vllm"


@pytest.fixture(scope="module")
def vllm_engine() -> VllmEngine:
    return wait_for_engine()


@pytest.mark.vllm
@pytest.mark.usefixtures("base_image")
async def test_demo_on_the_runs_vllm_engine_resolves_every_bundled_task(
    vllm_engine: VllmEngine,
) -> None:
    code, out, err = await _demo(
        "--engine", "vllm", "--policy-url", vllm_engine.url, env=dict(os.environ), timeout_s=400
    )
    assert code == 0, out + err
    assert "vLLM gold: 6/6 resolved (+1); 24 forced engine calls" in out
    assert f"vLLM {vllm_engine.url}" in out
