"""`local_stack`: a pool and exec nodes in this process on loopback ports, over the local dockerd.

The wiring of several services for the tools that need a whole stack in one process (`swerl
demo`, `swerl eval` without --pool, the tests and benchmarks); each service assembles only
itself (swerl.pool.server, swerl.exec.server).

    async with local_stack(nodes=2) as stack:
        pool = PoolClient(stack.pool_address, token=stack.token)
        async with pool.lease("swerl-base:bookworm", owner="me") as lease:
            node = SandboxClient.for_lease(lease)
            result = await node.run(lease.sandbox_id, "echo hi")
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swerl.exec.server import ExecNode
from swerl.exec.settings import ExecSettings
from swerl.pool.leases import N_HEALTHY
from swerl.pool.server import PoolServer
from swerl.pool.settings import PoolSettings


@dataclass
class LocalStack:
    pool_address: str
    token: str
    capability_secret: str
    pool: PoolServer
    nodes: list[ExecNode] = field(default_factory=list)

    @property
    def node_addresses(self) -> list[str]:
        return [f"127.0.0.1:{node.port}" for node in self.nodes]


def local_bundle_dir() -> Path:
    """Where a local stack's nodes keep their harness bundles: SWERL_EXEC_HARNESS_BUNDLE_DIR,
    else ~/.cache/swerl-bundles, so a bundle is built once per machine, not once per run."""
    configured = os.environ.get("SWERL_EXEC_HARNESS_BUNDLE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "swerl-bundles"


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
                        **{"harness_bundle_dir": local_bundle_dir(), **(node_settings or {})},
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
