"""swerl.agent.client against a real agent (loopback pool, exec node, replay policy): one
episode followed message by message, a cancel, a branching stream, and a bad start."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import grpc
import pytest
from testkit.agent import agent_stack, bundled_tasks, check_record, start_for

from swerl.agent.client import (
    episode_limits,
    episode_start,
    expected_results,
    open_episode,
    run_episode,
)
from swerl.agent.v1 import agent_pb2 as pb
from swerl.chassis.client import error_info
from swerl.devservers.replay import ReplayPolicyServer, gold_script, script_key, submit_turn


def _bash(command: str) -> str:
    return f"Running it.\n\n```bash\n{command}\n```"


def test_zero_limits_are_left_unset_for_the_agents_defaults():
    limits = episode_limits(max_turns=5, command_timeout_s=2.5)
    assert limits.max_turns == 5 and limits.max_new_tokens == 0
    assert (limits.command_timeout.seconds, limits.command_timeout.nanos) == (2, 500_000_000)
    assert not limits.HasField("wall_timeout") and not limits.HasField("eval_timeout")
    assert episode_limits() == pb.EpisodeLimits()


def test_a_start_carries_its_sampling_params_and_counts_its_results():
    task = bundled_tasks()[0]
    plain = start_for(task, "http://p:1", "ep-1")
    start = episode_start(
        episode_id="ep-2",
        instance=plain.instance,
        policy=pb.PolicyConfig(endpoint="http://p:1", model="m"),
        limits=episode_limits(max_turns=3),
        options=pb.EpisodeOptions(owner="me"),
        sampling_params={"temperature": 0.5, "top_k": 20},
    )
    assert start.policy.sampling_params["temperature"] == 0.5
    assert start.policy.sampling_params["top_k"] == 20
    assert (start.policy.model, start.options.owner, start.limits.max_turns) == ("m", "me", 3)
    assert expected_results(start) == 1
    start.options.branch.at_turn, start.options.branch.count = 1, 4
    assert expected_results(start) == 4


def test_the_trainer_plugin_imports_only_the_agents_contract_and_client():
    code = (
        "import sys, swerl.trainer_plugin, swerl.trainer_plugin.hooks,"
        " swerl.trainer_plugin.episode;"
        "print(sorted(m for m in sys.modules if m.startswith('swerl.agent')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = eval(out.stdout)  # a printed list of module names
    assert "swerl.agent.client" in loaded
    # swerl.agent.budget is the deadline arithmetic a caller shares with the agent (which
    # deadline outlasts the agent's own budget): pure, importing nothing of the service.
    public = ("swerl.agent", "swerl.agent.client", "swerl.agent.budget")
    inside = [m for m in loaded if m not in public]
    assert all(m.startswith("swerl.agent.v1") for m in inside), inside


def test_the_budget_module_a_client_shares_imports_nothing_of_swerl():
    # At import time budget loads only the standard library; client_deadline reads the agent's
    # configs, and imports them when it is called (the trainer plugin stays light until then).
    import ast
    import inspect

    from swerl.agent import budget

    tree = ast.parse(inspect.getsource(budget))
    top_level = [
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in tree.body
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    ]
    assert top_level == ["__future__", "dataclasses"], top_level
    code = (
        "import sys, swerl.agent.budget;"
        "print(sorted(m for m in sys.modules if m.startswith('swerl')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert eval(out.stdout) == ["swerl", "swerl.agent", "swerl.agent.budget"], out.stdout


@pytest.mark.usefixtures("base_image")
async def test_the_client_follows_cancels_and_completes_episodes_on_a_real_agent():
    gold, slow, forked = bundled_tasks()[:3]
    scripts = {
        script_key(gold.instance["problem_statement"]): gold_script(gold.gold_patch),
        script_key(slow.instance["problem_statement"]): [_bash("sleep 60"), submit_turn()],
        script_key(forked.instance["problem_statement"]): [
            _bash("ls"),
            _bash("git status --short"),
            submit_turn(),
        ],
    }
    replay = ReplayPolicyServer(scripts)
    url = await replay.start()
    try:
        async with agent_stack() as env:
            # Followed message by message: started, turns, evaluation, then the result.
            async with await open_episode(
                env.stub, start_for(gold, url, "client-gold"), timeout=600
            ) as episode:
                kinds = [m.WhichOneof("kind") async for m in episode.messages()]
            assert kinds[0] == "started" and kinds[-1] == "result"
            assert kinds.count("turn") == len(episode.turns) >= 2
            assert episode.started is not None and episode.started.lease_id
            assert episode.result is not None and episode.results == [episode.result]
            assert episode.result.status == pb.EPISODE_STATUS_SUBMITTED
            assert episode.result.reward == 1.0
            check_record(episode.result.trajectory, replay)

            # A cancel during a long command: the agent ends it CANCELLED, with its result.
            episode = await open_episode(env.stub, start_for(slow, url, "client-cancel"))
            async for message in episode.messages():
                if message.WhichOneof("kind") == "started":
                    await asyncio.sleep(1.0)  # the policy's `sleep 60` is running
                    await episode.cancel("client test stop")
            assert episode.result is not None, episode.results
            assert episode.result.status == pb.EPISODE_STATUS_CANCELLED
            assert episode.result.error_message == "client test stop"
            assert not episode.turns  # the command never finished

            # Branching: the stream is complete after the last of the branches' results.
            start = start_for(forked, url, "client-branch")
            start.options.skip_evaluation = True
            start.options.branch.at_turn, start.options.branch.count = 1, 2
            results = await run_episode(env.stub, start, timeout=600)
            assert sorted(r.branch for r in results) == [0, 1]
            assert all(r.status == pb.EPISODE_STATUS_SUBMITTED for r in results), results

            # A bad start: the call's status and the agent's reason, as the server sent them.
            bad = start_for(gold, url, "client-bad")
            bad.limits.max_turns = -1
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await run_episode(env.stub, bad, timeout=60)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert error_info(caught.value)[0] == "INVALID_EPISODE_START"
    finally:
        await replay.stop()
