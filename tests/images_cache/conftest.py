"""Session-wide real parts for the image-cache tests, from tests/dockerd_kit.py.

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
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import docker
import pytest
from dockerd_kit import Dockerd, Registry, push_images, start_dockerd, start_registry

from swerl.chassis.client import make_channel
from swerl.exec.client import SandboxClient
from swerl.exec.server import ExecNode
from swerl.exec.settings import ExecSettings
from swerl.exec.v1 import sandbox_pb2 as pb
from swerl.stack import LocalStack, local_stack
from swerl.tasks import build_images, default_tasks_dir, load_tasks

# exec_testkit (status assertions shared with the exec node's tests) lives in tests/exec, which
# is not on sys.path when only this directory is collected.
_EXEC_TESTS = str(Path(__file__).resolve().parents[1] / "exec")
if _EXEC_TESTS not in sys.path:
    sys.path.append(_EXEC_TESTS)

TOKEN = "cache-test-token"
BUNDLED_TASKS = load_tasks(default_tasks_dir())


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


def _reset_images(dockerd: Dockerd, keep: str) -> None:
    """Leaves only `keep` (the base image) in the second dockerd: every test starts cold."""
    client = dockerd.client()
    try:
        for container in client.containers.list(all=True):
            container.remove(force=True)
        for image in client.images.list():
            if keep not in image.tags:
                client.images.remove(image.id, force=True)
    finally:
        client.close()


class CacheNode:
    """An in-process exec node on the second dockerd, with a client."""

    def __init__(self, node: ExecNode) -> None:
        self.node = node
        self.channel = make_channel(f"127.0.0.1:{node.port}", token=TOKEN)
        self.client = SandboxClient(self.channel)
        self.stub = self.client.stub
        self.closed = False

    async def ensure(self, *images: str, timeout: float = 120) -> dict[str, pb.ImagePullResult]:
        request = pb.EnsureImagesRequest(request_id=uuid.uuid4().hex, images=list(images))
        results: dict[str, pb.ImagePullResult] = {}
        async for response in self.stub.EnsureImages(request, timeout=timeout):
            if response.WhichOneof("kind") == "result":
                results[response.result.image] = response.result
        return results

    async def create(self, image: str) -> pb.Sandbox:
        request = pb.CreateSandboxRequest(image=image, workdir="/tmp")
        return (await self.stub.CreateSandbox(request, timeout=60)).sandbox

    async def destroy(self, sandbox_id: str) -> None:
        await self.stub.DestroySandbox(pb.DestroySandboxRequest(sandbox_id=sandbox_id), timeout=60)

    async def images(self) -> dict[str, pb.Image]:
        """repo tag -> Image."""
        listing = await self.stub.ListImages(pb.ListImagesRequest(), timeout=30)
        return {tag: image for image in listing.images for tag in image.repo_tags}

    async def info(self) -> pb.GetNodeInfoResponse:
        return await self.stub.GetNodeInfo(pb.GetNodeInfoRequest(), timeout=30)

    async def close(self) -> None:
        """Stops the node (its sandboxes destroyed first); a second call does nothing."""
        if self.closed:
            return
        self.closed = True
        manager = self.node.manager
        for record in list(manager.list_sandboxes({})):
            await manager.destroy(record.sandbox_id)
        await self.channel.close()
        await self.node.stop(0)


def cache_settings(state_dir: Path, docker_host: str, **overrides) -> ExecSettings:
    values = dict(
        host="127.0.0.1",
        port=0,
        auth_token=TOKEN,
        node_id="cache-" + uuid.uuid4().hex[:8],
        state_dir=state_dir,
        docker_host=docker_host,
        default_memory_bytes=256 << 20,
        drain_grace_s=0.5,
        image_pull_retry_wait_s=0.2,
    )
    values.update(overrides)
    return ExecSettings(**values)


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
        await asyncio.to_thread(_reset_images, second_dockerd, base_image)


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
        await asyncio.to_thread(_reset_images, second_dockerd, base_image)
