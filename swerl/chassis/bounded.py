"""An await with a time bound that never loses the awaiting task's cancellation.

Python 3.11's `asyncio.wait_for` returns the inner result when its task is cancelled in the
same loop iteration as the inner future finishes (CPython gh-86296; 3.12 rebuilt `wait_for` on
`asyncio.timeout`). A background loop bounded that way can miss its stop and run on: an exec
node's docker-health loop did, and its server's shutdown waited for it until the test timed out.
`within` bounds the await with `asyncio.timeout`, which counts cancellations per task, so a
cancel from outside always reaches the caller and only the bound's own expiry is a TimeoutError.
Every bounded await of swerl goes through it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def within(aw: Awaitable[T], timeout_s: float | None) -> T:
    """Awaits `aw`; raises TimeoutError (and cancels it) after `timeout_s` (None: no bound)."""
    async with asyncio.timeout(timeout_s):
        return await aw
