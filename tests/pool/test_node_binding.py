"""The exec node's side of the pool: BindSandbox (a warm spare handed to a lease) is durable
across a node restart, and lease tokens are checked against the bound lease."""

from __future__ import annotations

import secrets
import time
import uuid

import grpc
import pytest

from swerl.chassis import capability
from swerl.chassis.client import error_info, make_channel
from swerl.chassis.timeconv import duration_pb
from swerl.exec.client import SandboxClient
from swerl.exec.server import ExecNode
from swerl.exec.settings import ExecSettings
from swerl.exec.v1 import sandbox_pb2 as pb

TOKEN = "node-token"


def settings(tmp_path, node_id: str, secret: str) -> ExecSettings:
    return ExecSettings(
        host="127.0.0.1",
        port=0,
        auth_token=TOKEN,
        capability_secret=secret,
        node_id=node_id,
        state_dir=tmp_path / "state",
        log_level="warning",
        drain_grace_s=0.5,
    )


async def test_binding_survives_a_node_restart_and_gates_the_sandbox(tmp_path, base_image):
    secret = secrets.token_hex(16)
    node_id = "bind-" + uuid.uuid4().hex[:8]
    node = ExecNode(settings(tmp_path, node_id, secret))
    await node.start()
    channel = make_channel(f"127.0.0.1:{node.port}", token=TOKEN)
    stub = SandboxClient(channel).stub
    sandbox_id = ""
    try:
        spare = await stub.CreateSandbox(
            pb.CreateSandboxRequest(image=base_image, owner="swerl-pool/spare"), timeout=60
        )
        sandbox_id = spare.sandbox.sandbox_id
        bound = await stub.BindSandbox(
            pb.BindSandboxRequest(
                sandbox_id=sandbox_id,
                lease_id="lse-bound",
                owner="agent-1",
                instance_id="inst-1",
                ttl=duration_pb(60),
            ),
            timeout=10,
        )
        assert (bound.sandbox.lease_id, bound.sandbox.owner) == ("lse-bound", "agent-1")
        await channel.close()
        await node.stop(0)

        node = ExecNode(settings(tmp_path, node_id, secret))
        await node.start()
        key = secret.encode()
        good = capability.mint(
            key, lease_id="lse-bound", sandbox_id=sandbox_id, expire_time=time.time() + 60
        )
        old_lease = capability.mint(
            key, lease_id="lse-other", sandbox_id=sandbox_id, expire_time=time.time() + 60
        )
        channel = make_channel(
            f"127.0.0.1:{node.port}",
            token=TOKEN,
            metadata_provider=lambda: [(capability.LEASE_TOKEN_METADATA_KEY, good)],
        )
        client = SandboxClient(channel)
        stub = client.stub
        listed = (await stub.GetSandbox(pb.GetSandboxRequest(sandbox_id=sandbox_id))).sandbox
        assert (listed.lease_id, listed.owner, listed.instance_id) == (
            "lse-bound",
            "agent-1",
            "inst-1",
        )
        assert (await client.run(sandbox_id, "echo ok")).stdout == b"ok\n"
        stale = make_channel(
            f"127.0.0.1:{node.port}",
            token=TOKEN,
            metadata_provider=lambda: [(capability.LEASE_TOKEN_METADATA_KEY, old_lease)],
        )
        try:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await SandboxClient(stale).run(sandbox_id, "true")
            assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert error_info(caught.value)[0] == "LEASE_TOKEN_FOREIGN"
        finally:
            await stale.close()
        missing = stub.BindSandbox(pb.BindSandboxRequest(sandbox_id="sbx-nope"), timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await missing
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        assert error_info(caught.value)[0] == "SANDBOX_NOT_FOUND"
    finally:
        if sandbox_id:
            await node.manager.destroy(sandbox_id)
        await channel.close()
        await node.stop(0)
