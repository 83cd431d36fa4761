"""PoolService and the lease client over real gRPC, real exec nodes and the real dockerd."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from swerl.chassis import capability
from swerl.chassis.client import error_info, make_channel
from swerl.chassis.timeconv import duration_pb
from swerl.exec.client import SandboxClient
from swerl.exec.v1 import evaluate_pb2, evaluate_pb2_grpc
from swerl.exec.v1 import sandbox_pb2 as exec_pb
from swerl.pool.client import PoolClient
from swerl.pool.v1 import pool_pb2 as pb
from swerl.pool.v1 import pool_pb2_grpc


async def refused(call) -> tuple[grpc.StatusCode, str | None]:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value.code(), error_info(caught.value)[0]


def node_client(stack, address: str, token: str | None) -> tuple[grpc.aio.Channel, SandboxClient]:
    extra = [(capability.LEASE_TOKEN_METADATA_KEY, token)] if token else []
    channel = make_channel(address, token=stack.token, metadata_provider=lambda: extra)
    return channel, SandboxClient(channel)


async def test_lease_runs_commands_and_is_released_on_exit(stack, pool, base_image):
    async with pool.lease(base_image, owner="t", instance_id="i-1") as lease:
        result = await SandboxClient.for_lease(lease).run(lease.sandbox_id, "echo hello")
        assert (result.exit_code, result.stdout) == (0, b"hello\n")
        listed = await pool.list_leases(owner="t")
        assert [x.lease_id for x in listed] == [lease.lease_id]
        assert listed[0].token == ""  # Tokens are never listed.
    ended = await pool.list_leases(states=[pb.LEASE_STATE_ENDED])
    assert [(x.lease_id, x.loss_reason) for x in ended] == [
        (lease.lease_id, pb.LEASE_LOSS_REASON_RELEASED)
    ]


async def test_lease_is_released_when_the_body_is_cancelled(stack, pool, base_image):
    acquired = asyncio.Event()

    async def body():
        async with pool.lease(base_image, owner="cancelled"):
            acquired.set()
            await asyncio.sleep(3600)

    task = asyncio.create_task(body())
    await acquired.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await pool.list_leases(owner="cancelled") == []


async def test_calls_about_a_sandbox_without_a_lease_token_are_refused(stack, pool, base_image):
    async with pool.lease(base_image) as lease:
        channel, client = node_client(stack, lease.node_address, None)
        try:
            assert await refused(client.run(lease.sandbox_id, "true")) == (
                grpc.StatusCode.UNAUTHENTICATED,
                "LEASE_TOKEN_MISSING",
            )
            diff = client.stub.GetDiff(exec_pb.GetDiffRequest(sandbox_id=lease.sandbox_id))
            assert await refused(diff) == (grpc.StatusCode.UNAUTHENTICATED, "LEASE_TOKEN_MISSING")
            evaluate = evaluate_pb2_grpc.EvaluateServiceStub(channel).Evaluate(
                evaluate_pb2.EvaluateRequest(sandbox_id=lease.sandbox_id)
            )
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in evaluate:
                    pass
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert error_info(caught.value)[0] == "LEASE_TOKEN_MISSING"
        finally:
            await channel.close()


async def test_expired_forged_and_foreign_tokens_are_refused(stack, pool, base_image):
    secret = stack.capability_secret.encode()
    async with pool.lease(base_image) as one, pool.lease(base_image) as two:
        cases = {
            "expired": (
                capability.mint(
                    secret,
                    lease_id=one.lease_id,
                    sandbox_id=one.sandbox_id,
                    expire_time=time.time() - 1,
                ),
                (grpc.StatusCode.UNAUTHENTICATED, "LEASE_TOKEN_EXPIRED"),
            ),
            "forged": (
                capability.mint(
                    b"not-the-secret",
                    lease_id=one.lease_id,
                    sandbox_id=one.sandbox_id,
                    expire_time=time.time() + 60,
                ),
                (grpc.StatusCode.UNAUTHENTICATED, "LEASE_TOKEN_INVALID"),
            ),
            "garbage": ("v1.x", (grpc.StatusCode.UNAUTHENTICATED, "LEASE_TOKEN_INVALID")),
            "other sandbox": (
                two.token,
                (grpc.StatusCode.PERMISSION_DENIED, "LEASE_TOKEN_FOREIGN"),
            ),
            "other lease": (
                capability.mint(
                    secret,
                    lease_id=two.lease_id,
                    sandbox_id=one.sandbox_id,
                    expire_time=time.time() + 60,
                ),
                (grpc.StatusCode.PERMISSION_DENIED, "LEASE_TOKEN_FOREIGN"),
            ),
        }
        for name, (token, expected) in cases.items():
            channel, client = node_client(stack, one.node_address, token)
            try:
                assert await refused(client.run(one.sandbox_id, "true")) == expected, name
                diff = client.stub.GetDiff(exec_pb.GetDiffRequest(sandbox_id=one.sandbox_id))
                assert await refused(diff) == expected, name
            finally:
                await channel.close()


async def test_keepalive_renews_past_the_ttl_with_fresh_tokens(stack, pool, base_image):
    async with pool.lease(base_image, ttl_s=1.5, keepalive_interval_s=0.3) as lease:
        first_token = lease.token
        await asyncio.sleep(3.0)
        assert not lease.lost.is_set()
        assert lease.token != first_token
        assert lease.expire_time > time.time()
        node = SandboxClient.for_lease(lease)
        assert (await node.run(lease.sandbox_id, "echo still")).stdout == b"still\n"


async def test_holder_hears_at_once_when_its_lease_is_taken_away(stack, pool, base_image):
    async with pool.lease(base_image) as lease:
        await asyncio.sleep(0.2)
        assert await pool.release(lease.lease_id)
        await asyncio.wait_for(lease.lost.wait(), 3.0)
        assert lease.lost_reason == "RELEASED"


async def test_same_request_id_gets_the_same_lease(stack, pool, base_image):
    first = await pool.acquire(base_image, request_id="same-1")
    again = await pool.acquire(base_image, request_id="same-1")
    assert (again.lease_id, again.sandbox_id) == (first.lease_id, first.sandbox_id)
    assert await pool.release(first.lease_id)
    assert not await pool.release(first.lease_id)  # Idempotent.


async def test_warm_spare_is_bound_to_the_lease_on_its_node(stack, pool, base_image):
    await pool.prewarm(base_image, 1)
    deadline = time.monotonic() + 30
    while (await pool.prewarm(base_image, 1)).ready < 1:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    async with pool.lease(base_image, owner="warm") as lease:
        assert lease.from_warm_spare
        node = SandboxClient.for_lease(lease)
        assert (await node.run(lease.sandbox_id, "echo warm")).stdout == b"warm\n"
        node = next(n for n in stack.nodes if f"127.0.0.1:{n.port}" == lease.node_address)
        listed = node.manager.get(lease.sandbox_id)
        assert (listed.lease_id, listed.owner) == (lease.lease_id, "warm")
    await pool.prewarm(base_image, 0)


async def test_pool_refuses_bad_requests_with_reasons(stack, pool, base_image):
    stub = pool.stub
    assert await refused(stub.AcquireLease(pb.AcquireLeaseRequest(), timeout=10)) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_LEASE_REQUEST",
    )
    too_long = pb.AcquireLeaseRequest(image=base_image, ttl=duration_pb(10**7))
    assert await refused(stub.AcquireLease(too_long, timeout=10)) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_LEASE_REQUEST",
    )
    assert await refused(stub.DrainNode(pb.DrainNodeRequest(node_id="nope"), timeout=10)) == (
        grpc.StatusCode.NOT_FOUND,
        "NODE_NOT_FOUND",
    )
    bad_node = pb.RegisterNodeRequest(node_id="x", address="no-port")
    assert await refused(stub.RegisterNode(bad_node, timeout=10)) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_NODE",
    )
    gone = pb.RegisterNodeRequest(node_id="x", address="127.0.0.1:1")
    assert await refused(stub.RegisterNode(gone, timeout=20)) == (
        grpc.StatusCode.UNAVAILABLE,
        "NODE_UNREACHABLE",
    )
    wrong_id = pb.RegisterNodeRequest(node_id="not-its-id", address=stack.node_addresses[0])
    assert await refused(stub.RegisterNode(wrong_id, timeout=20)) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "NODE_ID_MISMATCH",
    )
    released = await stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id="lse-unknown"), timeout=10)
    assert not released.existed
    anonymous = PoolClient(stack.pool_address)
    try:
        assert await refused(anonymous.list_nodes()) == (
            grpc.StatusCode.UNAUTHENTICATED,
            "MISSING_TOKEN",
        )
    finally:
        await anonymous.close()


async def test_full_pool_answers_resource_exhausted_with_retry_info(stack, pool, base_image):
    # Two nodes of three sandboxes each.
    held = [await pool.acquire(base_image, wait_s=30) for _ in range(6)]
    try:
        request = pb.AcquireLeaseRequest(image=base_image, wait_timeout=duration_pb(0.3))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await pool.stub.AcquireLease(request, timeout=10)
        err = caught.value
        assert (err.code(), error_info(err)[0]) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "POOL_AT_CAPACITY",
        )
        status = next(
            status_pb2.Status.FromString(v)
            for k, v in err.trailing_metadata()
            if k == "grpc-status-details-bin"
        )
        retry = error_details_pb2.RetryInfo()
        assert any(d.Unpack(retry) for d in status.details if d.Is(retry.DESCRIPTOR))
        assert retry.retry_delay.ToTimedelta().total_seconds() > 0
    finally:
        for lease in held:
            await pool.release(lease.lease_id)


async def test_keepalive_on_an_unknown_lease_reports_it_lost(stack, pool):
    async def requests():
        yield pb.KeepAliveRequest(watch=pb.KeepAliveWatch(lease_id="lse-nope"))
        await asyncio.sleep(5)

    call = pool_pb2_grpc.PoolServiceStub(pool.channel).KeepAlive(requests(), timeout=10)
    response = await call.read()
    call.cancel()
    assert response.lost.lease_id == "lse-nope"
    assert response.lost.reason == pb.LEASE_LOSS_REASON_NOT_FOUND


async def test_nodes_are_listed_healthy_with_their_load(stack, pool, base_image):
    async with pool.lease(base_image) as lease:
        nodes = {n.node_id: n for n in await pool.list_nodes()}
        assert len(nodes) == 2
        assert all(n.state == pb.NODE_STATE_HEALTHY and n.capacity == 3 for n in nodes.values())
        assert nodes[lease.node_id].lease_count == 1


async def test_pool_metrics_are_exported(base_image):
    import urllib.request

    from swerl.stack import local_stack

    async with local_stack(nodes=1, purpose="poolmetrics", pool_settings={"metrics_port": 0}) as s:
        client = PoolClient(s.pool_address, token=s.token)
        try:
            async with client.lease(base_image):
                pass
        finally:
            await client.close()
        url = f"http://127.0.0.1:{s.pool.server.metrics_port}/metrics"
        text = (await asyncio.to_thread(urllib.request.urlopen, url, timeout=10)).read().decode()
    for name in (
        "swerl_pool_leases",
        "swerl_pool_waiting",
        "swerl_pool_acquire_seconds_bucket",
        "swerl_pool_lease_ends_total",
        "swerl_pool_node_healthy",
    ):
        assert name in text, name
