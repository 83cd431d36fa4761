"""The exec node tells its callers of a dockerd fault within seconds, with its cause.

These tests hang a dockerd of their own (tests/testkit/dockerd.py): never the shared one.
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
from grpc_health.v1 import health_pb2
from testkit.dockerd import Dockerd, start_dockerd
from testkit.exec import (
    ExecStream,
    RunningNode,
    assert_status,
    node_settings,
    rpc_error,
    serving,
    start_node,
)

from swerl.chassis.client import error_info
from swerl.exec.client import exec_start
from swerl.exec.errors import DockerUnavailable
from swerl.exec.v1 import evaluate_pb2, evaluate_pb2_grpc
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
        # A restart test can end while its dockerd is still coming back (no socket yet, or one
        # that does not answer yet: seen in CI three times); it is waited for (its account
        # printed, and started again if it exited), then the node must see it again at its next
        # health ping before a destroy goes through, so each destroy is tried for up to 30 s.
        await asyncio.to_thread(own_dockerd.answer_again)
        manager = running.node.manager
        try:
            for record in list(manager.list_sandboxes({})):
                began = time.monotonic()
                while True:
                    try:
                        await manager.destroy(record.sandbox_id)
                        break
                    except DockerUnavailable:
                        if time.monotonic() - began > 30:
                            raise
                        await asyncio.sleep(0.2)
        except Exception:
            print(own_dockerd.describe())  # shown with the teardown's error
            raise
        await running.channel.close()
        await running.node.stop(0)


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


async def served_again(node: RunningNode) -> None:
    deadline = time.monotonic() + 30
    while await serving(node) != health_pb2.HealthCheckResponse.SERVING:
        assert time.monotonic() < deadline, "the node never served again"
        await asyncio.sleep(0.2)


async def running_in(dockerd: Dockerd, sandbox_id: str, command: str) -> None:
    """Waits until `command` runs in the sandbox's container (Docker's `top`)."""
    client = dockerd.client()
    try:
        deadline = time.monotonic() + 20
        while command not in str(await asyncio.to_thread(client.api.top, f"swerl-{sandbox_id}")):
            assert time.monotonic() < deadline, f"{command!r} never ran"
            await asyncio.sleep(0.1)
    finally:
        client.close()


def restart_soon(dockerd: Dockerd) -> tuple[asyncio.Future[None], float]:
    """Restarts the dockerd in the background; returns the restart and when it began."""
    return asyncio.ensure_future(asyncio.to_thread(dockerd.restart)), time.monotonic()


# A stopping dockerd stops its containers (SIGTERM, recorded as a kill) and closes its API
# socket, in an order that varies: the node that asks right after the command's end hears either
# that Docker stopped the container, or nothing from dockerd at all.
RESTART_REASONS = ("SANDBOX_STOPPED", "DOCKER_UNAVAILABLE")


def assert_restart_told(err: grpc.aio.AioRpcError) -> None:
    assert err.code() == grpc.StatusCode.UNAVAILABLE, err
    reason, metadata = error_info(err)
    assert reason in RESTART_REASONS, err
    if reason == "SANDBOX_STOPPED":
        assert "Docker stopped the sandbox's container" in err.details()
        assert metadata["signal"] == "15"  # dockerd stops its containers with SIGTERM
    else:
        assert "dockerd went away while the command ran" in err.details()


async def test_a_dockerd_restart_under_a_running_exec_tells_its_caller_within_5s(
    faulty_node, own_dockerd, base_image
):
    node = faulty_node
    sandbox = await node.create(base_image, workdir="/tmp")
    assert (await node.client.run(sandbox.sandbox_id, "echo up")).stdout == b"up\n"
    call = ExecStream(
        node.stub, exec_start(sandbox.sandbox_id, "sleep 120", notify_started=True), timeout_s=150
    )
    await call.started()
    restart, restarted = restart_soon(own_dockerd)
    try:
        # dockerd stops its containers as it goes: the command is lost with its container, and
        # its caller hears why at once (not a bare 137, not at a deadline).
        err = await asyncio.wait_for(rpc_error(call.result()), 10)
        told_s = time.monotonic() - restarted
        assert_restart_told(err)
        assert told_s < 5.0, f"told after {told_s:.1f} s"
    finally:
        await restart
    # The next command finds the container started again, filesystem intact.
    await served_again(node)
    again = await node.client.run(sandbox.sandbox_id, "echo again")
    assert again.stdout == b"again\n" and again.sandbox_restarted


# A repository whose `git add` takes a minute: a clean filter that sleeps, so GetDiff is in
# flight (its script in the container) when dockerd restarts.
SLOW_REPO = (
    "git init -q /tmp/repo && cd /tmp/repo && git config user.email t@t && git config user.name t"
    " && echo one > f && git add f && git commit -qm base"
    " && git config filter.slow.clean 'sleep 60; cat' && echo '* filter=slow' > .gitattributes"
    " && echo two > f"
)


async def test_a_dockerd_restart_under_a_running_get_diff_tells_its_caller_within_5s(
    faulty_node, own_dockerd, base_image
):
    node = faulty_node
    sandbox = await node.create(base_image, workdir="/tmp")
    made = await node.client.run(sandbox.sandbox_id, SLOW_REPO)
    assert made.exit_code == 0, made.stderr
    diff = asyncio.ensure_future(
        told(
            node.stub.GetDiff(
                pb.GetDiffRequest(sandbox_id=sandbox.sandbox_id, path="/tmp/repo"),
                timeout=150,
            )
        )
    )
    # The diff's script is waiting on the filter.
    await running_in(own_dockerd, sandbox.sandbox_id, "sleep 60")
    restart, restarted = restart_soon(own_dockerd)
    try:
        err, _ = await asyncio.wait_for(diff, 10)
        told_s = time.monotonic() - restarted
        assert_restart_told(err)
        assert told_s < 5.0, f"told after {told_s:.1f} s"
    finally:
        await restart


async def test_a_dockerd_restart_under_a_running_evaluate_reports_infra_error_within_5s(
    faulty_node, own_dockerd, base_image
):
    node = faulty_node
    sandbox = await node.create(base_image, workdir="/tmp")
    made = await node.client.run(
        sandbox.sandbox_id,
        "git init -q /testbed && cd /testbed && git config user.email t@t"
        " && git config user.name t && echo one > f && git add f && git commit -qm base",
    )
    assert made.exit_code == 0, made.stderr
    instance = evaluate_pb2.SweInstance(
        instance_id="slow-tests",
        eval_type="exit_code",
        eval_script="#!/bin/bash\necho testing\nsleep 60\n",
    )
    patch = b"diff --git a/g b/g\nnew file mode 100644\n--- /dev/null\n+++ b/g\n@@ -0,0 +1 @@\n+x\n"
    stub = evaluate_pb2_grpc.EvaluateServiceStub(node.channel)
    stream = stub.Evaluate(
        evaluate_pb2.EvaluateRequest(
            request_id="r1", sandbox_id=sandbox.sandbox_id, instance=instance, patch=patch
        ),
        timeout=150,
    )
    async for response in stream:
        kind = response.WhichOneof("kind")
        assert kind != "report", f"the evaluation ended early: {response.report}"
        if kind == "phase" and response.phase.phase == evaluate_pb2.EVALUATION_PHASE_RUN_TESTS:
            break
    await running_in(own_dockerd, sandbox.sandbox_id, "sleep 60")
    restart, restarted = restart_soon(own_dockerd)
    try:

        async def report() -> evaluate_pb2.EvaluationReport:
            async for response in stream:
                if response.WhichOneof("kind") == "report":
                    return response.report
            raise AssertionError("Evaluate ended without a report")

        got = await asyncio.wait_for(report(), 10)
        told_s = time.monotonic() - restarted
        assert got.status == evaluate_pb2.EVALUATION_STATUS_INFRA_ERROR, got
        assert got.error_reason in RESTART_REASONS, got
        assert got.failed_phase == evaluate_pb2.EVALUATION_PHASE_RUN_TESTS
        assert told_s < 5.0, f"told after {told_s:.1f} s"
    finally:
        await restart
