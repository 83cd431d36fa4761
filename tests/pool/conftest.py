"""A whole in-process stack (pool + exec nodes over the real dockerd) that must end clean."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from testkit.pool import assert_no_sandboxes_left

from swerl.pool.client import PoolClient
from swerl.stack import LocalStack, local_stack


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
