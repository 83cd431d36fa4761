"""mini-swe-agent's own DefaultAgent and SWE-bench environment factory on swerl: a scripted model
solves a bundled task in a sandbox leased from a real pool, through the exec node."""

from __future__ import annotations

import os

import pytest
from testkit.playback import eventually

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")

from minisweagent.agents.default import DefaultAgent
from minisweagent.models.test_models import DeterministicModel, make_output

from swerl.evaluation.mini_swe_agent import SwerlEnvironment, sb_environment
from swerl.exec.client import SandboxClient
from swerl.exec.v1 import evaluate_pb2
from swerl.pool.client import PoolClient
from swerl.stack import local_stack
from swerl.tasks import build_images, default_tasks_dir, load_tasks
from swerl.validate import instance_to_pb

pytestmark = pytest.mark.docker
ENV_CLASS = "swerl.evaluation.mini_swe_agent.SwerlEnvironment"
SYSTEM = "You solve tasks with bash."
INSTANCE = "{{task}}"


@pytest.fixture(scope="module")
def task(base_image):
    (found,) = [t for t in load_tasks(default_tasks_dir()) if "romans" in t.instance_id]
    build_images([found], base_image=base_image, progress=lambda line: None)
    return found


def _sandboxes(stack) -> int:
    return sum(len(node.manager._records) for node in stack.nodes)


async def test_default_agent_with_a_scripted_model_solves_a_bundled_task(task, tmp_path):
    script = [
        make_output("Look around.", [{"command": "git status --short && ls romans"}]),
        make_output(
            "Apply the fix.",
            [{"command": f"git apply <<'SWERL_EOF'\n{task.gold_patch}SWERL_EOF"}],
        ),
        make_output("Run the tests.", [{"command": "python3 -m pytest -q tests 2>&1 | tail -n 2"}]),
        make_output(
            "Submit.",
            [
                {
                    "command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git add -A && "
                    "git diff --cached"
                }
            ],
        ),
    ]
    async with local_stack(nodes=1, purpose="mini-swe-agent") as stack:
        config = {
            "environment": {
                "environment_class": "swerl",
                "cwd": "/testbed",
                "timeout": 60,
                "pool_address": stack.pool_address,
                "token": stack.token,
            }
        }

        def run_agent() -> tuple[dict, list[dict], dict]:
            # What mini-swe-agent's SWE-bench runner calls per instance (its own
            # get_sb_environment, with the image handed to swerl's environment).
            env = sb_environment(config, dict(task.instance))
            try:
                agent = DefaultAgent(
                    DeterministicModel(outputs=script),
                    env,
                    system_template=SYSTEM,
                    instance_template=INSTANCE,
                    step_limit=10,
                    cost_limit=0,  # the scripted model bills 1.0 per call
                    output_path=tmp_path / "traj.json",
                )
                info = agent.run(task.instance["problem_statement"])
                return info, agent.messages, env.serialize()
            finally:
                env.cleanup()

        import asyncio

        info, messages, serialized = await asyncio.to_thread(run_agent)
        # cleanup released the lease and, soon after, its sandbox
        await eventually(lambda: _sandboxes(stack) == 0, timeout_s=30.0)

        assert info["exit_status"] == "Submitted"
        submission = info["submission"]
        assert submission.startswith("diff --git a/romans/convert.py")
        observations = [m["content"] for m in messages if m["role"] == "user"][1:]
        assert "<returncode>0</returncode>" in observations[0]
        assert "convert.py" in observations[0]
        assert "passed" in observations[2]
        environment = serialized["info"]["config"]
        assert environment["environment_type"] == ENV_CLASS
        assert environment["lease_id"] and "token" not in environment["environment"]
        assert (tmp_path / "traj.json").exists()

        # The submission is what SWE-bench grades: it resolves the task on the same nodes.
        pool = PoolClient(stack.pool_address, token=stack.token)
        try:
            async with pool.lease(task.image_name, owner="grader") as lease:
                report = await SandboxClient.for_lease(lease).evaluation_report(
                    instance_to_pb(task.instance),
                    submission.encode(),
                    sandbox_id=lease.sandbox_id,
                    timeout_s=300,
                )
        finally:
            await pool.close()
        assert report is not None
        assert report.status == evaluate_pb2.EVALUATION_STATUS_RESOLVED_FULL


async def test_errors_timeouts_and_stderr_come_back_as_mini_swe_agent_expects(task):
    async with local_stack(nodes=1, purpose="mini-env") as stack:

        def scenario() -> list[dict]:
            env = SwerlEnvironment(
                image=task.image_name,
                cwd="/testbed",
                timeout=30,
                pool_address=stack.pool_address,
                token=stack.token,
                env={"SWERL_X": "1"},
            )
            try:
                return [
                    env.execute({"command": "echo out; echo err >&2; echo $SWERL_X; exit 3"}),
                    env.execute({"command": "sleep 30"}, timeout=1),
                    env.execute({"command": "pwd"}, cwd="/tmp"),
                    env.execute({"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; exit 1"}),
                ]
            finally:
                env.cleanup()

        import asyncio

        failed, timed_out, moved, not_submitted = await asyncio.to_thread(scenario)
        # ReleaseLease waits for the node's destroy for `release_wait_s` (5 s) only: on a loaded
        # machine the destroy ended after the release returned (CI, 7 Dec).
        await eventually(lambda: _sandboxes(stack) == 0, timeout_s=30.0)
    assert failed == {"output": "out\nerr\n1\n", "returncode": 3, "exception_info": ""}
    assert timed_out["returncode"] == -1 and "timed out" in timed_out["exception_info"]
    assert moved["output"] == "/tmp\n"
    # The sentinel only submits with exit code 0.
    assert not_submitted["returncode"] == 1


async def test_an_image_the_nodes_do_not_have_fails_at_construction_and_leaks_nothing():
    # A pool that pulls on demand would ask a registry (none is reachable from the tests but the
    # loopback ones); with --no-pull the refusal is the pool's own and the same everywhere.
    async with local_stack(nodes=1, purpose="mini-missing", pool_settings={"pull": False}) as stack:

        def build() -> None:
            SwerlEnvironment(
                image="swerl-test/not-present:1",
                pool_address=stack.pool_address,
                token=stack.token,
                lease_wait_s=5,
            )

        import asyncio

        import grpc

        with pytest.raises(grpc.RpcError) as caught:
            await asyncio.to_thread(build)
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert _sandboxes(stack) == 0
