"""OPENAI_CHAT mode: a hosted chat model is evaluated on a bundled task (text only, no tokens)."""

from __future__ import annotations

import json

import pytest
from aiohttp import web
from testkit.agent import (
    agent_stack,
    bundled_tasks,
    result_of,
    run_to_result,
    sandboxes_left,
    start_for,
)

from swerl.agent.v1 import agent_pb2 as pb
from swerl.devservers.replay import gold_script

pytestmark = pytest.mark.usefixtures("base_image")


async def test_a_chat_model_solves_a_task_and_gets_a_reward_without_token_records() -> None:
    task = bundled_tasks()[0]
    script = gold_script(task.gold_patch)
    seen: list[dict] = []

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(
            {
                "auth": request.headers.get("Authorization"),
                "routing": request.headers.get("X-Session"),
                **body,
            }
        )
        turn = sum(1 for m in body["messages"] if m["role"] == "assistant")
        reply = script[min(turn, len(script) - 1)]
        return web.json_response(
            {
                "choices": [
                    {"message": {"role": "assistant", "content": reply}, "finish_reason": "stop"}
                ]
            }
        )

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    start = start_for(task, url, "chat")
    start.policy.api = pb.POLICY_API_OPENAI_CHAT
    start.policy.model = "hosted-model"
    start.policy.tokenizer_path = ""
    try:
        async with agent_stack(openai_api_key="sk-test", routing_key_header="X-Session") as env:
            result = result_of(await run_to_result(env.stub, start))
    finally:
        await runner.cleanup()
    assert result.status == pb.EPISODE_STATUS_SUBMITTED and result.reward == 1.0
    assert not result.HasField("trajectory") and len(result.turns) == 0
    assert result.metrics["turns"] == 4
    assert seen[0]["model"] == "hosted-model" and seen[0]["auth"] == "Bearer sk-test"
    assert seen[0]["temperature"] == 1.0 and seen[0]["max_tokens"] == 2048
    assert [m["role"] for m in seen[1]["messages"]] == ["system", "user", "assistant", "user"]
    # The routing key goes under the header name the agent is configured with.
    assert [s["routing"] for s in seen] == ["chat"] * 4
    assert sandboxes_left() == []


async def test_a_chat_model_with_the_tools_config_gets_tools_and_its_tool_calls_run() -> None:
    task = bundled_tasks()[0]
    calls = [
        [("bash", {"command": "ls"})],
        [
            (
                "str_replace_editor",
                {"command": "create", "path": "/tmp/fix.patch", "file_text": task.gold_patch},
            ),
            ("bash", {"command": "git apply /tmp/fix.patch"}),
            # Arguments that are not JSON: a tool error the model reads, the turn goes on.
            ("bash", "{not json"),
        ],
        [("submit", {})],
    ]
    seen: list[dict] = []

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        turn = sum(1 for m in body["messages"] if m["role"] == "assistant")
        tool_calls = [
            {
                "id": f"call_{turn}_{i}",
                "type": "function",
                "function": {
                    "name": name,
                    "arguments": args if isinstance(args, str) else json.dumps(args),
                },
            }
            for i, (name, args) in enumerate(calls[min(turn, len(calls) - 1)])
        ]
        message = {"role": "assistant", "content": None, "tool_calls": tool_calls}
        return web.json_response({"choices": [{"message": message, "finish_reason": "tool_calls"}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    start = start_for(task, url, "chat-tools")
    start.policy.api = pb.POLICY_API_OPENAI_CHAT
    start.policy.model = "hosted-model"
    start.policy.tokenizer_path = ""
    start.options.config_name = "tools"
    try:
        async with agent_stack(openai_api_key="sk-test") as env:
            messages = await run_to_result(env.stub, start)
    finally:
        await runner.cleanup()
    result = result_of(messages)
    assert result.status == pb.EPISODE_STATUS_SUBMITTED and result.reward == 1.0
    assert [t["function"]["name"] for t in seen[0]["tools"]] == [
        "bash",
        "str_replace_editor",
        "submit",
    ]
    # The second request holds the assistant's tool calls and one tool message per call.
    history = seen[2]["messages"]
    assert [m["role"] for m in history] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "tool",
        "tool",
    ]
    assert history[2]["tool_calls"][0]["id"] == history[3]["tool_call_id"] == "call_0_0"
    assert [m["tool_call_id"] for m in history[5:]] == ["call_1_0", "call_1_1", "call_1_2"]
    assert history[7]["content"].startswith("Error: malformed tool call: invalid JSON arguments")
    assert result.metrics["tool_calls"] == 4 and result.metrics["tool_parse_failures"] == 1
    turns = [m.turn for m in messages if m.WhichOneof("kind") == "turn"]
    assert [t.format_error for t in turns] == [False, True, False]
