"""An evaluation that fails for infrastructure reasons is INFRA_ERROR with no reward, never -1
(sandboxes from an in-memory provider behind the agent's SandboxProvider Protocol)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from testkit.agent import bundled_tasks, result_of, start_for

from swerl.agent.server import AgentServer
from swerl.agent.settings import AgentSettings
from swerl.agent.v1 import agent_pb2 as pb
from swerl.agent.v1 import agent_pb2_grpc
from swerl.chassis.client import make_channel
from swerl.devservers.replay import ReplayPolicyServer, script_key
from swerl.exec.client import ExecResult
from swerl.exec.v1 import evaluate_pb2

SUBMIT = (
    "Done.\n\n```bash\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git add -A"
    " && git diff --cached --binary\n```"
)


class _Sandbox:
    lease_id, sandbox_id, node_id = "l1", "s1", "memory"

    def __init__(self, report: evaluate_pb2.EvaluationReport) -> None:
        self.lost = asyncio.Event()
        self.report = report

    def lost_detail(self):
        return ("UNSPECIFIED", "")

    async def run(self, command, *, timeout_s, env, cwd):
        out = b"COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\ndiff --git a/x b/x\n+1\n"
        return ExecResult(
            exit_code=0,
            stdout=out,
            stderr=b"",
            timed_out=False,
            output_truncated=False,
            bytes_dropped=0,
            duration_s=0.01,
            signaled=False,
        )

    async def diff(self):
        return b""

    async def evaluate(self, instance, patch, timeout_s):
        return self.report


class _Provider:
    def __init__(self, report) -> None:
        self.report = report
        self.leases = 0

    @contextlib.asynccontextmanager
    async def lease(self, image, *, owner, instance_id, request_id, workdir, avoid_node_ids=()):
        self.leases += 1
        yield _Sandbox(self.report)


async def _run(report: evaluate_pb2.EvaluationReport) -> tuple[pb.EpisodeResult, int]:
    task = bundled_tasks()[0]
    replay = ReplayPolicyServer({script_key(task.instance["problem_statement"]): [SUBMIT]})
    url = await replay.start()
    provider = _Provider(report)
    server = AgentServer(
        AgentSettings(
            host="127.0.0.1", port=0, auth_token="t", log_level="warning", tokenizer_processes=0
        ),
        provider=provider,
    )
    await server.start()
    channel = make_channel(server.address, token="t")
    try:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        call = stub.RunEpisode(
            iter([pb.RunEpisodeRequest(start=start_for(task, url, "eval"))]), timeout=60
        )
        result = result_of([m async for m in call])
    finally:
        await channel.close()
        await server.stop(0)
        await replay.stop()
    return result, provider.leases


@pytest.mark.parametrize(
    ("report_reason", "episode_reason"),
    [
        # A fault of the node: the episode names it, as for a command that hit it.
        ("DOCKER_UNAVAILABLE", "DOCKER_UNAVAILABLE"),
        ("SANDBOX_STOPPED", "SANDBOX_STOPPED"),
        # Anything else that made the evaluation no verdict.
        ("TEST_PATCH_FAILED", "EVALUATION_INFRA_ERROR"),
    ],
)
async def test_infra_error_evaluation_ends_infra_error_without_reward(
    report_reason, episode_reason
) -> None:
    report = evaluate_pb2.EvaluationReport(
        status=evaluate_pb2.EVALUATION_STATUS_INFRA_ERROR, error_reason=report_reason
    )
    result, leases = await _run(report)
    assert result.status == pb.EPISODE_STATUS_INFRA_ERROR
    assert result.error_reason == episode_reason and not result.HasField("reward")
    assert not result.trajectory.HasField("reward")
    assert leases == 2  # the agent's sandbox, then a fresh one for grading


async def test_unresolved_evaluation_is_minus_one() -> None:
    report = evaluate_pb2.EvaluationReport(status=evaluate_pb2.EVALUATION_STATUS_PATCH_FAILED)
    result, _ = await _run(report)
    assert result.status == pb.EPISODE_STATUS_SUBMITTED and result.reward == -1.0
    assert result.trajectory.reward == -1.0
