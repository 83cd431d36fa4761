"""Forks and checkpoints on a real node: filesystem copies, busy sources, tokens, image cleanup."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import docker
import grpc
import pytest
from testkit.exec import RPC_TIMEOUT_S, ExecStream, assert_status, rpc_error

from swerl.chassis import capability
from swerl.exec.client import duration, exec_start
from swerl.exec.v1 import sandbox_pb2 as pb


def _fork_images() -> dict[str, str]:
    """checkpoint id -> image id of every fork image on the shared dockerd. One list call, no
    inspect per image: `images.list` inspects each listed image, and one that another node on
    the shared dockerd removes in between fails the whole listing (ImageNotFound)."""
    client = docker.from_env()
    try:
        images = client.api.images(filters={"label": "swerl.checkpoint_id"})
        return {image["Labels"]["swerl.checkpoint_id"]: image["Id"] for image in images}
    finally:
        client.close()


async def fork_images() -> dict[str, str]:
    return await asyncio.to_thread(_fork_images)


async def _wait_image_gone(checkpoint_id: str, within_s: float = 15.0) -> None:
    began = time.monotonic()
    while checkpoint_id in await fork_images():
        assert time.monotonic() - began < within_s, f"fork image of {checkpoint_id} kept"
        await asyncio.sleep(0.2)


async def _fork(node, sandbox_id: str, count: int, **fields) -> pb.ForkSandboxResponse:
    request = pb.ForkSandboxRequest(sandbox_id=sandbox_id, count=count, **fields)
    return await node.stub.ForkSandbox(request, timeout=RPC_TIMEOUT_S)


async def _destroy(node, sandbox_id: str) -> bool:
    request = pb.DestroySandboxRequest(sandbox_id=sandbox_id, request_id=uuid.uuid4().hex)
    return (await node.stub.DestroySandbox(request, timeout=RPC_TIMEOUT_S)).existed


async def _read(node, sandbox_id: str, path: str) -> bytes:
    result = await node.client.run(sandbox_id, f"cat {path} 2>/dev/null || echo MISSING")
    return result.stdout


async def test_fork_copies_the_filesystem_and_branches_stay_apart(node, base_image):
    source = await node.create(base_image, workdir="/tmp", labels={"task": "t1"})
    sid = source.sandbox_id
    setup = await node.client.run(
        sid,
        "mkdir -p /tmp/repo /opt/pkg && echo trunk > /tmp/repo/a.txt"
        " && echo installed > /opt/pkg/marker && echo home > /root/notes",
    )
    assert setup.exit_code == 0

    forked = await _fork(node, sid, 3, labels={"branch": "yes"})
    copies = [s.sandbox_id for s in forked.sandboxes]
    assert len(set(copies)) == 3 and sid not in copies
    for copy in forked.sandboxes:
        assert copy.checkpoint_id == forked.checkpoint.checkpoint_id
        assert copy.image == base_image and copy.workdir == "/tmp"
        assert dict(copy.labels) == {"task": "t1", "branch": "yes"}
        assert copy.state == pb.SANDBOX_STATE_RUNNING
    assert forked.checkpoint.source_sandbox_id == sid
    assert forked.checkpoint.sandboxes == 3
    assert forked.checkpoint.size_bytes > 0

    for copy in copies:
        assert await _read(node, copy, "/tmp/repo/a.txt") == b"trunk\n"
        assert await _read(node, copy, "/opt/pkg/marker") == b"installed\n"
        assert await _read(node, copy, "/root/notes") == b"home\n"
    # A write in branch 1 after the fork is in no other branch, nor in the source.
    await node.client.run(copies[0], "echo branch1 > /tmp/repo/a.txt; echo new > /tmp/repo/b")
    assert await _read(node, copies[0], "/tmp/repo/a.txt") == b"branch1\n"
    for other in (*copies[1:], sid):
        assert await _read(node, other, "/tmp/repo/a.txt") == b"trunk\n"
        assert await _read(node, other, "/tmp/repo/b") == b"MISSING\n"
    # The source keeps running and its own later writes reach no branch.
    await node.client.run(sid, "echo source-later > /tmp/repo/c")
    assert await _read(node, sid, "/tmp/repo/c") == b"source-later\n"
    for copy in copies:
        assert await _read(node, copy, "/tmp/repo/c") == b"MISSING\n"


async def test_fork_while_a_command_runs_is_refused_sandbox_busy(node, base_image):
    source = await node.create(base_image, workdir="/tmp")
    running = ExecStream(node.stub, exec_start(source.sandbox_id, "sleep 3", notify_started=True))
    await running.started()
    err = await rpc_error(_fork(node, source.sandbox_id, 2))
    assert_status(err, grpc.StatusCode.FAILED_PRECONDITION, "SANDBOX_BUSY")
    checkpoint = pb.CheckpointSandboxRequest(sandbox_id=source.sandbox_id)
    err = await rpc_error(node.stub.CheckpointSandbox(checkpoint, timeout=RPC_TIMEOUT_S))
    assert_status(err, grpc.StatusCode.FAILED_PRECONDITION, "SANDBOX_BUSY")
    assert (await running.result()).exit_code == 0
    # Idle again: the fork goes through, and nothing was made by the refused ones.
    listed = await node.stub.ListSandboxes(pb.ListSandboxesRequest(), timeout=RPC_TIMEOUT_S)
    assert [s.sandbox_id for s in listed.sandboxes] == [source.sandbox_id]
    assert len((await _fork(node, source.sandbox_id, 1)).sandboxes) == 1


async def test_fork_of_another_leases_sandbox_is_refused_by_its_token(node_factory, base_image):
    secret = "capability-secret"
    node = await node_factory(capability_secret=secret)
    mine = await node.create(base_image, workdir="/tmp", lease_id="lease-mine")
    theirs = await node.create(base_image, workdir="/tmp", lease_id="lease-theirs")
    my_token = capability.mint(
        secret.encode(),
        lease_id="lease-mine",
        sandbox_id=mine.sandbox_id,
        expire_time=time.time() + 60,
    )
    metadata = ((capability.LEASE_TOKEN_METADATA_KEY, my_token),)
    request = pb.ForkSandboxRequest(sandbox_id=theirs.sandbox_id, count=1)
    err = await rpc_error(node.stub.ForkSandbox(request, metadata=metadata, timeout=30))
    assert_status(err, grpc.StatusCode.PERMISSION_DENIED, "LEASE_TOKEN_FOREIGN")
    err = await rpc_error(node.stub.ForkSandbox(request, timeout=30))
    assert_status(err, grpc.StatusCode.UNAUTHENTICATED, "LEASE_TOKEN_MISSING")
    checkpoint = pb.CheckpointSandboxRequest(sandbox_id=theirs.sandbox_id)
    err = await rpc_error(node.stub.CheckpointSandbox(checkpoint, metadata=metadata, timeout=30))
    assert_status(err, grpc.StatusCode.PERMISSION_DENIED, "LEASE_TOKEN_FOREIGN")

    own = pb.ForkSandboxRequest(sandbox_id=mine.sandbox_id, count=1, lease_ids=["lease-fork"])
    forked = await node.stub.ForkSandbox(own, metadata=metadata, timeout=RPC_TIMEOUT_S)
    assert forked.sandboxes[0].lease_id == "lease-fork"


async def test_fork_retried_with_the_same_request_id_returns_the_same_copies(node, base_image):
    source = await node.create(base_image, workdir="/tmp")
    first, second = await asyncio.gather(
        _fork(node, source.sandbox_id, 2, request_id="fork-1"),
        _fork(node, source.sandbox_id, 2, request_id="fork-1"),
    )
    again = await _fork(node, source.sandbox_id, 2, request_id="fork-1")
    ids = [s.sandbox_id for s in first.sandboxes]
    assert (
        ids == [s.sandbox_id for s in second.sandboxes] == [s.sandbox_id for s in again.sandboxes]
    )
    listed = await node.stub.ListSandboxes(pb.ListSandboxesRequest(), timeout=RPC_TIMEOUT_S)
    assert len(listed.sandboxes) == 3


async def test_fork_that_does_not_fit_makes_nothing_node_at_capacity(node_factory, base_image):
    node = await node_factory(max_sandboxes=3)
    source = await node.create(base_image, workdir="/tmp")
    err = await rpc_error(_fork(node, source.sandbox_id, 3))
    assert_status(err, grpc.StatusCode.RESOURCE_EXHAUSTED, "NODE_AT_CAPACITY")
    listed = await node.stub.ListSandboxes(pb.ListSandboxesRequest(), timeout=RPC_TIMEOUT_S)
    assert len(listed.sandboxes) == 1
    assert len((await _fork(node, source.sandbox_id, 2)).sandboxes) == 2


async def test_bad_fork_requests_are_refused(node, base_image):
    source = await node.create(base_image, workdir="/tmp")
    for count in (0, -1, 10_000):
        err = await rpc_error(_fork(node, source.sandbox_id, count))
        assert_status(err, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_SANDBOX_SPEC")
    err = await rpc_error(_fork(node, source.sandbox_id, 2, lease_ids=["only-one"]))
    assert_status(err, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_SANDBOX_SPEC")
    err = await rpc_error(_fork(node, "sbx-nope", 1))
    assert_status(err, grpc.StatusCode.NOT_FOUND, "SANDBOX_NOT_FOUND")
    request = pb.CheckpointSandboxRequest(sandbox_id=source.sandbox_id, ttl=duration(-1))
    err = await rpc_error(node.stub.CheckpointSandbox(request, timeout=RPC_TIMEOUT_S))
    assert_status(err, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_SANDBOX_SPEC")


async def test_fork_image_is_listed_and_removed_with_the_last_copy(node, base_image):
    source = await node.create(base_image, workdir="/tmp")
    forked = await _fork(node, source.sandbox_id, 2)
    checkpoint_id = forked.checkpoint.checkpoint_id
    assert checkpoint_id in await fork_images()
    images = await node.stub.ListImages(pb.ListImagesRequest(), timeout=RPC_TIMEOUT_S)
    marked = [i for i in images.images if i.checkpoint_id == checkpoint_id]
    assert len(marked) == 1 and f"swerl-fork:{checkpoint_id}" in marked[0].repo_tags
    listed = await node.stub.ListCheckpoints(pb.ListCheckpointsRequest(), timeout=RPC_TIMEOUT_S)
    assert [(c.checkpoint_id, c.sandboxes) for c in listed.checkpoints] == [(checkpoint_id, 2)]
    # A fork point is no checkpoint to create from: it lives on in its copies only.
    request = pb.CreateSandboxRequest(from_checkpoint=checkpoint_id)
    err = await rpc_error(node.stub.CreateSandbox(request, timeout=RPC_TIMEOUT_S))
    assert_status(err, grpc.StatusCode.NOT_FOUND, "CHECKPOINT_NOT_FOUND")

    assert await _destroy(node, forked.sandboxes[0].sandbox_id)
    await asyncio.sleep(1.0)
    assert checkpoint_id in await fork_images()  # the second copy still uses it
    assert await _destroy(node, forked.sandboxes[1].sandbox_id)
    await _wait_image_gone(checkpoint_id)
    listed = await node.stub.ListCheckpoints(pb.ListCheckpointsRequest(), timeout=RPC_TIMEOUT_S)
    assert not listed.checkpoints


async def test_checkpoint_outlives_its_source_and_makes_copies_later(node, base_image):
    source = await node.create(base_image, workdir="/tmp", env={"MARK": "m1"})
    await node.client.run(source.sandbox_id, "echo saved > /tmp/state")
    taken = await node.stub.CheckpointSandbox(
        pb.CheckpointSandboxRequest(
            sandbox_id=source.sandbox_id,
            request_id="ckp-1",
            name="turn-3",
            ttl=duration(600),
            labels={"group": "g7"},
        ),
        timeout=RPC_TIMEOUT_S,
    )
    checkpoint = taken.checkpoint
    assert (checkpoint.name, dict(checkpoint.labels)) == ("turn-3", {"group": "g7"})
    assert checkpoint.expire_time.seconds > time.time() + 500
    retried = await node.stub.CheckpointSandbox(
        pb.CheckpointSandboxRequest(sandbox_id=source.sandbox_id, request_id="ckp-1"),
        timeout=RPC_TIMEOUT_S,
    )
    assert retried.checkpoint.checkpoint_id == checkpoint.checkpoint_id
    assert await _destroy(node, source.sandbox_id)

    made = []
    for _ in range(2):
        request = pb.CreateSandboxRequest(
            from_checkpoint=checkpoint.checkpoint_id, labels={"copy": "yes"}
        )
        made.append((await node.stub.CreateSandbox(request, timeout=RPC_TIMEOUT_S)).sandbox)
    for sandbox in made:
        assert sandbox.checkpoint_id == checkpoint.checkpoint_id
        assert sandbox.image == base_image and sandbox.workdir == "/tmp"
        result = await node.client.run(sandbox.sandbox_id, "cat /tmp/state; echo $MARK; pwd")
        assert result.stdout == b"saved\nm1\n/tmp\n"
    wrong = pb.CreateSandboxRequest(from_checkpoint=checkpoint.checkpoint_id, image="other:1")
    err = await rpc_error(node.stub.CreateSandbox(wrong, timeout=RPC_TIMEOUT_S))
    assert_status(err, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_SANDBOX_SPEC")

    delete = pb.DeleteCheckpointRequest(checkpoint_id=checkpoint.checkpoint_id)
    assert (await node.stub.DeleteCheckpoint(delete, timeout=RPC_TIMEOUT_S)).existed
    assert not (await node.stub.DeleteCheckpoint(delete, timeout=RPC_TIMEOUT_S)).existed
    err = await rpc_error(
        node.stub.CreateSandbox(
            pb.CreateSandboxRequest(from_checkpoint=checkpoint.checkpoint_id),
            timeout=RPC_TIMEOUT_S,
        )
    )
    assert_status(err, grpc.StatusCode.NOT_FOUND, "CHECKPOINT_NOT_FOUND")
    assert checkpoint.checkpoint_id in await fork_images()  # its copies still use it
    for sandbox in made:
        await _destroy(node, sandbox.sandbox_id)
    await _wait_image_gone(checkpoint.checkpoint_id)


async def test_restarted_node_adopts_used_fork_images_and_removes_unused_ones(
    node_factory, base_image, tmp_path
):
    node_id = "test-forks-" + uuid.uuid4().hex[:8]
    state_dir = tmp_path / "fork-state"
    first = await node_factory(node_id=node_id, state_dir=state_dir)
    source = await first.create(base_image, workdir="/tmp", ttl=duration(600))
    await first.client.run(source.sandbox_id, "echo kept > /tmp/state")
    kept = await _fork(first, source.sandbox_id, 1, ttl=duration(600))
    dropped = await _fork(first, source.sandbox_id, 1, ttl=duration(600))
    saved = await first.stub.CheckpointSandbox(
        pb.CheckpointSandboxRequest(sandbox_id=source.sandbox_id, ttl=duration(600)),
        timeout=RPC_TIMEOUT_S,
    )
    await first.node.stop(0)
    # While the node is down the copy of the second fork disappears (as after a SIGKILL in the
    # middle of its destroy): its fork image is then used by nothing.
    client = docker.from_env()
    try:
        await asyncio.to_thread(
            client.api.remove_container,
            f"swerl-{dropped.sandboxes[0].sandbox_id}",
            force=True,
        )
    finally:
        client.close()

    second = await node_factory(node_id=node_id, state_dir=state_dir)
    images = await fork_images()
    assert kept.checkpoint.checkpoint_id in images
    assert saved.checkpoint.checkpoint_id in images
    assert dropped.checkpoint.checkpoint_id not in images
    copy = kept.sandboxes[0].sandbox_id
    assert (await second.client.run(copy, "cat /tmp/state")).stdout == b"kept\n"
    listed = await second.stub.ListCheckpoints(pb.ListCheckpointsRequest(), timeout=RPC_TIMEOUT_S)
    assert {c.checkpoint_id for c in listed.checkpoints} == {
        kept.checkpoint.checkpoint_id,
        saved.checkpoint.checkpoint_id,
    }
    made = await second.stub.CreateSandbox(
        pb.CreateSandboxRequest(from_checkpoint=saved.checkpoint.checkpoint_id),
        timeout=RPC_TIMEOUT_S,
    )
    assert made.sandbox.checkpoint_id == saved.checkpoint.checkpoint_id
    for sandbox_id in (copy, made.sandbox.sandbox_id, source.sandbox_id):
        await _destroy(second, sandbox_id)
    await _wait_image_gone(kept.checkpoint.checkpoint_id)
    delete = pb.DeleteCheckpointRequest(checkpoint_id=saved.checkpoint.checkpoint_id)
    assert (await second.stub.DeleteCheckpoint(delete, timeout=RPC_TIMEOUT_S)).existed
    await _wait_image_gone(saved.checkpoint.checkpoint_id)


def _remove_test_fork_images() -> None:
    client = docker.from_env()
    try:
        # One listing call (docker-py's `images.list` inspects each image, and one removed
        # meanwhile raises ImageNotFound).
        for image in client.api.images(filters={"label": "swerl.checkpoint_id"}):
            if (image.get("Labels") or {}).get("swerl.node", "").startswith("test-"):
                with contextlib.suppress(docker.errors.APIError):
                    client.images.remove(image["Id"], force=True)
    finally:
        client.close()


@pytest.fixture(autouse=True)
async def _no_fork_image_outlives_a_test():
    """The node fixture removes the sandboxes; a failed test could leave their fork images."""
    yield
    await asyncio.to_thread(_remove_test_fork_images)
