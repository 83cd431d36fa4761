"""EpisodeOptions.avoid_node_ids reaches every lease of the episode (its own sandbox and its
grading sandbox), so the pool places a trainer's re-run of an infra-failed episode elsewhere
(sandboxes from an in-memory provider behind the agent's SandboxProvider Protocol; the pool's
side is tests/pool/test_scheduling.py)."""

from __future__ import annotations

import contextlib

from test_evaluation_infra import SUBMIT, _Sandbox
from testkit.agent import bundled_tasks, result_of, start_for

from swerl.agent.server import AgentServer
from swerl.agent.settings import AgentSettings
from swerl.agent.v1 import agent_pb2 as pb
from swerl.agent.v1 import agent_pb2_grpc
from swerl.chassis.client import make_channel
from swerl.devservers.replay import ReplayPolicyServer, script_key
from swerl.exec.v1 import evaluate_pb2


class _RecordingProvider:
    def __init__(self) -> None:
        self.leases: list[tuple[str, tuple[str, ...]]] = []

    @contextlib.asynccontextmanager
    async def lease(self, image, *, owner, instance_id, request_id, workdir, avoid_node_ids=()):
        self.leases.append((request_id, tuple(avoid_node_ids)))
        report = evaluate_pb2.EvaluationReport(
            status=evaluate_pb2.EVALUATION_STATUS_RESOLVED_FULL, patch_applied=True
        )
        yield _Sandbox(report)


async def _episode(avoid: list[str]) -> tuple[pb.EpisodeResult, list]:
    task = bundled_tasks()[0]
    replay = ReplayPolicyServer({script_key(task.instance["problem_statement"]): [SUBMIT]})
    url = await replay.start()
    provider = _RecordingProvider()
    server = AgentServer(
        AgentSettings(
            host="127.0.0.1", port=0, auth_token="t", log_level="warning", tokenizer_processes=0
        ),
        provider=provider,
    )
    await server.start()
    channel = make_channel(server.address, token="t")
    start = start_for(task, url, "rerun-a2")
    start.options.avoid_node_ids.extend(avoid)
    try:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        call = stub.RunEpisode(iter([pb.RunEpisodeRequest(start=start)]), timeout=60)
        result = result_of([m async for m in call])
    finally:
        await channel.close()
        await server.stop(0)
        await replay.stop()
    return result, provider.leases


async def test_every_lease_of_an_episode_avoids_the_nodes_its_start_names() -> None:
    result, leases = await _episode(["node-7", "node-9"])
    assert result.status == pb.EPISODE_STATUS_SUBMITTED and result.reward == 1.0
    assert leases == [
        ("rerun-a2-agent", ("node-7", "node-9")),
        ("rerun-a2-eval", ("node-7", "node-9")),
    ]


async def test_an_episode_without_nodes_to_avoid_asks_for_none() -> None:
    _, leases = await _episode([])
    assert [avoid for _, avoid in leases] == [(), ()]
