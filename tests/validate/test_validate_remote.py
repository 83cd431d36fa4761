"""`swerl validate --node`: the checks run on a running exec node, through its client."""

from __future__ import annotations

import asyncio

from testkit.exec import TOKEN, node_settings, start_node

from swerl.tasks import build_images, default_tasks_dir, load_tasks
from swerl.validate import render, run_remote

TASK = "swerl-examples__semverlite-41"


async def test_validate_on_a_running_node_passes_a_sound_task(tmp_path, base_image):
    tasks = [t for t in load_tasks(default_tasks_dir()) if t.instance_id == TASK]
    await asyncio.to_thread(build_images, tasks, base_image=base_image)
    running = await start_node(node_settings(tmp_path))
    try:
        checks = await run_remote(
            tasks, node=running.address, token=TOKEN, concurrency=2, timeout_s=300
        )
    finally:
        await running.channel.close()
        await running.node.stop(0)
    expected = ["empty", "gold", "unpatched", *(["wrong"] if tasks[0].wrong_patch else [])]
    assert sorted(c.kind for c in checks) == sorted(expected)
    assert all(c.ok for c in checks), render(checks)
