"""`tool_choice` as OpenAI and Anthropic define it, through their SDKs: a choice without tools
and a named tool that is not declared are refused as the real APIs refuse them; a choice that
forces a tool call (which the policy's generation is not constrained to) is a 400 saying it
cannot be honoured; `auto` and `none` are answered (`none` hides the tools)."""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import pytest
from testkit.gateway import ANTHROPIC_BASH_TOOL, BASH_TOOL, KEY, gateway_env
from testkit.gateway_hostile import no_call_failed

MESSAGES = [{"role": "user", "content": f"{KEY}: look"}]
CANNOT = "cannot be honoured: this gateway does not constrain the policy's generation"


async def _openai_refusal(**request: Any) -> openai.BadRequestError:
    with no_call_failed():
        async with gateway_env() as env:
            session = await env.open()
            async with openai.AsyncOpenAI(
                base_url=env.openai_url(session), api_key=session.secret, max_retries=0
            ) as client:
                with pytest.raises(openai.BadRequestError) as refused:
                    await client.chat.completions.create(model="m", messages=MESSAGES, **request)
            assert not env.replay.stats.requests_seen
    assert refused.value.status_code == 400
    assert refused.value.body["type"] == "invalid_request_error"
    assert refused.value.body["param"] == "tool_choice"
    return refused.value


async def _anthropic_refusal(**request: Any) -> anthropic.BadRequestError:
    with no_call_failed():
        async with gateway_env() as env:
            session = await env.open()
            async with anthropic.AsyncAnthropic(
                base_url=env.anthropic_url(session), api_key=session.secret, max_retries=0
            ) as client:
                with pytest.raises(anthropic.BadRequestError) as refused:
                    await client.messages.create(
                        model="m", max_tokens=64, messages=MESSAGES, **request
                    )
            assert not env.replay.stats.requests_seen
    assert refused.value.status_code == 400
    assert refused.value.body["type"] == "error"
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    return refused.value


@pytest.mark.parametrize(
    "choice", ["auto", "none", "required", {"type": "function", "function": {"name": "bash"}}]
)
async def test_openai_tool_choice_without_tools_is_refused_as_openai_does(choice: Any) -> None:
    refused = await _openai_refusal(tool_choice=choice)
    assert refused.body["message"] == (
        "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are specified."
    )


async def test_openai_naming_an_undeclared_function_is_refused() -> None:
    refused = await _openai_refusal(
        tools=[BASH_TOOL], tool_choice={"type": "function", "function": {"name": "edit"}}
    )
    assert "function 'edit' is not one of the functions in 'tools'" in refused.body["message"]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "bash"}}])
async def test_openai_choices_forcing_a_call_cannot_be_honoured(choice: Any) -> None:
    refused = await _openai_refusal(tools=[BASH_TOOL], tool_choice=choice)
    assert CANNOT in refused.body["message"]


@pytest.mark.parametrize(
    "choice",
    [{"type": "auto"}, {"type": "any"}, {"type": "tool", "name": "bash"}, {"type": "none"}],
)
async def test_anthropic_tool_choice_without_tools_is_refused_as_anthropic_does(
    choice: dict[str, Any],
) -> None:
    refused = await _anthropic_refusal(tool_choice=choice)
    assert refused.body["error"]["message"] == (
        "tool_choice may only be specified while providing tools."
    )


async def test_anthropic_naming_an_undeclared_tool_is_refused() -> None:
    refused = await _anthropic_refusal(
        tools=[ANTHROPIC_BASH_TOOL], tool_choice={"type": "tool", "name": "edit"}
    )
    assert "Tool 'edit' not found in provided tools" in refused.body["error"]["message"]


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "bash"}])
async def test_anthropic_choices_forcing_a_call_cannot_be_honoured(choice: dict[str, Any]) -> None:
    refused = await _anthropic_refusal(tools=[ANTHROPIC_BASH_TOOL], tool_choice=choice)
    assert CANNOT in refused.body["error"]["message"]


async def test_auto_is_answered_and_none_hides_the_tools() -> None:
    with no_call_failed():
        async with gateway_env() as env:
            session = await env.open()
            async with openai.AsyncOpenAI(
                base_url=env.openai_url(session), api_key=session.secret, max_retries=0
            ) as client:
                auto = await client.chat.completions.create(
                    model="m", messages=MESSAGES, tools=[BASH_TOOL], tool_choice="auto"
                )
                none = await client.chat.completions.create(
                    model="m", messages=MESSAGES, tools=[BASH_TOOL], tool_choice="none"
                )
            async with anthropic.AsyncAnthropic(
                base_url=env.anthropic_url(session), api_key=session.secret, max_retries=0
            ) as client:
                anthropic_auto = await client.messages.create(
                    model="m",
                    max_tokens=512,
                    messages=MESSAGES,
                    tools=[ANTHROPIC_BASH_TOOL],
                    tool_choice={"type": "auto"},
                )
    assert auto.choices[0].message.tool_calls  # the script's tool call, parsed
    # With the tools hidden, the template declared none: the prompt holds no tool schema.
    prompts = [env.replay.tokenizer.decode(ids) for ids, _ in env.replay.stats.requests_seen]
    assert '"name": "bash"' in prompts[0] and '"name": "bash"' not in prompts[1]
    assert none.choices[0].message.content
    assert anthropic_auto.stop_reason == "tool_use"
