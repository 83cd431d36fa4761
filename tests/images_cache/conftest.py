"""Session-wide real parts for the image-cache tests, from testkit.dockerd and testkit.images_cache.

- `registry`: a loopback Distribution registry holding the bundled task images
  (`registry_images`: instance id -> `127.0.0.1:<port>/...` name).
- `second_dockerd`: a dockerd with its own image store, holding only the base image at the start
  of every test; the nodes under test drive it (`docker_host`), so their evictions can never
  reach the shared dockerd's images.
- `cache_node`: starts in-process exec nodes on port 0 against the second dockerd.
- `pool_stack`: a pool and one exec node in process (swerl.stack.local_stack), the node on
  the second dockerd, so its pulls are the second dockerd's and countable from its events.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import docker
import pytest
from testkit.dockerd import Dockerd, Registry, push_images, start_dockerd, start_registry
from testkit.images_cache import (
    BUNDLED_TASKS,
    TOKEN,
    CacheNode,
    cache_settings,
    reset_images,
)

from swerl.exec.server import ExecNode
from swerl.stack import LocalStack, local_stack
from swerl.tasks import build_images


@pytest.fixture(scope="session")
def task_images(base_image) -> dict[str, str]:
    """The bundled task images on the shared dockerd (built once); instance id -> name."""
    build_images(BUNDLED_TASKS, base_image=base_image, progress=lambda _line: None)
    return {task.instance_id: task.image_name for task in BUNDLED_TASKS}


@pytest.fixture(scope="session")
def registry(tmp_path_factory) -> Iterator[Registry]:
    running = start_registry(tmp_path_factory.mktemp("registry"))
    yield running
    running.stop()


@pytest.fixture(scope="session")
def registry_images(registry, task_images) -> dict[str, str]:
    """instance id -> the task image's name in the test registry."""
    pushed = push_images(sorted(task_images.values()), registry.address)
    return {instance: pushed[image] for instance, image in task_images.items()}


@pytest.fixture(scope="session")
def image_sizes(task_images) -> dict[str, int]:
    """instance id -> Docker's unpacked size of its image (the size the budget counts)."""
    client = docker.from_env()
    try:
        return {i: int(client.images.get(name).attrs["Size"]) for i, name in task_images.items()}
    finally:
        client.close()


@pytest.fixture(scope="session")
def second_dockerd(base_image) -> Iterator[Dockerd]:
    # A short root: the socket path must stay under the 108 bytes a unix socket name may have.
    root = Path(tempfile.mkdtemp(prefix="swerl-dd-", dir="/tmp"))
    dockerd = start_dockerd(root, base_image=base_image)
    yield dockerd
    dockerd.stop()


@pytest.fixture
async def cache_node(tmp_path, second_dockerd, base_image) -> AsyncIterator:
    """Starts nodes on the second dockerd (`cache_node(**settings)`); a restart passes the same
    `state_dir` and `node_id`. Afterwards the second dockerd holds the base image only."""
    started: list[CacheNode] = []

    async def start(**overrides) -> CacheNode:
        overrides.setdefault("state_dir", tmp_path / "state")
        settings = cache_settings(docker_host=second_dockerd.host, **overrides)
        node = ExecNode(settings)
        await node.start()
        started.append(CacheNode(node))
        return started[-1]

    try:
        yield start
    finally:
        for running in started:
            await running.close()
        await asyncio.to_thread(reset_images, second_dockerd, base_image)


@pytest.fixture
async def pool_stack(second_dockerd, base_image) -> AsyncIterator[LocalStack]:
    """A pool with one exec node (8 sandboxes) driving the second dockerd; on exit the stack has
    destroyed its sandboxes and the second dockerd holds the base image only."""
    try:
        async with local_stack(
            nodes=1,
            max_sandboxes=8,
            purpose="cachepool",
            token=TOKEN,
            node_settings={"docker_host": second_dockerd.host, "default_memory_bytes": 256 << 20},
        ) as stack:
            yield stack
    finally:
        await asyncio.to_thread(reset_images, second_dockerd, base_image)
