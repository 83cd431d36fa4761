"""`swerl demo`'s harness episode (`harness_tour`) on the real stack, as the demo runs it: real
dockerd, pool, exec node and an in-process agent with its gateway, the real mini-swe-agent, and
the replay policy (the real Qwen3 tokenizer) playing one bundled task's gold fix. The tour must
say resolved with exact samples, and its folder must be one `swerl inspect` shows with the
episode's session tree; a wrong fix must not pass as resolved."""

from __future__ import annotations

from pathlib import Path

import pytest
from testkit.agent import agent_stack, bundled_tasks, sandboxes_left
from testkit.gateway import TOKENIZER

from swerl.demo import HARNESS, harness_tour
from swerl.devservers.replay import ReplayPolicyServer, scripts_for_tasks
from swerl.web.runs import Run

pytestmark = pytest.mark.usefixtures("base_image")


async def _tour(task, variant: str) -> tuple[bool, str, str]:
    replay = ReplayPolicyServer(
        scripts_for_tasks([task], variant, harness=HARNESS), keep_requests=True
    )
    url = await replay.start()
    try:
        async with agent_stack() as env:
            ok, report = await harness_tour(
                env.stub, task, url, TOKENIZER, replay.stats.requests_seen
            )
            (node,) = env.stack.nodes
            node_id = str(node.settings.node_id)
    finally:
        await replay.stop()
    return ok, report, node_id


async def test_the_demos_harness_episode_resolves_with_exact_samples_and_its_tree():
    task = bundled_tasks()[1]
    ok, report, node = await _tour(task, "gold")
    assert ok, report
    assert f"mini-swe-agent on {task.instance_id}: SUBMITTED reward +1" in report
    assert "5 gateway calls -> 1 chain(s)" in report and "returned: yes" in report
    # The folder it names is a run `swerl inspect` reads, with the episode's session tree.
    folder = Path(report.split("swerl inspect ", 1)[1].strip())
    run = Run.open(folder)
    (summary,) = run.index
    assert summary.status == "SUBMITTED" and summary.reward == 1.0
    tree = run.detail(summary.key)["session"]
    assert [(r.index, r.kind) for r in tree.rows] == [(0, "root")] + [
        (i, "extend") for i in range(1, 5)
    ]
    assert (summary.artifact_dir / "harness.log").exists()
    assert sandboxes_left(node) == []


async def test_the_demos_harness_episode_fails_the_demo_on_a_wrong_fix():
    task = bundled_tasks()[1]
    ok, report, node = await _tour(task, "wrong")
    assert not ok, report
    assert "SUBMITTED reward -1" in report
    assert sandboxes_left(node) == []
