"""The runner keeps the shared event loop responsive: bursts of starts are spread over loop
iterations, and the collector's full passes are spaced out once the tokenizer is loaded."""

from __future__ import annotations

import asyncio
import gc
from collections import Counter

from agent_testkit import TOKENIZER_DIR

from swerl.agent.runner import EpisodeRunner, IterationGate
from swerl.agent.settings import AgentSettings


async def test_a_burst_of_starts_passes_the_gate_a_few_per_loop_iteration() -> None:
    gate = IterationGate(4)
    iteration = 0
    done = False
    passed_at: list[int] = []

    async def count_iterations() -> None:
        nonlocal iteration
        while not done:
            await asyncio.sleep(0)  # one step per loop iteration
            iteration += 1

    async def start() -> None:
        await gate.wait_turn()
        passed_at.append(iteration)

    counter = asyncio.ensure_future(count_iterations())
    await asyncio.gather(*(start() for _ in range(40)))
    done = True
    await counter
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
