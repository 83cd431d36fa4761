"""The Agent's client: whatever goes wrong, a FAILED verdict naming the cause, and the caller
goes on."""

from __future__ import annotations

import asyncio
import time

from testkit.prm import make_step

from swerl.chassis.client import make_channel
from swerl.devservers.scripted_prm import HANG, Rule, verdict
from swerl.prm.client import PrmClient
from swerl.prm.votes import JudgeState


async def test_an_unreachable_prm_service_gives_a_failed_verdict_within_the_limit(unused_tcp_port):
    channel = make_channel(f"127.0.0.1:{unused_tcp_port}")
    try:
        started = time.monotonic()
        result = await PrmClient(channel).judge_step(make_step(), timeout_s=2)
        elapsed = time.monotonic() - started
    finally:
        await channel.close()

    assert result.state is JudgeState.FAILED
    assert "UNAVAILABLE" in result.error_message
    assert elapsed < 6


async def test_a_judgment_past_the_callers_limit_fails_that_step_and_the_next_one_scores(
    scripted, prm
):
    judge = await scripted(rules=[Rule("SLOW-STEP", [HANG])], default=[verdict(1)])
    running = await prm(judge.url, request_timeout_s=60)

    started = time.monotonic()
    slow = await running.client.judge_step(make_step("echo SLOW-STEP"), votes=1, timeout_s=0.5)
    elapsed = time.monotonic() - started
    fine = await running.client.judge_step(make_step("ls"), votes=1, timeout_s=10)

    assert slow.state is JudgeState.FAILED
    assert "DEADLINE_EXCEEDED" in slow.error_message
    assert elapsed < 5
    assert fine.state is JudgeState.SCORED
    # The abandoned judgment gave its slot back and its hung HTTP call was cancelled.
    for _ in range(100):
        if running.server.judge.in_flight == 0 and judge.in_flight == 0:
            break
        await asyncio.sleep(0.02)
    assert (running.server.judge.in_flight, judge.in_flight) == (0, 0)


async def test_a_refused_request_gives_a_failed_verdict_with_code_and_reason(scripted, prm):
    judge = await scripted()
    running = await prm(judge.url)

    result = await running.client.judge_step(make_step(issue=""), votes=1)

    assert result.state is JudgeState.FAILED
    assert "INVALID_ARGUMENT/ISSUE_MISSING" in result.error_message
