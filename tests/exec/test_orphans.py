"""A container of the node that no sandbox accounts for is removed by the reaper.

create_and_start removes its container when the start fails; when dockerd goes away between the
create and the start, that removal fails too and a created, never started container is left
with the node's labels and no record. The soak's dockerd restart left exactly that behind.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import docker
from testkit.exec import container_exists


def _create_unstarted(image: str, node_id: str, sandbox_id: str, created: float) -> None:
    client = docker.from_env()
    try:
        client.api.create_container(
            image,
            command=["sleep", "infinity"],
            name=f"swerl-{sandbox_id}",
            labels={
                "swerl.managed": "1",
                "swerl.node": node_id,
                "swerl.sandbox_id": sandbox_id,
                "swerl.create_time": f"{created:.3f}",
            },
        )
    finally:
        client.close()


async def test_container_left_by_a_failed_create_is_removed_after_the_grace(
    node_factory, base_image
):
    node = await node_factory(reap_interval_s=0.3, orphan_grace_s=2.0)
    node_id = node.node.settings.node_id
    kept = await node.create(base_image)
    orphan = "sbx-orphan" + uuid.uuid4().hex[:10]
    await asyncio.to_thread(_create_unstarted, base_image, node_id, orphan, time.time())

    # Within the grace it is left alone: a create still in flight looks the same.
    await asyncio.sleep(1.0)
    assert await container_exists(orphan)
    began = time.monotonic()
    while await container_exists(orphan):
        assert time.monotonic() - began < 10, "orphan container not removed"
        await asyncio.sleep(0.2)

    # The sandbox the node does account for is untouched.
    assert await container_exists(kept.sandbox_id)
    assert (await node.client.run(kept.sandbox_id, "echo alive")).stdout == b"alive\n"


async def test_a_container_of_another_node_is_never_touched(node_factory, base_image):
    node = await node_factory(reap_interval_s=0.3, orphan_grace_s=0.5)
    other = "sbx-other" + uuid.uuid4().hex[:10]
    other_node = "test-other-" + uuid.uuid4().hex[:8]
    await asyncio.to_thread(_create_unstarted, base_image, other_node, other, time.time() - 600)
    try:
        await asyncio.sleep(2.0)  # several reaper rounds past the grace
        assert await container_exists(other)
    finally:
        client = docker.from_env()
        client.containers.get(f"swerl-{other}").remove(force=True)
        client.close()
    assert node.node.manager.live_count == 0
