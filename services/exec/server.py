"""Assembles the exec node: its container runtime, durable store, sandbox manager, gRPC server."""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from swerl.chassis.server import GrpcServer, ServiceHost
from swerl.exec.bundles import HarnessBundles
from swerl.exec.evaluate import Evaluator
from swerl.exec.evaluate_servicer import EvaluateServicer
from swerl.exec.forks import CheckpointStore, ForkManager
from swerl.exec.harness_host import HarnessHost
from swerl.exec.pool_registration import register_with_pool
from swerl.exec.runtimes import check_runtime, open_runtime
from swerl.exec.sandboxes import SandboxManager
from swerl.exec.servicer import SandboxServicer
from swerl.exec.settings import ExecSettings
from swerl.exec.store import NodeStore
from swerl.exec.v1 import evaluate_pb2, evaluate_pb2_grpc, sandbox_pb2, sandbox_pb2_grpc

SANDBOX_SERVICE = sandbox_pb2.DESCRIPTOR.services_by_name["SandboxService"].full_name
EVALUATE_SERVICE = evaluate_pb2.DESCRIPTOR.services_by_name["EvaluateService"].full_name


class ExecNode(ServiceHost):
    """One running exec node; `start()` then `serve_until_signal()` or `stop()`."""

    def __init__(self, settings: ExecSettings) -> None:
        self.settings = settings
        self.backend = open_runtime(settings)
        self.store = NodeStore(settings.state_dir / f"{settings.node_id}.sqlite")
        self.server = GrpcServer(settings, name="exec")
        self.manager = SandboxManager(
            settings, self.backend, self.store, on_docker_health=self._docker_health_changed
        )
        self.forks = ForkManager(
            self.manager,
            CheckpointStore(str(settings.state_dir / f"{settings.node_id}.checkpoints.sqlite")),
        )
        self.harnesses = HarnessHost(
            self.manager,
            HarnessBundles(settings.bundle_dir, package_index=settings.harness_package_index),
        )
        self.server.add_service(
            sandbox_pb2_grpc.add_SandboxServiceServicer_to_server,
            SandboxServicer(self.manager, self.forks, self.harnesses),
            [SANDBOX_SERVICE],
        )
        self.server.add_service(
            evaluate_pb2_grpc.add_EvaluateServiceServicer_to_server,
            EvaluateServicer(Evaluator(self.manager)),
            [EVALUATE_SERVICE],
        )
        self.server.add_shutdown_callback(self._shutdown)
        self.port = 0
        self._registration: asyncio.Task[None] | None = None

    def _docker_health_changed(self, healthy: bool) -> None:
        # Unhealthy Docker makes the node NOT_SERVING, so the pool stops placing work here.
        self._health_task = asyncio.get_running_loop().create_task(self.server.set_serving(healthy))

    async def start(self) -> int:
        await check_runtime(self.backend, self.settings)
        await self.manager.start()
        await self.forks.start()
        self.port = await self.server.start()
        if self.settings.pool_address:
            address = self.settings.advertise_address or self.server.address
            self._registration = asyncio.get_running_loop().create_task(
                register_with_pool(self.settings, address)
            )
        return self.port

    async def _shutdown(self) -> None:
        if self._registration is not None:
            self._registration.cancel()
        await self.forks.stop()
        await self.harnesses.stop()
        await self.manager.stop()
        self.forks.store.close()
        self.store.close()
        self.backend.close()


@contextlib.asynccontextmanager
async def local_node(purpose: str) -> AsyncIterator[tuple[ExecNode, grpc.aio.Channel]]:
    """An insecure loopback exec node with a throwaway state dir, for tools (demo, validate)."""
    from swerl.chassis.client import make_channel

    with tempfile.TemporaryDirectory(prefix=f"swerl-{purpose}-") as state:
        settings = ExecSettings(
            host="127.0.0.1",
            port=0,
            insecure=True,
            node_id=f"{purpose}-{os.getpid()}",
            state_dir=Path(state),
            log_level="warning",
        )
        node = ExecNode(settings)
        port = await node.start()
        channel = make_channel(f"127.0.0.1:{port}")
        try:
            yield node, channel
        finally:
            await channel.close()
            await node.stop(0)
