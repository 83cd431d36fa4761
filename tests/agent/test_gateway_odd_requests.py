"""Odd requests read as the protocols mean them: a body opening with a UTF-8 byte order mark
is the same request without it, `n` is a positive integer (`true` is not 1), and an unknown
path under a session answers 404 in the shape of the protocol asking (Anthropic's SDK gets
Anthropic's `not_found_error`)."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from testkit.gateway import KEY, gateway_env
from testkit.gateway_hostile import no_call_failed, openai_session, post_raw

BOM = b"\xef\xbb\xbf"


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
async def test_a_body_with_a_utf8_bom_is_the_same_request_without_it(protocol: str) -> None:
    body: dict = {"model": "m", "messages": [{"role": "user", "content": f"{KEY}: look"}]}
    if protocol == "anthropic":
        body["max_tokens"] = 64
    raw = json.dumps(body).encode()
    with no_call_failed():
        async with gateway_env() as env:
            session = await env.open()
            url = (
                env.openai_url(session) + "/chat/completions"
                if protocol == "openai"
                else env.anthropic_url(session) + "/v1/messages"
            )
            with_bom = await post_raw(url, session.secret, BOM + raw)
            without = await post_raw(url, session.secret, raw)
            again = await post_raw(url, session.secret, BOM + raw)
    assert with_bom[0] == without[0] == again[0] == 200
    prompts = [ids for ids, _ in env.replay.stats.requests_seen]
    assert prompts[0] == prompts[1] == prompts[2]
    # The reader kept the body without its mark: the third read reused the whole history.
    assert session.readers[protocol].body.reused_messages == 1


@pytest.mark.parametrize("n", [True, 1.0, 0, -1, "1"])
async def test_n_that_is_not_a_positive_integer_is_400(n: object) -> None:
    async with openai_session() as (_env, _session, client):
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": KEY}],
                extra_body={"n": n},
            )
    assert refused.value.status_code == 400
    assert refused.value.body["param"] == "n"
    assert refused.value.body["message"] == "n must be a positive integer"


async def test_n_of_one_is_answered() -> None:
    async with openai_session() as (_env, _session, client):
        reply = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": KEY}], n=1
        )
    assert len(reply.choices) == 1


async def test_anthropics_count_tokens_is_404_in_anthropics_shape() -> None:
    with no_call_failed():
        async with gateway_env() as env:
            session = await env.open()
            async with anthropic.AsyncAnthropic(
                base_url=env.anthropic_url(session), api_key=session.secret, max_retries=0
            ) as client:
                with pytest.raises(anthropic.NotFoundError) as missing:
                    await client.messages.count_tokens(
                        model="m", messages=[{"role": "user", "content": KEY}]
                    )
            # Without the SDK's header, the path alone says it is Anthropic's.
            status, body = await post_raw(
                env.anthropic_url(session) + "/v1/messages/batches", session.secret, b"{}"
            )
            # An OpenAI path stays in OpenAI's shape.
            openai_status, openai_body = await post_raw(
                env.openai_url(session) + "/embeddings", session.secret, b"{}"
            )
    assert missing.value.status_code == 404
    assert missing.value.body["type"] == "error"
    assert missing.value.body["error"]["type"] == "not_found_error"
    assert "/v1/messages/count_tokens" in missing.value.body["error"]["message"]
    assert status == 404 and body["error"]["type"] == "not_found_error"
    assert openai_status == 404 and openai_body["error"]["code"] == "not_found"
