"""The gateway's budget and size limits come before its expensive work: a body whose render
alone proves it over the session's context budget is refused untokenized, a body over the
gateway's maximum is 413 in the protocol's shape, and neither holds up another session."""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import anthropic
import openai
import pytest
from testkit.gateway import KEY, TOKENIZER, gateway_env
from testkit.gateway_hostile import no_call_failed, openai_session, post_raw

from swerl.agent.gateway.http import MAX_BODY_BYTES
from swerl.agent.gateway.render import OverBudget, Renderer
from swerl.agent.gateway.session import SessionState
from swerl.agent.policy.tokens import ChatCodec
from swerl.chassis.hf import load_tokenizer

BUDGET = 32_768


def _body(text: str) -> bytes:
    messages = [{"role": "user", "content": f"{KEY}: {text}"}]
    return json.dumps({"model": "m", "messages": messages}).encode()


async def _timed_call(client: openai.AsyncOpenAI) -> float:
    started = time.perf_counter()
    reply = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": f"{KEY}: a small question"}]
    )
    assert reply.choices[0].message.content
    return time.perf_counter() - started


async def test_a_50_mb_body_is_refused_in_2_s_and_holds_up_no_other_session() -> None:
    big = _body("x" * (50 * 1024 * 1024))
    with no_call_failed():
        async with gateway_env() as env:
            hostile = await env.open(max_context_tokens=BUDGET)
            other = await env.open()
            client = openai.AsyncOpenAI(
                base_url=env.openai_url(other), api_key=other.secret, max_retries=0
            )
            try:
                await _timed_call(client)  # warm: the tokenizer's first call
                unloaded = statistics.median([await _timed_call(client) for _ in range(5)])
                url = env.openai_url(hostile) + "/chat/completions"
                started = time.perf_counter()
                refusal = asyncio.ensure_future(post_raw(url, hostile.secret, big))
                loaded = []
                while not refusal.done():
                    loaded.append(await _timed_call(client))
                status, error = await refusal
                refused_s = time.perf_counter() - started
            finally:
                await client.close()
    assert status == 400
    assert error["error"]["code"] == "context_length_exceeded"
    assert "at least" in error["error"]["message"]
    assert refused_s < 2.0, f"refused after {refused_s:.2f} s"
    assert loaded, "no call of the other session overlapped the big one"
    assert max(loaded) < unloaded + 1.0, f"{max(loaded):.3f} s loaded, {unloaded:.3f} s not"
    assert hostile.state is SessionState.LIMIT_CONTEXT


async def test_a_render_over_the_budget_after_a_recorded_chain_is_refused_untokenized() -> None:
    async with openai_session(max_context_tokens=BUDGET) as (env, _session, client):
        messages = [{"role": "user", "content": f"{KEY}: look"}]
        first = await client.chat.completions.create(model="m", messages=messages)
        messages.append(first.choices[0].message.model_dump(exclude_none=True))
        call = first.choices[0].message.tool_calls[0]
        huge = "y" * (BUDGET * 200)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": huge})
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model="m", messages=messages)
    error = refused.value.body
    assert refused.value.status_code == 400
    assert error["code"] == "context_length_exceeded" and "at least" in error["message"]
    # The tool message was neither tokenized nor sent: one policy call, the first.
    assert len(env.replay.stats.requests_seen) == 1


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
async def test_a_body_whose_render_is_over_the_budget_is_the_protocols_context_error(
    protocol: str,
) -> None:
    text = "z" * (BUDGET * 200)
    with no_call_failed():
        async with gateway_env() as env:
            session = await env.open(max_context_tokens=BUDGET)
            if protocol == "openai":
                async with openai.AsyncOpenAI(
                    base_url=env.openai_url(session), api_key=session.secret, max_retries=0
                ) as client:
                    with pytest.raises(openai.BadRequestError) as refused:
                        await client.chat.completions.create(
                            model="m", messages=[{"role": "user", "content": text}]
                        )
                assert refused.value.body["code"] == "context_length_exceeded"
                assert refused.value.body["type"] == "invalid_request_error"
            else:
                async with anthropic.AsyncAnthropic(
                    base_url=env.anthropic_url(session), api_key=session.secret, max_retries=0
                ) as client:
                    with pytest.raises(anthropic.BadRequestError) as refused:
                        await client.messages.create(
                            model="m",
                            max_tokens=64,
                            messages=[{"role": "user", "content": text}],
                        )
                assert refused.value.body["error"]["type"] == "invalid_request_error"
                assert "prompt is too long: at least" in refused.value.body["error"]["message"]
    assert refused.value.status_code == 400
    assert not env.replay.stats.requests_seen


async def test_a_body_over_the_maximum_is_413_in_openais_shape() -> None:
    text = "w" * (MAX_BODY_BYTES + 1024)
    async with openai_session() as (_env, _session, client):
        with pytest.raises(openai.APIStatusError) as refused:
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": text}]
            )
    assert refused.value.status_code == 413
    assert refused.value.body["type"] == "invalid_request_error"
    assert refused.value.body["code"] == "request_too_large"
    assert str(MAX_BODY_BYTES) in refused.value.body["message"]


async def test_a_body_over_the_maximum_is_413_in_anthropics_shape() -> None:
    text = "w" * (MAX_BODY_BYTES + 1024)
    with no_call_failed():
        async with gateway_env() as env:
            session = await env.open()
            async with anthropic.AsyncAnthropic(
                base_url=env.anthropic_url(session), api_key=session.secret, max_retries=0
            ) as client:
                with pytest.raises(anthropic.APIStatusError) as refused:
                    await client.messages.create(
                        model="m", max_tokens=64, messages=[{"role": "user", "content": text}]
                    )
    assert refused.value.status_code == 413
    assert refused.value.body["type"] == "error"
    assert refused.value.body["error"]["type"] == "request_too_large"


async def test_a_chunked_body_over_the_maximum_is_413() -> None:
    # No Content-Length: the limit is met while reading.
    async def chunks():  # type: ignore[no-untyped-def]
        piece = b" " * (1024 * 1024)
        yield b'{"model": "m", "messages": [{"role": "user", "content": "'
        for _ in range(MAX_BODY_BYTES // len(piece) + 2):
            yield piece
        yield b'"}]}'

    with no_call_failed():
        async with gateway_env() as env:
            session = await env.open()
            status, error = await post_raw(
                env.openai_url(session) + "/chat/completions", session.secret, chunks()
            )
    assert status == 413
    assert error["error"]["code"] == "request_too_large"


def test_the_size_bound_refuses_only_texts_no_tokenization_could_fit() -> None:
    codec = ChatCodec(load_tokenizer(TOKENIZER), {}, TOKENIZER)
    renderer = Renderer(codec)
    # The worst case for the bound: long runs of spaces, the vocabulary's longest tokens.
    spaces = [{"role": "user", "content": " " * 100_000}]
    ids = renderer.full(spaces, None, limit=len(renderer.full(spaces, None)) + 1)
    assert len(ids) < 2_000
    with pytest.raises(OverBudget) as over:
        renderer.full([{"role": "user", "content": "a" * 200_000}], None, limit=1_000)
    assert over.value.at_least > 1_000
    assert len(renderer.full([{"role": "user", "content": "a" * 200_000}], None)) > 1_000
