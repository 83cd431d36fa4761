"""SGLang's own refusals are not infrastructure (issue 23, item 6): a prompt over the engine's
context length comes back as HTTP 400 (SGLang tokenizer_manager.py `_validate_one_request`),
which is the episode's context limit; an abort reply without logprob fields is an aborted turn.
Real SglangPolicy against the replay server, which refuses over-long requests as SGLang does."""

from __future__ import annotations

import json
from array import array

import aiohttp
import pytest

from swerl.agent.policy.clients import (
    PolicyUnavailable,
    SglangPolicy,
    over_context_length,
    parse_generate_reply,
)
from swerl.agent.policy.context import ContextExhausted
from swerl.devservers.replay import ReplayPolicyServer


@pytest.mark.parametrize(("prompt_len", "max_new"), [(100, 8), (90, 20)])
async def test_a_prompt_over_the_engines_context_length_is_the_context_limit(
    prompt_len: int, max_new: int
) -> None:
    replay = ReplayPolicyServer({}, context_length=100)
    url = await replay.start()
    try:
        async with aiohttp.ClientSession() as session:
            policy = SglangPolicy(session, url, {}, request_timeout_s=30)
            fits = await policy.generate(array("i", range(1, 60)), 8)
            with pytest.raises(ContextExhausted, match="context length"):
                await policy.generate(array("i", range(1, prompt_len + 1)), max_new)
    finally:
        await replay.stop()
    assert fits.output_ids
    assert replay.stats.requests == 1, "refused before any answer"


async def test_the_schedulers_input_length_refusal_is_the_context_limit() -> None:
    """Issue 41 point 3: a KV pool smaller than the context makes SGLang's scheduler refuse
    "Input length (N tokens) exceeds the maximum allowed length (M tokens)" with HTTP 400; the
    client reads it as the context limit (before: POLICY_ERROR, so INFRA_ERROR and a re-run)."""
    replay = ReplayPolicyServer({}, max_req_input_len=80)
    url = await replay.start()
    try:
        async with aiohttp.ClientSession() as session:
            policy = SglangPolicy(session, url, {}, request_timeout_s=30)
            fits = await policy.generate(array("i", range(1, 80)), 64)
            with pytest.raises(ContextExhausted, match="exceeds the maximum allowed length"):
                await policy.generate(array("i", range(1, 81)), 8)
    finally:
        await replay.stop()
    assert fits.output_ids, "79 tokens fit a bound of 80, whatever max_new_tokens"


async def test_other_refusals_stay_policy_errors() -> None:
    replay = ReplayPolicyServer({})
    url = await replay.start()
    try:
        async with aiohttp.ClientSession() as session:
            # A path the engine does not serve (HTTP 404): a policy error, not a context limit.
            policy = SglangPolicy(session, url + "/nowhere", {}, request_timeout_s=30)
            with pytest.raises(PolicyUnavailable) as caught:
                await policy.generate(array("i", [1, 2]), 8)
    finally:
        await replay.stop()
    assert caught.value.reason == "POLICY_ERROR" and "HTTP 404" in str(caught.value)
    assert not over_context_length(b'{"error": {"message": "bad sampling params"}}')


def test_an_abort_reply_without_logprob_fields_is_an_aborted_turn() -> None:
    body = json.dumps({"text": "", "meta_info": {"finish_reason": {"type": "abort"}}})
    gen = parse_generate_reply(body.encode(), top_p=True, routed_experts=True)
    assert gen.finish_reason == "abort" and gen.output_ids == [] and gen.logprobs == []


def test_a_finished_reply_without_logprob_fields_is_still_a_bad_reply() -> None:
    body = json.dumps({"text": "x", "meta_info": {"finish_reason": {"type": "stop"}}})
    with pytest.raises(PolicyUnavailable) as caught:
        parse_generate_reply(body.encode())
    assert caught.value.reason == "POLICY_BAD_REPLY"
