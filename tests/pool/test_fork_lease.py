"""ForkLease over real gRPC, real exec nodes and the real dockerd."""

from __future__ import annotations

import asyncio
import time

import docker
import grpc
import pytest

from swerl.chassis.client import error_info
from swerl.chassis.timeconv import duration_pb
from swerl.exec.client import ExecResult, SandboxClient
from swerl.pool.v1 import pool_pb2 as pb


async def refused(call) -> tuple[grpc.StatusCode, str | None]:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value.code(), error_info(caught.value)[0]


async def run(lease, command: str) -> ExecResult:
    """A command in a lease's sandbox, through its node's client (one per lease, closed with it)."""
    node = _nodes.get(lease.lease_id)
    if node is None:
        node = _nodes[lease.lease_id] = SandboxClient.for_lease(lease)
    return await node.run(lease.sandbox_id, command)


_nodes: dict[str, SandboxClient] = {}


def _fork_images_of(node_ids: list[str]) -> list[str]:
    client = docker.from_env()
    try:
        # One listing call, as `docker images` makes: docker-py's `images.list` inspects each
        # image it listed, and a fork image another worker's node removed meanwhile raised
        # ImageNotFound (CI, 7 Dec).
        images = client.api.images(filters={"label": "swerl.checkpoint_id"})
        return [i["Id"] for i in images if (i.get("Labels") or {}).get("swerl.node") in node_ids]
    finally:
        client.close()


async def assert_no_fork_images_left(stack, timeout_s: float = 15.0) -> None:
    node_ids = [n.settings.node_id for n in stack.nodes]
    deadline = time.monotonic() + timeout_s
    while left := await asyncio.to_thread(_fork_images_of, node_ids):
        assert time.monotonic() < deadline, f"fork images left behind: {left}"
        await asyncio.sleep(0.2)


async def test_forked_leases_live_on_the_source_node_with_their_own_tokens(stack, pool, base_image):
    async with pool.lease(base_image, owner="trunk", instance_id="i-1", ttl_s=30) as source:
        assert (await run(source, "echo trunk > /tmp/shared")).exit_code == 0
        forks = await pool.fork_leases(source, 2, owner="branch")
        try:
            assert len({f.lease_id for f in forks} | {source.lease_id}) == 3
            assert {f.node_id for f in forks} == {source.node_id}
            assert len({f.token for f in forks} | {source.token}) == 3
            for fork in forks:
                assert fork.info.state == pb.LEASE_STATE_ACTIVE
                assert fork.info.instance_id == "i-1" and fork.info.owner == "branch"
                assert (await run(fork, "cat /tmp/shared")).stdout == b"trunk\n"
            await run(forks[0], "echo one > /tmp/shared")
            assert (await run(forks[1], "cat /tmp/shared")).stdout == b"trunk\n"
            assert (await run(source, "cat /tmp/shared")).stdout == b"trunk\n"
            listed = await pool.list_leases(owner="branch")
            assert {x.lease_id for x in listed} == {f.lease_id for f in forks}
            # Each is kept alive on its own past the ttl.
            await asyncio.sleep(0.5)
            assert not any(f.lost.is_set() for f in forks)
        finally:
            for fork in forks:
                await fork.release()
    await assert_no_fork_images_left(stack)


async def test_fork_without_room_on_its_node_fails_and_never_goes_elsewhere(
    stack, pool, base_image
):
    async with pool.lease(base_image, owner="full") as source:
        began = time.monotonic()
        code, reason = await refused(pool.fork(source.lease_id, 3, wait_s=0.5))
        assert (code, reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "FORK_NODE_FULL")
        assert time.monotonic() - began >= 0.5  # it waited for room first
        listed = await pool.list_leases()
        assert [x.lease_id for x in listed] == [source.lease_id]
        # Two fit: the node holds 3.
        forks = await pool.fork_leases(source, 2)
        for fork in forks:
            await fork.release()
    await assert_no_fork_images_left(stack)


async def test_fork_while_a_command_runs_is_refused_sandbox_busy(stack, pool, base_image):
    async with pool.lease(base_image, owner="busy") as source:
        running = asyncio.create_task(run(source, "sleep 2"))
        await asyncio.sleep(0.8)
        code, reason = await refused(pool.fork(source.lease_id, 1, wait_s=1))
        assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "SANDBOX_BUSY")
        assert (await running).exit_code == 0
        assert [x.lease_id for x in await pool.list_leases()] == [source.lease_id]


async def test_bad_fork_requests_are_refused_with_reasons(stack, pool, base_image):
    code, reason = await refused(pool.fork("lse-unknown", 1, wait_s=1))
    assert (code, reason) == (grpc.StatusCode.NOT_FOUND, "LEASE_NOT_FOUND")
    async with pool.lease(base_image, owner="bad") as source:
        for count in (0, 4):
            code, reason = await refused(pool.fork(source.lease_id, count, wait_s=1))
            assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_LEASE_REQUEST")
        request = pb.ForkLeaseRequest(
            lease_id=source.lease_id, count=1, ttl=duration_pb(-1), request_id="r"
        )
        code, reason = await refused(pool.stub.ForkLease(request, timeout=30))
        assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_LEASE_REQUEST")


async def test_fork_retried_with_the_same_request_id_returns_the_same_leases(
    stack, pool, base_image
):
    async with pool.lease(base_image, owner="retry") as source:
        first = await pool.fork(source.lease_id, 2, request_id="fork-r")
        again = await pool.fork(source.lease_id, 2, request_id="fork-r")
        assert [x.lease_id for x in first.leases] == [x.lease_id for x in again.leases]
        for lease in first.leases:
            await pool.release(lease.lease_id)
