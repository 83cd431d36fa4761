"""The gateway through `litellm` (what mini-swe-agent calls models with): its OpenAI and
Anthropic providers, sync and async, streaming, tool calls, and its mapping of our errors."""

from __future__ import annotations

import asyncio
import os

# litellm fetches a model price list from the network at import unless told to use its own copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import litellm
import pytest
from testkit.gateway import (
    BASH_TOOL,
    KEY,
    assert_chains_exact,
    gateway_env,
)

from swerl.agent.gateway.tree import CallKind


def _messages() -> list[dict]:
    return [
        {"role": "system", "content": "You are a careful engineer."},
        {"role": "user", "content": f"{KEY}: check the repository."},
    ]


async def test_litellm_openai_provider_sync_tool_calls_extend_one_chain() -> None:
    async with gateway_env() as env:
        session = await env.open()

        def talk() -> list[str]:
            messages = _messages()
            names = []
            for _ in range(2):
                reply = litellm.completion(
                    model="openai/policy",
                    api_base=env.openai_url(session),
                    api_key=session.secret,
                    messages=messages,
                    tools=[BASH_TOOL],
                )
                message = reply.choices[0].message
                call = message.tool_calls[0]
                names.append(call.function.name)
                messages.append(message.model_dump(exclude_none=True))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": "a.py"})
            return names

        assert await asyncio.to_thread(talk) == ["bash", "bash"]
        assert [c.kind for c in session.tree.calls] == [CallKind.ROOT, CallKind.EXTEND]
        assert_chains_exact(env.gateway.store.close(session.id), env.replay)


async def test_litellm_async_streaming_through_both_providers() -> None:
    async with gateway_env({KEY: ["Plain answer."]}) as env:
        session = await env.open()
        stream = await litellm.acompletion(
            model="openai/policy",
            api_base=env.openai_url(session),
            api_key=session.secret,
            messages=_messages(),
            stream=True,
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
        assert text == "Plain answer."
        reply = await litellm.acompletion(
            model="anthropic/policy",
            api_base=env.anthropic_url(session),
            api_key=session.secret,
            messages=_messages(),
            tools=[BASH_TOOL],
            max_tokens=64,
        )
        assert reply.choices[0].message.content == "Plain answer."


async def test_litellm_maps_our_context_length_error_to_its_context_window_error() -> None:
    async with gateway_env() as env:
        session = await env.open(max_context_tokens=16)
        with pytest.raises(litellm.ContextWindowExceededError):
            await litellm.acompletion(
                model="openai/policy",
                api_base=env.openai_url(session),
                api_key=session.secret,
                messages=_messages(),
                num_retries=0,
            )


async def test_litellm_sees_a_wrong_secret_as_authentication_error() -> None:
    async with gateway_env() as env:
        session = await env.open()
        with pytest.raises(litellm.AuthenticationError):
            await litellm.acompletion(
                model="openai/policy",
                api_base=env.openai_url(session),
                api_key="wrong",
                messages=_messages(),
                num_retries=0,
            )
