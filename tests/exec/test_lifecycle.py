"""Sandbox lifecycle on a real node: capacity, idempotency, expiry, renewal, restarts."""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc
from testkit.exec import (
    RPC_TIMEOUT_S,
    assert_status,
    container_exists,
    container_host_config,
    node_container_names,
    rpc_error,
)

from swerl.exec.client import duration
from swerl.exec.v1 import sandbox_pb2 as pb


async def _get(node, sandbox_id: str) -> pb.Sandbox:
    request = pb.GetSandboxRequest(sandbox_id=sandbox_id)
    return (await node.stub.GetSandbox(request, timeout=RPC_TIMEOUT_S)).sandbox


async def _destroy(node, sandbox_id: str) -> bool:
    request = pb.DestroySandboxRequest(sandbox_id=sandbox_id, request_id=uuid.uuid4().hex)
    return (await node.stub.DestroySandbox(request, timeout=RPC_TIMEOUT_S)).existed


async def _wait_until_gone(node, sandbox_id: str, within_s: float) -> None:
    """Polls GetSandbox until NOT_FOUND."""
    began = time.monotonic()
    while time.monotonic() - began < within_s:
        try:
            await _get(node, sandbox_id)
        except grpc.aio.AioRpcError as err:
            assert_status(err, grpc.StatusCode.NOT_FOUND, "SANDBOX_NOT_FOUND")
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{sandbox_id} still present after {within_s} s")


async def test_node_at_capacity_refuses_creates_until_a_sandbox_is_destroyed(
    node_factory, base_image
):
    node = await node_factory(max_sandboxes=2)
    first = await node.create(base_image)
    await node.create(base_image)

    err = await rpc_error(node.create(base_image))
    metadata = assert_status(err, grpc.StatusCode.RESOURCE_EXHAUSTED, "NODE_AT_CAPACITY")
    assert metadata["capacity"] == "2"
    assert len(await node_container_names(node.node.settings.node_id)) == 2

    assert await _destroy(node, first.sandbox_id)
    third = await node.create(base_image)
    assert third.state == pb.SANDBOX_STATE_RUNNING


async def test_destroying_twice_reports_existed_then_not(node, base_image):
    sandbox = await node.create(base_image)
    assert await _destroy(node, sandbox.sandbox_id) is True
    assert await _destroy(node, sandbox.sandbox_id) is False
    assert not await container_exists(sandbox.sandbox_id)
    err = await rpc_error(_get(node, sandbox.sandbox_id))
    assert_status(err, grpc.StatusCode.NOT_FOUND, "SANDBOX_NOT_FOUND")


async def test_create_retried_with_the_same_request_id_makes_one_sandbox(node, base_image):
    request_id = uuid.uuid4().hex
    first = await node.create(base_image, request_id=request_id)
    retry = await node.create(base_image, request_id=request_id)
    assert retry.sandbox_id == first.sandbox_id
    assert await node_container_names(node.node.settings.node_id) == {f"swerl-{first.sandbox_id}"}


async def test_concurrent_creates_with_the_same_request_id_make_one_sandbox(node, base_image):
    request_id = uuid.uuid4().hex
    created = await asyncio.gather(
        *(node.create(base_image, request_id=request_id) for _ in range(3))
    )
    assert len({sandbox.sandbox_id for sandbox in created}) == 1
    assert len(await node_container_names(node.node.settings.node_id)) == 1
    info = await node.stub.GetNodeInfo(pb.GetNodeInfoRequest(), timeout=RPC_TIMEOUT_S)
    assert info.running == 1


async def test_expired_sandbox_is_reaped_with_its_container(node_factory, base_image):
    node = await node_factory(reap_interval_s=0.5)
    sandbox = await node.create(base_image, ttl=duration(1))
    assert await container_exists(sandbox.sandbox_id)

    began = time.monotonic()
    await _wait_until_gone(node, sandbox.sandbox_id, within_s=5)
    while await container_exists(sandbox.sandbox_id):  # removal may still be finishing
        assert time.monotonic() - began < 5, "container still listed by docker ps -a"
        await asyncio.sleep(0.1)
    listed = await node.stub.ListSandboxes(pb.ListSandboxesRequest(), timeout=RPC_TIMEOUT_S)
    assert list(listed.sandboxes) == []


async def test_renewed_sandbox_outlives_its_original_ttl(node_factory, base_image):
    node = await node_factory(reap_interval_s=0.5)
    sandbox = await node.create(base_image, ttl=duration(1))
    renewed = await node.stub.RenewSandbox(
        pb.RenewSandboxRequest(sandbox_id=sandbox.sandbox_id, ttl=duration(120)),
        timeout=RPC_TIMEOUT_S,
    )
    assert renewed.sandbox.expire_time.seconds >= sandbox.expire_time.seconds + 100

    await asyncio.sleep(2.0)  # past the original expiry and several reaper rounds
    assert (await _get(node, sandbox.sandbox_id)).sandbox_id == sandbox.sandbox_id
    result = await node.client.run(sandbox.sandbox_id, "echo alive")
    assert result.stdout == b"alive\n"


async def test_restarted_node_adopts_live_sandboxes_and_removes_expired_ones(
    node_factory, base_image, tmp_path
):
    node_id = "test-restart-" + uuid.uuid4().hex[:8]
    state_dir = tmp_path / "restart-state"
    # The first node never reaps: under load the short sandbox may expire before the stop,
    # and what this test asks is what the *restarted* node does with it.
    first = await node_factory(node_id=node_id, state_dir=state_dir, reap_interval_s=3600)
    short = await first.create(base_image, ttl=duration(2), labels={"role": "short"})
    long = await first.create(
        base_image, ttl=duration(600), workdir="/tmp", labels={"role": "long"}, owner="agent-7"
    )
    wrote = await first.client.run(long.sandbox_id, "echo kept > /tmp/state; cd /etc", session=True)
    assert wrote.exit_code == 0

    await first.node.stop(0)  # stopping keeps sandboxes: the next start adopts them
    assert await node_container_names(node_id) == {
        f"swerl-{short.sandbox_id}",
        f"swerl-{long.sandbox_id}",
    }
    expired_at = short.expire_time.ToNanoseconds() / 1e9
    await asyncio.sleep(max(0.0, expired_at - time.time()) + 0.2)

    second = await node_factory(node_id=node_id, state_dir=state_dir)
    adopted = await _get(second, long.sandbox_id)
    assert adopted.labels == {"role": "long"}
    assert adopted.owner == "agent-7"
    assert adopted.node_id == node_id
    result = await second.client.run(long.sandbox_id, "pwd; cat /tmp/state")
    assert result.stdout == b"/tmp\nkept\n"

    err = await rpc_error(_get(second, short.sandbox_id))
    assert_status(err, grpc.StatusCode.NOT_FOUND, "SANDBOX_NOT_FOUND")
    assert not await container_exists(short.sandbox_id)
    listed = await second.stub.ListSandboxes(pb.ListSandboxesRequest(), timeout=RPC_TIMEOUT_S)
    accounted = {f"swerl-{s.sandbox_id}" for s in listed.sandboxes}
    assert accounted == {f"swerl-{long.sandbox_id}"}
    assert await node_container_names(node_id) == accounted

    # The adopted sandbox is fully managed again: it can be destroyed through the new node.
    assert await _destroy(second, long.sandbox_id)
    assert await node_container_names(node_id) == set()


async def test_list_sandboxes_filters_by_caller_labels(node, base_image):
    a = await node.create(base_image, labels={"team": "a", "run": "1"})
    b = await node.create(base_image, labels={"team": "b", "run": "1"})

    async def listed(**selector: str) -> set[str]:
        request = pb.ListSandboxesRequest(label_selector=selector)
        response = await node.stub.ListSandboxes(request, timeout=RPC_TIMEOUT_S)
        return {s.sandbox_id for s in response.sandboxes}

    assert await listed() == {a.sandbox_id, b.sandbox_id}
    assert await listed(team="a") == {a.sandbox_id}
    assert await listed(run="1") == {a.sandbox_id, b.sandbox_id}
    assert await listed(team="a", run="2") == set()
    assert await listed(team="c") == set()
    # Only caller labels are reported, never swerl's own.
    got = await _get(node, a.sandbox_id)
    assert dict(got.labels) == {"team": "a", "run": "1"}


async def test_created_sandbox_reports_its_spec(node, base_image):
    sandbox = await node.create(
        base_image,
        workdir="/srv",
        resources=pb.Resources(cpus=0.5, memory_bytes=256 << 20, pids=100),
        ttl=duration(300),
        lease_id="lease-1",
        owner="agent-3/episode-17",
        instance_id="repo__issue-1",
    )
    assert sandbox.sandbox_id.startswith("sbx-")
    assert sandbox.image == base_image
    assert sandbox.workdir == "/srv"
    assert sandbox.state == pb.SANDBOX_STATE_RUNNING
    assert sandbox.network == pb.NETWORK_MODE_NONE
    assert (sandbox.resources.cpus, sandbox.resources.memory_bytes, sandbox.resources.pids) == (
        0.5,
        256 << 20,
        100,
    )
    lifetime = sandbox.expire_time.seconds - sandbox.create_time.seconds
    assert 299 <= lifetime <= 301
    assert (sandbox.lease_id, sandbox.owner, sandbox.instance_id) == (
        "lease-1",
        "agent-3/episode-17",
        "repo__issue-1",
    )
    assert sandbox.node_id == node.node.settings.node_id
    result = await node.client.run(sandbox.sandbox_id, "pwd")
    assert result.stdout == b"/srv\n"
    host_config = await container_host_config(sandbox.sandbox_id)
    assert host_config["PidsLimit"] == 100
    assert host_config["Memory"] == 256 << 20
    assert host_config["NanoCpus"] == 500_000_000
    assert host_config["NetworkMode"] == "none"


async def test_sandbox_whose_container_was_killed_outside_is_reported_exited_until_restarted(
    node_factory, base_image
):
    import docker

    running = await node_factory(reap_interval_s=0.3)
    sandbox = await running.create(base_image)
    assert (await running.client.run(sandbox.sandbox_id, "echo up")).stdout == b"up\n"

    def kill() -> None:
        client = docker.from_env()
        try:
            client.containers.get(f"swerl-{sandbox.sandbox_id}").kill()
        finally:
            client.close()

    await asyncio.to_thread(kill)
    await asyncio.sleep(1.5)
    got = await running.stub.GetSandbox(pb.GetSandboxRequest(sandbox_id=sandbox.sandbox_id))
    assert got.sandbox.state == pb.SANDBOX_STATE_EXITED
    # The next command starts it again (issue 15): see test_sandbox_recovery.py for the rest.
    again = await running.client.run(sandbox.sandbox_id, "echo again")
    assert (again.stdout, again.sandbox_restarted) == (b"again\n", True)
    destroyed = await running.stub.DestroySandbox(
        pb.DestroySandboxRequest(sandbox_id=sandbox.sandbox_id)
    )
    assert destroyed.existed
