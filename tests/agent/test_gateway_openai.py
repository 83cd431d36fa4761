"""The gateway through the official `openai` SDK (sync and async, streaming and not, tool calls,
every error), in front of the replay policy with the real Qwen3 tokenizer."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest
from testkit.gateway import BASH_TOOL, KEY, assert_chains_exact, async_client, gateway_env

from swerl.agent.gateway.session import SessionState
from swerl.agent.gateway.tree import CallKind
from swerl.agent.policy.clients import policy_retrying


def _conversation() -> list[dict]:
    return [
        {"role": "system", "content": "You are a careful engineer."},
        {"role": "user", "content": f"{KEY}: check the repository."},
    ]


async def test_tool_call_round_trip_reuses_the_sampled_ids_and_records_one_exact_chain() -> None:
    async with gateway_env() as env:
        session = await env.open()
        client = async_client(base_url=env.openai_url(session), api_key=session.secret)
        messages = _conversation()
        first = await client.chat.completions.create(
            model="policy", messages=messages, tools=[BASH_TOOL]
        )
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls"
        call = choice.message.tool_calls[0]
        assert call.function.name == "bash" and json.loads(call.function.arguments) == {
            "command": "ls"
        }
        assert choice.message.content == "Running it."
        assert choice.message.model_extra["reasoning_content"] == "Let me look around."
        assert first.usage.completion_tokens == len(env.replay.stats.requests_seen[0][1])
        messages.append(choice.message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "a.py\nb.py"})
        second = await client.chat.completions.create(
            model="policy", messages=messages, tools=[BASH_TOOL]
        )
        assert second.choices[0].message.tool_calls[0].function.arguments == json.dumps(
            {"command": "cat a.py"}
        )
        calls = session.tree.calls
        assert [c.kind for c in calls] == [CallKind.ROOT, CallKind.EXTEND]
        # The second prompt starts with the first prompt and the sampled ids, as they were.
        assert calls[1].reused_tokens == calls[0].token_count()
        # Only the tool message after the recorded reply was rendered for the second call.
        assert (calls[1].request_messages, calls[1].rendered_messages) == (4, 1)
        sent_first, got_first = env.replay.stats.requests_seen[0]
        sent_second, _ = env.replay.stats.requests_seen[1]
        assert sent_second[: len(sent_first) + len(got_first)] == sent_first + got_first
        records = env.gateway.store.close(session.id)
        assert len(records) == 1
        assert_chains_exact(records, env.replay)
        record = records[0]
        assert sum(record.loss_mask) == sum(len(o) for _, o in env.replay.stats.requests_seen)


async def test_streaming_answers_the_same_completion_as_chunks() -> None:
    async with gateway_env() as env:
        session = await env.open()
        client = async_client(base_url=env.openai_url(session), api_key=session.secret)
        stream = await client.chat.completions.create(
            model="policy",
            messages=_conversation(),
            tools=[BASH_TOOL],
            stream=True,
            stream_options={"include_usage": True},
        )
        reasoning, content, arguments, names, finish, usage = "", "", "", [], None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                delta = choice.delta
                reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
                content += delta.content or ""
                for call in delta.tool_calls or []:
                    names.append(call.function.name)
                    arguments += call.function.arguments or ""
                finish = choice.finish_reason or finish
        assert reasoning == "Let me look around." and content == "Running it."
        assert names == ["bash"] and json.loads(arguments) == {"command": "ls"}
        assert finish == "tool_calls"
        assert usage is not None and usage.total_tokens == usage.prompt_tokens + len(
            env.replay.stats.requests_seen[0][1]
        )


async def test_sync_client_streaming_and_not() -> None:
    async with gateway_env({KEY: ["Plain answer, no tools."]}) as env:
        session = await env.open()

        def talk() -> tuple[str, str]:
            client = openai.OpenAI(base_url=env.openai_url(session), api_key=session.secret)
            whole = client.chat.completions.create(model="policy", messages=_conversation())
            parts = client.chat.completions.create(
                model="policy", messages=_conversation(), stream=True
            )
            streamed = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
            return whole.choices[0].message.content, streamed

        whole, streamed = await asyncio.to_thread(talk)
        assert whole == streamed == "Plain answer, no tools."
        assert whole is not None
        # The same history twice: the second call is a second root-level call of the same
        # prompt, never a corrupted extension.
        assert [c.kind for c in session.tree.calls] == [CallKind.ROOT, CallKind.ROOT]


async def test_models_lists_the_sessions_model() -> None:
    async with gateway_env() as env:
        session = await env.open(model="qwen3-policy")
        client = async_client(base_url=env.openai_url(session), api_key=session.secret)
        listed = [m.id async for m in client.models.list()]
        assert listed == ["qwen3-policy"]
        assert (await client.models.retrieve("qwen3-policy")).id == "qwen3-policy"
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("other")


# -- errors -------------------------------------------------------------------------------------


async def test_unknown_and_closed_sessions_are_404() -> None:
    async with gateway_env() as env:
        session = await env.open()
        client = async_client(
            base_url=env.openai_url(session).replace(session.id, "nope"),
            api_key=session.secret,
            max_retries=0,
        )
        with pytest.raises(openai.NotFoundError) as err:
            await client.chat.completions.create(model="m", messages=_conversation())
        assert err.value.body["type"] == "invalid_request_error"
        env.gateway.store.close(session.id)
        client = async_client(
            base_url=env.openai_url(session), api_key=session.secret, max_retries=0
        )
        with pytest.raises(openai.NotFoundError) as err:
            await client.chat.completions.create(model="m", messages=_conversation())
        assert "no open session" in err.value.body["message"]


async def test_wrong_secret_is_401() -> None:
    async with gateway_env() as env:
        session = await env.open()
        client = async_client(base_url=env.openai_url(session), api_key="wrong")
        with pytest.raises(openai.AuthenticationError) as err:
            await client.chat.completions.create(model="m", messages=_conversation())
        assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
        assert env.replay.stats.requests == 0


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([{"role": "wizard", "content": "hi"}], "messages[0].role"),
        (
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "look"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
                    ],
                }
            ],
            "messages[0].content[1]",
        ),
        (
            [
                {"role": "user", "content": "hi"},
                {"role": "input_audio", "content": "x"},
            ],
            "messages[1].role",
        ),
        (
            [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "bash", "arguments": "{oops"},
                        }
                    ],
                },
            ],
            "messages[1].tool_calls[0].function.arguments",
        ),
        ([{"role": "tool", "content": "out"}], "messages[0].tool_call_id"),
    ],
)
async def test_malformed_messages_are_400_naming_the_field(messages, param) -> None:
    async with gateway_env() as env:
        session = await env.open()
        client = async_client(base_url=env.openai_url(session), api_key=session.secret)
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(model="m", messages=messages)
        assert err.value.status_code == 400 and err.value.param == param
        assert err.value.body["type"] == "invalid_request_error"
        assert env.replay.stats.requests == 0


async def test_bad_json_and_bad_fields_are_400_in_openais_error_body() -> None:
    async with gateway_env() as env:
        session = await env.open()
        url = env.openai_url(session) + "/chat/completions"
        headers = {"Authorization": f"Bearer {session.secret}"}
        cases = [
            (b"{not json", "body"),
            (b"[]", "body"),
            (json.dumps({"model": "m", "messages": []}).encode(), "messages"),
            (json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(), "model"),
            (
                json.dumps(
                    {"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 3}
                ).encode(),
                "n",
            ),
            (
                json.dumps(
                    {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}
                ).encode(),
                "max_tokens",
            ),
        ]
        async with aiohttp.ClientSession() as http:
            for body, param in cases:
                async with http.post(url, data=body, headers=headers) as response:
                    assert response.status == 400, body
                    error = (await response.json())["error"]
                    assert error["type"] == "invalid_request_error" and error["param"] == param


async def test_prompt_over_the_context_budget_is_openais_context_length_error() -> None:
    async with gateway_env() as env:
        session = await env.open(max_context_tokens=16)
        client = async_client(base_url=env.openai_url(session), api_key=session.secret)
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(model="m", messages=_conversation())
        assert err.value.code == "context_length_exceeded" and err.value.param == "messages"
        assert session.state is SessionState.LIMIT_CONTEXT
        assert env.replay.stats.requests == 0


async def test_a_call_under_the_budget_is_cut_to_what_is_left() -> None:
    async with gateway_env() as env:
        session = await env.open(max_context_tokens=25)
        client = async_client(base_url=env.openai_url(session), api_key=session.secret)
        reply = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": f"{KEY}"}]
        )
        prompt = reply.usage.prompt_tokens
        assert reply.choices[0].finish_reason == "length"
        assert 0 < reply.usage.completion_tokens == 25 - prompt


async def test_policy_unavailable_is_503_with_a_retry_hint_and_counted_as_infra() -> None:
    # The gateway retries the policy's 500s for a while (here half a second), then answers.
    retrying = {"retrying": policy_retrying(12, 0.5)}
    async with gateway_env(fault_control=True, gateway_options=retrying) as env:
        env.replay.inject_fault("error", 60)
        session = await env.open()
        client = async_client(
            base_url=env.openai_url(session), api_key=session.secret, max_retries=0
        )
        with pytest.raises(openai.InternalServerError) as err:
            await client.chat.completions.create(model="m", messages=_conversation())
        assert err.value.status_code == 503
        assert err.value.response.headers["retry-after"] == "1"
        assert err.value.code == "policy_unavailable"
        assert session.counters.infra_errors == 1
        # With retries the SDK waits for the hint and gets through once the policy is back.
        env.replay.inject_fault("none", 0)
        retrying = async_client(
            base_url=env.openai_url(session), api_key=session.secret, max_retries=2
        )
        reply = await retrying.chat.completions.create(model="m", messages=_conversation())
        assert reply.choices[0].finish_reason == "tool_calls"


async def test_policy_abort_fails_this_and_every_later_call_and_ends_the_session_aborted() -> None:
    async with gateway_env(abort_on_turn=1) as env:
        session = await env.open()
        client = async_client(
            base_url=env.openai_url(session), api_key=session.secret, max_retries=0
        )
        messages = _conversation()
        first = await client.chat.completions.create(
            model="m", messages=messages, tools=[BASH_TOOL]
        )
        message = first.choices[0].message
        messages += [
            message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "a.py"},
        ]
        for _ in range(2):
            with pytest.raises(openai.APIStatusError) as err:
                await client.chat.completions.create(
                    model="m", messages=messages, tools=[BASH_TOOL]
                )
            assert err.value.status_code == 410 and err.value.code == "session_aborted"
        assert session.state is SessionState.ABORTED
        assert len(env.gateway.store.close(session.id)) == 1  # the call before the abort


async def test_trainer_abort_answers_the_in_flight_call_with_an_error() -> None:
    async with gateway_env(latency_s=3) as env:
        session = await env.open()
        client = async_client(
            base_url=env.openai_url(session), api_key=session.secret, max_retries=0
        )
        pending = asyncio.ensure_future(
            client.chat.completions.create(model="m", messages=_conversation())
        )
        for _ in range(1000):  # until the policy holds the request
            if session.counters.in_flight and env.replay.stats.requests:
                break
            await asyncio.sleep(0.01)
        records = env.gateway.store.close(session.id, abort=True)
        with pytest.raises(openai.APIStatusError) as err:
            await asyncio.wait_for(pending, 10)
        assert err.value.status_code == 410
        assert records == [] and session.state is SessionState.ABORTED
        with pytest.raises(openai.APIStatusError) as err:
            await client.chat.completions.create(model="m", messages=_conversation())
        assert err.value.status_code == 410


async def test_the_sessions_lora_adapter_and_routing_key_reach_every_policy_call() -> None:
    async with gateway_env() as env:
        session = await env.open(lora_path="policy-lora-3")
        client = async_client(base_url=env.openai_url(session), api_key=session.secret)
        await client.chat.completions.create(model="m", messages=_conversation())
        plain = await env.open()
        client = async_client(base_url=env.openai_url(plain), api_key=plain.secret)
        await client.chat.completions.create(model="m", messages=_conversation())
    first, second = env.replay.stats.calls
    assert first.lora_path == "policy-lora-3" and second.lora_path is None
    assert first.headers["X-SMG-Routing-Key"] == session.id
    assert second.headers["X-SMG-Routing-Key"] == plain.id
