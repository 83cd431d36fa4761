"""The claude-code harness on the real stack: dockerd, pool, exec node with the real bundle
(standalone Node + the npm package, built once, shared), the agent on port 0 with its gateway,
and the replay policy server behind it speaking SGLang's /generate. The CLI runs inside a
`network none` sandbox and reaches its model only through the forwarder and the node's bridge.

Each fault test asserts the episode's status and reason and that nothing is left: no sandbox
container of the test's node, no active lease, no harness process."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time

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
from swerl.agent.v1 import agent_pb2 as pb
from swerl.chassis.timeconv import duration_pb
from swerl.devservers.replay import ReplayPolicyServer, claude_code_script, script_key
from swerl.exec.v1 import evaluate_pb2

pytestmark = pytest.mark.usefixtures("base_image", "harness_bundle_dir")

# A Bash call that does not come back by itself (the tool's own longest timeout).
HANG = get_tool_call_format("qwen25").render_call(
    "Bash", {"command": "tail -f /dev/null", "description": "Wait", "timeout": 600000}
)
# The claude processes of a container, found without matching the finder itself.
KILL_CLAUDE = (
    "for p in /proc/[0-9]*; do grep -qs 'claude-code-linux-x64/clau[d]e' $p/cmdline"
    " && kill -KILL ${p#/proc/}; done; true"
)


def _start(task, url: str, episode_id: str, wall_s: float = 240.0) -> pb.EpisodeStart:
    start = start_for(task, url, episode_id)
    start.options.harness = "claude-code"
    start.limits.wall_timeout.CopyFrom(duration_pb(wall_s))
    return start


async def _nothing_left(env) -> None:
    assert sandboxes_left(node_of(env)) == []
    await assert_no_active_lease(env)


async def _run_until_requests(env, start, replay, count: int):
    """Starts the episode; returns (call, sandbox_id) once the policy saw `count` requests."""
    call = env.stub.RunEpisode(timeout=600)
    await call.write(pb.RunEpisodeRequest(start=start))
    first = await call.read()
    assert first.WhichOneof("kind") == "started", first
    deadline = time.monotonic() + 180
    while replay.stats.requests < count:
        assert time.monotonic() < deadline, "claude never called its model"
        await asyncio.sleep(0.2)
    return call, first.started.sandbox_id


async def _rest(call) -> pb.EpisodeResult:
    return result_of([message async for message in call])


def _holds(record: pb.TokenRecord, sent: list[int], sampled: list[int]) -> bool:
    ids = list(record.prompt_ids) + list(record.response_ids)
    if ids[: len(sent) + len(sampled)] != sent + sampled:
        return False
    start = len(sent) - len(record.prompt_ids)
    return all(record.loss_mask[start : start + len(sampled)])


async def test_a_gold_episode_resolves_with_exact_token_samples_and_its_own_log(tmp_path):
    task = bundled_tasks()[0]
    replay = ReplayPolicyServer(
        {script_key(task.instance["problem_statement"]): claude_code_script(task.gold_patch)},
        keep_requests=True,
    )
    url = await replay.start()
    try:
        async with agent_stack() as env:
            start = _start(task, url, "cc-gold")
            start.options.artifact_dir = str(tmp_path)
            result = result_of(await run_to_result(env.stub, start))
            await _nothing_left(env)
    finally:
        await replay.stop()
    assert result.status == pb.EPISODE_STATUS_SUBMITTED, result.error_message
    assert result.report.status == evaluate_pb2.EVALUATION_STATUS_RESOLVED_FULL
    assert result.reward == 1.0
    # Each request the policy answered is in one of the episode's samples token for token:
    # the ids it was sent, then what it sampled with mask 1 (more than one sample when the
    # CLI's history is not the sampled text re-rendered: the gateway starts a new chain).
    records = list(result.chains) or [result.trajectory]
    for record in records:
        check_record(record, replay)
    for sent, sampled in replay.stats.requests_seen:
        assert any(_holds(record, sent, sampled) for record in records), len(sent)
    assert result.metrics["gateway_calls"] == float(len(replay.stats.requests_seen))
    # The CLI's own log beside traj.json: its stream-json session, ending in its result.
    (log,) = tmp_path.rglob("harness.log")
    events = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    assert events[0]["type"] == "system" and events[0]["cwd"] == "/testbed"
    assert events[-1]["type"] == "result" and events[-1]["is_error"] is False
    tools = [
        block["name"]
        for event in events
        if event["type"] == "assistant"
        for block in event["message"]["content"]
        if block["type"] == "tool_use"
    ]
    assert tools == ["Bash", "Write", "Bash", "Bash"]


async def test_a_harness_killed_mid_run_ends_harness_failed():
    task = bundled_tasks()[0]
    replay = ReplayPolicyServer({script_key(task.instance["problem_statement"]): [HANG]})
    url = await replay.start()
    try:
        async with agent_stack() as env:
            call, sandbox_id = await _run_until_requests(
                env, _start(task, url, "cc-killed"), replay, 1
            )
            await asyncio.sleep(3)  # its Bash call is running
            killed = await asyncio.to_thread(
                subprocess.run,
                ["docker", "exec", f"swerl-{sandbox_id}", "sh", "-c", KILL_CLAUDE],
                capture_output=True,
            )
            assert killed.returncode == 0, killed.stderr
            result = await _rest(call)
            await _nothing_left(env)
    finally:
        await replay.stop()
    assert result.status == pb.EPISODE_STATUS_HARNESS_FAILED, result.error_message
    assert result.error_reason == "HARNESS_FAILED"
    assert "claude exited with status 137" in result.error_message
    # Graded on what the sandbox holds (nothing changed): a failed attempt, not infra.
    assert result.reward == -1.0


async def test_a_harness_that_never_exits_ends_harness_timeout_at_its_budget():
    task = bundled_tasks()[0]
    replay = ReplayPolicyServer({script_key(task.instance["problem_statement"]): [HANG]})
    url = await replay.start()
    budget_s = 60.0
    try:
        async with agent_stack() as env:
            began = time.monotonic()
            call, _ = await _run_until_requests(
                env, _start(task, url, "cc-hang", wall_s=budget_s), replay, 1
            )
            result = await _rest(call)
            elapsed = time.monotonic() - began
            await _nothing_left(env)
    finally:
        await replay.stop()
    assert result.status == pb.EPISODE_STATUS_HARNESS_TIMEOUT, result.error_message
    assert result.error_reason == ""  # the status says it all (agent.proto)
    assert result.reward == -1.0
    # Stopped at the budget, then graded: not held past it by the CLI's 10-minute Bash call.
    assert elapsed < budget_s + 90, elapsed


async def test_an_abort_during_the_run_stops_the_harness_at_once():
    task = bundled_tasks()[0]
    key = script_key(task.instance["problem_statement"])
    replay = ReplayPolicyServer({key: claude_code_script(task.gold_patch)}, abort_on_turn=1)
    url = await replay.start()
    try:
        async with agent_stack() as env:
            call, _ = await _run_until_requests(env, _start(task, url, "cc-abort"), replay, 2)
            began = time.monotonic()
            result = await _rest(call)
            elapsed = time.monotonic() - began
            await _nothing_left(env)
    finally:
        await replay.stop()
    assert result.status == pb.EPISODE_STATUS_ABORTED, result.error_message
    assert result.error_reason == "POLICY_ABORTED"
    assert not result.HasField("reward") and not result.HasField("report")
    assert elapsed < 30, elapsed


async def test_the_trainers_cancel_during_the_run_stops_the_harness_at_once():
    task = bundled_tasks()[0]
    replay = ReplayPolicyServer({script_key(task.instance["problem_statement"]): [HANG]})
    url = await replay.start()
    try:
        async with agent_stack() as env:
            call, _ = await _run_until_requests(env, _start(task, url, "cc-cancel"), replay, 1)
            await asyncio.sleep(2)  # its Bash call is running
            sent = time.monotonic()
            await call.write(
                pb.RunEpisodeRequest(cancel=pb.EpisodeCancel(reason="rollout aborted"))
            )
            result = await _rest(call)
            took = time.monotonic() - sent
            await _nothing_left(env)
    finally:
        await replay.stop()
    assert result.status == pb.EPISODE_STATUS_CANCELLED
    assert result.error_message == "rollout aborted" and not result.HasField("reward")
    assert took < 15.0, took


async def test_a_gateway_that_goes_away_ends_the_episode_infra_error_and_stops_the_cli():
    task = bundled_tasks()[0]
    replay = ReplayPolicyServer({script_key(task.instance["problem_statement"]): [HANG]})
    url = await replay.start()
    try:
        async with agent_stack() as env:
            call, _ = await _run_until_requests(env, _start(task, url, "cc-gone"), replay, 1)
            await asyncio.sleep(2)  # its Bash call is running
            gateway = env.agent.runner.gateway
            assert gateway is not None
            stopped = time.monotonic()
            await gateway.stop()
            result = await _rest(call)
            took = time.monotonic() - stopped
            await _nothing_left(env)
    finally:
        await replay.stop()
    assert result.status == pb.EPISODE_STATUS_INFRA_ERROR
    assert result.error_reason == "GATEWAY_GONE"
    assert not result.HasField("reward") and not result.HasField("report")
    assert took < 20.0, took
