"""Faults on the real stack: the policy server dies, the exec node dies, the client cancels, the
pool revokes the lease, the policy aborts, the wall clock runs out. Infra failures are
INFRA_ERROR with no reward, and no sandbox is left behind."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from testkit.agent import (
    TOKENIZER_DIR,
    agent_stack,
    assert_no_active_lease,
    bundled_tasks,
    result_of,
    run_to_result,
    sandboxes_left,
    start_for,
    until_running,
)

from swerl.agent.v1 import agent_pb2 as pb
from swerl.chassis.timeconv import duration_pb
from swerl.devservers.replay import ReplayPolicyServer, script_key
from swerl.pool.client import PoolClient

pytestmark = pytest.mark.usefixtures("base_image")


def _bash(command: str) -> str:
    return f"Running it.\n\n```bash\n{command}\n```"


def _scripts(task, *commands: str) -> dict[str, list[str]]:
    return {script_key(task.instance["problem_statement"]): [_bash(c) for c in commands]}


async def _open(stub, start: pb.EpisodeStart):
    call = stub.RunEpisode(timeout=300)
    await call.write(pb.RunEpisodeRequest(start=start))
    return call


async def _until(call, kind: str) -> list[pb.RunEpisodeResponse]:
    seen = []
    while True:
        message = await call.read()
        seen.append(message)
        if message.WhichOneof("kind") == kind:
            return seen


async def _rest(call, within_s: float = 60.0) -> list[pb.RunEpisodeResponse]:
    """The rest of the episode's stream; a test fails in a minute rather than at pytest's
    timeout when the episode does not end (a fault that went unnoticed)."""

    async def rest() -> list[pb.RunEpisodeResponse]:
        return [message async for message in call]

    return await asyncio.wait_for(rest(), within_s)


async def test_cancel_ends_the_episode_cancelled_within_one_second_and_releases_the_lease():
    task = bundled_tasks()[0]
    replay = ReplayPolicyServer(_scripts(task, "ls", "sleep 60"))
    url = await replay.start()
    try:
        async with agent_stack() as env:
            call = await _open(env.stub, start_for(task, url, "cancel-1"))
            started = (await _until(call, "started"))[-1].started
            await until_running(started.sandbox_id, "sleep 60")
            sent = time.monotonic()
            await call.write(
                pb.RunEpisodeRequest(cancel=pb.EpisodeCancel(reason="rollout aborted"))
            )
            result = result_of(await _rest(call))
            elapsed = time.monotonic() - sent
            assert result.status == pb.EPISODE_STATUS_CANCELLED
            assert not result.HasField("reward") and result.error_reason == "CANCELLED"
            assert elapsed < 1.0, elapsed
            assert len(result.trajectory.response_ids) > 0  # the partial trajectory comes back
            await assert_no_active_lease(env)
    finally:
        await replay.stop()
    assert sandboxes_left() == []


async def test_killed_exec_node_ends_the_episode_infra_error_within_three_seconds():
    task = bundled_tasks()[0]
    replay = ReplayPolicyServer(_scripts(task, "ls", "sleep 60"))
    url = await replay.start()
    try:
        async with agent_stack() as env:
            call = await _open(env.stub, start_for(task, url, "node-kill"))
            started = (await _until(call, "started"))[-1].started
            await until_running(started.sandbox_id, "sleep 60")
            killed = time.monotonic()
            await env.stack.nodes[0].stop(0)
            result = result_of(await _rest(call))
            elapsed = time.monotonic() - killed
            assert result.status == pb.EPISODE_STATUS_INFRA_ERROR, result
            assert not result.HasField("reward")
            assert result.error_reason in ("SANDBOX_UNAVAILABLE", "LEASE_LOST")
            assert elapsed < 3.0, elapsed
            # The dead node's sandbox goes when the node comes back: the pool still holds the
            # released lease (RELEASING) and destroys the sandbox once the node answers.
            from swerl.exec.server import ExecNode

            restarted = ExecNode(env.stack.nodes[0].settings)
            await restarted.start()
            env.stack.nodes[0] = restarted
            for _ in range(60):
                if not sandboxes_left():
                    break
                await asyncio.sleep(0.5)
            assert sandboxes_left() == []
    finally:
        await replay.stop()
    assert sandboxes_left() == []


async def test_a_node_fault_ends_the_episode_infra_error_at_once_with_the_nodes_own_reason():
    task = bundled_tasks()[0]
    replay = ReplayPolicyServer(_scripts(task, "ls", "sleep 60"))
    url = await replay.start()
    try:
        async with agent_stack() as env:
            call = await _open(env.stub, start_for(task, url, "node-fault"))
            started = (await _until(call, "started"))[-1].started
            await until_running(started.sandbox_id, "sleep 60")
            # Docker stops the sandbox's container under the command (as `docker kill` does,
            # or a dockerd restarting): the node says so, and the episode ends with its words.
            stopped = time.monotonic()
            await asyncio.to_thread(
                subprocess.run,
                ["docker", "kill", f"swerl-{started.sandbox_id}"],
                check=True,
                capture_output=True,
            )
            result = result_of(await _rest(call))
            elapsed = time.monotonic() - stopped
            assert result.status == pb.EPISODE_STATUS_INFRA_ERROR, result
            assert result.error_reason == "SANDBOX_STOPPED", result
            assert "Docker stopped the sandbox's container (signal 9" in result.error_message
            assert not result.HasField("reward")
            assert elapsed < 5.0, elapsed
            await assert_no_active_lease(env)
            # This stack's node only: other runs on the shared dockerd use the same prefix.
            node_id = str(env.stack.nodes[0].settings.node_id)
    finally:
        await replay.stop()
    assert sandboxes_left(node_id) == []


async def test_revoked_lease_ends_the_episode_infra_error_lease_lost():
    task = bundled_tasks()[0]
    replay = ReplayPolicyServer(_scripts(task, "ls", "sleep 60"))
    url = await replay.start()
    try:
        async with agent_stack() as env:
            call = await _open(env.stub, start_for(task, url, "revoked"))
            started = (await _until(call, "started"))[-1].started
            await _until(call, "turn")
            pool = PoolClient(env.stack.pool_address, token=env.stack.token)
            await pool.drain_node(started.node_id, evict=True)
            await pool.close()
            result = result_of(await _rest(call))
            assert result.status == pb.EPISODE_STATUS_INFRA_ERROR
            assert result.error_reason in ("LEASE_LOST", "SANDBOX_UNAVAILABLE"), result
            assert not result.HasField("reward")
    finally:
        await replay.stop()
    assert sandboxes_left() == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_killed_policy_server_ends_the_episode_infra_error():
    task = bundled_tasks()[0]
    port = _free_port()
    process = subprocess.Popen(  # noqa: ASYNC220 (started once, before the loop's work)
        [
            sys.executable,
            "-m",
            "swerl.cli",
            "replay",
            "serve",
            "--port",
            str(port),
            "--latency-s",
            "0.3",
            "--tokenizer",
            TOKENIZER_DIR,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        line = await asyncio.to_thread(process.stdout.readline)
        assert b"serving" in line
        url = f"http://127.0.0.1:{port}"
        async with agent_stack(policy_connect_max_delay_s=1.0) as env:
            call = await _open(env.stub, start_for(task, url, "policy-kill"))
            await _until(call, "turn")
            os.killpg(process.pid, signal.SIGKILL)
            result = result_of(await _rest(call))
            assert result.status == pb.EPISODE_STATUS_INFRA_ERROR, result
            assert result.error_reason == "POLICY_UNAVAILABLE"
            assert not result.HasField("reward")
            await assert_no_active_lease(env)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    assert sandboxes_left() == []


async def test_policy_abort_ends_the_episode_aborted_without_reward():
    task = bundled_tasks()[0]
    replay = ReplayPolicyServer(_scripts(task, "ls", "ls"), abort_on_turn=1)
    url = await replay.start()
    try:
        async with agent_stack() as env:
            result = result_of(await run_to_result(env.stub, start_for(task, url, "abort")))
    finally:
        await replay.stop()
    assert result.status == pb.EPISODE_STATUS_ABORTED
    assert result.error_reason == "POLICY_ABORTED" and not result.HasField("reward")
    assert not result.HasField("report")
    assert sandboxes_left() == []


async def test_wall_timeout_ends_the_episode_limit_time_and_grades_the_diff():
    task = bundled_tasks()[0]
    replay = ReplayPolicyServer(_scripts(task, "echo x >> README.md", "sleep 60"))
    url = await replay.start()
    start = start_for(task, url, "wall")
    start.limits.wall_timeout.CopyFrom(duration_pb(3.0))
    try:
        async with agent_stack() as env:
            result = result_of(await run_to_result(env.stub, start))
    finally:
        await replay.stop()
    assert result.status == pb.EPISODE_STATUS_LIMIT_TIME
    assert b"README.md" in result.patch and result.reward == -1.0
    assert sandboxes_left() == []
