"""swerl.chassis.bounded: a bounded await keeps the cancel that wait_for loses before Python 3.12.

The race is made exact: the inner future gets its result and the awaiting task its cancel in one
loop iteration, before the task runs again. With 3.11's `asyncio.wait_for` the task then returns
the result and runs on (a background loop built that way never stops); `within` raises
CancelledError. And no module of swerl awaits through `asyncio.wait_for` again.
"""

from __future__ import annotations

import ast
import asyncio
import sys
from pathlib import Path

import pytest

from swerl.chassis.bounded import within

ROOT = Path(__file__).resolve().parents[2]


async def _cancelled_as_it_finishes(bound) -> str:
    """What a task bounded by `bound` did when its inner future finished as it was cancelled."""
    inner: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    outcome: list[str] = []

    async def waiter() -> None:
        try:
            outcome.append(await bound(inner, 10.0))
        except asyncio.CancelledError:
            outcome.append("cancelled")
            raise

    task = asyncio.ensure_future(waiter())
    await asyncio.sleep(0)  # the task is now parked on the bounded await
    inner.set_result("result")
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert len(outcome) == 1
    return outcome[0]


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="3.12's wait_for keeps the cancel")
async def test_python_311_wait_for_loses_a_cancel_that_races_its_result():
    # The fault `within` exists for, shown on the interpreter swerl runs on.
    assert await _cancelled_as_it_finishes(asyncio.wait_for) == "result"


async def test_within_keeps_a_cancel_that_races_its_result():
    assert await _cancelled_as_it_finishes(within) == "cancelled"


async def test_within_times_out_and_cancels_what_it_waited_on():
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    with pytest.raises(TimeoutError):
        await within(never, 0.05)
    assert never.cancelled()


async def test_within_cancelled_from_outside_cancels_what_it_waited_on():
    started = asyncio.Event()
    ended: list[str] = []

    async def slow() -> None:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            ended.append("cancelled")
            raise

    task = asyncio.ensure_future(within(slow(), 30.0))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ended == ["cancelled"]


async def test_within_passes_on_the_error_of_what_it_waited_on():
    async def broken() -> None:
        raise ValueError("inner")

    with pytest.raises(ValueError, match="inner"):
        await within(broken(), 1.0)


async def test_within_returns_the_result_and_none_means_unbounded():
    async def answer() -> int:
        await asyncio.sleep(0.01)
        return 42

    assert await within(answer(), 1.0) == 42
    assert await within(answer(), None) == 42


def test_no_module_of_swerl_awaits_through_asyncio_wait_for():
    found = []
    for folder in ("swerl", "services", "trainer_plugin"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if (
                    isinstance(node, ast.Attribute)
                    and node.attr == "wait_for"
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "asyncio"
                ):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == [], f"use swerl.chassis.bounded.within instead: {found}"
