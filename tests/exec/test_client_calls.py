"""swerl.exec.client's calls against a real in-process node over the real dockerd: what each
returns, and the node's status and reason for each bad input, exactly as the raw call has them."""

from __future__ import annotations

import time
import uuid

import grpc
import pytest
from testkit.exec import assert_status, rpc_error

from swerl.exec.v1 import evaluate_pb2
from swerl.exec.v1 import sandbox_pb2 as pb

UNKNOWN = "sbx-does-not-exist"


async def test_a_sandbox_is_created_changed_diffed_and_destroyed_through_the_client(
    node, base_image
):
    client = node.client
    sandbox = await client.create_sandbox(base_image, workdir="/tmp", labels={"t": "client"})
    sid = sandbox.sandbox_id
    made = await client.run(
        sid,
        "git init -q r && cd r && git -c user.email=a@b -c user.name=a commit -q --allow-empty"
        " -m base && echo hi > new.txt",
    )
    assert made.exit_code == 0, made.stderr
    diff = await client.diff(sid, path="/tmp/r")
    assert list(diff.files) == ["new.txt"] and b"+hi" in diff.patch
    tracked_only = await client.diff(sid, path="/tmp/r", include_untracked=False)
    assert tracked_only.patch == b""
    assert (await client.node_info()).running == 1
    assert await client.destroy_sandbox(sid) is True
    assert await client.destroy_sandbox(sid) is False  # idempotent
    assert (await client.node_info()).running == 0


UNKNOWN_SANDBOX_CALLS = {
    "diff": lambda client: client.diff(UNKNOWN),
    "get_sandbox": lambda client: client.get_sandbox(UNKNOWN),
    "renew_sandbox": lambda client: client.renew_sandbox(UNKNOWN, 60),
    "hold_sandbox": lambda client: client.hold_sandbox(UNKNOWN, 60),
    "open_harness": lambda client: client.open_harness(
        UNKNOWN, "claude-code", gateway_url="http://127.0.0.1:1/s/x"
    ),
}


@pytest.mark.parametrize("method", UNKNOWN_SANDBOX_CALLS)
async def test_the_clients_calls_on_an_unknown_sandbox_are_not_found(node, method):
    err = await rpc_error(UNKNOWN_SANDBOX_CALLS[method](node.client))
    assert_status(err, grpc.StatusCode.NOT_FOUND, "SANDBOX_NOT_FOUND")


async def test_a_diff_outside_a_repository_is_refused_with_the_nodes_reason(node, sandbox):
    err = await rpc_error(node.client.diff(sandbox.sandbox_id, path="/"))
    assert_status(err, grpc.StatusCode.FAILED_PRECONDITION, "NOT_A_GIT_REPOSITORY")


async def test_creating_from_an_image_the_node_lacks_is_refused_with_its_reason(node):
    absent = f"swerl-test-absent/image:{uuid.uuid4().hex[:12]}"
    err = await rpc_error(node.client.create_sandbox(absent))
    assert_status(err, grpc.StatusCode.FAILED_PRECONDITION, "IMAGE_NOT_PRESENT")
    err = await rpc_error(node.client.create_sandbox("UPPER/Case::x"))
    assert_status(err, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_IMAGE_REFERENCE")


async def test_an_unknown_harness_is_refused_with_its_reason(node, sandbox):
    call = node.client.open_harness(
        sandbox.sandbox_id, "no-such-cli", gateway_url="http://127.0.0.1:1/s/x"
    )
    assert_status(await rpc_error(call), grpc.StatusCode.INVALID_ARGUMENT, "UNKNOWN_HARNESS_BUNDLE")


async def test_an_evaluation_without_an_instance_is_refused_with_its_reason(node, sandbox):
    async def report() -> None:
        await node.client.evaluation_report(
            evaluate_pb2.SweInstance(), b"", sandbox_id=sandbox.sandbox_id, timeout_s=60
        )

    err = await rpc_error(report())
    assert_status(err, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_INSTANCE")


async def test_holding_a_sandbox_moves_its_expiry_on_the_node_later_and_never_sooner(
    node, base_image
):
    client = node.client
    sandbox = await client.create_sandbox(base_image, ttl_s=30)
    sid = sandbox.sandbox_id
    held = await client.hold_sandbox(sid, 600)
    assert held > time.time() + 590
    again = await client.hold_sandbox(sid, 60)  # shorter than what the node has: kept
    assert again == held
    got = await client.get_sandbox(sid)
    assert got.expire_time.seconds == int(held)


async def test_the_node_reports_the_images_it_holds_and_ensures_present_ones(node, base_image):
    client = node.client
    tags = {tag for image in await client.list_images() for tag in image.repo_tags}
    assert base_image in tags
    results = [r.result async for r in client.ensure_images([base_image]) if r.HasField("result")]
    assert [(r.image, r.status) for r in results] == [(base_image, pb.IMAGE_PULL_STATUS_PRESENT)]
