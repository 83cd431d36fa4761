"""A harness episode's model: its own gateway session (swerl.agent.harnesses.model), on the real
stack (dockerd, pool, exec node, agent on port 0, the replay policy server speaking SGLang's
/generate). The harness here is a test harness behind swerl's `Harness` Protocol that talks to
its session with the real `openai` SDK and runs the policy's bash tool calls in its sandbox."""

from __future__ import annotations

import asyncio
import base64
import json

import grpc
import openai
import pytest
from testkit.agent import (
    agent_stack,
    assert_no_active_lease,
    bundled_tasks,
    check_record,
    node_of,
    result_of,
    run_to_result,
    sandboxes_left,
    start_for,
)

from swerl.agent.actions.toolcalls import get_tool_call_format
from swerl.agent.harnesses import HARNESSES, HarnessRun
from swerl.agent.status import EpisodeStatus
from swerl.agent.v1 import agent_pb2 as pb
from swerl.chassis.client import error_info
from swerl.chassis.timeconv import duration_pb
from swerl.devservers.replay import ReplayPolicyServer, script_key
from swerl.exec.v1 import evaluate_pb2

pytestmark = pytest.mark.usefixtures("base_image")

BASH = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a command",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    },
}


def _call(text: str, command: str) -> str:
    return text + "\n" + get_tool_call_format("qwen25").render_call("bash", {"command": command})


def _script(patch: str) -> list[str]:
    encoded = base64.b64encode(patch.encode()).decode()
    return [
        _call("Looking first.", "git status --short && ls"),
        _call("Fixing.", f"echo {encoded} | base64 -d | git apply && git diff --stat"),
        "Done.",
    ]


class ChatHarness:
    """Chats with its gateway session (openai SDK) and runs each bash call in the sandbox until
    a reply has no call; the sandbox's diff is graded. `hold` blocks before call `hold_at`."""

    timeout_status = EpisodeStatus.HARNESS_TIMEOUT

    def __init__(self, name: str) -> None:
        self.name = name
        self.model = None
        self.calls = 0
        self.hold_at: int | None = None
        self.holding = asyncio.Event()
        self.release = asyncio.Event()
        self.cancels = 0
        self.errors: list[str] = []

    async def prepare(self, run: HarnessRun) -> None:
        assert run.model is not None
        self.model = run.model

    async def run(self, run: HarnessRun) -> str | None:
        assert run.model is not None
        client = openai.AsyncOpenAI(
            base_url=run.model.openai_base_url, api_key=run.model.api_key, max_retries=0
        )
        messages: list[dict] = [
            {"role": "system", "content": "You fix bugs."},
            {"role": "user", "content": run.spec.instance.problem_statement},
        ]
        try:
            while True:
                if self.hold_at is not None and self.calls == self.hold_at:
                    self.holding.set()
                    await self.release.wait()
                self.calls += 1
                try:
                    reply = await client.chat.completions.create(
                        model=run.model.model, messages=messages, tools=[BASH]
                    )
                except openai.APIError as err:
                    self.errors.append(type(err).__name__)
                    await asyncio.sleep(3600)  # a harness that retries forever
                message = reply.choices[0].message
                calls = message.tool_calls or []
                messages.append(
                    {
                        "role": "assistant",
                        "content": message.content,
                        **({"tool_calls": [c.model_dump() for c in calls]} if calls else {}),
                    }
                )
                if not calls:
                    return None
                for call in calls:
                    command = json.loads(call.function.arguments)["command"]
                    result = await run.sandbox.run(
                        command, timeout_s=60, env={}, cwd=run.spec.config.workdir
                    )
                    messages.append(
                        {
                            "role": "tool",
                            "tool_call_id": call.id,
                            "content": result.output.decode(errors="replace"),
                        }
                    )
        finally:
            await client.close()

    async def cancel(self) -> None:
        self.cancels += 1

    def log(self) -> bytes:
        return b""


@pytest.fixture
def chat_harness(monkeypatch):
    one = ChatHarness("test-chat")
    monkeypatch.setitem(HARNESSES, one.name, lambda: one)
    return one


def _start(task, url: str, episode_id: str, harness: str, wall_s: float = 180.0):
    start = start_for(task, url, episode_id)
    start.options.harness = harness
    start.limits.wall_timeout.CopyFrom(duration_pb(wall_s))
    return start


async def test_a_harness_session_is_the_episodes_policy_and_its_chain_is_the_sample(
    chat_harness,
):
    task = bundled_tasks()[0]
    key = script_key(task.instance["problem_statement"])
    replay = ReplayPolicyServer({key: _script(task.gold_patch)}, keep_requests=True)
    url = await replay.start()
    try:
        async with agent_stack() as env:
            start = _start(task, url, "hm-gold", chat_harness.name)
            start.policy.lora_path = "adapter-7"
            start.policy.sampling_params.update({"sampling_seed": 1234})
            result = result_of(await run_to_result(env.stub, start))
            await assert_no_active_lease(env)
            gateway = env.agent.runner.gateway
            assert gateway is not None
            session = gateway.store.get(chat_harness.model.session_id)
            node = node_of(env)
    finally:
        await replay.stop()
    assert result.status == pb.EPISODE_STATUS_SUBMITTED, result.error_message
    assert result.report.status == evaluate_pb2.EVALUATION_STATUS_RESOLVED_FULL
    assert result.reward == 1.0
    # The episode's policy: every call with its LoRA adapter and sampling params, routed by
    # the session id; the session ended with the episode.
    assert len(replay.stats.calls) == 3
    for call in replay.stats.calls:
        assert call.script_key == key
        assert call.lora_path == "adapter-7" and call.sampling_seed == 1234
    assert session.ended and session.spec.lora_path == "adapter-7"
    # One chain: the sample is exactly the last request's ids + what was sampled, its mask 1
    # only on sampled ids (with the logprobs the policy sent), the episode's reward on it.
    assert not result.chains
    record = result.trajectory
    check_record(record, replay)
    last_in, last_out = replay.stats.requests_seen[-1]
    assert list(record.prompt_ids) + list(record.response_ids) == last_in + last_out
    first_in, _ = replay.stats.requests_seen[0]
    assert list(record.prompt_ids) == first_in
    sampled = sum(len(out) for _, out in replay.stats.requests_seen)
    assert sum(record.loss_mask) == sampled
    assert record.reward == 1.0
    assert result.metrics["gateway_calls"] == 3.0
    assert sandboxes_left(node) == []


async def test_a_policy_down_mid_run_ends_a_harness_episode_infra_error_at_once(chat_harness):
    task = bundled_tasks()[0]
    key = script_key(task.instance["problem_statement"])
    replay = ReplayPolicyServer({key: _script(task.gold_patch)}, fault_control=True)
    url = await replay.start()
    chat_harness.hold_at = 1
    try:
        async with agent_stack(policy_connect_attempts=1) as env:
            call = env.stub.RunEpisode(timeout=300)
            await call.write(pb.RunEpisodeRequest(start=_start(task, url, "hm-down", "test-chat")))
            await asyncio.wait_for(chat_harness.holding.wait(), 120)
            replay.inject_fault("error", 120.0)
            chat_harness.release.set()
            result = result_of([message async for message in call])
            await assert_no_active_lease(env)
            node = node_of(env)
    finally:
        await replay.stop()
    # The harness would retry forever; the episode ends on the gateway's PolicyDown.
    assert result.status == pb.EPISODE_STATUS_INFRA_ERROR
    assert result.error_reason == "POLICY_ERROR"  # HTTP 500 from the policy server
    assert "500" in result.error_message
    assert not result.HasField("reward") and not result.HasField("report")
    assert chat_harness.errors == ["InternalServerError"]
    assert chat_harness.cancels == 1
    assert sandboxes_left(node) == []


@pytest.mark.parametrize(
    ("api", "field", "option"),
    [
        (pb.POLICY_API_OPENAI_CHAT, "policy.api", None),
        (pb.POLICY_API_SGLANG_GENERATE, "options.dynamic_history", "dynamic_history"),
    ],
)
async def test_a_harness_episode_needs_exact_tokens_and_whole_chains(
    chat_harness, api, field, option
):
    task = bundled_tasks()[0]
    async with agent_stack() as env:
        start = _start(task, "http://127.0.0.1:9", "hm-bad", chat_harness.name)
        start.policy.api = api
        if option:
            setattr(start.options, option, True)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await run_to_result(env.stub, start)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    reason, metadata = error_info(caught.value)
    assert reason == "INVALID_EPISODE_START"
    assert metadata.get("field") == field


async def test_a_served_gateway_at_its_session_limit_ends_a_harness_episode_infra_error(
    chat_harness,
):
    task = bundled_tasks()[0]
    async with agent_stack(gateway_port=0, gateway_max_sessions=0) as env:
        # The agent's served gateway is the one harness episodes open their sessions on.
        assert env.agent.runner.gateway is env.agent.gateway
        start = _start(task, "http://127.0.0.1:9", "hm-capacity", chat_harness.name)
        result = result_of(await run_to_result(env.stub, start))
        await assert_no_active_lease(env)
        node = node_of(env)
    assert result.status == pb.EPISODE_STATUS_INFRA_ERROR
    assert result.error_reason == "GATEWAY_AT_CAPACITY"
    assert "open sessions" in result.error_message
    assert chat_harness.model is None  # the harness never started
    assert not result.HasField("reward")
    assert sandboxes_left(node) == []
