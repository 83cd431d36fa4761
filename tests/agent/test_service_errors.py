"""RunEpisode's refusals (status code and ErrorInfo reason) and cancellation, on a real gRPC
server on port 0 with a sandbox provider behind the agent's own Protocol."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest
from testkit.agent import TOKENIZER_DIR, bundled_tasks, result_of, start_for

from swerl.agent.server import AgentServer
from swerl.agent.settings import AgentSettings
from swerl.agent.v1 import agent_pb2 as pb
from swerl.agent.v1 import agent_pb2_grpc
from swerl.chassis.client import error_info, make_channel

TOKEN = "agent-test-token"


class WaitingProvider:
    """Never finds a sandbox: lease() waits until cancelled, and counts what it gave back."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.exited = 0

    @contextlib.asynccontextmanager
    async def lease(self, image, *, owner, instance_id, request_id, workdir, avoid_node_ids=()):
        self.entered.set()
        try:
            await asyncio.Event().wait()
            yield None
        finally:
            self.exited += 1


@pytest.fixture
async def agent():
    provider = WaitingProvider()
    server = AgentServer(
        AgentSettings(
            host="127.0.0.1", port=0, auth_token=TOKEN, log_level="warning", tokenizer_processes=0
        ),
        provider=provider,
    )
    await server.start()
    channel = make_channel(server.address, token=TOKEN)
    try:
        yield agent_pb2_grpc.AgentServiceStub(channel), provider, server
    finally:
        await channel.close()
        await server.stop(0)


def _start(episode_id: str = "e1") -> pb.EpisodeStart:
    return start_for(bundled_tasks()[0], "http://127.0.0.1:9", episode_id)


async def _refused(stub, requests) -> tuple[grpc.StatusCode, str | None]:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in stub.RunEpisode(iter(requests), timeout=30):
            pass
    return caught.value.code(), error_info(caught.value)[0]


async def test_a_stream_without_start_is_invalid_argument(agent) -> None:
    stub, _, _ = agent
    assert await _refused(stub, []) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "EPISODE_START_REQUIRED",
    )
    cancel_first = [pb.RunEpisodeRequest(cancel=pb.EpisodeCancel(reason="x"))]
    assert await _refused(stub, cancel_first) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "EPISODE_START_REQUIRED",
    )


@pytest.mark.parametrize(
    "field",
    [
        "episode_id",
        "image_name",
        "endpoint",
        "tokenizer_path",
        "fail_to_pass",
        "negative_turns",
        "prm_without_endpoint",
        "routed_experts_from_a_chat_api",
        "branch_count_too_large",
        "branch_without_count",
        "branch_at_or_past_max_turns",
        "branch_from_a_chat_api",
        "rid_prefix_on_vllm",
        "cache_key_on_a_chat_api",
    ],
)
async def test_an_incomplete_start_is_invalid_episode_start(agent, field: str) -> None:
    stub, _, _ = agent
    start = _start()
    if field == "episode_id":
        start.episode_id = ""
    elif field == "image_name":
        start.instance.image_name = ""
    elif field == "endpoint":
        start.policy.endpoint = ""
    elif field == "tokenizer_path":
        start.policy.tokenizer_path = ""
    elif field == "fail_to_pass":
        del start.instance.fail_to_pass[:]
    elif field == "prm_without_endpoint":
        start.prm.enabled = True
    elif field == "routed_experts_from_a_chat_api":
        start.policy.api = pb.POLICY_API_OPENAI_CHAT
        start.policy.return_routed_experts = True
    elif field == "branch_count_too_large":
        start.options.branch.at_turn, start.options.branch.count = 1, 65
    elif field == "branch_without_count":
        start.options.branch.at_turn = 2
    elif field == "branch_at_or_past_max_turns":
        start.options.branch.at_turn, start.options.branch.count = 8, 2  # max_turns is 8
    elif field == "branch_from_a_chat_api":
        start.policy.api = pb.POLICY_API_OPENAI_CHAT
        start.options.branch.at_turn, start.options.branch.count = 1, 2
    elif field == "rid_prefix_on_vllm":  # SGLang's rid (miles multi-LoRA), issue 41 point 1
        start.policy.api = pb.POLICY_API_VLLM_GENERATE
        start.policy.request_id_prefix = "team-a::"
    elif field == "cache_key_on_a_chat_api":
        start.policy.api = pb.POLICY_API_OPENAI_CHAT
        start.policy.cache_key = "team-a:v7"
    else:
        start.limits.max_turns = -1
    code, reason = await _refused(stub, [pb.RunEpisodeRequest(start=start)])
    assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_EPISODE_START")


async def test_an_unknown_config_is_refused(agent) -> None:
    stub, _, _ = agent
    start = _start()
    start.options.config_name = "no-such-config"
    assert await _refused(stub, [pb.RunEpisodeRequest(start=start)]) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "UNKNOWN_AGENT_CONFIG",
    )


async def test_a_missing_tokenizer_directory_is_refused(agent, tmp_path) -> None:
    stub, _, _ = agent
    start = _start()
    start.policy.tokenizer_path = str(tmp_path / "nothing-here")
    assert await _refused(stub, [pb.RunEpisodeRequest(start=start)]) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "TOKENIZER_UNAVAILABLE",
    )


async def test_a_call_without_token_is_unauthenticated(agent) -> None:
    _, _, server = agent
    channel = make_channel(server.address)
    try:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        code, reason = await _refused(stub, [pb.RunEpisodeRequest(start=_start())])
    finally:
        await channel.close()
    assert (code, reason) == (grpc.StatusCode.UNAUTHENTICATED, "MISSING_TOKEN")


async def test_a_running_episode_id_is_refused_and_cancel_still_answers(agent) -> None:
    stub, provider, _ = agent
    call = stub.RunEpisode(timeout=30)
    await call.write(pb.RunEpisodeRequest(start=_start("same")))
    await asyncio.wait_for(provider.entered.wait(), 20)
    assert await _refused(stub, [pb.RunEpisodeRequest(start=_start("same"))]) == (
        grpc.StatusCode.ALREADY_EXISTS,
        "EPISODE_RUNNING",
    )
    sent = time.monotonic()
    await call.write(pb.RunEpisodeRequest(cancel=pb.EpisodeCancel(reason="test")))
    result = result_of([m async for m in call])
    assert time.monotonic() - sent < 1.0
    assert result.status == pb.EPISODE_STATUS_CANCELLED and not result.HasField("reward")
    assert provider.exited == 1


async def test_cancelling_the_call_stops_the_episode(agent) -> None:
    stub, provider, server = agent
    call = stub.RunEpisode(timeout=30)
    await call.write(pb.RunEpisodeRequest(start=_start("gone")))
    await asyncio.wait_for(provider.entered.wait(), 20)
    call.cancel()
    for _ in range(50):
        if provider.exited:
            break
        await asyncio.sleep(0.02)
    assert provider.exited == 1 and "gone" not in server.runner.running


def test_the_bundled_tokenizer_is_the_one_the_tests_use() -> None:
    assert TOKENIZER_DIR.endswith("tokenizer_files")


async def test_an_agent_at_max_episodes_refuses_more() -> None:
    provider = WaitingProvider()
    server = AgentServer(
        AgentSettings(
            host="127.0.0.1",
            port=0,
            auth_token=TOKEN,
            log_level="warning",
            tokenizer_processes=0,
            max_episodes=1,
        ),
        provider=provider,
    )
    await server.start()
    channel = make_channel(server.address, token=TOKEN)
    try:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        call = stub.RunEpisode(timeout=30)
        await call.write(pb.RunEpisodeRequest(start=_start("first")))
        await asyncio.wait_for(provider.entered.wait(), 20)
        assert await _refused(stub, [pb.RunEpisodeRequest(start=_start("second"))]) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "AGENT_AT_CAPACITY",
        )
        call.cancel()
    finally:
        await channel.close()
        await server.stop(0)
