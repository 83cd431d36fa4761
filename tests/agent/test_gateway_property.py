"""Property: for random sessions — tool calls, reasoning, histories rewritten midway, sub-agents
interleaved and concurrent, OpenAI and Anthropic calls mixed — every recorded chain is exactly
what /generate was sent plus what it returned, loss mask 1 lies exactly on sampled ids (each
call's ids trained once over all chains), and a rewritten history forks, never corrupts.

Checked against the replay policy's own log of requests, not against the gateway's tree."""

from __future__ import annotations

import asyncio
import json
import os

import anthropic
import openai
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from testkit.gateway import ANTHROPIC_BASH_TOOL, BASH_TOOL, gateway_env, tool_turn

from swerl.agent.gateway.tree import CallKind

AGENT_KEYS = ["MAIN-AGENT-KEY", "SUB-AGENT-KEY-A", "SUB-AGENT-KEY-B"]
# Each agent's script: tool calls with reasoning, a plain answer, tool calls again.
SCRIPTS = {
    key: [
        tool_turn(f"ls dir{i}", f"Step {i} of {key}.") if i % 3 != 1 else f"Plain note {i}."
        for i in range(12)
    ]
    for key in AGENT_KEYS
}

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("call"), st.integers(0, 2), st.sampled_from(["openai", "anthropic"])),
        st.tuples(st.just("rewrite"), st.integers(0, 2), st.integers(0, 4)),
        st.tuples(st.just("together"), st.integers(0, 2), st.integers(0, 2)),
    ),
    min_size=3,
    max_size=10,
)


class Agent:
    """One conversation of a harness: its messages in OpenAI form (the protocol that sends a
    call converts them)."""

    def __init__(self, key: str) -> None:
        self.messages: list[dict] = [
            {"role": "system", "content": f"You are {key}."},
            {"role": "user", "content": f"{key}: fix the bug."},
        ]


async def _openai_call(client: openai.AsyncOpenAI, agent: Agent) -> None:
    reply = await client.chat.completions.create(
        model="m", messages=agent.messages, tools=[BASH_TOOL]
    )
    message = reply.choices[0].message
    agent.messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls or []:
        agent.messages.append({"role": "tool", "tool_call_id": call.id, "content": "out"})
    if not message.tool_calls:
        agent.messages.append({"role": "user", "content": "Go on."})


def _to_anthropic(messages: list[dict]) -> tuple[str, list[dict]]:
    system = messages[0]["content"]
    out: list[dict] = []
    for message in messages[1:]:
        if message["role"] == "assistant":
            blocks = []
            if message.get("reasoning_content"):
                blocks.append(
                    {"type": "thinking", "thinking": message["reasoning_content"], "signature": ""}
                )
            if message.get("content"):
                blocks.append({"type": "text", "text": message["content"]})
            for call in message.get("tool_calls") or []:
                blocks.append(
                    {
                        "type": "tool_use",
                        "id": call["id"],
                        "name": call["function"]["name"],
                        "input": json.loads(call["function"]["arguments"]),
                    }
                )
            out.append({"role": "assistant", "content": blocks})
        elif message["role"] == "tool":
            block = {"type": "tool_result", "tool_use_id": message["tool_call_id"]}
            block["content"] = message["content"]
            if out and out[-1]["role"] == "user" and isinstance(out[-1]["content"], list):
                out[-1]["content"].append(block)
            else:
                out.append({"role": "user", "content": [block]})
        else:
            out.append({"role": "user", "content": message["content"]})
    return system, out


async def _anthropic_call(client: anthropic.AsyncAnthropic, agent: Agent) -> None:
    system, messages = _to_anthropic(agent.messages)
    reply = await client.messages.create(
        model="m", max_tokens=512, system=system, messages=messages, tools=[ANTHROPIC_BASH_TOOL]
    )
    assistant: dict = {"role": "assistant", "content": ""}
    calls = []
    for block in reply.content:
        if block.type == "text":
            assistant["content"] = block.text
        elif block.type == "thinking":
            assistant["reasoning_content"] = block.thinking
        elif block.type == "tool_use":
            calls.append(
                {
                    "id": block.id,
                    "type": "function",
                    "function": {"name": block.name, "arguments": json.dumps(block.input)},
                }
            )
    if calls:
        assistant["tool_calls"] = calls
    agent.messages.append(assistant)
    for call in calls:
        agent.messages.append({"role": "tool", "tool_call_id": call["id"], "content": "out"})
    if not calls:
        agent.messages.append({"role": "user", "content": "Go on."})


def _check(records, sent: list[tuple[list[int], list[int]]]) -> None:
    # A list, not a set: two calls may send the same prompt (a retried turn) and each is a call.
    requests = [(tuple(i), tuple(o)) for i, o in sent]
    trained: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for record in records:
        prompt, response = list(record.prompt_ids), list(record.response_ids)
        tokens = prompt + response
        assert len(record.loss_mask) == len(response) == len(record.logprobs)
        # The chain is exactly one request plus what it returned (its leaf call).
        assert any(tokens == list(i) + list(o) for i, o in requests)
        # Every run of mask 1 is a sampled output, given exactly the tokens before it.
        pos = 0
        while pos < len(response):
            if not record.loss_mask[pos]:
                assert record.logprobs[pos] == 0.0
                pos += 1
                continue
            end = pos
            while end < len(response) and record.loss_mask[end]:
                end += 1
            before = tuple(tokens[: len(prompt) + pos])
            match = [
                o for i, o in requests if i == before and response[pos : pos + len(o)] == list(o)
            ]
            assert match, "a trained run is not what the policy returned for that prompt"
            output = max(match, key=len)
            assert len(output) <= end - pos
            trained.append((before, output))
            pos += len(output)
    # Each call's sampled ids are trained exactly once over all chains.
    assert sorted(trained) == sorted(requests)


async def _scenario(ops: list[tuple]) -> None:
    async with gateway_env(SCRIPTS) as env:
        session = await env.open()
        oa = openai.AsyncOpenAI(base_url=env.openai_url(session), api_key=session.secret)
        an = anthropic.AsyncAnthropic(base_url=env.anthropic_url(session), api_key=session.secret)
        agents = [Agent(key) for key in AGENT_KEYS]

        async def call(agent: Agent, protocol: str) -> None:
            if protocol == "openai":
                await _openai_call(oa, agent)
            else:
                await _anthropic_call(an, agent)

        try:
            for op, a, arg in ops:
                agent = agents[a]
                if op == "call":
                    await call(agent, arg)
                elif op == "together":  # two sub-agents' calls in flight at once
                    await asyncio.gather(call(agent, "openai"), call(agents[arg], "anthropic"))
                else:  # a compaction: keep the first messages, summarize the rest
                    before = len(session.tree.calls)
                    tips = {node.index for node in session.tree.leaves()}
                    keep = 2 + arg
                    summary = {
                        "role": "user",
                        "content": f"Summary of {len(agent.messages)} turns.",
                    }
                    agent.messages = [*agent.messages[:keep], summary]
                    await call(agent, "openai")
                    node = session.tree.calls[before]
                    # Continuing a recorded call that already has a successor is a fork.
                    if node.parent is not None and node.parent.index not in tips:
                        assert node.kind is CallKind.FORK
                    else:
                        assert node.kind in (CallKind.ROOT, CallKind.EXTEND)
        finally:
            await oa.close()
            await an.close()
        records = env.gateway.store.close(session.id)
        sent = [(list(i), list(o)) for i, o in env.replay.stats.requests_seen]
        assert len(sent) == len(session.tree.calls)
        _check(records, sent)


@settings(
    max_examples=int(os.environ.get("SWERL_GATEWAY_PROPERTY_EXAMPLES", "12")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(OPS)
def test_random_sessions_record_exact_chains_and_fork_on_rewrites(ops) -> None:
    asyncio.run(_scenario(ops))
