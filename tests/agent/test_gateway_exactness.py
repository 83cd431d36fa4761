"""Property: the prompt the policy receives is a fresh render of exactly what the client sent.

Random sessions of raw HTTP calls (OpenAI and Anthropic mixed) whose histories hold tool calls
with random JSON arguments: across turns the same paths take `true`, `1`, `1.0`, `"1"`, `-0.0`
..., keys are reordered (arguments and the tools' schemas), unicode everywhere, and the model's
own replies are echoed. Each prompt the replay policy logs is compared with one computed here
without any of the gateway's caches: the body decoded by `json.loads` and converted afresh;
a new root is the chat template's whole render; a call that echoes a recorded reply, after a
history that is JSON-identical (types, key order) to that call's request, is that call's prompt,
its sampled ids and the template's render of the messages after it. Python's `==` is never the
test of "the same": `json.dumps` in the client's key order is.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from testkit.gateway import KEY, TOKENIZER, gateway_env, tool_turn

from swerl.agent.gateway.messages import (
    ConversationReader,
    anthropic_conversation,
    message_key,
    openai_conversation,
)
from swerl.agent.gateway.render import Renderer
from swerl.agent.policy.tokens import ChatCodec
from swerl.chassis.hf import load_tokenizer

# Values JSON tells apart and Python's `==` (and `hash`) does not.
CONFUSABLE = [True, 1, 1.0, "1", False, 0, 0.0, -0.0, "0", None, "", "true"]
LEAF = (
    st.sampled_from(CONFUSABLE)
    | st.text(alphabet=st.sampled_from(list('ab é中😀\u2028"\\\n<>{}')), max_size=6)
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
)
NAMES = st.sampled_from(["flag", "n", "path", "é", "b", "a"])
VALUE = st.recursive(
    LEAF,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(NAMES, kids, max_size=3),
    max_leaves=6,
)
ARGS = st.dictionaries(NAMES, VALUE, min_size=1, max_size=4)

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("grow"), ARGS, st.integers(0, 3)),
        st.tuples(st.just("retype"), st.integers(0, 50), st.sampled_from(CONFUSABLE)),
        st.tuples(st.just("reorder"), st.integers(0, 50), st.just(None)),
        st.tuples(st.just("replace"), st.integers(0, 50), ARGS),
        st.tuples(st.just("echo"), st.just(None), st.just(None)),
        st.tuples(st.just("tools"), st.just(None), st.just(None)),
    ),
    min_size=2,
    max_size=8,
)
PROTOCOLS = st.lists(st.sampled_from(["openai", "anthropic"]), min_size=9, max_size=9)

PROBE_SCHEMA = {
    "type": "object",
    "properties": {"flag": {"type": "boolean"}, "path": {"type": "string", "default": "é"}},
}


def _reordered(value: Any) -> Any:
    """The same JSON value with every object's keys in reverse order."""
    if isinstance(value, dict):
        return {k: _reordered(v) for k, v in reversed(list(value.items()))}
    if isinstance(value, list):
        return [_reordered(v) for v in value]
    return value


def _same(a: Any, b: Any) -> bool:
    """JSON-identical: the same types, values and key order."""
    return json.dumps(a) == json.dumps(b)


def _same_messages(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """JSON-identical messages, but for the order of a message's own fields (the template reads
    them by name, and each protocol's converter adds them in its own order)."""
    return _same([sorted(m.items()) for m in a], [sorted(m.items()) for m in b])


@dataclass
class Turn:
    """One (assistant, tool result) pair of the history, protocol-neutral. `echo_of`: the index
    of the call whose reply this assistant turn echoes (None: the client wrote it)."""

    call_id: str
    name: str
    arguments: dict[str, Any]
    result: str
    content: str = ""
    reasoning: str = ""
    echo_of: int | None = None


@dataclass
class Client:
    """The harness side: its history, and per call the fresh conversation it sent."""

    schema: dict[str, Any] = field(default_factory=lambda: json.loads(json.dumps(PROBE_SCHEMA)))
    turns: list[Turn] = field(default_factory=list)
    replies: list[Turn] = field(default_factory=list)  # each call's reply, as a client echoes it
    sent: list[Any] = field(default_factory=list)  # each call's fresh Conversation

    def openai_body(self) -> bytes:
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": f"{KEY} é中😀 be exact."},
            {"role": "user", "content": "fix it \u2028 now"},
        ]
        for turn in self.turns:
            assistant: dict[str, Any] = {
                "role": "assistant",
                "content": turn.content,
                "tool_calls": [
                    {
                        "id": turn.call_id,
                        "type": "function",
                        "function": {"name": turn.name, "arguments": json.dumps(turn.arguments)},
                    }
                ],
            }
            if turn.reasoning:
                assistant["reasoning_content"] = turn.reasoning
            messages.append(assistant)
            messages.append({"role": "tool", "tool_call_id": turn.call_id, "content": turn.result})
        tools = [
            {"type": "function", "function": {"name": "bash", "parameters": _BASH}},
            {"type": "function", "function": {"name": "probe", "parameters": self.schema}},
        ]
        return json.dumps({"model": "m", "messages": messages, "tools": tools}).encode()

    def anthropic_body(self) -> bytes:
        messages: list[dict[str, Any]] = [{"role": "user", "content": "fix it \u2028 now"}]
        for turn in self.turns:
            blocks: list[dict[str, Any]] = []
            if turn.reasoning:
                blocks.append({"type": "thinking", "thinking": turn.reasoning, "signature": ""})
            if turn.content:
                blocks.append({"type": "text", "text": turn.content})
            blocks.append(
                {"type": "tool_use", "id": turn.call_id, "name": turn.name, "input": turn.arguments}
            )
            messages.append({"role": "assistant", "content": blocks})
            result = {"type": "tool_result", "tool_use_id": turn.call_id, "content": turn.result}
            messages.append({"role": "user", "content": [result]})
        tools = [
            {"name": "bash", "input_schema": _BASH},
            {"name": "probe", "input_schema": self.schema},
        ]
        body = {
            "model": "m",
            "max_tokens": 256,
            "system": f"{KEY} é中😀 be exact.",
            "messages": messages,
            "tools": tools,
        }
        return json.dumps(body, ensure_ascii=False).encode()


_BASH = {"type": "object", "properties": {"command": {"type": "string"}}}


class Reference:
    """The prompts computed without the gateway's caches."""

    def __init__(self) -> None:
        codec = ChatCodec(load_tokenizer(TOKENIZER), {}, TOKENIZER)
        self.renderer = Renderer(codec, slots=False)
        self.prompts: list[list[int]] = []
        self.outputs: list[list[int]] = []

    def prompt(self, client: Client, conv: Any) -> list[int]:
        """The last echoed reply whose call's request is JSON-identical to the history before
        it continues that call; otherwise the conversation is a new root."""
        messages = conv.messages
        for i in range(len(messages) - 1, -1, -1):
            for j, before in enumerate(client.sent):
                if (
                    _echoes(messages[i], client.replies[j])
                    and _same_messages(messages[:i], before.messages)
                    and _same(conv.tools, before.tools)
                ):
                    ended = self.outputs[j][-1] == self.renderer.end_of_turn_id
                    delta = self.renderer.delta(messages[i + 1 :], ended)
                    return [*self.prompts[j], *self.outputs[j], *delta]
        return self.renderer.full(messages, conv.tools)


def _echoes(message: dict[str, Any], reply: Turn) -> bool:
    """Whether the message is the reply as a client echoes it: an assistant turn whose text and
    tool call are JSON-identical to the reply's (reasoning and ids may be dropped or rewritten)."""
    if message["role"] != "assistant":
        return False
    calls = [[c["function"]["name"], c["function"]["arguments"]] for c in message["tool_calls"]]
    return message["content"] == reply.content and _same(calls, [[reply.name, reply.arguments]])


async def _post(http: aiohttp.ClientSession, url: str, secret: str, raw: bytes) -> Any:
    headers = {"Authorization": f"Bearer {secret}", "Content-Type": "application/json"}
    async with http.post(url, data=raw, headers=headers) as response:
        body = await response.json()
        assert response.status == 200, body
        return body


def _reply_turn(protocol: str, body: Any, index: int) -> Turn:
    """The model's reply as the client echoes it (with a tool result of its own)."""
    if protocol == "openai":
        message = body["choices"][0]["message"]
        call = message["tool_calls"][0]
        return Turn(
            call["id"],
            call["function"]["name"],
            json.loads(call["function"]["arguments"]),
            f"result {index} ü",
            content=message.get("content") or "",
            reasoning=message.get("reasoning_content") or "",
            echo_of=index,
        )
    blocks = {block["type"]: block for block in body["content"]}
    use = blocks["tool_use"]
    return Turn(
        use["id"],
        use["name"],
        use["input"],
        f"result {index} ü",
        content=blocks.get("text", {}).get("text", ""),
        reasoning=blocks.get("thinking", {}).get("thinking", ""),
        echo_of=index,
    )


def _apply(client: Client, op: tuple[str, Any, Any], last: Turn | None) -> None:
    kind, a, b = op
    fabricated = [t for t in client.turns if t.echo_of is None]
    if kind == "grow":
        n = len(client.turns)
        client.turns.append(Turn(f"call_f{n}", "probe", a, "ok " * b + "é"))
    elif kind == "echo" and last is not None and all(t is not last for t in client.turns):
        client.turns.append(last)
    elif kind == "tools":
        client.schema = _reordered(client.schema)
    elif kind in ("retype", "reorder", "replace") and fabricated:
        turn = fabricated[a % len(fabricated)]
        if kind == "reorder":
            turn.arguments = _reordered(turn.arguments)
        elif kind == "replace":
            turn.arguments = b
        else:  # the same path, another JSON type (often one Python calls equal)
            name = list(turn.arguments)[a % len(turn.arguments)]
            turn.arguments = {**turn.arguments, name: b}


async def _scenario(ops: list[tuple[str, Any, Any]], protocols: list[str]) -> None:
    reference = Reference()
    client = Client(turns=[Turn("call_f0", "probe", {"flag": 1, "path": "é"}, "ok")])
    async with gateway_env({KEY: [tool_turn("ls é")]}) as env, aiohttp.ClientSession() as http:
        session = await env.open()
        last: Turn | None = None
        for index, op in enumerate([("none", 0, 0), *ops]):
            protocol = protocols[index % len(protocols)]
            _apply(client, op, last)
            if protocol == "openai":
                raw = client.openai_body()
                conv = openai_conversation(json.loads(raw))
                url = env.openai_url(session) + "/chat/completions"
            else:
                raw = client.anthropic_body()
                conv = anthropic_conversation(json.loads(raw))
                url = env.anthropic_url(session) + "/v1/messages"
            expected = reference.prompt(client, conv)
            body = await _post(http, url, session.secret, raw)
            prompt, output = env.replay.stats.requests_seen[index]
            assert prompt == expected, f"call {index} ({op[0]}, {protocol}): not what was sent"
            client.sent.append(conv)
            reference.prompts.append(prompt)
            reference.outputs.append(output)
            last = _reply_turn(protocol, body, index)
            client.replies.append(last)


@settings(
    max_examples=int(os.environ.get("SWERL_GATEWAY_PROPERTY_EXAMPLES", "25")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(OPS, PROTOCOLS)
def test_the_policy_is_sent_a_fresh_render_of_exactly_what_the_client_sent(
    ops: list[tuple[str, Any, Any]], protocols: list[str]
) -> None:
    asyncio.run(_scenario(ops, protocols))


def test_true_after_one_at_the_same_place_reaches_the_policy_as_true() -> None:
    """The reported case: a tool argument `1`, then `true` at the same place (Anthropic's
    `input`, an object); the second prompt holds `true`."""
    ops = [("retype", 0, True), ("retype", 0, 1.0), ("retype", 0, "1"), ("reorder", 0, None)]
    asyncio.run(_scenario(ops, ["anthropic"] * 5))


def test_the_values_the_property_varies_render_as_different_prompts() -> None:
    # So the checks above can fail: `1` rendered where `true` was sent is another prompt.
    reference = Reference()
    one = reference.renderer.full([_probe_call({"flag": 1})], None)
    true = reference.renderer.full([_probe_call({"flag": True})], None)
    reordered = reference.renderer.full([_probe_call({"path": "é", "flag": 1})], None)
    assert len({tuple(one), tuple(true), tuple(reordered)}) == 3


def _probe_call(arguments: dict[str, Any]) -> dict[str, Any]:
    call = {"id": "c", "type": "function", "function": {"name": "probe", "arguments": arguments}}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


EDITS = st.lists(
    st.tuples(st.sampled_from(["grow", "replace", "retype", "reorder"]), ARGS, LEAF),
    min_size=1,
    max_size=6,
)


@settings(max_examples=200, deadline=None)
@given(EDITS, st.sampled_from(["openai", "anthropic"]))
def test_the_incremental_reader_converts_as_a_fresh_read_does(
    edits: list[tuple[str, dict[str, Any], Any]], protocol: str
) -> None:
    """Messages and keys of each read are JSON-identical to a fresh conversion of the body,
    whatever values and key orders the history's tool arguments take from call to call."""
    convert = openai_conversation if protocol == "openai" else anthropic_conversation
    reader = ConversationReader(convert)
    client = Client(turns=[Turn("call_f0", "probe", {"flag": 1, "n": 0.0}, "ok")])
    for kind, arguments, value in edits:
        last = client.turns[-1]
        if kind == "grow":
            client.turns.append(Turn(f"call_f{len(client.turns)}", "probe", arguments, "ok"))
        elif kind == "replace":
            last.arguments = arguments
        elif kind == "reorder":
            last.arguments = _reordered(last.arguments)
        else:
            last.arguments = {**last.arguments, next(iter(last.arguments)): value}
        raw = client.openai_body() if protocol == "openai" else client.anthropic_body()
        got, fresh = reader.read(raw), convert(json.loads(raw))
        assert _same(got.messages, fresh.messages)
        assert got.keys == [message_key(m) for m in fresh.messages]
        assert got.tools_key() == fresh.tools_key()


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ({"flag": True}, {"flag": 1}),
        ({"flag": 1}, {"flag": 1.0}),
        ({"flag": 1}, {"flag": "1"}),
        ({"flag": 0.0}, {"flag": -0.0}),
        ({"a": 1, "b": 2}, {"b": 2, "a": 1}),
        ({"a": [True]}, {"a": [1]}),
    ],
)
def test_messages_json_tells_apart_have_different_keys(a: dict, b: dict) -> None:
    assert message_key(_probe_call(a)) != message_key(_probe_call(b))
