"""Shared pieces of the chassis tests: the test settings, servicer and domain errors.

A plain module (not conftest) so that tests and the SIGTERM server script can import it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from pydantic_settings import SettingsConfigDict

from swerl.chassis import errors
from swerl.chassis.interceptors import current_request_id
from swerl.chassis.server import GrpcServer
from swerl.chassis.settings import ServiceSettings
from swerl.exec.v1 import sandbox_pb2, sandbox_pb2_grpc

TOKEN = "chassis-test-token"
SANDBOX_SERVICE = sandbox_pb2.DESCRIPTOR.services_by_name["SandboxService"].full_name
LEAKED_SECRET = "db password is hunter2"
# What the `make_server` fixture yields: starts a server with settings overrides.
ServerFactory = Callable[..., Awaitable[GrpcServer]]


@dataclass(frozen=True)
class TlsFiles:
    """The `tls_files` fixture's certificates: a server one for 127.0.0.1/localhost and a
    client one, each self-signed."""

    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


class ChassisTestSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="SWERL_CHASSIS_TEST_")

    host: str = "127.0.0.1"
    port: int = 0


class SandboxGone(errors.NotFound):
    reason = "SANDBOX_NOT_FOUND"


class ImageMissing(errors.FailedPrecondition):
    reason = "IMAGE_NOT_PRESENT"


class NodeFull(errors.ResourceExhausted):
    reason = "NODE_AT_CAPACITY"


class ChassisTestServicer(sandbox_pb2_grpc.SandboxServiceServicer):
    """CreateSandbox is left to the generated base class (unimplemented)."""

    def __init__(self) -> None:
        self.slow_call_started = asyncio.Event()
        self.slow_call_cancelled = asyncio.Event()
        self.slow_call_finished = asyncio.Event()
        self.capacity_failures = 0
        self.list_calls = 0

    async def GetSandbox(self, request: Any, context: Any) -> Any:
        raise SandboxGone(
            f"sandbox {request.sandbox_id} does not exist", sandbox_id=request.sandbox_id
        )

    async def GetDiff(self, request: Any, context: Any) -> Any:
        raise RuntimeError(LEAKED_SECRET)

    async def GetNodeInfo(self, request: Any, context: Any) -> Any:
        # Echoes the request id the boundary bound, proving handlers can read it; the log line
        # shows that the id also reaches the handler's own logs.
        structlog.get_logger("chassis.test").info("node.info_requested")
        return sandbox_pb2.GetNodeInfoResponse(node_id=current_request_id() or "")

    async def RenewSandbox(self, request: Any, context: Any) -> Any:
        """Sleeps for the requested ttl: the slow call of drain and cancel tests."""
        self.slow_call_started.set()
        try:
            await asyncio.sleep(request.ttl.ToTimedelta().total_seconds())
        except asyncio.CancelledError:
            self.slow_call_cancelled.set()
            raise
        self.slow_call_finished.set()
        return sandbox_pb2.RenewSandboxResponse(
            sandbox=sandbox_pb2.Sandbox(sandbox_id=request.sandbox_id)
        )

    async def ListSandboxes(self, request: Any, context: Any) -> Any:
        self.list_calls += 1
        if self.capacity_failures > 0:
            self.capacity_failures -= 1
            raise NodeFull("node is full", capacity=2)
        return sandbox_pb2.ListSandboxesResponse()

    async def EnsureImages(self, request: Any, context: Any) -> AsyncIterator[Any]:
        for image in request.images:
            if image == "missing":
                raise ImageMissing(f"image {image} is not on the node", image=image)
            if image == "crash":
                raise RuntimeError(LEAKED_SECRET)
            yield sandbox_pb2.EnsureImagesResponse(
                progress=sandbox_pb2.ImagePullProgress(image=image, status="present")
            )

    async def Exec(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:
        """Echoes stdin chunks; the chunk b'fail' is a domain error mid-stream."""
        async for request in request_iterator:
            if request.stdin.data == b"fail":
                raise errors.InvalidArgument("stdin said fail", field="stdin")
            yield sandbox_pb2.ExecResponse(
                output=sandbox_pb2.ExecOutput(
                    stream=sandbox_pb2.OUTPUT_STREAM_STDOUT, data=request.stdin.data
                )
            )
