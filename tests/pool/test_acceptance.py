"""Acceptance: a pool process and three exec-node processes on loopback over the real dockerd.

Placement order, per-node and global caps under 100 concurrent acquires, FIFO waiting with
RESOURCE_EXHAUSTED on the deadline, idempotent acquire; no sandbox survives any test.
"""

from __future__ import annotations

import asyncio
import collections
import time

import grpc
import pytest
from testkit.pool import Cluster

from swerl.chassis.client import error_info
from swerl.pool.client import PoolClient
from swerl.pool.v1 import pool_pb2 as pb

NODE_CAPACITY = 4
GLOBAL_CAP = 10


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, base_image):
    cluster = Cluster(
        tmp_path_factory.mktemp("acceptance"),
        nodes=3,
        node_capacity=NODE_CAPACITY,
        # --no-pull: these tests pin today's refusal of an image no node has (the pull path
        # has its own tests, test_pulls and test_pool_pulls_grpc).
        pool_args=(
            "--max-leases",
            str(GLOBAL_CAP),
            "--maintenance-interval-s",
            "0.2",
            "--no-pull",
        ),
    )
    try:
        cluster.start()
        yield cluster
    finally:
        left = cluster.close()
    assert not left, f"sandboxes left behind: {left}"


@pytest.fixture
async def pool(cluster):
    client = PoolClient(cluster.pool_address, token=cluster.token)
    yield client
    await client.close()
    # Every test gives everything back, and the nodes confirm it: docker has nothing left.
    await asyncio.to_thread(cluster.release_everything)
    assert await asyncio.to_thread(cluster.containers) == []


async def load(pool: PoolClient) -> dict[str, int]:
    return {n.node_id: n.lease_count + n.warm_spare_count for n in await pool.list_nodes()}


async def test_placement_prefers_warm_spare_then_least_loaded(cluster, pool, base_image):
    first = [await pool.acquire(base_image) for _ in range(3)]
    # Least loaded: three leases on three nodes.
    assert len({lease.node_id for lease in first}) == 3
    extra = await pool.acquire(base_image)
    await pool.prewarm(base_image, 1)
    deadline = time.monotonic() + 60
    while (await pool.prewarm(base_image, 1)).ready < 1:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    spare_node = next(n.node_id for n in await pool.list_nodes() if n.warm_spare_count)
    loads = await load(pool)
    assert loads[spare_node] > min(loads.values())  # Another node is less loaded...
    warm = await pool.acquire(base_image)
    assert warm.from_warm_spare and warm.node_id == spare_node  # ...but the spare wins.
    assert extra.node_id != spare_node or loads[spare_node] == 3
    await pool.prewarm(base_image, 0)


async def test_no_pull_refuses_an_image_absent_from_every_node(cluster, pool):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await pool.acquire("swerl-absent/never-pulled:1", wait_s=5)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_info(caught.value)[0] == "IMAGE_NOT_PRESENT"


async def test_caps_hold_under_100_concurrent_acquires(cluster, pool, base_image):
    results = await asyncio.gather(
        *(pool.acquire(base_image, owner=f"c{i}", wait_s=3) for i in range(100)),
        return_exceptions=True,
    )
    leases = [r for r in results if isinstance(r, pb.Lease)]
    failures = [r for r in results if not isinstance(r, pb.Lease)]
    assert len(leases) == GLOBAL_CAP
    assert all(
        isinstance(f, grpc.aio.AioRpcError)
        and f.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        and error_info(f)[0] == "POOL_AT_CAPACITY"
        for f in failures
    ), failures[:3]
    per_node = collections.Counter(lease.node_id for lease in leases)
    assert max(per_node.values()) <= NODE_CAPACITY
    # What Docker runs agrees with the pool.
    assert len(await asyncio.to_thread(cluster.containers)) == GLOBAL_CAP
    assert all(n.lease_count <= NODE_CAPACITY for n in await pool.list_nodes())


async def test_waiters_are_served_in_order_and_time_out(cluster, pool, base_image):
    held = [await pool.acquire(base_image, wait_s=30) for _ in range(GLOBAL_CAP)]
    served: list[str] = []

    async def wait(name: str) -> pb.Lease:
        lease = await pool.acquire(base_image, owner=name, wait_s=60)
        served.append(name)
        return lease

    waiters = []
    for name in ("w1", "w2", "w3"):
        waiters.append(asyncio.create_task(wait(name)))
        await asyncio.sleep(0.1)
    # A request with a short deadline behind them gets RESOURCE_EXHAUSTED.
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await pool.acquire(base_image, wait_s=0.5)
    assert (caught.value.code(), error_info(caught.value)[0]) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "POOL_AT_CAPACITY",
    )
    for index in range(3):
        await pool.release(held[index].lease_id)
        await asyncio.wait_for(asyncio.shield(waiters[index]), 60)
    assert served == ["w1", "w2", "w3"]


async def test_retried_acquire_with_the_same_request_id_returns_the_same_lease(
    cluster, pool, base_image
):
    first, second = await asyncio.gather(
        pool.acquire(base_image, request_id="acc-same"),
        pool.acquire(base_image, request_id="acc-same"),
    )
    third = await pool.acquire(base_image, request_id="acc-same")
    assert first.lease_id == second.lease_id == third.lease_id
    assert first.sandbox_id == third.sandbox_id
    assert len(await asyncio.to_thread(cluster.containers)) == 1
