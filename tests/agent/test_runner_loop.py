"""The runner keeps the shared event loop responsive: bursts of starts are spread over loop
iterations, records are built one episode at a time, and the collector's full passes are spaced
out once the tokenizer is loaded."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections import Counter

import pytest
from testkit.agent import (
    TOKENIZER_DIR,
    LoopIterations,
    agent_stack,
    bundled_tasks,
    check_record,
    result_of,
    run_to_result,
    start_for,
)

from swerl.agent.loop.episode import Episode
from swerl.agent.loop.pacing import IterationGate
from swerl.agent.loop.runner import EpisodeRunner
from swerl.agent.settings import AgentSettings
from swerl.agent.v1 import agent_pb2 as pb
from swerl.devservers.replay import ReplayPolicyServer, scripts_for_tasks


async def test_a_burst_of_starts_passes_the_gate_a_few_per_loop_iteration() -> None:
    gate = IterationGate(4)
    passed_at: list[int] = []

    async with LoopIterations() as iterations:

        async def start() -> None:
            await gate.wait_turn()
            passed_at.append(iterations.now)

        await asyncio.gather(*(start() for _ in range(40)))
    assert len(passed_at) == 40
    assert max(Counter(passed_at).values()) <= 4


async def test_full_collections_are_spaced_once_the_tokenizer_is_loaded() -> None:
    before = gc.get_threshold()
    settings = AgentSettings(
        insecure=True, port=0, tokenizer_processes=0, gc_full_threshold=77, log_level="warning"
    )
    runner = EpisodeRunner(settings, provider=None)  # type: ignore[arg-type]
    try:
        await runner.codec(TOKENIZER_DIR, {})
        assert gc.get_threshold() == (before[0], before[1], 77)
        assert gc.get_freeze_count() > 0
    finally:
        await runner.close()
        gc.unfreeze()
        gc.set_threshold(*before)


@pytest.mark.usefixtures("base_image")
async def test_episodes_ending_together_build_their_records_one_at_a_time(monkeypatch) -> None:
    # Record jobs queued together in the CPU pool kept the loop thread off the GIL.
    tasks = bundled_tasks()[:3]
    lock = threading.Lock()
    running, most = 0, 0
    fill = Episode._fill_records

    def tracked(self: Episode, result: pb.EpisodeResult) -> None:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        try:
            time.sleep(0.05)
            fill(self, result)
        finally:
            with lock:
                running -= 1

    monkeypatch.setattr(Episode, "_fill_records", tracked)
    replay = ReplayPolicyServer(scripts_for_tasks(tasks, "gold"))
    url = await replay.start()
    try:
        async with agent_stack(cpu_threads=4) as env:
            starts = [start_for(t, url, f"slot-{i}") for i, t in enumerate(tasks)]
            runs = await asyncio.gather(*(run_to_result(env.stub, s) for s in starts))
    finally:
        await replay.stop()
    for messages in runs:
        result = result_of(messages)
        assert result.status == pb.EPISODE_STATUS_SUBMITTED, result
        check_record(result.trajectory, replay)
    assert most == 1
