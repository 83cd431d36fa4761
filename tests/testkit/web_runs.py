"""The real runs the browser tests show, made by real episodes: the replay policy with the real
Qwen3 tokenizer, a pool and exec node on the real dockerd, and an agent (the `real_run` and
`trimmed_run` fixtures of tests/web/conftest.py); and Debian's chromium with its chromedriver."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from swerl.agent.server import local_agent
from swerl.agent.v1 import agent_pb2 as pb
from swerl.agent.v1 import agent_pb2_grpc
from swerl.chassis.client import make_channel
from swerl.devservers.replay import ReplayPolicyServer, scripts_for_tasks
from swerl.stack import local_stack
from swerl.tasks import default_tasks_dir, load_tasks
from testkit.web import run_episode, start_message

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
# The tasks that get a wrong patch (reward -1) in the generated run; all get a gold one.
WRONG = 2


async def produce_runs(run_dir: Path, dynamic_dir: Path, trimmed_dir: Path) -> None:
    """The episodes behind the `real_run` and `trimmed_run` fixtures, each checked on the way:
    every bundled task with a gold patch and the first WRONG with a wrong one, one dynamic-history
    episode, and two whose context is trimmed (a 4,096-token window)."""
    tasks = load_tasks(default_tasks_dir())
    gold = ReplayPolicyServer(scripts_for_tasks(tasks, "gold"))
    wrong = ReplayPolicyServer(scripts_for_tasks(tasks[:WRONG], "wrong"))
    # Twelve long outputs in a 4,096-token window: the context is trimmed on the way.
    key = next(iter(scripts_for_tasks(tasks[:1])))
    looks = ReplayPolicyServer(
        {key: [f"Looking.\n\n```bash\nseq {i} {i + 150}\n```" for i in range(12)]}
    )
    gold_url, wrong_url, looks_url = await gold.start(), await wrong.start(), await looks.start()
    try:
        async with local_stack(nodes=1, max_sandboxes=6, purpose="web-test") as stack:
            async with local_agent(stack.pool_address, stack.token, tokenizer_processes=0) as agent:
                channel = make_channel(agent.address, token=stack.token)
                stub = agent_pb2_grpc.AgentServiceStub(channel)
                starts = [
                    start_message(t, gold_url, f"gold-{i}", str(run_dir))
                    for i, t in enumerate(tasks)
                ]
                starts += [
                    start_message(t, wrong_url, f"wrong-{i}", str(run_dir))
                    for i, t in enumerate(tasks[:WRONG])
                ]
                starts.append(
                    start_message(tasks[0], gold_url, "dynamic-0", str(dynamic_dir), dynamic=True)
                )
                for dynamic in (False, True):
                    trimmed = start_message(
                        tasks[0],
                        looks_url,
                        f"trim-{int(dynamic)}",
                        str(trimmed_dir),
                        dynamic=dynamic,
                    )
                    trimmed.limits.max_turns = 12
                    trimmed.limits.max_context_tokens = 4096
                    trimmed.limits.max_new_tokens = 512
                    starts.append(trimmed)
                limit = asyncio.Semaphore(4)

                async def one(start: pb.EpisodeStart) -> pb.EpisodeResult:
                    async with limit:
                        return await run_episode(stub, start)

                results = await asyncio.gather(*(one(s) for s in starts))
                await channel.close()
    finally:
        await gold.stop()
        await wrong.stop()
        await looks.stop()
    failed = [
        (r.episode_id, r.error_reason, r.error_message)
        for r in results
        if r.status
        != (
            pb.EPISODE_STATUS_LIMIT_TURNS
            if r.episode_id.startswith("trim-")
            else pb.EPISODE_STATUS_SUBMITTED
        )
        or not r.artifact_dir
    ]
    assert not failed, failed
    # tokens.json holds the result's token records as they are
    for result in results:
        written = json.loads((Path(result.artifact_dir) / "tokens.json").read_text())
        records = [result.trajectory] if result.HasField("trajectory") else list(result.turns)
        stored = [written["trajectory"]] if written["trajectory"] else written["turns"]
        assert len(stored) == len(records)
        for record, saved in zip(records, stored, strict=True):
            assert saved["prompt_ids"] == list(record.prompt_ids)
            assert saved["response_ids"] == list(record.response_ids)
            assert saved["loss_mask"] == list(record.loss_mask)
            assert saved["logprobs"] == pytest.approx(list(record.logprobs), abs=1e-4)
