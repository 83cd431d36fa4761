"""On-demand pulls over real gRPC: a pool and an exec node in process over the shared dockerd,
pulling from a real loopback registry (Debian's docker-registry, from tests/testkit/dockerd.py) that
tests stop and start."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from testkit.dockerd import push_images, remove_names, start_registry

from swerl.chassis.client import error_info
from swerl.chassis.timeconv import duration_pb
from swerl.pool.client import PoolClient
from swerl.pool.v1 import pool_pb2 as pb
from swerl.pool.v1 import pool_pb2_grpc
from swerl.stack import local_stack

TASK_IMAGE = "swerl-examples/swerl-examples__romans-5:latest"


@pytest.fixture(scope="module")
def registry(tmp_path_factory, base_image):
    running = start_registry(tmp_path_factory.mktemp("registry"))
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def pushed(registry):
    """TASK_IMAGE's name in the registry; afterwards no dockerd name of it is left behind."""
    name = push_images([TASK_IMAGE], registry.address)[TASK_IMAGE]
    try:
        yield name
    finally:
        remove_names([name])


@pytest.fixture
def pushed_only(pushed) -> str:
    """The pushed image, present in the registry and under this name in no dockerd (a test
    before may have pulled it)."""
    remove_names([pushed])
    return pushed


def seconds(duration) -> float:
    return duration.seconds + duration.nanos / 1e9


async def test_a_lease_for_an_image_only_the_registry_has_succeeds_after_one_pull(
    registry, pushed_only
):
    async with local_stack(nodes=1, max_sandboxes=4, purpose="pulltest") as stack:
        pool = PoolClient(stack.pool_address, token=stack.token)
        try:
            stub = pool.stub
            seen_pulling: list[pb.Lease] = []

            async def watch() -> None:
                while True:
                    listed = await pool.list_leases(states=[pb.LEASE_STATE_PULLING])
                    seen_pulling.extend(listed)
                    await asyncio.sleep(0.02)

            watcher = asyncio.ensure_future(watch())
            requests = [
                pb.AcquireLeaseRequest(
                    request_id=f"pull-{i}",
                    image=pushed_only,
                    owner=f"w{i}",
                    wait_timeout=duration_pb(120),
                )
                for i in range(3)
            ]
            replies = await asyncio.gather(*(stub.AcquireLease(r, timeout=180) for r in requests))
            watcher.cancel()
            leases = [reply.lease for reply in replies]
            assert all(lease.state == pb.LEASE_STATE_ACTIVE for lease in leases)
            # The wait reports the pull; every lease shared the one pull on the node.
            assert all(seconds(lease.pull_duration) > 0 for lease in leases)
            assert all(
                seconds(lease.wait_duration) >= seconds(lease.pull_duration) for lease in leases
            )
            (node,) = await pool.list_nodes()
            assert (node.image_pulls, node.image_misses, node.image_hits) == (1, 3, 0)
            assert seen_pulling and seen_pulling[0].pull.image == pushed_only
            # A later lease finds the image on the node.
            again = await pool.acquire(pushed_only, wait_s=30)
            assert seconds(again.pull_duration) == 0
            for lease in [*leases, again]:
                await pool.release(lease.lease_id)
        finally:
            await pool.close()


async def test_registry_stopped_answers_every_waiter_with_its_reason_before_the_deadline(
    registry, pushed_only
):
    async with local_stack(
        nodes=1, max_sandboxes=8, purpose="pulltest", pool_settings={"pull_backoff_s": 30.0}
    ) as stack:
        channel = grpc.aio.insecure_channel(stack.pool_address)
        stub = pool_pb2_grpc.PoolServiceStub(channel)
        metadata = (("authorization", f"Bearer {stack.token}"),)
        registry.stop()
        try:
            image = f"{registry.address}/swerl-pulltest/never-pushed:1"
            started = time.monotonic()

            async def acquire(i: int) -> tuple[grpc.StatusCode, str | None, float]:
                request = pb.AcquireLeaseRequest(image=image, wait_timeout=duration_pb(60))
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await stub.AcquireLease(request, timeout=90, metadata=metadata)
                return (
                    caught.value.code(),
                    error_info(caught.value)[0],
                    time.monotonic() - started,
                )

            results = await asyncio.gather(*(acquire(i) for i in range(8)))
            assert {(code, reason) for code, reason, _ in results} == {
                (grpc.StatusCode.UNAVAILABLE, "REGISTRY_UNREACHABLE")
            }
            assert max(elapsed for _, _, elapsed in results) < 60
            # The registry is remembered down: the image already pushed is refused at once too.
            request = pb.AcquireLeaseRequest(image=pushed_only, wait_timeout=duration_pb(60))
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.AcquireLease(request, timeout=90, metadata=metadata)
            assert error_info(caught.value)[0] == "REGISTRY_UNREACHABLE"
            (node,) = (
                await stub.ListNodes(pb.ListNodesRequest(), timeout=10, metadata=metadata)
            ).nodes
            assert node.image_pulls == 1  # One pull for eight waiters, none since.
        finally:
            registry.start()
            await channel.close()


async def test_no_pull_keeps_the_old_refusal(registry, pushed_only):
    async with local_stack(
        nodes=1, max_sandboxes=2, purpose="pulltest", pool_settings={"pull": False}
    ) as stack:
        pool = PoolClient(stack.pool_address, token=stack.token)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await pool.stub.AcquireLease(
                    pb.AcquireLeaseRequest(image=pushed_only, wait_timeout=duration_pb(30)),
                    timeout=30,
                )
            assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert error_info(caught.value) == ("IMAGE_NOT_PRESENT", {"image": pushed_only})
            (node,) = await pool.list_nodes()
            assert node.image_pulls == 0
        finally:
            await pool.close()


async def test_prefetch_images_pulls_on_the_home_node(registry, pushed_only):
    async with local_stack(nodes=1, max_sandboxes=2, purpose="pulltest") as stack:
        pool = PoolClient(stack.pool_address, token=stack.token)
        try:
            reply = await pool.stub.PrefetchImages(
                pb.PrefetchImagesRequest(images=[pushed_only, pushed_only]), timeout=30
            )
            (entry,) = reply.images
            node_id = (await pool.list_nodes())[0].node_id
            assert (entry.image, list(entry.home_node_ids)) == (pushed_only, [node_id])
            assert entry.status in (pb.PREFETCH_STATUS_STARTED, pb.PREFETCH_STATUS_PRESENT)
            deadline = time.monotonic() + 120
            while True:
                reply = await pool.stub.PrefetchImages(
                    pb.PrefetchImagesRequest(images=[pushed_only]), timeout=30
                )
                if reply.images[0].status == pb.PREFETCH_STATUS_PRESENT:
                    break
                assert time.monotonic() < deadline
                await asyncio.sleep(0.2)
            lease = await pool.acquire(pushed_only, wait_s=30)
            assert seconds(lease.pull_duration) == 0
            await pool.release(lease.lease_id)
            bad = await pool.stub.PrefetchImages(pb.PrefetchImagesRequest(images=[""]), timeout=30)
        except grpc.aio.AioRpcError as err:
            assert (err.code(), error_info(err)[0]) == (
                grpc.StatusCode.INVALID_ARGUMENT,
                "INVALID_LEASE_REQUEST",
            )
        else:
            pytest.fail(f"an empty image name was accepted: {bad}")
        finally:
            await pool.close()
