"""Pulls on demand through the whole stack: a pool and an exec node in process, the node on the
second dockerd (its own image store), the image only in the loopback registry. What is counted
is dockerd's own record of its pulls (its event stream), not swerl's counters."""

from __future__ import annotations

import asyncio
import os
import time

import docker
import pytest
from testkit.dockerd import pull_events

from swerl.chassis.timeconv import duration_pb
from swerl.pool.client import PoolClient
from swerl.pool.v1 import pool_pb2 as pb

ACQUIRES = 8
SHARED_DOCKER_HOST = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")


def _present(docker_host: str, image: str) -> bool:
    client = docker.DockerClient(base_url=docker_host, timeout=60)
    try:
        client.images.get(image)
        return True
    except docker.errors.ImageNotFound:
        return False
    finally:
        client.close()


def _containers_of(docker_host: str, node_id: str) -> list[str]:
    client = docker.DockerClient(base_url=docker_host, timeout=60)
    try:
        found = client.containers.list(all=True, filters={"label": f"swerl.node={node_id}"})
        return [c.name for c in found]
    finally:
        client.close()


def _pulls_of(events: list[dict], image: str) -> int:
    return sum(1 for e in events if (e.get("Actor") or {}).get("ID") == image)


async def test_eight_concurrent_acquires_of_a_missing_image_cause_exactly_one_pull_on_its_node(
    pool_stack, registry_images, second_dockerd
):
    image = registry_images[sorted(registry_images)[0]]
    host = second_dockerd.host
    (node,) = pool_stack.nodes
    node_id = node.settings.node_id
    assert not await asyncio.to_thread(_present, host, image)
    pool = PoolClient(pool_stack.pool_address, token=pool_stack.token)
    leases: list[pb.Lease] = []
    since = time.time()
    try:
        requests = [
            pb.AcquireLeaseRequest(
                request_id=f"pull-once-{i}",
                image=image,
                owner=f"worker-{i}",
                wait_timeout=duration_pb(240),
            )
            for i in range(ACQUIRES)
        ]
        replies = await asyncio.gather(
            *(pool.stub.AcquireLease(request, timeout=300) for request in requests)
        )
        leases = [reply.lease for reply in replies]
        until = time.time()

        assert [lease.state for lease in leases] == [pb.LEASE_STATE_ACTIVE] * ACQUIRES
        assert {lease.node_id for lease in leases} == {node_id}
        assert len({lease.sandbox_id for lease in leases}) == ACQUIRES
        # Every acquire waited on the pull (none found the image there before it).
        assert all(lease.pull_duration.ToNanoseconds() > 0 for lease in leases)
        events = await asyncio.to_thread(pull_events, host, since, until)
        assert _pulls_of(events, image) == 1, events
        assert len(events) == 1, events  # and no other pull on that dockerd
        # The node pulled into its own dockerd, never into the shared one.
        shared = await asyncio.to_thread(pull_events, SHARED_DOCKER_HOST, since, until)
        assert _pulls_of(shared, image) == 0, shared
        assert not await asyncio.to_thread(_present, SHARED_DOCKER_HOST, image)
        # The sandboxes run on the second dockerd, from the pulled image.
        sandboxes = await asyncio.to_thread(_containers_of, host, node_id)
        assert len(sandboxes) == ACQUIRES
        (listed,) = await pool.list_nodes()
        assert (listed.image_pulls, listed.image_misses) == (1, ACQUIRES)
    finally:
        for lease in leases:
            await pool.release(lease.lease_id)
        await pool.close()
    # Released: the node destroyed every sandbox (capacity is freed only on its confirmation).
    deadline = time.monotonic() + 30
    while left := await asyncio.to_thread(_containers_of, host, node_id):
        if time.monotonic() > deadline:
            pytest.fail(f"sandboxes left on the node's dockerd: {left}")
        await asyncio.sleep(0.2)
