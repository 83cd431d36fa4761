"""An in-process exec node on port 0 over the real dockerd, and a client for it (testkit.exec)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

import pytest
from testkit.exec import (
    RunningNode,
    containers_of,
    node_settings,
    remove_containers_of,
    start_node,
)

from swerl.exec.v1 import sandbox_pb2 as pb

# A restart of Podman's own service: the podman lane's test (scripts/runtime-lanes), which the
# other lanes do not collect.
if os.environ.get("SWERL_EXEC_RUNTIME") != "podman":
    collect_ignore = ["test_podman_service_restart.py"]


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
