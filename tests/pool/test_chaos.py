"""Chaos: processes killed with SIGKILL (holder, exec node, pool) and a node that cannot destroy.

One pool process and three exec-node processes on loopback over the real dockerd; each test puts
the cluster back (restarts what it killed) and proves that no sandbox is left behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from testkit.pool import Cluster

from swerl.exec.client import SandboxClient
from swerl.pool.client import PoolClient
from swerl.pool.settings import PoolSettings
from swerl.pool.v1 import pool_pb2 as pb

TTL_S = 3.0
HOLDER = Path(__file__).with_name("holder.py")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, base_image):
    cluster = Cluster(
        tmp_path_factory.mktemp("chaos"),
        nodes=3,
        node_capacity=4,
        pool_args=(
            "--default-ttl-s",
            "4",
            "--node-expiry-slack-s",
            "2",
            "--maintenance-interval-s",
            "0.2",
            "--expiry-interval-s",
            "0.1",
            "--release-wait-s",
            "2",
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
    # Whatever a test killed is back; everything is given back and docker has nothing left.
    for proc in (cluster.pool, *cluster.nodes):
        if not proc.alive:
            proc.start()
    await asyncio.to_thread(cluster.wait_healthy, len(cluster.nodes))
    await asyncio.to_thread(cluster.release_everything)
    assert await asyncio.to_thread(cluster.containers) == []


def container_exists(sandbox_id: str) -> bool:
    probe = subprocess.run(
        ["docker", "container", "inspect", f"swerl-{sandbox_id}"], capture_output=True
    )
    return probe.returncode == 0


async def test_killed_holder_has_its_sandbox_destroyed_within_ttl_plus_2s(
    cluster, pool, base_image
):
    holder = subprocess.Popen(  # noqa: ASYNC220 - started here, killed below, never waited on
        [sys.executable, str(HOLDER), cluster.pool_address, base_image, str(TTL_S)],
        stdout=subprocess.PIPE,
        env={**os.environ, "SWERL_TEST_TOKEN": cluster.token},
    )
    try:
        line = await asyncio.wait_for(asyncio.to_thread(holder.stdout.readline), 60)
        lease = json.loads(line)
        # Let it renew a few times: the lease outlives its first TTL only through keepalives.
        await asyncio.sleep(TTL_S * 1.5)
        assert container_exists(lease["sandbox_id"])
        holder.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        while container_exists(lease["sandbox_id"]):
            assert time.monotonic() - killed < TTL_S + 2.0, "sandbox outlived TTL + 2 s"
            await asyncio.sleep(0.1)
        ended = await pool.list_leases(states=[pb.LEASE_STATE_ENDED])
        assert any(
            x.lease_id == lease["lease_id"] and x.loss_reason == pb.LEASE_LOSS_REASON_EXPIRED
            for x in ended
        )
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.wait()


async def test_killed_node_reports_lost_within_3s_and_new_leases_avoid_it(
    cluster, pool, base_image
):
    async with pool.lease(base_image, owner="victim") as lease:
        index = cluster.node_ids.index(lease.node_id)
        cluster.nodes[index].kill()
        killed = time.monotonic()
        await asyncio.wait_for(lease.lost.wait(), 3.0)
        assert time.monotonic() - killed < 3.0
        assert lease.lost_reason == "NODE_LOST"
        others = [await pool.acquire(base_image) for _ in range(3)]
        assert lease.node_id not in {x.node_id for x in others}
        # The dead node's sandbox still counts against it until the node confirms its destroy.
        node = next(n for n in await pool.list_nodes() if n.node_id == lease.node_id)
        assert node.state == pb.NODE_STATE_UNHEALTHY and node.lease_count == 1
        # The node comes back, adopts its container, and the pool has it destroyed.
        cluster.nodes[index].start()
        deadline = time.monotonic() + 60
        while container_exists(lease.sandbox_id):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.2)
        for other in others:
            await pool.release(other.lease_id)


async def test_killed_and_restarted_pool_loses_no_lease(cluster, pool, base_image):
    # The TTL must outlast the pool's restart (a fresh Python process: a few seconds here).
    ttl_s = 10.0
    async with (
        pool.lease(base_image, owner="h1", ttl_s=ttl_s) as one,
        pool.lease(base_image, owner="h2", ttl_s=ttl_s) as two,
    ):
        nodes = {
            one.lease_id: SandboxClient.for_lease(one),
            two.lease_id: SandboxClient.for_lease(two),
        }
        cluster.pool.kill()
        await asyncio.sleep(1.0)
        # Commands never pass through the pool: they keep running while it is away.
        during = await nodes[one.lease_id].run(one.sandbox_id, "echo during")
        assert during.stdout == b"during\n"
        cluster.pool.start()
        await asyncio.to_thread(cluster.wait_healthy, len(cluster.nodes))
        # Well past the TTL: only renewals over reconnected KeepAlive streams keep them alive.
        await asyncio.sleep(ttl_s * 1.2)
        for lease in (one, two):
            assert not lease.lost.is_set(), lease.lost_reason
            after = await nodes[lease.lease_id].run(lease.sandbox_id, "echo after")
            assert after.stdout == b"after\n"
        listed = {x.lease_id: x for x in await pool.list_leases()}
        assert listed[one.lease_id].state == pb.LEASE_STATE_ACTIVE
        assert listed[two.lease_id].sandbox_id == two.sandbox_id


async def test_a_pool_away_longer_than_the_ttl_loses_no_lease(cluster, pool, base_image):
    # A restart slower than the TTL (a loaded machine): the holders keep their sandboxes alive
    # on the nodes meanwhile, and the restarted pool adopts them with that expiry.
    ttl_s = 4.0
    async with pool.lease(base_image, owner="h1", ttl_s=ttl_s) as one:
        # The holder's connection to the node, through which it renews there meanwhile.
        node = SandboxClient.for_lease(one)
        cluster.pool.kill()
        # Past the nodes' own expiry (TTL + the pool's 2 s slack) had nobody renewed there.
        await asyncio.sleep(ttl_s * 2.5)
        assert container_exists(one.sandbox_id)
        assert not one.lost.is_set(), one.lost_reason
        assert (await node.run(one.sandbox_id, "echo away")).stdout == b"away\n"
        cluster.pool.start()
        await asyncio.to_thread(cluster.wait_healthy, len(cluster.nodes))
        # Past the adoption's reconnect grace and a TTL more: only renewals over the
        # reconnected stream keep it now.
        await asyncio.sleep(PoolSettings.model_fields["adopt_grace_s"].default + ttl_s * 1.5)
        assert not one.lost.is_set(), one.lost_reason
        assert (await node.run(one.sandbox_id, "echo after")).stdout == b"after\n"
        listed = {x.lease_id: x for x in await pool.list_leases()}
        assert listed[one.lease_id].state == pb.LEASE_STATE_ACTIVE


async def test_capacity_is_not_freed_until_a_failed_destroy_is_reconciled(
    cluster, pool, base_image
):
    lease = await pool.acquire(base_image)
    index = cluster.node_ids.index(lease.node_id)
    frozen = cluster.nodes[index].process
    frozen.send_signal(signal.SIGSTOP)  # The node stays connected but cannot destroy anything.
    try:
        response = await pool.stub.ReleaseLease(
            pb.ReleaseLeaseRequest(lease_id=lease.lease_id), timeout=30
        )
        assert response.existed and response.lease.state == pb.LEASE_STATE_RELEASING
        node = next(n for n in await pool.list_nodes() if n.node_id == lease.node_id)
        assert node.lease_count == 1  # Still held.
        assert container_exists(lease.sandbox_id)
    finally:
        frozen.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 30
    while True:
        node = next(n for n in await pool.list_nodes() if n.node_id == lease.node_id)
        ended = await pool.list_leases(states=[pb.LEASE_STATE_ENDED])
        if node.lease_count == 0 and any(x.lease_id == lease.lease_id for x in ended):
            break
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    assert not container_exists(lease.sandbox_id)
