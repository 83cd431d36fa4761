"""Pacing for hundreds of episodes on one event loop.

A loop iteration runs every callback that was ready when it began. Episodes that move in step
(a rollout batch started together, commands and policy calls of equal length) become ready in
the same iteration, and their set-up or final-result steps then run back to back while every
other episode's I/O waits: one iteration of ~200 such steps stalled the loop for 10-20 ms.
"""

from __future__ import annotations

import asyncio


class IterationGate:
    """Lets at most `size` callers through per event-loop iteration; the rest wait their turn."""

    def __init__(self, size: int) -> None:
        self._slots = asyncio.Semaphore(size)

    async def wait_turn(self) -> None:
        await self._slots.acquire()
        # Released in the next iteration: whoever passed this one has run its step by then.
        asyncio.get_running_loop().call_soon(self._slots.release)
