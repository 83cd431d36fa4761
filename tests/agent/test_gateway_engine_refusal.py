"""The engine's own refusal of a prompt over its context length (SGLang's HTTP 400, modelled by
the replay), reached through the gateway on a session whose budget the prompt fits: the client
gets the protocol's context-length error with the engine's words, never a 500, and the session
(so a harness episode) ends on its context limit, as swerl's own loop does."""

from __future__ import annotations

import anthropic
import openai
import pytest
from testkit.gateway import KEY, gateway_env
from testkit.gateway_hostile import no_call_failed

from swerl.agent.gateway.session import SessionState

ENGINE_CONTEXT = 64  # tokens; the session's own budget (the default) is far larger
LONG = f"{KEY}: " + "please read this long question " * 40


@pytest.mark.parametrize(
    ("limit", "words"),
    [
        (
            {"context_length": ENGINE_CONTEXT},
            "is longer than the model's context length (64 tokens).",
        ),
        # Issue 41 point 3: SGLang's scheduler refuses a prompt of max_req_input_len tokens or
        # more (a KV pool smaller than the context) in words without "context length"; it is
        # the same context limit, not an infra failure the episode would be re-run for.
        (
            {"max_req_input_len": ENGINE_CONTEXT},
            "exceeds the maximum allowed length (64 tokens)."
            " Use a shorter input or enable --allow-auto-truncate.",
        ),
    ],
    ids=["tokenizer-manager", "scheduler"],
)
async def test_openai_sdk_gets_context_length_exceeded_with_the_engines_words(
    limit: dict[str, int], words: str
) -> None:
    with no_call_failed():
        async with gateway_env(**limit) as env:
            session = await env.open()
            async with openai.AsyncOpenAI(
                base_url=env.openai_url(session), api_key=session.secret, max_retries=0
            ) as client:
                with pytest.raises(openai.BadRequestError) as refused:
                    await client.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": LONG}]
                    )
    error = refused.value.body
    assert refused.value.status_code == 400
    assert error["code"] == "context_length_exceeded"
    assert error["type"] == "invalid_request_error" and error["param"] == "messages"
    assert error["message"].startswith("the model's engine refused the prompt (")
    assert error["message"].endswith(words)
    assert session.state is SessionState.LIMIT_CONTEXT
    assert session.counters.context_errors == 1 and session.counters.infra_errors == 0


async def test_anthropic_sdk_gets_invalid_request_error_with_the_engines_words() -> None:
    with no_call_failed():
        async with gateway_env(context_length=ENGINE_CONTEXT) as env:
            session = await env.open()
            async with anthropic.AsyncAnthropic(
                base_url=env.anthropic_url(session), api_key=session.secret, max_retries=0
            ) as client:
                with pytest.raises(anthropic.BadRequestError) as refused:
                    await client.messages.create(
                        model="m", max_tokens=16, messages=[{"role": "user", "content": LONG}]
                    )
    assert refused.value.status_code == 400
    body = refused.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "context length" in body["error"]["message"]
    assert session.state is SessionState.LIMIT_CONTEXT


async def test_a_prompt_that_fits_the_engine_is_answered_after_a_refusal() -> None:
    """The refusal ends the episode's context, not the gateway: a short call still answers."""
    with no_call_failed():
        async with gateway_env(context_length=8192) as env:
            session = await env.open()
            async with openai.AsyncOpenAI(
                base_url=env.openai_url(session), api_key=session.secret, max_retries=0
            ) as client:
                with pytest.raises(openai.BadRequestError):
                    await client.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": LONG * 20}]
                    )
                reply = await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": f"{KEY}: short"}]
                )
    assert reply.choices[0].message is not None
