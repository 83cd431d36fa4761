"""A policy call that fails for a reason a later attempt can cure is sent again, as the trainers'
own client sends a failed /generate again (slime/utils/http_utils.py:165-191 at 624b824a): a
connection failure, HTTP 500/502/503/504, no answer within the request's timeout. A fault shorter
than the retry time costs the episode seconds; one that outlasts it ends the call with the last
failure (issue 24: the soak's policy faults each failed every episode that called meanwhile).
Real SglangPolicy and OpenAIChatPolicy against the replay server's injected faults."""

from __future__ import annotations

import contextlib
import time
from array import array
from collections.abc import AsyncIterator

import aiohttp
import pytest

from swerl.agent.policy.clients import PolicyUnavailable, SglangPolicy, policy_retrying
from swerl.devservers.replay import ReplayPolicyServer

PROMPT = array("i", range(1, 40))


async def _generate(url: str, *, timeout_s: float = 30.0, retry_s: float = 10.0, attempts=12):
    async with aiohttp.ClientSession() as session:
        policy = SglangPolicy(
            session,
            url,
            {},
            request_timeout_s=timeout_s,
            retrying=policy_retrying(attempts, retry_s),
        )
        return await policy.generate(PROMPT, 8)


@contextlib.asynccontextmanager
async def _faulty(mode: str, window_s: float) -> AsyncIterator[tuple[ReplayPolicyServer, str]]:
    """A replay policy whose every /generate fails as `mode` says for `window_s` from now."""
    replay = ReplayPolicyServer({}, fault_control=True)
    url = await replay.start()
    try:
        replay.inject_fault(mode, window_s)
        yield replay, url
    finally:
        await replay.stop()


@pytest.mark.parametrize(("mode", "timeout_s"), [("error", 30.0), ("hang", 0.5)])
async def test_a_policy_fault_shorter_than_the_retry_time_costs_the_call_only_time(
    mode: str, timeout_s: float
) -> None:
    async with _faulty(mode, 1.5) as (replay, url):
        began = time.monotonic()
        reply = await _generate(url, timeout_s=timeout_s)
        took = time.monotonic() - began
    assert reply.output_ids and len(reply.logprobs) == len(reply.output_ids)
    assert 1.4 < took < 8.0, took
    if mode == "error":  # (a held request is answered at the window's end, its caller gone)
        assert replay.stats.requests == 1, "answered once, after the window"


async def test_a_policy_failing_past_the_retry_time_is_a_policy_error_naming_the_status() -> None:
    async with _faulty("error", 60) as (_, url):
        began = time.monotonic()
        with pytest.raises(PolicyUnavailable) as caught:
            await _generate(url, retry_s=1.0)
        took = time.monotonic() - began
    assert caught.value.reason == "POLICY_ERROR"
    assert "HTTP 500" in caught.value.message and "injected policy fault" in caught.value.message
    assert 1.0 <= took < 5.0, took


async def test_a_hang_past_the_retry_time_is_policy_unavailable() -> None:
    # (The server holds each request to the window's end, and its stop waits for them.)
    async with _faulty("hang", 4) as (_, url):
        with pytest.raises(PolicyUnavailable) as caught:
            await _generate(url, timeout_s=0.3, retry_s=1.0)
    assert caught.value.reason == "POLICY_UNAVAILABLE"
    assert "TimeoutError" in caught.value.message


async def test_one_attempt_means_no_retry_and_4xx_is_never_retried() -> None:
    async with _faulty("error", 60) as (replay, url):
        began = time.monotonic()
        with pytest.raises(PolicyUnavailable) as once:
            await _generate(url, attempts=1)
        assert time.monotonic() - began < 1.0
        replay.inject_fault("none", 0)
        began = time.monotonic()
        with pytest.raises(PolicyUnavailable) as refused:
            await _generate(url + "/nowhere")  # HTTP 404: the same answer next time
        assert time.monotonic() - began < 1.0
    assert once.value.reason == refused.value.reason == "POLICY_ERROR"
    assert "HTTP 404" in refused.value.message
