"""The gateway through the official `anthropic` SDK (sync and async, streaming and not,
tool_use/tool_result, stop_reason, every error), in front of the replay policy with the real
Qwen3 tokenizer."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import anthropic
import pytest
from testkit.gateway import ANTHROPIC_BASH_TOOL, KEY, assert_chains_exact, gateway_env

from swerl.agent.gateway.session import SessionState
from swerl.agent.gateway.tree import CallKind
from swerl.agent.policy.clients import policy_retrying

SYSTEM = "You are a careful engineer."


def _first() -> list[dict]:
    return [{"role": "user", "content": f"{KEY}: check the repository."}]


async def test_tool_use_round_trip_extends_one_chain_with_the_sampled_ids() -> None:
    async with gateway_env() as env:
        session = await env.open()
        async with anthropic.AsyncAnthropic(
            base_url=env.anthropic_url(session), api_key=session.secret
        ) as client:
            messages = _first()
            first = await client.messages.create(
                model="policy",
                max_tokens=512,
                system=SYSTEM,
                messages=messages,
                tools=[ANTHROPIC_BASH_TOOL],
            )
            assert first.stop_reason == "tool_use"
            kinds = [block.type for block in first.content]
            assert kinds == ["thinking", "text", "tool_use"]
            assert first.content[0].thinking == "Let me look around."
            tool_use = first.content[2]
            assert tool_use.name == "bash" and tool_use.input == {"command": "ls"}
            assert tool_use.id.startswith("toolu_")
            assert first.usage.output_tokens == len(env.replay.stats.requests_seen[0][1])
            messages += [
                {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": tool_use.id, "content": "a.py"}
                    ],
                },
            ]
            second = await client.messages.create(
                model="policy",
                max_tokens=512,
                system=SYSTEM,
                messages=messages,
                tools=[ANTHROPIC_BASH_TOOL],
            )
            assert second.content[-1].input == {"command": "cat a.py"}
        calls = session.tree.calls
        assert [c.kind for c in calls] == [CallKind.ROOT, CallKind.EXTEND]
        assert calls[1].reused_tokens == calls[0].token_count()
        records = env.gateway.store.close(session.id)
        assert len(records) == 1
        assert_chains_exact(records, env.replay)


async def test_streaming_events_rebuild_the_same_message() -> None:
    async with gateway_env() as env:
        session = await env.open()
        async with anthropic.AsyncAnthropic(
            base_url=env.anthropic_url(session), api_key=session.secret
        ) as client:
            async with client.messages.stream(
                model="policy",
                max_tokens=512,
                system=SYSTEM,
                messages=_first(),
                tools=[ANTHROPIC_BASH_TOOL],
            ) as stream:
                events = [event.type async for event in stream]
                final = await stream.get_final_message()
        assert events[0] == "message_start" and "message_stop" in events
        assert final.stop_reason == "tool_use"
        assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
        assert final.content[1].text == "Running it."
        assert final.content[2].input == {"command": "ls"}
        assert final.usage.output_tokens == len(env.replay.stats.requests_seen[0][1])


async def test_sync_client_streaming_and_not_with_max_tokens_stop_reason() -> None:
    async with gateway_env({KEY: ["A plain answer that runs on for a while."]}) as env:
        session = await env.open()

        def talk() -> tuple[anthropic.types.Message, str, str | None]:
            client = anthropic.Anthropic(
                base_url=env.anthropic_url(session), api_key=session.secret
            )
            whole = client.messages.create(model="m", max_tokens=512, messages=_first())
            with client.messages.stream(model="m", max_tokens=3, messages=_first()) as stream:
                text = "".join(stream.text_stream)
                stop = stream.get_final_message().stop_reason
            return whole, text, stop

        whole, short, stop = await asyncio.to_thread(talk)
        assert whole.stop_reason == "end_turn"
        assert whole.content[0].text == "A plain answer that runs on for a while."
        assert stop == "max_tokens" and short and whole.content[0].text.startswith(short)


# -- errors -------------------------------------------------------------------------------------


async def test_unknown_session_is_404_and_wrong_key_401_in_anthropics_words() -> None:
    async with gateway_env() as env:
        session = await env.open()
        async with anthropic.AsyncAnthropic(
            base_url=env.anthropic_url(session).replace(session.id, "nope"),
            api_key=session.secret,
            max_retries=0,
        ) as client:
            with pytest.raises(anthropic.NotFoundError) as err:
                await client.messages.create(model="m", max_tokens=9, messages=_first())
            assert err.value.body["error"]["type"] == "not_found_error"
        async with anthropic.AsyncAnthropic(
            base_url=env.anthropic_url(session), api_key="wrong", max_retries=0
        ) as client:
            with pytest.raises(anthropic.AuthenticationError) as err:
                await client.messages.create(model="m", max_tokens=9, messages=_first())
            assert err.value.body["error"]["type"] == "authentication_error"
        assert env.replay.stats.requests == 0


@pytest.mark.parametrize(
    ("request_body", "field"),
    [
        (
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [
                    {"role": "user", "content": [{"type": "tool_result", "content": "x"}]}
                ],
            },
            "messages.0.content.0.tool_use_id",
        ),
        ({"model": "m", "max_tokens": 5, "messages": [{"role": "robot", "content": "x"}]}, "role"),
        (
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {
                                    "type": "base64",
                                    "media_type": "image/png",
                                    "data": "AA",
                                },
                            }
                        ],
                    }
                ],
            },
            "messages.0.content.0",
        ),
        (
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [
                    {"role": "user", "content": "x"},
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t", "input": {}}],
                    },
                ],
            },
            "messages.1.content.0.name",
        ),
    ],
)
async def test_malformed_requests_are_400_invalid_request_error_naming_the_field(
    request_body, field
) -> None:
    async with gateway_env() as env:
        session = await env.open()
        async with anthropic.AsyncAnthropic(
            base_url=env.anthropic_url(session), api_key=session.secret
        ) as client:
            with pytest.raises(anthropic.BadRequestError) as err:
                await client.messages.create(**request_body)
        error = err.value.body["error"]
        assert err.value.status_code == 400 and error["type"] == "invalid_request_error"
        assert field in error["message"]
        assert env.replay.stats.requests == 0


async def test_bad_json_and_missing_max_tokens_are_400_in_anthropics_error_body() -> None:
    async with gateway_env() as env:
        session = await env.open()
        cases = [
            (b"{oops", "JSON"),
            (
                json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}),
                "max_tokens",
            ),
        ]
        async with aiohttp.ClientSession() as http:
            for data, field in cases:
                async with http.post(
                    env.anthropic_url(session) + "/v1/messages",
                    data=data,
                    headers={"x-api-key": session.secret},
                ) as response:
                    assert response.status == 400
                    body = await response.json()
                assert body["type"] == "error"
                assert body["error"]["type"] == "invalid_request_error"
                assert field in body["error"]["message"]


async def test_prompt_over_the_budget_is_anthropics_prompt_too_long() -> None:
    async with gateway_env() as env:
        session = await env.open(max_context_tokens=12)
        async with anthropic.AsyncAnthropic(
            base_url=env.anthropic_url(session), api_key=session.secret
        ) as client:
            with pytest.raises(anthropic.BadRequestError) as err:
                await client.messages.create(
                    model="m", max_tokens=9, system=SYSTEM, messages=_first()
                )
        error = err.value.body["error"]
        assert error["type"] == "invalid_request_error"
        assert error["message"].startswith("prompt is too long")
        assert session.state is SessionState.LIMIT_CONTEXT


async def test_policy_unavailable_is_503_with_retry_after() -> None:
    # The gateway retries the policy's 500s for a while (here half a second), then answers.
    retrying = {"retrying": policy_retrying(12, 0.5)}
    async with gateway_env(fault_control=True, gateway_options=retrying) as env:
        env.replay.inject_fault("error", 60)
        session = await env.open()
        async with anthropic.AsyncAnthropic(
            base_url=env.anthropic_url(session), api_key=session.secret, max_retries=0
        ) as client:
            with pytest.raises(anthropic.InternalServerError) as err:
                await client.messages.create(model="m", max_tokens=9, messages=_first())
        assert err.value.status_code == 503
        assert err.value.response.headers["retry-after"] == "1"
        assert err.value.body["error"]["type"] == "api_error"
        assert session.counters.infra_errors == 1


async def test_abort_is_an_error_for_this_and_later_calls() -> None:
    async with gateway_env(abort_on_turn=0) as env:
        session = await env.open()
        async with anthropic.AsyncAnthropic(
            base_url=env.anthropic_url(session), api_key=session.secret, max_retries=0
        ) as client:
            for _ in range(2):
                with pytest.raises(anthropic.APIStatusError) as err:
                    await client.messages.create(model="m", max_tokens=9, messages=_first())
                assert err.value.status_code == 410
                assert err.value.body["error"]["type"] == "invalid_request_error"
        assert session.state is SessionState.ABORTED
        assert json.dumps(env.gateway.store.close(session.id, abort=True)) == "[]"
