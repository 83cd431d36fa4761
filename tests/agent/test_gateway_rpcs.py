"""The session RPCs (OpenSession / GetSession / CloseSession) on a real agent gRPC server with
its gateway port: the round trip, idempotency, every refusal's status and reason, and grpcurl
driving a session around one call of the `openai` SDK."""

from __future__ import annotations

import json

import grpc
import openai
import pytest
from google.protobuf import struct_pb2
from testkit.gateway import BASH_TOOL, KEY, SCRIPT, TOKENIZER
from testkit.grpcurl import Grpcurl, json_messages

from swerl.agent.server import AgentServer
from swerl.agent.settings import GATEWAY_CPU_THREADS, AgentSettings
from swerl.agent.v1 import agent_pb2 as pb
from swerl.agent.v1 import agent_pb2_grpc
from swerl.chassis.client import error_info, make_channel
from swerl.devservers.replay import ReplayPolicyServer

TOKEN = "gateway-rpc-token"


class NoSandboxes:
    """Sessions need no sandbox; an episode here would be a test bug."""

    def lease(self, *args, **kwargs):
        raise AssertionError("no episode runs in these tests")


@pytest.fixture
async def replay():
    server = ReplayPolicyServer({KEY: SCRIPT}, keep_requests=True)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def _agent(gateway: bool, max_sessions: int = 4096) -> AgentServer:
    settings = AgentSettings(
        host="127.0.0.1",
        port=0,
        auth_token=TOKEN,
        log_level="warning",
        tokenizer_processes=0,
        gateway_port=0 if gateway else None,
        gateway_max_sessions=max_sessions,
    )
    server = AgentServer(settings, provider=NoSandboxes())  # type: ignore[arg-type]
    await server.start()
    return server


@pytest.fixture
async def agent():
    server = await _agent(gateway=True)
    channel = make_channel(server.address, token=TOKEN)
    try:
        yield agent_pb2_grpc.AgentServiceStub(channel), server
    finally:
        await channel.close()
        await server.stop(0)


def _open(url: str, **fields) -> pb.OpenSessionRequest:
    params = struct_pb2.Struct()
    params.update({"temperature": 1.0, "max_new_tokens": 256})
    request = pb.OpenSessionRequest(
        request_id="open-1",
        policy=pb.PolicyConfig(
            endpoint=url, tokenizer_path=TOKENIZER, model="qwen3", sampling_params=params
        ),
        max_context_tokens=8192,
        owner="rollout-3",
    )
    for name, value in fields.items():
        setattr(request, name, value)
    return request


async def _refused(call, code: grpc.StatusCode, reason: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    assert err.value.code() == code
    assert error_info(err.value)[0] == reason


async def test_open_call_get_close_returns_the_chain_with_the_reward(agent, replay) -> None:
    stub, server = agent
    # The agent's gateway renders in a CPU pool of its own (one thread), not the episodes'.
    assert server.gateway._executor is server.runner.gateway_executor
    assert server.runner.gateway_executor._max_workers == GATEWAY_CPU_THREADS
    request = _open(replay.url)
    request.policy.lora_path = "policy-lora-7"
    opened = await stub.OpenSession(request, timeout=30)
    assert opened.openai_base_url.endswith(f"/s/{opened.session_id}/v1")
    assert opened.anthropic_base_url.endswith(f"/s/{opened.session_id}")
    again = await stub.OpenSession(_open(replay.url), timeout=30)
    assert again.session_id == opened.session_id and again.secret == opened.secret
    async with openai.AsyncOpenAI(base_url=opened.openai_base_url, api_key=opened.secret) as client:
        reply = await client.chat.completions.create(
            model="qwen3",
            messages=[{"role": "user", "content": f"{KEY}: go"}],
            tools=[BASH_TOOL],
        )
    assert reply.choices[0].message.tool_calls[0].function.name == "bash"
    # The routing key is the session id; sampling params are the session's.
    call = replay.stats.calls[0]
    assert call.headers.get("X-SMG-Routing-Key") == opened.session_id
    assert call.lora_path == "policy-lora-7"  # PolicyConfig.lora_path, on every call
    live = await stub.GetSession(pb.GetSessionRequest(session_id=opened.session_id), timeout=10)
    assert live.status == pb.SESSION_STATUS_OPEN and live.owner == "rollout-3"
    assert [c.kind for c in live.calls] == [pb.SESSION_CALL_KIND_ROOT]
    assert live.calls[0].protocol == "openai" and live.calls[0].tool_calls == 1
    assert live.metrics["gateway_calls"] == 1 and live.metrics["tool_calls"] == 1
    assert live.calls[0].request_messages == live.calls[0].rendered_messages == 1
    assert live.metrics["gateway_sampled_tokens"] == len(replay.stats.requests_seen[0][1])
    assert live.metrics["model_query_time_sum"] > 0
    close = pb.CloseSessionRequest(request_id="close-1", session_id=opened.session_id, reward=1.0)
    closed = await stub.CloseSession(close, timeout=30)
    assert closed.status == pb.SESSION_STATUS_CLOSED and len(closed.records) == 1
    record = closed.records[0]
    sent, got = replay.stats.requests_seen[0]
    assert list(record.prompt_ids) == sent and list(record.response_ids) == got
    assert list(record.loss_mask) == [1] * len(got) and record.reward == 1.0
    assert record.weight_versions == ["replay-1"]
    assert await stub.CloseSession(close, timeout=30) == closed
    await _refused(
        stub.CloseSession(
            pb.CloseSessionRequest(request_id="close-2", session_id=opened.session_id), timeout=10
        ),
        grpc.StatusCode.FAILED_PRECONDITION,
        "SESSION_CLOSED",
    )


async def test_unknown_sessions_are_not_found(agent) -> None:
    stub, _ = agent
    await _refused(
        stub.GetSession(pb.GetSessionRequest(session_id="nope"), timeout=10),
        grpc.StatusCode.NOT_FOUND,
        "SESSION_NOT_FOUND",
    )
    await _refused(
        stub.CloseSession(pb.CloseSessionRequest(session_id="nope"), timeout=10),
        grpc.StatusCode.NOT_FOUND,
        "SESSION_NOT_FOUND",
    )


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"policy": pb.PolicyConfig(tokenizer_path=TOKENIZER)}, "INVALID_SESSION_SPEC"),
        ({"policy": pb.PolicyConfig(endpoint="http://x")}, "INVALID_SESSION_SPEC"),
        (
            {
                "policy": pb.PolicyConfig(
                    endpoint="http://x", tokenizer_path=TOKENIZER, api=pb.POLICY_API_OPENAI_CHAT
                )
            },
            "INVALID_SESSION_SPEC",
        ),
        ({"tool_call_parser": "nonesuch"}, "INVALID_SESSION_SPEC"),
        ({"reasoning_parser": "nonesuch"}, "INVALID_SESSION_SPEC"),
        ({"max_context_tokens": -1}, "INVALID_SESSION_SPEC"),
        (
            {"policy": pb.PolicyConfig(endpoint="http://x", tokenizer_path="/nonexistent/tok")},
            "TOKENIZER_UNAVAILABLE",
        ),
    ],
)
async def test_bad_open_requests_are_invalid_argument(agent, change, reason) -> None:
    stub, _ = agent
    request = _open("http://127.0.0.1:9", request_id="")
    for name, value in change.items():
        if name == "policy":
            request.policy.CopyFrom(value)
        else:
            setattr(request, name, value)
    await _refused(stub.OpenSession(request, timeout=30), grpc.StatusCode.INVALID_ARGUMENT, reason)


async def test_an_agent_without_a_gateway_refuses_sessions() -> None:
    server = await _agent(gateway=False)
    channel = make_channel(server.address, token=TOKEN)
    try:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        await _refused(
            stub.OpenSession(_open("http://127.0.0.1:9"), timeout=10),
            grpc.StatusCode.FAILED_PRECONDITION,
            "GATEWAY_DISABLED",
        )
    finally:
        await channel.close()
        await server.stop(0)


async def test_abort_on_close_ends_the_session_aborted(agent, replay) -> None:
    stub, _ = agent
    opened = await stub.OpenSession(_open(replay.url, request_id="a"), timeout=30)
    closed = await stub.CloseSession(
        pb.CloseSessionRequest(session_id=opened.session_id, abort=True, reward=0.0), timeout=10
    )
    assert closed.status == pb.SESSION_STATUS_ABORTED and not closed.records
    async with openai.AsyncOpenAI(
        base_url=opened.openai_base_url, api_key=opened.secret, max_retries=0
    ) as client:
        with pytest.raises(openai.APIStatusError) as err:
            await client.chat.completions.create(
                model="qwen3", messages=[{"role": "user", "content": "x"}]
            )
    assert err.value.status_code == 410


async def test_grpcurl_opens_a_session_the_openai_sdk_calls_and_grpcurl_closes_it(
    agent, replay, grpcurl_bin
) -> None:
    _, server = agent
    grpcurl = Grpcurl(grpcurl_bin, server.address)

    async def ok(method: str, body: dict) -> dict:
        done = await grpcurl(method, flags=("-d", json.dumps(body)), token=TOKEN)
        assert done.returncode == 0, done.stderr
        return json_messages(done.stdout)[0]

    open_body = {
        "request_id": "grpcurl-1",
        "policy": {"endpoint": replay.url, "tokenizer_path": TOKENIZER, "model": "qwen3"},
    }
    opened = await ok("swerl.agent.v1.AgentService/OpenSession", open_body)
    session_id = opened.get("session_id") or opened["sessionId"]
    base_url = opened.get("openai_base_url") or opened["openaiBaseUrl"]
    async with openai.AsyncOpenAI(base_url=base_url, api_key=opened["secret"]) as client:
        reply = await client.chat.completions.create(
            model="qwen3", messages=[{"role": "user", "content": f"{KEY}: go"}], tools=[BASH_TOOL]
        )
    assert reply.choices[0].finish_reason == "tool_calls"
    closed = await ok(
        "swerl.agent.v1.AgentService/CloseSession",
        {"request_id": "c", "session_id": session_id, "reward": 1},
    )
    assert closed["status"] == "SESSION_STATUS_CLOSED"
    record = closed["records"][0]
    sent, got = replay.stats.requests_seen[0]
    assert record["prompt_ids"] == sent and record["response_ids"] == got
    assert record["reward"] == 1
    missing = await grpcurl(
        "swerl.agent.v1.AgentService/GetSession",
        flags=("-d", json.dumps({"session_id": "nope"})),
        token=TOKEN,
    )
    assert missing.returncode != 0 and "NotFound" in missing.stderr


async def test_sessions_past_the_limit_are_refused_until_one_closes(replay) -> None:
    server = await _agent(gateway=True, max_sessions=1)
    channel = make_channel(server.address, token=TOKEN)
    try:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        first = await stub.OpenSession(_open(replay.url, request_id="one"), timeout=30)
        await _refused(
            stub.OpenSession(_open(replay.url, request_id="two"), timeout=30),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "GATEWAY_AT_CAPACITY",
        )
        await stub.CloseSession(pb.CloseSessionRequest(session_id=first.session_id), timeout=10)
        assert (await stub.OpenSession(_open(replay.url, request_id="two"), timeout=30)).secret
    finally:
        await channel.close()
        await server.stop(0)
