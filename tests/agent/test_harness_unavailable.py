"""A harness whose Python package is not installed is refused up front, never INTERNAL: RunEpisode
fails FAILED_PRECONDITION with reason HARNESS_UNAVAILABLE, its message naming the package and the
extra that brings it, before any sandbox is leased. On a real agent gRPC server on port 0 with a
sandbox provider behind the agent's own Protocol, the package hidden as on a machine without it
(testkit.hidden: `import` fails and find_spec finds nothing)."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from testkit.agent import TOKENIZER_DIR, bundled_tasks, start_for
from testkit.hidden import hide_here

from swerl.agent.server import AgentServer
from swerl.agent.settings import AgentSettings
from swerl.agent.v1 import agent_pb2 as pb
from swerl.agent.v1 import agent_pb2_grpc
from swerl.chassis.client import error_info, make_channel

TOKEN = "harness-unavailable-token"
INSTALL = "pip install 'swerl[harness]'"


class CountingProvider:
    """Counts leases asked for; a lease waits until the episode is cancelled."""

    def __init__(self) -> None:
        self.leased = asyncio.Event()

    @contextlib.asynccontextmanager
    async def lease(self, image, *, owner, instance_id, request_id, workdir, avoid_node_ids=()):
        self.leased.set()
        await asyncio.Event().wait()
        yield None


@pytest.fixture
async def agent():
    provider = CountingProvider()
    server = AgentServer(
        AgentSettings(
            host="127.0.0.1",
            port=0,
            auth_token=TOKEN,
            log_level="warning",
            tokenizer_processes=0,
            gateway_port=0,
        ),
        provider=provider,
    )
    await server.start()
    channel = make_channel(server.address, token=TOKEN)
    try:
        yield agent_pb2_grpc.AgentServiceStub(channel), provider
    finally:
        await channel.close()
        await server.stop(0)


def _harness_start(episode_id: str) -> pb.EpisodeStart:
    start = start_for(bundled_tasks()[0], "http://127.0.0.1:9", episode_id)
    start.options.harness = "mini-swe-agent"
    return start


async def _refusal(stub, start: pb.EpisodeStart) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in stub.RunEpisode(iter([pb.RunEpisodeRequest(start=start)]), timeout=30):
            pass
    return caught.value


@pytest.mark.parametrize(
    ("hidden", "package"), [("minisweagent", "mini-swe-agent"), ("litellm", "litellm")]
)
async def test_a_harness_without_its_package_is_failed_precondition_harness_unavailable(
    agent, monkeypatch, hidden, package
) -> None:
    stub, provider = agent
    hide_here(monkeypatch, [hidden])
    err = await _refusal(stub, _harness_start(f"no-{hidden}"))
    reason, metadata = error_info(err)
    assert (err.code(), reason) == (grpc.StatusCode.FAILED_PRECONDITION, "HARNESS_UNAVAILABLE")
    assert err.details() == (
        f"harness 'mini-swe-agent' needs {package} (import {hidden}), not installed here: {INSTALL}"
    )
    assert metadata == {"harness": "mini-swe-agent", "packages": package, "install": INSTALL}
    assert not provider.leased.is_set()  # refused before any sandbox was asked for


async def test_with_its_packages_installed_the_harness_episode_goes_on_to_lease(agent) -> None:
    stub, provider = agent
    call = stub.RunEpisode(iter([pb.RunEpisodeRequest(start=_harness_start("installed"))]))
    reading = asyncio.ensure_future(call.read())
    try:
        await asyncio.wait_for(provider.leased.wait(), timeout=30)
    finally:
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await reading


async def test_open_session_names_no_harness_and_opens_without_the_harness_packages(
    agent, monkeypatch
) -> None:
    # A gateway session serves whatever harness calls it, from any host: the harness packages
    # belong to the process that runs the harness, so OpenSession has nothing to refuse.
    stub, _ = agent
    hide_here(monkeypatch, ["minisweagent", "litellm"])
    opened = await stub.OpenSession(
        pb.OpenSessionRequest(
            policy=pb.PolicyConfig(endpoint="http://127.0.0.1:9", tokenizer_path=TOKENIZER_DIR),
            owner="harness-unavailable",
        ),
        timeout=30,
    )
    assert opened.session_id and opened.openai_base_url.endswith(f"/s/{opened.session_id}/v1")
