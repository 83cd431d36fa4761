"""An await with a time bound that never loses the awaiting task's cancellation.

`asyncio.wait_for` in Python 3.10 and 3.11 returns the inner result when its task is cancelled
in the same loop iteration as the inner future finishes (CPython gh-86296; 3.12 rebuilt it). A
background loop bounded that way can miss its stop and run on: an exec node's docker-health loop
did, and its server's shutdown waited for it until the test timed out. `within` waits on the
inner task with `asyncio.wait`, which never takes a cancel for a result: a cancel from outside
always reaches the caller, and only the bound's own expiry is a TimeoutError. Every bounded await
of swerl goes through it (tests/chassis/test_chassis_bounded.py holds the code to that).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def within(aw: Awaitable[T], timeout_s: float | None) -> T:
    """Awaits `aw`; after `timeout_s` (None: no bound) cancels it and raises TimeoutError
    (`asyncio.TimeoutError`, the builtin one from 3.11). Cancelled from outside, it cancels `aw`,
    waits for it to end and raises CancelledError, whatever `aw` did meanwhile."""
    inner = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait({inner}, timeout=timeout_s)
    except asyncio.CancelledError:
        await _cancel_and_settle(inner)
        raise
    if not done:
        await _cancel_and_settle(inner)
        raise asyncio.TimeoutError
    return inner.result()


async def _cancel_and_settle(inner: asyncio.Future[T]) -> None:
    """Cancels `inner` and waits for it to end; an error it ended with is taken (the caller's
    cancel or timeout is what is raised), so none is reported as never retrieved."""
    inner.cancel()
    await asyncio.wait({inner})
    if not inner.cancelled():
        inner.exception()
