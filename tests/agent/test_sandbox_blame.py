"""Blame when a sandbox breaks (issue 15 item 3): the policy's own command that kills its shell
is an ordinary turn; a sandbox that cannot come back after such a command ends the episode
SANDBOX_BROKEN with reward -1, which the trainer plugin trains on like any failed attempt; a
sandbox found dead with no such command is INFRA_ERROR, which the plugin drops.

Sandboxes come from an in-memory provider behind the agent's SandboxProvider Protocol, which
answers each command from a script of results or errors; tests/agent/test_sandbox_blame_docker.py
runs the same commands on the real stack."""

from __future__ import annotations

import asyncio
import contextlib

from testkit import slime_standin  # the framework stand-in of the plugin's own tests
from testkit.agent import bundled_tasks, check_record, result_of, start_for

from swerl.agent.errors import EpisodeInfraError
from swerl.agent.loop.sandbox import SANDBOX_NOT_RUNNING
from swerl.agent.server import AgentServer
from swerl.agent.settings import AgentSettings
from swerl.agent.v1 import agent_pb2 as pb
from swerl.agent.v1 import agent_pb2_grpc
from swerl.chassis.client import make_channel
from swerl.devservers.replay import ReplayPolicyServer, script_key
from swerl.exec.client import ExecResult
from swerl.trainer_plugin.convert import INFRA_ERROR, outcome_to_samples
from swerl.trainer_plugin.episode import EpisodeOutcome

NOT_RUNNING = (
    "the sandbox's container stopped and could not be started again (exec: sleep: not found);"
    " destroy it and create another"
)


def _bash(command: str) -> str:
    return f"Running it.\n\n```bash\n{command}\n```"


class _Sandbox:
    lease_id, sandbox_id, node_id = "l1", "s1", "memory"

    def __init__(self, answers: list[ExecResult | EpisodeInfraError]) -> None:
        self.lost = asyncio.Event()
        self.answers = answers
        self.commands: list[str] = []

    def lost_detail(self):
        return ("UNSPECIFIED", "")

    async def run(self, command, *, timeout_s, env, cwd):
        self.commands.append(command)
        answer = self.answers.pop(0)
        if isinstance(answer, EpisodeInfraError):
            raise answer
        return answer

    async def diff(self):
        return b""

    async def evaluate(self, instance, patch, timeout_s):
        raise AssertionError("nothing is graded in these episodes")


class _Provider:
    def __init__(self, answers) -> None:
        self.sandbox = _Sandbox(answers)

    @contextlib.asynccontextmanager
    async def lease(self, image, *, owner, instance_id, request_id, workdir, avoid_node_ids=()):
        yield self.sandbox


def _exit(code: int, out: bytes = b"") -> ExecResult:
    return ExecResult(
        exit_code=code,
        stdout=out,
        stderr=b"",
        timed_out=False,
        output_truncated=False,
        bytes_dropped=0,
        duration_s=0.01,
        signaled=False,
    )


async def _episode(commands: list[str], answers) -> tuple[pb.EpisodeResult, list[str]]:
    task = bundled_tasks()[0]
    replay = ReplayPolicyServer(
        {script_key(task.instance["problem_statement"]): [_bash(c) for c in commands]}
    )
    url = await replay.start()
    provider = _Provider(answers)
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
            iter([pb.RunEpisodeRequest(start=start_for(task, url, "blame"))]), timeout=60
        )
        result = result_of([m async for m in call])
    finally:
        await channel.close()
        await server.stop(0)
        await replay.stop()
    return result, provider.sandbox.commands


def _converted(result: pb.EpisodeResult):
    outcome = EpisodeOutcome(episode_id=result.episode_id, address="memory", result=result)
    template = slime_standin.Sample(
        group_index=0, index=0, prompt="p", label=None, metadata={"instance": {}}
    )
    return outcome_to_samples(template, outcome, per_turn=False)


async def test_a_sandbox_dead_after_the_policy_killed_everything_is_sandbox_broken_minus_one():
    answers = [_exit(0, b"a\n"), _exit(137), EpisodeInfraError(SANDBOX_NOT_RUNNING, NOT_RUNNING)]
    result, commands = await _episode(["ls", "kill -9 -1", "ls"], answers)
    assert commands == ["ls", "kill -9 -1", "ls"]
    assert result.status == pb.EPISODE_STATUS_SANDBOX_BROKEN, result.error_message
    assert result.error_reason == "SANDBOX_BROKEN" and "could not be started" in (
        result.error_message
    )
    assert result.HasField("reward") and result.reward == -1.0
    assert not result.HasField("report")  # nothing to grade: the sandbox is gone
    assert result.trajectory.reward == -1.0
    check_record(result.trajectory)
    # The trainer plugin trains on it as a failed attempt; it is not an infra failure.
    sample = _converted(result)
    assert sample.metadata[INFRA_ERROR] is False and not sample.remove_sample
    assert sample.reward == -1.0 and sample.status is slime_standin.Sample.Status.COMPLETED
    assert sample.metadata["episode_status"] == "SANDBOX_BROKEN"
    assert sample.loss_mask.count(1) > 0


async def test_a_sandbox_found_dead_with_no_command_of_the_policy_to_blame_is_infra_error():
    # The previous command exited normally: whatever stopped the sandbox was not the policy.
    answers = [_exit(0, b"a\n"), EpisodeInfraError(SANDBOX_NOT_RUNNING, NOT_RUNNING)]
    result, _ = await _episode(["ls", "ls"], answers)
    assert result.status == pb.EPISODE_STATUS_INFRA_ERROR
    assert result.error_reason == SANDBOX_NOT_RUNNING and not result.HasField("reward")
    sample = _converted(result)
    assert sample.metadata[INFRA_ERROR] is True and sample.remove_sample


async def test_a_command_that_timed_out_is_not_the_policy_killing_its_sandbox():
    # exit 137 of a timeout is the node's own kill, not the policy's doing.
    timed_out = ExecResult(
        exit_code=137,
        stdout=b"",
        stderr=b"",
        timed_out=True,
        output_truncated=False,
        bytes_dropped=0,
        duration_s=5.0,
        signaled=False,
    )
    answers = [timed_out, EpisodeInfraError(SANDBOX_NOT_RUNNING, NOT_RUNNING)]
    result, _ = await _episode(["sleep 100", "ls"], answers)
    assert result.status == pb.EPISODE_STATUS_INFRA_ERROR and not result.HasField("reward")


async def test_other_node_failures_after_a_kill_stay_infra_error():
    # The node answering UNAVAILABLE says nothing about the policy, whatever it ran before.
    answers = [_exit(137), EpisodeInfraError("SANDBOX_UNAVAILABLE", "Exec failed: UNAVAILABLE")]
    result, _ = await _episode(["kill -9 -1", "ls"], answers)
    assert result.status == pb.EPISODE_STATUS_INFRA_ERROR
    assert result.error_reason == "SANDBOX_UNAVAILABLE"
