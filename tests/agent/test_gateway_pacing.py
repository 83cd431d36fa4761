"""The gateway under a burst of calls: each event-loop iteration runs only a few of the calls'
steps, and its CPU pool is one thread (real HTTP, the real `openai` SDK, the
replay policy and the real Qwen3 tokenizer)."""

from __future__ import annotations

import asyncio
import collections
import threading

from testkit.agent import LoopIterations
from testkit.gateway import BASH_TOOL, KEY, async_client, gateway_env

from swerl.agent.gateway.service import local_gateway
from swerl.agent.gateway.session import GATEWAY_TURNS
from swerl.agent.loop.pacing import IterationGate
from swerl.agent.settings import GATEWAY_CPU_THREADS


class _Counted(IterationGate):
    """The gate, noting the loop iteration in which each caller got through."""

    def __init__(self, size: int, iterations: LoopIterations) -> None:
        super().__init__(size)
        self._iterations = iterations
        self.passes: list[int] = []

    async def wait_turn(self) -> None:
        await super().wait_turn()
        self.passes.append(self._iterations.now)


async def _burst(size: int, sessions: int = 24) -> list[int]:
    """`sessions` concurrent first calls; the iterations their gated steps ran in."""
    async with gateway_env({KEY: ["Nothing to do."]}) as env:
        opened = [await env.open() for _ in range(sessions)]
        clients = [
            async_client(base_url=env.openai_url(s), api_key=s.secret, max_retries=0)
            for s in opened
        ]
        async with LoopIterations() as iterations:
            gate = env.gateway.store.turns = _Counted(size, iterations)
            replies = await asyncio.gather(
                *(
                    c.chat.completions.create(
                        model="m",
                        messages=[{"role": "user", "content": f"{KEY}: look"}],
                        tools=[BASH_TOOL],
                    )
                    for c in clients
                )
            )
        assert [r.choices[0].message.content for r in replies] == ["Nothing to do."] * sessions
        return gate.passes


async def test_a_burst_of_calls_runs_at_most_a_few_gateway_steps_per_loop_iteration() -> None:
    passes = await _burst(GATEWAY_TURNS)
    # Each call waits its turn three times: its request read and matched, its policy request
    # sent, its answer recorded and written.
    assert len(passes) == 3 * 24
    assert max(collections.Counter(passes).values()) <= GATEWAY_TURNS
    # The same burst with a gate that never holds anyone back runs more than that in one
    # iteration: the burst is real, and the bound above is the gate's doing.
    unbounded = await _burst(1000)
    assert max(collections.Counter(unbounded).values()) > GATEWAY_TURNS


async def test_the_gateways_cpu_pool_is_one_thread() -> None:
    async with local_gateway() as gateway:
        executor = gateway._executor
        loop = asyncio.get_running_loop()
        threads = {await loop.run_in_executor(executor, threading.get_ident) for _ in range(8)}
        assert len(threads) == GATEWAY_CPU_THREADS == 1
