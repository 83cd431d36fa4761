"""The harness seam (EpisodeOptions.harness) on the real stack: real dockerd, pool, exec node and
agent on port 0. The harnesses here are test harnesses behind swerl's own `Harness` Protocol that
act in the real leased sandbox; each test asserts the episode's status, reason, grading, and
that nothing is left (no container, no active lease)."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from testkit.agent import (
    agent_stack,
    assert_no_active_lease,
    bundled_tasks,
    node_of,
    result_of,
    run_to_result,
    sandboxes_left,
    start_for,
)
from testkit.playback import eventually

from swerl.agent import budget
from swerl.agent.errors import EpisodeInfraError
from swerl.agent.harnesses import HARNESSES, HarnessFailed, HarnessRun
from swerl.agent.status import EpisodeStatus
from swerl.agent.v1 import agent_pb2 as pb
from swerl.chassis.client import error_info
from swerl.chassis.timeconv import duration_pb
from swerl.exec.v1 import evaluate_pb2

pytestmark = pytest.mark.usefixtures("base_image")

NO_POLICY = "http://127.0.0.1:9"  # the test harnesses never call the policy


class ScriptedHarness:
    """Runs `commands` in the sandbox in order (the gold patch on stdin where asked), then ends
    as `ending` says: "submit" returns the gold patch, "diff" returns None, "fail" raises
    HarnessFailed; a command that ends killed by a signal fails the harness."""

    timeout_status = EpisodeStatus.HARNESS_TIMEOUT

    def __init__(self, name: str, commands: list[str], ending: str, gold: str) -> None:
        # ending "infra": what the harness stands on failed (EpisodeInfraError).
        self.name = name
        self.commands = commands
        self.ending = ending
        self.gold = gold
        self.prepared = False
        self.cancels = 0
        self.running = asyncio.Event()
        self.output = bytearray()

    async def prepare(self, run: HarnessRun) -> None:
        self.prepared = True

    async def run(self, run: HarnessRun) -> str | None:
        self.running.set()
        workdir = run.spec.config.workdir
        for command in self.commands:
            stdin = self.gold.encode() if "git apply" in command else None
            result = await run.sandbox.run(command, timeout_s=600, env={}, cwd=workdir, stdin=stdin)
            self.output += result.output
            if result.exit_code > 128:
                raise HarnessFailed(f"harness process killed by signal {result.exit_code - 128}")
        if self.ending == "fail":
            raise HarnessFailed("harness exited with status 3")
        if self.ending == "infra":
            raise EpisodeInfraError("MODEL_UNREACHABLE", "connection refused")
        return self.gold if self.ending == "submit" else None

    async def cancel(self) -> None:
        self.cancels += 1

    def log(self) -> bytes:
        return bytes(self.output)


@pytest.fixture
def harness(monkeypatch):
    """Registers one ScriptedHarness under a test name; returns a maker."""
    made: list[ScriptedHarness] = []

    def make(commands: list[str], ending: str, gold: str) -> ScriptedHarness:
        one = ScriptedHarness(f"test-{len(made)}", commands, ending, gold)
        made.append(one)
        monkeypatch.setitem(HARNESSES, one.name, lambda: one)
        return one

    return make


def _start(task, episode_id: str, harness: str, wall_s: float = 120.0) -> pb.EpisodeStart:
    start = start_for(task, NO_POLICY, episode_id)
    start.options.harness = harness
    start.limits.wall_timeout.CopyFrom(duration_pb(wall_s))
    return start


async def test_an_unknown_harness_is_invalid_argument_unknown_harness():
    task = bundled_tasks()[0]
    # No policy serves this test: its builtin episode gives up after 1 s of retries, not 60.
    async with agent_stack(policy_connect_max_delay_s=1.0) as env:
        start = _start(task, "unknown-harness", "no-such-harness")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await run_to_result(env.stub, start)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_info(caught.value)[0] == "UNKNOWN_HARNESS"
        # The default by name runs swerl's loop (no policy here: INFRA_ERROR, not a refusal).
        result = result_of(await run_to_result(env.stub, _start(task, "named-builtin", "builtin")))
        assert result.status == pb.EPISODE_STATUS_INFRA_ERROR
        await assert_no_active_lease(env)
        node = node_of(env)
    assert sandboxes_left(node) == []


async def test_a_harness_cannot_branch(harness):
    task = bundled_tasks()[0]
    one = harness([], "diff", task.gold_patch)
    async with agent_stack() as env:
        start = _start(task, "branching-harness", one.name)
        start.options.branch.at_turn, start.options.branch.count = 1, 2
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await run_to_result(env.stub, start)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_info(caught.value)[0] == "INVALID_EPISODE_START"


async def test_a_harness_submission_is_the_patch_and_is_graded(harness):
    task = bundled_tasks()[0]
    one = harness(["true"], "submit", task.gold_patch)
    async with agent_stack() as env:
        result = result_of(await run_to_result(env.stub, _start(task, "h-submit", one.name)))
        await assert_no_active_lease(env)
        node = node_of(env)
    assert one.prepared and one.cancels == 1
    assert result.status == pb.EPISODE_STATUS_SUBMITTED
    assert result.patch == task.gold_patch.encode()
    assert result.report.status == evaluate_pb2.EVALUATION_STATUS_RESOLVED_FULL
    assert result.reward == 1.0
    assert sandboxes_left(node) == []


async def test_a_harness_that_fails_is_harness_failed_graded_on_its_sandbox(harness, tmp_path):
    task = bundled_tasks()[0]
    one = harness(["git apply -", "echo harness-said-this"], "fail", task.gold_patch)
    start = _start(task, "h-fail", one.name)
    start.options.artifact_dir = str(tmp_path)
    async with agent_stack() as env:
        result = result_of(await run_to_result(env.stub, start))
        await assert_no_active_lease(env)
        node = node_of(env)
    # The harness's own log is kept beside traj.json; meta.json names the harness.
    (directory,) = tmp_path.iterdir()
    assert (directory / "harness.log").read_bytes().strip() == b"harness-said-this"
    assert (directory / "traj.json").exists()
    assert json.loads((directory / "meta.json").read_text())["harness"] == one.name
    assert result.status == pb.EPISODE_STATUS_HARNESS_FAILED
    assert result.error_reason == "HARNESS_FAILED"
    assert result.error_message == "harness exited with status 3"
    # What the harness wrote before it failed is what is graded: the gold fix resolves.
    assert result.report.status == evaluate_pb2.EVALUATION_STATUS_RESOLVED_FULL
    assert result.reward == 1.0
    assert sandboxes_left(node) == []


async def test_a_harness_killed_mid_run_is_harness_failed_and_leaves_nothing(harness):
    task = bundled_tasks()[0]
    one = harness(["echo x >> README.md; kill -9 $$", "echo never >> README.md"], "diff", "")
    async with agent_stack() as env:
        result = result_of(await run_to_result(env.stub, _start(task, "h-killed", one.name)))
        await assert_no_active_lease(env)
        node = node_of(env)
    assert result.status == pb.EPISODE_STATUS_HARNESS_FAILED
    assert result.error_reason == "HARNESS_FAILED"
    assert "killed by signal 9" in result.error_message
    assert b"README.md" in result.patch and b"never" not in result.patch
    assert result.reward == -1.0
    assert one.cancels == 1
    assert sandboxes_left(node) == []


async def test_a_harness_that_never_exits_is_stopped_at_its_budget_harness_timeout(harness):
    task = bundled_tasks()[0]
    one = harness(["echo x >> README.md", "sleep 600"], "diff", "")
    async with agent_stack() as env:
        loop = asyncio.get_running_loop()
        began = loop.time()
        start = _start(task, "h-hang", one.name, wall_s=4.0)
        result = result_of(await run_to_result(env.stub, start))
        elapsed = loop.time() - began
        await assert_no_active_lease(env)
        node = node_of(env)
    assert result.status == pb.EPISODE_STATUS_HARNESS_TIMEOUT
    assert b"README.md" in result.patch and result.reward == -1.0
    assert one.cancels == 1
    assert elapsed < 120, elapsed  # stopped at its budget, not at the command's 600 s
    assert sandboxes_left(node) == []


# A harness that never exits, and leaves a package whose import hangs: the tests of its grading
# run until the grading's limit kills them.
HANGING_IMPORT = ["printf 'import time\\ntime.sleep(600)\\n' >> inicfg/__init__.py", "sleep 600"]


def _since_lease(result: pb.EpisodeResult, started: pb.EpisodeStarted) -> float:
    """The episode's time from its sandbox's lease on (where its one budget starts)."""
    return result.metrics["total_time"] - started.lease_wait_duration.ToTimedelta().total_seconds()


async def test_a_harness_that_eats_its_budget_is_graded_within_it(harness):
    """One budget covers the harness and the grading: the harness is stopped at its share, the
    grading gets what is left (never more than eval_timeout), and the episode ends within the
    budget plus the grading's overhead, graded, with nothing held."""
    task = bundled_tasks()[0]
    one = harness(HANGING_IMPORT, "diff", "")
    budget_s = 16.0
    start = _start(task, "h-budget", one.name, wall_s=budget_s)
    start.limits.eval_timeout.CopyFrom(duration_pb(600.0))
    async with agent_stack() as env:
        messages = await run_to_result(env.stub, start)
        await assert_no_active_lease(env)
        node = node_of(env)
    (started,) = [m.started for m in messages if m.HasField("started")]
    result = result_of(messages)
    assert result.status == pb.EPISODE_STATUS_HARNESS_TIMEOUT, result.error_message
    assert b"time.sleep(600)" in result.patch
    # The harness had three quarters of the budget; the grading the rest, not its 600 s.
    assert budget.harness_run_s(budget_s, 600.0) == 12.0
    assert 12.0 <= result.metrics["agent_run_time"] < 12.0 + 5, result.metrics["agent_run_time"]
    assert result.report.status == evaluate_pb2.EVALUATION_STATUS_TIMEOUT
    assert result.report.error_reason == "TESTS_TIMED_OUT"
    killed_at = float(result.report.error_message.split("past ")[1].split(" s")[0])
    assert 0 < killed_at <= budget_s - 12.0, result.report.error_message
    assert result.reward == -1.0
    assert _since_lease(result, started) < budget_s + budget.GRADING_OVERHEAD_S
    assert one.cancels == 1
    assert sandboxes_left(node) == []


async def test_a_grading_past_the_budget_ends_infra_error_grading_over_budget(harness, monkeypatch):
    """With no overhead allowed past the budget, a grading whose tests hang to its limit cannot
    end within it: INFRA_ERROR GRADING_OVER_BUDGET, no reward, the grading's lease released."""
    monkeypatch.setattr(budget, "GRADING_OVERHEAD_S", 0.0)
    task = bundled_tasks()[0]
    one = harness(HANGING_IMPORT, "diff", "")
    budget_s = 12.0
    async with agent_stack() as env:
        messages = await run_to_result(env.stub, _start(task, "h-over", one.name, wall_s=budget_s))
        await assert_no_active_lease(env)
        node = node_of(env)
        # On a loaded machine the budget can run out while the grading's sandbox is still being
        # made (CI, 7 Dec): the node finishes that create, and the pool releases the lease no
        # caller claimed after its grace (PoolSettings.unclaimed_grace_s, 10 s). Left to the
        # stack's teardown instead, that sandbox outlived the stack.
        await eventually(lambda: sandboxes_left(node) == [], timeout_s=30.0)
    (started,) = [m.started for m in messages if m.HasField("started")]
    result = result_of(messages)
    assert result.status == pb.EPISODE_STATUS_INFRA_ERROR, result.error_message
    assert result.error_reason == "GRADING_OVER_BUDGET"
    assert "budget (12 s from its lease" in result.error_message
    assert not result.HasField("reward") and not result.HasField("report")
    assert _since_lease(result, started) < budget_s + 10.0
    assert sandboxes_left(node) == []


def test_the_budgets_are_ordered_client_over_agent_over_grading():
    """A client's deadline exceeds the agent's bound on an episode, which exceeds the harness's
    share and the grading's limit: no sandbox is held past its episode."""
    from swerl.agent.settings import AgentSettings
    from swerl.evaluation.runner import EvalConfig

    for harness in ("mini-swe-agent", "builtin"):
        for eval_s in (1.0, 50.0):
            config = EvalConfig(
                policy_endpoint=NO_POLICY,
                wall_timeout_s=100.0,
                eval_timeout_s=eval_s,
                harness=harness,
            )
            harnessed = harness != "builtin"
            bound = budget.agent_bound_s(100.0, eval_s, harnessed=harnessed)
            # swerl eval's deadline outlasts the agent's wait for the lease plus its bound.
            assert config.episode_deadline_s > budget.DEFAULT_LEASE_WAIT_S + bound
            assert bound > 100.0 + (0.0 if harnessed else eval_s)
    # The agent's default wait for a sandbox is the one the deadline counts on.
    assert AgentSettings.model_fields["lease_wait_s"].default == budget.DEFAULT_LEASE_WAIT_S
    assert budget.harness_run_s(100.0, 50.0) == 75.0  # a quarter of the budget, at most
    assert budget.harness_run_s(100.0, 10.0) == 90.0  # the grading's own limit, when less
    assert budget.grading_limit_s(25.0, 50.0) == 25.0  # what is left ...
    assert budget.grading_limit_s(80.0, 50.0) == 50.0  # ... never more than its own limit
    assert budget.grading_limit_s(-3.0, 50.0) == budget.MIN_GRADING_S


async def test_an_abort_during_a_harness_run_stops_it_at_once(harness):
    task = bundled_tasks()[0]
    one = harness(["sleep 600"], "diff", "")
    async with agent_stack() as env:
        call = env.stub.RunEpisode(timeout=300)
        await call.write(pb.RunEpisodeRequest(start=_start(task, "h-abort", one.name)))
        await asyncio.wait_for(one.running.wait(), 120)
        await asyncio.sleep(0.5)
        loop = asyncio.get_running_loop()
        sent = loop.time()
        await call.write(pb.RunEpisodeRequest(cancel=pb.EpisodeCancel(reason="rollout aborted")))
        messages = [message async for message in call]
        took = loop.time() - sent
        await assert_no_active_lease(env)
        node = node_of(env)
    result = result_of(messages)
    assert result.status == pb.EPISODE_STATUS_CANCELLED
    assert result.error_message == "rollout aborted" and not result.HasField("reward")
    assert one.cancels == 1
    assert took < 5.0, took
    assert sandboxes_left(node) == []


async def test_an_infra_failure_under_a_harness_is_infra_error_with_no_reward(harness):
    task = bundled_tasks()[0]
    one = harness(["echo x >> README.md"], "infra", "")
    async with agent_stack() as env:
        result = result_of(await run_to_result(env.stub, _start(task, "h-infra", one.name)))
        await assert_no_active_lease(env)
        node = node_of(env)
    assert result.status == pb.EPISODE_STATUS_INFRA_ERROR
    assert result.error_reason == "MODEL_UNREACHABLE"
    assert not result.HasField("reward") and not result.HasField("report")
    assert one.cancels == 1
    assert sandboxes_left(node) == []
