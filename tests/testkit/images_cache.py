"""The image-cache tests' exec nodes on the second dockerd (tests/images_cache/conftest.py
starts them): a node with its client (`CacheNode`), its settings, and the reset that leaves the
second dockerd with the base image only, so every test starts cold."""

from __future__ import annotations

import uuid
from pathlib import Path

from swerl.chassis.client import make_channel
from swerl.exec.client import SandboxClient
from swerl.exec.server import ExecNode
from swerl.exec.settings import ExecSettings
from swerl.exec.v1 import sandbox_pb2 as pb
from swerl.tasks import default_tasks_dir, load_tasks
from testkit.dockerd import Dockerd

TOKEN = "cache-test-token"
BUNDLED_TASKS = load_tasks(default_tasks_dir())


def reset_images(dockerd: Dockerd, keep: str) -> None:
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
