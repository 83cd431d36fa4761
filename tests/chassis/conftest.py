"""Fixtures of the chassis tests: real in-process servers on port 0 running a test servicer.

The servicer implements the exec contract's methods with behaviour the chassis must handle:
domain errors, unknown exceptions, slow calls, and streams that fail half way.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from testkit.chassis import (
    SANDBOX_SERVICE,
    TOKEN,
    ChassisTestServicer,
    ChassisTestSettings,
    ServerFactory,
    TlsFiles,
)

from swerl.chassis.client import make_channel
from swerl.chassis.server import GrpcServer
from swerl.exec.v1 import sandbox_pb2_grpc


@pytest.fixture
def servicer() -> ChassisTestServicer:
    return ChassisTestServicer()


@pytest.fixture
async def make_server(servicer: ChassisTestServicer) -> AsyncIterator[ServerFactory]:
    """Starts servers with settings overrides (token auth by default); stops them afterwards."""
    servers: list[GrpcServer] = []

    async def start(**overrides: Any) -> GrpcServer:
        settings = ChassisTestSettings(**{"auth_token": TOKEN, "drain_grace_s": 1.0, **overrides})
        server = GrpcServer(settings, name="chassis-test")
        server.add_service(
            sandbox_pb2_grpc.add_SandboxServiceServicer_to_server, servicer, [SANDBOX_SERVICE]
        )
        await server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        await server.stop(0)


@pytest.fixture
async def server(make_server: ServerFactory) -> GrpcServer:
    return await make_server()


@pytest.fixture
async def channel(server: GrpcServer) -> AsyncIterator[grpc.aio.Channel]:
    async with make_channel(server.address, token=TOKEN) as channel:
        yield channel


@pytest.fixture
def stub(channel: grpc.aio.Channel) -> sandbox_pb2_grpc.SandboxServiceStub:
    return sandbox_pb2_grpc.SandboxServiceStub(channel)


@pytest.fixture
def tls_files(tmp_path: Path) -> TlsFiles:
    """A self-signed server certificate for 127.0.0.1/localhost and a self-signed client one."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not installed")

    def self_signed(name: str, common_name: str, extra: list[str]) -> tuple[Path, Path]:
        cert, key = tmp_path / f"{name}.crt", tmp_path / f"{name}.key"
        command = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2"]
        command += ["-keyout", str(key), "-out", str(cert), "-subj", f"/CN={common_name}"]
        subprocess.run(
            [*command, *extra],
            check=True,
            capture_output=True,
        )
        return cert, key

    server_cert, server_key = self_signed(
        "server", "localhost", ["-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"]
    )
    client_cert, client_key = self_signed("client", "chassis-test-client", [])
    return TlsFiles(server_cert, server_key, client_cert, client_key)
