"""Fixtures of the EvaluateService tests: the bundled task images, built once per session, and
an in-process exec node on port 0 over the real dockerd with an EvaluateService client."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
from testkit.evaluate import BUNDLED_TASKS, NETWORK_TASKS, TOKEN, EvalNode, sweep_containers_of

from swerl.exec.server import ExecNode
from swerl.exec.settings import ExecSettings
from swerl.tasks import build_images


@pytest.fixture(scope="session")
def task_images(base_image) -> dict[str, str]:
    """Builds (or finds) every bundled task's image once; maps instance id to image name."""
    build_images(BUNDLED_TASKS, base_image=base_image, progress=lambda _line: None)
    return {task.instance_id: task.image_name for task in BUNDLED_TASKS}


@pytest.fixture(scope="session")
def network_task_images(base_image) -> dict[str, str]:
    """Builds (or finds) the images of examples/network-tasks once; maps id to image name."""
    tasks = list(NETWORK_TASKS.values())
    build_images(tasks, base_image=base_image, progress=lambda _line: None)
    return {task.instance_id: task.image_name for task in tasks}


@pytest.fixture
async def eval_node(tmp_path, task_images) -> AsyncIterator[EvalNode]:
    """A fresh node per test; afterwards no sandbox container of it may be left behind (the
    evaluations create and destroy their own)."""
    settings = ExecSettings(
        host="127.0.0.1",
        port=0,
        auth_token=TOKEN,
        node_id="test-eval-" + uuid.uuid4().hex[:8],
        state_dir=tmp_path / "state",
        reap_interval_s=0.5,
        default_memory_bytes=512 << 20,
        default_pids=256,
        drain_grace_s=1.0,
    )
    node = ExecNode(settings)
    await node.start()
    running = EvalNode(node)
    try:
        yield running
    finally:
        await running.channel.close()
        await node.stop(0)
        leftover = await asyncio.to_thread(sweep_containers_of, settings.node_id)
    assert not leftover, f"sandbox containers leaked: {leftover}"


@pytest.fixture(scope="session")
def official_task(base_image, tmp_path_factory):
    """The classic-row task in the official layout (testkit.official), its image built once."""
    from testkit.official import write_official_task

    task = write_official_task(tmp_path_factory.mktemp("official"))
    build_images([task], base_image=base_image, rebuild=True, progress=lambda _line: None)
    return task
