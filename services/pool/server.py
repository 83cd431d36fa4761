"""Assembles the pool (store, Pool, gRPC server), and `local_stack`: a whole loopback stack.

async with local_stack(nodes=2) as stack:
    pool = PoolClient(stack.pool_address, token=stack.token)
    async with pool.lease("swerl-base:bookworm", owner="me") as lease:
        result = await lease.sandbox.run(lease.sandbox_id, "echo hi")
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swerl.chassis.gctune import tune_collector
from swerl.chassis.server import GrpcServer
from swerl.pool.leases import N_HEALTHY, Pool
from swerl.pool.nodes import GrpcNodeConnection, NodeConnection
from swerl.pool.servicer import PoolServicer
from swerl.pool.settings import PoolSettings
from swerl.pool.store import PoolStore
from swerl.pool.v1 import pool_pb2, pool_pb2_grpc

POOL_SERVICE = pool_pb2.DESCRIPTOR.services_by_name["PoolService"].full_name


def tune_garbage_collector(settings: PoolSettings) -> None:
    """For a process that serves a pool, once it has started (not for one that embeds a pool).

    The middle generation is collected less often, so that fewer short-lived objects (each
    KeepAlive stream's pending read lives a second) are promoted into the oldest generation,
    whose growth is what triggers a full collection of the whole lease table.
    """
    tune_collector(middle_every=settings.gc_middle_threshold)


class PoolServer:
    """One running pool; `start()` then `serve_until_signal()` or `stop()`."""

    def __init__(
        self,
        settings: PoolSettings,
        connect: Callable[[str], NodeConnection] | None = None,
    ) -> None:
        self.settings = settings
        secret = settings.node_auth_token or settings.auth_token
        node_token = secret.get_secret_value() if secret else None
        self.store = PoolStore(settings.state_dir / "pool.sqlite")
        self.pool = Pool(
            settings,
            connect
            or (
                lambda address: GrpcNodeConnection(
                    address, token=node_token, timeout_s=settings.node_call_timeout_s
                )
            ),
            self.store,
        )
        self.server = GrpcServer(settings, name="pool")
        self.server.add_service(
            pool_pb2_grpc.add_PoolServiceServicer_to_server, PoolServicer(self.pool), [POOL_SERVICE]
        )
        self.server.add_shutdown_callback(self._shutdown)
        self.port = 0

    async def start(self) -> int:
        await self.pool.start()
        self.port = await self.server.start()
        return self.port

    @property
    def address(self) -> str:
        return self.server.address

    async def _shutdown(self) -> None:
        await self.pool.stop()
        self.store.close()

    async def stop(self, grace_s: float | None = None) -> None:
        await self.server.stop(grace_s)

    async def serve_until_signal(self) -> None:
        await self.server.serve_until_signal()


@dataclass
class LocalStack:
    pool_address: str
    token: str
    capability_secret: str
    pool: PoolServer
    nodes: list[Any] = field(default_factory=list)  # swerl.exec.server.ExecNode

    @property
    def node_addresses(self) -> list[str]:
        return [f"127.0.0.1:{node.port}" for node in self.nodes]


@contextlib.asynccontextmanager
async def local_stack(
    nodes: int = 1,
    *,
    max_sandboxes: int = 8,
    purpose: str = "stack",
    token: str | None = None,
    pool_settings: dict[str, Any] | None = None,
    node_settings: dict[str, Any] | None = None,
    ready_timeout_s: float = 60.0,
) -> AsyncIterator[LocalStack]:
    """A pool and `nodes` exec nodes in this process on loopback ports, over the local dockerd.

    Every call needs `token`; nodes check lease capability tokens. On exit every sandbox the
    nodes host is destroyed, so the stack leaves no container behind.
    """
    from swerl.exec.server import ExecNode
    from swerl.exec.settings import ExecSettings

    token = token or secrets.token_hex(16)
    secret = secrets.token_hex(32)
    with tempfile.TemporaryDirectory(prefix=f"swerl-{purpose}-") as state:
        settings = PoolSettings(
            host="127.0.0.1",
            port=0,
            auth_token=token,
            capability_secret=secret,
            state_dir=Path(state) / "pool",
            log_level="warning",
            drain_grace_s=1.0,
            **(pool_settings or {}),
        )
        pool = PoolServer(settings)
        await pool.start()
        stack = LocalStack(pool.address, token, secret, pool)
        try:
            for index in range(nodes):
                node = ExecNode(
                    ExecSettings(
                        host="127.0.0.1",
                        port=0,
                        auth_token=token,
                        capability_secret=secret,
                        pool_address=pool.address,
                        node_id=f"{purpose}-{index}-{secrets.token_hex(3)}",
                        state_dir=Path(state) / f"node-{index}",
                        max_sandboxes=max_sandboxes,
                        log_level="warning",
                        drain_grace_s=1.0,
                        **(node_settings or {}),
                    )
                )
                await node.start()
                stack.nodes.append(node)
            deadline = time.monotonic() + ready_timeout_s
            while sum(n.state == N_HEALTHY for n in pool.pool.nodes.values()) < nodes:
                if time.monotonic() > deadline:
                    raise TimeoutError("the local stack's nodes did not become healthy")
                await asyncio.sleep(0.05)
            yield stack
        finally:
            await pool.stop(0)
            for node in stack.nodes:
                for record in list(node.manager._records.values()):
                    with contextlib.suppress(Exception):
                        await node.manager.destroy(record.sandbox_id)
                await node.stop(0)
