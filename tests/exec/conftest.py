"""An in-process exec node on port 0 over the real dockerd, and a client for it."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from swerl.chassis.client import make_channel
from swerl.exec.client import SandboxClient
from swerl.exec.server import ExecNode
from swerl.exec.settings import ExecSettings
from swerl.exec.v1 import sandbox_pb2 as pb
from tests.exec.exec_testkit import containers_of, remove_containers_of

TOKEN = "test-token"


def node_settings(tmp_path: Path, **overrides) -> ExecSettings:
    values = dict(
        host="127.0.0.1",
        port=0,
        auth_token=TOKEN,
        node_id="test-" + uuid.uuid4().hex[:8],
        state_dir=tmp_path / "state",
        reap_interval_s=0.5,
        default_memory_bytes=512 << 20,
        default_pids=256,
        drain_grace_s=1.0,
    )
    values.update(overrides)
    return ExecSettings(**values)


class RunningNode:
    def __init__(self, node: ExecNode) -> None:
        self.node = node
        self.address = f"127.0.0.1:{node.port}"
        self.channel = make_channel(self.address, token=TOKEN)
        self.client = SandboxClient(self.channel)
        self.stub = self.client.stub

    async def create(self, image: str, **fields) -> pb.Sandbox:
        request = pb.CreateSandboxRequest(image=image, **fields)
        return (await self.stub.CreateSandbox(request, timeout=60)).sandbox


async def start_node(settings: ExecSettings) -> RunningNode:
    node = ExecNode(settings)
    await node.start()
    return RunningNode(node)


@pytest.fixture
async def node_factory(tmp_path, base_image) -> AsyncIterator:
    """Starts nodes with optional setting overrides; tears them down and proves no leak."""
    started: list[RunningNode] = []

    async def factory(**overrides) -> RunningNode:
        running = await start_node(node_settings(tmp_path, **overrides))
        started.append(running)
        return running

    yield factory
    for running in started:
        manager = running.node.manager
        for record in list(manager.list_sandboxes({})):
            await manager.destroy(record.sandbox_id)
        await running.channel.close()
        await running.node.stop(0)
        leftover = await asyncio.to_thread(containers_of, running.node.settings.node_id)
        remove_containers_of(running.node.settings.node_id)
        assert not leftover, f"sandbox containers leaked: {[c.name for c in leftover]}"


@pytest.fixture
async def node(node_factory) -> RunningNode:
    return await node_factory()


@pytest.fixture
async def sandbox(node, base_image) -> pb.Sandbox:
    return await node.create(base_image, workdir="/tmp")
