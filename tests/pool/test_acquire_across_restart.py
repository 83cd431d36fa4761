"""An AcquireLease sent while the pool is down (SIGKILLed, being restarted) is answered once the
pool is back, not failed after a few quick attempts: found by the soak, where every pool restart
ended the episodes that were acquiring a sandbox INFRA_ERROR LEASE_UNAVAILABLE."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from testkit.pool import Cluster

from swerl.pool.client import PoolClient


@pytest.fixture
def cluster(tmp_path, base_image):
    cluster = Cluster(tmp_path, nodes=1, node_capacity=2)
    try:
        cluster.start()
        yield cluster
    finally:
        left = cluster.close()
    assert not left, f"sandboxes left behind: {left}"


async def test_acquire_during_a_pool_restart_waits_for_the_pool(cluster, base_image) -> None:
    cluster.pool.kill()
    pool = PoolClient(cluster.pool_address, token=cluster.token)
    try:
        acquiring = asyncio.create_task(pool.acquire(base_image, owner="restart", wait_s=60))
        # Longer than the five quick attempts used to last (~3 s).
        await asyncio.sleep(6.0)
        assert not acquiring.done()
        cluster.pool.start()
        lease = await asyncio.wait_for(acquiring, 90)
        assert lease.sandbox_id
        await pool.release(lease.lease_id)
    finally:
        await pool.close()
    await asyncio.to_thread(cluster.release_everything)


async def test_acquire_gives_up_on_a_pool_that_stays_down(cluster, base_image) -> None:
    cluster.pool.kill()
    pool = PoolClient(cluster.pool_address, token=cluster.token)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            # The retry is bounded by max(30 s, wait_s).
            await asyncio.wait_for(pool.acquire(base_image, wait_s=1), 60)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await pool.close()
        cluster.pool.start()
        await asyncio.to_thread(cluster.wait_healthy, 1)
