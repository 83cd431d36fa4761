"""The `mini-swe-agent` harness on the real stack: real dockerd, pool, exec node and agent on
port 0, the real mini-swe-agent (PyPI 2.x) with its litellm model on the episode's gateway
session, and the replay policy server (SGLang's /generate, the real Qwen3 tokenizer) playing
the bundled tasks through mini-swe-agent's own `bash` tool. Every test asserts the episode's
status and reason, and that nothing is left (no container of the test's node, no active lease).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.request import urlopen

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

from swerl.agent.v1 import agent_pb2 as pb
from swerl.chassis.timeconv import duration_pb
from swerl.devservers.replay import (
    ReplayPolicyServer,
    _mini_bash,
    mini_swe_agent_script,
    script_key,
    scripts_for_tasks,
)
from swerl.exec.v1 import evaluate_pb2

pytestmark = pytest.mark.usefixtures("base_image")

HARNESS = "mini-swe-agent"


def _start(task, url: str, episode_id: str, *, wall_s: float = 300.0, command_s: float = 60.0):
    start = start_for(task, url, episode_id, command_timeout_s=command_s)
    start.options.harness = HARNESS
    start.limits.wall_timeout.CopyFrom(duration_pb(wall_s))
    return start


async def _until(predicate, timeout_s: float) -> None:
    for _ in range(int(timeout_s / 0.2)):
        if predicate():
            return
        await asyncio.sleep(0.2)
    raise AssertionError("timed out waiting")


def _replay(task, script: list[str], **options) -> ReplayPolicyServer:
    key = script_key(task.instance["problem_statement"])
    return ReplayPolicyServer({key: script}, keep_requests=True, **options)


@contextlib.asynccontextmanager
async def _episode_stack(replay: ReplayPolicyServer) -> AsyncIterator[tuple[Any, str]]:
    """The replay policy and a whole agent stack (pool, exec node, agent) around a test's
    episodes, as (env, policy url); on the way out, no lease is held and no container of the
    test's node is left."""
    url = await replay.start()
    try:
        async with agent_stack() as env:
            yield env, url
            await assert_no_active_lease(env)
            node = node_of(env)
    finally:
        await replay.stop()
    assert sandboxes_left(node) == []


async def test_mini_swe_agent_resolves_with_exact_token_samples(tmp_path):
    task = bundled_tasks()[1]
    replay = _replay(task, mini_swe_agent_script(task.gold_patch))
    async with _episode_stack(replay) as (env, url):
        start = _start(task, url, "mini-gold")
        start.options.artifact_dir = str(tmp_path)
        result = result_of(await run_to_result(env.stub, start))
    assert result.status == pb.EPISODE_STATUS_SUBMITTED, result.error_message
    assert result.report.status == evaluate_pb2.EVALUATION_STATUS_RESOLVED_FULL
    assert result.reward == 1.0
    # mini-swe-agent's submission (`cat patch.txt`) is the episode's patch.
    assert b"diff --git" in result.patch
    # Five policy calls, one chain: the sample is exactly what the policy was sent and what
    # it sampled, mask 1 on the sampled ids only (with the policy's logprobs).
    sent = replay.stats.requests_seen
    assert len(sent) == 5 and result.metrics["gateway_calls"] == 5.0
    assert result.metrics["turns"] == 5.0
    assert not result.chains
    record = result.trajectory
    check_record(record, replay)
    first_in, _ = sent[0]
    last_in, last_out = sent[-1]
    assert list(record.prompt_ids) == first_in
    assert list(record.prompt_ids) + list(record.response_ids) == last_in + last_out
    assert sum(record.loss_mask) == sum(len(out) for _, out in sent)
    for ids, out in sent:  # every call extends the chain: each prompt is a prefix of it
        whole = list(record.prompt_ids) + list(record.response_ids)
        assert whole[: len(ids) + len(out)] == ids + out
    assert record.reward == 1.0
    # mini-swe-agent's own trajectory is harness.log, beside swerl's traj.json.
    (directory,) = tmp_path.iterdir()
    log = json.loads((directory / "harness.log").read_text())
    assert log["info"]["exit_status"] == "Submitted"
    assert log["info"]["config"]["agent_type"] == "minisweagent.agents.default.DefaultAgent"
    assert [m["role"] for m in log["messages"][:3]] == ["system", "user", "assistant"]
    assert (directory / "traj.json").exists()
    # The episode's gateway session tree beside them, the shape a closed session's folder has:
    # five calls, one root extended four times.
    tree = json.loads((directory / "session.json").read_text())
    assert tree["session_id"] and tree["status"] == "SESSION_STATUS_CLOSED"
    assert [c["kind"] for c in tree["calls"]] == ["SESSION_CALL_KIND_ROOT"] + [
        "SESSION_CALL_KIND_EXTEND"
    ] * 4
    assert [c.get("parent_call_index") for c in tree["calls"]] == [None, 0, 1, 2, 3]
    # `swerl inspect` on the folder's run shows that tree on the episode's page.
    page = await asyncio.to_thread(_inspector_page, tmp_path, directory.name)
    assert '<div id="session-tree">' in page
    calls = re.findall(r'id="call-(\d+)" data-call="\d+" data-kind="(\w+)"', page)
    assert calls == [("0", "root")] + [(str(i), "extend") for i in range(1, 5)]


def _inspector_page(run_dir, key: str) -> str:
    """The episode's page as `swerl inspect RUN_DIR` serves it (a subprocess, as users run it)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "swerl.cli", "inspect", str(run_dir), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        url = ""
        for line in proc.stdout:
            match = re.search(r"(http://\S+?)/?\s", line)
            if match:
                url = match.group(1)
                break
        assert url, "swerl inspect printed no URL"
        with urlopen(f"{url}/episode/{key}", timeout=60) as response:
            return response.read().decode()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def test_mini_swe_agent_wrong_fix_is_graded_minus_one():
    task = bundled_tasks()[1]
    (script,) = scripts_for_tasks([task], "wrong", harness=HARNESS).values()
    replay = _replay(task, script)
    async with _episode_stack(replay) as (env, url):
        result = result_of(await run_to_result(env.stub, _start(task, url, "mini-wrong")))
    assert result.status == pb.EPISODE_STATUS_SUBMITTED, result.error_message
    assert result.report.status != evaluate_pb2.EVALUATION_STATUS_RESOLVED_FULL
    assert result.reward == -1.0


async def test_mini_swe_agent_on_garbage_fails_as_a_harness_not_infra():
    task = bundled_tasks()[1]
    replay = ReplayPolicyServer({}, garbage=True, keep_requests=True)
    async with _episode_stack(replay) as (env, url):
        result = result_of(await run_to_result(env.stub, _start(task, url, "mini-garbage")))
    # Random tokens hold no tool call: mini-swe-agent's format errors, three in a row.
    assert result.status == pb.EPISODE_STATUS_HARNESS_FAILED
    assert result.error_reason == "HARNESS_FAILED"
    assert "RepeatedFormatError" in result.error_message
    assert result.reward == -1.0
    assert len(replay.stats.requests_seen) == 3
    check_record(result.trajectory if not result.chains else result.chains[0], replay)


async def test_mini_swe_agent_killed_mid_run_is_harness_failed(monkeypatch):
    """The harness runs in the agent's process: it is killed by its run dying under it (an
    exception out of mini-swe-agent's step after the first action), not by a signal."""
    from minisweagent.agents.default import DefaultAgent

    task = bundled_tasks()[1]
    original = DefaultAgent.execute_actions

    def dies_after_one(self, message):
        if self.n_calls >= 2:
            raise RuntimeError("mini-swe-agent killed")
        return original(self, message)

    monkeypatch.setattr(DefaultAgent, "execute_actions", dies_after_one)
    replay = _replay(task, mini_swe_agent_script(task.gold_patch))
    async with _episode_stack(replay) as (env, url):
        result = result_of(await run_to_result(env.stub, _start(task, url, "mini-killed")))
    assert result.status == pb.EPISODE_STATUS_HARNESS_FAILED
    assert result.error_reason == "HARNESS_FAILED"
    assert result.error_message == "mini-swe-agent raised RuntimeError: mini-swe-agent killed"
    # Graded on what the sandbox holds: the fix was never applied.
    assert result.reward == -1.0
    assert len(replay.stats.requests_seen) == 2


async def test_mini_swe_agent_that_never_exits_is_stopped_at_its_budget():
    task = bundled_tasks()[1]
    script = [_mini_bash("Waiting.", "echo x >> README.md && sleep 600")]
    replay = _replay(task, script)
    async with _episode_stack(replay) as (env, url):
        began = time.monotonic()
        start = _start(task, url, "mini-hang", wall_s=20.0, command_s=900.0)
        result = result_of(await run_to_result(env.stub, start))
        elapsed = time.monotonic() - began
    assert result.status == pb.EPISODE_STATUS_HARNESS_TIMEOUT
    assert b"README.md" in result.patch and result.reward == -1.0
    # The budget (20 s) ends it, not the command's 600 s; grading follows at once.
    assert elapsed < 120, elapsed
    assert result.metrics["agent_run_time"] < 40, result.metrics["agent_run_time"]


async def test_a_gateway_that_goes_away_ends_a_mini_swe_agent_episode_infra_error():
    task = bundled_tasks()[1]
    script = [_mini_bash("Waiting.", "sleep 600")]
    replay = _replay(task, script)
    async with _episode_stack(replay) as (env, url):
        call = env.stub.RunEpisode(timeout=300)
        await call.write(pb.RunEpisodeRequest(start=_start(task, url, "mini-gone")))
        await _until(lambda: replay.stats.requests_seen, 180)  # its command is running
        await asyncio.sleep(1.0)
        gateway = env.agent.runner.gateway
        assert gateway is not None
        stopped = time.monotonic()
        await gateway.stop()
        result = result_of([message async for message in call])
        took = time.monotonic() - stopped
    assert result.status == pb.EPISODE_STATUS_INFRA_ERROR
    assert result.error_reason == "GATEWAY_GONE"
    assert "went away" in result.error_message
    assert not result.HasField("reward") and not result.HasField("report")
    assert took < 15.0, took


async def test_a_trainer_abort_during_a_mini_swe_agent_run_ends_it_aborted_at_once():
    task = bundled_tasks()[1]
    # The policy's third generation is aborted (the trainer's abort of in-flight requests).
    replay = _replay(task, mini_swe_agent_script(task.gold_patch), abort_on_turn=2)
    async with _episode_stack(replay) as (env, url):
        began = time.monotonic()
        result = result_of(await run_to_result(env.stub, _start(task, url, "mini-abort")))
        elapsed = time.monotonic() - began
    assert result.status == pb.EPISODE_STATUS_ABORTED
    assert result.error_reason == "POLICY_ABORTED"
    assert not result.HasField("report")
    assert len(replay.stats.requests_seen) == 3
    assert elapsed < 120, elapsed


async def test_a_trainer_cancel_during_a_mini_swe_agent_run_stops_it_at_once():
    task = bundled_tasks()[1]
    replay = _replay(task, [_mini_bash("Waiting.", "sleep 600")])
    async with _episode_stack(replay) as (env, url):
        call = env.stub.RunEpisode(timeout=300)
        await call.write(pb.RunEpisodeRequest(start=_start(task, url, "mini-cancel")))
        await _until(lambda: replay.stats.requests_seen, 180)  # its command is running
        await asyncio.sleep(1.0)
        sent = time.monotonic()
        cancel = pb.EpisodeCancel(reason="rollout aborted")
        await call.write(pb.RunEpisodeRequest(cancel=cancel))
        result = result_of([message async for message in call])
        took = time.monotonic() - sent
    assert result.status == pb.EPISODE_STATUS_CANCELLED
    assert result.error_message == "rollout aborted" and not result.HasField("reward")
    assert took < 5.0, took


async def test_mini_swe_agent_over_its_context_budget_ends_limit_context():
    task = bundled_tasks()[1]
    replay = _replay(task, mini_swe_agent_script(task.gold_patch))
    async with _episode_stack(replay) as (env, url):
        # A first run measures the calls; the budget then fits the second call and its
        # reply but not the third call's prompt.
        probe = result_of(await run_to_result(env.stub, _start(task, url, "mini-probe")))
        assert probe.status == pb.EPISODE_STATUS_SUBMITTED
        (_, _), (second_in, second_out), (third_in, _) = replay.stats.requests_seen[:3]
        budget = len(second_in) + len(second_out) + 1
        assert budget <= len(third_in)
        replay.stats.requests_seen.clear()
        start = _start(task, url, "mini-context")
        start.limits.max_context_tokens = budget
        result = result_of(await run_to_result(env.stub, start))
    # The session refused the third call over the budget (context_length_exceeded, which
    # mini-swe-agent does not retry); its run failed on it: LIMIT_CONTEXT, graded.
    assert result.status == pb.EPISODE_STATUS_LIMIT_CONTEXT, result.error_message
    assert "ContextWindowExceededError" in result.error_message
    assert result.metrics["gateway_context_errors"] == 1.0
    assert len(replay.stats.requests_seen) == 2
    assert result.report.status == evaluate_pb2.EVALUATION_STATUS_RESOLVED_FULL  # fix applied
