"""The replay policy's injected faults (`/fault`), which the soak uses to make the policy answer
500 or hang: what a policy client sees during a window and after it."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from swerl.agent.policy.clients import PolicyUnavailable, SglangPolicy
from swerl.devservers.replay import ReplayPolicyServer, scripts_for_tasks
from swerl.tasks import default_tasks_dir, load_tasks


@pytest.fixture
async def replay():
    server = ReplayPolicyServer(
        scripts_for_tasks(load_tasks(default_tasks_dir())), fault_control=True
    )
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
async def session():
    async with aiohttp.ClientSession() as session:
        yield session


async def _fault(session: aiohttp.ClientSession, url: str, body: object) -> int:
    async with session.post(url + "/fault", json=body) as reply:
        return reply.status


def _policy(session: aiohttp.ClientSession, url: str, timeout_s: float = 5.0) -> SglangPolicy:
    # One attempt: these tests see each answer of the window (the client's retries of a failing
    # policy are tests/agent/test_policy_retries.py's).
    return SglangPolicy(
        session, url, {"temperature": 1.0}, request_timeout_s=timeout_s, connect_attempts=1
    )


async def test_an_error_window_answers_500_and_the_policy_client_says_policy_error(
    replay, session
) -> None:
    assert await _fault(session, replay.url, {"mode": "error", "duration_s": 30}) == 200
    with pytest.raises(PolicyUnavailable) as caught:
        await _policy(session, replay.url).generate([1, 2, 3], 16)
    assert caught.value.reason == "POLICY_ERROR"
    assert "HTTP 500" in str(caught.value)
    # "none" ends the window early; the next call is answered.
    assert await _fault(session, replay.url, {"mode": "none"}) == 200
    generation = await _policy(session, replay.url).generate([1, 2, 3], 16)
    assert generation.output_ids


async def test_a_hang_window_holds_calls_past_the_client_timeout_then_answers(
    replay, session
) -> None:
    assert await _fault(session, replay.url, {"mode": "hang", "duration_s": 2.0}) == 200
    started = time.monotonic()
    with pytest.raises(PolicyUnavailable) as caught:
        await _policy(session, replay.url, timeout_s=0.5).generate([1, 2, 3], 16)
    assert caught.value.reason == "POLICY_UNAVAILABLE"
    assert time.monotonic() - started < 1.5
    # A caller that waits longer than the window gets its answer when the window ends.
    generation = await _policy(session, replay.url, timeout_s=10).generate([1, 2, 3], 16)
    assert generation.output_ids
    assert time.monotonic() - started >= 1.9


@pytest.mark.parametrize(
    "body",
    [{"mode": "explode", "duration_s": 1}, {"duration_s": 1}, {"mode": "hang", "duration_s": -1}],
    ids=["unknown-mode", "no-mode", "negative"],
)
async def test_a_bad_fault_request_is_refused_and_injects_nothing(replay, session, body) -> None:
    assert await _fault(session, replay.url, body) == 400
    generation = await _policy(session, replay.url).generate([1, 2, 3], 16)
    assert generation.output_ids


async def test_without_fault_control_there_is_no_fault_endpoint(session) -> None:
    server = ReplayPolicyServer({})
    url = await server.start()
    try:
        assert await _fault(session, url, {"mode": "error", "duration_s": 5}) == 404
    finally:
        await server.stop()


async def test_a_fault_window_ends_by_itself(replay, session) -> None:
    replay.inject_fault("error", 0.3)
    with pytest.raises(PolicyUnavailable):
        await _policy(session, replay.url).generate([1, 2, 3], 16)
    await asyncio.sleep(0.4)
    assert (await _policy(session, replay.url).generate([1, 2, 3], 16)).output_ids
