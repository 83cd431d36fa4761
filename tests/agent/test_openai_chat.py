"""OPENAI_CHAT mode: a hosted chat model is evaluated on a bundled task (text only, no tokens)."""

from __future__ import annotations

import pytest
from agent_testkit import (
    agent_stack,
    bundled_tasks,
    result_of,
    run_to_result,
    sandboxes_left,
    start_for,
)
from aiohttp import web

from swerl.agent.replay import gold_script
from swerl.agent.v1 import agent_pb2 as pb

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
