"""The exec node tells its callers of a dockerd fault within seconds, with its cause.

These tests hang a dockerd of their own (tests/dockerd_kit.py): never the shared one.
"""

from __future__ import annotations

import asyncio
import os
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from conftest import RunningNode, node_settings, start_node
from dockerd_kit import Dockerd, start_dockerd
from exec_testkit import ExecStream, assert_status, rpc_error
from grpc_health.v1 import health_pb2, health_pb2_grpc

from swerl.exec.client import exec_start
from swerl.exec.v1 import sandbox_pb2 as pb

# The node pings dockerd every second and calls a ping unanswered after 2 s a hung dockerd.
INTERVAL_S, PING_TIMEOUT_S = 1.0, 2.0
TOLD_WITHIN_S = 10.0


@pytest.fixture(scope="module")
def own_dockerd(base_image) -> Iterator[Dockerd]:
    # A short root: its socket path must fit a unix socket name.
    root = Path(tempfile.mkdtemp(prefix="swerl-df-", dir="/tmp"))
    dockerd = start_dockerd(root, base_image=base_image)
    try:
        yield dockerd
    finally:
        dockerd.process.send_signal(signal.SIGCONT)  # Whatever a failed test left stopped.
        dockerd.stop()


@pytest.fixture
async def faulty_node(tmp_path, own_dockerd) -> RunningNode:
    running = await start_node(
        node_settings(
            tmp_path,
            docker_host=own_dockerd.host,
            default_memory_bytes=256 << 20,
            docker_health_interval_s=INTERVAL_S,
            docker_ping_timeout_s=PING_TIMEOUT_S,
        )
    )
    try:
        yield running
    finally:
        own_dockerd.process.send_signal(signal.SIGCONT)
        manager = running.node.manager
        for record in list(manager.list_sandboxes({})):
            await manager.destroy(record.sandbox_id)
        await running.channel.close()
        await running.node.stop(0)


async def serving(node: RunningNode) -> int:
    stub = health_pb2_grpc.HealthStub(node.channel)
    answer = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    return answer.status


async def told(call) -> tuple[grpc.aio.AioRpcError, float]:
    started = time.monotonic()
    err = await rpc_error(call)
    return err, time.monotonic() - started


async def test_a_hung_dockerd_is_told_to_create_sandbox_and_get_diff_within_10s(
    faulty_node, own_dockerd, base_image
):
    node = faulty_node
    sandbox = await node.create(base_image, workdir="/tmp")
    assert (await node.client.run(sandbox.sandbox_id, "echo up")).stdout == b"up\n"
    # Its container stopped from outside: the next command (a GetDiff) must start it again,
    # which takes dockerd.
    client = own_dockerd.client()
    try:
        await asyncio.to_thread(client.api.kill, f"swerl-{sandbox.sandbox_id}")
    finally:
        client.close()
    await asyncio.sleep(1.0)  # The node sees its shell end.
    assert await serving(node) == health_pb2.HealthCheckResponse.SERVING

    os.kill(own_dockerd.process.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        (create_err, _), (diff_err, _) = await asyncio.gather(
            told(
                node.stub.CreateSandbox(
                    pb.CreateSandboxRequest(image=base_image, workdir="/tmp"), timeout=150
                )
            ),
            told(node.stub.GetDiff(pb.GetDiffRequest(sandbox_id=sandbox.sandbox_id), timeout=150)),
        )
        told_s = time.monotonic() - stopped
        assert_status(create_err, grpc.StatusCode.UNAVAILABLE, "DOCKER_UNAVAILABLE")
        assert_status(diff_err, grpc.StatusCode.UNAVAILABLE, "DOCKER_UNAVAILABLE")
        assert told_s < TOLD_WITHIN_S, f"told after {told_s:.1f} s"
        assert "did not answer a ping" in create_err.details()
        # Meanwhile the node says it cannot serve, and a new call is refused at once.
        assert await serving(node) == health_pb2.HealthCheckResponse.NOT_SERVING
        err, took_s = await told(
            node.stub.CreateSandbox(pb.CreateSandboxRequest(image=base_image), timeout=150)
        )
        assert_status(err, grpc.StatusCode.UNAVAILABLE, "DOCKER_UNAVAILABLE")
        assert took_s < 2.0
    finally:
        os.kill(own_dockerd.process.pid, signal.SIGCONT)

    # dockerd answers again: the node serves again and its sandboxes work.
    deadline = time.monotonic() + 30
    while await serving(node) != health_pb2.HealthCheckResponse.SERVING:
        assert time.monotonic() < deadline, "the node never served again"
        await asyncio.sleep(0.2)
    again = await node.create(base_image, workdir="/tmp")
    assert (await node.client.run(again.sandbox_id, "echo back")).stdout == b"back\n"


async def test_a_dockerd_restart_under_a_running_exec_ends_it_within_5s(
    faulty_node, own_dockerd, base_image
):
    node = faulty_node
    sandbox = await node.create(base_image, workdir="/tmp")
    assert (await node.client.run(sandbox.sandbox_id, "echo up")).stdout == b"up\n"
    call = ExecStream(
        node.stub, exec_start(sandbox.sandbox_id, "sleep 120", notify_started=True), timeout_s=150
    )
    await call.started()
    restarted = time.monotonic()
    restart = asyncio.ensure_future(asyncio.to_thread(own_dockerd.restart))
    try:
        # dockerd stops its containers as it goes: the command is killed with its container,
        # and its caller hears so at once, not at a deadline.
        result = await asyncio.wait_for(call.result(), 10)
        told_s = time.monotonic() - restarted
        assert result.exit_code == 137
        assert told_s < 5.0, f"told after {told_s:.1f} s"
    finally:
        await restart
    # The next command finds the container started again, filesystem intact.
    deadline = time.monotonic() + 30
    while await serving(node) != health_pb2.HealthCheckResponse.SERVING:
        assert time.monotonic() < deadline, "the node never served again"
        await asyncio.sleep(0.2)
    again = await node.client.run(sandbox.sandbox_id, "echo again")
    assert again.stdout == b"again\n" and again.sandbox_restarted
