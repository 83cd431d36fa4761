"""Shared pieces of the exec node's integration tests: status checks, live Exec calls, Docker,
and an in-process node on port 0 with its client (`start_node(node_settings(tmp_path))`, what the
`node_factory` fixture of tests/exec/conftest.py starts)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any

import docker
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from swerl.chassis.client import error_info, make_channel
from swerl.exec.client import ExecResult, SandboxClient
from swerl.exec.server import ExecNode
from swerl.exec.settings import ExecSettings
from swerl.exec.v1 import sandbox_pb2 as pb
from swerl.exec.v1 import sandbox_pb2_grpc

RPC_TIMEOUT_S = 60.0
TOKEN = "test-token"


def node_settings(tmp_path: Path, **overrides) -> ExecSettings:
    values = dict(
        host="127.0.0.1",
        port=0,
        auth_token=TOKEN,
        node_id="test-" + uuid.uuid4().hex[:8],
        state_dir=tmp_path / "state",
        reap_interval_s=0.5,
        default_memory_bytes=512 << 20,
        default_pids=256,
        drain_grace_s=1.0,
    )
    values.update(overrides)
    return ExecSettings(**values)


class RunningNode:
    def __init__(self, node: ExecNode) -> None:
        self.node = node
        self.address = f"127.0.0.1:{node.port}"
        self.channel = make_channel(self.address, token=TOKEN)
        self.client = SandboxClient(self.channel)
        self.stub = self.client.stub

    async def create(self, image: str, **fields) -> pb.Sandbox:
        request = pb.CreateSandboxRequest(image=image, **fields)
        return (await self.stub.CreateSandbox(request, timeout=60)).sandbox


async def start_node(settings: ExecSettings) -> RunningNode:
    node = ExecNode(settings)
    await node.start()
    return RunningNode(node)


async def serving(node: RunningNode) -> int:
    """The node's answer to a gRPC health check (SERVING, NOT_SERVING)."""
    stub = health_pb2_grpc.HealthStub(node.channel)
    answer = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    return answer.status


async def rpc_error(call: Awaitable[Any]) -> grpc.aio.AioRpcError:
    """Awaits a call that must fail and returns its error."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


def assert_status(err: grpc.aio.AioRpcError, code: grpc.StatusCode, reason: str) -> dict[str, str]:
    """Checks a failure's status code and ErrorInfo reason; returns the ErrorInfo metadata."""
    assert err.code() == code, f"expected {code.name}, got {err.code().name}: {err.details()}"
    got, metadata = error_info(err)
    assert got == reason, f"expected reason {reason}, got {got}: {err.details()}"
    return metadata


class ExecStream:
    """One Exec call whose later requests (stdin, signals) the test sends while it runs."""

    def __init__(
        self,
        stub: sandbox_pb2_grpc.SandboxServiceStub,
        first: pb.ExecRequest,
        *,
        timeout_s: float = RPC_TIMEOUT_S,
    ) -> None:
        self._requests: asyncio.Queue[pb.ExecRequest | None] = asyncio.Queue()
        self._requests.put_nowait(first)
        self.call = stub.Exec(self._request_messages(), timeout=timeout_s)
        self._stdout = bytearray()
        self._stderr = bytearray()

    async def _request_messages(self) -> AsyncIterator[pb.ExecRequest]:
        while (request := await self._requests.get()) is not None:
            yield request

    def send(self, request: pb.ExecRequest) -> None:
        self._requests.put_nowait(request)

    def send_stdin(self, data: bytes, *, close: bool = False) -> None:
        self.send(pb.ExecRequest(stdin=pb.ExecStdin(data=data, close=close)))

    def send_signal(self, signal: pb.Signal) -> None:
        self.send(pb.ExecRequest(signal=pb.ExecSignal(signal=signal)))

    def end_requests(self) -> None:
        self._requests.put_nowait(None)

    async def next_response(self) -> pb.ExecResponse:
        response = await self.call.read()
        assert response is not grpc.aio.EOF, "Exec stream ended early"
        return response

    async def started(self) -> pb.ExecStarted:
        """Waits for `started` (asked for with notify_started or open_stdin)."""
        response = await self.next_response()
        assert response.WhichOneof("kind") == "started", response
        return response.started

    async def result(self) -> ExecResult:
        """Reads the rest of the stream up to `exit`."""
        try:
            while True:
                response = await self.next_response()
                kind = response.WhichOneof("kind")
                if kind == "output":
                    out = self._stdout
                    if response.output.stream == pb.OUTPUT_STREAM_STDERR:
                        out = self._stderr
                    out += response.output.data
                elif kind == "exit":
                    e = response.exit
                    return ExecResult(
                        exit_code=e.exit_code,
                        stdout=bytes(self._stdout),
                        stderr=bytes(self._stderr),
                        timed_out=e.timed_out,
                        output_truncated=e.output_truncated,
                        bytes_dropped=e.bytes_dropped,
                        duration_s=e.duration.ToNanoseconds() / 1e9,
                        signaled=e.signaled,
                        sandbox_restarted=e.sandbox_restarted,
                    )
        finally:
            self.end_requests()

    def cancel(self) -> None:
        self.call.cancel()
        self.end_requests()


def _containers(filters: dict[str, Any]) -> list[tuple[str, dict[str, str]]]:
    # One list call, as `docker ps -a`: docker-py's containers.list inspects each container it
    # listed, and one removed in between (what the reaper tests wait for) fails that with NotFound.
    client = docker.from_env()
    try:
        rows = client.api.containers(all=True, filters=filters)
        return [(row["Names"][0].lstrip("/"), dict(row.get("Labels") or {})) for row in rows]
    finally:
        client.close()


async def node_container_names(node_id: str) -> set[str]:
    """Names of every container (running or not) labelled as belonging to `node_id`."""
    rows = await asyncio.to_thread(_containers, {"label": f"swerl.node={node_id}"})
    return {name for name, _ in rows}


async def container_exists(sandbox_id: str) -> bool:
    """Whether `docker ps -a` still lists the sandbox's container, labelled or not."""
    rows = await asyncio.to_thread(_containers, {"name": f"swerl-{sandbox_id}"})
    return any(name == f"swerl-{sandbox_id}" for name, _ in rows)


def _host_config(name: str) -> dict[str, Any]:
    client = docker.from_env()
    try:
        return dict(client.api.inspect_container(name)["HostConfig"])
    finally:
        client.close()


async def container_host_config(sandbox_id: str) -> dict[str, Any]:
    """`docker inspect`'s HostConfig of the sandbox's container (its limits)."""
    return await asyncio.to_thread(_host_config, f"swerl-{sandbox_id}")


def surviving(ps_output: bytes, needle: bytes) -> list[bytes]:
    """Lines of `ps -eo pid,pgid,cmd` output whose command contains `needle`."""
    return [line for line in ps_output.splitlines() if needle in line]


def group_running(pgid: int) -> str:
    """A shell snippet that prints GROUP-ALIVE while a member of process group `pgid` still
    runs (a zombie awaiting its reaper, tini, no longer runs)."""
    return (
        f"if ps -eo pgid=,stat= | awk '$1 == {int(pgid)} && $2 !~ /^Z/ {{f = 1}} END {{exit !f}}';"
        " then echo GROUP-ALIVE; fi"
    )


def containers_of(node_id: str) -> list[Any]:
    """The containers the exec node `node_id` made, running or not."""
    client = docker.from_env()
    try:
        return list(client.containers.list(all=True, filters={"label": f"swerl.node={node_id}"}))
    finally:
        client.close()


def remove_containers_of(node_id: str) -> None:
    """Removes every container the exec node `node_id` made (a test's own node only)."""
    for container in containers_of(node_id):
        container.remove(force=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class NodeProcess:
    """`swerl exec serve` on a port of its own, with this node id and state dir."""

    def __init__(
        self,
        node_id: str,
        state_dir: Path,
        log_path: Path,
        token: str,
        extra_options: tuple[tuple[str, int], ...] = (),
    ) -> None:
        self.port = free_port()
        argv = [
            sys.executable,
            "-m",
            "swerl.cli",
            "exec",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--node-id",
            node_id,
            "--state-dir",
            str(state_dir),
            "--log-level",
            "info",
        ]
        with log_path.open("ab") as log:
            self.process = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "SWERL_EXEC_AUTH_TOKEN": token},
                start_new_session=True,
            )
        self.channel = make_channel(
            f"127.0.0.1:{self.port}", token=token, extra_options=extra_options
        )
        self.client = SandboxClient(self.channel)

    async def serving(self, within_s: float = 60.0) -> None:
        health = health_pb2_grpc.HealthStub(self.channel)
        deadline = time.monotonic() + within_s
        while True:
            assert self.process.poll() is None, "the node exited"
            with contextlib.suppress(grpc.aio.AioRpcError):
                check = await health.Check(health_pb2.HealthCheckRequest(), timeout=2.0)
                if check.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            assert time.monotonic() < deadline, "the node did not start serving"
            await asyncio.sleep(0.1)

    async def kill(self) -> None:
        # The process dies first: a channel closed first cancels the calls in flight, and a node
        # that saw the cancel before its SIGKILL ends their commands as for a caller gone, which
        # is not a node killed under them.
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        await asyncio.to_thread(self.process.wait)
        await self.channel.close(grace=None)
