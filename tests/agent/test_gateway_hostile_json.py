"""Pathological JSON is a 400 naming the problem, in each protocol's shape: nesting deeper than
the decoder goes (in any field, in Anthropic content, after a reused prefix), tool arguments and
tool schemas nested past what the template may write, lone surrogate escapes."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import openai
import pytest
from testkit.gateway import KEY, gateway_env
from testkit.gateway_hostile import no_call_failed, openai_session, post_raw

from swerl.agent.gateway.messages import MAX_JSON_DEPTH

DEEP = "[" * 100_000 + "]" * 100_000


def _nested(levels: int) -> Any:
    value: Any = {}
    for _ in range(levels):
        value = {"a": value}
    return value


def _openai_deep_field() -> bytes:
    head = json.dumps({"model": "m", "messages": [{"role": "user", "content": KEY}]})
    return (head[:-1] + f', "metadata": {DEEP}}}').encode()


def _anthropic_deep_content() -> bytes:
    head = json.dumps({"model": "m", "max_tokens": 16, "messages": []})[: -len("]}")]
    return (head + f'{{"role": "user", "content": {DEEP}}}]}}').encode()


@pytest.mark.parametrize("reused_prefix", [False, True])
async def test_nesting_past_the_decoder_is_400_in_openais_shape(reused_prefix: bool) -> None:
    messages = [{"role": "user", "content": f"{KEY}: look"}]
    with no_call_failed():
        async with gateway_env() as env:
            session = await env.open()
            url = env.openai_url(session) + "/chat/completions"
            if reused_prefix:  # the reader holds this history when the deep body comes
                status, _ = await post_raw(
                    url, session.secret, json.dumps({"model": "m", "messages": messages}).encode()
                )
                assert status == 200
                head = json.dumps({"model": "m", "messages": messages})[: -len("]}")]
                body = (head + f', {{"role": "user", "content": {DEEP}}}]}}').encode()
            else:
                body = _openai_deep_field()
            status, error = await post_raw(url, session.secret, body)
    assert status == 400
    assert error["error"]["type"] == "invalid_request_error"
    assert error["error"]["param"] == "body"
    assert "nests arrays or objects too deeply" in error["error"]["message"]


async def test_nesting_past_the_decoder_in_anthropic_content_is_400_in_anthropics_shape() -> None:
    with no_call_failed():
        async with gateway_env() as env:
            session = await env.open()
            url = env.anthropic_url(session) + "/v1/messages"
            status, error = await post_raw(url, session.secret, _anthropic_deep_content())
    assert status == 400
    assert error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error"
    assert "nests arrays or objects too deeply" in error["error"]["message"]


async def test_tool_arguments_and_schemas_nested_too_deep_are_400_naming_the_field() -> None:
    deep = _nested(MAX_JSON_DEPTH + 5)
    with no_call_failed():
        async with gateway_env() as env:
            session = await env.open()
            async with openai.AsyncOpenAI(
                base_url=env.openai_url(session), api_key=session.secret, max_retries=0
            ) as client:
                call = {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "probe", "arguments": json.dumps(deep)},
                }
                history = [
                    {"role": "user", "content": KEY},
                    {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "c1", "content": "ok"},
                ]
                with pytest.raises(openai.BadRequestError) as arguments:
                    await client.chat.completions.create(model="m", messages=history)
                tool = {"type": "function", "function": {"name": "probe", "parameters": deep}}
                with pytest.raises(openai.BadRequestError) as schema:
                    await client.chat.completions.create(
                        model="m", messages=history[:1], tools=[tool]
                    )
            async with anthropic.AsyncAnthropic(
                base_url=env.anthropic_url(session), api_key=session.secret, max_retries=0
            ) as client:
                with pytest.raises(anthropic.BadRequestError) as use:
                    await client.messages.create(
                        model="m",
                        max_tokens=16,
                        messages=[
                            {"role": "user", "content": KEY},
                            {
                                "role": "assistant",
                                "content": [
                                    {"type": "tool_use", "id": "t1", "name": "p", "input": deep}
                                ],
                            },
                            {
                                "role": "user",
                                "content": [
                                    {"type": "tool_result", "tool_use_id": "t1", "content": "ok"}
                                ],
                            },
                        ],
                    )
    too_deep = f"nests arrays or objects more than {MAX_JSON_DEPTH} levels deep"
    assert arguments.value.status_code == schema.value.status_code == 400
    assert arguments.value.body["param"] == "messages[1].tool_calls[0].function.arguments"
    assert too_deep in arguments.value.body["message"]
    assert schema.value.body["param"] == "tools[0]" and too_deep in schema.value.body["message"]
    assert use.value.status_code == 400
    assert use.value.body["error"]["type"] == "invalid_request_error"
    assert use.value.body["error"]["message"].startswith("messages.1.content.0.input " + too_deep)
    assert not env.replay.stats.requests_seen


async def test_arguments_at_the_depth_limit_are_taken() -> None:
    deep = _nested(MAX_JSON_DEPTH - 1)
    async with openai_session() as (_env, _session, client):
        call = {"id": "c", "type": "function", "function": {"name": "p", "arguments": "{}"}}
        call["function"]["arguments"] = json.dumps(deep)
        reply = await client.chat.completions.create(
            model="m",
            messages=[
                {"role": "user", "content": KEY},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c", "content": "ok"},
            ],
        )
    assert reply.choices[0].message.tool_calls


async def test_a_lone_surrogate_escape_is_400_naming_it() -> None:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": f"{KEY} \ud800"}]})
    with no_call_failed():
        async with gateway_env() as env:
            session = await env.open()
            status, error = await post_raw(
                env.openai_url(session) + "/chat/completions", session.secret, body.encode()
            )
    assert status == 400
    assert error["error"]["param"] == "body"
    assert "lone surrogate escape ('\\ud800')" in error["error"]["message"]
