"""A command whose caller vanished with the node process (SIGKILL) does not keep running once
the node restarts and adopts the sandbox (issue 24, exit codes). The node runs as its own
process here (`swerl exec serve`), so it can be killed the way a crash or the OOM killer would."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import docker
import pytest
from testkit.exec import RPC_TIMEOUT_S, NodeProcess, remove_containers_of

from swerl.exec.v1 import sandbox_pb2 as pb

TOKEN = "orphan-test-token"
# The orphan: a process in the command's process group, its pid left in a file to look for.
ORPHAN = "sleep 1234 & echo $! > /tmp/orphan.pid; wait"
ALIVE = "kill -0 $(cat /tmp/orphan.pid)"


def _in_container(sandbox_id: str, script: str) -> int:
    client = docker.from_env()
    try:
        container = client.containers.get(f"swerl-{sandbox_id}")
        return int(container.exec_run(["bash", "-c", script]).exit_code)
    finally:
        client.close()


@pytest.mark.parametrize("session", [False, True], ids=["isolated", "session"])
async def test_a_command_whose_node_was_killed_is_ended_when_the_restarted_node_adopts_it(
    base_image, tmp_path, session
):
    node_id = "test-orphan-" + uuid.uuid4().hex[:8]
    state_dir = tmp_path / "state"
    log_path = tmp_path / "node.log"
    nodes: list[NodeProcess] = []
    try:
        first = NodeProcess(node_id, state_dir, log_path, TOKEN)
        nodes.append(first)
        await first.serving()
        request = pb.CreateSandboxRequest(image=base_image, workdir="/tmp", ttl={"seconds": 600})
        sid = (await first.client.stub.CreateSandbox(request, timeout=RPC_TIMEOUT_S)).sandbox
        sandbox_id = sid.sandbox_id
        running = asyncio.ensure_future(
            first.client.run(sandbox_id, ORPHAN, timeout_s=600, session=session)
        )
        deadline = time.monotonic() + 30
        while await asyncio.to_thread(_in_container, sandbox_id, ALIVE) != 0:
            assert not running.done(), running
            assert time.monotonic() < deadline, "the command never started"
            await asyncio.sleep(0.1)

        await first.kill()
        with contextlib.suppress(BaseException):
            await running
        # Nothing ends it while no node runs: the test would catch a node that did nothing.
        await asyncio.sleep(1.0)
        assert await asyncio.to_thread(_in_container, sandbox_id, ALIVE) == 0

        second = NodeProcess(node_id, state_dir, log_path, TOKEN)
        nodes.append(second)
        await second.serving()
        deadline = time.monotonic() + 10
        while await asyncio.to_thread(_in_container, sandbox_id, ALIVE) == 0:
            assert time.monotonic() < deadline, "the orphaned command still runs 10 s after"
            await asyncio.sleep(0.1)
        after = await second.client.run(sandbox_id, "echo ok", timeout_s=30, session=session)
        assert (after.exit_code, after.stdout) == (0, b"ok\n")
        destroyed = await second.client.stub.DestroySandbox(
            pb.DestroySandboxRequest(sandbox_id=sandbox_id), timeout=RPC_TIMEOUT_S
        )
        assert destroyed.existed
    finally:
        for node in nodes:
            await node.kill()
        await asyncio.to_thread(remove_containers_of, node_id)
