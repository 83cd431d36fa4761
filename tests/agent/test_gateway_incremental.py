"""The gateway's incremental reading of re-sent histories: the same bodies, conversations and
digests as a full decode, reusing only what the previous body's bytes hold unchanged."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from testkit.gateway import BASH_TOOL, KEY, assert_chains_exact, gateway_env

from swerl.agent.gateway.errors import SessionClosed
from swerl.agent.gateway.incremental import BodyReader, DigestMemo
from swerl.agent.gateway.messages import (
    ConversationReader,
    anthropic_conversation,
    chain_digests,
    openai_conversation,
)
from swerl.agent.gateway.tree import chain_records


def _history(n: int, tag: str = "") -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"role": "system", "content": "be brief"}]
    for i in range(n):
        out.append({"role": "user", "content": f'question {i}{tag} \u00e9\u4e2d \\ "'})
        out.append(
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": f"call_{i}",
                        "type": "function",
                        "function": {"name": "bash", "arguments": json.dumps({"command": "ls"})},
                    }
                ],
            }
        )
        out.append({"role": "tool", "tool_call_id": f"call_{i}", "content": f"out {i}"})
    return out


def _body(
    messages: list[dict[str, Any]], *, indent: int | None = None, first: bool = False
) -> bytes:
    body: dict[str, Any] = {"messages": messages} if first else {"model": "m"}
    body.update({"model": "m", "messages": messages, "tools": [BASH_TOOL], "stream": False})
    return json.dumps(body, indent=indent, ensure_ascii=False).encode()


def test_a_growing_history_decodes_as_json_loads_and_reuses_the_sent_messages() -> None:
    reader = BodyReader()
    for n in range(1, 8):
        raw = _body(_history(n))
        assert reader.decode(raw) == json.loads(raw)
        # All the previous body's messages came from its decode, none re-decoded.
        assert reader.reused_messages == (0 if n == 1 else 1 + 3 * (n - 1))


@pytest.mark.parametrize("indent", [None, 2])
@pytest.mark.parametrize("first", [False, True])
def test_layouts_and_key_orders_decode_as_json_loads(indent: int | None, first: bool) -> None:
    reader = BodyReader()
    for n in (2, 3, 5):
        raw = _body(_history(n), indent=indent, first=first)
        assert reader.decode(raw) == json.loads(raw)
    assert reader.reused_messages > 0


def test_a_rewritten_history_reuses_only_the_unchanged_prefix() -> None:
    reader = BodyReader()
    reader.decode(_body(_history(6)))
    rewritten = _history(6)
    rewritten[7]["content"] = "compacted"
    raw = _body(rewritten)
    assert reader.decode(raw) == json.loads(raw)
    assert reader.reused_messages == 7
    shorter = _body(_history(2))
    assert reader.decode(shorter) == json.loads(shorter)


def test_a_change_inside_a_multibyte_character_reuses_only_the_messages_before_it() -> None:
    # The prefix is found on the bytes: "\u00e9" and "\u00e8" differ in their second UTF-8 byte
    # only, so the first differing byte lies inside a character; the messages before it are
    # reused, that one and all after it are decoded, and the next body resumes at the right byte.
    reader = BodyReader()
    reader.decode(_body(_history(4)))
    changed = _history(4)
    changed[4]["content"] = changed[4]["content"].replace("\u00e9", "\u00e8")
    raw = _body(changed)
    assert reader.decode(raw) == json.loads(raw)
    assert reader.reused_messages == 4
    changed.append({"role": "user", "content": "\u4e2d\u00e8 more"})
    raw = _body(changed)
    assert reader.decode(raw) == json.loads(raw)
    assert reader.reused_messages == len(changed) - 1


@pytest.mark.parametrize(
    "raw",
    [
        b"{not json",
        b"[]",
        b'"text"',
        b"{}",
        b'{"model": "m", "messages": []}',
        b'{"model": "m", "messages": [{"role": "user"}] } extra',
        b'{"model": "m", "messages": [{"role": "user"},]}',
        b'{"model": "m", "messages": [{"role": "user"}], "messages": [1]}',
        b'{"model": "m", "messages": "no list"}',
        "\ufeff{}".encode("utf-16"),
        b'{"messages": [1, 2',
    ],
)
def test_odd_and_bad_bodies_read_as_json_loads_reads_them(raw: bytes) -> None:
    reader = BodyReader()
    reader.decode(_body(_history(2)))  # a previous body whose prefix some cases share
    try:
        expected: Any = json.loads(raw)
    except ValueError as err:
        with pytest.raises(ValueError) as got:
            reader.decode(raw)
        assert str(got.value) == str(err)
        return
    assert reader.decode(raw) == expected


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 6), st.sampled_from(["", "x", "\u00e9", "\\n"])),
        min_size=1,
        max_size=6,
    ),
    st.sampled_from([None, 1]),
)
def test_any_sequence_of_histories_decodes_as_json_loads(
    steps: list[tuple[int, str]], indent: int | None
) -> None:
    reader = BodyReader()
    conversations = ConversationReader(openai_conversation)
    for n, tag in steps:
        raw = _body(_history(n, tag), indent=indent)
        assert reader.decode(raw) == json.loads(raw)
        conv = conversations.read(raw)
        full = openai_conversation(json.loads(raw))
        assert conv.messages == full.messages and conv.keys == full.keys
        assert conv.digests == chain_digests(full.tools_key(), full.keys)


def test_anthropic_conversations_read_incrementally_as_in_full() -> None:
    reader = ConversationReader(anthropic_conversation)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "fix it"}]
    for i in range(4):
        messages.append(
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": f"t{i}", "name": "bash", "input": {}}],
            }
        )
        messages.append(
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": f"t{i}", "content": f"out {i}"},
                    {"type": "text", "text": "go on"},
                ],
            }
        )
        raw = json.dumps(
            {"model": "m", "max_tokens": 9, "system": "be brief", "messages": messages}
        ).encode()
        conv = reader.read(raw)
        full = anthropic_conversation(json.loads(raw))
        assert conv.messages == full.messages and conv.keys == full.keys
        assert conv.digests == chain_digests(full.tools_key(), full.keys)
    assert reader.body.reused_messages == len(messages) - 2


def test_digests_of_a_changed_seed_or_key_are_recomputed() -> None:
    memo = DigestMemo()
    keys = [b"a", b"b", b"c"]
    assert memo.digests(b"s", keys) == chain_digests(b"s", keys)
    assert memo.digests(b"s", [*keys, b"d"]) == chain_digests(b"s", [*keys, b"d"])
    assert memo.digests(b"t", keys) == chain_digests(b"t", keys)
    assert memo.digests(b"t", [b"a", b"x", b"c"]) == chain_digests(b"t", [b"a", b"x", b"c"])


async def test_bad_json_after_a_good_call_is_400_and_the_next_call_still_continues() -> None:
    async with gateway_env() as env:
        session = await env.open()
        url = env.openai_url(session) + "/chat/completions"
        headers = {"Authorization": f"Bearer {session.secret}"}
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": f"{KEY}: fix the bug"},
        ]
        async with aiohttp.ClientSession() as http:

            async def post(raw: bytes) -> tuple[int, dict[str, Any]]:
                async with http.post(url, data=raw, headers=headers) as response:
                    return response.status, await response.json()

            status, reply = await post(_openai(messages))
            assert status == 200
            message = reply["choices"][0]["message"]
            messages.append(message)
            good = _openai([*messages, _tool(message, "a.py")])
            # The same prefix, cut short: the gateway answers json.loads's error.
            status, error = await post(good[:-7])
            assert status == 400
            assert error["error"]["type"] == "invalid_request_error"
            assert error["error"]["param"] == "body"
            try:
                json.loads(good[:-7])
            except ValueError as err:
                assert error["error"]["message"] == f"the request body is not valid JSON: {err}"
            status, reply = await post(good)
            assert status == 200
            # The two messages of the first body came from its decode.
            assert session.readers["openai"].body.reused_messages == 2
        node = session.tree.calls[-1]
        assert node.parent is session.tree.calls[0] and node.rendered_messages == 1
        assert_chains_exact(await env.gateway.store.aclose(session.id), env.replay)


def _openai(messages: list[dict[str, Any]]) -> bytes:
    return json.dumps({"model": "m", "messages": messages, "tools": [BASH_TOOL]}).encode()


def _tool(message: dict[str, Any], content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": content}


async def test_close_builds_the_records_off_the_loop_once_for_concurrent_retries() -> None:
    async with gateway_env() as env:
        session = await env.open()
        url = env.openai_url(session) + "/chat/completions"
        headers = {"Authorization": f"Bearer {session.secret}"}
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"{KEY}: fix the bug"}]
        async with aiohttp.ClientSession() as http:
            for command in ("ls", "cat a.py"):
                async with http.post(url, data=_openai(messages), headers=headers) as response:
                    message = (await response.json())["choices"][0]["message"]
                messages += [message, _tool(message, command)]
        store = env.gateway.store
        first, again = await asyncio.gather(
            store.aclose(session.id, request_id="close-1"),
            store.aclose(session.id, request_id="close-1"),
        )
        assert first is again and len(first) == 1
        assert first == chain_records(session.tree, len(session.tree.calls))
        assert_chains_exact(first, env.replay)
        with pytest.raises(SessionClosed):
            await store.aclose(session.id, request_id="another")
