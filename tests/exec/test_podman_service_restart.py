"""A restart of Podman's API service under a running node (issue 38; the podman lane of
scripts/runtime-lanes runs this file, tests/exec/conftest.py keeps it out of the others).

Podman has no daemon holding the containers: conmon does, so a service that stops leaves the
sandboxes running, and the node's commands (which talk to the container's shell through its
I/O directory, not through the API) go on. What the API serves (a new sandbox, a side exec)
is refused while the service is away, told as the runtime's unavailability, and served again
once it answers. The test starts a service of its own on a socket of its own over the same
storage, so the lane's shared service is never touched."""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from testkit.exec import (
    ExecStream,
    RunningNode,
    assert_status,
    node_settings,
    rpc_error,
    serving,
    start_node,
)

from swerl.exec.client import exec_start
from swerl.exec.v1 import sandbox_pb2 as pb

pytestmark = pytest.mark.docker


class PodmanService:
    """`podman system service` on a socket of the test's own."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.socket = root / "podman.sock"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def host(self) -> str:
        return f"unix://{self.socket}"

    def answers(self) -> bool:
        probe = subprocess.run(
            ["podman", "--url", self.host, "version"], capture_output=True, timeout=20
        )
        return probe.returncode == 0

    def start(self) -> None:
        log = open(self.root / "service.log", "ab")  # the child holds it open
        self.process = subprocess.Popen(
            ["podman", "system", "service", "--time=0", self.host], stdout=log, stderr=log
        )
        log.close()
        deadline = time.monotonic() + 30
        while not self.answers():
            assert self.process.poll() is None, (self.root / "service.log").read_text()
            assert time.monotonic() < deadline, "podman's service did not answer within 30 s"
            time.sleep(0.1)

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None


@pytest.fixture(scope="module")
def service() -> Iterator[PodmanService]:
    assert shutil.which("podman"), "the podman lane needs podman (deploy/podman-up.sh)"
    root = Path(tempfile.mkdtemp(prefix="swerl-ps-", dir="/tmp"))
    running = PodmanService(root)
    running.start()
    try:
        yield running
    finally:
        running.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
async def podman_node(tmp_path, service) -> RunningNode:
    running = await start_node(
        node_settings(
            tmp_path,
            docker_host=service.host,
            runtime="podman",
            docker_health_interval_s=0.5,
            docker_ping_timeout_s=2.0,
        )
    )
    try:
        yield running
    finally:
        if service.process is None:
            service.start()
        manager = running.node.manager
        for record in list(manager.list_sandboxes({})):
            await manager.destroy(record.sandbox_id)
        await running.channel.close()
        await running.node.stop(0)


async def until_serving(node: RunningNode, want: int) -> None:
    deadline = time.monotonic() + 20
    while await serving(node) != want:
        assert time.monotonic() < deadline, f"the node's health never became {want}"
        await asyncio.sleep(0.1)


async def test_a_podman_service_restart_under_a_command_loses_nothing(
    podman_node, service, base_image
) -> None:
    node = podman_node
    sandbox = await node.create(base_image, workdir="/tmp")
    assert (await node.client.run(sandbox.sandbox_id, "echo up")).stdout == b"up\n"
    call = ExecStream(
        node.stub,
        exec_start(sandbox.sandbox_id, "sleep 4; echo finished", notify_started=True),
        timeout_s=60,
    )
    await call.started()

    await asyncio.to_thread(service.stop)
    # While the service is away the node says it cannot serve, and what needs the API (a new
    # sandbox) is refused at once as the runtime's unavailability, with no half-made sandbox.
    await until_serving(node, health_pb2.HealthCheckResponse.NOT_SERVING)
    err = await rpc_error(
        node.stub.CreateSandbox(pb.CreateSandboxRequest(image=base_image), timeout=30)
    )
    assert_status(err, grpc.StatusCode.UNAVAILABLE, "DOCKER_UNAVAILABLE")
    assert "podman's API service" in err.details(), err.details()  # not "dockerd"
    assert [s.sandbox_id for s in node.node.manager.list_sandboxes({})] == [sandbox.sandbox_id]

    # The command, held by conmon and not by the service, runs to its end meanwhile.
    result = await asyncio.wait_for(call.result(), 30)
    assert (result.exit_code, result.stdout) == (0, b"finished\n")

    await asyncio.to_thread(service.start)
    await until_serving(node, health_pb2.HealthCheckResponse.SERVING)
    again = await node.client.run(sandbox.sandbox_id, "echo again")
    assert again.stdout == b"again\n" and not again.sandbox_restarted
    fresh = await node.create(base_image, workdir="/tmp")
    assert (await node.client.run(fresh.sandbox_id, "echo new")).stdout == b"new\n"
