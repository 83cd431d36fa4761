"""A node process stopped (SIGSTOP) for 10 s: the callers of its calls in flight hear so within
5 s, from the pings of their channel (swerl.exec.client.NODE_CHANNEL_OPTIONS, what the agent's
lease channels use), not at their 60/120 s deadlines. The node runs as its own process
(`swerl exec serve`) so that it can be stopped."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import traceback
import uuid

import docker
import grpc
from testkit.exec import RPC_TIMEOUT_S, ExecStream, NodeProcess, remove_containers_of, rpc_error

from swerl.exec.client import NODE_CHANNEL_OPTIONS, exec_start
from swerl.exec.v1 import sandbox_pb2 as pb

TOKEN = "stopped-node-token"
STOPPED_S = 10.0
TOLD_WITHIN_S = 5.0
# A repository whose `git add` takes a minute (a clean filter that sleeps), so a GetDiff is in
# flight while the node is stopped.
SLOW_REPO = (
    "git init -q /tmp/repo && cd /tmp/repo && git config user.email t@t && git config user.name t"
    " && echo one > f && git add f && git commit -qm base"
    " && git config filter.slow.clean 'sleep 60; cat' && echo '* filter=slow' > .gitattributes"
    " && echo two > f"
)


def _top(sandbox_id: str) -> str:
    client = docker.from_env()
    try:
        return str(client.api.top(f"swerl-{sandbox_id}"))
    finally:
        client.close()


async def test_a_node_stopped_for_10s_tells_its_exec_and_get_diff_callers_within_5s(
    base_image, tmp_path
):
    node_id = "test-stopped-" + uuid.uuid4().hex[:8]
    node = NodeProcess(
        node_id, tmp_path / "state", tmp_path / "node.log", TOKEN, NODE_CHANNEL_OPTIONS
    )
    stub = node.client.stub
    try:
        await node.serving()
        created = [
            (
                await stub.CreateSandbox(
                    pb.CreateSandboxRequest(image=base_image, workdir="/tmp"),
                    timeout=RPC_TIMEOUT_S,
                )
            ).sandbox.sandbox_id
            for _ in range(2)
        ]
        runner, differ = created
        made = await node.client.run(differ, SLOW_REPO)
        assert made.exit_code == 0, made.stderr
        command = ExecStream(
            stub, exec_start(runner, "sleep 120", notify_started=True), timeout_s=150
        )
        await command.started()
        diff = asyncio.ensure_future(
            rpc_error(
                stub.GetDiff(pb.GetDiffRequest(sandbox_id=differ, path="/tmp/repo"), timeout=150)
            )
        )
        deadline = time.monotonic() + 20
        while "sleep 60" not in await asyncio.to_thread(_top, differ):
            assert time.monotonic() < deadline, "the diff never reached its filter"
            await asyncio.sleep(0.1)

        os.kill(node.process.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            exec_err = await asyncio.wait_for(rpc_error(command.result()), 15)
            exec_s = time.monotonic() - stopped
            diff_err = await asyncio.wait_for(diff, 15)
            diff_s = time.monotonic() - stopped
            # A call made while the node is still stopped, on a channel whose connection is
            # gone, is told as soon: the new connection's attempt gives up in seconds.
            late = time.monotonic()
            late_err = await rpc_error(node.client.run(runner, "echo late", timeout_s=5))
            late_s = time.monotonic() - late
        finally:
            await asyncio.sleep(max(0.0, STOPPED_S - (time.monotonic() - stopped)))
            os.kill(node.process.pid, signal.SIGCONT)
        for err in (exec_err, diff_err):
            assert err.code() == grpc.StatusCode.UNAVAILABLE, err
            assert "ping timeout" in err.details(), err.details()
        assert exec_s < TOLD_WITHIN_S, f"Exec told after {exec_s:.1f} s"
        assert diff_s < TOLD_WITHIN_S, f"GetDiff told after {diff_s:.1f} s"
        # Where it was raised goes with a failure (a send failure told late, at a read, was
        # once seen under load).
        assert late_err.code() == grpc.StatusCode.UNAVAILABLE, "".join(
            traceback.format_exception(late_err)
        )
        assert late_s < TOLD_WITHIN_S, f"a call to the stopped node told after {late_s:.1f} s"

        # Continued, the node serves again, and the sandbox whose caller went away runs the
        # next command.
        await node.serving()
        again = await node.client.run(runner, "echo back")
        assert again.stdout == b"back\n"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(node.process.pid, signal.SIGCONT)
        await node.kill()
        await asyncio.to_thread(remove_containers_of, node_id)
