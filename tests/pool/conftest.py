"""A whole in-process stack (pool + exec nodes over the real dockerd) that must end clean."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import docker
import pytest

from swerl.pool.client import PoolClient
from swerl.stack import LocalStack, local_stack


def swerl_containers(node_ids: list[str]) -> list[str]:
    client = docker.from_env()
    try:
        names: list[str] = []
        for node_id in node_ids:
            found = client.containers.list(all=True, filters={"label": f"swerl.node={node_id}"})
            names += [c.name for c in found]
        return names
    finally:
        client.close()


async def assert_no_sandboxes_left(node_ids: list[str], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        left = await asyncio.to_thread(swerl_containers, node_ids)
        if not left:
            return
        assert time.monotonic() < deadline, f"sandboxes left behind: {left}"
        await asyncio.sleep(0.2)


@pytest.fixture
async def stack(base_image) -> AsyncIterator[LocalStack]:
    async with local_stack(
        nodes=2,
        max_sandboxes=3,
        purpose="pooltest",
        pool_settings={"maintenance_interval_s": 0.2, "expiry_interval_s": 0.1},
    ) as running:
        yield running
        # Whatever a test acquired it must have given back: no sandbox outlives its lease.
        node_ids = [n.settings.node_id for n in running.nodes]
        await assert_no_sandboxes_left(node_ids)
    await assert_no_sandboxes_left(node_ids)


@pytest.fixture
async def pool(stack) -> AsyncIterator[PoolClient]:
    client = PoolClient(stack.pool_address, token=stack.token)
    yield client
    await client.close()
